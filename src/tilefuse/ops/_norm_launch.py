"""Launch heuristics and launchers of layer_norm / rms_norm (see ``norms.py`` for the math, the
bytes counted and the tiers; kernels in ``_norm_kernels``). Inputs arrive validated by the public
functions; x's last dim is the normalized one. Every heuristic can be overridden through the
launchers' ``config`` dict."""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from .. import _dispatch
from .._dispatch import (
    COOPERATIVE_REFUSED, cdiv, collectives_may_overlap, cooperative_launch, empty, empty_like, next_power_of_2,
    num_sms, rows_view, workspace,
)
from .._launch import BoundLaunch, PreparedArgs, config_key, hooks_active
from ._norm_kernels import (
    final_sum_tile, norm_bwd_kernel, norm_bwd_stats_kernel, norm_fwd_kernel, norm_fwd_stats_kernel,
    sum_partials_kernel, sum_partials_plan,
)

MAX_FUSED_N_FWD = 16384   # padded row length kept in registers by the forward (x, w, b live)
MAX_FUSED_N_BWD = 8192    # backward keeps x, dy, x̂, wdy and two accumulators live: a smaller tile
LOOPED_BLOCK_N = 4096     # column tile of the looped tier


# ----------------------------------------------------------------------------------------------
# launch heuristics (every one can be overridden through the launchers' ``config`` dict)
# ----------------------------------------------------------------------------------------------


