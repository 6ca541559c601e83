"""bias_act: bias add, activation, dropout and residual add in one pass, forward and backward.

    z  = x + b                                  (b broadcast over the last dim)
    y  = keep · act(z) / (1 − p)  [+ residual]  (keep: counter-based dropout mask, _dropout.py)
    backward:  dz = dy · keep / (1 − p) · act'(z);   dx = dz,  db = Σ_rows dz,  dresidual = dy

Bytes counted (ideal, per pass), M·N = x.numel(): forward reads x and b and writes y
(2·M·N + N elements; + M·N with a residual); backward reads x, b and dy and writes dx and db
(3·M·N + 2·N). The dropout mask is never stored: the backward regenerates it from the seed,
and only x (the pre-bias input, which the caller keeps alive anyway) is saved, never z or y.
Without an activation x is not even read back: dz = dy·keep/(1 − p).

db is reduced without atomics: each backward program walks a chunk of rows for one column
block, keeps its column sums in registers and writes one fp32 partial row; the [chunks, N]
partials are then summed (a few MB against the hundreds of MB of x, dy and dx at LLM sizes) by
the same launch on a GPU -- its programs are all resident (a cooperative launch) and meet at a
grid barrier, as the norms' backward does -- or by a second, small one (``launch_sum_partials``,
shared with the norms) under the interpreter, CUDA-graph capture, or a grid the GPU refuses.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import cdiv, cooperative_launch, empty, empty_like, num_sms, rows_view, use_triton, workspace
from .._launch import PreparedArgs, config_key, fast_launch
from .._op import custom_op
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._activation_math import (
    ACTIVATION_FLOPS, ACTIVATIONS, FWD_TILE_ELEMS, activation_fwd, activation_fwd_bwd,
    activation_grad_reference, activation_reference, tile_config, tile_rows_cols,
)
from ._common import row_tile_mask_offsets
from ._dropout import dropout_keep, dropout_keep_reference, dropout_scale, dropout_threshold, draw_seed
from ._norm_kernels import (
    _grid_barrier, _grid_barrier_leave, _sum_partials_slices, final_sum_tile, launch_sum_partials,
)

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptr, rows, cols, n_rows, n_cols, row_stride):
    """fp32 [BLOCK_M, BLOCK_N] tile (0 outside the matrix) and its mask."""
    mask, offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, row_stride)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _apply_dropout(v, seed, rows, col_start, threshold, scale,
                   DROPOUT: tl.constexpr, RNG_GROUPED: tl.constexpr, BLOCK_N: tl.constexpr):
    """keep · v · scale, the forward's mask on activations and the backward's on dy alike."""
    if DROPOUT:
        keep = dropout_keep(seed, rows, col_start, threshold, BLOCK_N, RNG_GROUPED)
        v = tl.where(keep, v * scale, 0.0)
    return v


@fast_launch
@triton.jit
def bias_act_fwd_kernel(
    x_ptr,              # *input    [n_rows, n_cols], unit column stride
    bias_ptr,           # *bias     [n_cols] contiguous (unused without HAS_BIAS)
    res_ptr,            # *residual [n_rows, n_cols], unit column stride (unused without HAS_RESIDUAL)
    y_ptr,              # *output   [n_rows, n_cols], contiguous, x's dtype
    seed,               # Philox key of the dropout mask (first integer: the one that changes per call)
    x_row_stride,       # elements between rows of x
    res_row_stride,     # elements between rows of the residual
    y_row_stride,       # elements between rows of y
    n_rows,             # rows (all leading dims flattened)
    n_cols,             # row length (bias length)
    n_col_blocks,       # cdiv(n_cols, BLOCK_N): the grid is row blocks x column blocks
    threshold,          # dropout_threshold(p)
    scale,              # 1 / (1 - p), 0 when p == 1
    ACT: tl.constexpr,          # one of ACTIVATIONS
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DROPOUT: tl.constexpr,      # p > 0 and training
    RNG_GROUPED: tl.constexpr,  # dropout_keep implementation (same mask either way)
    BLOCK_M: tl.constexpr,      # rows per tile
    BLOCK_N: tl.constexpr,      # columns per tile (power of two >= 4)
):
    rows, col_start, cols = tile_rows_cols(n_col_blocks, BLOCK_M, BLOCK_N)
    z, mask = _load_tile(x_ptr, rows, cols, n_rows, n_cols, x_row_stride)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    act = activation_fwd(z, ACT, y_ptr.dtype.element_ty == tl.float32)
    v = _apply_dropout(act, seed, rows, col_start, threshold, scale, DROPOUT, RNG_GROUPED, BLOCK_N)
    if HAS_RESIDUAL:
        res, _ = _load_tile(res_ptr, rows, cols, n_rows, n_cols, res_row_stride)
        v += res
    _, y_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, y_row_stride)
    tl.store(y_ptr + y_offs, v.to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def bias_act_bwd_kernel(
    dy_ptr,             # *grad of output [n_rows, n_cols], unit column stride
    x_ptr,              # *saved input    [n_rows, n_cols] (unused when ACT == "none")
    bias_ptr,           # *bias [n_cols] (unused without HAS_BIAS or when ACT == "none")
    dx_ptr,             # *grad of x      [n_rows, n_cols], contiguous (unused without STORE_DX)
    dbias_part_ptr,     # *fp32 [n_chunks, n_cols]: one partial column sum per row chunk
    dbias_ptr,          # *dbias [n_cols], the bias's dtype (written with FINAL_SUM)
    sync_ptr,           # *int32 [2], zero: the grid barrier's counters (FINAL_SUM; left zero)
    seed,               # Philox key of the forward's dropout mask (first integer, as forward)
    dy_row_stride,      # elements between rows of dy
    x_row_stride,       # elements between rows of x
    dx_row_stride,      # elements between rows of dx
    n_rows,             # rows
    n_cols,             # row length
    n_col_blocks,       # cdiv(n_cols, BLOCK_N): the grid is row chunks x column blocks
    tiles_per_chunk,    # BLOCK_M-row tiles each program walks
    threshold,          # dropout_threshold(p)
    scale,              # 1 / (1 - p), 0 when p == 1
    ACT: tl.constexpr,          # the forward's activation
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    RNG_GROUPED: tl.constexpr,
    STORE_DX: tl.constexpr,     # x needs a gradient
    REDUCE_DBIAS: tl.constexpr, # the bias needs a gradient
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,   # software pipelining of the row-tile loop (1: none)
    FINAL_SUM: tl.constexpr,    # all programs resident (cooperative launch): sum the dbias partials here
    SUM_P: tl.constexpr,        # FINAL_SUM: partial rows per load
    SUM_N: tl.constexpr,        # FINAL_SUM: columns per slice
):
    chunk = tl.program_id(0) // n_col_blocks               # column blocks fastest, as forward
    col_start = (tl.program_id(0) % n_col_blocks) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_BIAS and ACT != "none":
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dbias_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in tl.range(0, tiles_per_chunk, num_stages=NUM_STAGES):
        rows = chunk.to(tl.int64) * tiles_per_chunk * BLOCK_M + t * BLOCK_M + tl.arange(0, BLOCK_M)
        dy, mask = _load_tile(dy_ptr, rows, cols, n_rows, n_cols, dy_row_stride)
        dz = dy
        if ACT != "none":
            z, _ = _load_tile(x_ptr, rows, cols, n_rows, n_cols, x_row_stride)
            if HAS_BIAS:
                z += bias
            _, dact = activation_fwd_bwd(z, ACT, x_ptr.dtype.element_ty == tl.float32)
            dz = dz * dact
        # the mask last: a dropped element's grad is exactly 0 even where act'(z) is not finite
        dz = _apply_dropout(dz, seed, rows, col_start, threshold, scale, DROPOUT, RNG_GROUPED, BLOCK_N)
        if STORE_DX:
            _, dx_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dx_row_stride)
            tl.store(dx_ptr + dx_offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        if REDUCE_DBIAS:
            dbias_acc += dz          # rows past n_rows loaded dy = 0, so they add 0
    if REDUCE_DBIAS:
        tl.store(dbias_part_ptr + chunk.to(tl.int64) * n_cols + cols, tl.sum(dbias_acc, axis=0), mask=col_mask)
        if FINAL_SUM:       # the norms' one-launch final sum (_norm_kernels): barrier, column slices, leave
            n_programs = tl.num_programs(0)
            _grid_barrier(sync_ptr, n_programs)
            _sum_partials_slices(dbias_part_ptr, dbias_part_ptr, dbias_ptr, dbias_ptr, n_programs // n_col_blocks,
                                 n_cols, tl.program_id(0), n_programs, False, True, SUM_P, SUM_N)
            _grid_barrier_leave(sync_ptr, n_programs)


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------

# Backward grid: 4 programs per SM, rounded *down* to whole row chunks x column blocks. Rounding
# up left a few programs of a last wave running alone (H200, 2 x 1024 tiles, 16384x14336: 4,041
# GB/s rounded down vs 3,666 rounded up; -s10-bias-act-bwd-configs.log).
REDUCE_PROGRAMS_PER_SM = 4
# Row tiles of a backward program software-pipelined 3 deep (async copies to shared memory): the
# unpipelined loop held dy and x in 211 registers (2 programs of 4 warps per SM), pipelined 128.
# H200 (-s8-bias-act-bwd-stages.log, graph): 16384x14336 398.5 -> 390.0 us, 16384x4096 level.
BWD_STAGES = 3
# 32 values per thread in the forward, not the elementwise default's 16: with the GELU's ~20
# instructions per element the per-thread index and mask setup is worth amortizing (sm_90 SASS:
# 28.5 -> 25.2 instructions per element), and the H200 sweep agreed (benchmarks/NOTES.md, bias_act).
ELEMS_PER_THREAD = 32
# The backward's row tile: 2048 elements, 16 per thread (4 warps); see _bwd_tile.
BWD_TILE = 2048
BWD_ELEMS_PER_THREAD = 16


def _fwd_tile(n_rows: int, n_cols: int, config: dict | None) -> dict:
    """16 rows x 512 columns, 8 warps: the best forward tile at N = 4096 and 14336 (H200 sweep:
    3.76 / 3.84 TB/s vs 3.33 / 3.46 for the 8 x 1024, 16-warp elementwise default)."""
    return tile_config(n_rows, n_cols, FWD_TILE_ELEMS, {"RNG_GROUPED": True, **(config or {})},
                       max_block_n=512, elems_per_thread=ELEMS_PER_THREAD)


def _bwd_tile(n_rows: int, n_cols: int, defaults: dict, config: dict | None) -> dict:
    """2 x 1024 tiles at 16 values per thread (4 warps): small smem stages (24 KB for 3), so ~9
    programs fit an SM. H200, bias + GELU bwd, graph, 10 tiles x grid sizes interleaved
    (-s10-bias-act-bwd-configs.log): 4,041 / 3,772 / 3,929 GB/s at 16384x14336 / 16384x4096 /
    8192x11008, the best at all three (was 4 x 1024 / 2 x 2048 at 32 per thread: 3,670 / 3,401
    / 3,394); 16 x 512 with 8 warps came second (3,975 / 3,618 / 3,796)."""
    return tile_config(n_rows, n_cols, BWD_TILE, {**defaults, **(config or {})},
                       max_block_n=1024, elems_per_thread=BWD_ELEMS_PER_THREAD)


def _bwd_row_chunks(n_rows: int, block_m: int, n_col_blocks: int, programs: int) -> tuple[int, int]:
    """(tiles per program, row chunks) so that chunks x column blocks ~= ``programs``, not more
    (rounded down: see REDUCE_PROGRAMS_PER_SM)."""
    row_tiles = cdiv(n_rows, block_m)
    chunks = max(1, min(row_tiles, programs // n_col_blocks))
    tiles_per_chunk = cdiv(row_tiles, chunks)
    return tiles_per_chunk, cdiv(row_tiles, tiles_per_chunk)


class _FwdPlan(NamedTuple):
    grid: tuple
    prepared: PreparedArgs     # bias_act_fwd_kernel's integers, floats and constexprs, for seed 0


@functools.lru_cache(maxsize=1024)
def _fwd_plan(n_rows: int, n_cols: int, x_stride: int, res_stride: int, activation: str, p: float, has_bias: bool,
              has_residual: bool, config: tuple = ()) -> _FwdPlan:
    """The forward's launch, cached per shape and options (host time); ``_seeded`` adds the seed."""
    cfg = _fwd_tile(n_rows, n_cols, dict(config))
    n_col_blocks = cdiv(n_cols, cfg["BLOCK_N"])
    prepared = bias_act_fwd_kernel.prepare(
        (0, x_stride, res_stride, n_cols, n_rows, n_cols, n_col_blocks, dropout_threshold(p), dropout_scale(p)),
        dict(ACT=activation, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, DROPOUT=p > 0.0,
             RNG_GROUPED=cfg["RNG_GROUPED"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
             num_warps=cfg["num_warps"]))
    return _FwdPlan((cdiv(n_rows, cfg["BLOCK_M"]) * n_col_blocks,), prepared)


class _BwdPlan(NamedTuple):
    n_chunks: int              # row chunks: rows of the dbias partials
    grid: tuple
    prepared: PreparedArgs     # bias_act_bwd_kernel's integers, floats and constexprs, for seed 0
    final: PreparedArgs | None  # the same summing its dbias partials itself (FINAL_SUM), if it may


def _final_sum(want_dbias: bool, cuda: bool) -> bool:
    """Sum the dbias partials inside the backward kernel behind a grid barrier, not in a second
    launch (as the norms do since s40): a launch is ~25-30 µs of host time on the H200 host,
    where the 4096-wide backward is host-bound. On a GPU only: the interpreter runs programs one
    at a time (a barrier of more than one would wait forever)."""
    return want_dbias and cuda


@functools.lru_cache(maxsize=1024)
def _bwd_plan(n_rows: int, n_cols: int, sms: int, dy_stride: int, x_stride: int, dx_stride: int, activation: str,
              p: float, has_bias: bool, want_dx: bool, want_dbias: bool, cuda: bool, config: tuple = ()) -> _BwdPlan:
    """The backward's launch, cached per shape and options."""
    defaults = {"RNG_GROUPED": True, "REDUCE_PROGRAMS": REDUCE_PROGRAMS_PER_SM * sms, "NUM_STAGES": BWD_STAGES}
    cfg = _bwd_tile(n_rows, n_cols, defaults, dict(config))
    n_col_blocks = cdiv(n_cols, cfg["BLOCK_N"])
    tiles_per_chunk, n_chunks = _bwd_row_chunks(n_rows, cfg["BLOCK_M"], n_col_blocks, cfg["REDUCE_PROGRAMS"])
    ints = (0, dy_stride, x_stride, dx_stride, n_rows, n_cols, n_col_blocks, tiles_per_chunk,
            dropout_threshold(p), dropout_scale(p))
    consts = dict(ACT=activation, HAS_BIAS=has_bias, DROPOUT=p > 0.0, RNG_GROUPED=cfg["RNG_GROUPED"],
                  STORE_DX=want_dx, REDUCE_DBIAS=want_dbias, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"])
    n_programs = n_chunks * n_col_blocks
    final = None
    # (a sweep may ask for it off the GPU with one program: the interpreter then runs the barrier)
    if (cuda or n_programs == 1) and cfg.get("final_sum", _final_sum(want_dbias, cuda)) and want_dbias:
        sum_p, sum_n = final_sum_tile(n_chunks, n_cols, cfg["num_warps"])
        final = bias_act_bwd_kernel.prepare(ints, dict(consts, FINAL_SUM=True, SUM_P=sum_p, SUM_N=sum_n,
                                                       launch_cooperative_grid=True))
    prepared = bias_act_bwd_kernel.prepare(ints, dict(consts, FINAL_SUM=False, SUM_P=1, SUM_N=16))
    return _BwdPlan(n_chunks, (n_programs,), prepared, final)


def _seeded(prepared: PreparedArgs, seed: int) -> PreparedArgs:
    """A plan's arguments (built with seed 0, the kernels' first integer) for this call's dropout
    seed: training draws a new seed every step, so the seed alone is keyed per call (a seed's
    value must not key the plan: one cache entry per step)."""
    if seed == 0:
        return prepared
    return prepared.with_first_int(seed)


# ----------------------------------------------------------------------------------------------
# launchers (inputs already validated by the public function)
# ----------------------------------------------------------------------------------------------


def _launch_fwd(x, bias, residual, activation: str, p: float, seed: int, config: dict | None = None):
    """``config`` keys: BLOCK_M, BLOCK_N, num_warps, RNG_GROUPED."""
    y = empty_like(x)                   # contiguous: row stride n_cols
    if x.numel() == 0:
        return y
    x2 = rows_view(x)
    n_rows, n_cols = x2.shape
    res2 = rows_view(residual) if residual is not None else x2
    plan = _fwd_plan(n_rows, n_cols, x2.stride(0), res2.stride(0), activation, p, bias is not None,
                     residual is not None, config_key(config))
    bias_arg = bias.contiguous() if bias is not None else x2
    bias_act_fwd_kernel.launch_prepared(plan.grid, (x2, bias_arg, res2, y), _seeded(plan.prepared, seed))
    return y


def _dbias_dtype(dy: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """The bias gradient's dtype: the bias's own (an fp32 bias may sit beside 16-bit x)."""
    return dy.dtype if bias is None else bias.dtype


def _launch_bwd(dy, x, bias, activation: str, p: float, seed: int, want_dx: bool, want_dbias: bool,
                n_cols: int, config: dict | None = None):
    """(dx or None, dbias or None); ``x``/``bias`` may be None when the activation is "none".
    ``config`` keys: BLOCK_M, BLOCK_N, num_warps, RNG_GROUPED, REDUCE_PROGRAMS, NUM_STAGES."""
    dbias = None
    if dy.numel() == 0:
        dx = empty(dy.shape, dy.dtype, dy.device) if want_dx else None
        if want_dbias:
            dbias = torch.zeros(n_cols, dtype=_dbias_dtype(dy, bias), device=dy.device)
        return dx, dbias
    dy2 = rows_view(dy)
    n_rows = dy2.shape[0]
    x2 = rows_view(x) if x is not None else dy2
    dx = empty_like(dy) if want_dx else dy2                 # contiguous: row stride n_cols
    plan = _bwd_plan(n_rows, n_cols, num_sms(dy), dy2.stride(0), x2.stride(0), n_cols if want_dx else dy2.stride(0),
                     activation, p, bias is not None, want_dx, want_dbias, dy.is_cuda, config_key(config))
    # dbias partials: internal to this call, from a reused workspace (no allocation)
    partials = dy2
    if want_dbias:
        partials = workspace("bias_act_dbias", ((plan.n_chunks, n_cols),), torch.float32, dy.device)[0]
        dbias = empty(n_cols, _dbias_dtype(dy, bias), dy.device)
    bias_arg = bias.contiguous() if bias is not None else dy2
    tensors = (dy2, x2, bias_arg, dx, partials, dbias if want_dbias else partials)
    if plan.final is not None and cooperative_launch(bias_act_bwd_kernel, plan.grid, tensors,
                                                     _seeded(plan.final, seed), (dy.device.index, plan.grid, plan.final.key)) is not None:
        return (dx if want_dx else None), dbias     # one launch: the partials summed behind a grid barrier
    bias_act_bwd_kernel.launch_prepared(plan.grid, (*tensors, partials), _seeded(plan.prepared, seed))
    if want_dbias:
        launch_sum_partials(partials, None, dbias, None)
    return (dx if want_dx else None), dbias


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t):
    return t if t is None or t.dtype == torch.float64 else t.float()


def _dropout_reference(v: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """keep · v / (1 - p) with the kernels' exact mask (dropout_keep); dropped elements are 0."""
    if v.numel() == 0:
        return v
    keep = dropout_keep_reference(seed, v.numel() // v.shape[-1], v.shape[-1], p, v.device)
    return torch.where(keep.reshape(v.shape), v * dropout_scale(p), torch.zeros_like(v))


def bias_act_reference(x, bias=None, activation="none", dropout_p=0.0, residual=None, seed=None, training=True):
    """Plain differentiable PyTorch, computed in fp32 (fp64 for fp64 inputs); the dropout mask is
    the kernels' own (same seed, same bits), so results agree with dropout on too."""
    p = float(dropout_p) if training else 0.0
    v = _wide(x)
    if bias is not None:
        v = v + _wide(bias)
    v = activation_reference(v, activation)
    if p > 0.0:
        v = _dropout_reference(v, p, draw_seed() if seed is None else seed)
    if residual is not None:
        v = v + _wide(residual)
    return v.to(x.dtype)


def _bias_act_bwd_reference(dy, x, bias, activation, p, seed):
    """(dz, Σ_rows dz) in fp32 (fp64 for fp64 inputs)."""
    g = _wide(dy)
    if activation != "none":
        z = _wide(x) + (_wide(bias) if bias is not None else 0.0)
        g = g * activation_grad_reference(z, activation)
    if p > 0.0:
        g = _dropout_reference(g, p, seed)
    return g, g.reshape(-1, dy.shape[-1]).sum(0)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::bias_act_fwd", mutates_args=())
def _bias_act_fwd_op(x: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                     activation: str, dropout_p: float, seed: int) -> torch.Tensor:
    if use_triton(x):
        return _launch_fwd(x, bias, residual, activation, dropout_p, seed)
    y = bias_act_reference(x, bias, activation, dropout_p, residual, seed)
    return y.clone(memory_format=torch.contiguous_format) if y is x else y.contiguous()  # no alias


@_bias_act_fwd_op.register_fake
def _(x, bias, residual, activation, dropout_p, seed):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@custom_op("tilefuse::bias_act_bwd", mutates_args=())
def _bias_act_bwd_op(dy: torch.Tensor, x: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     activation: str, dropout_p: float, seed: int, n_cols: int,
                     want_dx: bool, want_dbias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias); an unwanted one comes back as an empty tensor (custom ops return tensors)."""
    if use_triton(dy):
        dx, dbias = _launch_bwd(dy, x, bias, activation, dropout_p, seed, want_dx, want_dbias, n_cols)
    else:
        dz, dz_sum = _bias_act_bwd_reference(dy, x, bias, activation, dropout_p, seed)
        dx, dbias = dz.to(dy.dtype).contiguous(), dz_sum.to(_dbias_dtype(dy, bias))
    nothing = dy.new_empty(0)
    return (dx if want_dx else nothing), (dbias if want_dbias else nothing)


@_bias_act_bwd_op.register_fake
def _(dy, x, bias, activation, dropout_p, seed, n_cols, want_dx, want_dbias):
    dx_shape = dy.shape if want_dx else (0,)
    dbias_shape = (n_cols,) if want_dbias else (0,)
    return dy.new_empty(dx_shape), dy.new_empty(dbias_shape, dtype=_dbias_dtype(dy, bias))


def _setup_context(ctx, inputs, output):
    x, bias, residual, activation, dropout_p, seed = inputs
    ctx.activation, ctx.dropout_p, ctx.seed = activation, dropout_p, seed   # the seed, not the mask
    ctx.n_cols = x.shape[-1]
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    # act'(x + b) needs x and b back; without an activation the backward reads neither (the
    # bias still goes back as its gradient's dtype, a tensor of n_cols elements)
    ctx.save_for_backward(x if activation != "none" else None, bias)


def _backward(ctx, dy):
    want_dx, want_dbias, want_dres = ctx.needs_input_grad[:3]
    want_dbias = want_dbias and ctx.has_bias
    x, bias = ctx.saved_tensors
    dx = dbias = None
    if ctx.activation == "none" and ctx.dropout_p == 0.0:
        # y = x + b (+ r): dx is dy itself, db its column sum; no kernel has anything to fuse
        dx = dy if want_dx else None
        if want_dbias:
            dbias = dy.reshape(-1, ctx.n_cols).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    elif want_dx or want_dbias:
        dx, dbias = _bias_act_bwd_op(dy, x, bias, ctx.activation, ctx.dropout_p, ctx.seed,
                                     ctx.n_cols, want_dx, want_dbias)
        dx, dbias = (dx if want_dx else None), (dbias if want_dbias else None)
    return dx, dbias, (dy if want_dres else None), None, None, None


_bias_act_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_dropout(dropout_p, seed, training) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if seed is not None and not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")


def bias_act(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    dropout_p: float = 0.0,
    residual: torch.Tensor | None = None,
    seed: int | None = None,
    training: bool = True,
) -> torch.Tensor:
    """``dropout(act(x + bias), dropout_p) + residual`` in one pass over memory.

    ``activation``: "none", "relu", "gelu" (erf), "gelu_tanh" or "silu". Dropout (only when
    ``training`` and ``dropout_p > 0``) scales kept elements by 1/(1 - p); its mask is a function
    of ``seed`` and the element's position only, so the same seed gives the same mask on any
    device or launch config; ``seed=None`` draws one from torch's CPU generator. ``bias`` is
    ``[x.shape[-1]]``, ``residual`` has x's shape and dtype; the bias may be any float dtype (an
    fp32 parameter beside 16-bit activations, as under ``torch.autocast``; its gradient comes back
    in its dtype). fp32 math; output in x's dtype.
    """
    check_tensor("x", x, min_dim=1)
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (x.shape[-1],), "x's last dimension")
    if residual is not None:
        check_tensor("residual", residual)
        check_shape("residual", residual, x.shape, "x's shape")
    check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, bias=bias, residual=residual)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}")
    _check_dropout(dropout_p, seed, training)
    p = float(dropout_p) if training else 0.0
    if p > 0.0 and seed is None:
        seed = draw_seed()
    return _bias_act_fwd_op(x, bias, residual, activation, p, int(seed) if p > 0.0 else 0)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


_BENCH_ACTIVATION = "gelu"


def _make_inputs(shape, dtype, device):
    # scale 2: pre-activations spread over gelu's curved region, not only its linear tails
    x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_(True)
    bias = torch.randn(shape[-1], device=device).to(dtype).requires_grad_(True)
    return Inputs((x, bias), {"activation": _BENCH_ACTIVATION}, grad_args=(0, 1))


def _bytes(shape, dtype, pass_):
    # fwd: x read + y written + bias read; bwd: x, dy read + dx written + bias read + dbias written
    big, small = tensor_bytes(shape, dtype), tensor_bytes(shape[-1:], dtype)
    return 2 * big + small if pass_ == "fwd" else 3 * big + 2 * small


def _flops(shape, pass_):
    # fwd: z = x + bias, act(z); bwd: z again, act'(z), dy·act'(z), dbias = the column sums of dx
    act_fwd, act_grad = ACTIVATION_FLOPS[_BENCH_ACTIVATION]
    numel, cols = math.prod(shape), shape[-1]
    if pass_ == "fwd":
        return numel * (1 + act_fwd)
    return numel * (2 + act_grad) + max(0, numel - cols)


_TORCH_ACTS = {
    "none": lambda z: z, "relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
}


def _torch_bias_act(x, bias=None, activation="none", dropout_p=0.0, residual=None, seed=None, training=True):
    """Eager PyTorch composition (its own dropout RNG: same statistics, different mask)."""
    v = _TORCH_ACTS[activation](x + bias if bias is not None else x)
    v = torch.nn.functional.dropout(v, dropout_p, training) if dropout_p > 0 else v
    return v + residual if residual is not None else v


register(OpSpec(
    name="bias_act",
    fn=bias_act,
    reference=bias_act_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(1, 1), (3, 781), (2, 3, 1000), (7, 4097), (300, 40), (5, 1), (33, 64)],
    gpu_test_shapes=[(8192, 4096), (4096, 4096 + 3), (65536, 64), (16, 16384 * 3)],
    bench_shapes=[(16384, 4096), (16384, 14336)],
    # no Liger peer: Liger-Kernel has no fused bias + activation (+ dropout) op
    peers={"torch": lambda: _torch_bias_act},
    description="x + bias -> activation -> dropout (+ residual), one pass",
))
