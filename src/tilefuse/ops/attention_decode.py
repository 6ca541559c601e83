"""Attention decode against a KV cache: split-KV flash-decoding, GQA-packed, paged, in-place append.

    out[b, i, h] = Σ_j softmax_j(s[i, j]) · v[b, j, h // G],   s[i, j] = scale · q[b, i, h] · k[b, j, h // G]

for the ``S_q`` (1..16) new queries of each batch row against its ``seqlen_k`` cached keys, with
the masking rule, softcap and lse of ``_attention_common`` and ``shift = seqlen_k - S_q`` per
row (the new queries sit at the bottom right: causal query ``i`` sees keys ``j <= seqlen_k -
S_q + i``). G = H_q / H_kv.

Cache layouts (flash_attn_with_kvcache's): contiguous ``[B, L_max, H_kv, D]``, or paged
``[num_pages, page_size, H_kv, D]`` with ``block_table`` int32 ``[B, max_pages]`` (key ``j`` of
row ``b`` lives in page ``block_table[b, j // page_size]``, slot ``j % page_size``).
``cache_seqlens`` int32 ``[B]``: valid keys per row *before* the append. With ``k_new``/``v_new``
``[B, S_q, H_kv, D]`` those are written IN PLACE into slots ``cache_seqlens[b] .. + S_q - 1``
and attended to, so ``seqlen_k = cache_seqlens + S_q``; ``cache_seqlens`` itself is NOT
incremented (flash-attn's convention: the caller advances it). The caller guarantees room,
``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + S_q <= capacity``, and page ids within the
cache for the pages those keys use. CPU tensors are checked (a ValueError naming the row); on a
GPU the values are not read on the host (a decode step stays free of syncs and extra launches):
lengths are clamped to the capacity inside the kernels and the append writes nothing through a
page id outside ``[0, num_pages)``, but the results are then unspecified, and the split kernel
reads whatever page a bad id names.

Kernels. (1) ``kv_append_kernel`` (only with k_new): one program per new token. (2)
``decode_split_kernel``: grid ``(B · H_kv · query blocks, splits)``; a program takes all ``G·S_q``
(query head, query) pairs of its kv head as the M rows of one tile (GQA packing: a KV tile is
read once per group, not G times), walks its share of the row's visible key range in BLOCK_N
tiles with an exp2 online softmax, and writes fp32 partial out + lse; with one split it writes
the final out directly. (3) ``decode_combine_kernel`` merges the splits by their lse:
``out = Σ_s e^{lse_s - lse} out_s``, ``lse = log Σ_s e^{lse_s}``.

CUDA-graph capturable: the split count and every buffer come from shapes only (B, H_kv, the
cache capacity, SM count), never from ``cache_seqlens`` values; the key range of a row is split
on the device, and a program whose share is empty writes an empty partial (lse -inf) at once.

Bytes counted (registry): K and V cache bytes actually read ``2·B·L·H_kv·D·elem`` + q + out
(+ k_new, v_new read and written into the cache when appended). No backward (inference op).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import torch
from torch.autograd.graph import increment_version

from .._autocast import autocast_dtype, cast_to
from .._checks import (DisjointByOffset, check_same_device, check_same_dtype, check_shape, check_tensor,
                       check_writable, may_share_elements)
from .._dispatch import cdiv, contiguous_strides, empty, next_power_of_2, num_sms, use_triton, workspace
from .._launch import PreparedArgs, config_key
from .._op import CallCache, call_key, custom_op, no_grad_layout, plain_tensors
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._attention_common import (
    attention_reference, normalize_scale, normalize_softcap, normalize_window, visible_mask,
)
from ._attention_decode_kernels import decode_combine_kernel, decode_split_kernel, kv_append_kernel
from ._attention_fwd_kernels import attention_flops

MAX_QUERIES = 16          # S_q limit: the new tokens of one decode step (speculative decoding)
MAX_HEAD_DIM = 256
MIN_PAGE_SIZE = 16        # the floor; pages that hold whole key tiles read one page id per tile
MAX_SPLITS = 128

# ----------------------------------------------------------------------------------------------
# launch heuristics (shapes only: the op stays CUDA-graph capturable)
# ----------------------------------------------------------------------------------------------


def _key_block(block_d: int, elem_size: int) -> int:
    """Keys per tile: 128 while a K+V tile pair fits in 64 KiB (bf16 D <= 128), fewer above. H200
    sweep, bf16 D = 128, 2026-11-24: 128 keys 134 against 152 us at B = 16, L = 8k and 138 against
    160 us at B = 1, L = 128k (contiguous), 172 / 160 against 206 / 174 us paged (16 / 256 slots);
    the H100's (session 2, 3.35 TB/s) had 64 keys level or ahead: 188 vs 190 us, 64 vs 71 us."""
    return max(32, min(128, 65536 // (2 * block_d * elem_size)))


def _decode_warps(block_n: int, block_d: int) -> int:
    """8 warps from 128×128 K/V tiles: a paged cache's per-key page offsets take a thread to ~240
    registers at 4 (108-128 at 8, offline sm_90 compiles), and 8 warps ran paged caches faster, contiguous ones level (H200
    2026-11-24, B = 16, L = 8k: 16-slot pages 143 against 177 us, 256-slot 135 against 139,
    contiguous 134.8 against 134.4)."""
    return 8 if block_n * block_d >= 128 * 128 else 4


def _query_block(rows: int, block_d: int) -> int:
    """Packed rows per tile: all G·S_q rows when they fit, >= 16 (tl.dot's minimum), and the
    fp32 accumulator BLOCK_M·BLOCK_D <= 8192 (64 registers a thread at 4 warps)."""
    return max(16, min(next_power_of_2(rows), 8192 // block_d))


@functools.lru_cache(maxsize=1024)   # ints in, int out: ~60 % of the op's host time uncached
def _num_splits(programs: int, key_tiles: int, sms: int) -> int:
    """No split when the (row, kv head, query block) programs already fill 80 % of the SMs; else
    the most splits whose programs still run in one wave (programs · splits <= SMs), at most one
    split per key tile and MAX_SPLITS. (flash-attn's rule, the fewest splits whose waves are 85 %
    as full as the best count's, took 15 at B = 1, H_kv = 8 on 132 SMs: 120 programs. 16 fill
    128 SMs: H200 2026-11-24, graph replays, 37.5 against 38.5 µs at L = 32k and 125.4 against
    126.3 at L = 128k; 22 or 33 splits, two waves, 43-51 µs at 32k:
    -s19-decode-pdl-graph-ab.log.)"""
    if programs >= 0.8 * sms or key_tiles <= 1:
        return 1
    return max(1, min(sms // programs, key_tiles, MAX_SPLITS))


def _combine_chunk(splits: int, block_d: int) -> int:
    """Splits per step of the combine kernel: all of them while the [chunk, D] fp32 tile stays
    within 4096 values (32 registers a thread at 4 warps), so the usual 16 splits of D <= 256
    merge after a single round of loads."""
    return max(1, min(next_power_of_2(splits), 4096 // block_d))


def _launch_config(q: torch.Tensor, capacity: int, n_kv_heads: int, num_splits: int,
                   config: dict | None = None) -> dict:
    """BLOCK_M/N/D, query blocks, splits, warps, stages; ``config`` overrides any of them
    (the bench script sweeps them)."""
    return _config_from_shapes(tuple(q.shape), q.element_size(), capacity, n_kv_heads, num_splits, num_sms(q), config)


def _config_from_shapes(q_shape: tuple, elem_size: int, capacity: int, n_kv_heads: int, num_splits: int, sms: int,
                        config: dict | None) -> dict:
    batch, s_q, h_q, d = q_shape
    rows = (h_q // n_kv_heads) * s_q
    block_d = max(16, next_power_of_2(d))
    block_n = _key_block(block_d, elem_size)
    cfg = {"BLOCK_D": block_d, "BLOCK_M": _query_block(rows, block_d), "BLOCK_N": block_n,
           "num_warps": _decode_warps(block_n, block_d), "num_stages": 3}
    cfg.update(config or {})
    cfg["M_BLOCKS"] = cdiv(rows, cfg["BLOCK_M"])
    programs = batch * n_kv_heads * cfg["M_BLOCKS"]
    if num_splits <= 0:
        num_splits = _num_splits(programs, cdiv(capacity, cfg["BLOCK_N"]), sms)
    cfg["splits"] = max(1, min(num_splits, MAX_SPLITS))
    return cfg


# ----------------------------------------------------------------------------------------------
# launchers (inputs validated by the public function)
# ----------------------------------------------------------------------------------------------


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def _check_cache_values(k_cache, cache_seqlens, block_table, n_new: int) -> None:
    """The values of ``cache_seqlens`` (and the pages they use) against the cache, on the host:
    CPU tensors only. On a GPU they are not read (a check would be a host sync, or a kernel and an
    assertion per decode step); there the append never writes outside the cache's pages, and
    keys past the capacity are dropped. In the ops' implementations (real tensors under
    torch.compile too) and on the eager fast path."""
    capacity, page_size = _capacity(k_cache, block_table), k_cache.shape[1]
    for b, n in enumerate(cache_seqlens.tolist()):
        if not 0 <= n <= capacity - n_new:
            raise ValueError(f"cache_seqlens[{b}] = {n}: the row's keys (+ {n_new} appended) must fit "
                             f"[0, {capacity}], the cache's capacity")
        if block_table is not None and n + n_new > 0:
            pages = block_table[b, :cdiv(n + n_new, page_size)]
            if bool(((pages < 0) | (pages >= k_cache.shape[0])).any()):
                raise ValueError(f"block_table[{b}] holds page ids outside [0, {k_cache.shape[0]}) among the "
                                 f"{pages.numel()} pages its {n + n_new} keys use: {pages.tolist()}")


def _launch_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table) -> None:
    batch, s_q, h_kv, d = k_new.shape
    if batch * s_q == 0:
        return
    k_new, v_new = _unit_last(k_new), _unit_last(v_new)
    paged = block_table is not None
    bt = block_table.contiguous() if paged else cache_seqlens
    block_d = max(16, next_power_of_2(d))
    kv_append_kernel[(batch * s_q,)](
        k_new, v_new, k_cache, v_cache, cache_seqlens.contiguous(), bt,
        *k_new.stride()[:3], *v_new.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        bt.stride(0) if paged else 0, _capacity(k_cache, block_table), k_cache.shape[0], h_kv, d,
        S_Q=s_q, PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        BLOCK_H=max(1, min(next_power_of_2(h_kv), 4096 // block_d)), BLOCK_D=block_d,
    )


class _DecodePlan(NamedTuple):
    """One decode launch, from shapes and strides only (cached: the split kernel takes ~45
    arguments, and keying them on every call cost more host time than the rest of the op)."""
    part_shapes: tuple | None       # (partial out, partial lse) when the keys are split, else None
    grid: tuple
    split_args: PreparedArgs        # decode_split_kernel's arguments after its 7 tensors
    combine_grid: tuple
    combine_args: PreparedArgs | None


@functools.lru_cache(maxsize=1024)
def _decode_plan(q_shape: tuple, q_strides: tuple, k_strides: tuple, v_strides: tuple, h_kv: int, capacity: int,
                 page_size: int, bt_stride: int, elem_size: int, fp32: bool, n_new: int, left: int, right: int,
                 softcap: float, scale: float, num_splits: int, sms: int, config: tuple) -> _DecodePlan:
    batch, s_q, h_q, d = q_shape
    # a window side past every distance is none (-1): window sums stay inside int32
    left, right = (-1 if w >= capacity + s_q + 1 else w for w in (left, right))
    cfg = _config_from_shapes(q_shape, elem_size, capacity, h_kv, num_splits, sms, dict(config))
    splits, group = cfg["splits"], h_q // h_kv
    out_st, lse_st = contiguous_strides(q_shape), contiguous_strides((batch, h_q, s_q))
    if splits == 1:     # the split kernel writes out and lse themselves
        part_shapes = None
        o_strides, l_strides = (out_st[0], 0, *out_st[1:3]), (lse_st[0], 0, *lse_st[1:])
    else:               # fp32 partials, sized from shapes: B · splits · S_q · H_q · (D + 1) floats
        part_shapes = ((batch, splits, s_q, h_q, d), (batch, splits, h_q, s_q))
        o_strides, l_strides = contiguous_strides(part_shapes[0])[:4], contiguous_strides(part_shapes[1])
    split_args = decode_split_kernel.prepare(
        (*q_strides[:3], *k_strides[:3], *v_strides[:3], bt_stride, *o_strides, *l_strides, capacity, h_kv, d,
         scale, softcap, left, right),
        dict(S_Q=s_q, GROUP=group, N_NEW=n_new, M_BLOCKS=cfg["M_BLOCKS"], Q_SPAN=cdiv(cfg["BLOCK_M"], group) + 1,
             PAGED=page_size > 0, PAGE_SIZE=max(page_size, 1), HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
             HAS_SOFTCAP=softcap > 0, DOT_PRECISION="ieee" if fp32 else "tf32",
             BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
             KV_EVICT=cfg.get("KV_EVICT", ""), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    combine_args = None
    if splits > 1:
        combine_args = decode_combine_kernel.prepare(
            (*o_strides, *l_strides[:3], *out_st[:3], lse_st[0], lse_st[1], splits, h_q, d),
            dict(S_Q=s_q, CHUNK_S=_combine_chunk(splits, cfg["BLOCK_D"]), BLOCK_D=cfg["BLOCK_D"], num_warps=4))
    return _DecodePlan(part_shapes, (batch * h_kv * cfg["M_BLOCKS"], splits), split_args, (batch * s_q * h_q,),
                       combine_args)


def _plan_for(q, k_cache, v_cache, block_table, n_new: int, left: int, right: int, softcap: float, scale: float,
              num_splits: int, config: dict | None = None) -> _DecodePlan:
    """The cached :class:`_DecodePlan` of a call (q with unit last stride, block_table contiguous)."""
    paged = block_table is not None
    return _decode_plan(tuple(q.shape), q.stride(), k_cache.stride(), v_cache.stride(), k_cache.shape[2],
                        _capacity(k_cache, block_table), k_cache.shape[1] if paged else 0,
                        block_table.stride(0) if paged else 0, q.element_size(), q.dtype == torch.float32, n_new,
                        left, right, softcap, scale, num_splits, num_sms(q), config_key(config))


def _launch_planned(plan: _DecodePlan, q, k_cache, v_cache, cache_seqlens, block_table, out, lse) -> None:
    """The split kernel (and the combine when the keys are split) writing out and lse."""
    bt = block_table if block_table is not None else cache_seqlens   # a placeholder when not paged
    if plan.part_shapes is None:
        part_out, part_lse = out, lse
    else:
        part_out, part_lse = workspace("decode_partials", plan.part_shapes, torch.float32, q.device)
    decode_split_kernel.launch_prepared(plan.grid, (q, k_cache, v_cache, cache_seqlens, bt, part_out, part_lse),
                                        plan.split_args)
    if plan.combine_args is not None:
        decode_combine_kernel.launch_prepared(plan.combine_grid, (part_out, part_lse, out, lse), plan.combine_args)


def _launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, n_new: int, left: int, right: int,
                   softcap: float, scale: float, num_splits: int, config: dict | None = None):
    """(out [B, S_q, H_q, D], lse fp32 [B, H_q, S_q])."""
    batch, s_q, h_q, d = q.shape
    out = empty(q.shape, q.dtype, q.device)
    lse = empty((batch, h_q, s_q), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    q = _unit_last(q)
    block_table = block_table.contiguous() if block_table is not None else None
    plan = _plan_for(q, k_cache, v_cache, block_table, n_new, left, right, softcap, scale, num_splits, config)
    _launch_planned(plan, q, k_cache, v_cache, cache_seqlens.contiguous(), block_table, out, lse)
    return out, lse


class _DecodeCall(NamedTuple):
    """A validated call layout of :func:`attention_decode` (the eager fast path): its plan and
    normalized options. ``run`` does what the checked path does after its checks."""
    plan: _DecodePlan
    n_new: int
    lse_shape: tuple
    return_lse: bool
    disjoint: DisjointByOffset      # with an append: k_cache and v_cache share no element (not in the key)

    def run(self, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):
        if self.n_new:
            if k_cache is not v_cache:
                self.disjoint.check(k_cache, v_cache, _check_caches_disjoint)
            _launch_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
            increment_version(k_cache)                   # as the custom op's mutation would
            increment_version(v_cache)
        out = empty(q.shape, q.dtype, q.device)
        # the lse is the caller's only with return_lse; else a buffer reused across calls
        lse = empty(self.lse_shape, torch.float32, q.device) if self.return_lse else \
            workspace("decode_lse", (self.lse_shape,), torch.float32, q.device)[0]
        _launch_planned(self.plan, q, k_cache, v_cache, cache_seqlens, block_table, out, lse)
        return (out, lse) if self.return_lse else out


_FAST = CallCache()       # call layout and options -> _DecodeCall


# ----------------------------------------------------------------------------------------------
# references (fp64 for tests; fp32 math otherwise); also the CPU path
# ----------------------------------------------------------------------------------------------


def _row_keys(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, n: int) -> torch.Tensor:
    """The first ``n`` cached keys (or values) of batch row ``b``: ``[n, H_kv, D]``."""
    if block_table is None:
        return cache[b, :n]
    page_size = cache.shape[1]
    pages = block_table[b, :cdiv(n, page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


def _append_reference(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table) -> None:
    """The append, in place, slot by slot (as kv_append_kernel: slots past the capacity skipped)."""
    page_size = k_cache.shape[1] if block_table is not None else 1
    capacity = _capacity(k_cache, block_table)
    for b, n in enumerate(cache_seqlens.tolist()):
        for t in range(k_new.shape[1]):
            pos = n + t
            if not 0 <= pos < capacity:
                continue
            page, slot = (int(block_table[b, pos // page_size]), pos % page_size) if block_table is not None else (b, pos)
            k_cache[page, slot] = k_new[b, t]
            v_cache[page, slot] = v_new[b, t]


def _decode_reference(q, k_cache, v_cache, cache_seqlens, block_table, n_new, left, right, softcap, scale):
    """(out, lse) by attention_reference per batch row on its ``seqlen_k`` keys, shift
    ``seqlen_k - S_q``; the cache already holds the appended keys."""
    batch, s_q, h_q, d = q.shape
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, h_q, s_q), float("-inf"), dtype=wide, device=q.device)
    capacity = _capacity(k_cache, block_table)
    for b, n in enumerate(cache_seqlens.tolist()):
        seqlen_k = min(n + n_new, capacity)
        k = _row_keys(k_cache, block_table, b, seqlen_k)[None]
        v = _row_keys(v_cache, block_table, b, seqlen_k)[None]
        o, l = attention_reference(q[b:b + 1], k, v, False, (left, right), softcap, scale, return_lse=True,
                                   shift=seqlen_k - s_q)
        out[b], lse[b] = o[0], l[0].to(wide)
    return out, lse


def attention_decode_reference(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None,
                               causal=True, window=(-1, -1), softcap=0.0, scale=None, return_lse=False,
                               num_splits=None):
    """:func:`attention_decode` in plain PyTorch (fp64 for fp64 inputs), leaving the cache as it
    is: the appended keys are taken from ``k_new``/``v_new`` (copies of the cache are updated)."""
    left, right = normalize_window(causal, window)
    scale = normalize_scale(scale, q.shape[-1])
    n_new = 0
    if k_new is not None:
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        _append_reference(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
        n_new = q.shape[1]
    out, lse = _decode_reference(q, k_cache, v_cache, cache_seqlens, block_table, n_new, left, right,
                                 normalize_softcap(softcap), scale)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# custom ops (no autograd: an inference op)
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::kv_cache_append", mutates_args=("k_cache", "v_cache"))
def _append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor]) -> None:
    if not cache_seqlens.is_cuda:
        _check_cache_values(k_cache, cache_seqlens, block_table, k_new.shape[1])
    if use_triton(k_cache):
        _launch_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
    else:
        _append_reference(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)


@_append_op.register_fake
def _(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table):
    return None


@custom_op("tilefuse::attention_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
               block_table: Optional[torch.Tensor], n_new: int, window_left: int, window_right: int,
               softcap: float, scale: float, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); ``n_new`` keys were appended (seqlen_k = cache_seqlens + n_new); num_splits 0: auto."""
    if not cache_seqlens.is_cuda:
        _check_cache_values(k_cache, cache_seqlens, block_table, n_new)
    if use_triton(q):
        return _launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, n_new, window_left,
                              window_right, softcap, scale, num_splits)
    out, lse = _decode_reference(q, k_cache, v_cache, cache_seqlens, block_table, n_new, window_left,
                                 window_right, softcap, scale)
    return out.contiguous(), lse.float().contiguous()


@_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, n_new, window_left, window_right, softcap, scale, num_splits):
    b, s_q, h_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h_q, s_q), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits) -> None:
    check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, H_q, D], got shape {tuple(q.shape)}")
    batch, s_q, h_q, d = q.shape
    if not 1 <= s_q <= MAX_QUERIES:
        raise ValueError(f"q: S_q (dim 1) must be in 1..{MAX_QUERIES} for decode, got {s_q}; use attention()")
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim must be a multiple of 8 in 8..{MAX_HEAD_DIM}, got {d}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c)
        if c.dim() != 4:
            raise ValueError(f"{name} must be [B, L_max, H_kv, D] or paged [num_pages, page_size, H_kv, D], "
                             f"got shape {tuple(c.shape)}")
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {c.stride()})")
    check_shape("v_cache", v_cache, k_cache.shape, "k_cache's shape")
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    if k_new is not None and torch.is_grad_enabled() and (k_cache.requires_grad or v_cache.requires_grad):
        # torch's own in-place ops refuse this; the append wrote silently (s38 audit)
        raise ValueError("k_cache / v_cache require grad: attention_decode appends k_new / v_new into them in "
                         "place and has no gradient; detach the caches or call it under torch.no_grad()")
    h_kv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache: head dim {k_cache.shape[3]} differs from q's {d}")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q's {h_q} heads must be a multiple of k_cache's {h_kv} kv heads (dim 2)")
    check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,))
    check_shape("cache_seqlens", cache_seqlens, (batch,), "one int32 length per batch row of q")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: batch {k_cache.shape[0]} differs from q's {batch} "
                             "(pass block_table for a paged cache)")
    else:
        check_tensor("block_table", block_table, dtypes=(torch.int32,))
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be [B={batch}, max_pages], got shape {tuple(block_table.shape)}")
        page_size = k_cache.shape[1]
        if page_size < MIN_PAGE_SIZE:
            raise ValueError(f"k_cache: page_size (dim 1 of a paged cache) must be >= {MIN_PAGE_SIZE}, got {page_size}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_tensor(name, t)
            check_shape(name, t, (batch, s_q, h_kv, d), "[B, S_q, H_kv, D]")
        check_same_dtype(q=q, k_new=k_new, v_new=v_new)
        check_writable("k_cache", k_cache, "k_new is appended to it")
        check_writable("v_cache", v_cache, "v_new is appended to it")
        if k_cache is not v_cache:
            _check_caches_disjoint(k_cache, v_cache)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                      block_table=block_table, k_new=k_new, v_new=v_new)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None (auto) or an int >= 1, got {num_splits!r}")


def _check_caches_disjoint(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """With an append, k_cache and v_cache must be one tensor or share no element: the append
    kernel writes k then v per block of heads, so where overlapping views share slots a later
    block's k landed on an earlier block's v (0.66 off against torch's append order, s43 audit;
    on a GPU, unordered writes from different threads). Eager only (dynamo cannot compare data
    pointers)."""
    if not torch.compiler.is_compiling() and may_share_elements(k_cache, v_cache):
        raise ValueError("k_cache and v_cache overlap (views sharing memory): k_new and v_new cannot both be "
                         "appended into shared slots; pass disjoint caches (a packed [.., 2, H, D] cache's "
                         "slices are fine)")


def _fast_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, options: tuple):
    """The layout key of an eager call with no gradient to build (every tensor's layout, the
    options with their types, the Triton path or not), or None where the checked path must see
    the call: the dispatcher's cases, and grad-requiring tensors under grad mode (whose refusal
    for an append into the caches ran on the checked path only: a warm fast path wrote into
    grad-requiring leaves, s43 audit)."""
    return call_key(no_grad_layout(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new), options)


def _remember(key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, n_new, left, right, softcap, scale,
              return_lse, num_splits) -> None:
    """After a checked call: keep its :class:`_DecodeCall` when the direct path launches exactly
    what the checked path did (plain tensors in their own layout: no copies made for the kernels)."""
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, k_new)
    if not key[-1] or q.numel() == 0 or q.stride(-1) != 1 or not cache_seqlens.is_contiguous():
        return
    if block_table is not None and not block_table.is_contiguous():
        return
    if k_new is not None and (k_new.stride(-1) != 1 or k_new.shape[0] * k_new.shape[1] == 0):
        return
    if not plain_tensors(*tensors):
        return
    batch, s_q, h_q, _ = q.shape
    plan = _plan_for(q, k_cache, v_cache, block_table, n_new, left, right, softcap, scale, num_splits or 0)
    _FAST.put(key, _DecodeCall(plan, n_new, (batch, h_q, s_q), return_lse, DisjointByOffset(k_cache, v_cache)))


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                     block_table: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                     v_new: torch.Tensor | None = None, causal: bool = True, window=(-1, -1), softcap: float = 0.0,
                     scale: float | None = None, return_lse: bool = False, num_splits: int | None = None):
    """Decode attention of ``q [B, S_q, H_q, D]`` (S_q 1..16) against a KV cache (module docstring).

    ``k_new``/``v_new`` ``[B, S_q, H_kv, D]`` are written into the cache IN PLACE at slots
    ``cache_seqlens[b] ..`` and attended to; ``cache_seqlens`` is not incremented. Masking as
    ``tilefuse.attention`` with the queries bottom-right aligned (causal by default). Returns
    out ``[B, S_q, H_q, D]``, and lse fp32 ``[B, H_q, S_q]`` with ``return_lse``. ``num_splits``:
    key-range splits per (row, kv head); None picks from shapes. No gradient (inference op).
    Under ``torch.autocast`` q, k_new and v_new are cast to the cache's dtype (the cache is
    written in place, so its dtype decides).

    Host path: a repeated eager call (a decode loop) takes the launches its layout and options got
    the first time, after the checks passed then (:func:`_fast_key`)."""
    if autocast_dtype(q) is not None and isinstance(k_cache, torch.Tensor):
        q, k_new, v_new = cast_to(k_cache.dtype, q, k_new, v_new)
    key = _fast_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                    (causal, window, softcap, scale, return_lse, num_splits))
    hit = _FAST.get(key)
    if hit is not None:
        if not cache_seqlens.is_cuda:
            _check_cache_values(k_cache, cache_seqlens, block_table, 0 if k_new is None else k_new.shape[1])
        return hit.run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits)
    left, right = normalize_window(causal, window)
    softcap = normalize_softcap(softcap)
    scale = normalize_scale(scale, q.shape[-1])
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    n_new = 0
    if k_new is not None:
        _append_op(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
        n_new = q.shape[1]
    out, lse = _decode_op(q, k_cache, v_cache, cache_seqlens, block_table, n_new, left, right, softcap, scale,
                          num_splits or 0)
    if key is not None:
        _remember(key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, n_new, left, right, softcap, scale,
                  return_lse, num_splits)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# registry: shape = (B, S_q, H_q, H_kv, L, D); a contiguous cache of L slots, all valid
# (cache_seqlens = L, no append): the bench's decode step reads the whole cache
# ----------------------------------------------------------------------------------------------


def _make_inputs(shape, dtype, device):
    batch, s_q, h_q, h_kv, length, d = shape
    q = torch.randn(batch, s_q, h_q, d, device=device).to(dtype)
    k_cache = torch.randn(batch, length, h_kv, d, device=device).to(dtype)
    v_cache = torch.randn(batch, length, h_kv, d, device=device).to(dtype)
    cache_seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    return Inputs((q, k_cache, v_cache, cache_seqlens))


def _bytes(shape, dtype, pass_):
    batch, s_q, h_q, h_kv, length, d = shape
    # K and V cache read once (GQA packing: once per kv head, not per query head) + q read + out
    # written + the int32 cache_seqlens read
    return (tensor_bytes((2, batch, length, h_kv, d), dtype) + 2 * tensor_bytes((batch, s_q, h_q, d), dtype)
            + tensor_bytes((batch,), torch.int32))


def _flops(shape, pass_):
    # FlashAttention's convention (4·D per visible (query, key) pair: q·k and p·v) on the exact
    # pair count: causal bottom-right (the default), query i of S_q sees L - S_q + 1 + i keys
    batch, s_q, h_q, h_kv, length, d = shape
    return attention_flops(batch, s_q, length, h_q, d, causal=True)


def _sdpa_on_slices(backend):
    """A peer with attention_decode's signature: torch SDPA (``enable_gqa``, q's dtype) on each
    row's contiguous cache slice ``[:seqlen_k]`` (one batched call when all rows have the same
    length), after the same in-place append; ``backend`` None = SDPA's own choice."""

    def run(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None, causal=True,
            window=(-1, -1), softcap=0.0, scale=None, return_lse=False, num_splits=None):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        if softcap or return_lse:
            raise NotImplementedError("torch SDPA has no softcap and returns no lse")
        left, right = normalize_window(causal, window)
        s_q = q.shape[1]
        if k_new is not None:
            _append_op(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
        lengths = [n + (s_q if k_new is not None else 0) for n in cache_seqlens.tolist()]

        def attend(rows, n):
            if block_table is None:
                k, v = k_cache[rows, :n], v_cache[rows, :n]
            else:
                k = torch.stack([_row_keys(k_cache, block_table, b, n) for b in range(rows.start, rows.stop)])
                v = torch.stack([_row_keys(v_cache, block_table, b, n) for b in range(rows.start, rows.stop)])
            mask = None    # only when some query cannot see every key (causal decode of 1 query: none)
            if left >= 0 or 0 <= right < s_q - 1:
                mask = visible_mask(s_q, n, left, right, device=q.device)
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   attn_mask=mask, scale=scale, enable_gqa=True)
            return o.transpose(1, 2)

        if len(set(lengths)) <= 1:
            return attend(slice(0, q.shape[0]), lengths[0] if lengths else 0)
        return torch.cat([attend(slice(b, b + 1), n) for b, n in enumerate(lengths)])

    return run


def _torch_peer():
    """The reference peer: SDPA's math backend (PyTorch's plain same-dtype attention)."""
    from torch.nn.attention import SDPBackend
    return _sdpa_on_slices(SDPBackend.MATH)


register(OpSpec(
    name="attention_decode",
    fn=attention_decode,
    reference=attention_decode_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(1, 1, 4, 1, 37, 32), (2, 3, 4, 2, 50, 16), (3, 1, 6, 3, 20, 8), (2, 16, 2, 2, 64, 64)],
    gpu_test_shapes=[(16, 1, 32, 8, 8192, 128), (2, 4, 32, 4, 5000, 128), (1, 16, 64, 8, 3000, 256),
                     (1, 1, 32, 8, 131072, 128)],
    bench_shapes=[(16, 1, 32, 8, 8192, 128), (1, 1, 32, 8, 32768, 128), (1, 1, 32, 8, 131072, 128)],
    peers={"torch": _torch_peer, "sdpa": lambda: _sdpa_on_slices(None)},
    has_backward=False,
    description="decode attention on a KV cache: split-KV, GQA-packed, paged, in-place append",
))
