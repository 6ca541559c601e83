"""Launch heuristics of ``tilefuse.matmul``'s tl kernel (``_matmul_kernels.matmul_kernel``):
the declared config table (:data:`CONFIGS`), the M buckets and the choice function
(:func:`choose_config`; no runtime autotuning, any key can be overridden with ``config=`` for
sweeps), split-K for small-M GEMMs that would leave SMs idle, and which operands go through TMA
descriptors. Each rule is a small named function with the measurement it rests on.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .._dispatch import cdiv, is_hopper_or_newer, next_power_of_2

# The declared configs. Keys: BLOCK_M/N/K, GROUP_M, num_warps, num_stages (the usual Hopper
# wgmma shapes: 128x256x64 with 8 warps and 3 stages fits the 228 KB of shared memory with
# 16-bit operands; untuned on the GPU as written).
CONFIGS = {
    "tile_128x256": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "tile_128x128": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "tile_64x128": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "tile_64x64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    # small M (decode, small batches): one row tile, narrow columns for enough programs, long K steps
    "small_m16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    "small_m32": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    # 32 < M <= 256: the weight streams through once (memory-bound); long K steps keep more bytes
    # in flight per SM (H100 2026-11-22, M=128: 64x64x256 14.0 us = cuBLAS, 64x64x64 18.4 us)
    "mid_128x128": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    "mid_128x64": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    "mid_64x128": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    "mid_64x64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=3),
    # fp32 operands: ieee dot (FMA, no tensor cores): smaller tiles, registers are the limit
    "fp32": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}
LARGE_TILES = ("tile_128x256", "tile_128x128", "tile_64x128", "tile_64x64")   # largest first
# H200 2026-11-24 sweeps as CUDA-graph replays (-s7-matmul-sweep-small-m-graph*.log), M = 128:
# 128x128 fills at N = 14336 (112 tiles); 128x64 at N = 6144 (96 tiles: 0.82x cuBLAS against
# 0.67x for 192 tiles of 64x64 in two rounds) and, split in two, at N = 4096, K = 14336 (0.90x
# against 0.84x); 64x64x256 at N = K = 4096 (128 tiles; 128x64 in two slices 0.80-0.83x, 0.85x)
MID_TILES = ("mid_128x128", "mid_128x64", "mid_64x64")
# M <= 32: 128 columns per tile, split over K, beat narrower tiles at every shape measured
# (N = 14336: 0.97x against 0.88x; N = 4096: 0.86-0.93x with 4 slices against 0.77-0.83x)
SMALL_M_BLOCK_N = (128, 64, 32, 16)
MIN_SLICE_K_TILES = {"small": 8, "mid": 48}     # K steps per split-K slice (see fill_with_slices)
MID_MAX_M = 256
DEFAULT_USE_TMA = True      # descriptors where eligible (GPU sm_90+); False: pointer loads everywhere
DEFAULT_STORE_TMA = False  # out through a descriptor store (with operands through descriptors)
DEFAULT_STORE_SPLIT = 2    # column subtiles of that store
DEFAULT_FLATTEN = False    # H100 2026-11-22: flatten=True was within noise on large GEMMs, 4x slower at M=1, -15% gate-up


def m_bucket(m: int) -> str:
    """The M bucket of the config key: 16 / 32 rows get their own small-M tiles, up to
    MID_MAX_M the memory-bound mid tiles, else large."""
    return "m16" if m <= 16 else "m32" if m <= 32 else "mid" if m <= MID_MAX_M else "large"


def largest_filling_tile(m: int, n: int, sms: int, tiles: tuple = LARGE_TILES) -> str:
    """The largest tile that still gives >= 3/4 of the SMs a tile (fewer, larger tiles reuse more
    operand bytes per FLOP; 112 tiles of 128x128 on 132 SMs beat 224 of 64x128 at M=128); the
    smallest one when none fills the machine."""
    for name in tiles:
        cfg = CONFIGS[name]
        if 4 * cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]) >= 3 * sms:
            return name
    return tiles[-1]


def wide_tile_epilogue(cfg: dict) -> dict:
    """128x256 tiles store through a descriptor in two column halves, with the tile loop
    flattened so the next tile's loads start under this tile's stores (H200 2026-11-24, sweep
    interleaved with cuBLAS: +1-5 % at the six large shapes, 0.97-1.02x cuBLAS against
    0.94-1.00x with pointer stores). Other tiles keep pointer stores (not measured)."""
    if (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (128, 256):
        return dict(STORE_TMA=True, STORE_SPLIT=2, FLATTEN=True)
    return {}


def split_k_slices(tiles: int, k_tiles: int, sms: int, min_slice_k_tiles: int) -> int:
    """K slices per output tile (SPLIT_K) when the tiles alone leave over half the SMs idle (small
    M against a narrow N: the weight would stream through a few SMs at their per-SM bandwidth):
    the most with tiles x slices <= SMs, each slice >= ``min_slice_k_tiles`` K steps."""
    if 2 * tiles > sms:
        return 1
    return max(1, min(sms // tiles, k_tiles // min_slice_k_tiles))


def fill_with_slices(candidates: list, m: int, n: int, k: int, sms: int, min_slice_k_tiles: int) -> dict:
    """The first candidate config (largest tiles first) whose tiles, split over K when they alone
    leave over half the SMs idle, give >= 2/3 of the SMs work; the last one when none does.
    Memory-bound small-M GEMMs want wide tiles (each weight byte read once, few re-reads of a)
    on most SMs. ``min_slice_k_tiles``: the split-K sum runs serially on one SM at ~70 GB/s, so a
    slice must be long against its [BLOCK_M, BLOCK_N] fp32 partial (8 K steps at BLOCK_M = 16,
    48 at BLOCK_M = 128: shorter ones measured slower than an unsplit smaller tile)."""
    for cfg in candidates:
        cfg = dict(cfg, BLOCK_M=_fit(cfg["BLOCK_M"], m), BLOCK_N=_fit(cfg["BLOCK_N"], n), BLOCK_K=_fit(cfg["BLOCK_K"], k))
        tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
        split = split_k_slices(tiles, cdiv(k, cfg["BLOCK_K"]), sms, min_slice_k_tiles)
        if 3 * tiles * split >= 2 * sms:
            break
    if split > 1:
        cfg["SPLIT_K"] = split
    return cfg


def _fit(block: int, dim: int) -> int:
    """A block no larger than the dimension needs (power of two, >= 16 for tl.dot)."""
    return min(block, max(16, next_power_of_2(dim)))


@functools.lru_cache(maxsize=4096)
def _cached_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int) -> tuple:
    return tuple(choose_config(m, n, k, dtype, sms).items())


def choose_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int) -> dict:
    """The launch config of an [m, k] x [k, n] GEMM, keyed by (M bucket, N, K, dtype)."""
    if dtype == torch.float32:
        cfg = dict(CONFIGS["fp32"])
    elif m_bucket(m) in ("m16", "m32"):
        small = CONFIGS["small_m16" if m_bucket(m) == "m16" else "small_m32"]
        return fill_with_slices([dict(small, BLOCK_N=bn) for bn in SMALL_M_BLOCK_N], m, n, k, sms,
                                MIN_SLICE_K_TILES["small"])
    elif m_bucket(m) == "mid":
        return fill_with_slices([CONFIGS[name] for name in MID_TILES], m, n, k, sms, MIN_SLICE_K_TILES["mid"])
    else:
        cfg = dict(CONFIGS[largest_filling_tile(m, n, sms)])
    cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"] = _fit(cfg["BLOCK_M"], m), _fit(cfg["BLOCK_N"], n), _fit(cfg["BLOCK_K"], k)
    return cfg


class TmaLayout(NamedTuple):
    """How descriptors can read a GEMM's operands (see :func:`tma_layout`)."""
    ok: bool                # both operands can be read through descriptors
    a_m_contiguous: bool    # A has unit M stride (xᵀ): tiles are read [K, M] and transposed
    b_k_contiguous: bool    # B has unit K stride (wᵀ): tiles are read [N, K] and transposed


