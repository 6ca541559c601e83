"""Small Triton helpers shared by the row-wise kernels (softmax, norms, ...)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)     # ln(2):   log(x) = log2(x) * LN2


@triton.jit
def row_tile_mask_offsets(rows, cols, n_rows, n_cols, row_stride):
    """Mask and int64 element offsets of a [BLOCK_M, BLOCK_N] tile of a row-major matrix.

    Offsets are 64-bit because rows * row_stride passes 2**31 on large activations.
    """
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return mask, offs
