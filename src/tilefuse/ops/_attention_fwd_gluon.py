"""FlashAttention forward, warp-specialized for Hopper (Gluon): FlashAttention-3's structure.

Why a second kernel: in the ``tl`` forward (``attention_fwd_kernel``) the eight warps of a
128x128 tile run one instruction stream, and the pipeliner's CTA barriers keep its two warp
groups in step, so the tensor core idles while both compute their softmax (0.85-0.87x cuDNN at
D = 128, S >= 4k on the H200, session 13). Here, per program (BLOCK_M = 64·CONSUMERS queries of
one (batch, head)):

- one producer warp TMA-loads each consumer group's 64 query rows once, then every key block's
  K and V tiles into a ``STAGES``-deep ring (separate ``k_ready`` / ``v_ready`` mbarriers, so the
  score GEMM can start before V lands; ``kv_empty`` counts one release per consumer group);
- each consumer warp group owns 64 query rows, with no barrier across the groups: while one runs
  its softmax, the tensor core runs the other's GEMMs (the groups drift apart by themselves);
- inside a group, block j's score GEMM and block j - 1's P·V GEMM are issued together and the
  softmax of block j runs while P·V is still in flight (FlashAttention-3's intra-warpgroup
  overlap; P stays in registers as the wgmma's A operand).

The math per key block is the ``tl`` kernel's (``_attention_fwd_kernels._block_probs``: the same
jitted helper, masking rule, softcap and exp2 split), so the two kernels agree to rounding::

    m_new = max(m, rowmax(s2)),  p = exp2(s2 - m_new),  alpha = exp2(m - m_new)
    l = l·alpha + rowsum(p),     acc = acc·alpha + p·v,  out = acc / l,  lse = ln2·(m + log2 l)

Bytes and FLOPs: the op registry's model in ``attention.py`` (the same reads and writes as the
``tl`` kernel). GPU only (Gluon has no interpreter): ``attention_forward`` takes it on sm_90 for
dense 16-bit inputs that TMA can read (``use_gluon_forward``) where it measured faster than the
``tl`` kernel (``gluon_forward_default``; H200, session 16: 0.96-1.03x cuDNN at D = 128, S >= 4k,
against the tl kernel's 0.83-0.92x); GPU tests compare it with the fp64 reference and with the
``tl`` kernel, and CI compiles it for sm_90 offline (tests/test_gluon_compile.py).
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
from ._attention_common import key_range, schedule_grid
from ._gluon_common import (
    LOADER_REGS_KERNEL, consumer_regs, host_descriptor, release_stage, resident_and_ring_barriers, smem_layout)
from ._attention_fwd_kernels import LN2, _block_probs, _desc_strides, _unmasked_key_blocks, program_block

ROWS_PER_GROUP = 64                           # query rows per consumer warp group (wgmma's M)
WG_ROWS = gl.constexpr(ROWS_PER_GROUP)


@gluon.jit
def _tile_of_program(seqlen_q, n_heads_q, group_size, BLOCK_M: gl.constexpr, REVERSE_M: gl.constexpr):
    """(start_m, b, h, hk) of this program: the ``tl`` kernel's walk (:func:`program_block`)."""
    pid_m, b, h, hk = program_block(n_heads_q, group_size, REVERSE_M)
    return pid_m * BLOCK_M, b, h, hk


@gluon.jit
def attn_load_partition(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                        kv_empty, seqlen_q, seqlen_k, n_heads_q, group_size, window_left, window_right,
                        BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        REVERSE_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                        HAS_DO: gl.constexpr):
    """The producer warp: each group's query rows (and with HAS_DO their dO rows, the backward's
    dq kernel: ``_attention_dq_gluon``), then K_j and V_j of every key block the program's
    queries can see, into stage j % STAGES once both groups have released it."""
    start_m, b, h, hk = _tile_of_program(seqlen_q, n_heads_q, group_size, WG_ROWS * CONSUMERS, REVERSE_M)
    for g in gl.static_range(CONSUMERS):
        if HAS_DO:
            mbarrier.expect(q_ready.index(g), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, h, start_m + g * WG_ROWS, 0], q_ready.index(g),
                                            do_bufs.index(g))
        else:
            mbarrier.expect(q_ready.index(g), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + g * WG_ROWS, 0], q_ready.index(g), q_bufs.index(g))
    lo, hi = key_range(start_m, WG_ROWS * CONSUMERS, seqlen_k, seqlen_k - seqlen_q, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT)
    lo_aligned = (lo // BLOCK_N) * BLOCK_N
    for start_n in range(lo_aligned, hi, BLOCK_N):
        j = (start_n - lo_aligned) // BLOCK_N
        s = j % STAGES
        # a fresh mbarrier counts as phase 1 complete: the first lap does not wait
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, start_n, 0], k_ready.index(s), k_bufs.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, start_n, 0], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _tile_2d(buf, ROWS: gl.constexpr, BLOCK_D: gl.constexpr):
    """A [1, 1, ROWS, BLOCK_D] TMA tile as the [ROWS, BLOCK_D] operand of a wgmma."""
    return buf.reshape([ROWS, BLOCK_D])


