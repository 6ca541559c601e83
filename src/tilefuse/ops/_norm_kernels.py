"""Triton kernels shared by layer_norm and rms_norm (see tilefuse.ops.norms for the math).

Four kernels serve both norms, with and without the fused residual add:

* ``norm_fwd_kernel``: normalizes a [BLOCK_M, BLOCK_N] tile. With the whole row in the tile it
  computes the row statistics itself (the fused tier); with ``STATS_IN`` it reads mean/rstd
  written by ``norm_fwd_stats_kernel`` and normalizes one column tile of a long row. (A
  persistent grid with Triton's pipeliner on a row loop was measured and lost: NOTES, session 9.)
* ``norm_fwd_stats_kernel``: long rows only; walks a row in tiles for mean/rstd (and writes
  ``h = x + residual``).
* ``norm_bwd_kernel``: a persistent grid ``(row programs, column tiles)``; each program walks its
  share of the rows for one column tile, writes dx, and accumulates dw/db in fp32 registers into
  one row of a ``[row programs, n_cols]`` partial buffer (summed afterwards: no atomics).
  With the whole row in the tile it computes the row dot products itself; with ``STATS_IN`` it
  reads them from ``norm_bwd_stats_kernel``.
  With ``FINAL_SUM`` (one column tile, a cooperative launch: every program resident) the
  programs meet at a grid barrier and sum those partials themselves, in column slices: one
  launch, not two (a launch is ~25-30 µs of host time on the H200 host).
* ``sum_partials_kernel``: the one final reduction of those dw/db partials, cast to the weight's
  and bias's dtypes in the same pass (one launch for both, instead of a sum and a cast each);
  ``launch_sum_partials`` also serves bias_act's db partials.
* ``norm_bwd_stats_kernel``: long rows only; walks a row for mean(wdy·x̂) and mean(wdy).

``IS_RMS`` drops the mean (μ = 0, and the mean(wdy) term of dx). All math is fp32.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .._dispatch import cdiv, next_power_of_2
from .._launch import PreparedArgs, fast_launch
from ._common import row_tile_mask_offsets


@triton.jit
def _xhat(x, mean, rstd, mask, IS_RMS: tl.constexpr):
    """x̂ = (x - μ)·rstd for a [BLOCK_M, BLOCK_N] tile (μ = 0 for RMS); 0 where masked."""
    if IS_RMS:
        return x * rstd[:, None]          # masked x loads as 0, so x̂ is 0 there already
    else:
        return tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)


@triton.jit
def _scale(w_ptr, cols, n_cols, offset, HAS_W: tl.constexpr):
    """(offset + w) over the column tile, fp32; 1 without a weight (offset is then 0)."""
    if HAS_W:
        return tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
    else:
        return tl.full(cols.shape, 1.0, tl.float32)


@fast_launch
@triton.jit
def norm_fwd_kernel(
    x_ptr,              # *input [n_rows, n_cols], unit column stride (h when STATS_IN)
    res_ptr,            # *residual [n_rows, n_cols], x's dtype (read when HAS_RES)
    w_ptr,              # *weight [n_cols], any float dtype (read when HAS_W)
    b_ptr,              # *bias [n_cols], any float dtype (read when HAS_B)
    y_ptr,              # *output [n_rows, n_cols], contiguous, x's dtype
    h_ptr,              # *x + residual [n_rows, n_cols], contiguous, x's dtype (written when HAS_RES)
    mean_ptr,           # *fp32 [n_rows]: written, or read with STATS_IN (LayerNorm only)
    rstd_ptr,           # *fp32 [n_rows]: written, or read with STATS_IN
    x_row_stride,       # elements between rows of x
    res_row_stride,     # elements between rows of residual
    y_row_stride,       # elements between rows of y
    h_row_stride,       # elements between rows of h
    n_rows,             # rows (all leading dims flattened)
    n_cols,             # row length N
    eps,                # added to the variance
    offset,             # y = x̂·(offset + w) + b
    IS_RMS: tl.constexpr,    # RMSNorm (μ = 0) instead of LayerNorm
    HAS_RES: tl.constexpr,   # normalize h = x + residual and write h
    HAS_W: tl.constexpr,     # scale by (offset + w)
    HAS_B: tl.constexpr,     # add b
    STATS_IN: tl.constexpr,  # mean/rstd come from norm_fwd_stats_kernel (long rows, column tiles)
    BLOCK_M: tl.constexpr,   # rows per program
    BLOCK_N: tl.constexpr,   # columns per program: >= n_cols unless STATS_IN
    X_EVICT: tl.constexpr,   # L2 eviction policy of the x load ("" default; norms._fwd_x_evict)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask, x_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, x_row_stride)
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0, eviction_policy=X_EVICT).to(tl.float32)
    if HAS_RES:
        _, r_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, res_row_stride)
        _, h_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, h_row_stride)
        h = (x + tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + h_offs, h, mask=mask)
        x = h.to(tl.float32)            # normalize the stored (rounded) h: the backward reads it back
    if STATS_IN:
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        mean = rstd                     # unused for RMS
        if not IS_RMS:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        xc = x                          # masked x loads as 0
        if not IS_RMS:
            mean = tl.sum(x, axis=1) * (1.0 / n_cols)
            tl.store(mean_ptr + rows, mean, mask=row_mask)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) * (1.0 / n_cols) + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = _xhat(x, mean, rstd, mask, IS_RMS)
    if HAS_W:
        y = y * _scale(w_ptr, cols, n_cols, offset, HAS_W)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    _, y_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, y_row_stride)
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def norm_fwd_stats_kernel(
    x_ptr,              # *input [n_rows, n_cols], unit column stride
    res_ptr,            # *residual [n_rows, n_cols] (read when HAS_RES)
    h_ptr,              # *x + residual [n_rows, n_cols], contiguous (written when HAS_RES)
    mean_ptr,           # *fp32 [n_rows], written (LayerNorm only)
    rstd_ptr,           # *fp32 [n_rows], written
    x_row_stride,       # elements between rows of x
    res_row_stride,     # elements between rows of residual
    h_row_stride,       # elements between rows of h
    n_cols,             # row length (long: more than one tile)
    eps,                # added to the variance
    IS_RMS: tl.constexpr,   # RMSNorm: only the mean square
    HAS_RES: tl.constexpr,  # statistics of h = x + residual, and write h
    BLOCK_N: tl.constexpr,  # tile walked per step
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    n = 0.0         # elements merged so far
    mean = 0.0      # their mean (LayerNorm)
    m2 = 0.0        # their sum of squared deviations from `mean` (sum of squares for RMS)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * h_row_stride + cols, h, mask=mask)
            x = h.to(tl.float32)
        if IS_RMS:
            m2 += tl.sum(x * x, axis=0)
        else:
            # exact per-tile mean and M2, merged by Chan's parallel update: no E[x²]-E[x]² cancellation
            cnt = tl.minimum(n_cols - start, BLOCK_N).to(tl.float32)
            t_mean = tl.sum(x, axis=0) / cnt
            d = tl.where(mask, x - t_mean, 0.0)
            delta = t_mean - mean
            n_new = n + cnt
            mean += delta * (cnt / n_new)
            m2 += tl.sum(d * d, axis=0) + delta * delta * (n * cnt / n_new)
            n = n_new
    if not IS_RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, tl.rsqrt(m2 / n_cols + eps))


@triton.jit
def _bwd_block_loads(x_ptr, dy_ptr, mean_ptr, rstd_ptr, blk, cols, n_rows, n_cols, x_row_stride, dy_row_stride,
                     IS_RMS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Raw x and dy tiles (storage dtype) and the row stats of row block ``blk``; all masked off
    past the last row, so the prefetch after the last block touches no memory."""
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask, x_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, x_row_stride)
    _, dy_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dy_row_stride)
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    mean = rstd                         # unused for RMS
    if not IS_RMS:
        mean = tl.load(mean_ptr + rows, mask=rows < n_rows, other=0.0)
    return x, dy, mean, rstd


