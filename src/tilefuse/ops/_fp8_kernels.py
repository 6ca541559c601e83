"""Kernels and launch heuristics of ``tilefuse.fp8``'s current-scaling quantization.

Quantization (``x ≈ q.float() * scale``, q in e4m3 / e5m2, fp32 math)::

    amax  = max(max|x|, AMAX_FLOOR)         (over a row, or the whole tensor)
    scale = amax / FP8_MAX                  (IEEE division: tl.div_rn, the same value as torch)
    q     = fp8(clamp(x * (FP8_MAX / amax), -FP8_MAX, FP8_MAX))    round to nearest even, saturating

* ``quantize_rows_kernel``: per-row scales, BLOCK_R rows at a time: an amax loop over the row,
  then a cast loop over it (the second read of a row block comes from L1/L2). Each program also
  writes the max of its rows' amax: the partials of the per-tensor amax below.
* per-tensor scale, no host synchronization (graph-capturable): ``amax_partials_kernel`` writes
  one fp32 max per program; ``quantize_tensor_kernel`` reduces those partials itself (every
  program, <= MAX_PARTIALS floats), then casts its tiles. It can write the row-major copy, the
  transposed copy ``[C, R]`` (the K-major operand the backward GEMMs need), or both from one read.
  Partials of the same tensor from an earlier quantization (either kernel) replace the amax pass:
  max is exact and order-free, so the scale is bit-identical (fp8.matmul's backward re-quantizes
  the forward's operands per tensor this way: two launches and two reads of x and W fewer).
* the fp8 GEMM (``fp8_gemm_kernel``, its heuristics, plan and launcher) is in ``_fp8_gemm.py``
  (its names are re-exported here).

The interpreter (Triton 3.6) converts fp8 wrongly in two places, both worked around only when
interpreting: fp32 -> fp8 does not carry into the exponent on mantissa overflow (31.9 -> 16.0
instead of 32.0) and rounds ties away from zero, so values are first rounded onto the fp8 grid in
fp32 (``SOFT_ROUND``) and its cast is exact; and its fp8 tl.dot goes through fp16 with e5m2
subnormals flushed or halved, so the GEMM upcasts its operands to fp32 itself (``UPCAST``; fp8
products are exact in fp32). On the GPU the hardware conversion (cvt.rn.satfinite) and the fp8
wgmma run as written.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .._dispatch import cdiv, device_traits, empty, next_power_of_2
from .._launch import PreparedArgs, fast_launch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {dt: float(torch.finfo(dt).max) for dt in FP8_DTYPES}            # 448, 57344
# (mantissa bits, exponent of the smallest normal): the fp8 grid for SOFT_ROUND
FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
# amax floor: an all-zero row / tensor gets scale = AMAX_FLOOR / FP8_MAX > 0 (no 0/0 = NaN)
AMAX_FLOOR = 1e-12
MAX_PARTIALS = 1024         # per-tensor amax: most programs of the partial-max pass

# ----------------------------------------------------------------------------------------------
# quantization kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """x (fp32, |x| <= fp8 max) rounded to the nearest fp8 value, ties to even, still in fp32:
    y = rint(x / ulp) · ulp with ulp = 2^(max(exponent(x), MIN_NORMAL_EXP) - MANT_BITS)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_NORMAL_EXP)
    ulp = ((exponent - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exponent + MANT_BITS) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0          # 1.5 · 2^23: y + magic rounds |y| < 2^22 to an integer, ties to even
    y = tl.abs(x) * inv_ulp     # exact: a power of two; y < 2^(MANT_BITS + 1)
    r = ((y + magic) - magic) * ulp
    # x's sign bit onto |result| (bitwise: the interpreter's negation turns 0.0 into +0, not -0)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


# NaN in, NaN out: the amax, its floor and the clamp propagate NaN (tl.maximum / tl.max / tl.clamp
# drop it by default on the GPU: a NaN input came out as a finite product, a NaN gradient as a
# finite grad that no GradScaler sees). An inf input makes amax inf, inv_scale 0 and inf · 0 NaN.
@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(x, axis):
    """max |x| along ``axis``, NaN if any element is NaN."""
    return tl.reduce(tl.abs(x), axis, _nan_max)


@triton.jit
def _to_fp8(x, inv_scale, FP8_MAX: tl.constexpr, SOFT_ROUND: tl.constexpr,
            MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """clamp(x · inv_scale, ±FP8_MAX) in fp32 (NaN kept), rounded onto the fp8 grid under the interpreter."""
    y = tl.clamp(x * inv_scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if SOFT_ROUND:
        # NaN as the fp32 pattern whose top MANT_BITS mantissa bits are set: the 3.6 interpreter's
        # fp32 -> fp8 store truncates the payload, and its default NaN (0x7FC00000) landed on
        # e4m3's finite 384 (an inf input gave an inf product where the GPU's cvt gives NaN)
        nan_bits: tl.constexpr = 0x7F800000 | (((1 << MANT_BITS) - 1) << (23 - MANT_BITS))
        fp8_nan = tl.full(y.shape, nan_bits, tl.int32).to(tl.float32, bitcast=True)
        y = tl.where(y != y, fp8_nan, _round_to_fp8_grid(y, MANT_BITS, MIN_NORMAL_EXP))
    return y


@fast_launch
@triton.jit
def quantize_rows_kernel(
    x_ptr,              # *x [R, C], fp32 / fp16 / bf16, any strides
    q_ptr,              # *q [R, C], fp8, row stride stride_qr, unit column stride
    scale_ptr,          # *scale [R], fp32: amax(row) / FP8_MAX
    partial_ptr,        # *partials [programs], fp32: max|x| over this program's rows (a per-tensor amax's partials)
    R,                  # rows
    C,                  # columns (the scaled axis)
    stride_xr,          # elements between rows of x
    stride_xc,          # elements between columns of x
    stride_qr,          # elements between rows of q
    FP8_MAX: tl.constexpr,          # largest finite value of q's dtype
    AMAX_FLOOR: tl.constexpr,       # amax lower bound (all-zero rows)
    SOFT_ROUND: tl.constexpr,       # round on the fp8 grid in fp32 first (the interpreter)
    MANT_BITS: tl.constexpr,        # q's mantissa bits (SOFT_ROUND)
    MIN_NORMAL_EXP: tl.constexpr,   # exponent of q's smallest normal (SOFT_ROUND)
    BLOCK_R: tl.constexpr,          # rows per block
    BLOCK_C: tl.constexpr,          # columns per loop step
):
    # row blocks strided over the grid (at most MAX_PARTIALS programs): the partials then suit
    # quantize_tensor_kernel as they are, so a later per-tensor quantization of x needs no amax pass
    cols0 = tl.arange(0, BLOCK_C)
    block_max = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for row_block in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        rows64 = rows.to(tl.int64)
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + cols0
            mask = row_ok[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :].to(tl.int64) * stride_xc,
                        mask=mask, other=0.0).to(tl.float32)
            amax = _nan_max(amax, _amax(x, 1))
        block_max = _nan_max(block_max, amax)
        amax = _nan_max(amax, AMAX_FLOOR)
        tl.store(scale_ptr + rows64, tl.div_rn(amax, FP8_MAX), mask=row_ok)
        inv_scale = tl.div_rn(tl.full((BLOCK_R,), FP8_MAX, tl.float32), amax)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + cols0
            mask = row_ok[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :].to(tl.int64) * stride_xc,
                        mask=mask, other=0.0).to(tl.float32)
            q = _to_fp8(x, inv_scale[:, None], FP8_MAX, SOFT_ROUND, MANT_BITS, MIN_NORMAL_EXP)
            tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + tl.program_id(0), tl.reduce(block_max, 0, _nan_max))