@gluon.jit
def _attend_block(acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                  start_n, lo_aligned, offs_m, seqlen_k, shift, score_scale, softcap_log2, window_left, window_right,
                  BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FOLD_SCALE: gl.constexpr,
                  EXP2_FMA_PARTS: gl.constexpr, STAGES: gl.constexpr, FIRST: gl.constexpr):
    """Key block j (keys start_n ..): its score GEMM, then (unless FIRST) block j - 1's P·V
    into acc, both in flight while block j's probabilities are formed; acc is rescaled once
    P·V has landed, and block j's probabilities come back as the next call's P."""
    s_layout: gl.constexpr = s_acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    j = (start_n - lo_aligned) // BLOCK_N
    stage = j % STAGES
    mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
    # the dead previous scores are the wgmma's C (use_acc=False): no register copies
    s_acc = warpgroup_mma(q_tile, _tile_2d(k_bufs.index(stage), BLOCK_N, BLOCK_D).permute((1, 0)), s_acc,
                          use_acc=False, is_async=True)
    if not FIRST:
        prev = (j - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, _tile_2d(v_bufs.index(prev), BLOCK_N, BLOCK_D), acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=1, deps=(s_acc,))   # scores done, P·V in flight
    else:
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    p_new, alpha, m_i = _block_probs(s_acc, m_i, offs_n, seqlen_k, offs_m, shift, score_scale, softcap_log2,
                                     window_left, window_right, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT,
                                     HAS_SOFTCAP, FOLD_SCALE, EXP2_FMA_PARTS)
    # the exp2 split hands p back in a linear form of the same layout: a relabelling, no moves
    p_new = gl.convert_layout(p_new, s_layout, assert_trivial=True)
    l_i = l_i * alpha + gl.sum(p_new, axis=1)
    if not FIRST:
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))   # p: read by the P·V in flight
        release_stage(kv_empty, (j - 1) % STAGES)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))
    acc = acc * alpha_o[:, None]
    p = gl.convert_layout(p_new.to(q_tile.dtype), p_layout)
    return acc, l_i, m_i, p, s_acc


@gluon.jit
def _attend_range(acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                  start, end, lo_aligned, offs_m, seqlen_k, shift, score_scale, softcap_log2, window_left, window_right,
                  BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FOLD_SCALE: gl.constexpr,
                  EXP2_FMA_PARTS: gl.constexpr, STAGES: gl.constexpr):
    """Key blocks start, start + BLOCK_N, .. < end (none when end <= start)."""
    for start_n in range(start, end, BLOCK_N):
        acc, l_i, m_i, p, s_acc = _attend_block(
            acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, start_n, lo_aligned,
            offs_m, seqlen_k, shift, score_scale, softcap_log2, window_left, window_right, BLOCK_N, BLOCK_D,
            MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, EXP2_FMA_PARTS, STAGES, False)
    return acc, l_i, m_i, p, s_acc


