"""FlashAttention backward dq kernel, warp-specialized for Hopper (Gluon).

Why a second kernel: the ``tl`` dq kernel (``attention_bwd_dq_kernel``) runs its eight warps as
one instruction stream, so per key block the chain QKᵀ → exp2 → dOVᵀ → dS → dQ runs with the
tensor core idle during the element-wise work. That costs most where the loops are short or the
exp2s weigh most: at S = 1k (B·S = 16k, H = 16) it ran its tensor work at 358 TF/s at D = 64
causal and 512 at D = 128 full, against ~670 at S = 16k (H200, session 17 sweep). Here, per
program (BLOCK_M = 64·CONSUMERS queries of one (batch, query head)), the Gluon forward's structure:

- one producer warp TMA-loads each consumer group's Q and dO rows once, then K_j and V_j of every
  key block the program's queries can see into a ``STAGES``-deep ring (the forward's loader,
  ``attn_load_partition`` with HAS_DO);
- each consumer warp group owns 64 queries and their fp32 dq accumulator, with no barrier across
  the groups: while one forms its probabilities, the tensor core runs the other's GEMMs;
- inside a group, block j's two score GEMMs and block j - 1's dQ GEMM are issued together, and
  block j's probabilities and dS are formed while dPⱼ and dQ are still in flight
  (FlashAttention-3's intra-warpgroup overlap; dS stays in registers as the wgmma's A operand)::

      s  = Q·Kⱼᵀ,   dP = dO·Vⱼᵀ,   dq += dSⱼ₋₁·Kⱼ₋₁          (async, in that order)
      p  = exp2(s·scale·log2e - lse2)  [masked]              under dP and dq
      dSⱼ = p ∘ (dP - delta)  [∘ (1 - tanh²) with softcap]  under dq
      dq = scale · Σⱼ dSⱼ·Kⱼ                                 (TMA store through the Q tile)

The math is the ``tl`` kernel's (``_dq_block``: the same exp2 form, ``visible`` masking rule,
``apply_softcap``), and the walk over key blocks is the forward's (``key_range``, the mask-free
interior from ``_unmasked_key_blocks``), so the two kernels agree to rounding. lse2 (+inf for a
query that sees no key or lies past S_q, so its p is 0) and delta come from the preprocess kernel.
No atomics: bitwise reproducible.

Bytes and FLOPs (per program): Q, dO read once, K and V once per visible key block; three GEMMs of
2·64·BLOCK_N·D per group and block. GPU only (Gluon has no interpreter): the backward launcher
takes it with the Gluon dk/dv kernel (``_attention_bwd._use_gluon``: sm_90, dense 16-bit,
TMA-readable) at D = 128 (``gluon_dq_default``: H200, session 21, dq kernel time 18-24 % below the
``tl`` kernel's at every bench shape; at D = 64 it measured 3-13 % slower, and serves there only
when a config asks, ``GLUON_DQ``). GPU tests compare it with the fp64 reference and the ``tl``
kernel, and CI compiles it offline for sm_90 (tests/test_gluon_compile.py).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .._dispatch import cdiv, num_sms
from .._launch import config_key, fast_launch
from ._attention_bwd_kernels import LOG2E
from ._attention_common import apply_softcap, key_range, schedule_grid, visible
from ._attention_fwd_gluon import _descriptor, _tile_2d, _tile_of_program, attn_load_partition
from ._attention_fwd_kernels import _unmasked_key_blocks
from ._gluon_common import LOADER_REGS_KERNEL, consumer_regs, release_stage, resident_and_ring_barriers

ROWS_PER_GROUP = 64                           # query rows per consumer warp group (wgmma's M)
WG_ROWS = gl.constexpr(ROWS_PER_GROUP)


@gluon.jit
def _dq_block(dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
              start_n, lo_aligned, offs_m, lse2, delta, seqlen_k, shift, scale, score_scale, softcap,
              window_left, window_right, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, MASKED: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              STAGES: gl.constexpr, FIRST: gl.constexpr):
    """Key block j (keys start_n ..): its s and dP GEMMs, then (unless FIRST) block j - 1's
    dq += dS·K, all in flight while block j's p and dS are formed; block j's dS comes back as the
    next call's A operand, and block j - 1's stage goes back to the loader."""
    s_layout: gl.constexpr = s_acc.type.layout
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
    j = (start_n - lo_aligned) // BLOCK_N
    stage = j % STAGES
    phase = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    # the dead previous tiles are the wgmmas' C (use_acc=False): no register copies
    s_acc = warpgroup_mma(q_tile, _tile_2d(k_bufs.index(stage), BLOCK_N, BLOCK_D).permute((1, 0)), s_acc,
                          use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(stage), phase)
    dp_acc = warpgroup_mma(do_tile, _tile_2d(v_bufs.index(stage), BLOCK_N, BLOCK_D).permute((1, 0)), dp_acc,
                           use_acc=False, is_async=True)
    if not FIRST:
        prev = (j - 1) % STAGES
        dq = warpgroup_mma(ds, _tile_2d(k_bufs.index(prev), BLOCK_N, BLOCK_D), dq, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=2, deps=(s_acc,))     # s done; dP, dq in flight
    else:
        s_acc = warpgroup_mma_wait(num_outstanding=1, deps=(s_acc,))
    if HAS_SOFTCAP:
        capped, dcap = apply_softcap(s_acc * scale, softcap, HAS_SOFTCAP)
        p = gl.exp2(capped * LOG2E - lse2[:, None])
    else:
        p = gl.exp2(s_acc * score_scale - lse2[:, None])
    if MASKED:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(visible(offs_m, offs_n, seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT),
                     p, 0.0)
    if not FIRST:
        dp_acc = warpgroup_mma_wait(num_outstanding=1, deps=(dp_acc,))   # dq still in flight
    else:
        dp_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dp_acc,))
    ds_new = p * (dp_acc - delta[:, None])
    if HAS_SOFTCAP:
        ds_new = ds_new * dcap
    if not FIRST:
        dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))   # ds: read by the dq GEMM
        release_stage(kv_empty, prev)
    ds = gl.convert_layout(ds_new.to(q_tile.dtype), ds_layout)
    return dq, ds, s_acc, dp_acc


@gluon.jit
def _dq_range(dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
              start, end, lo_aligned, offs_m, lse2, delta, seqlen_k, shift, scale, score_scale, softcap,
              window_left, window_right, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, MASKED: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, STAGES: gl.constexpr):
    """Key blocks start, start + BLOCK_N, .. < end (none when end <= start)."""
    for start_n in range(start, end, BLOCK_N):
        dq, ds, s_acc, dp_acc = _dq_block(
            dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, start_n, lo_aligned,
            offs_m, lse2, delta, seqlen_k, shift, scale, score_scale, softcap, window_left, window_right, BLOCK_N,
            BLOCK_D, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, STAGES, False)
    return dq, ds, s_acc, dp_acc


@gluon.jit
def dq_mma_partition(q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, dq_desc, lse2_ptr,
                     delta_ptr, stat_stride, stat_seq, seqlen_q, seqlen_k, n_heads_q, group_size, scale, score_scale,
                     softcap, window_left, window_right, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                     REVERSE_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """One consumer warp group: query rows [WG·64, WG·64 + 64) of the program's block, over the
    key blocks of the whole block (the same walk for every group, so the ring's stages are
    released in order): masked left edge, unmasked interior, masked right edge, the first block
    peeled off as it has no dS before it (the Gluon forward's walk)."""
    BLOCK_D: gl.constexpr = dq_desc.block_type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_D, 16])
    block_m: gl.constexpr = WG_ROWS * CONSUMERS
    start_m, b, h, hk = _tile_of_program(seqlen_q, n_heads_q, group_size, block_m, REVERSE_M)
    shift = seqlen_k - seqlen_q
    row0 = start_m + WG * WG_ROWS
    offs_m = row0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    # statistics of rows past S_q: lse2 = +inf (p = 0), delta = 0
    in_seq = offs_m < seqlen_q
    stat = h.to(gl.int64) * stat_stride + b * stat_seq + offs_m
    lse2 = gl.load(lse2_ptr + stat, mask=in_seq, other=float("inf"))
    delta = gl.load(delta_ptr + stat, mask=in_seq, other=0.0)
    lo, hi = key_range(start_m, block_m, seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    lo_aligned, full_lo, full_hi = _unmasked_key_blocks(start_m, lo, seqlen_k, shift, window_left, window_right,
                                                        block_m, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, dq_layout)
    s_acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    dp_acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    q_buf = q_bufs.index(WG)
    q_tile = _tile_2d(q_buf, WG_ROWS, BLOCK_D)
    do_tile = _tile_2d(do_bufs.index(WG), WG_ROWS, BLOCK_D)
    mbarrier.wait(q_ready.index(WG), 0)
    if lo_aligned < hi:
        ds = gl.zeros([WG_ROWS, BLOCK_N], q_tile.dtype, gl.DotOperandLayout(0, dq_layout, 2))
        dq, ds, s_acc, dp_acc = _dq_block(
            dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, lo_aligned,
            lo_aligned, offs_m, lse2, delta, seqlen_k, shift, scale, score_scale, softcap, window_left, window_right,
            BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, STAGES, True)
        nxt = lo_aligned + BLOCK_N
        dq, ds, s_acc, dp_acc = _dq_range(
            dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, nxt, full_lo,
            lo_aligned, offs_m, lse2, delta, seqlen_k, shift, scale, score_scale, softcap, window_left, window_right,
            BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, STAGES)
        dq, ds, s_acc, dp_acc = _dq_range(
            dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
            gl.maximum(nxt, full_lo), full_hi, lo_aligned, offs_m, lse2, delta, seqlen_k, shift, scale, score_scale,
            softcap, window_left, window_right, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, STAGES)
        dq, ds, s_acc, dp_acc = _dq_range(
            dq, ds, s_acc, dp_acc, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
            gl.maximum(nxt, gl.maximum(full_lo, full_hi)), hi, lo_aligned, offs_m, lse2, delta, seqlen_k, shift,
            scale, score_scale, softcap, window_left, window_right, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, STAGES)
        # the last block's dq GEMM
        last = (hi - 1 - lo_aligned) // BLOCK_N
        dq = warpgroup_mma(ds, _tile_2d(k_bufs.index(last % STAGES), BLOCK_N, BLOCK_D), dq)
        release_stage(kv_empty, last % STAGES)
    # the query tile's shared memory stages dq (every score GEMM has finished reading it); the
    # descriptor clips rows past S_q. A program whose queries see no key writes zeros.
    q_tile.store((dq * scale).to(dq_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, row0, 0], q_buf)
    tma.store_wait(pendings=0)


@fast_launch
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def attention_bwd_dq_ws_kernel(
    q_desc,             # TMA descriptor of q [B, S_q, H_q, D] viewed [B, H_q, S_q, D], block [1, 1, 64, D]
    do_desc,            # of do, as q
    k_desc,             # of k [B, S_k, H_kv, D] viewed [B, H_kv, S_k, D], block [1, 1, BLOCK_N, D]
    v_desc,             # of v, as k
    dq_desc,            # of dq, as q
    lse2_ptr,           # *lse·log2(e) [H_q, stat_stride] fp32 (+inf for rows that see no key)
    delta_ptr,          # *rowsum(out·do), as lse2
    stat_stride,        # head stride of lse2 / delta
    stat_seq,           # statistics columns per sequence (sequence b's start at b·stat_seq)
    seqlen_q,           # S_q
    seqlen_k,           # S_k
    n_heads_q,          # H_q
    group_size,         # H_q // H_kv
    scale,              # softmax scale (dq = scale·dS·K)
    score_scale,        # scale·log2(e)
    softcap,            # logit cap (HAS_SOFTCAP)
    window_left,        # keys visible down to d >= -window_left (HAS_LEFT)
    window_right,       # keys visible up to d <= window_right (HAS_RIGHT)
    HAS_LEFT: gl.constexpr,         # a left window bound exists
    HAS_RIGHT: gl.constexpr,        # a right bound exists (causal is right = 0)
    HAS_SOFTCAP: gl.constexpr,      # softcap > 0
    REVERSE_M: gl.constexpr,        # heavy (late, causal) query blocks first
    STAGES: gl.constexpr,           # K/V ring depth
    CONSUMERS: gl.constexpr,        # consumer warp groups (2): BLOCK_M = 64 · CONSUMERS
    CONSUMER_REGS: gl.constexpr,    # registers per thread of the worker consumer group
):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [CONSUMERS] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready, k_ready, v_ready, kv_empty = resident_and_ring_barriers(CONSUMERS, STAGES)
    # the argument lists are written out: warp_specialize takes literal tuples
    gl.static_assert(CONSUMERS == 2, "two consumer warp groups (CONSUMER_GROUPS)")
    gl.warp_specialize([
        (dq_mma_partition, (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, dq_desc, lse2_ptr,
                            delta_ptr, stat_stride, stat_seq, seqlen_q, seqlen_k, n_heads_q, group_size, scale,
                            score_scale, softcap, window_left, window_right, 0, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                            HAS_SOFTCAP, REVERSE_M, STAGES, CONSUMERS)),
        (dq_mma_partition, (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, dq_desc, lse2_ptr,
                            delta_ptr, stat_stride, stat_seq, seqlen_q, seqlen_k, n_heads_q, group_size, scale,
                            score_scale, softcap, window_left, window_right, 1, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                            HAS_SOFTCAP, REVERSE_M, STAGES, CONSUMERS)),
        (attn_load_partition, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready,
                               v_ready, kv_empty, seqlen_q, seqlen_k, n_heads_q, group_size, window_left,
                               window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT, REVERSE_M, STAGES, CONSUMERS, True)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS_KERNEL])


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------

CONSUMER_GROUPS = 2


def dq_ws_config(head_dim: int, softcap: bool) -> dict:
    """Keys per step and ring depth. Per group the fp32 s and dP tiles ([64, BLOCK_N]) sit beside
    the dq accumulator ([64, D]) and the previous block's dS operand: 64 keys at D = 128 (32 + 32
    + 64 + 16 registers a thread), 128 at D = 64 (64 + 64 + 32 + 32), but 64 with a softcap, whose
    derivative tile spilled 524 B at 128 (offline sm_90 compile). Shared memory: Q, dO
    2·2·64·D·2 bytes + STAGES × K, V 2·BLOCK_N·D·2 bytes: 64 + 4 × 32 KB at D = 128."""
    return dict(BLOCK_N=128 if head_dim <= 64 and not softcap else 64, STAGES=4)


@functools.lru_cache(maxsize=256)
def _dq_ws_plan(q_shape: tuple, k_shape: tuple, stat_stride: int, stat_seq: int, scale: float, softcap: float,
                window_left, window_right, config: tuple, sms: int) -> tuple:
    """(grid, keys per step, prepared arguments after the 7 leading descriptors and tensors) of
    one launch, from shapes and options only (cached, as the dk/dv kernel's)."""
    cfg = {**dq_ws_config(q_shape[-1], softcap > 0), **dict(config)}
    batch, seqlen_q, n_heads_q, _ = q_shape
    seqlen_k, n_heads_kv = k_shape[1], k_shape[2]
    launch_regs, worker_regs = consumer_regs(CONSUMER_GROUPS)
    grid = schedule_grid(cdiv(seqlen_q, ROWS_PER_GROUP * CONSUMER_GROUPS), batch * n_heads_q,
                         window_left is not None or window_right is not None, sms, cfg.get("HEAD_GROUP"))
    prepared = attention_bwd_dq_ws_kernel.prepare(
        (stat_stride, stat_seq, seqlen_q, seqlen_k, n_heads_q, n_heads_q // n_heads_kv, scale,
         scale * 1.4426950408889634, softcap, window_left if window_left is not None else 0,
         window_right if window_right is not None else 0),
        dict(HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None, HAS_SOFTCAP=softcap > 0,
             REVERSE_M=window_right is not None, STAGES=cfg["STAGES"], CONSUMERS=CONSUMER_GROUPS,
             CONSUMER_REGS=worker_regs, num_warps=4, maxnreg=launch_regs))
    return grid, cfg["BLOCK_N"], prepared


def launch_attention_bwd_dq_ws(q, k, v, do, dq, lse2, delta, stat_seq, *, scale: float, softcap: float,
                               window_left, window_right, config: dict | None = None) -> None:
    """Fills dq ([B, S_q, H_q, D], preallocated) from the preprocess kernel's lse2 and delta
    (``[H_q, stride]``, sequence b's columns from b·stat_seq)."""
    grid, block_n, prepared = _dq_ws_plan(tuple(q.shape), tuple(k.shape), lse2.stride(0), stat_seq, scale, softcap,
                                          window_left, window_right, config_key(config), num_sms(q))
    attention_bwd_dq_ws_kernel.launch_prepared(grid, (
        _descriptor(q, ROWS_PER_GROUP), _descriptor(do, ROWS_PER_GROUP), _descriptor(k, block_n),
        _descriptor(v, block_n), _descriptor(dq, ROWS_PER_GROUP), lse2, delta), prepared)
