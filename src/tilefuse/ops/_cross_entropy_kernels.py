"""Triton kernels of cross_entropy (and linear_cross_entropy's chunks): loss and gradient rows,
and the in-place scaling of stored gradients by grad_output. The math is in ops/cross_entropy.py.

Two ways to get the gradient: in the forward (``cross_entropy_fwd_kernel`` with WRITE_GRAD, as
Liger does; a grad_output other than 1 then costs a scaling pass, ``scale_rows_kernel``), or
deferred (the forward writes three fp32 statistics per row -- max m, log2 s, q = 1 - p_t -- and
``cross_entropy_bwd_kernel`` rebuilds the gradient from them and the logits, times grad_output).
Both walk the gradient with the same helpers (``_grad_walk``, ``_store_target_grad``).

Numerics, all in fp32 whatever the logits' dtype:

* differences against the row max first: p = exp2((x - m)·log2 e - log2 s), loss terms (m - x_t),
  never x - lse (at |x| ~ 1e4, lse's own fp32 rounding is a 1e-3 relative error in p);
* q = 1 - p_t is summed over the other classes (the target's term added from its scalar logit),
  so a confident row (p_t ~ 1) keeps its relative precision: the target's gradient is
  (eps - q) - eps/V and -log p_t = -log1p(-q) there, where softmax - onehot and (m - x_t) + ln s
  would be all rounding;
* the soft cap's tanh and slope are fp32-accurate for every logit (see _softcap).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .._dispatch import empty, next_power_of_2, num_sms
from .._launch import fast_launch
from ._common import LN2, LOG2E, lane_max_sum_merge, lane_max_sum_step, lane_view

MAX_SINGLE_TILE = 8192    # a row this long sits in registers (16 warps x 16 values per thread): one read
BWD_BLOCK_V = 8192        # ... of the deferred backward: 16 values per thread at 16 warps
LOOPED_STATS_BLOCK_V = 4096   # ... when it writes no gradient (the deferred forward): 16 values at 8 warps
LOOPED_GRAD_EVICT = {"STATS_EVICT": "evict_last", "GRAD_EVICT": "evict_first", "STORE_EVICT": "evict_first"}
SCALE_BLOCK = 4096        # tile of the in-place scaling pass (8 warps, 16 values per thread)
SCALE_PROGRAMS_PER_SM = 4 # its persistent grid: 4 x 8 warps at ~40 registers all fit on an SM at once
TARGET_SCAN_MAX = 1 << 16 # target_scan_kernel's one program takes up to this many targets (a few us)
TARGET_SCAN_BLOCK = 2048


class CEOptions(NamedTuple):
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _softcap(x, softcap):
    """(c·tanh(x/c), its slope 1 - tanh^2), fp32-accurate for every x (libdevice.tanh is not in the
    interpreter). With y = x/c and e = exp(-2|y|) in (0, 1]: tanh = sign·(1 - e)/(1 + e) and
    1 - tanh^2 = 4e/(1 + e)^2 (no 1 - t·t cancellation where tanh saturates); below |y| = 1/4,
    where 1 - e would cancel, tanh's odd series to y^9 (error < 1e-8 relative)."""
    y = x / softcap
    e = tl.exp2((-2.0 * LOG2E) * tl.abs(y))
    r = 1.0 / (1.0 + e)
    y2 = y * y
    series = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0)))))
    t = tl.where(tl.abs(y) < 0.25, series, tl.where(y < 0, e - 1.0, 1.0 - e) * r)
    return softcap * t, 4.0 * e * r * r


@triton.jit
def _load_logits(row_ptr, cols, n_cols, softcap, HAS_SOFTCAP: tl.constexpr, EVICT: tl.constexpr):
    """(x', mask, dx'/dx) of one fp32 tile of (soft-capped) logits; past the row x' is -inf.
    EVICT: the load's L2 policy."""
    mask = cols < n_cols
    if HAS_SOFTCAP:
        x = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        x, slope = _softcap(x, softcap)
        x = tl.where(mask, x, -float("inf"))
    else:
        x = tl.load(row_ptr + cols, mask=mask, other=-float("inf"), eviction_policy=EVICT).to(tl.float32)
        slope = 1.0
    return x, mask, slope


