"""layer_norm and rms_norm over the last dimension(s), optionally fused with a residual add.

    h      = x + residual                    (fused add; otherwise h = x)
    μ      = mean_j h_j                      (0 for RMSNorm)
    rstd   = 1 / sqrt(mean_j (h_j - μ)² + eps)
    x̂      = (h - μ) · rstd
    y      = x̂ · (offset + w) + b            (offset = 1 gives Gemma's RMSNorm)
    backward, wdy = dy · (offset + w):
        dh  = rstd · (wdy - mean(wdy) - x̂ · mean(wdy · x̂))   (no mean(wdy) term for RMSNorm)
              + the gradient flowing into h itself;  dx = dresidual = dh
        dw  = Σ_rows dy · x̂,   db = Σ_rows dy

Bytes counted (ideal, per pass; M rows of N): forward reads x (and residual) and writes y (and h),
reads w/b, writes rstd (and μ) as fp32 [M]; backward reads x (h when fused), dy (and dh) and
writes dx, reads w and rstd/μ, writes dw/db. x is read once per pass in the fused tier.

Tiers (kernels in ``_norm_kernels``, one set for both norms and both residual variants):

* fused: the padded row fits one register tile (``MAX_FUSED_N_FWD`` / ``_BWD``); short rows share
  a program. Forward: one read, one write. Backward: a persistent grid, each program walks a
  slice of the rows and keeps dw/db partials in fp32 registers, written once to a
  ``[programs, N]`` buffer that one ``.sum(0)`` reduces (no atomics).
* looped (long rows): a stats kernel walks each row in tiles first (mean/rstd forward, the two
  row dot products backward), then the same normalize / backward kernels run on column tiles.
  Two walks over the row per pass.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import cdiv, empty, empty_like, next_power_of_2, num_sms, rows_view, use_triton, workspace
from .._launch import PreparedArgs, config_key
from .._op import CallCache, call_key, custom_op, no_grad_layout, plain_tensors
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._norm_kernels import (
    launch_sum_partials, norm_bwd_kernel, norm_bwd_stats_kernel, norm_fwd_kernel, norm_fwd_stats_kernel,
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


@functools.lru_cache(maxsize=1024)
def _bwd_plan(n_rows: int, n_cols: int, elem_bytes: int, sms: int, x_stride: int, dy_stride: int, dr_stride: int,
              offset: float, is_rms: bool, has_w: bool, has_dres: bool, need_dw: bool, need_db: bool,
              cfg: tuple = ()) -> _BwdPlan:
    """The backward's launch, cached per shape and options."""
    cfg = dict(cfg)
    stats_in, block_m, block_n, num_warps = _tier_tile(n_rows, n_cols, cfg, MAX_FUSED_N_BWD,
                                                       _bwd_rows_per_step, _bwd_num_warps)
    n_col_tiles = cdiv(n_cols, block_n)
    pps = cfg.get("programs_per_sm", _bwd_programs_per_sm(num_warps))
    n_prog = _bwd_row_programs(cdiv(n_rows, block_m), n_col_tiles, sms, pps)
    stages = cfg.get("STAGES", _bwd_stages(block_m * block_n, elem_bytes, 3 if has_dres else 2, pps))
    prefetch = cfg.get("prefetch", _bwd_prefetch(num_warps, stages))
    prepared = norm_bwd_kernel.prepare(
        (x_stride, dy_stride, dr_stride, n_cols, n_rows, n_cols, offset),
        dict(IS_RMS=is_rms, HAS_W=has_w, HAS_DRES=has_dres, DW=need_dw, DB=need_db, STATS_IN=stats_in,
             BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=prefetch, STAGES=stages, num_warps=num_warps))
    return _BwdPlan(stats_in, block_n, (n_prog, n_col_tiles), prepared)


