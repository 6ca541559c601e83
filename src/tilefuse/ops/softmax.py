"""softmax and log_softmax over the last dimension, forward and backward.

    softmax(x)_i     = exp(x_i - m) / s,          m = max_j x_j,  s = sum_j exp(x_j - m)
    log_softmax(x)_i = x_i - m - log(s)
    backward (softmax):     dx = y * (dy - sum_j y_j dy_j)
    backward (log_softmax): dx = dy - exp(y) * sum_j dy_j

Bytes counted (ideal, per pass): forward reads x and writes y (2·M·N elements); backward reads
y and dy and writes dx (3·M·N elements). Only y is saved for backward, never x.

Two tiers of the row reduction:

* fused: the whole row (or several short rows) sits in registers; one read, one write, one
  exp per element. Used while the padded row fits (``MAX_FUSED_N`` fp32 values per program).
* looped: rows longer than that are walked in tiles twice, with an online max/sum in the first
  walk (a running max ``m`` and sum ``s`` rescaled by ``exp(m_old - m_new)`` per tile), so the
  forward costs two reads and a write. The second read hits L2 only while the rows in flight fit.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._checks import check_dim, check_tensor
from .._dispatch import cdiv, empty_like, next_power_of_2, rows_view, use_triton
from .._launch import FastKernel, PreparedArgs, config_key, fast_launch
from .._op import custom_op, direct_backward
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._common import LN2, LOG2E, lane_max_sum_merge, lane_max_sum_step, lane_view, row_tile_mask_offsets

# Widest row kept whole in registers, per pass. Measured on an H200 (benchmarks/NOTES.md): at
# N = 32768 the forward runs faster looped (session 9: 4.00 TB/s with 8 warps and L2 hints, against
# 3.63 fused with three rows pipelined through shared memory and 3.26 fused plainly: the second
# read of a 64 KB row hits L2, and the fused tile's registers cost occupancy); the backward, which
# needs no second read to be cheap, runs best fused (4.03-4.08 TB/s at 32 warps).
FWD_MAX_FUSED_N = 16384
BWD_MAX_FUSED_N = 32768
MAX_FUSED_N = BWD_MAX_FUSED_N   # widest row any pass keeps whole (tests cover both sides)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def softmax_fwd_fused_kernel(
    x_ptr,              # *input  [n_rows, n_cols], unit column stride
    y_ptr,              # *output [n_rows, n_cols], contiguous, x's dtype
    x_row_stride,       # elements between rows of x
    y_row_stride,       # elements between rows of y
    n_rows,             # rows (all leading dims flattened)
    n_cols,             # row length
    LOG: tl.constexpr,      # log_softmax instead of softmax
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= n_cols: the whole row is in registers
    LOAD_EVICT: tl.constexpr,   # L2 policy of the x load (FUSED_EVICT: evict_last)
    STORE_EVICT: tl.constexpr,  # L2 policy of the y store
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask, x_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, x_row_stride)
    x = tl.load(x_ptr + x_offs, mask=mask, other=-float("inf"), eviction_policy=LOAD_EVICT).to(tl.float32)
    m = tl.max(x, axis=1)
    z = (x - m[:, None]) * LOG2E            # log2-domain shifted logits; exp2 is one MUFU op
    e = tl.exp2(z)
    s = tl.sum(e, axis=1)
    if LOG:
        y = (z - tl.log2(s)[:, None]) * LN2
    else:
        y = e * (1.0 / s)[:, None]
    _, y_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, y_row_stride)
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask, eviction_policy=STORE_EVICT)


@fast_launch
@triton.jit
def softmax_fwd_looped_kernel(
    x_ptr,              # *input  [n_rows, n_cols], unit column stride
    y_ptr,              # *output [n_rows, n_cols], contiguous
    x_row_stride,       # elements between rows of x
    y_row_stride,       # elements between rows of y
    n_cols,             # row length (> MAX_FUSED_N)
    LOG: tl.constexpr,      # log_softmax instead of softmax
    BLOCK_N: tl.constexpr,  # tile walked per step
    FIRST_EVICT: tl.constexpr,   # L2 policy of walk 1's loads: "evict_last" keeps the row for walk 2
    SECOND_EVICT: tl.constexpr,  # walk 2's: "evict_first" (the row's last use)
    LANE_STATS: tl.constexpr,    # walk 1 keeps a max per thread (no cross-warp step per tile)
    PREFETCH: tl.constexpr,      # ... and issues tile i + 1's load before tile i's math
    REVERSE: tl.constexpr,       # walk 2 from the row's end, the tiles walk 1 left in L2 last
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    if LANE_STATS:
        # walk 1: online max and sum per thread (ops/_common.py), one exp per element and one per
        # 16-byte load to rescale; the threads' partials merged after the walk
        VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
        m = tl.full([BLOCK_N // VEC], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK_N // VEC], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_N)
        x_next = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"), eviction_policy=FIRST_EVICT)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if PREFETCH:
                x = x_next
                x_next = tl.load(x_row + cols + BLOCK_N, mask=cols + BLOCK_N < n_cols, other=-float("inf"),
                                 eviction_policy=FIRST_EVICT)
            else:
                x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"), eviction_policy=FIRST_EVICT)
            m, s = lane_max_sum_step(m, s, lane_view(x.to(tl.float32), VEC), None, 0, False)
        m, s = lane_max_sum_merge(m, s)
    else:
        # walk 1: the tile's max, then the running sum rescaled per tile (one cross-warp max per
        # tile; fewer exps: the faster walk while the row's second read hits L2, up to 64K)
        m = -float("inf")
        s = 0.0
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"),
                        eviction_policy=FIRST_EVICT).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)   # an all -inf prefix stays 0, not NaN
            s = s * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((x - m_safe) * LOG2E), axis=0)
            m = m_new
    log2_s = tl.log2(s)
    inv_s = 1.0 / s
    # walk 2: normalize and write
    last = (n_cols - 1) // BLOCK_N * BLOCK_N
    for i in range(0, n_cols, BLOCK_N):
        cols = (last - i if REVERSE else i) + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=SECOND_EVICT).to(tl.float32)
        z = (x - m) * LOG2E
        if LOG:
            y = (z - log2_s) * LN2
        else:
            y = tl.exp2(z) * inv_s
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_terms(y, dy, LOG: tl.constexpr):
    """Per-element term whose row sum the backward needs: y·dy (softmax) or dy (log_softmax)."""
    if LOG:
        return dy
    else:
        return y * dy


@triton.jit
def _softmax_bwd_dx(y, dy, row_sum, LOG: tl.constexpr):
    if LOG:
        return dy - tl.exp2(y * LOG2E) * row_sum
    else:
        return y * (dy - row_sum)


@fast_launch
@triton.jit
def softmax_bwd_fused_kernel(
    y_ptr,              # *forward output [n_rows, n_cols]
    dy_ptr,             # *grad of output [n_rows, n_cols]
    dx_ptr,             # *grad of input  [n_rows, n_cols], contiguous
    y_row_stride,       # elements between rows of y
    dy_row_stride,      # elements between rows of dy
    dx_row_stride,      # elements between rows of dx
    n_rows,             # rows
    n_cols,             # row length
    LOG: tl.constexpr,      # y is log_softmax output
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= n_cols
    LOAD_EVICT: tl.constexpr,   # L2 policy of the y and dy loads (as the forward's)
    STORE_EVICT: tl.constexpr,  # L2 policy of the dx store
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask, y_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, y_row_stride)
    _, dy_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dy_row_stride)
    _, dx_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dx_row_stride)
    y = tl.load(y_ptr + y_offs, mask=mask, other=0.0, eviction_policy=LOAD_EVICT).to(tl.float32)
    dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0, eviction_policy=LOAD_EVICT).to(tl.float32)
    row_sum = tl.sum(_softmax_bwd_terms(y, dy, LOG), axis=1)
    dx = _softmax_bwd_dx(y, dy, row_sum[:, None], LOG)
    tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask, eviction_policy=STORE_EVICT)


@fast_launch
@triton.jit
def softmax_bwd_looped_kernel(
    y_ptr,              # *forward output [n_rows, n_cols]
    dy_ptr,             # *grad of output [n_rows, n_cols]
    dx_ptr,             # *grad of input  [n_rows, n_cols], contiguous
    y_row_stride,       # elements between rows of y
    dy_row_stride,      # elements between rows of dy
    dx_row_stride,      # elements between rows of dx
    n_cols,             # row length (> MAX_FUSED_N)
    LOG: tl.constexpr,      # y is log_softmax output
    BLOCK_N: tl.constexpr,  # tile walked per step
    FIRST_EVICT: tl.constexpr,   # as the forward's
    SECOND_EVICT: tl.constexpr,  # as the forward's
    PREFETCH: tl.constexpr,      # as the forward's (both inputs of walk 1)
    REVERSE: tl.constexpr,       # as the forward's
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * y_row_stride
    dy_row = dy_ptr + row * dy_row_stride
    dx_row = dx_ptr + row * dx_row_stride
    # walk 1: per-element partial sums, one cross-warp reduction after the walk
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    dy_next, y_next = _softmax_bwd_loads(y_row, dy_row, cols, n_cols, LOG, FIRST_EVICT)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if PREFETCH:
            dy, y = dy_next, y_next
            dy_next, y_next = _softmax_bwd_loads(y_row, dy_row, cols + BLOCK_N, n_cols, LOG, FIRST_EVICT)
        else:
            dy, y = _softmax_bwd_loads(y_row, dy_row, cols, n_cols, LOG, FIRST_EVICT)
        acc += _softmax_bwd_terms(y, dy, LOG)
    row_sum = tl.sum(acc, axis=0)
    last = (n_cols - 1) // BLOCK_N * BLOCK_N
    for i in range(0, n_cols, BLOCK_N):
        cols = (last - i if REVERSE else i) + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy=SECOND_EVICT).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy=SECOND_EVICT).to(tl.float32)
        tl.store(dx_row + cols, _softmax_bwd_dx(y, dy, row_sum, LOG).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_loads(y_row, dy_row, cols, n_cols, LOG: tl.constexpr, EVICT: tl.constexpr):
    """(dy, y) of one tile in fp32, 0 past the row; log_softmax's walk 1 needs no y (0.0)."""
    mask = cols < n_cols
    dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    y = 0.0
    if not LOG:
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return dy, y


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


