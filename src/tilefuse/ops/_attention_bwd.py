"""FlashAttention-2 backward: dq, dk, dv by recomputation, dense and varlen, no S×S buffer.

With ``P = exp(S - lse)`` recomputed tile by tile from the saved log-sum-exp (module docstring of
``_attention_common`` for S, the mask and softcap)::

    delta_i = Σ_d out[i, d] · do[i, d]                       (preprocess kernel, fp32)
    dV      = Pᵀ · dO
    dP      = dO · Vᵀ
    dS      = P ∘ (dP - delta) ∘ (1 - tanh²)                 (last factor only with softcap)
    dQ      = scale · dS · K,      dK = scale · dSᵀ · Q

Three launches: preprocess (delta, and lse turned into log2 units with ``-inf`` -> ``+inf`` so a
row that saw no key gets P = exp2(s - inf) = 0 exactly, never NaN), the dk/dv kernel (a program
per (key block, kv head, sequence) walks the query blocks of query_range() for each query head of
its GQA group, so dk/dv are summed in registers: no atomics) and the dq kernel (a program per
(query block, query head, sequence) walks key_range()). Nothing uses atomics: results are bitwise
reproducible, ``deterministic`` only documents that.

Masking costs only on boundary blocks: each loop knows its mask-free run of blocks (every (query,
key) pair visible) and applies visible() only outside it, through a uniform branch in one loop, or
(SPLIT_LOOPS) in a second loop over the edge blocks after a mask-free loop with no mask code;
both walk the same per-block body (_dkdv_block, _dq_block). Padded query rows
(past the sequence) carry lse = +inf, so they give P = 0 exactly without a mask; padded key rows of
the dk/dv kernel only touch dk/dv rows that are never stored; the dq kernel masks its last partial
key block (a zero-padded key has s = 0, whose exp may overflow against a very negative lse).

Memory: delta and lse2, fp32 ``[H_q, rows]``: O(S). Launch configs are small named functions
(dkdv_config, dq_config). On sm_90+ the inner loops read their tiles through TMA descriptors built
in the kernel (zero fill past the sequence replaces the row masks; far fewer registers than
pointer loads); elsewhere, and for the interpreter unless a config asks for it, pointer loads.

FLOPs (FlashAttention's convention): 2.5 × the forward's 4·B·S_q·S_k·H·D, × 0.5 causal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import empty
from .._launch import fast_launch
from ._attention_common import apply_softcap, key_range, query_range, visible

LOG2E = tl.constexpr(1.4426950408889634)   # exp(x) = exp2(x · log2(e))
# SPLIT_LOOPS default (launch config key "split_loops"): off until the H100 sweep's B-split /
# A-ptr-split rows (scripts/attention_bwd_sweep.py) say the split loops are faster
DEFAULT_SPLIT_LOOPS = False


# ----------------------------------------------------------------------------------------------
# helpers (device)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sequence(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(first row of sequence ``b`` in the packed tensors (0 when dense), its first key row, its
    query and key lengths, its first column in the ``[H_q, rows]`` statistics buffers)."""
    if IS_VARLEN:
        q_row0 = tl.load(cu_seqlens_q + b)
        k_row0 = tl.load(cu_seqlens_k + b)
        seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_row0
        seqlen_k = tl.load(cu_seqlens_k + b + 1) - k_row0
        stat_row0 = q_row0
    else:
        q_row0 = 0
        k_row0 = 0
        stat_row0 = b * seqlen_q
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
    n_stat_rows,        # columns of delta / lse2: B·S_q or total_q
    HEAD_DIM: tl.constexpr,   # D
    D_PAD: tl.constexpr,      # D rounded up to a power of two (>= 16)
    BLOCK_M: tl.constexpr,    # query rows per program
    IS_VARLEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q_row0, _, seqlen_q, _, stat_row0 = _sequence(b, cu_seqlens_q, cu_seqlens_q, seqlen_q, seqlen_q, IS_VARLEN)
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
    stat = h * n_stat_rows + stat_row0 + start_m + offs
    tl.store(delta_ptr + stat, delta, mask=in_seq)
    tl.store(lse2_ptr + stat, lse2, mask=in_seq)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, start_m, offs_n, mask_block,
                seqlen_q, shift, window_left, window_right, scale, softcap, lse2_ptr, delta_ptr,
                MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                USE_TMA: tl.constexpr):
    """dk, dv [BLOCK_N, D_PAD] += the share of queries start_m .. start_m + BLOCK_M - 1; scores
    transposed ([keys, queries]) so both products land in the key-major accumulators. MASKED
    compiles visible() in; ``mask_block`` (uniform) says whether this block applies it: a runtime
    flag in the single loop, the constant True in the split masked loop (folded away)."""
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
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
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
               D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dk, dv over ``n_blocks`` query blocks from ``first_m``. With MASK (a window),
    blocks outside [first_free, end_free) apply visible(): by default in one loop through a
    uniform branch (split loops spilled 5x more registers in ptxas -v on sm_90a when last
    counted); with SPLIT_LOOPS the mask-free run first, in a loop with no mask code, then the
    edge blocks in a masked loop (not compiled at all without a window)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    walk_lo, walk_hi = (first_free, end_free) if SPLIT_LOOPS else (0, n_blocks)   # the (mask-free) first loop
    for i in range(walk_lo, walk_hi):
        dk, dv = _dkdv_block(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, first_m + i * BLOCK_M,
                             offs_n, (i < first_free) | (i >= end_free), seqlen_q, shift, window_left,
                             window_right, scale, softcap, lse2_ptr, delta_ptr, MASK and not SPLIT_LOOPS,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_M, HEAD_DIM, D_PAD, DOT_PRECISION, USE_TMA)
    if SPLIT_LOOPS and MASK:
        for j in range(first_free + n_blocks - end_free):
            i = tl.where(j < first_free, j, j + (end_free - first_free))   # left edge, then right edge
            dk, dv = _dkdv_block(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos,
                                 first_m + i * BLOCK_M, offs_n, True, seqlen_q, shift, window_left, window_right,
                                 scale, softcap, lse2_ptr, delta_ptr, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                 BLOCK_M, HEAD_DIM, D_PAD, DOT_PRECISION, USE_TMA)
    return dk, dv