def _launch_bwd(dy, x, weight, mean, rstd, dres, offset: float, is_rms: bool, need_dw: bool, need_db: bool,
                dw_dtype: torch.dtype = torch.float32, db_dtype: torch.dtype = torch.float32, config=None):
    """Returns (dx, dw, db): dw/db [N] in ``dw_dtype`` / ``db_dtype`` (empty when not needed).

    ``config`` overrides: ``max_fused_n``, ``BLOCK_M`` (rows per step, fused tier), ``BLOCK_N``
    (column tile, looped tier), ``num_warps``, ``programs_per_sm`` (persistent grid size),
    ``prefetch`` (next row block loaded during this one's math, in registers), ``STAGES`` (row
    blocks in flight through shared memory, Triton's pipeliner; use with ``prefetch`` off).
    """
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
                     offset, is_rms, weight is not None, dres is not None, need_dw, need_db, config_key(config))
    dots = dx                           # dummy unless stats_in
    if plan.stats_in:
        dots = workspace("norm_bwd_dots", ((2, n_rows),), torch.float32, dev)[0]     # internal: a reused workspace
        norm_bwd_stats_kernel[(n_rows,)](
            x2, w, dy2, mean1, rstd1, dots, x2.stride(0), dy2.stride(0), n_rows, n_cols, offset,
            IS_RMS=is_rms, HAS_W=weight is not None, BLOCK_N=plan.block_n, num_warps=_bwd_num_warps(plan.block_n),
        )
    n_prog = plan.grid[0]
    # dw / db partials, internal to this call: reused workspace views, not allocations
    parts = list(workspace("norm_bwd_partials", ((n_prog, n_cols),) * (need_dw + need_db), torch.float32, dev))
    dw_part = parts.pop(0) if need_dw else dx
    db_part = parts.pop(0) if need_db else dx
    norm_bwd_kernel.launch_prepared(plan.grid, (x2, w, dy2, dr2, mean1, rstd1, dots, dx, dw_part, db_part),
                                    plan.prepared)
    if need_dw or need_db:
        launch_sum_partials(dw_part if need_dw else None, db_part if need_db else None,
                            dw if need_dw else None, db if need_db else None)
    return dx, dw, db


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == torch.float64 else t.float()


def _norm_stats(h: torch.Tensor, eps: float, is_rms: bool, dims=(-1,)):
    """(mean or None, rstd) of the wide tensor h over ``dims``, keepdim."""
    mean = None if is_rms else h.mean(dims, keepdim=True)
    hc = h if is_rms else h - mean
    return mean, torch.rsqrt((hc * hc).mean(dims, keepdim=True) + eps)


