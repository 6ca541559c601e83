"""What the warp-specialized Gluon kernels (``_fp8_gluon``, ``_attention_fwd_gluon``) share:
dtype names, cached shared-memory layouts and the register split between warp groups.

Registers: Triton pads the worker partitions to whole warp groups (a 1-warp loader becomes a
4-warp group) and, when the partitions request register counts, emits ``setmaxnreg`` so that the
groups' shares add up to the 64K-register file: the kernel launches at 64K / threads registers per
thread, the worker groups take what they request, and the default group gets what is left.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._launch import cached_by_view, cached_descriptor
from ._matmul_kernels import _tile_coords     # the grouped tile order, shared with the tl GEMMs
from ._stream_k import stream_k_prefetch, stream_k_run

GLUON_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
                torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
SMEM_BYTES = 227 * 1024         # sm_90's shared memory per block (opt-in maximum)
LOADER_REGS = 40                # the TMA producer warp's registers (addresses and phase bits)
ROWS_PER_GROUP = 64             # rows of a GEMM tile per consumer warp group (wgmma's M per warp group)


@functools.lru_cache(maxsize=None)
def smem_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The widest-swizzle shared layout of a TMA / wgmma tile (~10 µs uncached)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GLUON_DTYPES[dtype])


def host_descriptor(t: torch.Tensor, shape: tuple, strides: tuple, block: tuple,
                    layout: gl.NVMMASharedLayout) -> TensorDescriptor:
    """The Gluon host TMA descriptor of ``t``'s memory viewed as ``shape`` / ``strides`` with
    ``block`` boxes in ``layout``, cached (``_launch.cached_descriptor``: the attention backward
    builds 13 a step, 5.8 µs each uncached on the H200 host)."""
    return cached_descriptor(t, shape, strides, block, layout)


@cached_by_view
def matrix_descriptor(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    """A GEMM operand's descriptor (the small-M and fp8 GEMMs): ``t`` as it is, ``block`` boxes in
    the widest-swizzle layout."""
    return host_descriptor(t, tuple(t.shape), t.stride(), tuple(block), smem_layout(tuple(block), t.dtype))


@cached_by_view
def transposed_matrix_descriptor(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    """:func:`matrix_descriptor` of ``t.t()`` (a K-major B, ``w.t()``, or an M-major A, ``dy.t()``,
    read as the row-major matrix it transposes), memoized on ``t``'s own view: a hit builds no
    transposed view (~1 µs of host time each on the CI CPU)."""
    return matrix_descriptor(t.t(), block)


def consumer_regs(consumers: int, loader_regs: int = LOADER_REGS, cap: int = 232) -> tuple[int, int]:
    """(registers per thread at launch, registers requested by each worker consumer group) for
    ``consumers`` 4-warp consumer groups (the first is the default partition) and one loader warp,
    padded to a group: the loader's group keeps ``loader_regs``, the consumer groups split the rest
    up to ``cap`` (a multiple of 8 under the 255-register limit; 240 is the most two consumer
    groups can take, with a 24-register loader)."""
    groups = consumers + 1
    launch = 65536 // (groups * 128) // 8 * 8
    worker = min(cap, (65536 - loader_regs * 128) // consumers // 128 // 8 * 8)
    return launch, worker


LOADER_REGS_KERNEL = gl.constexpr(LOADER_REGS)    # the same, for kernels (globals they read are constexprs)
WG_ROWS = gl.constexpr(ROWS_PER_GROUP)


# The GEMMs' producer / consumer protocol (_fp8_gluon, _matmul_gluon): a ring of STAGES stages,
# each holding one 64-row A piece per consumer group and the shared B tile; ``ready`` (count 1:
# the producer's expect + TMA) and ``empty`` (count CONSUMERS: every group releases it).


@gluon.jit
def gemm_ring(a_desc, b_desc, c_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    """(a_bufs, b_bufs, c_bufs, ready, empty): the ring's STAGES stages of CONSUMERS A pieces and
    one B tile, one output tile per consumer group, and the ring's mbarriers, initialized.
    PINGPONG: each stage belongs to one group's tile (all its A pieces; one release) and each
    group stages all CONSUMERS row pieces of its own output tile."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [CONSUMERS * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if PINGPONG:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS * CONSUMERS] + c_desc.block_type.shape,
                                           c_desc.layout)
    else:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        # every consumer group releases a stage (ping-pong: the one group whose tile it holds)
        mbarrier.init(empty.index(i), count=1 if PINGPONG else CONSUMERS)
    return a_bufs, b_bufs, c_bufs, ready, empty


