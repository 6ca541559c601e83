"""Small Triton helpers shared by the row-wise kernels (softmax, norms, ...)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)     # ln(2):   log(x) = log2(x) * LN2

# Triton decides when a kernel is decorated whether it runs under the interpreter; so does this.
# rcp_approx below is PTX, which the interpreter cannot run: there it falls back to a division
# (same values to within its stated error).
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def rcp_approx(x):
    """1/x of an fp32 tile as one MUFU.RCP (``rcp.approx.ftz.f32``: <= 1 ulp; 1/inf = 0). fp32
    division in Triton is ``div.full.f32``: range tests and scalings around the same MUFU.RCP."""
    if INTERPRETING:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def sigmoid_approx(x):
    """σ(x) = 1/(1 + 2**(−x·log2 e)) in two MUFU ops (~3 ulp); exact 0 and 1 in the tails."""
    return rcp_approx(1.0 + tl.exp2(x * (-LOG2E)))


@triton.jit
def row_tile_mask_offsets(rows, cols, n_rows, n_cols, row_stride):
    """Mask and int64 element offsets of a [BLOCK_M, BLOCK_N] tile of a row-major matrix.

    Offsets are 64-bit because rows * row_stride passes 2**31 on large activations.
    """
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return mask, offs