def _norm_reference(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    dims = tuple(range(-len(_shape_tuple(normalized_shape, x)), 0))
    h = x if residual is None else x + residual          # rounded to x's dtype, as the kernel does
    hw = _wide(h)
    mean, rstd = _norm_stats(hw, eps, is_rms, dims)
    y = (hw if is_rms else hw - mean) * rstd
    if weight is not None:
        y = y * (_wide(weight) + offset)
    if bias is not None:
        y = y + _wide(bias)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def layer_norm_reference(x, normalized_shape=None, weight=None, bias=None, eps=1e-5, residual=None):
    return _norm_reference(x, normalized_shape, weight, bias, eps, 0.0, residual, is_rms=False)


def rms_norm_reference(x, normalized_shape=None, weight=None, eps=1e-6, offset=0.0, residual=None):
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _norm_reference(x, normalized_shape, weight, None, eps, offset, residual, is_rms=True)


def _fwd_reference(x, weight, bias, residual, eps, offset, is_rms):
    """The custom op's CPU path: (y, h, mean, rstd) like _launch_fwd."""
    h = x if residual is None else x + residual
    hw = _wide(h)
    mean, rstd = _norm_stats(hw, eps, is_rms)
    y = (hw if is_rms else hw - mean) * rstd
    if weight is not None:
        y = y * (weight.float() + offset)
    if bias is not None:
        y = y + bias.float()
    mean = x.new_empty((0,), dtype=torch.float32) if is_rms else mean.reshape(-1).float()
    return (y.to(x.dtype).contiguous(), h.contiguous() if residual is not None else x.new_empty((0,)),
            mean.contiguous(), rstd.reshape(-1).float().contiguous())


def _bwd_reference(dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db,
                   dw_dtype=torch.float32, db_dtype=torch.float32):
    n = x.shape[-1]
    xw, dyw = x.float(), dy.float()
    lead_shape = x.shape[:-1] + (1,)    # mean / rstd come flat, [rows]
    rstd = rstd.reshape(lead_shape)
    xhat = (xw if is_rms else xw - mean.reshape(lead_shape)) * rstd
    wdy = dyw * (weight.float() + offset) if weight is not None else dyw
    dx = wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - wdy.mean(-1, keepdim=True)
    dx = dx * rstd
    if dres is not None:
        dx = dx + dres.float()
    lead = tuple(range(x.dim() - 1))
    dw = (dyw * xhat).sum(lead).reshape(n) if need_dw else x.new_empty((0,))
    db = dyw.sum(lead).reshape(n) if need_db else x.new_empty((0,))
    return dx.to(x.dtype).contiguous(), dw.to(dw_dtype), db.to(db_dtype)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::norm_fwd", mutates_args=())
def _norm_fwd_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor], eps: float, offset: float, is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _launch_fwd(x, weight, bias, residual, eps, offset, is_rms)
    return _fwd_reference(x, weight, bias, residual, eps, offset, is_rms)


@_norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps, offset, is_rms):
    f32 = dict(dtype=torch.float32, device=x.device)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else math.prod(x.shape[:-1])
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape if residual is not None else (0,)),
        torch.empty((0 if is_rms else rows,), **f32),   # mean and rstd: flat [rows]
        torch.empty((rows,), **f32),
    )