@triton.jit
def _add_pair(a1, b1, a2, b2):
    """Combine of a two-sum ``tl.reduce``: (Σa, Σb) in one reduction."""
    return a1 + a2, b1 + b2


@fast_launch
@triton.jit
def norm_bwd_kernel(
    x_ptr,              # *normalized input [n_rows, n_cols] (h for the residual-fused op)
    w_ptr,              # *weight [n_cols] (read when HAS_W)
    dy_ptr,             # *grad of y [n_rows, n_cols]
    dres_ptr,           # *grad of h [n_rows, n_cols], added to dx (read when HAS_DRES)
    mean_ptr,           # *fp32 [n_rows] (LayerNorm)
    rstd_ptr,           # *fp32 [n_rows]
    dot_ptr,            # *fp32 [2, n_rows]: mean(wdy·x̂), mean(wdy) per row (read when STATS_IN)
    dx_ptr,             # *grad of x [n_rows, n_cols], contiguous, x's dtype
    dw_ptr,             # *fp32 [row programs, n_cols]: this program's dw partial (when DW)
    db_ptr,             # *fp32 [row programs, n_cols]: db partial (when DB)
    dw_out_ptr,         # *dw [n_cols], the weight's dtype (written with FINAL_SUM)
    db_out_ptr,         # *db [n_cols], the bias's dtype (written with FINAL_SUM)
    sync_ptr,           # *int32 [2], zero: arrival and departure counters (FINAL_SUM; left zero)
    x_row_stride,       # elements between rows of x
    dy_row_stride,      # elements between rows of dy
    dres_row_stride,    # elements between rows of dres
    dx_row_stride,      # elements between rows of dx
    n_rows,             # rows
    n_cols,             # row length N
    offset,             # the scale is (offset + w)
    IS_RMS: tl.constexpr,    # RMSNorm: μ = 0, no mean(wdy) term
    HAS_W: tl.constexpr,     # y was scaled by (offset + w)
    HAS_DRES: tl.constexpr,  # add the gradient flowing into h
    DW: tl.constexpr,        # accumulate dw = Σ dy·x̂
    DB: tl.constexpr,        # accumulate db = Σ dy
    STATS_IN: tl.constexpr,  # row dot products come from norm_bwd_stats_kernel (column tiles)
    BLOCK_M: tl.constexpr,   # rows per step
    BLOCK_N: tl.constexpr,   # columns per program: >= n_cols unless STATS_IN
    PREFETCH: tl.constexpr,  # load the next row block's tiles before reducing this one (registers)
    STAGES: tl.constexpr,    # row blocks in flight through shared memory (Triton's pipeliner; > 1 without PREFETCH)
    FINAL_SUM: tl.constexpr,  # one column tile, all programs resident (cooperative launch): sum the partials here
    SUM_P: tl.constexpr,     # FINAL_SUM: partial rows per load
    SUM_N: tl.constexpr,     # FINAL_SUM: columns per slice
):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = _scale(w_ptr, cols, n_cols, offset, HAS_W)      # loaded once per program
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    step = tl.num_programs(0)
    if PREFETCH:
        x_nxt, dy_nxt, mean_nxt, rstd_nxt = _bwd_block_loads(
            x_ptr, dy_ptr, mean_ptr, rstd_ptr, pid_m, cols, n_rows, n_cols, x_row_stride, dy_row_stride,
            IS_RMS, BLOCK_M)
    for blk in tl.range(pid_m, tl.cdiv(n_rows, BLOCK_M), step, num_stages=STAGES):
        if PREFETCH:
            # software pipelining by hand: the next block's loads are issued before this block's
            # row reductions, so their latency hides behind the math
            x, dy, mean, rstd = x_nxt, dy_nxt, mean_nxt, rstd_nxt
            x_nxt, dy_nxt, mean_nxt, rstd_nxt = _bwd_block_loads(
                x_ptr, dy_ptr, mean_ptr, rstd_ptr, blk + step, cols, n_rows, n_cols, x_row_stride, dy_row_stride,
                IS_RMS, BLOCK_M)
        else:
            x, dy, mean, rstd = _bwd_block_loads(
                x_ptr, dy_ptr, mean_ptr, rstd_ptr, blk, cols, n_rows, n_cols, x_row_stride, dy_row_stride,
                IS_RMS, BLOCK_M)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        if HAS_DRES:
            _, dr_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dres_row_stride)
            dres = tl.load(dres_ptr + dr_offs, mask=mask, other=0.0).to(tl.float32)
        xhat = _xhat(x, mean, rstd, mask, IS_RMS)
        wdy = dy * scale[None, :]
        if STATS_IN:
            c1 = tl.load(dot_ptr + rows, mask=row_mask, other=0.0)
            c2 = tl.load(dot_ptr + n_rows + rows, mask=row_mask, other=0.0)
        elif IS_RMS:
            c1 = tl.sum(xhat * wdy, axis=1) * (1.0 / n_cols)
            c2 = c1                     # unused
        else:
            # both row sums in one reduction: one exchange through shared memory, not two
            c1, c2 = tl.reduce((xhat * wdy, wdy), 1, _add_pair)
            c1 *= 1.0 / n_cols
            c2 *= 1.0 / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += dres
        _, dx_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dx_row_stride)
        tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if DW:
            dw_acc += dy * xhat
        if DB:
            db_acc += dy
    part = pid_m.to(tl.int64) * n_cols + cols
    if DW:
        tl.store(dw_ptr + part, tl.sum(dw_acc, axis=0), mask=cols < n_cols)
    if DB:
        tl.store(db_ptr + part, tl.sum(db_acc, axis=0), mask=cols < n_cols)
    if FINAL_SUM:
        _grid_barrier(sync_ptr, step)
        _sum_partials_slices(dw_ptr, db_ptr, dw_out_ptr, db_out_ptr, step, n_cols, pid_m, step, DW, DB, SUM_P, SUM_N)
        _grid_barrier_leave(sync_ptr, step)


