"""Launch planning for the warp-specialized Gluon GEMM (``_matmul_gluon.gemm_ws_kernel``): the
declared tiles and the heuristics that pick one per problem (small / mid M: memory-bound,
``choose_ws_tile``; large M: compute-bound, ``choose_large_ws_tile``; the tail split, the ring
depth, the register split), the cached launch plan and the launchers (``launch_gemm_ws``,
``launch_gemm_accumulate``). GPU only at launch; the plans are made on any host.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .._dispatch import cdiv, num_sms
from .._address_memo import AddressMemo
from ._gluon_common import ROWS_PER_GROUP, SMEM_BYTES, consumer_regs
from ._gluon_common import matrix_descriptor as _descriptor
from ._gluon_common import transposed_matrix_descriptor as _descriptor_t
from ._matmul_gluon import gemm_ws_kernel
from ._matmul_kernels import split_k_buffers
from ._stream_k import stream_k_epilogue_ok, stream_k_tiles

# Tile candidates (H200 2026-11-24, graph replays after an L2 flush, -s19-matmul-sweep-small-m-graph.log
# and -s19-decode-splits-matmul-mid-sweep.log): 64x64 tiles with 128-deep K steps in a 6-stage
# ring, 64x128 with 64-deep steps in 8 stages, 128x128 (two consumer groups) in 6.
WS_TILES = {
    "64x64": dict(CONSUMERS=1, BLOCK_N=64, BLOCK_K=128, STAGES=6, GROUP_M=8),
    "64x128": dict(CONSUMERS=1, BLOCK_N=128, BLOCK_K=64, STAGES=8, GROUP_M=8),
    "128x128": dict(CONSUMERS=2, BLOCK_N=128, BLOCK_K=64, STAGES=6, GROUP_M=8),
}
MIN_FILL = 0.45     # below this share of busy SMs the tl kernel's split-K fills them better


def stream_cost(m: int, n: int, cfg: dict, sms: int) -> int:
    """Relative time of a tile choice for a memory-bound GEMM: waves x the operand rows a tile
    streams per K step (64·CONSUMERS of a, BLOCK_N of b). It ranks the tiles as measured at all 12
    mid-M shapes of the sweeps (M = 64 / 128 / 256 against N x K = 4096², 14336x4096,
    4096x14336, 6144x4096), where the fullest-waves rule picked 64x64 at M = 256, N = 14336
    (0.68x cuBLAS against 0.89x for 128x128)."""
    rows = ROWS_PER_GROUP * cfg["CONSUMERS"]
    return cdiv(cdiv(m, rows) * cdiv(n, cfg["BLOCK_N"]), sms) * (rows + cfg["BLOCK_N"])


def choose_ws_tile(m: int, n: int, sms: int) -> dict | None:
    """The tile of least :func:`stream_cost` (ties: the first declared); None when its tiles
    leave over 55 % of the SMs idle (M = 64, N = 4096: 64 tiles of 64x64 still beat the tl
    kernel's split-K, 0.97 against 0.84x cuBLAS)."""
    name = min(WS_TILES, key=lambda t: stream_cost(m, n, WS_TILES[t], sms))
    cfg = WS_TILES[name]
    tiles = cdiv(m, ROWS_PER_GROUP * cfg["CONSUMERS"]) * cdiv(n, cfg["BLOCK_N"])
    return dict(cfg) if min(tiles, sms) >= MIN_FILL * sms else None


# A persistent 128x256 GEMM whose last wave is short leaves most SMs idle for a tile-time;
# splitting off its last row blocks as a second GEMM (a mid-M problem on 128-column tiles, one wave)
# shortens the first launch by a wave for about 0.75 of a tile-time at K = 4096. H200 2026-12-01,
# 8192x14336x4096 (27.15 waves), CUDA-graph replays after an L2 flush, interleaved with cuBLAS:
# 1.3908 -> 1.3777 ms, 1.009 -> 1.019x cuBLAS (-s46-tail-split-probe.log); the next call, 7 rounds,
# 1.3884 -> 1.3610 ms, 1.000 -> 1.021x (-s46-tail-split-probe-2-and-bench-matmul.log). False: one launch (A/B).
TAIL_SPLIT = True
# at shorter K the second launch's fixed cost (~12 µs there) is a larger part of the half tile it saves
TAIL_SPLIT_MIN_K = 4096


def tail_split_rows(m: int, n: int, k: int, tile: dict, epilogue: tuple, sms: int) -> int:
    """Rows to launch as a second GEMM after the first ``M - rows`` (0: one launch): the fewest
    whole row blocks of ``tile`` whose tiles cover the last partial wave, when the split-off rows
    fill at most one wave of 128-column tiles. Only for 128x256 at long K, and only with an epilogue
    of bias and activation (a split needs no residual or pre-activation views). ``epilogue``:
    (HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT)."""
    _, _, has_res, save_preact = epilogue
    if not TAIL_SPLIT or tile["BLOCK_N"] != 256 or k < TAIL_SPLIT_MIN_K or has_res or save_preact:
        return 0
    rows = ROWS_PER_GROUP * tile["CONSUMERS"]
    row_blocks, col_blocks = cdiv(m, rows), cdiv(n, tile["BLOCK_N"])
    tail = row_blocks * col_blocks % sms            # tiles of the last wave
    split = cdiv(tail, col_blocks)                  # row blocks that hold as many
    if tail == 0 or split >= row_blocks or split * cdiv(n, 128) > sms:
        return 0
    return m - (row_blocks - split) * rows


def fit_ring(requested: int, consumers: int, block_n: int, block_k: int, elem: int, out_elem: int,
             pingpong: bool = False) -> int:
    """The ring depth that fits beside the output tiles (one [64, BLOCK_N] per consumer group;
    ``pingpong``: each group stages its whole tile, ``consumers`` of them)."""
    stage = (consumers * ROWS_PER_GROUP + block_n) * block_k * elem
    staging = consumers * (consumers if pingpong else 1)
    free = SMEM_BYTES - staging * ROWS_PER_GROUP * block_n * out_elem - 1024
    return max(2, min(requested, free // stage))


def ws_regs(consumers: int) -> tuple[int, int]:
    """(registers per thread at launch, registers of the worker consumer group): the split of
    :func:`consumer_regs`, with the launch figure capped at 248 (one consumer group and the
    loader's padded group would get 256, over the 255-register limit)."""
    launch, worker = consumer_regs(consumers)
    return min(launch, 248), worker


# Large M (> MID_MAX_M): compute-bound tiles. H200 2026-11-29, CUDA-graph replays after an L2 flush,
# interleaved with cuBLAS (scripts/matmul_sweep.py, -s43-matmul-sweep-large-gluon.log), b = w.t():
# 128x256 at 4096³ / 8192³ / 8192 x (4096x4096, 14336x4096, 4096x14336, 6144x4096) 1.00 / 1.03 /
# 1.03 / 0.99 / 1.00 / 1.02x cuBLAS, where the tl kernel's 128x256 measured 0.96 / 1.01 / 1.00 /
# 0.97 / 0.99 / 1.00x; 128x128 0.98 / 0.98 / 1.02 / 0.99 / 0.97 / 1.01x. Row-major b and the
# weight gradient's M-major a likewise (+1 to +5 points over the tl kernel at 11 of 12 rows).
LARGE_WS_TILES = {
    "128x256": dict(CONSUMERS=2, BLOCK_N=256, BLOCK_K=64, STAGES=4, GROUP_M=8),
    "128x128": dict(CONSUMERS=2, BLOCK_N=128, BLOCK_K=64, STAGES=6, GROUP_M=8),
}
# each tile's throughput at full waves relative to 128x256 (the six shapes above: 0.97-1.04x, ~0.97 mean)
LARGE_TILE_RATE = {"128x256": 1.0, "128x128": 0.97}
# 128x256 wants this many waves: with fewer, its ramp and epilogue are not hidden behind other tiles
# (-s43-matmul-sweep-midlarge-gluon.log, N = K = 4096: M = 1024, one wave, 0.95x cuBLAS against 0.98x
# for two waves of 128x128; M = 2048, two waves, 0.98 against 0.98; 4096³, four waves, 1.00 against 0.98)
MIN_WAVES_128X256 = 3


def large_tile_cost(m: int, n: int, name: str, sms: int) -> float:
    """Relative time of a large-M tile: waves × the tile's area / its rate (compute-bound)."""
    cfg = LARGE_WS_TILES[name]
    rows = ROWS_PER_GROUP * cfg["CONSUMERS"]
    return cdiv(cdiv(m, rows) * cdiv(n, cfg["BLOCK_N"]), sms) * rows * cfg["BLOCK_N"] / LARGE_TILE_RATE[name]


def choose_large_ws_tile(m: int, n: int, epilogue: tuple, out_elem: int, sms: int) -> dict | None:
    """The large-M tile of least :func:`large_tile_cost`; 128x256 only with MIN_WAVES_128X256
    waves and when its registers and shared memory suffice (a residual or a saved pre-activation in
    the epilogue spills 350-450 bytes at 128x256, offline sm_90 compile; a 4-byte output leaves
    room for a 2-stage ring). None (the tl kernel, whose tile choice and split-K fill the SMs) when
    the tiles leave over 55 % of the SMs idle (MIN_FILL). ``epilogue``: (HAS_BIAS, ACT,
    HAS_RESIDUAL, SAVE_PREACT). M = 384 / 1024, N = 14336: 0.87 / 0.99x cuBLAS on 128x128 against
    0.67 / 0.89x on 128x256 and 0.64 / 0.86x on the tl kernel (-s43-matmul-sweep-midlarge-gluon.log)."""
    _, _, has_res, save_preact = epilogue
    names = ["128x128"]
    wide = cdiv(m, 2 * ROWS_PER_GROUP) * cdiv(n, LARGE_WS_TILES["128x256"]["BLOCK_N"])
    if not (has_res or save_preact or out_elem > 2) and wide >= MIN_WAVES_128X256 * sms:
        names.append("128x256")
    name = min(names, key=lambda t: large_tile_cost(m, n, t, sms))
    cfg = LARGE_WS_TILES[name]
    tiles = cdiv(m, ROWS_PER_GROUP * cfg["CONSUMERS"]) * cdiv(n, cfg["BLOCK_N"])
    return dict(cfg) if min(tiles, sms) >= MIN_FILL * sms else None


class _WsPlan(NamedTuple):
    """A launch of :func:`gemm_ws_kernel`, everything but the tensors (:func:`_ws_plan`)."""
    grid: tuple
    block_n1: int               # the tile's first (power-of-two) column part
    block_n2: int               # its second part (0: none)
    block_k: int
    b_k_major: bool
    a_m_major: bool
    prepared: object            # gemm_ws_kernel.prepare(...) of the sizes, strides and constexprs
    sk_slots: int = 0           # stream-K: partial tiles / flags in the workspace (0: no stream-K)
    sk_workspace: int = 0       # stream-K: fp32 elements of the partials


@functools.lru_cache(maxsize=1024)
def _ws_plan(m: int, n: int, k: int, elem: int, out_elem: int, b_k_major: bool, sms: int,
             epilogue: tuple, res_strides: tuple, config: tuple, scales: tuple = (0, 0)) -> _WsPlan:
    """The launch of one problem, cached (host time: the kernel takes ~10-35 µs at M = 128;
    building this on every call took ~60 µs of the H200 host's time, s42).
    ``b_k_major``: b read as [N, K] (a transposed weight) unless the config says otherwise; a is
    row-major unless the config's A_M_MAJOR says it is given as aᵀ [K, M] row-major.
    ``epilogue``: (HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT). ``scales``: the kernel's (SCALE_A,
    SCALE_B), fp8 operands' dequantization (:func:`scale_modes`)."""
    cfg = dict(config) if config else choose_ws_tile(m, n, sms) or dict(WS_TILES["64x64"])
    block_n, block_k, consumers = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["CONSUMERS"]
    if cfg.get("PINGPONG", False) and (consumers != 2 or block_n & (block_n - 1)):
        raise ValueError(f"config: PINGPONG takes two consumer groups and a power-of-two BLOCK_N, got {cfg}")
    b_k_major = cfg.get("B_K_MAJOR", b_k_major)
    a_m_major = cfg.get("A_M_MAJOR", False)
    pingpong = cfg.get("PINGPONG", False)
    tiles = cdiv(m, ROWS_PER_GROUP * consumers) * cdiv(n, block_n)
    programs = max(1, min(sms, tiles))
    launch_regs, worker_regs = ws_regs(consumers)
    stages = fit_ring(cfg["STAGES"], consumers, block_n, block_k, elem, out_elem, pingpong)
    # a tile width that is not a power of two (96) is two parts that are (64 + 32)
    block_n1 = 1 << (block_n.bit_length() - 1)
    block_n2 = block_n - block_n1
    if block_n2 & (block_n2 - 1):
        raise ValueError(f"config: BLOCK_N must be a power of two or the sum of two, got {block_n}")
    has_bias, act, has_res, save_preact = epilogue
    # the last waves cut along K when the tile says STREAM_K (_matmul_kernels._ws_tile: large M, and
    # _stream_k.STREAM_K or the caller's config) and the epilogue leaves the registers for it
    sk_tiles = (stream_k_tiles(m, n, k, ROWS_PER_GROUP * consumers, block_n, block_k, programs)
                if cfg.get("STREAM_K", False) and not (block_n2 or pingpong) and stream_k_epilogue_ok(block_n, epilogue)
                else 0)
    kwargs = dict(
        HAS_BIAS=has_bias, ACT=act, HAS_RESIDUAL=has_res, SAVE_PREACT=save_preact,
        NUM_PROGRAMS=programs, GROUP_M=cfg["GROUP_M"], STAGES=stages, CONSUMERS=consumers,
        CONSUMER_REGS=worker_regs, B_K_MAJOR=b_k_major, HAS_B2=block_n2 > 0, A_M_MAJOR=a_m_major, ACCUMULATE=False,
        HAS_SCALE=False, SCALE_A=scales[0], SCALE_B=scales[1], STREAM_K=sk_tiles > 0, PINGPONG=pingpong,
        num_warps=4, maxnreg=launch_regs,
    )
    prepared = gemm_ws_kernel.prepare((m, n, k, res_strides[0], res_strides[1], n, sk_tiles), kwargs)
    slots = programs * consumers if sk_tiles else 0
    return _WsPlan((programs,), block_n1, block_n2, block_k, b_k_major, a_m_major, prepared, slots,
                   slots * ROWS_PER_GROUP * block_n1)


def launch_ws_plan(plan: _WsPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   preact: torch.Tensor | None = None, memo: AddressMemo | None = None,
                   key: tuple | None = None, sk_buffers: tuple | None = None,
                   scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of a :func:`_ws_plan` (``_matmul_kernels`` keeps the plan in its own cached
    GEMM plan, so a call builds only this call's descriptors): see :func:`launch_gemm_ws`.
    ``memo``: the caller's plan's launches by address; this one is kept there under ``key``
    (the caller's plan fixes every view, :class:`AddressMemo`). ``sk_buffers``: (zeroed int32
    flags, fp32 partials) of at least the plan's ``sk_slots`` / ``sk_workspace`` when it has them
    (``_matmul_kernels.split_k_buffers``). ``scale_a`` / ``scale_b``: fp32 [1] or [M] / [N], as the
    plan's ``scales`` say."""
    if plan.sk_slots and sk_buffers is None:
        raise ValueError("a stream-K plan needs its workspace (sk_buffers)")
    flags, partials = sk_buffers if plan.sk_slots else (out, out)
    block_k, block_n1, block_n2 = plan.block_k, plan.block_n1, plan.block_n2
    if plan.b_k_major:
        b_desc = _descriptor_t(b, (block_n1, block_k))
        b2_desc = _descriptor_t(b, (block_n2, block_k)) if block_n2 else b_desc
    else:
        b_desc = _descriptor(b, (block_k, block_n1))
        b2_desc = _descriptor(b, (block_k, block_n2)) if block_n2 else b_desc
    c_desc = _descriptor(out, (ROWS_PER_GROUP, block_n1))
    c2_desc = _descriptor(out, (ROWS_PER_GROUP, block_n2)) if block_n2 else c_desc
    a_desc = _descriptor_t(a, (block_k, ROWS_PER_GROUP)) if plan.a_m_major else _descriptor(a, (ROWS_PER_GROUP, block_k))
    tensors = (a_desc, b_desc, b2_desc, c_desc, c2_desc, bias if bias is not None else out,
               residual if residual is not None else out, preact if preact is not None else out,
               scale_a if scale_a is not None else out, scale_b if scale_b is not None else out, partials, flags)
    gemm_ws_kernel.launch_prepared(plan.grid, tensors, plan.prepared)
    if memo is not None:
        memo.keep(key, gemm_ws_kernel, plan.grid, tensors, plan.prepared)
    return out


def launch_gemm_ws(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, preact: torch.Tensor | None = None,
                   activation: str = "none", config: dict | None = None, scale_a: torch.Tensor | None = None,
                   scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = act(a [M, K] @ b [K, N] · scale_a · scale_b + bias) + residual (and preact =
    the value before the activation); 16-bit a and b, or fp8 ones (K-major both: wgmma reads 8-bit
    operands K-major only) with fp32 scales ([1] or [M] / [N]; None: 1), K > 0, a row-major (or, with the config's A_M_MAJOR, the transpose of a
    row-major [K, M]), b a transposed weight (``w.t()``, K-contiguous) or row-major, every base
    and row stride TMA-aligned, ``out`` (and ``preact``) preallocated row-major. ``config``: the
    tile (:func:`choose_ws_tile` when None)."""
    (m, k), n = a.shape, b.shape[1]
    plan = _ws_plan(m, n, k, a.element_size(), out.element_size(), b.stride(0) == 1, num_sms(a),
                    (bias is not None, activation, residual is not None, preact is not None),
                    residual.stride() if residual is not None else (n, 1),
                    tuple(config.items()) if config else (), scale_modes(scale_a, scale_b))
    sk = split_k_buffers(a.device, plan.sk_slots, plan.sk_workspace) if plan.sk_slots else None
    return launch_ws_plan(plan, a, b, out, bias, residual, preact, sk_buffers=sk, scale_a=scale_a, scale_b=scale_b)


def scale_mode(scale: torch.Tensor | None) -> int:
    """The kernel's SCALE_A / SCALE_B for a scale tensor: 0 none, 1 one value, 2 one per row / column."""
    return 0 if scale is None else 1 if scale.numel() == 1 else 2


def scale_modes(scale_a: torch.Tensor | None, scale_b: torch.Tensor | None) -> tuple:
    """(SCALE_A, SCALE_B) of :func:`scale_mode`."""
    return scale_mode(scale_a), scale_mode(scale_b)


# out += a @ b with a short K (linear cross-entropy's grad_weight: M = V, N = H, K = 512 tokens per
# chunk): compute-bound tiles, the old output loaded by the producer during the K loop. The
# ping-pong 128x128 (each consumer group on its own tile: gemm_pingpong_partition) hides the
# epilogue that a short K cannot amortize.
ACCUMULATE_TILES = {**LARGE_WS_TILES,
                    "128x128-pingpong": dict(CONSUMERS=2, BLOCK_N=128, BLOCK_K=64, STAGES=5, GROUP_M=8,
                                             PINGPONG=True)}


def launch_gemm_accumulate(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, config: dict | None = None,
                           accumulate: bool = True, scale: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] += a [M, K] @ b [K, N] in one pass over ``out`` (fp32 accumulation of the
    product, one rounding of the sum to out's dtype); with ``scale`` (fp32 [1] on out's device,
    accumulating only) out = scale · (out + a @ b), the sum scaled before its one rounding.
    16-bit a and b of one dtype, K > 0; a row-major or the transpose of a row-major [K, M]
    (``dy.t()``), b row-major or a transposed weight (``w.t()``); out row-major in a's dtype; every
    base and row stride TMA-aligned. No checks here (callers check): a GPU-only building block.
    ``config``: ACCUMULATE_TILES's 128x256 when None. ``accumulate=False``: out = a @ b (the same
    tiles, no old output)."""
    (m, k), n = a.shape, b.shape[1]
    cfg = dict(config) if config else dict(ACCUMULATE_TILES["128x256"])
    block_n, block_k, consumers = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["CONSUMERS"]
    pingpong = cfg.get("PINGPONG", False)
    a_m_major = a.stride(0) == 1 and a.stride(1) != 1
    b_k_major = b.stride(0) == 1 and b.stride(1) != 1
    tiles = cdiv(m, ROWS_PER_GROUP * consumers) * cdiv(n, block_n)
    programs = max(1, min(num_sms(a), tiles))
    launch_regs, worker_regs = ws_regs(consumers)
    stages = fit_ring(cfg["STAGES"], consumers, block_n, block_k, a.element_size(), out.element_size(), pingpong)
    a_desc = _descriptor_t(a, (block_k, ROWS_PER_GROUP)) if a_m_major else _descriptor(a, (ROWS_PER_GROUP, block_k))
    b_desc = _descriptor_t(b, (block_n, block_k)) if b_k_major else _descriptor(b, (block_k, block_n))
    c_desc = _descriptor(out, (ROWS_PER_GROUP, block_n))
    if scale is not None and not accumulate:
        raise ValueError("scale: an accumulating GEMM only")
    gemm_ws_kernel[(programs,)](
        a_desc, b_desc, b_desc, c_desc, c_desc, out, out, out, scale if scale is not None else out, out, out, out,
        m, n, k, n, 1, n, 0,
        HAS_BIAS=False, ACT="none", HAS_RESIDUAL=False, SAVE_PREACT=False,
        NUM_PROGRAMS=programs, GROUP_M=cfg["GROUP_M"], STAGES=stages, CONSUMERS=consumers,
        CONSUMER_REGS=worker_regs, B_K_MAJOR=b_k_major, HAS_B2=False, A_M_MAJOR=a_m_major, ACCUMULATE=accumulate,
        HAS_SCALE=scale is not None, SCALE_A=0, SCALE_B=0, STREAM_K=False, PINGPONG=pingpong, num_warps=4,
        maxnreg=launch_regs,
    )
    return out