@custom_op("tilefuse::norm_bwd", mutates_args=())
def _norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: Optional[torch.Tensor],
    rstd: torch.Tensor, dres: Optional[torch.Tensor], offset: float, is_rms: bool, need_dw: bool, need_db: bool,
    dw_dtype: torch.dtype, db_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); dw / db already in the weight's / bias's dtype (the cast fused into the
    final reduction)."""
    args = (dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db, dw_dtype, db_dtype)
    return _launch_bwd(*args) if use_triton(x) else _bwd_reference(*args)


@_norm_bwd_op.register_fake
def _(dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db, dw_dtype, db_dtype):
    n = x.shape[-1]
    return (x.new_empty(x.shape), torch.empty((n,) if need_dw else (0,), dtype=dw_dtype, device=x.device),
            torch.empty((n,) if need_db else (0,), dtype=db_dtype, device=x.device))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, offset, is_rms = inputs
    _, h, mean, rstd = output
    ctx.has_res, ctx.offset, ctx.is_rms = residual is not None, offset, is_rms
    ctx.w_dtype = weight.dtype if weight is not None else None
    ctx.b_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    # mean / rstd (and h without a residual) never get gradients: untracked outputs spare the
    # autograd engine their grad slots (host time of every backward)
    ctx.mark_non_differentiable(mean, rstd, *(() if residual is not None else (h,)))


def _backward(ctx, dy, dh, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_dw = ctx.w_dtype is not None and ctx.needs_input_grad[1]
    need_db = ctx.b_dtype is not None and ctx.needs_input_grad[2]
    dy = torch.zeros_like(x) if dy is None else dy.to(x.dtype)
    dres = dh.to(x.dtype) if ctx.has_res and dh is not None else None
    dx, dw, db = _norm_bwd_op(dy, x, weight, None if ctx.is_rms else mean, rstd, dres,
                              ctx.offset, ctx.is_rms, need_dw, need_db,
                              ctx.w_dtype or torch.float32, ctx.b_dtype or torch.float32)
    return (dx, dw if need_dw else None, db if need_db else None,
            dx if ctx.has_res else None, None, None, None)


# mean/rstd never receive gradients: skip materializing zeros for them (and for an unused y or h)
_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context, materialize_grads=False)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _shape_tuple(normalized_shape, x) -> tuple:
    if normalized_shape is None:
        return (x.shape[-1],)
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


def _check_normalized_shape(normalized_shape, x: torch.Tensor) -> tuple:
    # the common cases first (host time): None, N, (N,) for x's last dim N
    n = x.shape[-1] if x.dim() else None
    kind = type(normalized_shape)
    if normalized_shape is None and n is not None or kind is int and normalized_shape == n:
        return (n,)
    if kind is tuple and len(normalized_shape) == 1 and type(normalized_shape[0]) is int and normalized_shape[0] == n:
        return normalized_shape
    ok_type = normalized_shape is None or isinstance(normalized_shape, (int, tuple, list, torch.Size))
    if not ok_type or isinstance(normalized_shape, bool):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got "
                        f"{type(normalized_shape).__name__} (pass weight/bias by keyword)")
    shape = _shape_tuple(normalized_shape, x)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"normalized_shape must be a non-empty sequence of ints, got {normalized_shape!r}")
    if len(shape) > x.dim() or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {shape} does not match the trailing dims of x {tuple(x.shape)}")
    return shape


def _check_number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not -math.inf < v < math.inf:   # (not math.isfinite: dynamo traces floats symbolically)
        raise ValueError(f"{name} must be finite, got {v}")
    return float(v)


class _NormCall(NamedTuple):
    """A validated no-grad call layout of :func:`_norm` (the eager fast path): what the checked
    path launches after its checks, with mean / rstd in a workspace (nothing saves them)."""
    shape: tuple               # normalized_shape
    eps: float
    offset: float
    is_rms: bool
    rows: int

    def run(self, x, weight, bias, residual):
        flat = len(self.shape) > 1
        if flat:
            x = x.flatten(x.dim() - len(self.shape))
            weight = weight.flatten() if weight is not None else None
            bias = bias.flatten() if bias is not None else None
            residual = residual.flatten(residual.dim() - len(self.shape)) if residual is not None else None
        stats = workspace("norm_fwd_stats", ((0 if self.is_rms else self.rows,), (self.rows,)), torch.float32,
                          x.device)
        y, h, _, _ = _launch_fwd(x, weight, bias, residual, self.eps, self.offset, self.is_rms, stats=stats)
        if flat:
            y = y.unflatten(-1, self.shape)
            h = h.unflatten(-1, self.shape) if residual is not None else h
        return y if residual is None else (y, h)


_FAST = CallCache()       # no-grad call layout and options -> _NormCall


def _fast_key(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    """The layout key of an eager call with no gradient to build, else None (:func:`layout_key`
    of every tensor, the options with their types, the Triton path or not)."""
    return call_key(no_grad_layout(x, weight, bias, residual), (normalized_shape, eps, offset, is_rms))


def _norm(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    key = _fast_key(x, normalized_shape, weight, bias, eps, offset, residual, is_rms)
    hit = _FAST.get(key)
    if hit is not None:
        return hit.run(x, weight, bias, residual)
    out = _checked_norm(x, normalized_shape, weight, bias, eps, offset, residual, is_rms)
    if key is not None and key[-1] and x.numel() and plain_tensors(x, weight, bias, residual):
        shape = _check_normalized_shape(normalized_shape, x)
        _FAST.put(key, _NormCall(shape, float(eps), float(offset), is_rms, x.numel() // math.prod(shape)))
    return out


def _checked_norm(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    check_tensor("x", x, min_dim=1)
    shape = _check_normalized_shape(normalized_shape, x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t)
            check_shape(name, t, shape, "normalized_shape")
    if residual is not None:
        check_tensor("residual", residual)
        check_same_dtype(x=x, residual=residual)
        check_shape("residual", residual, x.shape, "x's shape")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual)
    eps = _check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    offset = _check_number("offset", offset)
    if offset != 0.0 and weight is None:
        raise ValueError("offset scales the weight (y = x̂·(offset + weight)): pass weight with offset")
    if len(shape) > 1:  # normalize the trailing dims as one flattened row
        x = x.flatten(x.dim() - len(shape))
        weight = weight.flatten() if weight is not None else None
        bias = bias.flatten() if bias is not None else None
        residual = residual.flatten(residual.dim() - len(shape)) if residual is not None else None
    y, h, _, _ = _norm_fwd_op(x, weight, bias, residual, eps, offset, is_rms)
    if len(shape) > 1:
        y = y.unflatten(-1, shape)
        h = h.unflatten(-1, shape) if residual is not None else h
    return y if residual is None else (y, h)


def layer_norm(x, normalized_shape=None, weight=None, bias=None, eps=1e-5, residual=None):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)``; normalized_shape defaults to
    x's last dim. fp32 math; y in x's dtype; weight/bias may be another float dtype than x.

    With ``residual`` (x's shape and dtype): ``h = x + residual``, returns ``(layer_norm(h), h)``.
    """
    return _norm(x, normalized_shape, weight, bias, eps, 0.0, residual, is_rms=False)


