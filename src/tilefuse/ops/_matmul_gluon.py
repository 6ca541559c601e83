"""Warp-specialized GEMM on Hopper (Gluon): a deep TMA ring; bf16 / fp16, and fp8 operands.

    out[M, N] = a[M, K] @ w[N, K]ᵀ        (x @ w.t(): nn.Linear's weight, K-contiguous)
    out[M, N] = a[M, K] @ b[K, N]         (row-major b: dy @ w, nn.Linear's input gradient)
    out[M, N] = (aᵀ)ᵀ @ b                 (a given M-major: dyᵀ @ x, the weight gradient; large M)

Why a second GEMM: at M ≤ 256 the GEMM streams the weight once (memory-bound) and each SM's
share of it must keep enough bytes in flight. ncu on the ``tl`` kernel at 128x4096x4096 (H200,
2026-11-24): 45 % of L2 throughput, 38 % of DRAM, 19.4 µs against cuBLAS's 16.0 µs, with the
same 134 MB moved from L2 to the SMs; cuBLAS runs a 13-stage ring of 64-deep K steps with
a producer warp group. Here:

- one producer warp issues the TMA loads of a ``STAGES``-deep ring (``ready`` / ``empty`` mbarriers),
  from descriptors built on the host (no in-kernel descriptor creation at the start of the launch);
- ``CONSUMERS`` warp groups each own 64 rows of the tile and share its B tile; each keeps one
  wgmma in flight and releases a stage once the wgmma that read it has finished;
- the output tile goes out through shared memory and a TMA store;
- a tile width that is not a power of two (96) is two B parts that are (64 + 32): two TMA loads
  per stage, two accumulators, two epilogues (Triton's blocks are powers of two).

At large M the same kernel with 128x256 tiles (two 64x256 consumer groups, the tile cuBLAS's
nvjet kernels use) is compute-bound and beats the ``tl`` kernel by ~2 % (``choose_large_ws_tile``).

``PINGPONG`` (a config key): each consumer group takes alternate tiles whole (128x128, two
64-row accumulators) and the groups' K loops take turns, so one group's epilogue runs under the
other's wgmmas (``gemm_pingpong_partition``). It pays where K is short: linear cross-entropy's
accumulating grad_weight GEMMs (K = 640 tokens), 2-6 % faster than the cooperative 128x256 tile
there and 5-10 % than the cuBLAS call it replaced (H200, 2026-12-02, three probes); at K = 4096
the 128x128 tile's extra L2 traffic costs more than the epilogue it hides (8192³: 651 against
699 TF/s), so plain GEMMs keep the cooperative tiles.

fp8 (e4m3 / e5m2, K-major both: sm_90's 8-bit wgmma reads no other layout) with fast accumulation
(the wgmma accumulator over the whole K, as ``_scaled_mm(use_fast_accum=True)``): the same kernel
with 128-deep K steps (the 16-bit tiles' stage bytes; ``wgmma_layout`` takes 32 K per instruction)
and the dequantization scales in the epilogue (SCALE_A / SCALE_B, :func:`_scaled`), planned by
``_fp8_gemm.fast_gluon_plan``: 1.01-1.07x ``_scaled_mm`` fast at 4096³, 8192³ and 8192x4096x4096
(0.99-1.09x at the other Llama shapes), where the fp8 ``tl`` kernel ran 0.94-1.00x (0.93x) (H200,
2026-12-02, two probes: scripts/fp8_ws_probe.py, scripts/stream_k_probe.py --layouts fp8).

The tiles, the heuristics that choose them and the launchers: ``_matmul_gluon_plan``.
GPU only (Gluon has no interpreter).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .._launch import fast_launch
from ._gluon_common import (LOADER_REGS_KERNEL, WG_ROWS, accumulator_barriers,
                             gemm_load_partition, gemm_ring, release_stage)
from ._activation_math import activation_fwd
from ._matmul_kernels import _tile_coords
from ._stream_k import stream_k_add, stream_k_publish, stream_k_run, stream_k_wait


@gluon.constexpr_function
def wgmma_layout(block_n, operand_dtype):
    """The accumulator layout of one consumer warp group's [64, block_n] wgmma tile. An
    instruction reduces 32 bytes of K: 16 elements of a 16-bit operand, 32 of an fp8 one."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, block_n, 256 // operand_dtype.primitive_bitwidth])