@fast_launch
# S_q / S_k are not specialized on value: an H100 run failed to compile ("PassManager::run
# failed") at S_q = 1, S_k = 21, D = 64; a descriptor dimension folded to the constant 1 is the
# suspect. Not specializing costs nothing measurable: they only bound loops and masks.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
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
    n_stat_rows,                             # columns of lse2 / delta
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
):
    pid_n = tl.program_id(0)
    h_kv = tl.program_id(1)
    b = tl.program_id(2)
    q_row0, k_row0, seqlen_q, seqlen_k, stat_row0 = _sequence(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, IS_VARLEN)
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
    # mask-free query blocks: m0 >= start_n + BLOCK_N - 1 - shift - right (every key within
    # right) and m0 + BLOCK_M - 1 <= start_n - shift + left (every key within left)
    first_free = 0
    end_free = n_blocks
    if HAS_RIGHT:
        first_free = tl.minimum(_blocks_below(start_n + BLOCK_N - 1 - shift - window_right - lo, BLOCK_M), n_blocks)
    if HAS_LEFT:
        end_free = _blocks_below(start_n - shift + window_left - BLOCK_M + 2 - lo, BLOCK_M)
        end_free = tl.maximum(tl.minimum(end_free, n_blocks), first_free)
    for g in range(group):
        h = (h_kv * group + g).to(tl.int64)
        q_src = _row_source(q_ptr + b64 * stride_qb + h * stride_qh + q_row0.to(tl.int64) * stride_qs,
                            seqlen_q, stride_qs, BLOCK_M, HEAD_DIM, D_PAD, USE_TMA)
        do_src = _row_source(do_ptr + b64 * stride_dob + h * stride_doh + q_row0.to(tl.int64) * stride_dos,
                             seqlen_q, stride_dos, BLOCK_M, HEAD_DIM, D_PAD, USE_TMA)
        stat_base = h * n_stat_rows + stat_row0
        dk, dv = _dkdv_loop(dk, dv, k, v, q_src, do_src, stat_base, stride_qs, stride_dos, lo, n_blocks,
                            first_free, end_free, start_n, seqlen_q, shift, window_left, window_right,
                            scale, softcap, lse2_ptr, delta_ptr, HAS_LEFT or HAS_RIGHT, SPLIT_LOOPS,
                            HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_M, BLOCK_N, HEAD_DIM, D_PAD,
                            DOT_PRECISION, USE_TMA)
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