def _fused_block_n(n_cols: int) -> int:
    """The padded row: a power of two so the whole row is one register tile."""
    return next_power_of_2(max(n_cols, 1))


def _rows_per_program(block_n: int, n_rows: int) -> int:
    """Short rows share a program up to ~2K elements per tile: many small programs beat few big
    ones (H200 sweeps: 1 row of 4096 or 2 rows of 1024 per program were best)."""
    return max(1, min(2048 // block_n, next_power_of_2(max(n_rows, 1))))


def _num_warps(tile_elems: int) -> int:
    """~32 values per thread (four 16-byte bf16 loads in flight), 4 to 32 warps: more warps than
    that stalled the loads on the cross-warp row reductions (H200: 4 warps 3.55 TB/s vs 16 warps
    2.35 at 1x4096); a fused 32K row wants all 32 (backward: 4.08 vs 3.79 TB/s at 16, session 9)."""
    return max(4, min(32, tile_elems // (32 * 32)))


LOOPED_BLOCK_N = 16384   # tile of the looped tier up to LONG_ROW (best or tied-best at N = 32K)
# L2 hints of the looped tier's two walks, as inductor's two-walk reductions: keep the row for
# the second walk, then let it go (H200 session 9: 4.00 vs 3.44 TB/s at 4096x32768 forward
# with 8 warps; +1.5 % at 1024x262144, whose rows in flight outgrow L2 anyway)
LOOPED_EVICT = {"FIRST_EVICT": "evict_last", "SECOND_EVICT": "evict_first"}


def _looped_num_warps(n_cols: int, forward: bool) -> int:
    """Looped tier: 64 values per thread (8 warps) for forward rows up to 64K, so twice the programs
    stay resident and more rows' second walks hit L2 (4096x32768: 4.00 TB/s vs 3.45 at 16 warps);
    the backward keeps 16."""
    return 8 if forward and n_cols <= 65536 else _num_warps(LOOPED_BLOCK_N)


# L2 hints of the fused tier (one read, one write per element). Loads with evict_last, as
# RMSNorm's x (session 9, not understood there either): H200 session 39, bench timer (do_bench,
# zero_ flush), 8192x4096 bf16 forward 35.8 us against 36.8 unhinted, backward 51.4 against 52.6,
# 4096x32768 backward 199.5 against 202.2; evict_first on loads or the store was slower or level
# (results/nvidia-h200-2026-11-28-s39-evict-probe.log, -sweep-softmax-fused-evict.log).
FUSED_EVICT = {"LOAD_EVICT": "evict_last", "STORE_EVICT": ""}


LONG_ROW = 65536   # rows longer than this: too many in flight for L2 at several programs per SM


def _long_row_config(forward: bool, elem_bytes: int) -> dict:
    """Rows past LONG_ROW (a 512 KB bf16 row at 262144): 64 KB tiles at 32 warps, one program (one
    row) per SM, walk 2 running backwards from the tiles walk 1 read last; the forward's walk 1
    keeps per-thread maxima and prefetches its next tile (the backward's walk 1 has no max, and
    prefetching its two inputs lost). H200 session 32, 1024x262144 bf16, 3 interleaved rounds
    against the previous tree: forward 354.8 us (3,026 GB/s) against 400.8 (2,679), backward
    588.4 (2,737) against 640.5 (2,515). At 4096x32768 the same forward lost (190 us against 134:
    there the 16K / 8-warp tiles' second read hits L2 already)."""
    cfg = {"looped": True, "BLOCK_M": 1, "BLOCK_N": 65536 // elem_bytes, "num_warps": 32, **LOOPED_EVICT,
           "REVERSE": True}
    if forward:
        cfg.update(LANE_STATS=True, PREFETCH=True)
    return cfg


# ----------------------------------------------------------------------------------------------
# launchers (inputs already validated by the public function)
# ----------------------------------------------------------------------------------------------


def _launch_config(n_rows: int, n_cols: int, forward: bool, config: dict | None, elem_bytes: int = 2) -> dict:
    """Tier and tile of one pass over a [n_rows, n_cols] problem of ``elem_bytes`` values;
    ``config`` overrides keys (GPU sweeps). Cached per shape (host time); the returned dict is
    shared: read it, never change it."""
    return _cached_config(n_rows, n_cols, forward, config_key(config), elem_bytes)


@functools.lru_cache(maxsize=1024)
def _cached_config(n_rows: int, n_cols: int, forward: bool, config: tuple, elem_bytes: int = 2) -> dict:
    if n_cols <= (FWD_MAX_FUSED_N if forward else BWD_MAX_FUSED_N):
        block_n = _fused_block_n(n_cols)
        block_m = _rows_per_program(block_n, n_rows)
        cfg = {"looped": False, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": _num_warps(block_m * block_n),
               **FUSED_EVICT}
    elif n_cols > LONG_ROW:
        cfg = _long_row_config(forward, elem_bytes)
    else:
        warps = _looped_num_warps(n_cols, forward)
        cfg = {"looped": True, "BLOCK_M": 1, "BLOCK_N": LOOPED_BLOCK_N, "num_warps": warps, **LOOPED_EVICT}
    cfg.update(config)
    return cfg


class _Plan(NamedTuple):
    kernel: FastKernel         # the fused or the looped tier's kernel
    grid: tuple
    prepared: PreparedArgs     # its integers and constexprs


def _plan(fused: FastKernel, looped: FastKernel, forward: bool, n_rows: int, n_cols: int, in_strides: tuple,
          log: bool, config: tuple, elem_bytes: int) -> _Plan:
    """One pass's launch. Both passes' kernels take the inputs' row strides, the output's (n_cols:
    it is contiguous), then n_rows (fused tier only) and n_cols."""
    cfg = _cached_config(n_rows, n_cols, forward, config, elem_bytes)
    if not cfg["looped"]:
        kwargs = dict(LOG=log, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                      **{k: cfg.get(k, "") for k in FUSED_EVICT})
        return _Plan(fused, (cdiv(n_rows, cfg["BLOCK_M"]),),
                     fused.prepare((*in_strides, n_cols, n_rows, n_cols), kwargs))
    evict = {k: cfg.get(k, "") for k in LOOPED_EVICT}     # a config forcing the looped tier may omit them
    kwargs = dict(LOG=log, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], **evict,
                  PREFETCH=cfg.get("PREFETCH", False), REVERSE=cfg.get("REVERSE", False))
    if forward:
        kwargs["LANE_STATS"] = cfg.get("LANE_STATS", False)
    return _Plan(looped, (n_rows,), looped.prepare((*in_strides, n_cols, n_cols), kwargs))


@functools.lru_cache(maxsize=1024)
def _fwd_plan(n_rows: int, n_cols: int, x_stride: int, log: bool, config: tuple = (), elem_bytes: int = 2) -> _Plan:
    """The forward's launch, cached per shape (host time: a small softmax's kernel takes a few µs,
    and keying every integer of its launch on each call cost as much again)."""
    return _plan(softmax_fwd_fused_kernel, softmax_fwd_looped_kernel, True, n_rows, n_cols,
                 (x_stride,), log, config, elem_bytes)


@functools.lru_cache(maxsize=1024)
def _bwd_plan(n_rows: int, n_cols: int, y_stride: int, dy_stride: int, log: bool, config: tuple = (),
              elem_bytes: int = 2) -> _Plan:
    """The backward's launch, cached per shape."""
    return _plan(softmax_bwd_fused_kernel, softmax_bwd_looped_kernel, False, n_rows, n_cols,
                 (y_stride, dy_stride), log, config, elem_bytes)


def _launch_fwd(x: torch.Tensor, log: bool, config: dict | None = None) -> torch.Tensor:
    x2 = rows_view(x)
    n_rows, n_cols = x2.shape
    y = empty_like(x)                   # contiguous: row stride n_cols
    if n_rows == 0 or n_cols == 0:
        return y
    plan = _fwd_plan(n_rows, n_cols, x2.stride(0), log, config_key(config), x.element_size())
    plan.kernel.launch_prepared(plan.grid, (x2, y), plan.prepared)
    return y


def _launch_bwd(y: torch.Tensor, dy: torch.Tensor, log: bool, config: dict | None = None) -> torch.Tensor:
    y2, dy2 = rows_view(y), rows_view(dy)
    n_rows, n_cols = y2.shape
    dx = empty_like(y)                  # contiguous: row stride n_cols
    if n_rows == 0 or n_cols == 0:
        return dx
    plan = _bwd_plan(n_rows, n_cols, y2.stride(0), dy2.stride(0), log, config_key(config), y.element_size())
    plan.kernel.launch_prepared(plan.grid, (y2, dy2, dx), plan.prepared)
    return dx


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(_wide(x), dim).to(x.dtype)


def log_softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(_wide(x), dim).to(x.dtype)


def _softmax_bwd_reference(y: torch.Tensor, dy: torch.Tensor, log: bool) -> torch.Tensor:
    yw, dyw = _wide(y), _wide(dy)
    if log:
        dx = dyw - yw.exp() * dyw.sum(-1, keepdim=True)
    else:
        dx = yw * (dyw - (yw * dyw).sum(-1, keepdim=True))
    return dx.to(y.dtype)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::softmax_fwd", mutates_args=())
def _softmax_fwd_op(x: torch.Tensor, log: bool) -> torch.Tensor:
    if use_triton(x):
        return _launch_fwd(x, log)
    return (log_softmax_reference if log else softmax_reference)(x).contiguous()


@_softmax_fwd_op.register_fake
def _(x, log):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@custom_op("tilefuse::softmax_bwd", mutates_args=())
def _softmax_bwd_op(y: torch.Tensor, dy: torch.Tensor, log: bool) -> torch.Tensor:
    if use_triton(y):
        return _launch_bwd(y, dy, log)
    return _softmax_bwd_reference(y, dy, log).contiguous()


@_softmax_bwd_op.register_fake
def _(y, dy, log):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _setup_context(ctx, inputs, output):
    ctx.log = inputs[1]
    ctx.save_for_backward(output)


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    bwd_op = _softmax_bwd_op.direct if direct_backward(ctx, dy) else _softmax_bwd_op
    return bwd_op(y, dy if dy.dtype == y.dtype else dy.to(y.dtype), ctx.log), None


_softmax_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _softmax_any_dim(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    check_tensor("x", x)
    dim = check_dim("x", x, dim)
    if x.dim() > 1 and dim != x.dim() - 1:
        # the kernels reduce the last dim; other dims go through a transposed (copied) view
        return _softmax_fwd_op(x.transpose(dim, -1), log).transpose(dim, -1)
    return _softmax_fwd_op(x, log)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.softmax(x, dim)`` with fp32 math for fp16/bf16 inputs; output in x's dtype."""
    return _softmax_any_dim(x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.log_softmax(x, dim)`` with fp32 math for fp16/bf16 inputs; output in x's dtype."""
    return _softmax_any_dim(x, dim, log=True)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _make_inputs(shape, dtype, device):
    # scale 4: rows with a real spread of probabilities, not a near-uniform softmax
    x = (torch.randn(shape, device=device, dtype=torch.float32) * 4).to(dtype).requires_grad_(True)
    return Inputs((x,), grad_args=(0,))


def _bytes(shape, dtype, pass_):
    # fwd: x read + y written; bwd: y, dy read + dx written
    return tensor_bytes(shape, dtype) * (2 if pass_ == "fwd" else 3)


def _flops_of(log: bool):
    """Per row of n, the module docstring's formulas: forward m (n-1 compares), x - m, exp, s (n-1
    adds), then / s (softmax: 5n - 2) or log s and a subtract (log_softmax: 5n - 1); backward
    sum_j y_j dy_j (2n - 1), a subtract and a multiply (softmax: 4n - 1), or sum_j dy_j, exp(y),
    a multiply and a subtract (log_softmax: 4n - 1)."""
    def flops(shape, pass_):
        n = shape[-1]
        rows = math.prod(shape[:-1])
        return rows * ((5 * n - 1 if log else 5 * n - 2) if pass_ == "fwd" else 4 * n - 1)
    return flops


def _liger_softmax():
    try:
        from liger_kernel.functional import softmax as liger_softmax  # type: ignore
    except Exception:
        return None
    return liger_softmax


_TEST_SHAPES = [(1, 1), (3, 781), (7, 4097), (2, 3, 1000), (1, 65537), (5, 1), (33, 64)]
_GPU_TEST_SHAPES = [(8192, 1024), (64, 32768), (4, 262144), (4096, 4096 + 3)]
_BENCH_SHAPES = [(8192, 1024), (8192, 4096), (4096, 32768), (1024, 262144)]

register(OpSpec(
    name="softmax",
    fn=softmax,
    reference=softmax_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops_of(log=False),
    test_shapes=_TEST_SHAPES,
    gpu_test_shapes=_GPU_TEST_SHAPES,
    bench_shapes=_BENCH_SHAPES,
    peers={"torch": lambda: (lambda x: torch.softmax(x, -1)), "liger": _liger_softmax},
    description="softmax over the last dim",
))

register(OpSpec(
    name="log_softmax",
    fn=log_softmax,
    reference=log_softmax_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops_of(log=True),
    test_shapes=_TEST_SHAPES,
    gpu_test_shapes=_GPU_TEST_SHAPES,
    bench_shapes=_BENCH_SHAPES[:2],
    peers={"torch": lambda: (lambda x: torch.log_softmax(x, -1))},
    description="log_softmax over the last dim",
))