@gluon.jit
def load_stage(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, it, off_m, off_n, off_k,
               STAGES: gl.constexpr, CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr, HAS_B2: gl.constexpr,
               A_M_MAJOR: gl.constexpr):
    """The producer's ``it``-th K step: wait for its stage to be free, then TMA the 64-row pieces
    of the A tile at (off_m, off_k) (one per consumer group) and the B tile at (off_n, off_k) into
    it (out-of-range rows and K columns read as zeros); with HAS_B2 also the B tile's second,
    narrower part (``b2_desc``'s block) right after the first (a tile of two power-of-two widths,
    e.g. 64 + 32). B_K_MAJOR: b is [N, K] (a weight read as x @ wᵀ), else [K, N] (row-major).
    A_M_MAJOR: a is given as its transpose [K, M] (row-major; e.g. dlogitsᵀ of a weight gradient),
    loaded as [BLOCK_K, 64] pieces that the consumers read transposed."""
    if HAS_B2:
        step_bytes: gl.constexpr = (CONSUMERS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                    + b2_desc.block_type.nbytes)
    else:
        step_bytes: gl.constexpr = CONSUMERS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    s = it % STAGES
    # a fresh mbarrier counts as phase 1 complete: the first lap does not wait
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, step_bytes)
    for g in gl.static_range(CONSUMERS):
        if A_M_MAJOR:
            tma.async_copy_global_to_shared(a_desc, [off_k, off_m + g * WG_ROWS], bar, a_bufs.index(CONSUMERS * s + g))
        else:
            tma.async_copy_global_to_shared(a_desc, [off_m + g * WG_ROWS, off_k], bar, a_bufs.index(CONSUMERS * s + g))
    if B_K_MAJOR:
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s))
        if HAS_B2:
            tma.async_copy_global_to_shared(b2_desc, [off_n + b_desc.block_type.shape[0], off_k], bar, b2_bufs.index(s))
    else:
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_bufs.index(s))
        if HAS_B2:
            tma.async_copy_global_to_shared(b2_desc, [off_k, off_n + b_desc.block_type.shape[1]], bar, b2_bufs.index(s))