@fast_launch
# S_q / S_k are not specialized on value: an H100 run failed to compile ("PassManager::run
# failed") at S_q = 1, S_k = 21, D = 64; a descriptor dimension folded to the constant 1 is the
# suspect. Not specializing costs nothing measurable: they only bound loops and masks.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
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
    n_stat_rows,                             # columns of lse2 / delta
    n_q_blocks,                              # cdiv(max S_q, BLOCK_M): grid axis 0
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
    # last query blocks first: under a causal mask they walk the most key blocks
    pid_m = n_q_blocks - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_row0, k_row0, seqlen_q, seqlen_k, stat_row0 = _sequence(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, IS_VARLEN)
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
    stat = h64 * n_stat_rows + stat_row0 + offs_m
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


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


def _head_dim_pad(head_dim: int) -> int:
    """tl.dot needs K >= 16 and tiles of power-of-two width."""
    return max(16, triton.next_power_of_2(head_dim))


# Tiles below were chosen by ptxas -v register / spill counts on sm_90a (bf16, causal and not,
# compiled offline) pending GPU timings from scripts/attention_bwd_sweep.py: pointer loads keep a
# per-thread address per element of every pipelined tile, TMA loads none, so the TMA configs
# afford larger tiles without spilling.


def dkdv_config(d_pad: int, dtype: torch.dtype, use_tma: bool) -> dict:
    """dk/dv kernel: BLOCK_N1 keys keep two fp32 [BLOCK_N1, D] accumulators in registers, so the
    tiles shrink as D grows; BLOCK_M1 queries stream through shared memory per step."""
    if d_pad > 128:                                                            # <= 32 B (TMA)
        return dict(BLOCK_M1=16, BLOCK_N1=64, num_warps=8, num_stages=2)
    if dtype == torch.float32:                  # the correctness path (ieee fp32 products)
        return dict(BLOCK_M1=32, BLOCK_N1=64, num_warps=8, num_stages=2)
    if d_pad <= 64:
        if use_tma:
            return dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=2)   # 0 spills
        return dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3)       # <= 12 B spilled
    # D = 128: 32 queries x 128 keys, 8 warps, 2 stages measured fastest (H100 sweep, bf16, B·S = 16k:
    # 305-334 TF/s at S >= 4k vs 192-234 for 64 x 64 with TMA)
    return dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=2)


