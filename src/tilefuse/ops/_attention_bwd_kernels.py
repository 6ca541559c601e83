"""Triton kernels of the attention backward (the math, the launch plan and the launcher:
ops/_attention_bwd.py): the preprocess kernel (delta, lse in log2 units), the dk/dv kernel and the
dq kernel, with their per-block bodies and loops."""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import fast_launch, unit_value_fallback
from ._attention_common import apply_softcap, key_range, query_range, scheduled_block, visible

LOG2E = tl.constexpr(1.4426950408889634)   # exp(x) = exp2(x · log2(e))


# ----------------------------------------------------------------------------------------------
# helpers (device)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sequence(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, stat_seq, IS_VARLEN: tl.constexpr):
    """(first row of sequence ``b`` in the packed tensors (0 when dense), its first key row, its
    query and key lengths, its first column in the ``[H_q, columns]`` statistics buffers: b·stat_seq
    when dense, its first packed row when varlen)."""
    if IS_VARLEN:
        q_row0 = tl.load(cu_seqlens_q + b)
        k_row0 = tl.load(cu_seqlens_k + b)
        seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_row0
        seqlen_k = tl.load(cu_seqlens_k + b + 1) - k_row0
        stat_row0 = q_row0
    else:
        q_row0 = 0
        k_row0 = 0
        stat_row0 = b * stat_seq
    return q_row0, k_row0, seqlen_q, seqlen_k, stat_row0


@triton.jit
def _tile_ptrs_mask(base, n_rows, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr):
    """Pointers and mask of a [BLOCK, D_PAD] tile whose row 0 is at ``base`` (int64-offset);
    rows past ``n_rows`` and columns past HEAD_DIM are masked."""
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, D_PAD)
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    if HEAD_DIM == D_PAD:
        mask = (rows < n_rows)[:, None]
    else:
        mask = (rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :]
    return ptrs, mask


@triton.jit
def _load_tile(base, n_rows, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    ptrs, mask = _tile_ptrs_mask(base, n_rows, row_stride, BLOCK, HEAD_DIM, D_PAD)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_tile(base, value, n_rows, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr):
    ptrs, mask = _tile_ptrs_mask(base, n_rows, row_stride, BLOCK, HEAD_DIM, D_PAD)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _row_source(base, seqlen, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, USE_TMA: tl.constexpr):
    """What the inner loops read [BLOCK, D_PAD] tiles of a [seqlen, HEAD_DIM] (b, h) slice from:
    a TMA descriptor (out-of-range rows and columns come back as zeros), or its base pointer."""
    if USE_TMA:   # one return statement: Triton rejects returns of different types
        src = tl.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[row_stride, 1],
                                        block_shape=[BLOCK, D_PAD])
    else:
        src = base
    return src