@triton.jit
def _row_stats_looped(row_ptr, n_cols, t_col, softcap,
                      HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
                      VEC: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr):
    """(m, s_other, sum_j x'_j) of a row walked in tiles (see _tile_stats), with no cross-warp
    step inside the loop: the tile is viewed as [BLOCK_V / VEC, VEC] (VEC = one 16-byte load per
    thread, so each row of the view is one thread's) and every thread keeps its own running max
    and rescaled sum (one extra exp2 per VEC values), merged once after the walk. So warps run
    ahead of each other and a program keeps its loads in flight; PREFETCH issues tile i + 1's
    load before tile i's math. (Until session 31 the walk took the tile's max first, a
    cross-warp reduction and two barriers per tile: 69 % of copy where this reaches 90 %.)"""
    LANES: tl.constexpr = BLOCK_V // VEC
    m = tl.full([LANES], -float("inf"), tl.float32)
    s_other = tl.zeros([LANES], dtype=tl.float32)
    sum_x = tl.zeros([LANES], dtype=tl.float32)
    x_next, _, _ = _load_logits(row_ptr, tl.arange(0, BLOCK_V), n_cols, softcap, HAS_SOFTCAP, EVICT)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        if PREFETCH:
            x = x_next
            x_next, _, _ = _load_logits(row_ptr, cols + BLOCK_V, n_cols, softcap, HAS_SOFTCAP, EVICT)
        else:
            x, _, _ = _load_logits(row_ptr, cols, n_cols, softcap, HAS_SOFTCAP, EVICT)
        x2 = lane_view(x, VEC)
        c2 = lane_view(cols, VEC)
        m, s_other = lane_max_sum_step(m, s_other, x2, c2, t_col, True)
        if HAS_SMOOTHING:
            sum_x += tl.sum(tl.where(c2 < n_cols, x2, 0.0), axis=1)
    m_row, s_row = lane_max_sum_merge(m, s_other)
    return m_row, s_row, tl.sum(sum_x, axis=0)


@triton.jit
def _tile_stats(x, mask, cols, t_col, HAS_SMOOTHING: tl.constexpr):
    """(m, s_other, sum_j x'_j) of a row held in one register tile: the max m and the sum of
    exp(x'_j - m) over the classes other than the target. The target's term is added back from its
    scalar logit, so q = 1 - p_t = s_other / s keeps its relative precision when p_t ~ 1 (1 - p_t
    would be ~1e-7 of rounding), at the cost of one vector accumulator, not two."""
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    s_other = tl.sum(tl.where(cols == t_col, 0.0, tl.exp2((x - m_safe) * LOG2E)), axis=0)
    sum_x = 0.0
    if HAS_SMOOTHING:
        sum_x = tl.sum(tl.where(mask, x, 0.0), axis=0)
    return m, s_other, sum_x


@triton.jit
def _nll(m, x_t, log_s, q):
    """-log p_t: (m - x'_t) + ln s, or -log1p(-q) where p_t > 1/2 (there the first form cancels
    to ~1e-7 absolute). log1p(y) = log(u)·y/(u - 1), u = 1 + y rounded (Goldberg): triton.language
    has no log1p."""
    u = 1.0 - q
    u_used = tl.maximum(u, 0.5)   # the form is only taken for q <= 1/2
    log1p_neg_q = tl.where(u == 1.0, -q, tl.log(u_used) * (-q) / tl.where(u == 1.0, 1.0, u_used - 1.0))
    return tl.where(q <= 0.5, -log1p_neg_q, (m - x_t) + log_s)