def dq_config(d_pad: int, dtype: torch.dtype, use_tma: bool) -> dict:
    """dq kernel: one fp32 [BLOCK_M2, D] accumulator plus the q and do tiles stay resident; the
    key / value tiles stream (BLOCK_N2 per step)."""
    if dtype == torch.float32 or d_pad > 128:
        return dict(BLOCK_M2=64, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=2)
    if d_pad <= 64:
        return dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3)  # 0 spills both
    return dict(BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=3)      # with the dk/dv tiles above


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """The default load path: TMA descriptors where they work (sm_90+, 16-byte aligned bases and
    row strides, which D a multiple of 8 in 16-bit types gives for the usual layouts; checked,
    not assumed), pointer loads otherwise."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1])
               for t in tensors)


def _tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator hook: global memory for the descriptors built inside the kernels."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def preprocess_block(d_pad: int) -> int:
    """~8k elements of out and of do per program: enough bytes in flight, few registers."""
    return max(16, min(128, 8192 // d_pad))


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


def _bsh_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides; batch stride 0 for packed [total, H, D] tensors."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _clamp_window(w: int | None, bound: int) -> int:
    """A window wider than both sequences equals no window; clamping keeps the in-kernel
    arithmetic (sums of positions and the window) far inside int32."""
    return 0 if w is None else max(-bound, min(bound, int(w)))


def attention_backward(
    do, q, k, v, out, lse,
    *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    scale: float, window_left: int | None = None, window_right: int | None = None,
    softcap: float = 0.0, deterministic: bool = False,
):
    """(dq, dk, dv) of attention (layouts and masking: ``_attention_common``), in q's / k's / v's
    dtype and shape, contiguous. Inputs are assumed validated by the public API. No atomics are
    used, so the result is bitwise reproducible whether or not ``deterministic`` is set."""
    return launch_attention_backward(
        do, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
        window_left=window_left, window_right=window_right, softcap=softcap)


def launch_attention_backward(
    do, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, scale: float, window_left=None, window_right=None, softcap: float = 0.0,
    config: dict | None = None,
):
    """:func:`attention_backward` with an optional launch ``config`` overriding the keys of
    :func:`dkdv_config` / :func:`dq_config` (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps,
    num_stages for the dk/dv kernel, num_warps_dq, num_stages_dq; use_tma; split_loops: the
    SPLIT_LOOPS variant of both kernels) -- tests and the sweep."""
    varlen = cu_seqlens_q is not None
    q, k, v, do, out = (_unit_last_dim(t) for t in (q, k, v, do, out))
    head_dim = q.shape[-1]
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch > 0 else 0
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if batch > 0 else 0
        seqlen_q = seqlen_k = 0        # per sequence, read from cu_seqlens in the kernels
        n_stat_rows = q.shape[0]
        cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        max_seqlen_q, max_seqlen_k = seqlen_q, seqlen_k
        n_stat_rows = batch * seqlen_q
        cu_q = cu_k = q                # unused pointers
    if q.numel() == 0 or k.numel() == 0 or batch == 0:
        # no query or no key anywhere: every gradient is an empty sum
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if batch > 65535:
        raise ValueError(f"batch must be <= 65535 (a grid axis), got {batch}")
    d_pad = _head_dim_pad(head_dim)
    use_tma = (config or {}).get("use_tma")
    if use_tma is None:
        use_tma = tma_eligible(q, k, v, do)
    elif use_tma and q.device.type == "cuda":
        use_tma = tma_eligible(q, k, v, do)   # asked for, but not possible here: pointer loads
    if use_tma:
        triton.set_allocator(_tma_scratch)
    cfg = {**dkdv_config(d_pad, q.dtype, use_tma), **dq_config(d_pad, q.dtype, use_tma), **(config or {})}
    bound = max_seqlen_q + max_seqlen_k + 1
    wl, wr = _clamp_window(window_left, bound), _clamp_window(window_right, bound)
    flags = dict(USE_TMA=use_tma, SPLIT_LOOPS=bool(cfg.get("split_loops", DEFAULT_SPLIT_LOOPS)),
                 HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None, HAS_SOFTCAP=softcap > 0,
                 IS_VARLEN=varlen, HEAD_DIM=head_dim, D_PAD=d_pad,
                 DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")

    delta = empty((h_q, n_stat_rows), torch.float32, q.device)
    lse2 = empty((h_q, n_stat_rows), torch.float32, q.device)
    lse_strides = (0, lse.stride(0), lse.stride(1)) if varlen else lse.stride()
    block_pre = preprocess_block(d_pad)
    attention_bwd_preprocess_kernel[(triton.cdiv(max_seqlen_q, block_pre), h_q, batch)](
        out, do, lse, delta, lse2, cu_q,
        *_bsh_strides(out, varlen), *_bsh_strides(do, varlen), *lse_strides,
        seqlen_q, n_stat_rows,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=block_pre, IS_VARLEN=varlen, num_warps=4,
    )

    dq = empty(q.shape, q.dtype, q.device)
    dk = empty(k.shape, k.dtype, k.device)
    dv = empty(v.shape, v.dtype, v.device)
    common = (scale, softcap, wl, wr)
    strides = (*_bsh_strides(q, varlen), *_bsh_strides(k, varlen), *_bsh_strides(v, varlen),
               *_bsh_strides(do, varlen))
    attention_bwd_dkdv_kernel[(triton.cdiv(max_seqlen_k, cfg["BLOCK_N1"]), h_kv, batch)](
        q, k, v, do, dk, dv, lse2, delta, cu_q, cu_k,
        *strides, *_bsh_strides(dk, varlen), *_bsh_strides(dv, varlen),
        seqlen_q, seqlen_k, n_stat_rows, h_q // h_kv, *common,
        BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=cfg["BLOCK_N1"], **flags,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    n_q_blocks = triton.cdiv(max_seqlen_q, cfg["BLOCK_M2"])
    attention_bwd_dq_kernel[(n_q_blocks, h_q, batch)](
        q, k, v, do, dq, lse2, delta, cu_q, cu_k,
        *strides, *_bsh_strides(dq, varlen),
        seqlen_q, seqlen_k, n_stat_rows, n_q_blocks, h_q // h_kv, *common,
        BLOCK_M=cfg["BLOCK_M2"], BLOCK_N=cfg["BLOCK_N2"], **flags,
        num_warps=cfg["num_warps_dq"], num_stages=cfg["num_stages_dq"],
    )
    return dq, dk, dv