@gluon.jit
def attn_mma_partition(q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, o_desc, lse_ptr,
                       stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q, group_size,
                       score_scale, softcap_log2, window_left, window_right,
                       WG: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                       HAS_SOFTCAP: gl.constexpr, FOLD_SCALE: gl.constexpr, EXP2_FMA_PARTS: gl.constexpr,
                       REVERSE_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """One consumer warp group: query rows [WG·64, WG·64 + 64) of the program's block, over the
    key blocks of the whole block (the same walk for every group, so the ring's stages are
    released in order): masked left edge, unmasked interior, masked right edge (the
    ``tl`` kernel's three ranges), the first block peeled off as it has no P·V before it."""
    BLOCK_D: gl.constexpr = o_desc.block_type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    block_m: gl.constexpr = WG_ROWS * CONSUMERS
    start_m, b, h, hk = _tile_of_program(seqlen_q, n_heads_q, group_size, block_m, REVERSE_M)
    shift = seqlen_k - seqlen_q
    row0 = start_m + WG * WG_ROWS
    offs_m = row0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    lo, hi = key_range(start_m, block_m, seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    lo_aligned, full_lo, full_hi = _unmasked_key_blocks(start_m, lo, seqlen_k, shift, window_left, window_right,
                                                        block_m, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WG_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, o_layout)
    s_acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    q_buf = q_bufs.index(WG)
    q_tile = _tile_2d(q_buf, WG_ROWS, BLOCK_D)
    mbarrier.wait(q_ready.index(WG), 0)
    if lo_aligned < hi:
        p = gl.zeros([WG_ROWS, BLOCK_N], q_tile.dtype, gl.DotOperandLayout(0, o_layout, 2))
        acc, l_i, m_i, p, s_acc = _attend_block(
            acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, lo_aligned, lo_aligned,
            offs_m, seqlen_k, shift, score_scale, softcap_log2, window_left, window_right, BLOCK_N, BLOCK_D,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, 0, STAGES, True)
        nxt = lo_aligned + BLOCK_N
        acc, l_i, m_i, p, s_acc = _attend_range(
            acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, nxt, full_lo, lo_aligned,
            offs_m, seqlen_k, shift, score_scale, softcap_log2, window_left, window_right, BLOCK_N, BLOCK_D,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, 0, STAGES)
        acc, l_i, m_i, p, s_acc = _attend_range(
            acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, gl.maximum(nxt, full_lo),
            full_hi, lo_aligned, offs_m, seqlen_k, shift, score_scale, softcap_log2, window_left, window_right,
            BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, EXP2_FMA_PARTS, STAGES)
        acc, l_i, m_i, p, s_acc = _attend_range(
            acc, l_i, m_i, p, s_acc, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
            gl.maximum(nxt, gl.maximum(full_lo, full_hi)), hi, lo_aligned, offs_m, seqlen_k, shift, score_scale,
            softcap_log2, window_left, window_right, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            FOLD_SCALE, 0, STAGES)
        # the last block's P·V
        last = (hi - 1 - lo_aligned) // BLOCK_N
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, _tile_2d(v_bufs.index(last % STAGES), BLOCK_N, BLOCK_D), acc)
        release_stage(kv_empty, last % STAGES)

    # deferred normalization; rows that saw no key: l = 0 -> out 0, lse = -inf (m = -inf)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    lse_offs = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + offs_m
    gl.store(lse_ptr + lse_offs, lse, mask=offs_m < seqlen_q)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    # the query tile's shared memory stages the output (every score GEMM has finished reading it);
    # the descriptor clips rows past S_q
    q_tile.store(o.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_buf)
    tma.store_wait(pendings=0)


@fast_launch
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def attention_fwd_ws_kernel(
    q_desc,             # TMA descriptor of q [B, S_q, H_q, D] viewed [B, H_q, S_q, D], block [1, 1, 64, D]
    k_desc,             # of k [B, S_k, H_kv, D] viewed [B, H_kv, S_k, D], block [1, 1, BLOCK_N, D]
    v_desc,             # of v, as k
    o_desc,             # of out, as q
    lse_ptr,            # *lse float32 [B, H_q, S_q]
    stride_lb,          # lse batch stride (elements)
    stride_lh,          # lse head stride; unit stride along queries
    seqlen_q,           # S_q
    seqlen_k,           # S_k
    n_heads_q,          # H_q
    group_size,         # H_q // H_kv
    score_scale,        # scale·log2(e), or scale / softcap with softcap
    softcap_log2,       # softcap·log2(e) (unused without softcap)
    window_left,        # keys visible down to d >= -window_left (HAS_LEFT)
    window_right,       # keys visible up to d <= window_right (HAS_RIGHT)
    HAS_LEFT: gl.constexpr,         # a left window bound exists
    HAS_RIGHT: gl.constexpr,        # a right bound exists (causal is right = 0)
    HAS_SOFTCAP: gl.constexpr,      # softcap > 0
    FOLD_SCALE: gl.constexpr,       # score_scale > 0: scale folded into the exp2's FMA
    EXP2_FMA_PARTS: gl.constexpr,   # unmasked blocks: 1/this of the exp2s on the FMA pipe (0: none)
    REVERSE_M: gl.constexpr,        # heavy (late, causal) query blocks first
    STAGES: gl.constexpr,           # K/V ring depth
    CONSUMERS: gl.constexpr,        # consumer warp groups (2): BLOCK_M = 64 · CONSUMERS
    CONSUMER_REGS: gl.constexpr,    # registers per thread of the worker consumer group
):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready, k_ready, v_ready, kv_empty = resident_and_ring_barriers(CONSUMERS, STAGES)
    # the argument lists are written out: warp_specialize takes literal tuples
    gl.static_assert(CONSUMERS == 2, "two consumer warp groups (CONSUMER_GROUPS)")
    gl.warp_specialize([
        (attn_mma_partition, (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, o_desc, lse_ptr,
                              stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q, group_size, score_scale,
                              softcap_log2, window_left, window_right, 0, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                              FOLD_SCALE, EXP2_FMA_PARTS, REVERSE_M, STAGES, CONSUMERS)),
        (attn_mma_partition, (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, o_desc, lse_ptr,
                              stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q, group_size, score_scale,
                              softcap_log2, window_left, window_right, 1, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                              FOLD_SCALE, EXP2_FMA_PARTS, REVERSE_M, STAGES, CONSUMERS)),
        (attn_load_partition, (q_desc, q_desc, k_desc, v_desc, q_bufs, q_bufs, k_bufs, v_bufs, q_ready, k_ready,
                               v_ready, kv_empty, seqlen_q, seqlen_k, n_heads_q, group_size, window_left,
                               window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT, REVERSE_M, STAGES, CONSUMERS, False)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS_KERNEL])


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------

CONSUMER_GROUPS = 2
# 3 stages: a group holds blocks j - 1 (its P·V) and j (its scores) while the loader fills j + 1;
# q 32 KB + 3 x (K, V) 192 KB at D = 128 fit sm_90's 227 KB
WS_CONFIG = dict(BLOCK_N=128, STAGES=3)
GLUON_HEAD_DIMS = (64, 128)


@cached_by_view
def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """[B, S, H, D] memory as [B, H, S, D] (exact per-(batch, head) bounds), block [1, 1, rows, D]."""
    sb, ss, sh, _ = _desc_strides(t)
    b, s, h, d = t.shape
    block = (1, 1, rows, d)
    return host_descriptor(t, (b, h, s, d), (sb, sh, ss, 1), block, smem_layout(block, t.dtype))


def use_gluon_forward(dtype: torch.dtype, head_dim: int, varlen: bool, load: str) -> bool:
    """The warp-specialized kernel serves dense 16-bit inputs with D = 64 or 128 read through
    host TMA descriptors (``load`` the ``tl`` path's "desc_*"), on sm_90 exactly."""
    return (not varlen and dtype in (torch.bfloat16, torch.float16) and head_dim in GLUON_HEAD_DIMS
            and load.startswith("desc_") and load != "desc_device")


@functools.lru_cache(maxsize=256)
def _fwd_ws_plan(q_shape: tuple, k_shape: tuple, scale_arg: float, softcap_log2: float, window_left, window_right,
                 has_softcap: bool, exp2_fma_parts: int, config: tuple, sms: int) -> tuple:
    """(grid, keys per step, prepared arguments after the 4 descriptors and lse) of one launch,
    from shapes and options only (cached; ``sms``: the device's, for the program order)."""
    cfg = dict(WS_CONFIG, **dict(config))
    batch, seqlen_q, n_heads_q, _ = q_shape
    seqlen_k, n_heads_kv = k_shape[1], k_shape[2]
    block_m = ROWS_PER_GROUP * CONSUMER_GROUPS
    launch_regs, worker_regs = consumer_regs(CONSUMER_GROUPS)
    grid = schedule_grid(cdiv(seqlen_q, block_m), batch * n_heads_q,
                         window_left is not None or window_right is not None, sms, cfg.get("HEAD_GROUP"))
    prepared = attention_fwd_ws_kernel.prepare(
        (n_heads_q * seqlen_q, seqlen_q,                # lse [B, H_q, S_q] contiguous: batch, head strides
         seqlen_q, seqlen_k, n_heads_q, n_heads_q // n_heads_kv, scale_arg, softcap_log2,
         window_left if window_left is not None else 0, window_right if window_right is not None else 0),
        dict(HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None, HAS_SOFTCAP=has_softcap,
             FOLD_SCALE=scale_arg > 0, EXP2_FMA_PARTS=exp2_fma_parts, REVERSE_M=window_right is not None,
             STAGES=cfg["STAGES"], CONSUMERS=CONSUMER_GROUPS, CONSUMER_REGS=worker_regs,
             num_warps=4, maxnreg=launch_regs))
    return grid, cfg["BLOCK_N"], prepared


def launch_attention_fwd_ws(q, k, v, out, lse, *, scale_arg: float, softcap_log2: float,
                            window_left, window_right, has_softcap: bool, exp2_fma_parts: int,
                            config: dict | None = None) -> None:
    """Fills out [B, S_q, H_q, D] and lse [B, H_q, S_q] (both preallocated, contiguous)."""
    grid, block_n, prepared = _fwd_ws_plan(tuple(q.shape), tuple(k.shape), scale_arg, softcap_log2, window_left,
                                           window_right, has_softcap, exp2_fma_parts, config_key(config),
                                           num_sms(q))
    attention_fwd_ws_kernel.launch_prepared(grid, (
        _descriptor(q, ROWS_PER_GROUP), _descriptor(k, block_n), _descriptor(v, block_n),
        _descriptor(out, ROWS_PER_GROUP), lse), prepared)
