"""FlashAttention backward dk/dv kernel, warp-specialized for Hopper (Gluon).

Why a second kernel: the ``tl`` dk/dv kernel (``attention_bwd_dkdv_kernel``) runs its eight warps
as one instruction stream and Triton 3.6 waits for every non-accumulating wgmma right after issuing
it, so per query block the chain QKᵀ → exp2 → dPᵀ → dSᵀ → dK runs with the tensor core idle during
the element-wise work (582 TF/s of tensor work at D = 128, S = 16k on the H200, session 13, against
~670 for the dq kernel). Here, per program (``BLOCK_N`` = 64·CONSUMERS keys of one (batch, kv head)):

- one producer warp TMA-loads each consumer group's K and V rows once, then, for every query head
  of the GQA group and every query block that can see the program's keys, the block's Q and dO
  tiles and its lse2 / delta rows into a ``STAGES``-deep ring (``q_ready`` / ``do_ready``, and
  ``qdo_empty`` counting one release per consumer group);
- each consumer warp group owns 64 keys and their dk, dv accumulators, with no barrier across the
  groups: while one forms its probabilities, the tensor core runs the other's GEMMs;
- inside a group, per query block (scores transposed, [keys, queries], so that both products
  land in the key-major accumulators)::

      sᵀ  = K·Qᵀ          (async)              pᵀ = exp2(sᵀ·scale·log2e - lse2)   under dPᵀ
      dPᵀ = V·dOᵀ         (async)              dSᵀ = pᵀ ∘ (dPᵀ - delta) [∘ (1 - tanh²)]
      dV += pᵀ·dO,  dK += dSᵀ·Q                (async, pᵀ / dSᵀ as register A operands)

  all retired within the block (see ``_dkdv_step`` for why), in one flat loop over (query head,
  query block) with the mask as a uniform branch outside the mask-free run; at the end dk·scale
  and dv go out by TMA store through the group's K / V tiles.

The math is the ``tl`` kernel's (same exp2 form, masking rule through ``visible`` with the roles
of queries and keys swapped, softcap through ``apply_softcap``, the same mask-free block range
``free_query_blocks``), so the two agree to rounding. Differences: lse2 and delta arrive by TMA,
from a 4-aligned query row (``_query_walk``), and a query block that runs past S_q is treated as
masked (its padded rows hold padding or another sequence's statistics, zeroed by the mask, where
the ``tl`` kernel loads +inf); dense inputs only.
No atomics: dk / dv are summed over the group's query heads in registers, bitwise reproducible.

GPU only (Gluon has no interpreter): ``launch_attention_backward`` takes it on sm_90 for dense
16-bit inputs with D = 64 or 128 that TMA can read (``use_gluon_backward``), where it measured
faster than the ``tl`` kernel at every bench shape (H200, session 17: dk/dv kernel time 11-31 %
lower; the backward 0.84-0.92x cuDNN at D = 128, 0.91-0.97x at D = 64). GPU tests compare it with
the fp64 reference and the ``tl`` kernel; CI compiles it offline for sm_90
(tests/test_gluon_compile.py).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._dispatch import cdiv, num_sms
from .._launch import cached_by_view, config_key, fast_launch
from ._attention_bwd_kernels import LOG2E, free_query_blocks
from ._attention_common import apply_softcap, query_range, schedule_grid, scheduled_block, visible
from ._attention_fwd_gluon import _descriptor
from ._gluon_common import consumer_regs, host_descriptor, resident_and_ring_barriers

KEYS_PER_GROUP = 64                          # keys per consumer warp group (the wgmma's M)
WG_KEYS = gl.constexpr(KEYS_PER_GROUP)
# the producer warp's registers: 24 (setmaxnreg's minimum) leaves the consumer groups 240 each, which
# the dk, dv accumulators (128 at D = 128), sᵀ, dPᵀ (64) and the bf16 operands need
LOADER_REGS = 24
LOADER_REGS_KERNEL = gl.constexpr(LOADER_REGS)


@gluon.jit
def _key_block_of_program(n_heads_kv, BLOCK_N: gl.constexpr):
    """(start_n, b, hk): a :func:`schedule_grid` grid over (key blocks, B·H_kv); under a causal
    mask the first key blocks see the most queries, so the heavy programs start first."""
    block, pid_bh = scheduled_block(False)
    return block * BLOCK_N, pid_bh // n_heads_kv, pid_bh % n_heads_kv


@gluon.jit
def _query_walk(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """(lo, n_blocks, first_free, end_free): the query blocks lo + i·BLOCK_M the program walks
    per query head, and the mask-free run among them. lo is query_range's start rounded down to 4
    rows: TMA faults on a statistics row that does not start on 16 bytes (H200, session 17: an
    illegal instruction at S_q = 777, B = 2). Blocks that run past S_q are masked (their statistics
    columns hold the padding, the next sequence's rows or zeros past the buffer)."""
    shift = seqlen_k - seqlen_q
    lo, hi = query_range(start_n, BLOCK_N, seqlen_q, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    lo = lo // 4 * 4
    n_blocks = gl.cdiv(hi - lo, BLOCK_M)
    first_free, end_free = free_query_blocks(start_n, lo, n_blocks, shift, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    end_free = gl.maximum(gl.minimum(end_free, (seqlen_q - lo) // BLOCK_M), first_free)
    return lo, n_blocks, first_free, end_free


@gluon.jit
def dkdv_load_partition(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                        q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
                        kv_ready, q_ready, do_ready, qdo_empty,
                        seqlen_q, seqlen_k, stat_seq, n_heads_kv, group_size, window_left, window_right,
                        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
                        CONSUMERS: gl.constexpr):
    """The producer warp: each group's K and V rows, then per (query head, query block) of the
    walk the Q tile with its lse2 row (``q_ready``) and the dO tile with its delta row
    (``do_ready``), into stage it % STAGES once both groups have released it."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    start_n, b, hk = _key_block_of_program(n_heads_kv, WG_KEYS * CONSUMERS)
    for w in gl.static_range(CONSUMERS):
        mbarrier.expect(kv_ready.index(w), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, start_n + w * WG_KEYS, 0], kv_ready.index(w), k_bufs.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, hk, start_n + w * WG_KEYS, 0], kv_ready.index(w), v_bufs.index(w))
    lo, n_blocks, first_free, end_free = _query_walk(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                     BLOCK_M, WG_KEYS * CONSUMERS, HAS_LEFT, HAS_RIGHT)
    stat_col = b * stat_seq + lo
    for g in range(group_size):
        h = hk * group_size + g
        for i in range(n_blocks):
            it = g * n_blocks + i
            s = it % STAGES
            # a fresh mbarrier counts as phase 1 complete: the first lap does not wait
            mbarrier.wait(qdo_empty.index(s), ((it // STAGES) & 1) ^ 1)
            start_m = lo + i * BLOCK_M
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_ready.index(s), q_bufs.index(s))
            tma.async_copy_global_to_shared(lse_desc, [h, stat_col + i * BLOCK_M], q_ready.index(s), lse_bufs.index(s))
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, h, start_m, 0], do_ready.index(s), do_bufs.index(s))
            tma.async_copy_global_to_shared(delta_desc, [h, stat_col + i * BLOCK_M], do_ready.index(s),
                                            delta_bufs.index(s))


@gluon.jit
def _stat_row(bufs, stage, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """A [1, BLOCK_M] fp32 statistics tile of the ring as a [BLOCK_M] vector broadcast over keys."""
    return bufs.index(stage).reshape([BLOCK_M]).load(layout)


@gluon.jit
def _dkdv_step(dk, dv, k_tile, v_tile, q_bufs, do_bufs, lse_bufs, delta_bufs, q_ready, do_ready, qdo_empty, it,
               start_m, mask_block, offs_n, seqlen_q, shift, scale, score_scale, softcap, window_left, window_right,
               s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, HAS_LEFT: gl.constexpr,
               HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, STAGES: gl.constexpr):
    """One query block (ring slot ``it``): sᵀ and dPᵀ issued together, the probabilities formed
    under dPᵀ, then dSᵀ and the dV and dK GEMMs, all retired before the next block (a wgmma left
    in flight across the loop's back edge made ptxas serialize every wgmma of the kernel in session
    17's offline compiles, as did the next block's sᵀ / dPᵀ issued ahead); the other warp group's
    GEMMs fill the tensor core meanwhile."""
    stage = it % STAGES
    phase = (it // STAGES) & 1
    q_tile = q_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
    do_tile = do_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
    mbarrier.wait(q_ready.index(stage), phase)
    s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([WG_KEYS, BLOCK_M], gl.float32, s_layout),
                        use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(stage), phase)
    dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros([WG_KEYS, BLOCK_M], gl.float32, s_layout),
                         use_acc=False, is_async=True)
    s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
    lse2 = _stat_row(lse_bufs, stage, BLOCK_M, gl.SliceLayout(0, s_layout))
    if HAS_SOFTCAP:
        capped, dcap = apply_softcap(s_t * scale, softcap, HAS_SOFTCAP)
        p_t = gl.exp2(capped * LOG2E - lse2[None, :])
    else:
        p_t = gl.exp2(s_t * score_scale - lse2[None, :])
    if mask_block:
        # visible() of the transposed tile: the roles of queries and keys swapped (shift -> -shift,
        # left <-> right); it also drops the query rows past S_q
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        p_t = gl.where(visible(offs_n, offs_m, seqlen_q, -shift, window_right, window_left, HAS_RIGHT, HAS_LEFT),
                       p_t, 0.0)
    dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
    delta = _stat_row(delta_bufs, stage, BLOCK_M, gl.SliceLayout(0, s_layout))
    if mask_block:
        # padding columns are never written: not even a NaN there may reach dsᵀ = 0 · (dPᵀ - delta)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        delta = gl.where(offs_m < seqlen_q, delta, 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * dcap
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    p_op = gl.convert_layout(p_t.to(q_tile.dtype), op_layout)
    ds_op = gl.convert_layout(ds_t.to(q_tile.dtype), op_layout)
    dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
    dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
    dk, dv, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p_op, ds_op))
    # dV and dK were the last readers of this slot's Q and dO: the stage goes back to the loader
    gl.thread_barrier()
    mbarrier.arrive(qdo_empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def dkdv_mma_partition(q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, q_ready, do_ready, qdo_empty,
                       dk_desc, dv_desc, seqlen_q, seqlen_k, n_heads_kv, group_size, scale, score_scale, softcap,
                       window_left, window_right, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                       HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """One consumer warp group: keys [WG·64, WG·64 + 64) of the program's block, their dk and dv
    over the walk of the whole block (the same for every group, so the ring's stages are released
    in order): per query head, its query blocks, masked outside [first_free, end_free)."""
    BLOCK_D: gl.constexpr = dk_desc.block_type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_D, 16])
    dtype: gl.constexpr = dk_desc.dtype
    start_n, b, hk = _key_block_of_program(n_heads_kv, WG_KEYS * CONSUMERS)
    shift = seqlen_k - seqlen_q
    n0 = start_n + WG * WG_KEYS
    offs_n = n0 + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, s_layout))
    lo, n_blocks, first_free, end_free = _query_walk(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                     BLOCK_M, WG_KEYS * CONSUMERS, HAS_LEFT, HAS_RIGHT)
    k_buf = k_bufs.index(WG)
    v_buf = v_bufs.index(WG)
    k_tile = k_buf.reshape([WG_KEYS, BLOCK_D])
    v_tile = v_buf.reshape([WG_KEYS, BLOCK_D])
    dk = gl.zeros([WG_KEYS, BLOCK_D], gl.float32, acc_layout)
    dv = gl.zeros([WG_KEYS, BLOCK_D], gl.float32, acc_layout)
    mbarrier.wait(kv_ready.index(WG), 0)
    i = 0   # the query block of slot it (it = g·n_blocks + i for query head g)
    for it in range(group_size * n_blocks):
        dk, dv = _dkdv_step(
            dk, dv, k_tile, v_tile, q_bufs, do_bufs, lse_bufs, delta_bufs, q_ready, do_ready, qdo_empty, it,
            lo + i * BLOCK_M, (i < first_free) | (i >= end_free), offs_n, seqlen_q, shift, scale, score_scale,
            softcap, window_left, window_right, s_layout, BLOCK_M, BLOCK_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            STAGES)
        i = gl.where(i + 1 == n_blocks, 0, i + 1)
    # the group's own K / V tiles stage its results (its GEMMs were their only readers); the
    # descriptors clip rows past S_k
    k_tile.store((dk * scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, 0], v_buf)
    tma.store_wait(pendings=0)


@fast_launch
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def attention_bwd_dkdv_ws_kernel(
    q_desc,             # TMA descriptor of q [B, S_q, H_q, D] viewed [B, H_q, S_q, D], block [1, 1, BLOCK_M, D]
    do_desc,            # of do, as q
    k_desc,             # of k [B, S_k, H_kv, D] viewed [B, H_kv, S_k, D], block [1, 1, 64, D]
    v_desc,             # of v, as k
    dk_desc,            # of dk, as k
    dv_desc,            # of dv, as k
    lse_desc,           # of lse2 [H_q, B·stat_seq] fp32 (lse·log2 e), block [1, BLOCK_M]
    delta_desc,         # of delta [H_q, B·stat_seq] fp32 (rowsum(out·do)), as lse
    seqlen_q,           # S_q
    seqlen_k,           # S_k
    stat_seq,           # statistics columns per sequence: S_q rounded up to a multiple of 4
    n_heads_kv,         # H_kv
    group_size,         # H_q // H_kv
    scale,              # softmax scale (dk = scale·dSᵀ·Q)
    score_scale,        # scale·log2(e)
    softcap,            # logit cap (HAS_SOFTCAP)
    window_left,        # keys visible down to d >= -window_left (HAS_LEFT)
    window_right,       # keys visible up to d <= window_right (HAS_RIGHT)
    HAS_LEFT: gl.constexpr,         # a left window bound exists
    HAS_RIGHT: gl.constexpr,        # a right bound exists (causal is right = 0)
    HAS_SOFTCAP: gl.constexpr,      # softcap > 0
    STAGES: gl.constexpr,           # Q / dO ring depth
    CONSUMERS: gl.constexpr,        # consumer warp groups (2): BLOCK_N = 64 · CONSUMERS
    CONSUMER_REGS: gl.constexpr,    # registers per thread of the worker consumer group
):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
    kv_ready, q_ready, do_ready, qdo_empty = resident_and_ring_barriers(CONSUMERS, STAGES)
    # the argument lists are written out: warp_specialize takes literal tuples
    gl.static_assert(CONSUMERS == 2, "two consumer warp groups (CONSUMER_GROUPS)")
    gl.warp_specialize([
        (dkdv_mma_partition, (q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, q_ready, do_ready,
                              qdo_empty, dk_desc, dv_desc, seqlen_q, seqlen_k, n_heads_kv, group_size, scale,
                              score_scale, softcap, window_left, window_right, 0, BLOCK_M, HAS_LEFT, HAS_RIGHT,
                              HAS_SOFTCAP, STAGES, CONSUMERS)),
        (dkdv_mma_partition, (q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, q_ready, do_ready,
                              qdo_empty, dk_desc, dv_desc, seqlen_q, seqlen_k, n_heads_kv, group_size, scale,
                              score_scale, softcap, window_left, window_right, 1, BLOCK_M, HAS_LEFT, HAS_RIGHT,
                              HAS_SOFTCAP, STAGES, CONSUMERS)),
        (dkdv_load_partition, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                               lse_bufs, delta_bufs, kv_ready, q_ready, do_ready, qdo_empty, seqlen_q, seqlen_k,
                               stat_seq, n_heads_kv, group_size, window_left, window_right, HAS_LEFT, HAS_RIGHT, STAGES,
                               CONSUMERS)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS_KERNEL])


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------

CONSUMER_GROUPS = 2
# 3 stages: the loader fills blocks j + 1 and j + 2 while the groups work on j; K, V 64 KB + 3 x
# (Q, dO) 96 KB at D = 128
WS_CONFIG = dict(BLOCK_M=64, STAGES=3)


def ws_block_m(head_dim: int) -> int:
    """Queries per step: per group the fp32 sᵀ and dPᵀ tiles ([64, BLOCK_M]) sit beside the dk and
    dv accumulators ([64, D]); at D = 128 that leaves room for 64 queries, at D = 64 for 128, which
    measured faster (H200, session 17, dk/dv kernel µs at S = 1k / 4k / 16k: full 318 / 1188 / 4537
    -> 274 / 978 / 3703, causal 209 / 615 / 2183 -> 204 / 553 / 1871)."""
    return 128 if head_dim <= 64 else 64
GLUON_HEAD_DIMS = (64, 128)
STAT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@cached_by_view
def _stat_descriptor(stat: torch.Tensor, n_rows: int, block_m: int) -> TensorDescriptor:
    """lse2 / delta ``[H_q, head stride]`` fp32 (head stride a multiple of 4: TMA's 16-byte rule)
    as [H_q, n_rows], block [1, block_m]; columns past n_rows read as zeros."""
    return host_descriptor(stat, (stat.shape[0], n_rows), (stat.stride(0), 1), (1, block_m), STAT_LAYOUT)


def use_gluon_backward(dtype: torch.dtype, head_dim: int, varlen: bool, use_tma: bool) -> bool:
    """The warp-specialized dk/dv kernel serves dense 16-bit inputs with D = 64 or 128 that TMA
    can read (the caller checks for sm_90, as for the forward)."""
    return use_tma and not varlen and dtype in (torch.bfloat16, torch.float16) and head_dim in GLUON_HEAD_DIMS


@functools.lru_cache(maxsize=256)
def _dkdv_ws_plan(q_shape: tuple, k_shape: tuple, stat_seq: int, scale: float, softcap: float,
                  window_left, window_right, config: tuple, sms: int) -> tuple:
    """(grid, queries per step, prepared arguments after the 8 descriptors) of one launch, from
    shapes and options only (cached: ~40 µs of host time per backward on the H200 host; ``sms``:
    the device's, for the program order)."""
    cfg = {**WS_CONFIG, "BLOCK_M": ws_block_m(q_shape[-1]), **dict(config)}
    batch, seqlen_q, n_heads_q, _ = q_shape
    seqlen_k, n_heads_kv = k_shape[1], k_shape[2]
    launch_regs, worker_regs = consumer_regs(CONSUMER_GROUPS, LOADER_REGS, cap=240)
    grid = schedule_grid(cdiv(seqlen_k, KEYS_PER_GROUP * CONSUMER_GROUPS), batch * n_heads_kv,
                         window_left is not None or window_right is not None, sms, cfg.get("HEAD_GROUP"))
    prepared = attention_bwd_dkdv_ws_kernel.prepare(
        (seqlen_q, seqlen_k, stat_seq, n_heads_kv, n_heads_q // n_heads_kv, scale, scale * 1.4426950408889634,
         softcap, window_left if window_left is not None else 0, window_right if window_right is not None else 0),
        dict(HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None, HAS_SOFTCAP=softcap > 0,
             STAGES=cfg["STAGES"], CONSUMERS=CONSUMER_GROUPS, CONSUMER_REGS=worker_regs,
             num_warps=4, maxnreg=launch_regs))
    return grid, cfg["BLOCK_M"], prepared


def launch_attention_bwd_dkdv_ws(q, k, v, do, dk, dv, lse2, delta, stat_seq, *, scale: float, softcap: float,
                                 window_left, window_right, config: dict | None = None) -> None:
    """Fills dk and dv ([B, S_k, H_kv, D], preallocated) from the preprocess kernel's lse2 and
    delta (``[H_q, stride]``, sequence b's columns from b·stat_seq, stat_seq a multiple of 4)."""
    grid, block_m, prepared = _dkdv_ws_plan(tuple(q.shape), tuple(k.shape), stat_seq, scale, softcap,
                                            window_left, window_right, config_key(config), num_sms(q))
    n_stat = q.shape[0] * stat_seq
    attention_bwd_dkdv_ws_kernel.launch_prepared(grid, (
        _descriptor(q, block_m), _descriptor(do, block_m), _descriptor(k, KEYS_PER_GROUP),
        _descriptor(v, KEYS_PER_GROUP), _descriptor(dk, KEYS_PER_GROUP), _descriptor(dv, KEYS_PER_GROUP),
        _stat_descriptor(lse2, n_stat, block_m), _stat_descriptor(delta, n_stat, block_m)), prepared)