@gluon.jit
def gemm_load_partition(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
                        NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                        B_K_MAJOR: gl.constexpr, HAS_B2: gl.constexpr, c_desc, c_bufs, c_ready, c_free,
                        A_M_MAJOR: gl.constexpr, ACCUMULATE: gl.constexpr, sk_tiles, ws_ptr,
                        STREAM_K: gl.constexpr, PINGPONG: gl.constexpr):
    """The producer warp: every K step of every tile of this program (grouped order, as the
    consumers walk them) through :func:`load_stage`. BLOCK_N: the tile's width (both B parts).

    ACCUMULATE (out += a @ b): also each tile's old output, into the consumers' output staging
    tiles (``c_bufs``; ``c_ready`` / ``c_free``: one mbarrier each per consumer group). It is
    issued after the tile's first STAGES K steps: those go out while the consumers still finish
    the previous tile, whose TMA store must have left the staging tile (``c_free``) first; the
    load then has the rest of the K loop to land before the epilogue reads it. PINGPONG: tile j of
    this program is group j % 2's, whole: its old output (all CONSUMERS row pieces) goes into
    that group's staging tiles.

    STREAM_K: the last ``sk_tiles`` tiles are cut into even runs of K steps, one per program
    (``_stream_k``), loaded in the order the consumers walk them; once the tail's loads are
    issued, the previous program's partials (``ws_ptr``: both consumer groups' slots) are
    prefetched into L2 for the consumers' collect, ~STAGES K steps later."""
    num_pid_m = gl.cdiv(M, WG_ROWS * CONSUMERS)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    if ACCUMULATE:
        head = gl.minimum(k_tiles, STAGES)
    else:
        head = k_tiles
    it = 0
    tile_count = 0
    dp_tiles = num_pid_m * num_pid_n - sk_tiles
    for tile_id in range(gl.program_id(0), dp_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * (WG_ROWS * CONSUMERS)
        off_n = pid_n * BLOCK_N
        for ki in range(head):
            load_stage(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, it, off_m, off_n,
                       ki * BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, HAS_B2, A_M_MAJOR)
            it += 1
        if ACCUMULATE and PINGPONG:
            g = tile_count % 2
            mbarrier.wait(c_free.index(g), ((tile_count // 2) & 1) ^ 1)
            mbarrier.expect(c_ready.index(g), CONSUMERS * c_desc.block_type.nbytes)
            for h in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(c_desc, [off_m + h * WG_ROWS, off_n], c_ready.index(g),
                                                c_bufs.index(CONSUMERS * g + h))
        elif ACCUMULATE:
            for g in gl.static_range(CONSUMERS):
                # a fresh mbarrier counts as phase 1 complete: the first tile does not wait
                mbarrier.wait(c_free.index(g), (tile_count & 1) ^ 1)
                mbarrier.expect(c_ready.index(g), c_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(c_desc, [off_m + g * WG_ROWS, off_n], c_ready.index(g),
                                                c_bufs.index(g))
        if ACCUMULATE:
            for ki in range(head, k_tiles):
                load_stage(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, it, off_m, off_n,
                           ki * BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, HAS_B2, A_M_MAJOR)
                it += 1
        tile_count += 1
    if STREAM_K:
        gl.static_assert(not (ACCUMULATE or HAS_B2), "stream-K: plain tiles of one B part")
        first, a, last, b = stream_k_run(gl.program_id(0), sk_tiles, k_tiles, NUM_PROGRAMS)
        for t in range(first + (a > 0).to(gl.int32), last + (b == k_tiles).to(gl.int32)):
            it = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, dp_tiles + t, 0, k_tiles,
                             num_pid_m, num_pid_n, GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR,
                             A_M_MAJOR)
        if b < k_tiles:
            it = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, dp_tiles + last, 0, b,
                             num_pid_m, num_pid_n, GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR,
                             A_M_MAJOR)
        if a > 0:
            it = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, dp_tiles + first, a, k_tiles,
                             num_pid_m, num_pid_n, GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR,
                             A_M_MAJOR)
            stream_k_prefetch(ws_ptr, gl.program_id(0) - 1, CONSUMERS * WG_ROWS * BLOCK_N)


@gluon.jit
def _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, tile_id, k_lo, k_hi, num_pid_m, num_pid_n,
                GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr, A_M_MAJOR: gl.constexpr):
    """The producer's K steps [k_lo, k_hi) of one tile (one B part) from ring step ``it``; returns
    the ring step after them."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    for ki in range(k_lo, k_hi):
        load_stage(a_desc, b_desc, b_desc, a_bufs, b_bufs, b_bufs, ready, empty, it, pid_m * (WG_ROWS * CONSUMERS),
                   pid_n * BLOCK_N, ki * BLOCK_K, STAGES, CONSUMERS, B_K_MAJOR, False, A_M_MAJOR)
        it += 1
    return it


@gluon.jit
def accumulator_barriers(CONSUMERS: gl.constexpr):
    """(c_ready, c_free): per consumer group, the old output tile has landed in its staging tile
    (count 1: the producer's expect + TMA) / the staging tile is free again (count 1: the group,
    once its TMA store has read it)."""
    c_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    c_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_free.index(i), count=1)
    return c_ready, c_free


@gluon.jit
def release_stage(empty, s):
    """Hand stage ``s`` back to the producer once every warp of this group is past its wgmma wait."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def resident_and_ring_barriers(CONSUMERS: gl.constexpr, STAGES: gl.constexpr):
    """The mbarriers of the attention kernels' producer / consumer protocol, initialized: one
    ``ready`` per consumer group for the tiles it keeps (count 1: the producer's expect + TMA),
    and per ring stage an ``a_ready`` and a ``b_ready`` for its two tiles (count 1 each) and an
    ``empty`` that every consumer group releases (count CONSUMERS)."""
    ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, a_ready, b_ready, empty