def rms_norm(x, normalized_shape=None, weight=None, eps=1e-6, offset=0.0, residual=None):
    """``F.rms_norm(x, normalized_shape, weight, eps)`` with ``y = x̂·(offset + weight)``
    (offset=1.0: Gemma). ``eps=None`` means ``torch.finfo(x.dtype).eps``, as torch.

    With ``residual``: ``h = x + residual``, returns ``(rms_norm(h), h)`` (Llama's pre-norm add).
    """
    if eps is None and isinstance(x, torch.Tensor) and x.is_floating_point():
        eps = torch.finfo(x.dtype).eps
    return _norm(x, normalized_shape, weight, None, eps, offset, residual, is_rms=True)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _randn(shape, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale + shift).to(dtype).requires_grad_(True)


def _make_inputs(is_rms: bool, fused_add: bool):
    def make(shape, dtype, device):
        n = shape[-1]
        x = _randn(shape, dtype, device, scale=2.0, shift=0.5)   # a real mean to subtract
        w = _randn((n,), dtype, device, scale=0.1, shift=1.0)    # near 1 but random, like a trained norm
        res = _randn(shape, dtype, device) if fused_add else None
        if is_rms:                      # rms_norm(x, normalized_shape, weight, eps, offset, residual)
            args, grads = (x, (n,), w, 1e-6, 0.0) + ((res,) if fused_add else ()), (0, 2, 5)
        else:                           # layer_norm(x, normalized_shape, weight, bias, eps, residual)
            b = _randn((n,), dtype, device, scale=0.1)
            args, grads = (x, (n,), w, b, 1e-5) + ((res,) if fused_add else ()), (0, 2, 3, 5)
        return Inputs(args, grad_args=grads if fused_add else grads[:-1])
    return make


def _bytes(is_rms: bool, fused_add: bool):
    def count(shape, dtype, pass_):
        n = shape[-1]
        m = math.prod(shape[:-1])
        big = tensor_bytes(shape, dtype)            # one [M, N] tensor
        vec = tensor_bytes((n,), dtype)             # one of w, b, dw, db
        stats = (1 if is_rms else 2) * 4 * m        # rstd (and mean), fp32
        params = 1 if is_rms else 2                 # w (and b)
        if pass_ == "fwd":                          # x (+ residual) read, y (+ h) written
            return big * (4 if fused_add else 2) + vec * params + stats
        # bwd: x (h), dy (+ dh) read, dx written (also d residual: the same tensor); w read, dw/db written
        return big * (4 if fused_add else 3) + vec * (1 + params) + stats
    return count


