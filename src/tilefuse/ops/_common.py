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


# Per-thread online softmax statistics for rows walked in tiles (cross_entropy's and softmax's
# looped tiers). A tile of BLOCK values is viewed as [BLOCK / VEC, VEC] with VEC = one 16-byte load,
# so each row of the view is one thread's (Triton's layout for a vectorized 1-D load, reshaped):
# the reductions over axis 1 stay in registers, and no warp waits on another inside the loop.
# Merging the threads' (m, s) once after the walk replaces a cross-warp max per tile (H200: the
# cross-entropy rows kernel went from 69 to 90 % of copy, session 32).


@triton.jit
def lane_view(x, VEC: tl.constexpr):
    """[BLOCK] -> [BLOCK / VEC, VEC], one thread's VEC consecutive values per row."""
    return tl.reshape(x, [x.shape[0] // VEC, VEC])


@triton.jit
def lane_max_sum_step(m, s, x2, c2, skip_col, SKIP: tl.constexpr):
    """One tile of the per-thread online max and exp-sum: (m, s) per row of x2 [LANES, VEC] fp32
    after adding exp(x - m), leaving out the entry whose column c2 is ``skip_col`` when SKIP (the
    compare is made here, late, so that its predicates are not live across the exps). An all -inf
    prefix keeps m = -inf, s = 0 (never NaN). One extra exp2 per VEC values rescales s."""
    m_new = tl.maximum(m, tl.max(x2, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    e = tl.exp2((x2 - m_safe[:, None]) * LOG2E)
    s = s * tl.exp2((m - m_safe) * LOG2E)
    if SKIP:   # after the rescale: that order compiles to 60 registers at 32K x 32 warps, the other 64
        e = tl.where(c2 == skip_col, 0.0, e)
    return m_new, s + tl.sum(e, axis=1)


@triton.jit
def lane_max_sum_merge(m, s):
    """The row's (max, sum of exp(x - max)) from the threads' (m, s); (-inf, 0) for an all -inf row."""
    m_row = tl.max(m, axis=0)
    m_row_safe = tl.where(m_row == -float("inf"), 0.0, m_row)
    return m_row, tl.sum(s * tl.exp2((m - m_row_safe) * LOG2E), axis=0)
