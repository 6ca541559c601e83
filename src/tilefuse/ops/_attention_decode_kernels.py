"""Triton kernels of attention_decode (the math, layouts and launch plan: ops/attention_decode.py).

* ``kv_append_kernel``: k_new / v_new written into their cache slots (through the block table
  when paged), one program per new token;
* ``decode_split_kernel``: one (kv head, query block, split) per program, GQA-packed rows, an
  exp2 online softmax over the split's share of the visible keys, fp32 partial out + lse;
* ``decode_combine_kernel``: the splits merged by their lse.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import fast_launch
from ._attention_common import apply_softcap, key_range, visible

from ._common import LN2, LOG2E




@triton.jit
def _cache_pages(keys, b, block_table_ptr, stride_bt, key_ok, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """int64 page of keys ``keys`` of batch row ``b`` through the page table when paged (one page
    id load per key; the keys of one page hit the same cached id; 0 where not ``key_ok``), else
    the batch row itself: a slot's elements start at ``page · stride_page + slot · stride_slot``."""
    # one return of one type on both branches (Triton's compiler rejects branch-dependent types)
    if PAGED:
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + keys // PAGE_SIZE, mask=key_ok, other=0)
        page = page.to(tl.int64)
    else:
        page = tl.zeros_like(keys).to(tl.int64) + b.to(tl.int64)
    return page