@triton.jit
def _grad_tile(x, slope, m, log2_s, scale, z_coef, uniform, HAS_SOFTCAP: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """dloss/dx of one tile's non-target classes: (p·scale - uniform + p·z_coef)·dx'/dx."""
    # p = exp(x - m) / s: x - m first, never x - lse (at |x| ~ 1e4 lse's fp32 rounding alone
    # would be a 1e-3 relative error in p)
    p = tl.exp2((x - m) * LOG2E - log2_s)
    g = p * scale - uniform
    if HAS_Z_LOSS:
        g += p * z_coef
    if HAS_SOFTCAP:
        g = g * slope
    return g


@triton.jit
def _zero_row(g_row, n_cols, BLOCK_V: tl.constexpr):
    """An ignored row's gradient."""
    zeros = tl.zeros([BLOCK_V], dtype=g_row.dtype.element_ty)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(g_row + cols, zeros, mask=cols < n_cols)


@triton.jit
def _grad_walk(x_row, g_row, n_cols, m, log2_s, scale, z_coef, uniform, softcap,
               HAS_SOFTCAP: tl.constexpr, HAS_Z_LOSS: tl.constexpr, REVERSE: tl.constexpr, BLOCK_V: tl.constexpr,
               EVICT: tl.constexpr, STORE_EVICT: tl.constexpr, PREFETCH: tl.constexpr):
    """scale·dloss/dx of every non-target class of a row, tile by tile (g_row may be x_row: each
    tile is read before it is overwritten, also with PREFETCH: the next tile's load is issued
    before this tile's math and store, and tiles never overlap). REVERSE walks from the row's
    end, whose tiles a preceding stats walk left in L2. EVICT / STORE_EVICT: L2 policies of the
    loads and stores."""
    last = (n_cols - 1) // BLOCK_V * BLOCK_V
    x_next, _, slope_next = _load_logits(x_row, tl.arange(0, BLOCK_V) + (last if REVERSE else 0), n_cols,
                                         softcap, HAS_SOFTCAP, EVICT)
    for i in range(0, n_cols, BLOCK_V):
        start = last - i if REVERSE else i
        cols = start + tl.arange(0, BLOCK_V)
        if PREFETCH:
            x, slope, mask = x_next, slope_next, cols < n_cols
            # the next tile; past the row's end (or, reversed, its start) a limit that masks it all
            nxt = start - BLOCK_V if REVERSE else start + BLOCK_V
            limit = tl.where(nxt >= 0, n_cols, -BLOCK_V)
            x_next, _, slope_next = _load_logits(x_row, nxt + tl.arange(0, BLOCK_V), limit, softcap, HAS_SOFTCAP,
                                                 EVICT)
        else:
            x, mask, slope = _load_logits(x_row, cols, n_cols, softcap, HAS_SOFTCAP, EVICT)
        g = _grad_tile(x, slope, m, log2_s, scale, z_coef, uniform, HAS_SOFTCAP, HAS_Z_LOSS)
        tl.store(g_row + cols, g.to(g_row.dtype.element_ty), mask=mask, eviction_policy=STORE_EVICT)


@triton.jit
def _store_target_grad(g_row, target, in_range, q, p_t, slope_t, scale, z_coef, uniform, label_smoothing,
                       HAS_SOFTCAP: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """The target's entry, rewritten once after the walk rather than picked out per element in it
    (that compare cost registers, i.e. occupancy): p_t - eps/V - (1 - eps) = (eps - q) - eps/V,
    free of the p_t - 1 cancellation. The barrier orders this store after the walk's store of the
    same address."""
    target_grad = scale * (label_smoothing - q) - uniform
    if HAS_Z_LOSS:
        target_grad += p_t * z_coef
    if HAS_SOFTCAP:
        target_grad = target_grad * slope_t
    tl.debug_barrier()
    tl.store(g_row + target, target_grad.to(g_row.dtype.element_ty), mask=in_range)


@triton.jit
def _cross_entropy_row(x_row, g_row, target, loss_ptr, stats_ptr, stats_stride, scale, n_cols, ignore_index,
                       label_smoothing, z_loss, softcap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                       HAS_Z_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, SAVE_STATS: tl.constexpr,
                       SINGLE_TILE: tl.constexpr, BLOCK_V: tl.constexpr, STATS_EVICT: tl.constexpr,
                       GRAD_EVICT: tl.constexpr, STORE_EVICT: tl.constexpr, VEC: tl.constexpr,
                       PREFETCH: tl.constexpr, GRAD_PREFETCH: tl.constexpr):
    """One row: its loss into *loss_ptr; with WRITE_GRAD scale·dloss/dx into g_row; with
    SAVE_STATS (m, log2 s, q) into stats_ptr[0 | 1 | 2 · stats_stride] for the deferred backward."""
    # the target as an int32 column for the per-element compares (-1: matches no column)
    t_col = tl.where((target >= 0) & (target < n_cols), target, -1).to(tl.int32)
    if target == ignore_index:
        tl.store(loss_ptr, 0.0)
        if WRITE_GRAD:
            _zero_row(g_row, n_cols, BLOCK_V)
    else:
        if SINGLE_TILE:
            cols = tl.arange(0, BLOCK_V)
            x, mask, slope = _load_logits(x_row, cols, n_cols, softcap, HAS_SOFTCAP, "")
            m, s_other, sum_x = _tile_stats(x, mask, cols, t_col, HAS_SMOOTHING)
        else:
            m, s_other, sum_x = _row_stats_looped(x_row, n_cols, t_col, softcap, HAS_SOFTCAP, HAS_SMOOTHING,
                                                  BLOCK_V, VEC, PREFETCH, STATS_EVICT)
        m = tl.where(m == -float("inf"), 0.0, m)   # an all -inf row: NaN loss below, no NaN shift
        # the target logit is one scalar load (cached); an out-of-range target (check_targets=False)
        # reads nothing and makes the row NaN
        in_range = (target >= 0) & (target < n_cols)
        x_t = tl.load(x_row + target, mask=in_range, other=float("nan")).to(tl.float32)
        slope_t = 1.0
        if HAS_SOFTCAP:
            x_t, slope_t = _softcap(x_t, softcap)
        e_t = tl.exp2((x_t - m) * LOG2E)
        s = s_other + e_t
        q = s_other / s
        log2_s = tl.log2(s)
        log_s = log2_s * LN2
        lse = m + log_s
        loss = _nll(m, x_t, log_s, q)
        if HAS_SMOOTHING:   # eps·(lse - mean x'), with m subtracted first as in p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * ((m - sum_x / n_cols) + log_s)
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr, loss)
        if SAVE_STATS:
            tl.store(stats_ptr, m)
            tl.store(stats_ptr + stats_stride, log2_s)
            tl.store(stats_ptr + 2 * stats_stride, q)
        if WRITE_GRAD:
            z_coef = scale * (2.0 * z_loss) * lse
            uniform = scale * (label_smoothing / n_cols)
            if SINGLE_TILE:
                g = _grad_tile(x, slope, m, log2_s, scale, z_coef, uniform, HAS_SOFTCAP, HAS_Z_LOSS)
                tl.store(g_row + cols, g.to(g_row.dtype.element_ty), mask=mask)
            else:
                _grad_walk(x_row, g_row, n_cols, m, log2_s, scale, z_coef, uniform, softcap,
                           HAS_SOFTCAP, HAS_Z_LOSS, True, BLOCK_V, GRAD_EVICT, STORE_EVICT, GRAD_PREFETCH)
            _store_target_grad(g_row, target, in_range, q, e_t / s, slope_t, scale, z_coef, uniform,
                               label_smoothing, HAS_SOFTCAP, HAS_Z_LOSS)


@fast_launch
@triton.jit
def cross_entropy_fwd_kernel(
    logits_ptr,         # *[n_rows, n_cols] logits, unit column stride
    grad_ptr,           # *[n_rows, n_cols] dloss/dlogits (may be logits_ptr: in-place mode)
    target_ptr,         # *[n_rows] int32/int64 class ids
    loss_ptr,           # *[n_rows] fp32 loss per row before reduction (0 on ignored rows)
    scale_ptr,          # *fp32 gradient scale per row (1/n_valid for mean, grad_output rows, ...)
    stats_ptr,          # *fp32 [3, n_rows] (m, log2 s, q) per row, written with SAVE_STATS
    skip_ptr,           # *bool: when set (a failed target check, HAS_SKIP) the kernel writes nothing
    logits_row_stride,  # elements between rows of logits
    grad_row_stride,    # elements between rows of grad
    scale_stride,       # 0: one scale shared by every row, 1: one per row
    n_rows,             # rows (tokens)
    n_cols,             # vocabulary size V
    ignore_index,       # target value of rows that contribute nothing
    label_smoothing,    # eps
    z_loss,             # z
    softcap,            # c (unused without HAS_SOFTCAP)
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SKIP: tl.constexpr,     # read *skip_ptr first
    WRITE_GRAD: tl.constexpr,   # False: loss only (nothing needs the gradient, or it is deferred)
    SAVE_STATS: tl.constexpr,   # write the row statistics of the deferred backward
    SINGLE_TILE: tl.constexpr,  # the whole row is one register tile: read once
    BLOCK_V: tl.constexpr,      # tile of the row
    STATS_EVICT: tl.constexpr,  # L2 policy of the looped stats walk's loads ("evict_last": kept for the gradient walk)
    GRAD_EVICT: tl.constexpr,   # the gradient walk's loads ("evict_first": the row's last use)
    STORE_EVICT: tl.constexpr,  # the gradient's stores
    VEC: tl.constexpr,          # elements per 16-byte load (a thread's slice of the stats walk's tile)
    PREFETCH: tl.constexpr,     # _row_stats_looped loads the next tile before the current one's math
    GRAD_PREFETCH: tl.constexpr,  # ... and so does the gradient walk
):
    # one row per program by default; with fewer programs than rows (config programs_per_sm) the
    # grid is persistent and bounds the rows in flight, for the looped rows' second read from L2
    rows_to_do = n_rows
    if HAS_SKIP:
        rows_to_do = tl.where(tl.load(skip_ptr) != 0, 0, n_rows)
    for row in range(tl.program_id(0).to(tl.int64), rows_to_do, tl.num_programs(0)):   # int64 offsets
        target = tl.load(target_ptr + row).to(tl.int64)
        scale = 0.0
        if WRITE_GRAD:
            scale = tl.load(scale_ptr + row * scale_stride)
        _cross_entropy_row(logits_ptr + row * logits_row_stride, grad_ptr + row * grad_row_stride, target,
                           loss_ptr + row, stats_ptr + row, n_rows, scale, n_cols, ignore_index,
                           label_smoothing, z_loss, softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS,
                           WRITE_GRAD, SAVE_STATS, SINGLE_TILE, BLOCK_V, STATS_EVICT, GRAD_EVICT, STORE_EVICT,
                           VEC, PREFETCH, GRAD_PREFETCH)


@fast_launch
@triton.jit
def cross_entropy_bwd_kernel(
    logits_ptr,         # *[n_rows, n_cols] logits, unit column stride
    grad_ptr,           # *[n_rows, n_cols] dloss/dlogits out (may be logits_ptr: in-place mode)
    target_ptr,         # *[n_rows] int32/int64 class ids
    stats_ptr,          # *fp32 [3, n_rows] (m, log2 s, q) from the forward
    scale_ptr,          # *fp32 grad_output (times 1/n_valid for mean), shared or per row
    logits_row_stride,  # elements between rows of logits
    grad_row_stride,    # elements between rows of grad
    scale_stride,       # 0: one scale shared by every row, 1: one per row
    n_rows,             # rows (tokens)
    n_cols,             # vocabulary size V
    ignore_index,       # target value of rows that contribute nothing
    label_smoothing,    # eps
    z_loss,             # z
    softcap,            # c (unused without HAS_SOFTCAP)
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    BLOCK_V: tl.constexpr,      # tile of the row
):
    """The deferred gradient: one read of the logits and one write, grad_output applied in it."""
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        target = tl.load(target_ptr + row).to(tl.int64)
        x_row = logits_ptr + row * logits_row_stride
        g_row = grad_ptr + row * grad_row_stride
        if target == ignore_index:
            _zero_row(g_row, n_cols, BLOCK_V)
        else:
            scale = tl.load(scale_ptr + row * scale_stride)
            m = tl.load(stats_ptr + row)
            log2_s = tl.load(stats_ptr + n_rows + row)
            q = tl.load(stats_ptr + 2 * n_rows + row)
            in_range = (target >= 0) & (target < n_cols)
            slope_t = 1.0
            if HAS_SOFTCAP:   # the target's slope, read before an in-place walk overwrites it
                x_t = tl.load(x_row + target, mask=in_range, other=0.0).to(tl.float32)
                _, slope_t = _softcap(x_t, softcap)
            lse = m + log2_s * LN2
            z_coef = scale * (2.0 * z_loss) * lse
            uniform = scale * (label_smoothing / n_cols)
            _grad_walk(x_row, g_row, n_cols, m, log2_s, scale, z_coef, uniform, softcap,
                       HAS_SOFTCAP, HAS_Z_LOSS, False, BLOCK_V, "", "", False)
            _store_target_grad(g_row, target, in_range, q, 1.0 - q, slope_t, scale, z_coef, uniform,
                               label_smoothing, HAS_SOFTCAP, HAS_Z_LOSS)


@fast_launch
@triton.jit
def scale_rows_kernel(
    x_ptr,              # *[n_rows, n_cols] stored gradient, scaled in place
    applied_ptr,        # *fp32 scale already applied to each row (1 after the forward)
    grad_ptr,           # *fp32 grad_output: the scale each row must carry
    x_row_stride,       # elements between rows of x
    scale_stride,       # stride of applied and grad_output (unused with SHARED_SCALE)
    n_rows,             # rows
    n_cols,             # row length
    SHARED_SCALE: tl.constexpr,  # one scalar grad_output for every row (mean/sum)
    BLOCK: tl.constexpr,         # tile of a row
):
    # rows times grad_output / applied, skipped where both are 1: loss.backward() on a fresh
    # forward moves no bytes (a repeated backward with grad_output 1 still rescales, by 1)
    if SHARED_SCALE:
        g = tl.load(grad_ptr)
        a = tl.load(applied_ptr)
        if (g != 1.0) | (a != 1.0):
            for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
                _scale_row(x_ptr + row * x_row_stride, g / a, n_cols, BLOCK)
    else:
        for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
            g = tl.load(grad_ptr + row * scale_stride)
            a = tl.load(applied_ptr + row * scale_stride)
            if (g != 1.0) | (a != 1.0):
                _scale_row(x_ptr + row * x_row_stride, g / a, n_cols, BLOCK)


@triton.jit
def _scale_row(row_ptr, factor, n_cols, BLOCK: tl.constexpr):
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(row_ptr + cols, (x * factor).to(row_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def target_scan_kernel(
    target_ptr,         # *[n] int32/int64 class ids
    bad_ptr,            # *bool out: some target is neither ignore_index nor in [0, n_classes)
    scale_ptr,          # *fp32 out: 1 / max(valid targets, 1) with MEAN, else 1
    n,                  # targets
    n_classes,          # V
    ignore_index,       # target value of rows that contribute nothing
    MEAN: tl.constexpr,         # reduction="mean": the gradient scale counts the valid rows
    BLOCK: tl.constexpr,        # targets per step of the one program
):
    """One program over every target: the range test's flag and the mean's 1 / n_valid, in one
    launch instead of a dozen small torch ones (its effect on a step was not timed apart from
    session 32's kernel changes)."""
    n_valid = tl.zeros([BLOCK], dtype=tl.int32)
    n_bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        # not other=ignore_index: the fill takes the targets' dtype, and an int32 target tensor
        # truncates an ignore_index past int32 (2**32 became 0: the block's padding counted valid)
        t = tl.load(target_ptr + offs, mask=inside, other=0).to(tl.int64)
        valid = inside & (t != ignore_index)
        n_valid += valid.to(tl.int32)
        n_bad += (valid & ((t < 0) | (t >= n_classes))).to(tl.int32)
    tl.store(bad_ptr, tl.sum(n_bad, axis=0) > 0)
    scale = 1.0
    if MEAN:
        scale = 1.0 / tl.maximum(tl.sum(n_valid, axis=0), 1).to(tl.float32)
    tl.store(scale_ptr, scale)


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


def _single_tile_config(n_cols: int) -> dict:
    """Rows up to MAX_SINGLE_TILE sit in registers (one read) at ~16 values per thread; one
    program per row, as many resident as fit."""
    tile = next_power_of_2(max(n_cols, 1))
    return {"single_tile": True, "BLOCK_V": tile, "num_warps": max(1, min(16, tile // 512)),
            "maxnreg": None, "programs_per_sm": None}


def _looped_grad_tile(n_cols: int, elem_bytes: int = 2) -> tuple:
    """(BLOCK_V, num_warps) of the gradient-writing looped kernel, tiles sized in bytes (fp32
    logits take half the columns: a bf16-sized tile of fp32 spills). Rows of 64K+ classes: 64 KB
    tiles (32K bf16) at 32 warps, 60 registers, so one program (one row in flight) per SM with
    64 KB of loads per walk step: H200 session 32, 1,097 us = 90 % of copy at V = 128256 and 83 %
    at 256000, against 84 / 77 % at 16K tiles. Shorter rows: 16 KB (8K bf16) at 16 warps (59
    registers, two rows per SM): 83 % at V = 32000, where a 32K tile is the whole row and one
    row per SM reached 63 %."""
    if n_cols >= 65536:
        return 65536 // elem_bytes, 32
    return 16384 // elem_bytes, 16


def _looped_config(write_grad: bool, n_cols: int, elem_bytes: int = 2) -> dict:
    """Long rows, one program per row; the stats walk keeps a running max per thread (no
    cross-warp step per tile, _row_stats_looped) and loads the next tile before the current one's
    math (PREFETCH). Loss and statistics only (the deferred mode): 4K tiles at 8 warps, no
    prefetch (H200 sweep, 8192 x 128256, session 32: 448-470 us = 105-110 % of copy, a
    read-only pass, against 544 us with the per-tile max). With the gradient written in the same
    kernel: _looped_grad_tile; the stats walk's loads evict_last (the row stays in L2 for the
    gradient walk), the gradient walk's loads and stores evict_first (their last use: they must
    not push rows still to be re-read out of L2); s31's per-tile max with the same hints: 69 %
    of copy (1,426 us), 64 % without them. Prefetching in the gradient walk too (GRAD_PREFETCH)
    lost at 32K tiles (1,206 us) and was within 2 % at the others. Persistent grids of 1-4
    programs per SM were slower in both modes."""
    if write_grad:
        block, warps = _looped_grad_tile(n_cols, elem_bytes)
        return {"single_tile": False, "BLOCK_V": block, "num_warps": warps, "maxnreg": None,
                "programs_per_sm": None, "PREFETCH": True, "GRAD_PREFETCH": False,
                **LOOPED_GRAD_EVICT}
    return {"single_tile": False, "BLOCK_V": LOOPED_STATS_BLOCK_V, "num_warps": 8, "maxnreg": None,
            "programs_per_sm": None, "PREFETCH": False}


def default_config(n_cols: int, write_grad: bool = True, elem_bytes: int = 2) -> dict:
    """Launch config for rows of ``n_cols`` logits of ``elem_bytes`` each; ``programs_per_sm``
    (None: one program per row) makes the grid persistent, for sweeps that bound the rows in
    flight further."""
    if next_power_of_2(max(n_cols, 1)) <= MAX_SINGLE_TILE:
        return _single_tile_config(n_cols)
    return _looped_config(write_grad, n_cols, elem_bytes)


def launch_cross_entropy_rows(logits, target, row_scale, loss_rows, grad, opts: CEOptions, config=None,
                              stats=None, skip_if=None):
    """Per-row loss into ``loss_rows`` (fp32 [n]) and, unless ``grad`` is None, the gradient
    times ``row_scale`` ([1] shared or [n]) into ``grad`` ([n, V], may be ``logits`` itself);
    ``stats`` (fp32 [3, n]) receives the deferred backward's row statistics. ``skip_if`` (a 0-d
    bool device tensor): when it holds True the kernel writes nothing."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    cfg = {**default_config(n_cols, grad is not None, logits.element_size()), **(config or {})}
    if cfg["single_tile"] and cfg["BLOCK_V"] < n_cols:
        raise ValueError(f"config: a single tile of {cfg['BLOCK_V']} cannot hold rows of {n_cols}")
    programs = n_rows if not cfg["programs_per_sm"] else min(n_rows, num_sms(logits) * cfg["programs_per_sm"])
    extra = {"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}
    cross_entropy_fwd_kernel[(programs,)](
        logits, logits if grad is None else grad, target, loss_rows, row_scale,
        loss_rows if stats is None else stats, loss_rows if skip_if is None else skip_if,
        logits.stride(0), logits.stride(0) if grad is None else grad.stride(0),
        0 if row_scale.numel() == 1 else row_scale.stride(0),
        n_rows, n_cols, opts.ignore_index,
        float(opts.label_smoothing), float(opts.z_loss), float(opts.softcap or 1.0),
        HAS_SOFTCAP=opts.softcap is not None, HAS_SMOOTHING=opts.label_smoothing > 0,
        HAS_Z_LOSS=opts.z_loss > 0, HAS_SKIP=skip_if is not None, WRITE_GRAD=grad is not None,
        SAVE_STATS=stats is not None,
        SINGLE_TILE=cfg["single_tile"], BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"],
        STATS_EVICT=cfg.get("STATS_EVICT", ""), GRAD_EVICT=cfg.get("GRAD_EVICT", ""),
        STORE_EVICT=cfg.get("STORE_EVICT", ""),
        VEC=max(1, 16 // logits.element_size()), PREFETCH=cfg.get("PREFETCH", False),
        GRAD_PREFETCH=cfg.get("GRAD_PREFETCH", False), **extra,
    )


def _bwd_config(n_cols: int) -> dict:
    """The deferred backward streams each row once (read logits, write grad): a short row's
    single tile, else 8K tiles at 16 warps, no register cap (nothing is kept across tiles but
    four scalars; H200: 97-98 % of copy at 8192 x 128256, 95 % at 8 warps)."""
    if next_power_of_2(max(n_cols, 1)) <= MAX_SINGLE_TILE:
        cfg = _single_tile_config(n_cols)
        return {"BLOCK_V": cfg["BLOCK_V"], "num_warps": cfg["num_warps"]}
    return {"BLOCK_V": BWD_BLOCK_V, "num_warps": 16}


def launch_cross_entropy_bwd(logits, target, stats, row_scale, grad, opts: CEOptions, config=None):
    """grad [n, V] (may be ``logits``) = row_scale · dloss/dlogits from the forward's ``stats``."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    cfg = {**_bwd_config(n_cols), **(config or {})}
    cross_entropy_bwd_kernel[(n_rows,)](
        logits, grad, target, stats, row_scale, logits.stride(0), grad.stride(0),
        0 if row_scale.numel() == 1 else row_scale.stride(0), n_rows, n_cols, opts.ignore_index,
        float(opts.label_smoothing), float(opts.z_loss), float(opts.softcap or 1.0),
        HAS_SOFTCAP=opts.softcap is not None, HAS_Z_LOSS=opts.z_loss > 0,
        BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"],
    )


def launch_scale_rows(x2, applied, grad_output):
    """x2 [n, C] *= grad_output / applied, per row ([n] each) or shared ([1] each)."""
    n_rows, n_cols = x2.shape
    if x2.numel() == 0:
        return
    shared = grad_output.numel() == 1
    block = min(SCALE_BLOCK, next_power_of_2(n_cols))
    programs = max(1, min(n_rows, num_sms(x2) * SCALE_PROGRAMS_PER_SM))
    scale_rows_kernel[(programs,)](
        x2, applied, grad_output, x2.stride(0), 0 if shared else grad_output.stride(0), n_rows, n_cols,
        SHARED_SCALE=shared, BLOCK=block, num_warps=max(1, min(8, block // 512)),
    )


def launch_target_scan(target, n_classes: int, ignore_index: int, mean: bool):
    """(bad, scale): a 0-d bool (some target out of range and not ignore_index) and a [1] fp32
    gradient scale (1 / max(n_valid, 1) when ``mean``, else 1), both on target's device, in one
    launch; ``target`` is 1-D with 1 <= numel <= TARGET_SCAN_MAX."""
    bad = torch.empty((), dtype=torch.bool, device=target.device)
    scale = empty(1, torch.float32, target.device)
    target_scan_kernel[(1,)](
        target, bad, scale, target.numel(), n_classes, ignore_index,
        MEAN=mean, BLOCK=TARGET_SCAN_BLOCK, num_warps=4,
    )
    return bad, scale