@gluon.jit
def _gemm_epilogue(acc, c_desc, c_smem, bias_ptr, residual_ptr, preact_ptr, scale_a_ptr, scale_b_ptr, off_m, off_n,
                   M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
                   HAS_RESIDUAL: gl.constexpr, SAVE_PREACT: gl.constexpr, SCALE_A: gl.constexpr,
                   SCALE_B: gl.constexpr):
    """The output tile at (off_m, off_n), as the tl kernel's: z = acc · scale_a · scale_b + bias;
    [preact = z]; out = act(z) + residual, stored through shared memory and a TMA store (rows /
    columns past the edges are clipped by the descriptor)."""
    y = _epilogue_value(acc, c_desc, bias_ptr, residual_ptr, preact_ptr, scale_a_ptr, scale_b_ptr, off_m, off_n,
                        M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT, SCALE_A,
                        SCALE_B)
    tma.store_wait(pendings=0)      # the last tile's store has left c_smem
    c_smem.store(y.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _accumulate_epilogue(acc, old, c_desc, c_smem, off_m, off_n, scale_ptr, HAS_SCALE: gl.constexpr):
    """out = old + acc (HAS_SCALE: times scale_ptr[0], one fp32 value) for the tile at (off_m,
    off_n): ``old`` was TMA-loaded into ``c_smem`` by the producer during the K loop and read by
    _mma_k_steps; the sum goes back out through the same staging tile (the next tile's first K
    step hands it back to the producer)."""
    y = acc + old.to(gl.float32)
    if HAS_SCALE:
        y = y * gl.load(scale_ptr)
    gl.thread_barrier()             # every warp has read the old tile before any overwrites it
    c_smem.store(y.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


# A timeline probe of the persistent schedule (scripts/stream_k_trace.py): with TRACE set before the
# first compile, each consumer group stores %globaltimer at TRACE_EVENTS points of its run into
# preact_ptr (an int64 buffer there; the traced launches save no pre-activation). Off: no code.
TRACE = gl.constexpr(False)
TRACE_EVENTS = gl.constexpr(8)


@gluon.jit
def _trace(ptr, event: gl.constexpr, WG: gl.constexpr, CONSUMERS: gl.constexpr):
    """Store the global timer (ns) as ``event`` of this program's group WG (TRACE only)."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                        pack=1)
        slot = gl.program_id(0) * CONSUMERS + WG
        gl.store(ptr.to(gl.pointer_type(gl.int64), bitcast=True) + slot * TRACE_EVENTS + event, now)


@gluon.jit
def _scaled(acc, scale_a_ptr, scale_b_ptr, off_m, off_n, M, N, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr):
    """acc · scale_a · scale_b for the tile at (off_m, off_n): an fp8 product's dequantization.
    SCALE_A: 0 none, 1 one fp32 value (scale_a_ptr[0]), 2 one per row (scale_a_ptr[row]); SCALE_B
    likewise, 2 being one per output column."""
    layout: gl.constexpr = acc.type.layout
    if SCALE_A == 1:
        acc = acc * gl.load(scale_a_ptr)
    elif SCALE_A == 2:
        rows = off_m + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, layout))
        acc = acc * gl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)[:, None]
    if SCALE_B == 1:
        acc = acc * gl.load(scale_b_ptr)
    elif SCALE_B == 2:
        cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        acc = acc * gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)[None, :]
    return acc


@gluon.jit
def _epilogue_value(acc, c_desc, bias_ptr, residual_ptr, preact_ptr, scale_a_ptr, scale_b_ptr, off_m, off_n, M, N,
                    stride_rm, stride_rn, stride_pm, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
                    HAS_RESIDUAL: gl.constexpr, SAVE_PREACT: gl.constexpr, SCALE_A: gl.constexpr,
                    SCALE_B: gl.constexpr):
    """act(acc · scale_a · scale_b + bias) + residual of the tile at (off_m, off_n) in fp32 (and
    the pre-activation stored, SAVE_PREACT)."""
    layout: gl.constexpr = acc.type.layout
    rows = off_m + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(gl.int64)
    z = _scaled(acc, scale_a_ptr, scale_b_ptr, off_m, off_n, M, N, SCALE_A, SCALE_B)
    if HAS_BIAS:
        z += gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
    if SAVE_PREACT:
        gl.store(preact_ptr + rows64[:, None] * stride_pm + cols[None, :], z.to(preact_ptr.dtype.element_ty),
                 mask=mask)
    y = activation_fwd(z, ACT, c_desc.dtype == gl.float32)
    if HAS_RESIDUAL:
        y += gl.load(residual_ptr + rows64[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask,
                     other=0.0).to(gl.float32)
    return y


@gluon.jit
def _a_piece(a_bufs, i, A_M_MAJOR: gl.constexpr):
    """The ring's ``i``-th 64-row A piece as wgmma's A operand ([BLOCK_K, 64] pieces of an M-major
    A are read transposed: wgmma takes an M-major 16-bit A from shared memory)."""
    if A_M_MAJOR:
        return a_bufs.index(i).permute((1, 0))
    else:
        return a_bufs.index(i)


@gluon.jit
def _b_tile(bufs, s, B_K_MAJOR: gl.constexpr):
    """Stage ``s``'s B tile as wgmma's B operand ([BLOCK_N, BLOCK_K] of a K-major b, transposed)."""
    if B_K_MAJOR:
        return bufs.index(s).permute((1, 0))
    else:
        return bufs.index(s)


@gluon.jit
def _mma_k_steps(acc, acc2, a_bufs, b_bufs, b2_bufs, ready, empty, it, steps, c_smem, c_ready, c_free, order,
                 free_staging, phase, WG: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr,
                 HAS_B2: gl.constexpr, A_M_MAJOR: gl.constexpr, ACCUMULATE: gl.constexpr, PINGPONG: gl.constexpr):
    """(acc, acc2) + the ring's ``steps`` (>= 1) K steps from step ``it`` (acc2: the B tile's second
    part, HAS_B2; PINGPONG: the tile's second 64-row A piece against the same B), one step's
    wgmmas in flight; each stage goes back to the producer once the wgmmas that read it have
    finished (PINGPONG: the stages are this group's alone, and once the last step's wgmmas are
    issued the other group may start its tile: ``order``, see gemm_pingpong_partition).
    A_M_MAJOR: see :func:`_a_piece`.

    ACCUMULATE and ``free_staging`` (the previous tile's TMA store is out): once the first step's
    wgmmas are issued, wait for that store to have read the output staging tile and hand it to the
    producer (``c_free``) for this tile's old output. Waiting right after issuing the store
    instead idled the tensor cores: 1.145 against 0.880 ms without the accumulator at M = 128256,
    N = 4096, K = 512 (H200, 2026-11-25, scripts/gemm_accumulate_probe.py; 1.010 after). And
    while the last step's wgmmas run, wait for the old tile (``c_ready``, ``phase``) and read it
    from ``c_smem`` into registers, returned in place of acc2 (in the output dtype; not PINGPONG,
    whose epilogue reads its staging tiles itself while the other group's wgmmas run)."""
    TWO: gl.constexpr = HAS_B2 or PINGPONG      # two accumulators
    for ki in range(steps):
        s = (it + ki) % STAGES
        mbarrier.wait(ready.index(s), ((it + ki) // STAGES) & 1)
        if PINGPONG:
            a = _a_piece(a_bufs, CONSUMERS * s, A_M_MAJOR)
            acc = warpgroup_mma(a, _b_tile(b_bufs, s, B_K_MAJOR), acc, is_async=True)
            a2 = _a_piece(a_bufs, CONSUMERS * s + 1, A_M_MAJOR)
            acc2 = warpgroup_mma(a2, _b_tile(b_bufs, s, B_K_MAJOR), acc2, is_async=True)
            if ki == steps - 1:
                release_stage(order, 1 - WG)
        else:
            a = _a_piece(a_bufs, CONSUMERS * s + WG, A_M_MAJOR)
            acc = warpgroup_mma(a, _b_tile(b_bufs, s, B_K_MAJOR), acc, is_async=True)
            if HAS_B2:
                acc2 = warpgroup_mma(a, _b_tile(b2_bufs, s, B_K_MAJOR), acc2, is_async=True)
        # the previous step's wgmmas are done once at most this step's are outstanding: free its stage
        if TWO:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if ki > 0:
            release_stage(empty, (it + ki + STAGES - 1) % STAGES)
        elif ACCUMULATE:
            if free_staging:
                tma.store_wait(pendings=0)
                release_stage(c_free, WG)
    if ACCUMULATE and not PINGPONG:
        mbarrier.wait(c_ready.index(WG), phase)
        acc2 = c_smem.load(acc.type.layout)
    if TWO:
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    release_stage(empty, (it + steps + STAGES - 1) % STAGES)
    return acc, acc2


@gluon.jit
def gemm_mma_partition(a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c2_desc, c_smem, c2_smem, c_ready, c_free,
                       bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, ws_ptr, flag_ptr, M, N, K,
                       stride_rm, stride_rn, stride_pm, sk_tiles, WG: gl.constexpr,
                       HAS_BIAS: gl.constexpr, ACT: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                       SAVE_PREACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
                       BLOCK_N1: gl.constexpr, BLOCK_N2: gl.constexpr, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr,
                       A_M_MAJOR: gl.constexpr, ACCUMULATE: gl.constexpr, HAS_SCALE: gl.constexpr,
                       SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, STREAM_K: gl.constexpr):
    """One consumer warp group: rows [WG·64, WG·64 + 64) of each tile of this program, columns
    [0, BLOCK_N1) in one accumulator and, when BLOCK_N2 > 0, [BLOCK_N1, BLOCK_N1 + BLOCK_N2) in a
    second (a tile of two power-of-two widths, e.g. 96 = 64 + 32). ACCUMULATE: out += a @ b, the
    old tile from the producer (one B part; no bias, activation or residual), times scale_ptr[0]
    with HAS_SCALE. Otherwise SCALE_A / SCALE_B (fp8 operands): the product times scale_ptr's and
    scale_b_ptr's values (:func:`_scaled`). STREAM_K: the last ``sk_tiles`` tiles are cut along K
    (``_stream_k``)."""
    HAS_B2: gl.constexpr = BLOCK_N2 > 0
    mma_layout: gl.constexpr = wgmma_layout(BLOCK_N1, a_bufs.dtype)
    num_pid_m = gl.cdiv(M, WG_ROWS * CONSUMERS)
    num_pid_n = gl.cdiv(N, BLOCK_N1 + BLOCK_N2)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    tile_count = 0
    dp_tiles = num_pid_m * num_pid_n - sk_tiles
    _trace(preact_ptr, 0, WG, CONSUMERS)
    for tile_id in range(gl.program_id(0), dp_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * (WG_ROWS * CONSUMERS) + WG * WG_ROWS
        off_n = pid_n * (BLOCK_N1 + BLOCK_N2)
        acc = gl.zeros([WG_ROWS, BLOCK_N1], gl.float32, mma_layout)
        if HAS_B2:
            mma_layout2: gl.constexpr = wgmma_layout(BLOCK_N2, a_bufs.dtype)
            acc2 = gl.zeros([WG_ROWS, BLOCK_N2], gl.float32, mma_layout2)
        else:
            acc2 = acc
        acc, acc2 = _mma_k_steps(acc, acc2, a_bufs, b_bufs, b2_bufs, ready, empty, it, k_tiles, c_smem, c_ready,
                                 c_free, ready, tile_count > 0, tile_count & 1, WG, STAGES, CONSUMERS, B_K_MAJOR, HAS_B2,
                                 A_M_MAJOR, ACCUMULATE, False)
        it += k_tiles
        if ACCUMULATE:
            _accumulate_epilogue(acc, acc2, c_desc, c_smem, off_m, off_n, scale_ptr, HAS_SCALE)
        else:
            _gemm_epilogue(acc, c_desc, c_smem, bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, off_m,
                           off_n, M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT,
                           SCALE_A, SCALE_B)
            if HAS_B2:
                _gemm_epilogue(acc2, c2_desc, c2_smem, bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr,
                               off_m, off_n + BLOCK_N1, M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS, ACT,
                               HAS_RESIDUAL, SAVE_PREACT, SCALE_A, SCALE_B)
        tile_count += 1
    _trace(preact_ptr, 1, WG, CONSUMERS)
    if STREAM_K:
        gl.static_assert(not (ACCUMULATE or HAS_B2), "stream-K: plain tiles of one B part")
        first, a, last, b = stream_k_run(gl.program_id(0), sk_tiles, k_tiles, NUM_PROGRAMS)
        slot = gl.program_id(0) * CONSUMERS + WG
        # 1. the tiles this run covers whole
        for t in range(first + (a > 0).to(gl.int32), last + (b == k_tiles).to(gl.int32)):
            acc = _plain_k_steps(a_bufs, b_bufs, ready, empty, it, k_tiles, c_smem, mma_layout, WG, BLOCK_N1,
                                 STAGES, CONSUMERS, B_K_MAJOR, A_M_MAJOR)
            it += k_tiles
            off_m, off_n = _group_tile_offsets(dp_tiles + t, num_pid_m, num_pid_n, WG, GROUP_M, BLOCK_N1, CONSUMERS)
            _gemm_epilogue(acc, c_desc, c_smem, bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, off_m,
                           off_n, M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT,
                           SCALE_A, SCALE_B)
        _trace(preact_ptr, 2, WG, CONSUMERS)
        # 2. the head of the tile it ends in: a partial for the next program
        if b < k_tiles:
            acc = _plain_k_steps(a_bufs, b_bufs, ready, empty, it, b, c_smem, mma_layout, WG, BLOCK_N1, STAGES,
                                 CONSUMERS, B_K_MAJOR, A_M_MAJOR)
            it += b
            # the head carries the tile's scales and bias, so the tail's epilogue applies neither
            off_m, off_n = _group_tile_offsets(dp_tiles + last, num_pid_m, num_pid_n, WG, GROUP_M, BLOCK_N1,
                                               CONSUMERS)
            acc = _scaled(acc, scale_ptr, scale_b_ptr, off_m, off_n, M, N, SCALE_A, SCALE_B)
            if HAS_BIAS:
                acc += _bias_row(acc, bias_ptr, off_n, N)
            stream_k_publish(acc, ws_ptr, flag_ptr, slot)
        _trace(preact_ptr, 3, WG, CONSUMERS)
        # 3. the tail of the tile it starts in, plus the previous program's head of it (which the
        # producer has asked L2 for, ~STAGES K steps ahead: gemm_load_partition)
        if a > 0:
            acc = _plain_k_steps(a_bufs, b_bufs, ready, empty, it, k_tiles - a, c_smem, mma_layout, WG, BLOCK_N1,
                                 STAGES, CONSUMERS, B_K_MAJOR, A_M_MAJOR)
            it += k_tiles - a
            off_m, off_n = _group_tile_offsets(dp_tiles + first, num_pid_m, num_pid_n, WG, GROUP_M, BLOCK_N1,
                                               CONSUMERS)
            acc = _scaled(acc, scale_ptr, scale_b_ptr, off_m, off_n, M, N, SCALE_A, SCALE_B)    # its own K steps
            _trace(preact_ptr, 4, WG, CONSUMERS)
            stream_k_wait(flag_ptr, slot - CONSUMERS)
            _trace(preact_ptr, 5, WG, CONSUMERS)
            acc = stream_k_add(acc, ws_ptr, slot - CONSUMERS)
            _gemm_epilogue(acc, c_desc, c_smem, bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, off_m,
                           off_n, M, N, stride_rm, stride_rn, stride_pm, False, ACT, HAS_RESIDUAL, SAVE_PREACT, 0, 0)
    _trace(preact_ptr, 7, WG, CONSUMERS)
    tma.store_wait(pendings=0)
    _trace(preact_ptr, 6, WG, CONSUMERS)


@gluon.jit
def gemm_pingpong_partition(a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ready, c_free, order, bias_ptr,
                            residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, M, N, K, stride_rm, stride_rn,
                            stride_pm, WG: gl.constexpr,
                            HAS_BIAS: gl.constexpr, ACT: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                            SAVE_PREACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                            B_K_MAJOR: gl.constexpr, A_M_MAJOR: gl.constexpr, ACCUMULATE: gl.constexpr,
                            HAS_SCALE: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr):
    """One consumer warp group of a ping-pong schedule: tiles WG, WG + 2, ... of this program's
    walk, each whole (128 rows as two 64-row accumulators against the stage's one B tile), so
    that one group's epilogue (and, ACCUMULATE, its read of the old tile) runs while the other
    group's wgmmas keep the tensor cores busy; the cooperative schedule (both groups on one tile)
    leaves them idle for every epilogue. Tile j's K steps are ring steps [j·k, (j+1)·k) of the
    producer's walk, k = cdiv(K, BLOCK_K); staging tiles c_bufs[2·WG], c_bufs[2·WG + 1].

    The groups' K loops take turns (``order``: one mbarrier per group, raised by the other once
    it has issued its tile's last wgmmas): a ring slot's ``ready`` phase names its lap only
    modulo 2, so a group that waited on a step whose slot's previous lap (the other group's
    tile) had not yet landed would pass on the wrong lap. Group 0's first tile does not wait."""
    mma_layout: gl.constexpr = wgmma_layout(BLOCK_N, a_bufs.dtype)
    num_pid_m = gl.cdiv(M, 2 * WG_ROWS)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    lo = c_bufs.index(2 * WG)
    hi = c_bufs.index(2 * WG + 1)
    t = 0
    for tile_id in range(gl.program_id(0) + WG * NUM_PROGRAMS, num_pid_m * num_pid_n, 2 * NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * (2 * WG_ROWS)
        off_n = pid_n * BLOCK_N
        acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, mma_layout)
        acc2 = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, mma_layout)
        # a fresh mbarrier counts as phase 1 complete: group 0's first wait passes
        mbarrier.wait(order.index(WG), (t & 1) ^ (1 - WG))
        acc, acc2 = _mma_k_steps(acc, acc2, a_bufs, b_bufs, b_bufs, ready, empty, (2 * t + WG) * k_tiles, k_tiles,
                                 lo, c_ready, c_free, order, t > 0, 0, WG, STAGES, 2, B_K_MAJOR, False, A_M_MAJOR,
                                 ACCUMULATE, True)
        if ACCUMULATE:
            mbarrier.wait(c_ready.index(WG), t & 1)
            _accumulate_epilogue(acc, lo.load(mma_layout), c_desc, lo, off_m, off_n, scale_ptr, HAS_SCALE)
            _accumulate_epilogue(acc2, hi.load(mma_layout), c_desc, hi, off_m + WG_ROWS, off_n, scale_ptr,
                                 HAS_SCALE)
        else:
            _gemm_epilogue(acc, c_desc, lo, bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, off_m, off_n,
                           M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT, SCALE_A,
                           SCALE_B)
            _gemm_epilogue(acc2, c_desc, hi, bias_ptr, residual_ptr, preact_ptr, scale_ptr, scale_b_ptr,
                           off_m + WG_ROWS, off_n, M, N, stride_rm, stride_rn, stride_pm, HAS_BIAS, ACT, HAS_RESIDUAL,
                           SAVE_PREACT, SCALE_A, SCALE_B)
        t += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _bias_row(acc, bias_ptr, off_n, N):
    """bias[off_n:] as a [1, acc's columns] fp32 row in ``acc``'s layout."""
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
    return gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]


@gluon.jit
def _plain_k_steps(a_bufs, b_bufs, ready, empty, it, steps, c_smem, layout: gl.constexpr, WG: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr,
                   A_M_MAJOR: gl.constexpr):
    """A fresh accumulator through ``steps`` ring steps from ``it`` (one B part, no old output):
    the stream-K region's whole tiles, heads and tails."""
    acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout)
    acc, _ = _mma_k_steps(acc, acc, a_bufs, b_bufs, b_bufs, ready, empty, it, steps, c_smem, ready, empty, ready,
                          False, 0,
                          WG, STAGES, CONSUMERS, B_K_MAJOR, False, A_M_MAJOR, False, False)
    return acc


@gluon.jit
def _group_tile_offsets(tile_id, num_pid_m, num_pid_n, WG: gl.constexpr, GROUP_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr):
    """(first row, first column) of consumer group WG's part of tile ``tile_id`` (grouped order)."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    return pid_m * (WG_ROWS * CONSUMERS) + WG * WG_ROWS, pid_n * BLOCK_N


@fast_launch
@gluon.jit
def gemm_ws_kernel(
    a_desc,             # TMA descriptor of a [M, K], block [64, BLOCK_K]; A_M_MAJOR: of aᵀ [K, M], block [BLOCK_K, 64]
    b_desc,             # TMA descriptor of b: [N, K] block [BLOCK_N1, BLOCK_K] (B_K_MAJOR), else [K, N] block [BLOCK_K, BLOCK_N1]
    b2_desc,            # the same with BLOCK_N2 columns: the tile's second part (ignored unless HAS_B2)
    c_desc,             # TMA descriptor of out [M, N], block [64, BLOCK_N1]
    c2_desc,            # the same with block [64, BLOCK_N2] (ignored unless HAS_B2)
    bias_ptr,           # *bias [N], contiguous (ignored unless HAS_BIAS)
    residual_ptr,       # *residual [M, N], output dtype (ignored unless HAS_RESIDUAL)
    preact_ptr,         # *pre-activation a @ b + bias [M, N], row-major (ignored unless SAVE_PREACT)
    scale_ptr,          # *fp32 [1]: out = scale · (out + a @ b) (HAS_SCALE); else scale_a (SCALE_A)
    scale_b_ptr,        # *fp32 [1] or [N]: scale_b (ignored unless SCALE_B)
    ws_ptr,             # *fp32 [NUM_PROGRAMS · CONSUMERS, 64, BLOCK_N1] stream-K partials (ignored unless STREAM_K)
    flag_ptr,           # *int32 [NUM_PROGRAMS · CONSUMERS] their flags, zero between launches (ditto)
    M,                  # rows of a and out
    N,                  # columns of b and out
    K,                  # the reduced dimension (> 0)
    stride_rm,          # elements between rows of residual
    stride_rn,          # elements between columns of residual
    stride_pm,          # elements between rows of preact
    sk_tiles,           # tiles at the end of the tile order cut along K (_stream_k.stream_k_tiles; 0: none)
    HAS_BIAS: gl.constexpr,         # add bias[N] before the activation
    ACT: gl.constexpr,              # one of _activation_math.ACTIVATIONS ("none": identity)
    HAS_RESIDUAL: gl.constexpr,     # add residual[M, N] after the activation
    SAVE_PREACT: gl.constexpr,      # also store a @ b + bias (the backward's act' input)
    NUM_PROGRAMS: gl.constexpr,     # persistent grid size
    GROUP_M: gl.constexpr,          # row tiles per group of the tile order
    STAGES: gl.constexpr,           # depth of the shared-memory ring
    CONSUMERS: gl.constexpr,        # consumer warp groups (1 or 2): BLOCK_M = 64 * CONSUMERS
    CONSUMER_REGS: gl.constexpr,    # registers per thread of the worker consumer group
    B_K_MAJOR: gl.constexpr,        # b read as [N, K] (x @ wᵀ: nn.Linear's weight), else [K, N]
    HAS_B2: gl.constexpr,           # tiles BLOCK_N1 + BLOCK_N2 wide (b2_desc, c2_desc)
    A_M_MAJOR: gl.constexpr,        # a given as aᵀ [K, M] row-major (a weight gradient's dyᵀ)
    ACCUMULATE: gl.constexpr,       # out += a @ b (the old out TMA-loaded during the K loop)
    HAS_SCALE: gl.constexpr,        # ACCUMULATE only: out = scale · (out + a @ b)
    SCALE_A: gl.constexpr,          # not ACCUMULATE: a @ b times scale_ptr[0] (1) or scale_ptr[row] (2); 0: none
    SCALE_B: gl.constexpr,          # likewise scale_b_ptr[0] (1) or scale_b_ptr[column] (2)
    STREAM_K: gl.constexpr,         # sk_tiles > 0: the stream-K region is compiled in
    PINGPONG: gl.constexpr,         # CONSUMERS == 2 take alternate tiles whole (gemm_pingpong_partition)
):
    BLOCK_N1: gl.constexpr = b_desc.block_type.shape[0] if B_K_MAJOR else b_desc.block_type.shape[1]
    BLOCK_N2: gl.constexpr = (b2_desc.block_type.shape[0] if B_K_MAJOR else b2_desc.block_type.shape[1]) if HAS_B2 else 0
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1] if B_K_MAJOR else b_desc.block_type.shape[0]
    gl.static_assert(not (ACCUMULATE and (HAS_B2 or HAS_BIAS or HAS_RESIDUAL or SAVE_PREACT or ACT != "none")),
                     "ACCUMULATE is out += a @ b alone")
    gl.static_assert(ACCUMULATE or not HAS_SCALE, "HAS_SCALE scales an accumulating GEMM only")
    gl.static_assert(not ACCUMULATE or (SCALE_A == 0 and SCALE_B == 0), "SCALE_A / SCALE_B: a plain GEMM's")
    gl.static_assert(not PINGPONG or (CONSUMERS == 2 and not (HAS_B2 or STREAM_K)),
                     "ping-pong: two consumer groups, tiles of one B part, no stream-K")
    a_bufs, b_bufs, c_bufs, ready, empty = gemm_ring(a_desc, b_desc, c_desc, STAGES, CONSUMERS, PINGPONG)
    if HAS_B2:
        b2_bufs = gl.allocate_shared_memory(b2_desc.dtype, [STAGES] + b2_desc.block_type.shape, b2_desc.layout)
        c2_bufs = gl.allocate_shared_memory(c2_desc.dtype, [CONSUMERS] + c2_desc.block_type.shape, c2_desc.layout)
    else:
        b2_bufs = b_bufs
        c2_bufs = c_bufs
    if ACCUMULATE:
        c_ready, c_free = accumulator_barriers(CONSUMERS)
    else:
        c_ready, c_free = ready, empty      # unused
    # the argument lists are written out: warp_specialize takes literal tuples
    if CONSUMERS == 1:
        gl.warp_specialize([
            (gemm_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c2_desc, c_bufs.index(0),
                                  c2_bufs.index(0), c_ready, c_free, bias_ptr, residual_ptr, preact_ptr, scale_ptr,
                                  scale_b_ptr, ws_ptr, flag_ptr, M, N, K, stride_rm, stride_rn, stride_pm, sk_tiles,
                                  0, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT, NUM_PROGRAMS, GROUP_M, BLOCK_N1,
                                  BLOCK_N2, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, A_M_MAJOR, ACCUMULATE, HAS_SCALE,
                                  SCALE_A, SCALE_B, STREAM_K)),
            (gemm_load_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
                                   NUM_PROGRAMS, GROUP_M, BLOCK_N1 + BLOCK_N2, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR,
                                   HAS_B2, c_desc, c_bufs, c_ready, c_free, A_M_MAJOR, ACCUMULATE, sk_tiles,
                                   ws_ptr, STREAM_K, False)),
        ], [1], [LOADER_REGS_KERNEL])
    elif PINGPONG:
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(order.index(i), count=1)
        gl.warp_specialize([
            (gemm_pingpong_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ready, c_free, order, bias_ptr,
                                       residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, M, N, K, stride_rm,
                                       stride_rn, stride_pm, 0, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT,
                                       NUM_PROGRAMS, GROUP_M, BLOCK_N1, BLOCK_K, STAGES, B_K_MAJOR, A_M_MAJOR,
                                       ACCUMULATE, HAS_SCALE, SCALE_A, SCALE_B)),
            (gemm_pingpong_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ready, c_free, order, bias_ptr,
                                       residual_ptr, preact_ptr, scale_ptr, scale_b_ptr, M, N, K, stride_rm,
                                       stride_rn, stride_pm, 1, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT,
                                       NUM_PROGRAMS, GROUP_M, BLOCK_N1, BLOCK_K, STAGES, B_K_MAJOR, A_M_MAJOR,
                                       ACCUMULATE, HAS_SCALE, SCALE_A, SCALE_B)),
            (gemm_load_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
                                   NUM_PROGRAMS, GROUP_M, BLOCK_N1, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, False,
                                   c_desc, c_bufs, c_ready, c_free, A_M_MAJOR, ACCUMULATE, sk_tiles, ws_ptr, False,
                                   True)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS_KERNEL])
    else:
        gl.static_assert(CONSUMERS == 2, "one or two consumer warp groups")
        gl.warp_specialize([
            (gemm_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c2_desc, c_bufs.index(0),
                                  c2_bufs.index(0), c_ready, c_free, bias_ptr, residual_ptr, preact_ptr, scale_ptr,
                                  scale_b_ptr, ws_ptr, flag_ptr, M, N, K, stride_rm, stride_rn, stride_pm, sk_tiles,
                                  0, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT, NUM_PROGRAMS, GROUP_M, BLOCK_N1,
                                  BLOCK_N2, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, A_M_MAJOR, ACCUMULATE, HAS_SCALE,
                                  SCALE_A, SCALE_B, STREAM_K)),
            (gemm_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c2_desc, c_bufs.index(1),
                                  c2_bufs.index(1), c_ready, c_free, bias_ptr, residual_ptr, preact_ptr, scale_ptr,
                                  scale_b_ptr, ws_ptr, flag_ptr, M, N, K, stride_rm, stride_rn, stride_pm, sk_tiles,
                                  1, HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT, NUM_PROGRAMS, GROUP_M, BLOCK_N1,
                                  BLOCK_N2, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, A_M_MAJOR, ACCUMULATE, HAS_SCALE,
                                  SCALE_A, SCALE_B, STREAM_K)),
            (gemm_load_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
                                   NUM_PROGRAMS, GROUP_M, BLOCK_N1 + BLOCK_N2, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR,
                                   HAS_B2, c_desc, c_bufs, c_ready, c_free, A_M_MAJOR, ACCUMULATE, sk_tiles,
                                   ws_ptr, STREAM_K, False)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS_KERNEL])