@triton.jit
def _tile_pages(start_n, end, b, block_table_ptr, stride_bt, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The pages (int32) of key tile ``start_n ..`` (a multiple of BLOCK_N) of batch row ``b``,
    for :func:`_tile_rows`: the batch row itself (contiguous cache), one page id when a page holds
    whole tiles, else one id per key (:func:`_cache_pages`). Ids past ``end`` read as 0 (never
    used: their keys are masked).
    (One id per page of a tile holding several, expanded with a reshape, measured 255 registers
    + stack and no pipelining: not used.)"""
    if not PAGED:
        return b
    elif PAGE_SIZE % BLOCK_N == 0:
        return tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + start_n // PAGE_SIZE, mask=start_n < end, other=0)
    else:
        keys = start_n + tl.arange(0, BLOCK_N)
        return _cache_pages(keys, b, block_table_ptr, stride_bt, keys < end, PAGED, PAGE_SIZE)


@triton.jit
def _tile_rows(pages, start_n, stride_page, stride_slot, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """int64 offsets ``[BLOCK_N]`` of the first element of each key slot of the tile, from
    :func:`_tile_pages`' ``pages``: ``page · stride_page + slot · stride_slot``."""
    keys = start_n + tl.arange(0, BLOCK_N)
    slot = (keys % PAGE_SIZE) if PAGED else keys
    return pages.to(tl.int64) * stride_page + slot.to(tl.int64) * stride_slot


@triton.jit
def _cache_slots(keys, b, block_table_ptr, stride_bt, key_ok, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(page, slot) int64 of keys ``keys`` of batch row ``b`` (:func:`_cache_pages`)."""
    page = _cache_pages(keys, b, block_table_ptr, stride_bt, key_ok, PAGED, PAGE_SIZE)
    slot = (keys % PAGE_SIZE).to(tl.int64) if PAGED else keys.to(tl.int64)
    return page, slot


@fast_launch
@triton.jit
def kv_append_kernel(
    k_new_ptr,          # *k_new [B, S_q, H_kv, D]
    v_new_ptr,          # *v_new [B, S_q, H_kv, D]
    k_cache_ptr,        # *k_cache, contiguous [B, L_max, H_kv, D] or paged [pages, PAGE_SIZE, H_kv, D]
    v_cache_ptr,        # *v_cache, same layout as k_cache
    seqlens_ptr,        # *int32 [B] keys cached before the append
    block_table_ptr,    # *int32 [B, max_pages] (paged; any valid pointer otherwise)
    stride_knb, stride_kns, stride_knh,      # k_new strides: batch, token, head (dim stride 1)
    stride_vnb, stride_vns, stride_vnh,      # v_new strides
    stride_kb, stride_kn, stride_kh,         # k_cache strides: batch row or page, slot, head
    stride_vb, stride_vn, stride_vh,         # v_cache strides
    stride_bt,          # block_table row stride
    capacity,           # slots per batch row (L_max, or max_pages · PAGE_SIZE)
    num_pages,          # pages of the cache (paged: a page id outside [0, num_pages) is not written)
    n_kv_heads,         # H_kv
    head_dim,           # D
    S_Q: tl.constexpr,          # new tokens per row
    PAGED: tl.constexpr,        # block_table given
    PAGE_SIZE: tl.constexpr,    # slots per page (1 when contiguous)
    BLOCK_H: tl.constexpr,      # heads per tile
    BLOCK_D: tl.constexpr,      # next power of two >= D
):
    pid = tl.program_id(0)
    b = pid // S_Q
    token = pid % S_Q
    pos = tl.load(seqlens_ptr + b) + token
    in_range = (pos >= 0) & (pos < capacity)          # no write outside the cache, ever
    dims = tl.arange(0, BLOCK_D)
    page, slot = _cache_slots(pos, b, block_table_ptr, stride_bt, in_range, PAGED, PAGE_SIZE)
    if PAGED:       # a bad page id in the table: no write outside the cache's pages either
        in_range = in_range & (page >= 0) & (page < num_pages)
    k_slot = page * stride_kb + slot * stride_kn
    v_slot = page * stride_vb + slot * stride_vn
    b64 = b.to(tl.int64)
    for h0 in range(0, n_kv_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_kv_heads)[:, None] & (dims < head_dim)[None, :] & in_range
        src = heads[:, None] * stride_knh + dims[None, :]
        x = tl.load(k_new_ptr + b64 * stride_knb + token * stride_kns + src, mask=mask)
        tl.store(k_cache_ptr + k_slot + heads[:, None] * stride_kh + dims[None, :], x, mask=mask)
        src = heads[:, None] * stride_vnh + dims[None, :]
        x = tl.load(v_new_ptr + b64 * stride_vnb + token * stride_vns + src, mask=mask)
        tl.store(v_cache_ptr + v_slot + heads[:, None] * stride_vh + dims[None, :], x, mask=mask)


@fast_launch
@triton.jit
def decode_split_kernel(
    q_ptr,              # *q [B, S_q, H_q, D]
    k_cache_ptr,        # *k_cache, contiguous [B, L_max, H_kv, D] or paged [pages, PAGE_SIZE, H_kv, D]
    v_cache_ptr,        # *v_cache, same layout
    seqlens_ptr,        # *int32 [B] keys cached before the append
    block_table_ptr,    # *int32 [B, max_pages] (paged; any valid pointer otherwise)
    out_ptr,            # *out: final [B, S_q, H_q, D] (one split) or fp32 partials [B, splits, S_q, H_q, D]
    lse_ptr,            # *fp32 lse: final [B, H_q, S_q] or partials [B, splits, H_q, S_q]
    stride_qb, stride_qs, stride_qh,         # q strides: batch, query, head
    stride_kb, stride_kn, stride_kh,         # k_cache strides: batch row or page, slot, head
    stride_vb, stride_vn, stride_vh,         # v_cache strides
    stride_bt,          # block_table row stride
    stride_ob, stride_osplit, stride_os, stride_oh,   # out strides: batch, split (0: final), query, head
    stride_lb, stride_lsplit, stride_lh, stride_ls,   # lse strides: batch, split, head, query
    capacity,           # slots per batch row (keys beyond it are never read)
    n_kv_heads,         # H_kv
    head_dim,           # D
    scale,              # softmax scale (natural units)
    softcap,            # > 0 when HAS_SOFTCAP
    window_left,        # keys visible on the left of the diagonal (HAS_LEFT)
    window_right,       # keys visible on the right of the diagonal (HAS_RIGHT; causal: 0)
    S_Q: tl.constexpr,          # queries per row
    GROUP: tl.constexpr,        # H_q // H_kv
    N_NEW: tl.constexpr,        # keys appended by this call (S_Q or 0): seqlen_k = seqlens + N_NEW
    M_BLOCKS: tl.constexpr,     # query blocks per kv head: cdiv(GROUP · S_Q, BLOCK_M)
    Q_SPAN: tl.constexpr,       # queries a block of BLOCK_M rows can touch (bound for key_range)
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,   # "ieee" for fp32 inputs (no tf32 rounding), else the default
    BLOCK_M: tl.constexpr,      # packed (query head, query) rows per tile, >= 16
    BLOCK_N: tl.constexpr,      # keys per tile
    BLOCK_D: tl.constexpr,      # next power of two >= D
    KV_EVICT: tl.constexpr,     # L2 policy of the K/V tile loads ("" default)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    m_block = pid % M_BLOCKS
    kv_head = (pid // M_BLOCKS) % n_kv_heads
    b = pid // (M_BLOCKS * n_kv_heads)
    b64 = b.to(tl.int64)

    # row r of the tile is query r // GROUP of query head kv_head·GROUP + r % GROUP: the heads of
    # one query are adjacent in q's memory, so the tile loads in runs of GROUP·D elements
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < GROUP * S_Q
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim

    seqlen_k = tl.minimum(tl.load(seqlens_ptr + b) + N_NEW, capacity)
    shift = seqlen_k - S_Q
    lo, hi = key_range((m_block * BLOCK_M) // GROUP, Q_SPAN, seqlen_k, shift, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT)
    # this split's share of [lo, hi): whole tiles, the same count for every split of the row
    lo = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(hi, start + chunk)

    q = tl.load(q_ptr + b64 * stride_qb + query[:, None] * stride_qs + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)     # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)                    # running Σ 2^(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the pages of the next tile are read one step ahead: with K/V addresses that hang on a load
    # of the same step, Triton's pipeliner keeps one K/V buffer and waits for it at once (paged
    # cache 45 % of copy on the H200 against 73-79 % with the look-ahead, B = 16, L = 8k)
    pages_next = _tile_pages(start, end, b, block_table_ptr, stride_bt, PAGED, PAGE_SIZE, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):              # empty when the share is: early exit
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        tile_mask = key_ok[:, None] & dim_ok[None, :]
        pages = pages_next
        pages_next = _tile_pages(start_n + BLOCK_N, end, b, block_table_ptr, stride_bt, PAGED, PAGE_SIZE, BLOCK_N)
        k_rows = _tile_rows(pages, start_n, stride_kb, stride_kn, PAGED, PAGE_SIZE, BLOCK_N)
        k = tl.load(k_cache_ptr + k_rows[:, None] + kv_head * stride_kh + dims[None, :], mask=tile_mask, other=0.0,
                    eviction_policy=KV_EVICT)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s, _ = apply_softcap(qk * scale, softcap, HAS_SOFTCAP)
            s = s * LOG2E
        else:
            s = qk * (scale * LOG2E)                         # exp2 with the scale folded in
        ok = visible(query, keys, seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(ok & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that saw nothing yet: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _tile_rows(pages, start_n, stride_vb, stride_vn, PAGED, PAGE_SIZE, BLOCK_N)
        v = tl.load(v_cache_ptr + v_rows[:, None] + kv_head * stride_vh + dims[None, :], mask=tile_mask, other=0.0,
                    eviction_policy=KV_EVICT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_offs = b64 * stride_ob + split * stride_osplit + query[:, None] * stride_os + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    l_offs = b64 * stride_lb + split * stride_lsplit + head * stride_lh + query * stride_ls
    tl.store(lse_ptr + l_offs, lse, mask=row_ok)


@fast_launch
@triton.jit
def decode_combine_kernel(
    part_out_ptr,       # *fp32 [B, splits, S_q, H_q, D] per-split normalized outputs
    part_lse_ptr,       # *fp32 [B, splits, H_q, S_q] per-split lse (-inf: the split saw no key)
    out_ptr,            # *out [B, S_q, H_q, D]
    lse_ptr,            # *fp32 [B, H_q, S_q]
    stride_pb, stride_psplit, stride_ps, stride_ph,   # partial out strides
    stride_plb, stride_plsplit, stride_plh,           # partial lse strides (query stride 1)
    stride_ob, stride_os, stride_oh,                  # out strides
    stride_lb, stride_lh,                             # lse strides (query stride 1)
    n_splits,           # splits
    n_heads,            # H_q
    head_dim,           # D
    S_Q: tl.constexpr,
    CHUNK_S: tl.constexpr,      # splits per step (a power of two; all of them in one step when they fit)
    BLOCK_D: tl.constexpr,
):
    """``out = Σ_s e^{lse_s - m} out_s / Σ_s e^{lse_s - m}``, ``lse = m + log Σ_s e^{lse_s - m}``
    (m the largest lse; -inf where no split saw a key) for one (batch, query, head) row per
    program. One pass: each step loads CHUNK_S splits' lse *and* partial outputs together and
    rescales the running sums when m grows (flash's online softmax), so with all splits in one
    step the merge waits on one round of loads, not two (lse first, then the partials)."""
    row = tl.program_id(0)                  # ((b · S_q) + i) · H_q + h
    h = row % n_heads
    query = (row // n_heads) % S_Q
    b64 = (row // (n_heads * S_Q)).to(tl.int64)
    lse_base = part_lse_ptr + b64 * stride_plb + h * stride_plh + query
    out_base = part_out_ptr + b64 * stride_pb + query * stride_ps + h * stride_ph
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    m = float("-inf")
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    for s0 in range(0, n_splits, CHUNK_S):
        ss = s0 + tl.arange(0, CHUNK_S)
        s_ok = ss < n_splits
        lse = tl.load(lse_base + ss * stride_plsplit, mask=s_ok, other=float("-inf"))
        o = tl.load(out_base + ss[:, None] * stride_psplit + dims[None, :], mask=s_ok[:, None] & dim_ok[None, :],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - m_safe) * LOG2E)            # 0 while no split has seen a key
        w = tl.exp2((lse - m_safe) * LOG2E)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)
    tl.store(out_ptr + b64 * stride_ob + query * stride_os + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)
    tl.store(lse_ptr + b64 * stride_lb + h * stride_lh + query,
             tl.where(seen, m_safe + tl.log2(tl.where(seen, total, 1.0)) * LN2, float("-inf")))