def _unit_axis(strides: tuple, shape: tuple, prefer: int) -> int | None:
    """The axis of a 2-D tensor with unit stride (``prefer`` when both qualify), None if neither."""
    for d in (prefer, 1 - prefer):
        if strides[d] == 1 or shape[d] == 1:
            return d
    return None


def tma_layout_from_strides(a_strides: tuple, b_strides: tuple, a_shape: tuple, b_shape: tuple,
                            aligned: bool, itemsize: int) -> TmaLayout:
    """:func:`tma_layout` from strides and shapes (``aligned``: both base pointers 16-byte aligned)."""
    a_unit, b_unit = _unit_axis(a_strides, a_shape, 1), _unit_axis(b_strides, b_shape, 1)
    a_m_contiguous, b_k_contiguous = a_unit == 0 and a_shape[0] > 1, b_unit == 0 and b_shape[1] > 1
    a_outer = a_strides[1] if a_m_contiguous else a_strides[0]
    b_outer = b_strides[1] if b_k_contiguous else b_strides[0]
    ok = (a_unit is not None and b_unit is not None and aligned
          and (a_outer * itemsize) % 16 == 0 and (b_outer * itemsize) % 16 == 0)
    return TmaLayout(ok, a_m_contiguous, b_k_contiguous)


def tma_layout(a: torch.Tensor, b: torch.Tensor) -> TmaLayout:
    """Whether descriptors can read ``a`` [M, K] and ``b`` [K, N]: each needs a unit stride on one
    axis (a: K, or M for a transposed view; b: N, or K for a transposed weight), a 16-byte aligned
    base and 16-byte aligned other stride. Row-major views are preferred when both qualify."""
    return tma_layout_from_strides(a.stride(), b.stride(), tuple(a.shape), tuple(b.shape),
                                   a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0, a.element_size())


def _store_tma_ok(n: int, out_dtype: torch.dtype) -> bool:
    """The output (allocated here: row-major, aligned) can be stored through a descriptor: its row
    stride must be a multiple of 16 bytes."""
    return (n * out_dtype.itemsize) % 16 == 0


def _tma_by_default(layout_ok: bool, hopper: bool) -> bool:
    """Descriptors by default on sm_90+ GPUs when the layout allows (DEFAULT_USE_TMA)."""
    return DEFAULT_USE_TMA and layout_ok and hopper


def _pointer_loads_cheaper(m: int, a_strides: tuple, b_strides: tuple) -> bool:
    """Small M with both operands K-contiguous (x @ w.t(), nn.Linear's forward) skips the
    descriptors: creating them costs ~1.6 µs per launch, and at the 12 small-M shapes pointer
    loads were 1-11 points closer to cuBLAS (H200 2026-11-24, graph sweep,
    -s7-matmul-sweep-small-m-ptr-graph.log). Other layouts keep descriptors: the pointer path
    clamps rows / columns with a where, which hides an M- or N-contiguous axis from the
    vectorizer (0.03-0.20x cuBLAS measured, -s7-matmul-sweep-small-m-final.log)."""
    return m <= MID_MAX_M and a_strides[1] == 1 and b_strides[0] == 1


def use_tma_default(a: torch.Tensor, layout_ok: bool) -> bool:
    """:func:`_tma_by_default` for ``a``'s device."""
    return _tma_by_default(layout_ok, is_hopper_or_newer(a))
