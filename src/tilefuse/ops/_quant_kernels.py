"""Triton kernels for weight-only quantized linear layers: ``y = x @ dequant(W).T (+ bias)``.

Weight formats (see ``tilefuse.ops.quant`` for the quantizer and the exact layout):

* int8, symmetric, per output channel: ``W[n, k] = q[n, k] * s[n]``, ``q`` int8 in [-127, 127].
  The scale is constant along K, so it is applied once to the finished dot product.
* int4, asymmetric, group-wise along K: ``W[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with
  ``g = k // GROUP_SIZE``, ``q`` and ``z`` in [0, 15]. Two values per byte, along K:
  byte ``[n, j]`` holds ``k = 2j`` in its low nibble and ``k = 2j + 1`` in its high nibble.
  Every K tile lies inside one group (``GROUP_SIZE % BLOCK_K == 0``), so the tile's dot product
  is taken on the exact small integers ``q - z`` (exact in fp16/bf16) and scaled by ``s[n, g]``
  once per tile, in fp32.

Neither kernel materializes the fp weight: tiles are dequantized in registers.

* :func:`quant_gemm_kernel`  -- tensor-core tiles for M >= 9 (prefill, batches).
* :func:`quant_gemv_kernel`  -- decode, M = 1..8: split-K over a (N blocks, K splits) grid, fp32
  partials ``[splits, M, N]``; :func:`splitk_reduce_kernel` sums them in split order (no atomics:
  the result is deterministic) and adds the bias.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import fast_launch


@triton.jit
def _int_weight_tile(qw_ptr, offs_n, offs_k, N, K, stride_qn, BITS: tl.constexpr):
    """[BLOCK_N, BLOCK_K] int32 tile of the stored integers (unsigned nibbles for int4, signed
    int8); 0 outside [N, K]. int4: the byte ``k // 2`` is read by both nibbles' lanes (one
    sector, so no extra DRAM traffic) and shifted by ``4 * (k % 2)``."""
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None] * stride_qn
    if BITS == 4:
        packed = tl.load(qw_ptr + rows + (offs_k // 2)[None, :], mask=mask, other=0).to(tl.int32)
        return (packed >> ((offs_k % 2) * 4)[None, :]) & 0xF
    else:
        return tl.load(qw_ptr + rows + offs_k[None, :], mask=mask, other=0).to(tl.int32)


@fast_launch
@triton.jit
def quant_gemm_kernel(
    x_ptr,              # *x [M, K], unit K stride, fp32/fp16/bf16
    qw_ptr,             # *packed weight: int8 [N, K] or uint8 [N, K/2] (int4, two per byte)
    scales_ptr,         # *scales: [N] (int8) or [N, K/GROUP_SIZE] (int4), x's dtype
    zeros_ptr,          # *zero points uint8 [N, K/GROUP_SIZE] (int4; unused for int8)
    bias_ptr,           # *bias [N] (read only when HAS_BIAS)
    y_ptr,              # *y [M, N], contiguous, x's dtype
    M,                  # rows of x
    N,                  # output features
    K,                  # input features
    stride_xm,          # elements between rows of x
    stride_qn,          # bytes between rows of the packed weight
    stride_sn,          # elements between rows of scales / zeros (K / GROUP_SIZE for int4)
    stride_ym,          # elements between rows of y
    BITS: tl.constexpr,           # 8 or 4
    GROUP_SIZE: tl.constexpr,     # int4 group along K (multiple of BLOCK_K); 0 for int8
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 x (no tf32), None for fp16/bf16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,        # row blocks per tile group (L2 reuse of weight tiles)
):
    pid = tl.program_id(0)
    n_blocks_m = tl.cdiv(M, BLOCK_M)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks walk the same weight column blocks back to back
    width = GROUP_M * n_blocks_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(n_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)
        q = _int_weight_tile(qw_ptr, offs_n, offs_k, N, K, stride_qn, BITS)      # [BN, BK]
        if BITS == 4:
            group = k0 // GROUP_SIZE
            sz_offs = offs_n.to(tl.int64) * stride_sn + group
            z = tl.load(zeros_ptr + sz_offs, mask=n_mask, other=0).to(tl.int32)
            s = tl.load(scales_ptr + sz_offs, mask=n_mask, other=0.0).to(tl.float32)
            w = tl.trans((q - z[:, None]).to(x.dtype))                          # [BK, BN], exact
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s[None, :]
        else:
            w = tl.trans(q.to(x.dtype))
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if BITS == 8:
        acc = acc * tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


@fast_launch
@triton.jit
def quant_gemv_kernel(
    x_ptr,              # *x [M, K], unit K stride, M <= M_PAD
    qw_ptr,             # *packed weight, as quant_gemm_kernel
    scales_ptr,         # *scales, as quant_gemm_kernel
    zeros_ptr,          # *zero points (int4)
    partial_ptr,        # *fp32 partial sums [n_splits, M, N], contiguous
    M,                  # rows of x (1..8)
    N,                  # output features
    K,                  # input features
    stride_xm,          # elements between rows of x
    stride_qn,          # bytes between rows of the packed weight
    stride_sn,          # elements between rows of scales / zeros
    chunks_per_split,   # BLOCK_K chunks of K per program along grid axis 1
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,     # multiple of BLOCK_K (int4); 0 for int8
    M_PAD: tl.constexpr,          # next power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, M_PAD)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for c in range(chunks_per_split):
        k0 = (pid_s * chunks_per_split + c) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        q = _int_weight_tile(qw_ptr, offs_n, offs_k, N, K, stride_qn, BITS)      # [BN, BK]
        if BITS == 4:
            sz_offs = offs_n.to(tl.int64) * stride_sn + k0 // GROUP_SIZE
            sz_mask = n_mask & (k0 < K)        # the last split may run past K
            z = tl.load(zeros_ptr + sz_offs, mask=sz_mask, other=0).to(tl.int32)
            s = tl.load(scales_ptr + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)
            w = (q - z[:, None]).to(tl.float32)
        else:
            w = q.to(tl.float32)
        for m in tl.static_range(M_PAD):
            xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask & (m < M), other=0.0).to(tl.float32)
            dot_m = tl.sum(w * xm[None, :], axis=1)                               # [BN]
            if BITS == 4:
                dot_m = dot_m * s
            acc += tl.where(rows[:, None] == m, dot_m[None, :], 0.0)
    if BITS == 8:
        acc = acc * tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    p_offs = (pid_s * M + rows).to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(partial_ptr + p_offs, acc, mask=(rows < M)[:, None] & n_mask[None, :])


@fast_launch
@triton.jit
def splitk_reduce_kernel(
    partial_ptr,        # *fp32 partial sums [n_splits, M, N]
    bias_ptr,           # *bias [N] (read only when HAS_BIAS)
    y_ptr,              # *y [M, N], x's dtype
    M,                  # rows
    N,                  # output features
    n_splits,           # partials per output element, summed in order (deterministic)
    stride_ym,          # elements between rows of y
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in range(n_splits):
        acc += tl.load(partial_ptr + (split * M + pid_m).to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