@triton.jit
def _grid_barrier(sync_ptr, n_programs):
    """Wait until all ``n_programs`` programs have arrived (they are all resident: a cooperative
    launch). Each program's stores before the call are visible to every program after it."""
    tl.debug_barrier()                  # this program's threads have stored
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < n_programs:
        arrived = tl.atomic_add(sync_ptr, 0, sem="acq_rel", scope="gpu")


@triton.jit
def _grid_barrier_leave(sync_ptr, n_programs):
    """Count this program out of :func:`_grid_barrier`; the last one out zeroes both counters for
    the next launch (every program has left the wait by then: each counts out after it)."""
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") + 1
    if left == n_programs:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_partials_slices(dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, n_parts, n_cols, first, n_programs,
                         DW: tl.constexpr, DB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[j] = Σ_p dw_part[p, j] (and db likewise), fp32 sums, one cast at the store. The columns
    go in BLOCK_N-wide slices to the programs: this one sums slices first, first + n_programs, ...
    Loads go through L2 (``.cg``): inside one launch the partials are other programs' stores."""
    for c0 in range(first * BLOCK_N, n_cols, n_programs * BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        acc_w = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for p0 in range(0, n_parts, BLOCK_P):
            mask, offs = row_tile_mask_offsets(p0 + tl.arange(0, BLOCK_P), cols, n_parts, n_cols, n_cols)
            if DW:
                acc_w += tl.load(dw_part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if DB:
                acc_b += tl.load(db_part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if DW:
            tl.store(dw_ptr + cols, tl.sum(acc_w, 0).to(dw_ptr.dtype.element_ty), mask=cols < n_cols)
        if DB:
            tl.store(db_ptr + cols, tl.sum(acc_b, 0).to(db_ptr.dtype.element_ty), mask=cols < n_cols)


@fast_launch
@triton.jit
def norm_bwd_stats_kernel(
    x_ptr,              # *normalized input [n_rows, n_cols]
    w_ptr,              # *weight [n_cols] (read when HAS_W)
    dy_ptr,             # *grad of y [n_rows, n_cols]
    mean_ptr,           # *fp32 [n_rows] (LayerNorm)
    rstd_ptr,           # *fp32 [n_rows]
    dot_ptr,            # *fp32 [2, n_rows], written: mean(wdy·x̂), mean(wdy)
    x_row_stride,       # elements between rows of x
    dy_row_stride,      # elements between rows of dy
    n_rows,             # rows
    n_cols,             # row length (long: more than one tile)
    offset,             # the scale is (offset + w)
    IS_RMS: tl.constexpr,   # μ = 0 (mean(wdy) is still written, unused)
    HAS_W: tl.constexpr,    # y was scaled by (offset + w)
    BLOCK_N: tl.constexpr,  # tile walked per step
):
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)                # a [1]-row "tile", to share _xhat
    rstd = tl.load(rstd_ptr + rows)
    mean = rstd
    if not IS_RMS:
        mean = tl.load(mean_ptr + rows)
    acc_xw = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc_w = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask, x_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, x_row_stride)
        _, dy_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dy_row_stride)
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
        wdy = dy * _scale(w_ptr, cols, n_cols, offset, HAS_W)[None, :]
        acc_xw += _xhat(x, mean, rstd, mask, IS_RMS) * wdy
        acc_w += wdy
    tl.store(dot_ptr + rows, tl.sum(acc_xw, axis=1) * (1.0 / n_cols))
    tl.store(dot_ptr + n_rows + rows, tl.sum(acc_w, axis=1) * (1.0 / n_cols))


@fast_launch
@triton.jit
def sum_partials_kernel(
    dw_part_ptr,        # *fp32 [n_parts, n_cols] dw partial sums (one row per backward program)
    db_part_ptr,        # *fp32 [n_parts, n_cols] db partial sums (read only with DB)
    dw_ptr,             # *dw [n_cols], the weight's dtype
    db_ptr,             # *db [n_cols], the bias's dtype
    n_parts,            # rows of the partial buffers
    n_cols,             # N
    DW: tl.constexpr,       # reduce dw
    DB: tl.constexpr,       # reduce db
    BLOCK_P: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    """dw[j] = Σ_p dw_part[p, j] (and db likewise): one BLOCK_N-column slice per program."""
    _sum_partials_slices(dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, n_parts, n_cols, tl.program_id(0),
                         tl.num_programs(0), DW, DB, BLOCK_P, BLOCK_N)


def _sum_partials_tile() -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of the dw/db reduction: 64 columns per program gives N/64 programs
    (64 at N = 4096) each summing ~130-260 partial rows of fp32, a few µs."""
    return 32, 64


def final_sum_tile(n_prog: int, n_cols: int, num_warps: int) -> tuple[int, int]:
    """(SUM_P, SUM_N) of an in-kernel final sum (:func:`_sum_partials_slices` after a grid
    barrier): slices of ~N / programs columns (16-128), so every program sums one or two; at most
    16 partial values per thread per load (8K at 16 warps), so the sum's registers stay under the
    row loop's."""
    sum_n = max(16, min(128, next_power_of_2(cdiv(n_cols, n_prog))))
    return min(next_power_of_2(n_prog), max(1, 16 * 32 * num_warps // sum_n)), sum_n


@functools.lru_cache(maxsize=256)
def sum_partials_plan(n_parts: int, n_cols: int, dw: bool, db: bool) -> tuple[tuple, PreparedArgs]:
    """(grid, prepared arguments) of one reduction shape: keyed once, not per call (host time of
    every backward; scripts/autograd_floor.py)."""
    block_p, block_n = _sum_partials_tile()
    return (cdiv(n_cols, block_n),), sum_partials_kernel.prepare(
        (n_parts, n_cols), dict(DW=dw, DB=db, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4))


def launch_sum_partials(dw_part, db_part, dw, db) -> None:
    """dw = Σ_rows dw_part and db = Σ_rows db_part (fp32 [parts, N] -> [N] in dw's / db's dtype)
    in one launch; either pair may be None."""
    part = dw_part if dw_part is not None else db_part
    grid, prepared = sum_partials_plan(*part.shape, dw is not None, db is not None)
    sum_partials_kernel.launch_prepared(
        grid, (part if dw_part is None else dw_part, part if db_part is None else db_part,
               dw if dw is not None else db, db if db is not None else dw), prepared)