def _torch_peer(is_rms: bool, fused_add: bool):
    def fn(x, normalized_shape, weight, *rest):
        if is_rms:
            eps, offset, residual = (list(rest) + [1e-6, 0.0, None][len(rest):])[:3]
            h = x + residual if fused_add else x
            y = torch.nn.functional.rms_norm(h, normalized_shape, weight + offset if offset else weight, eps)
        else:
            bias, eps, residual = (list(rest) + [None, 1e-5, None][len(rest):])[:3]
            h = x + residual if fused_add else x
            y = torch.nn.functional.layer_norm(h, normalized_shape, weight, bias, eps)
        return (y, h) if fused_add else y
    return lambda: fn


def _liger_peer(is_rms: bool, fused_add: bool):
    def factory():
        try:
            if is_rms:
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction as Norm  # type: ignore
                if fused_add:
                    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as Add  # type: ignore
            else:
                from liger_kernel.ops.layer_norm import LigerLayerNormFunction as Norm  # type: ignore
        except Exception:
            return None
        import inspect

        def no_in_place(fn):            # liger may overwrite dy with dx unless told not to
            return (False,) if "in_place" in inspect.signature(fn.forward).parameters else ()

        def fn(x, normalized_shape, weight, *rest):
            if is_rms:
                eps, offset, residual = (list(rest) + [1e-6, 0.0, None][len(rest):])[:3]
                if fused_add:
                    return Add.apply(x, residual, weight, eps, offset, "llama", *no_in_place(Add))
                return Norm.apply(x, weight, eps, offset, "llama", *no_in_place(Norm))
            bias, eps, residual = (list(rest) + [None, 1e-5, None][len(rest):])[:3]
            h = x + residual if fused_add else x
            y = Norm.apply(h, weight, bias, eps)
            return (y, h) if fused_add else y
        return fn
    return factory


# Rows of one element are tested in tests/test_norms.py::test_rows_of_length_one: LayerNorm's exact
# dx is 0 at N = 1 and N = 2 (two values normalize to ±1 whatever they are), so a relative error
# is undefined there (the GPU's FMA leaves rounding-level values); the sweep starts at N = 3.
_TEST_SHAPES = [(1, 3), (3, 781), (7, 4097), (2, 3, 1000), (1, 65537), (5, 3)]
# RMSNorm's dx at N = 1 is eps·rstd³·wdy: a difference of two O(1) terms, ill-conditioned in fp32
# against an fp64 reference (LayerNorm's is exactly 0); tests/test_norms.py checks N = 1 separately.
_RMS_TEST_SHAPES = [(1, 2), (3, 781), (7, 4097), (2, 3, 1000), (1, 65537), (5, 2)]
_GPU_TEST_SHAPES = [(16384, 4096), (4096, 8192), (64, 65537), (1000, 12288)]
_BENCH_SHAPES = [(16384, 4096), (16384, 8192)]

for _name, _is_rms, _add, _desc in (
    ("layer_norm", False, False, "LayerNorm over the last dim"),
    ("rms_norm", True, False, "RMSNorm over the last dim"),
    ("add_layer_norm", False, True, "residual add fused with LayerNorm: (norm(x + r), x + r)"),
    ("add_rms_norm", True, True, "residual add fused with RMSNorm: (norm(x + r), x + r)"),
):
    register(OpSpec(
        name=_name,
        fn=rms_norm if _is_rms else layer_norm,
        reference=rms_norm_reference if _is_rms else layer_norm_reference,
        make_inputs=_make_inputs(_is_rms, _add),
        bytes_fn=_bytes(_is_rms, _add),
        test_shapes=_RMS_TEST_SHAPES if _is_rms else _TEST_SHAPES,
        gpu_test_shapes=_GPU_TEST_SHAPES,
        bench_shapes=_BENCH_SHAPES,
        peers={"torch": _torch_peer(_is_rms, _add), "liger": _liger_peer(_is_rms, _add)},
        description=_desc,
    ))