def _rows_per_program(block_n: int, n_rows: int, target: int) -> int:
    """Short rows share a program so each moves ~``target`` elements per step."""
    return max(1, min(target // block_n, next_power_of_2(max(n_rows, 1))))


def _fwd_rows_per_program(block_n: int, n_rows: int) -> int:
    """~2K elements per forward program: many small programs beat few big ones (H200 sweep,
    16384x4096 bf16: 1 row x 4 warps 3.7 TB/s, 2 rows x 16 warps 2.2-2.5)."""
    return _rows_per_program(block_n, n_rows, 2048)


def _bwd_rows_per_step(block_n: int, n_rows: int) -> int:
    """~8K elements per backward step (16 warps at 16 values per thread), x, dy, x̂, wdy and the
    dw/db accumulators in registers (H200 sweep, 16384 rows bf16, session 9: 2x4096 and 1x8192
    best for both norms)."""
    return _rows_per_program(block_n, n_rows, 8192)


def _fwd_num_warps(tile_elems: int) -> int:
    """LayerNorm forward: ~32 values per thread, at most 16 warps (H200: 4 warps best at N=4096, 8 at
    N=8192; 16 warps with the evict_last x load cost 16384x8192 9 %, session 9)."""
    return _num_warps(tile_elems, per_thread=32, max_warps=16)


def _rms_fwd_num_warps(tile_elems: int) -> int:
    """RMSNorm forward (x loaded evict_last): ~16 values per thread, at most 16 warps (H200 session
    9, 16384 rows replayed: 8 warps 65.3 vs 4 warps 65.8 µs at N = 4096, 16 warps 127.4 vs 8 warps
    127.9 at 8192; without the hint 4 and 8 warps had been best)."""
    return _num_warps(tile_elems, per_thread=16, max_warps=16)


def _fwd_x_evict() -> str:
    """L2 policy of the forward's x load: evict_last for both norms. RMSNorm (H200 session 9,
    `-s9-rms-fwd-evict.log`, replayed): 16384x8192 127.4 vs 129.9 µs, 16384x4096 65.3 vs 65.7.
    LayerNorm (H200 session 24, `-s24-sweep-layer-norm.log`, do_bench after an L2 flush, interleaved
    medians): 16384x4096 69.6 vs 70.7 µs at its 4 warps, 16384x8192 134.4 vs 135.9 at 8 warps
    (session 9's loss with the hint was at 16 warps). What in L2 it protects is not known."""
    return "evict_last"


def _num_warps(tile_elems: int, per_thread: int = 16, max_warps: int = 32) -> int:
    """~``per_thread`` fp32 values of a tile per thread: wide loads, no spills."""
    return max(4, min(max_warps, tile_elems // (32 * per_thread)))


def _bwd_num_warps(tile_elems: int) -> int:
    """Backward: 16 values per thread per tile (H200 sweep, 16384 rows bf16: 8 warps at N=4096 and
    16 at N=8192 with prefetch were best or within 3 % of best for both norms)."""
    return _num_warps(tile_elems, per_thread=16, max_warps=32)


def _bwd_programs_per_sm(num_warps: int) -> int:
    """Persistent grid: every program must be resident at once (a second wave would idle most
    SMs); at ~100 registers per thread an SM holds ~16 warps of this kernel."""
    return max(1, 16 // num_warps)


ROW_STAGE_SMEM = 192 * 1024   # shared memory for the backward's pipelined row blocks, per SM (227 KB)


def _bwd_stages(tile_elems: int, elem_bytes: int, n_inputs: int, programs_per_sm: int) -> int:
    """Row blocks in flight through shared memory (Triton's pipeliner on the row loop): 3 while
    the SM's programs' stages fit in ``ROW_STAGE_SMEM``, 2, else none (H200 sweep, 16384 rows
    bf16, session 9, 3 stages against the register prefetch: LayerNorm 3.81 vs 3.29 TB/s at
    N = 8192, 3.47 vs 3.33 at 4096; with the residual's gradient 4.01 vs 3.11 and 3.75 vs 2.84,
    where 2 stages gave 3.11; RMSNorm within ±2 %)."""
    stages = min(3, ROW_STAGE_SMEM // (programs_per_sm * tile_elems * elem_bytes * n_inputs))
    return stages if stages >= 2 else 1


def _bwd_prefetch(num_warps: int, stages: int) -> bool:
    """Without pipelined stages, prefetch the next row block in registers while reducing this one.
    Costs ~30 registers (ptxas: 128 at 4096x16 warps, no spills); at 32 warps (64 registers per
    thread) it spills, so only up to 16 warps."""
    return stages == 1 and num_warps <= 16


def _bwd_row_programs(n_row_blocks: int, n_col_tiles: int, sms: int, programs_per_sm: int) -> int:
    """Row programs of the persistent grid: fill the SMs, never more than there are row blocks."""
    return max(1, min(n_row_blocks, (sms * programs_per_sm) // n_col_tiles))


# ----------------------------------------------------------------------------------------------
# launchers (inputs already validated by the public functions; x's last dim is the normalized one)
# ----------------------------------------------------------------------------------------------


def _tier_tile(n_rows: int, n_cols: int, cfg: dict, max_fused_n: int, rows_fn, warps_fn) -> tuple:
    """(stats_in, BLOCK_M, BLOCK_N, num_warps): the fused tier's whole padded row with
    ``rows_fn`` rows per tile, or the looped tier's column tile; ``cfg`` overrides any of them."""
    fused_n = next_power_of_2(n_cols)
    stats_in = fused_n > cfg.get("max_fused_n", max_fused_n)
    if not stats_in:
        block_n = fused_n
        block_m = cfg.get("BLOCK_M", rows_fn(block_n, n_rows))
    else:
        block_n, block_m = cfg.get("BLOCK_N", LOOPED_BLOCK_N), 1
    return stats_in, block_m, block_n, cfg.get("num_warps", warps_fn(block_m * block_n))


class _FwdPlan(NamedTuple):
    stats_in: bool             # the looped tier: row stats from norm_fwd_stats_kernel first
    block_n: int
    grid: tuple
    prepared: PreparedArgs     # norm_fwd_kernel's integers, floats and constexprs


@functools.lru_cache(maxsize=1024)
def _fwd_plan(n_rows: int, n_cols: int, x_stride: int, r_stride: int, eps: float, offset: float, is_rms: bool,
              has_res: bool, has_w: bool, has_b: bool, cfg: tuple = ()) -> _FwdPlan:
    """The forward's launch, cached per shape and options (host time: the heuristics are cheap,
    but every µs of Python is paid per call on the 4096-wide rows)."""
    cfg = dict(cfg)
    stats_in, block_m, block_n, num_warps = _tier_tile(n_rows, n_cols, cfg, MAX_FUSED_N_FWD,
                                                       _fwd_rows_per_program,
                                                       _rms_fwd_num_warps if is_rms else _fwd_num_warps)
    # with stats first and a residual, h is written by the stats pass and normalized here
    src_stride = n_cols if stats_in and has_res else x_stride
    prepared = norm_fwd_kernel.prepare(
        (src_stride, r_stride, n_cols, n_cols, n_rows, n_cols, eps, offset),
        dict(IS_RMS=is_rms, HAS_RES=has_res and not stats_in, HAS_W=has_w, HAS_B=has_b, STATS_IN=stats_in,
             BLOCK_M=block_m, BLOCK_N=block_n, X_EVICT=cfg.get("X_EVICT", _fwd_x_evict()),
             num_warps=num_warps))
    return _FwdPlan(stats_in, block_n, (cdiv(n_rows, block_m), cdiv(n_cols, block_n)), prepared)


def _launch_fwd(x, weight, bias, residual, eps: float, offset: float, is_rms: bool, config=None, stats=None):
    """Returns (y, h, mean, rstd): h is empty without residual, mean is empty for RMSNorm;
    mean and rstd are flat fp32 [rows] (internal: saved for the backward, never returned).
    ``stats``: (mean, rstd) buffers to write instead of fresh ones (a no-grad call's workspace);
    then h, never returned without a residual, is not allocated either (y stands in).

    ``config`` (tuning sweeps) overrides: ``max_fused_n`` (longest padded row of the fused tier),
    ``BLOCK_M`` (rows per program, fused tier), ``BLOCK_N`` (column tile, looped tier), ``num_warps``,
    ``X_EVICT`` (L2 policy of the x load: "", "evict_last", "evict_first").
    """
    x2 = rows_view(x)
    n_rows, n_cols = x2.shape
    has_res = residual is not None
    dev = x.device
    y = empty_like(x)                                     # contiguous: row stride n_cols
    h = empty_like(x) if has_res else y if stats is not None else empty(0, x.dtype, dev)
    if stats is None:                                     # flat [rows]: saved for backward only
        mean, rstd = empty(0 if is_rms else n_rows, torch.float32, dev), empty(n_rows, torch.float32, dev)
    else:
        mean, rstd = stats
    if n_rows == 0 or n_cols == 0:
        mean.zero_()
        rstd.zero_()
        return y, h, mean, rstd
    r2 = rows_view(residual) if has_res else y
    w = weight.contiguous() if weight is not None else y
    b = bias.contiguous() if bias is not None else y
    plan = _fwd_plan(n_rows, n_cols, x2.stride(0), r2.stride(0), eps, offset, is_rms, has_res, weight is not None,
                     bias is not None, config_key(config))
    stats = rstd if is_rms else mean                       # mean_ptr: never read for RMSNorm
    src = x2
    if plan.stats_in:
        norm_fwd_stats_kernel[(n_rows,)](
            x2, r2, h, stats, rstd,
            x2.stride(0), r2.stride(0), n_cols, n_cols, eps,
            IS_RMS=is_rms, HAS_RES=has_res, BLOCK_N=plan.block_n, num_warps=_num_warps(plan.block_n),
        )
        if has_res:
            src = h                                 # h is written; normalize it instead of re-adding
    norm_fwd_kernel.launch_prepared(plan.grid, (src, r2, w, b, y, h, stats, rstd), plan.prepared)
    return y, h, mean, rstd


class _BwdPlan(NamedTuple):
    stats_in: bool             # the looped tier: per-row dot products from norm_bwd_stats_kernel first
    block_n: int
    grid: tuple                # (row programs, column tiles): the dw/db partials have grid[0] rows
    prepared: PreparedArgs     # norm_bwd_kernel's integers, floats and constexprs
    part_shapes: tuple         # the dw / db partial buffers' shapes (one per gradient asked for)
    sum_launch: tuple | None   # (grid, prepared) of sum_partials_kernel, None without dw and db
    final: PreparedArgs | None  # norm_bwd_kernel summing the partials itself (FINAL_SUM), if it may


def _final_sum(n_col_tiles: int, need_grad: bool, cuda: bool) -> bool:
    """Sum the dw / db partials inside the backward kernel, behind a grid barrier, instead of in a
    second launch: a launch is ~25-30 µs of host time on the H200 host, where the 4096-wide
    backwards are host-bound (s40, `-s40-autograd-floor-profile.log`). Only with one column tile
    (the fused tier; the looped tier's long rows are kernel-bound), on a GPU (the interpreter runs
    programs one at a time: a barrier would wait forever). A grid the GPU refuses to co-schedule
    (another process holding SMs, a sweep's programs_per_sm) takes the two launches instead."""
    return n_col_tiles == 1 and need_grad and cuda


_COOPERATIVE_OK = [True]   # False: never the in-kernel final sum (an A/B switch for probes)
_COOPERATIVE_REFUSED = COOPERATIVE_REFUSED    # (device, grid, kernel key) refused: two launches


@functools.lru_cache(maxsize=1024)
def _bwd_plan(n_rows: int, n_cols: int, elem_bytes: int, sms: int, x_stride: int, dy_stride: int, dr_stride: int,
              offset: float, is_rms: bool, has_w: bool, has_dres: bool, need_dw: bool, need_db: bool,
              cuda: bool, cfg: tuple = ()) -> _BwdPlan:
    """The backward's launch, cached per shape and options."""
    cfg = dict(cfg)
    stats_in, block_m, block_n, num_warps = _tier_tile(n_rows, n_cols, cfg, MAX_FUSED_N_BWD,
                                                       _bwd_rows_per_step, _bwd_num_warps)
    n_col_tiles = cdiv(n_cols, block_n)
    pps = cfg.get("programs_per_sm", _bwd_programs_per_sm(num_warps))
    n_prog = _bwd_row_programs(cdiv(n_rows, block_m), n_col_tiles, sms, pps)
    stages = cfg.get("STAGES", _bwd_stages(block_m * block_n, elem_bytes, 3 if has_dres else 2, pps))
    prefetch = cfg.get("prefetch", _bwd_prefetch(num_warps, stages))
    ints = (x_stride, dy_stride, dr_stride, n_cols, n_rows, n_cols, offset)
    consts = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_DRES=has_dres, DW=need_dw, DB=need_db, STATS_IN=stats_in,
                  BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=prefetch, STAGES=stages, num_warps=num_warps)
    prepared = norm_bwd_kernel.prepare(ints, dict(consts, FINAL_SUM=False, SUM_P=1, SUM_N=16))
    final = None
    # (a sweep may ask for it off the GPU with one program: the interpreter then runs the barrier)
    if (cuda or n_prog == 1) and cfg.get("final_sum", _final_sum(n_col_tiles, need_dw or need_db, cuda)):
        sum_p, sum_n = final_sum_tile(n_prog, n_cols, num_warps)
        final = norm_bwd_kernel.prepare(ints, dict(consts, FINAL_SUM=True, SUM_P=sum_p, SUM_N=sum_n,
                                                   launch_cooperative_grid=True))
    part_shapes = ((n_prog, n_cols),) * (need_dw + need_db)
    sum_launch = sum_partials_plan(n_prog, n_cols, need_dw, need_db) if part_shapes else None
    return _BwdPlan(stats_in, block_n, (n_prog, n_col_tiles), prepared, part_shapes, sum_launch, final)


class _BwdCall(NamedTuple):
    """A backward layout whose plan is one launch, bound (:meth:`FastKernel.bind_prepared`): what
    a repeated call needs beside its fresh outputs."""
    launch: BoundLaunch
    dw_part: "torch.Tensor | None"     # the dw / db partials: this stream's and thread's workspace
    db_part: "torch.Tensor | None"
    sync: "torch.Tensor | None"        # the grid barrier's counters (FINAL_SUM); None: no dw / db
    dw_like_w: bool                    # dw / db allocated as empty_like(weight) (the cheapest way)
    db_like_w: bool


_BWD_CALLS: dict = {}      # _bwd_call_key -> _BwdCall
BWD_CALL_ENTRIES = 64      # kept before the cache starts over


def _bwd_call_key(dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db, dw_dtype, db_dtype):
    """The key of a backward call that may reuse a bound launch, or None where it must take the
    planned path: not on the current GPU, an operand not contiguous, misaligned or of another
    shape, CUDA-graph capture, a profiler's launch hooks, or tests' poisoned outputs. The key holds
    what fixes the plan and the bound arguments: shape, dtypes, options, device, stream, thread.
    (Why: the planned path's separate lookups -- plan, workspace, counters, a launch key over 13
    tensors, three allocations -- cost ~47 µs of host time per call on the H200 host against
    ~20 for a bare launch, s40's `-s40-e2e-floor-bwd-final-sum.log`, where the 4096-wide
    backwards are host-bound.)"""
    if not x.is_cuda or _dispatch.POISON_OUTPUTS or torch._C._cuda_isCurrentStreamCapturing() or hooks_active():
        return None
    device = torch._C._cuda_getDevice()
    if x.get_device() != device or dy.shape != x.shape or not (x.is_contiguous() and dy.is_contiguous()):
        return None
    ptrs = x.data_ptr() | dy.data_ptr() | rstd.data_ptr()
    if dres is not None:
        if not dres.is_contiguous():
            return None
        ptrs |= dres.data_ptr()
    if weight is not None:
        if not weight.is_contiguous():
            return None
        ptrs |= weight.data_ptr()
    if mean is not None:
        ptrs |= mean.data_ptr()
    if ptrs % 16:
        return None
    return (x.shape, x.dtype, device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident(),
            None if weight is None else weight.dtype, mean is None, dres is None, offset, is_rms, need_dw, need_db,
            dw_dtype, db_dtype, _COOPERATIVE_OK[0] and not collectives_may_overlap())


def _bound_bwd(call: _BwdCall, stream: int, dy, x, weight, mean, rstd, dres, need_dw, need_db, dw_dtype, db_dtype):
    """A repeated backward: fresh outputs, then the bound launch (contiguous operands, so the
    tensors themselves stand for their [rows, N] views)."""
    dx = torch.empty_like(x)
    dw = torch.empty_like(weight) if call.dw_like_w else torch.empty(
        x.shape[-1] if need_dw else 0, dtype=dw_dtype, device=x.device)
    db = torch.empty_like(weight) if call.db_like_w else torch.empty(
        x.shape[-1] if need_db else 0, dtype=db_dtype, device=x.device)
    call.launch(stream, (x, dx if weight is None else weight, dy, dy if dres is None else dres,
                         rstd if mean is None else mean, rstd, dx, dx, call.dw_part if need_dw else dx,
                         call.db_part if need_db else dx, dw, db, rstd if call.sync is None else call.sync))
    return dx, dw, db


def _bind_bwd(key: tuple, plan: _BwdPlan, tensors: tuple, prepared: PreparedArgs, parts: tuple, sync, weight,
              need_dw: bool, need_db: bool, dw_dtype, db_dtype) -> None:
    """Keep the one launch a planned call just made, for later calls of its key."""
    bound = norm_bwd_kernel.bind_prepared(plan.grid, tensors, prepared)
    if bound is None:
        return
    if len(_BWD_CALLS) >= BWD_CALL_ENTRIES:
        _BWD_CALLS.clear()
    like_w = weight is not None and weight.dim() == 1
    _BWD_CALLS[key] = _BwdCall(bound, parts[0] if need_dw else None, parts[-1] if need_db else None, sync,
                               like_w and need_dw and dw_dtype == weight.dtype,
                               like_w and need_db and db_dtype == weight.dtype)


def _launch_bwd(dy, x, weight, mean, rstd, dres, offset: float, is_rms: bool, need_dw: bool, need_db: bool,
                dw_dtype: torch.dtype = torch.float32, db_dtype: torch.dtype = torch.float32, config=None):
    """Returns (dx, dw, db): dw/db [N] in ``dw_dtype`` / ``db_dtype`` (empty when not needed).

    ``config`` overrides: ``max_fused_n``, ``BLOCK_M`` (rows per step, fused tier), ``BLOCK_N``
    (column tile, looped tier), ``num_warps``, ``programs_per_sm`` (persistent grid size),
    ``prefetch`` (next row block loaded during this one's math, in registers), ``final_sum`` (the
    dw / db partials summed in the kernel behind a grid barrier, GPU only), ``STAGES`` (row
    blocks in flight through shared memory, Triton's pipeliner; use with ``prefetch`` off).

    A call whose plan is one launch keeps it bound (:func:`_bwd_call_key`): a repeated call of the
    same layout allocates its outputs and launches, nothing else.
    """
    key = _bwd_call_key(dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db, dw_dtype,
                        db_dtype) if config is None else None
    if key is not None:
        call = _BWD_CALLS.get(key)
        if call is not None:
            return _bound_bwd(call, key[3], dy, x, weight, mean, rstd, dres, need_dw, need_db, dw_dtype, db_dtype)
    x2, dy2 = rows_view(x), rows_view(dy)
    n_rows, n_cols = x2.shape
    dev = x.device
    dx = empty_like(x)                                    # contiguous: row stride n_cols
    dw = empty(n_cols if need_dw else 0, dw_dtype, dev)   # 0: no aliasing outputs
    db = empty(n_cols if need_db else 0, db_dtype, dev)
    if n_rows == 0 or n_cols == 0:
        return dx, dw.zero_(), db.zero_()
    dr2 = rows_view(dres) if dres is not None else dy2
    w = weight.contiguous() if weight is not None else dx
    rstd1 = rstd                        # flat [rows], as the forward wrote it
    mean1 = mean if mean is not None else rstd1
    plan = _bwd_plan(n_rows, n_cols, x.element_size(), num_sms(x), x2.stride(0), dy2.stride(0), dr2.stride(0),
                     offset, is_rms, weight is not None, dres is not None, need_dw, need_db, x.is_cuda,
                     config_key(config))
    dots = dx                           # dummy unless stats_in
    if plan.stats_in:
        dots = workspace("norm_bwd_dots", ((2, n_rows),), torch.float32, dev)[0]     # internal: a reused workspace
        norm_bwd_stats_kernel[(n_rows,)](
            x2, w, dy2, mean1, rstd1, dots, x2.stride(0), dy2.stride(0), n_rows, n_cols, offset,
            IS_RMS=is_rms, HAS_W=weight is not None, BLOCK_N=plan.block_n, num_warps=_bwd_num_warps(plan.block_n),
        )
    # dw / db partials, internal to this call: reused workspace views, not allocations
    parts = workspace("norm_bwd_partials", plan.part_shapes, torch.float32, dev) if plan.part_shapes else ()
    dw_part = parts[0] if need_dw else dx
    db_part = parts[-1] if need_db else dx
    tensors = (x2, w, dy2, dr2, mean1, rstd1, dots, dx, dw_part, db_part, dw, db)
    if plan.final is not None and _COOPERATIVE_OK[0]:     # one launch: the partials summed behind a grid barrier
        sync = cooperative_launch(norm_bwd_kernel, plan.grid, tensors, plan.final, (dev.index, plan.grid, plan.final.key))
        if sync is not None:
            if key is not None:
                _bind_bwd(key, plan, (*tensors, sync), plan.final, parts, sync, weight, need_dw, need_db,
                          dw_dtype, db_dtype)
            return dx, dw, db
    norm_bwd_kernel.launch_prepared(plan.grid, (*tensors, rstd1), plan.prepared)
    if key is not None and plan.sum_launch is None and not plan.stats_in:     # one launch: no dw / db
        _bind_bwd(key, plan, (*tensors, rstd1), plan.prepared, (), None, weight, False, False, dw_dtype, db_dtype)
    if plan.sum_launch is not None:     # the one final reduction, cast to dw's / db's dtypes
        sum_grid, sum_prepared = plan.sum_launch
        sum_partials_kernel.launch_prepared(
            sum_grid, (dw_part if need_dw else db_part, db_part if need_db else dw_part,
                       dw if need_dw else db, db if need_db else dw), sum_prepared)
    return dx, dw, db