@triton.jit
def _tile_offsets(tile, n_col_tiles, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(rows, cols, mask) of 2-D tile ``tile`` of an [R, C] grid of BLOCK_R x BLOCK_C tiles."""
    rows = (tile // n_col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (tile % n_col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    return rows.to(tl.int64), cols.to(tl.int64), mask


@fast_launch
@triton.jit
def amax_partials_kernel(
    x_ptr,              # *x [R, C], any strides
    partial_ptr,        # *partials [NUM_PROGRAMS], fp32: max|x| over this program's tiles
    R,                  # rows
    C,                  # columns
    stride_xr,          # elements between rows of x
    stride_xc,          # elements between columns of x
    n_col_tiles,        # cdiv(C, BLOCK_C)
    n_tiles,            # cdiv(R, BLOCK_R) · n_col_tiles
    NUM_PROGRAMS: tl.constexpr,     # the grid (tile loop stride)
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    amax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for tile in range(tl.program_id(0), n_tiles, NUM_PROGRAMS):
        rows, cols, mask = _tile_offsets(tile, n_col_tiles, R, C, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        amax = _nan_max(amax, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + tl.program_id(0), tl.reduce(tl.reduce(amax, 1, _nan_max), 0, _nan_max))


@fast_launch
@triton.jit
def quantize_tensor_kernel(
    x_ptr,              # *x [R, C], any strides
    partial_ptr,        # *partials [n_partials], fp32 (amax_partials_kernel)
    q_ptr,              # *q [R, C] contiguous, fp8 (ignored unless WRITE_Q)
    qt_ptr,             # *qᵀ [C, R] contiguous, fp8 (ignored unless WRITE_QT)
    scale_ptr,          # *scale [1], fp32: amax / FP8_MAX (written by program 0)
    R,                  # rows
    C,                  # columns
    stride_xr,          # elements between rows of x
    stride_xc,          # elements between columns of x
    n_col_tiles,        # cdiv(C, BLOCK_C)
    n_tiles,            # cdiv(R, BLOCK_R) · n_col_tiles
    n_partials,         # programs of the partial-max pass
    FP8_MAX: tl.constexpr,          # largest finite value of q's dtype
    AMAX_FLOOR: tl.constexpr,       # amax lower bound (all-zero tensors)
    SOFT_ROUND: tl.constexpr,       # round on the fp8 grid in fp32 first (the interpreter)
    MANT_BITS: tl.constexpr,        # q's mantissa bits (SOFT_ROUND)
    MIN_NORMAL_EXP: tl.constexpr,   # exponent of q's smallest normal (SOFT_ROUND)
    WRITE_Q: tl.constexpr,          # store q in x's layout [R, C]
    WRITE_QT: tl.constexpr,         # store the transpose [C, R] (a K-major GEMM operand)
    NUM_PROGRAMS: tl.constexpr,     # the grid (tile loop stride)
    BLOCK_P: tl.constexpr,          # next power of two >= n_partials
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    p = tl.arange(0, BLOCK_P)
    amax = tl.reduce(tl.load(partial_ptr + p, mask=p < n_partials, other=0.0), 0, _nan_max)
    amax = _nan_max(amax, AMAX_FLOOR)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, tl.div_rn(amax, FP8_MAX))
    inv_scale = tl.div_rn(FP8_MAX, amax)
    for tile in range(tl.program_id(0), n_tiles, NUM_PROGRAMS):
        rows, cols, mask = _tile_offsets(tile, n_col_tiles, R, C, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        q = _to_fp8(x.to(tl.float32), inv_scale, FP8_MAX, SOFT_ROUND, MANT_BITS, MIN_NORMAL_EXP)
        if WRITE_Q:
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        if WRITE_QT:
            # the transpose is read transposed (the same tile again, from L2) and stored row-major:
            # storing this tile with column-major offsets, or tl.trans of its fp8 values, wrote
            # wrong elements on the H100 (2026-11-22; both right under the interpreter)
            xt = tl.load(x_ptr + cols[:, None] * stride_xc + rows[None, :] * stride_xr, mask=tl.trans(mask), other=0.0)
            qt = _to_fp8(xt.to(tl.float32), inv_scale, FP8_MAX, SOFT_ROUND, MANT_BITS, MIN_NORMAL_EXP)
            tl.store(qt_ptr + cols[:, None] * R + rows[None, :], qt.to(qt_ptr.dtype.element_ty), mask=tl.trans(mask))


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------

def rows_tile(r: int, c: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the per-row kernel: up to 2048 columns per step, rows stacked to
    ~4096 elements per step so short rows still fill a program."""
    block_c = min(2048, max(16, next_power_of_2(c)))
    return min(max(1, next_power_of_2(r)), max(1, 4096 // block_c)), block_c


def tensor_tile(r: int, c: int, transpose: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the per-tensor kernels: 64 x 64 when writing the transpose (both
    store directions coalesce), else up to 256 columns and ~4096 elements per tile."""
    if transpose:
        return min(64, max(1, next_power_of_2(r))), min(64, max(16, next_power_of_2(c)))
    block_c = min(256, max(16, next_power_of_2(c)))
    return min(max(1, next_power_of_2(r)), 4096 // block_c), block_c


def elementwise_warps(block_elems: int) -> int:
    """4 warps up to 2048 elements per step (16 per thread), 8 above: registers stay small."""
    return 4 if block_elems <= 2048 else 8


# Whether this module's kernels run in Triton's interpreter (SOFT_ROUND, UPCAST): fixed when they
# were decorated (TRITON_INTERPRET at import), so a module constant, not an environment lookup per
# launch (~1 µs each, 8 per fp8.Linear step), and right even if the variable changes afterwards.
KERNELS_INTERPRETED = not isinstance(quantize_rows_kernel.fn, JITFunction)


def _grid_fp8_constants(dtype: torch.dtype, soft_round: bool) -> dict:
    mant, min_exp = FP8_GRID[dtype]
    return dict(FP8_MAX=FP8_MAX[dtype], AMAX_FLOOR=AMAX_FLOOR, SOFT_ROUND=soft_round,
                MANT_BITS=mant, MIN_NORMAL_EXP=min_exp)


# ----------------------------------------------------------------------------------------------
# launch plans: everything but the pointers, cached per shape / strides / options
# ----------------------------------------------------------------------------------------------
# Why: at the sizes where the kernels take a few µs, fp8.Linear's fwd+bwd was host-bound (8
# launches through the heuristics and the full launch key each, ~1 ms per step on the H200 host).
# A plan keys the integers once (FastKernel.prepare); a call keys only its tensors.


class QuantizePlan(NamedTuple):
    grid: tuple                     # (programs,)
    amax: PreparedArgs | None       # amax_partials_kernel's arguments (per-tensor scale only)
    cast: PreparedArgs              # quantize_rows_kernel's / quantize_tensor_kernel's arguments


def rows_programs(r: int, c: int) -> int:
    """Programs of quantize_rows_kernel for an [r, c] x: one per row block, at most MAX_PARTIALS
    (its partials then feed quantize_tensor_kernel); also the length of its partials."""
    return max(1, min(cdiv(r, rows_tile(r, c)[0]), MAX_PARTIALS))


def tensor_programs(r: int, c: int, transpose: bool, sms: int) -> int:
    """Programs of the per-tensor kernels (and partials of amax_partials_kernel): ~8 per SM."""
    block_r, block_c = tensor_tile(r, c, transpose)
    return max(1, min(cdiv(r, block_r) * cdiv(c, block_c), 8 * sms, MAX_PARTIALS))


@functools.lru_cache(maxsize=1024)
def quantize_rows_plan(r: int, c: int, stride_xr: int, stride_xc: int, dtype: torch.dtype,
                       soft_round: bool) -> QuantizePlan:
    """quantize_rows_kernel's launch for an [r, c] x (q written contiguous: row stride c)."""
    block_r, block_c = rows_tile(r, c)
    cast = quantize_rows_kernel.prepare(
        (r, c, stride_xr, stride_xc, max(c, 1)),         # max: torch's row stride of an [r, 0] q
        dict(**_grid_fp8_constants(dtype, soft_round), BLOCK_R=block_r, BLOCK_C=block_c,
             num_warps=elementwise_warps(block_r * block_c)))
    return QuantizePlan((rows_programs(r, c),), None, cast)


@functools.lru_cache(maxsize=1024)
def quantize_tensor_plan(r: int, c: int, stride_xr: int, stride_xc: int, dtype: torch.dtype, write_q: bool,
                         write_qt: bool, sms: int, soft_round: bool, given_partials: int = 0) -> QuantizePlan:
    """amax_partials_kernel + quantize_tensor_kernel for an [r, c] x, one grid for both (the
    partials buffer has one float per program); ``given_partials`` > 0: that many partials of x
    exist already, the cast alone (``amax`` None)."""
    block_r, block_c = tensor_tile(r, c, write_qt)
    n_col_tiles = cdiv(c, block_c)
    n_tiles = cdiv(r, block_r) * n_col_tiles
    programs = tensor_programs(r, c, write_qt, sms)
    n_partials = given_partials or programs
    warps = elementwise_warps(block_r * block_c)
    amax = None if given_partials else amax_partials_kernel.prepare(
        (r, c, stride_xr, stride_xc, n_col_tiles, n_tiles),
        dict(NUM_PROGRAMS=programs, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps))
    cast = quantize_tensor_kernel.prepare(
        (r, c, stride_xr, stride_xc, n_col_tiles, n_tiles, n_partials),
        dict(**_grid_fp8_constants(dtype, soft_round), WRITE_Q=write_q, WRITE_QT=write_qt, NUM_PROGRAMS=programs,
             BLOCK_P=next_power_of_2(n_partials), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps))
    return QuantizePlan((programs,), amax, cast)


# ----------------------------------------------------------------------------------------------
# launchers (inputs validated by the public functions)
# ----------------------------------------------------------------------------------------------


def launch_quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [R, C] contiguous fp8, scale [R] fp32, amax partials [rows_programs(R, C)] fp32) of a
    2-D ``x`` with per-row scales; the partials can stand in for a per-tensor quantization's amax
    pass over the same x (:func:`launch_quantize_tensor`)."""
    r, c = x.shape
    device = x.device
    q = empty((r, c), dtype, device)
    scale = empty((r,), torch.float32, device)
    sx = x.stride()
    plan = quantize_rows_plan(r, c, sx[0], sx[1], dtype, KERNELS_INTERPRETED)
    partials = empty(plan.grid, torch.float32, device)
    quantize_rows_kernel.launch_prepared(plan.grid, (x, q, scale, partials), plan.cast)     # R = 0: partials 0
    return q, scale, partials


def launch_quantize_tensor(x: torch.Tensor, dtype: torch.dtype, write_q: bool = True, write_qt: bool = False,
                           partials: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(q [R, C] or None, qᵀ [C, R] or None, scale [1] fp32, amax partials fp32) of a 2-D ``x``
    with one scale; both layouts come from one read of x when both are asked for. ``partials``:
    amax partials of this same x from an earlier quantization (either launcher): no amax pass."""
    r, c = x.shape
    device = x.device
    q = empty((r, c), dtype, device) if write_q else None
    qt = empty((c, r), dtype, device) if write_qt else None
    scale = empty((1,), torch.float32, device)       # [1]: the GEMM's form of a per-tensor scale
    sx = x.stride()
    plan = quantize_tensor_plan(r, c, sx[0], sx[1], dtype, write_q, write_qt, device_traits(device)[0],
                                KERNELS_INTERPRETED, 0 if partials is None else partials.numel())
    if partials is None:
        partials = empty(plan.grid, torch.float32, device)
        amax_partials_kernel.launch_prepared(plan.grid, (x, partials), plan.amax)
    dummy = q if q is not None else qt if qt is not None else partials
    quantize_tensor_kernel.launch_prepared(
        plan.grid, (x, partials, q if q is not None else dummy, qt if qt is not None else dummy, scale), plan.cast)
    return q, qt, scale, partials


# the fp8 GEMM lives in _fp8_gemm.py; its names are read through this module too (fp8.py, tests)
from ._fp8_gemm import (  # noqa: E402,F401
    DEFAULT_FLATTEN, DEFAULT_USE_TMA, DEFAULT_WARP_SPECIALIZE, GEMM_CONFIGS, LARGE_TILES_FAST, LARGE_TILES_PRECISE,
    SMALL_M, GemmPlan, choose_gemm_config, fp8_gemm_kernel, gemm_plan, gemm_tma_ok, launch_fp8_gemm,
    use_warp_specialized)