@triton.jit
def _load_rows(src, start, seqlen, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows start .. start + BLOCK - 1 of a _row_source, zeros past ``seqlen`` / HEAD_DIM."""
    if USE_TMA:
        tile = src.load([start, 0])
    else:
        tile = _load_tile(src + start.to(tl.int64) * row_stride, seqlen - start, row_stride, BLOCK,
                          HEAD_DIM, D_PAD)
    return tile


@triton.jit
def _blocks_below(x, BLOCK: tl.constexpr):
    """Number of blocks k >= 0 with k·BLOCK < x (0 for x <= 0)."""
    return tl.cdiv(tl.maximum(x, 0), BLOCK)


@triton.jit
def free_query_blocks(start_n, lo, n_blocks, shift, window_left, window_right, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[first_free, end_free) of the query blocks lo + i·BLOCK_M, i < n_blocks, that every key
    start_n .. start_n + BLOCK_N - 1 may see (no mask needed): m0 >= start_n + BLOCK_N - 1 -
    shift - right (every key within right) and m0 + BLOCK_M - 1 <= start_n - shift + left (every
    key within left). Shared by the tl and Gluon dk/dv kernels."""
    first_free = 0
    end_free = n_blocks
    if HAS_RIGHT:
        first_free = tl.minimum(_blocks_below(start_n + BLOCK_N - 1 - shift - window_right - lo, BLOCK_M), n_blocks)
    if HAS_LEFT:
        end_free = _blocks_below(start_n - shift + window_left - BLOCK_M + 2 - lo, BLOCK_M)
        end_free = tl.maximum(tl.minimum(end_free, n_blocks), first_free)
    return first_free, end_free


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def attention_bwd_preprocess_kernel(
    out_ptr,            # *out [.., S_q, H_q, D] (dense) or [total_q, H_q, D] (varlen)
    do_ptr,             # *grad of out, same shape
    lse_ptr,            # *lse, float32, natural log: [B, H_q, S_q] or [H_q, total_q]
    delta_ptr,          # *delta [H_q, rows] fp32 out: rowsum(out · do)
    lse2_ptr,           # *lse·log2(e) [H_q, rows] fp32 out, -inf replaced by +inf
    cu_seqlens_q,       # *int32 [B + 1] (varlen) or unused
    stride_ob, stride_os, stride_oh,       # out strides (batch 0 when varlen)
    stride_dob, stride_dos, stride_doh,    # do strides
    stride_lb, stride_lh, stride_ls,       # lse strides (batch 0 when varlen)
    seqlen_q,           # S_q (dense)
    stat_stride,        # head stride of delta / lse2 (>= B·stat_seq or total_q columns)
    stat_seq,           # columns per sequence (dense): S_q rounded up to 16 bytes
    HEAD_DIM: tl.constexpr,   # D
    D_PAD: tl.constexpr,      # D rounded up to a power of two (>= 16)
    BLOCK_M: tl.constexpr,    # query rows per program
    IS_VARLEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q_row0, _, seqlen_q, _, stat_row0 = _sequence(b, cu_seqlens_q, cu_seqlens_q, seqlen_q, seqlen_q, stat_seq,
                                                  IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    row = (q_row0 + start_m).to(tl.int64)
    n_rows = seqlen_q - start_m
    o = _load_tile(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + row * stride_os,
                   n_rows, stride_os, BLOCK_M, HEAD_DIM, D_PAD)
    do = _load_tile(do_ptr + b.to(tl.int64) * stride_dob + h * stride_doh + row * stride_dos,
                    n_rows, stride_dos, BLOCK_M, HEAD_DIM, D_PAD)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs = tl.arange(0, BLOCK_M)
    in_seq = offs < n_rows
    lse = tl.load(lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + (row + offs) * stride_ls,
                  mask=in_seq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    stat = h * stat_stride + stat_row0 + start_m + offs
    tl.store(delta_ptr + stat, delta, mask=in_seq)
    tl.store(lse2_ptr + stat, lse2, mask=in_seq)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, start_m, offs_n, mask_block,
                seqlen_q, shift, window_left, window_right, scale, softcap, lse2_ptr, delta_ptr,
                MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                USE_TMA: tl.constexpr, DV_LATE: tl.constexpr):
    """dk, dv [BLOCK_N, D_PAD] += the share of queries start_m .. start_m + BLOCK_M - 1; scores
    transposed ([keys, queries]) so both products land in the key-major accumulators. MASKED
    compiles visible() in; ``mask_block`` (uniform) says whether this block applies it: a runtime
    flag in the single loop, the constant True in the split masked loop (folded away).
    DV_LATE: dv's GEMM issued after dpᵀ's, so that it runs while dsᵀ is formed (Triton 3.6 waits
    for a non-accumulating GEMM right away, and with it for every GEMM issued before it)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(q_src, start_m, seqlen_q, stride_qs, BLOCK_M, HEAD_DIM, D_PAD, USE_TMA)
    do = _load_rows(do_src, start_m, seqlen_q, stride_dos, BLOCK_M, HEAD_DIM, D_PAD, USE_TMA)
    in_seq = offs_m < seqlen_q
    lse2 = tl.load(lse2_ptr + stat_base + offs_m, mask=in_seq, other=float("inf"))
    delta = tl.load(delta_ptr + stat_base + offs_m, mask=in_seq, other=0.0)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)                     # [N, M]
    if HAS_SOFTCAP:
        s_t, dcap_t = apply_softcap(qk_t * scale, softcap, HAS_SOFTCAP)
        p_t = tl.exp2(s_t * LOG2E - lse2[None, :])
    else:
        p_t = tl.exp2(qk_t * (scale * LOG2E) - lse2[None, :])
    if MASKED:
        if mask_block:
            # visible() of the transposed tile: swap the roles of queries and keys, which
            # mirrors d = j - i - shift to -d, i.e. shift -> -shift and left <-> right
            p_t = tl.where(visible(offs_n, offs_m, seqlen_q, -shift, window_right, window_left,
                                   HAS_RIGHT, HAS_LEFT), p_t, 0.0)
    if not DV_LATE:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if DV_LATE:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * dcap_t
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_loop(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, first_m, n_blocks,
               first_free, end_free, start_n, seqlen_q, shift, window_left, window_right, scale,
               softcap, lse2_ptr, delta_ptr,
               MASK: tl.constexpr, SPLIT_LOOPS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DV_LATE: tl.constexpr):
    """Accumulate dk, dv over ``n_blocks`` query blocks from ``first_m``. With MASK (a window),
    blocks outside [first_free, end_free) apply visible(): in one loop through a uniform branch,
    or with SPLIT_LOOPS the mask-free run first, in a loop with no mask code, then the edge
    blocks in a masked loop (not compiled at all without a window); which is faster depends on
    D (_attention_bwd.split_loops_default)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    walk_lo, walk_hi = (first_free, end_free) if SPLIT_LOOPS else (0, n_blocks)   # the (mask-free) first loop
    for i in range(walk_lo, walk_hi):
        dk, dv = _dkdv_block(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, first_m + i * BLOCK_M,
                             offs_n, (i < first_free) | (i >= end_free), seqlen_q, shift, window_left,
                             window_right, scale, softcap, lse2_ptr, delta_ptr, MASK and not SPLIT_LOOPS,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_M, HEAD_DIM, D_PAD, DOT_PRECISION, USE_TMA,
                             DV_LATE and not (MASK and not SPLIT_LOOPS))   # mask-free loops only: with mask
                                                                           # code it lost (H200, causal)
    if SPLIT_LOOPS and MASK:
        for j in range(first_free + n_blocks - end_free):
            i = tl.where(j < first_free, j, j + (end_free - first_free))   # left edge, then right edge
            dk, dv = _dkdv_block(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos,
                                 first_m + i * BLOCK_M, offs_n, True, seqlen_q, shift, window_left, window_right,
                                 scale, softcap, lse2_ptr, delta_ptr, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                 BLOCK_M, HEAD_DIM, D_PAD, DOT_PRECISION, USE_TMA, False)
    return dk, dv


# specialized on S_q / S_k but where one of them is 1 (see UnitValueFallback)
@unit_value_fallback("seqlen_q", "seqlen_k")
def attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,             # *inputs (dense [B, S, H, D] or packed [total, H, D])
    dk_ptr, dv_ptr,                          # *outputs, k's shape
    lse2_ptr, delta_ptr,                     # *[H_q, rows] fp32 from the preprocess kernel
    cu_seqlens_q, cu_seqlens_k,              # *int32 [B + 1] (varlen) or unused
    stride_qb, stride_qs, stride_qh,         # q strides (batch 0 when varlen)
    stride_kb, stride_ks, stride_kh,         # k strides
    stride_vb, stride_vs, stride_vh,         # v strides
    stride_dob, stride_dos, stride_doh,      # do strides
    stride_dkb, stride_dks, stride_dkh,      # dk strides
    stride_dvb, stride_dvs, stride_dvh,      # dv strides
    seqlen_q, seqlen_k,                      # S_q, S_k (dense)
    stat_stride,                             # head stride of lse2 / delta
    stat_seq,                                # columns per sequence (dense)
    n_heads_kv,                              # H_kv
    group,                                   # H_q // H_kv: query heads per kv head
    scale,                                   # softmax scale
    softcap,                                 # logit cap (HAS_SOFTCAP)
    window_left, window_right,               # mask bounds (HAS_LEFT / HAS_RIGHT)
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,                   # query rows per inner step
    BLOCK_N: tl.constexpr,                   # keys per program (dk/dv rows kept in registers)
    DOT_PRECISION: tl.constexpr,             # "ieee" for fp32 inputs (no tf32)
    USE_TMA: tl.constexpr,                   # inner-loop tiles through TMA descriptors
    SPLIT_LOOPS: tl.constexpr,               # mask-free and masked blocks in separate loops
    DV_LATE: tl.constexpr,                   # dv's GEMM after dpᵀ's in the mask-free loop (_dkdv_block)
):
    pid_n, pid_bh = scheduled_block(False)     # a schedule_grid grid over (key blocks, B·H_kv)
    b = pid_bh // n_heads_kv
    h_kv = pid_bh % n_heads_kv
    q_row0, k_row0, seqlen_q, seqlen_k, stat_row0 = _sequence(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, stat_seq, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:
        return
    b64 = b.to(tl.int64)
    k_row = (k_row0 + start_n).to(tl.int64)
    n_keys = seqlen_k - start_n
    k = _load_tile(k_ptr + b64 * stride_kb + h_kv.to(tl.int64) * stride_kh + k_row * stride_ks,
                   n_keys, stride_ks, BLOCK_N, HEAD_DIM, D_PAD)
    v = _load_tile(v_ptr + b64 * stride_vb + h_kv.to(tl.int64) * stride_vh + k_row * stride_vs,
                   n_keys, stride_vs, BLOCK_N, HEAD_DIM, D_PAD)
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    shift = seqlen_k - seqlen_q
    lo, hi = query_range(start_n, BLOCK_N, seqlen_q, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    n_blocks = tl.cdiv(hi - lo, BLOCK_M)
    first_free, end_free = free_query_blocks(start_n, lo, n_blocks, shift, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for g in range(group):
        h = (h_kv * group + g).to(tl.int64)
        q_src = _row_source(q_ptr + b64 * stride_qb + h * stride_qh + q_row0.to(tl.int64) * stride_qs,
                            seqlen_q, stride_qs, BLOCK_M, HEAD_DIM, D_PAD, USE_TMA)
        do_src = _row_source(do_ptr + b64 * stride_dob + h * stride_doh + q_row0.to(tl.int64) * stride_dos,
                             seqlen_q, stride_dos, BLOCK_M, HEAD_DIM, D_PAD, USE_TMA)
        stat_base = h * stat_stride + stat_row0
        dk, dv = _dkdv_loop(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, lo, n_blocks,
                            first_free, end_free, start_n, seqlen_q, shift, window_left, window_right,
                            scale, softcap, lse2_ptr, delta_ptr, HAS_LEFT or HAS_RIGHT, SPLIT_LOOPS,
                            HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_M, BLOCK_N, HEAD_DIM, D_PAD,
                            DOT_PRECISION, USE_TMA, DV_LATE)
    _store_tile(dk_ptr + b64 * stride_dkb + h_kv.to(tl.int64) * stride_dkh + k_row * stride_dks,
                dk * scale, n_keys, stride_dks, BLOCK_N, HEAD_DIM, D_PAD)
    _store_tile(dv_ptr + b64 * stride_dvb + h_kv.to(tl.int64) * stride_dvh + k_row * stride_dvs,
                dv, n_keys, stride_dvs, BLOCK_N, HEAD_DIM, D_PAD)


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n, mask_block, offs_m,
              seqlen_k, shift, window_left, window_right, scale, softcap,
              MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
              USE_TMA: tl.constexpr):
    """dq [BLOCK_M, D_PAD] (unscaled) += the share of keys start_n .. start_n + BLOCK_N - 1;
    MASKED / ``mask_block`` as in _dkdv_block."""
    k = _load_rows(k_src, start_n, seqlen_k, stride_ks, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA)
    v = _load_rows(v_src, start_n, seqlen_k, stride_vs, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                       # [M, N]
    if HAS_SOFTCAP:
        s, dcap = apply_softcap(qk * scale, softcap, HAS_SOFTCAP)
        p = tl.exp2(s * LOG2E - lse2[:, None])
    else:
        p = tl.exp2(qk * (scale * LOG2E) - lse2[:, None])
    if MASKED:
        if mask_block:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            p = tl.where(visible(offs_m, offs_n, seqlen_k, shift, window_left, window_right,
                                 HAS_LEFT, HAS_RIGHT), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * dcap
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, first_n, n_blocks,
             first_free, end_free, offs_m, seqlen_k, shift, window_left, window_right, scale, softcap,
             SPLIT_LOOPS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
             USE_TMA: tl.constexpr):
    """Accumulate dq over ``n_blocks`` key blocks from ``first_n``; blocks outside [first_free,
    end_free) apply visible() (always compiled in: the last key block may be partial), in one
    loop or, with SPLIT_LOOPS, the mask-free run then the edge blocks (as _dkdv_loop)."""
    walk_lo, walk_hi = (first_free, end_free) if SPLIT_LOOPS else (0, n_blocks)   # the (mask-free) first loop
    for i in range(walk_lo, walk_hi):
        dq = _dq_block(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, first_n + i * BLOCK_N,
                       (i < first_free) | (i >= end_free), offs_m, seqlen_k, shift, window_left, window_right,
                       scale, softcap, not SPLIT_LOOPS, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N, HEAD_DIM,
                       D_PAD, DOT_PRECISION, USE_TMA)
    if SPLIT_LOOPS:
        for j in range(first_free + n_blocks - end_free):
            i = tl.where(j < first_free, j, j + (end_free - first_free))   # left edge, then right edge
            dq = _dq_block(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, first_n + i * BLOCK_N,
                           True, offs_m, seqlen_k, shift, window_left, window_right, scale, softcap, True,
                           HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION, USE_TMA)
    return dq


# specialized on S_q / S_k but where one of them is 1 (see UnitValueFallback)
@unit_value_fallback("seqlen_q", "seqlen_k")
def attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,             # *inputs (dense [B, S, H, D] or packed [total, H, D])
    dq_ptr,                                  # *output, q's shape
    lse2_ptr, delta_ptr,                     # *[H_q, rows] fp32 from the preprocess kernel
    cu_seqlens_q, cu_seqlens_k,              # *int32 [B + 1] (varlen) or unused
    stride_qb, stride_qs, stride_qh,         # q strides (batch 0 when varlen)
    stride_kb, stride_ks, stride_kh,         # k strides
    stride_vb, stride_vs, stride_vh,         # v strides
    stride_dob, stride_dos, stride_doh,      # do strides
    stride_dqb, stride_dqs, stride_dqh,      # dq strides
    seqlen_q, seqlen_k,                      # S_q, S_k (dense)
    stat_stride,                             # head stride of lse2 / delta
    stat_seq,                                # columns per sequence (dense)
    n_heads_q,                               # H_q
    group,                                   # H_q // H_kv
    scale, softcap, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,                   # queries per program (dq rows kept in registers)
    BLOCK_N: tl.constexpr,                   # keys per inner step
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    SPLIT_LOOPS: tl.constexpr,               # as in the dk/dv kernel
):
    # a schedule_grid grid over (query blocks, B·H_q), the last query blocks first: under a
    # causal mask they walk the most key blocks
    pid_m, pid_bh = scheduled_block(True)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    q_row0, k_row0, seqlen_q, seqlen_k, stat_row0 = _sequence(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, stat_seq, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    h_kv = (h // group).to(tl.int64)
    q_row = (q_row0 + start_m).to(tl.int64)
    n_rows = seqlen_q - start_m
    q = _load_tile(q_ptr + b64 * stride_qb + h64 * stride_qh + q_row * stride_qs,
                   n_rows, stride_qs, BLOCK_M, HEAD_DIM, D_PAD)
    do = _load_tile(do_ptr + b64 * stride_dob + h64 * stride_doh + q_row * stride_dos,
                    n_rows, stride_dos, BLOCK_M, HEAD_DIM, D_PAD)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_seq = offs_m < seqlen_q
    stat = h64 * stat_stride + stat_row0 + offs_m
    lse2 = tl.load(lse2_ptr + stat, mask=in_seq, other=float("inf"))
    delta = tl.load(delta_ptr + stat, mask=in_seq, other=0.0)
    k_src = _row_source(k_ptr + b64 * stride_kb + h_kv * stride_kh + k_row0.to(tl.int64) * stride_ks,
                        seqlen_k, stride_ks, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA)
    v_src = _row_source(v_ptr + b64 * stride_vb + h_kv * stride_vh + k_row0.to(tl.int64) * stride_vs,
                        seqlen_k, stride_vs, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA)
    shift = seqlen_k - seqlen_q
    lo, hi = key_range(start_m, BLOCK_M, seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    n_blocks = tl.cdiv(hi - lo, BLOCK_N)
    # mask-free key blocks: n0 >= start_m + BLOCK_M - 1 + shift - left (left bound), n0 <=
    # start_m + shift + right - BLOCK_N + 1 (right bound) and n0 + BLOCK_N <= seqlen_k (no padding)
    first_free = 0
    if HAS_LEFT:
        first_free = tl.minimum(_blocks_below(start_m + BLOCK_M - 1 + shift - window_left - lo, BLOCK_N), n_blocks)
    end_free = _blocks_below(seqlen_k - BLOCK_N + 1 - lo, BLOCK_N)
    if HAS_RIGHT:
        end_free = tl.minimum(end_free, _blocks_below(start_m + shift + window_right - BLOCK_N + 2 - lo, BLOCK_N))
    end_free = tl.maximum(tl.minimum(end_free, n_blocks), first_free)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    dq = _dq_loop(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, lo, n_blocks,
                  first_free, end_free, offs_m, seqlen_k, shift, window_left, window_right, scale,
                  softcap, SPLIT_LOOPS, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, D_PAD,
                  DOT_PRECISION, USE_TMA)
    _store_tile(dq_ptr + b64 * stride_dqb + h64 * stride_dqh + q_row * stride_dqs,
                dq * scale, n_rows, stride_dqs, BLOCK_M, HEAD_DIM, D_PAD)
