"""Gated linear units: swiglu and geglu, forward and backward.

    swiglu(gate, up) = silu(gate) · up
    geglu(gate, up)  = gelu(gate) · up            (erf, or the tanh approximation)
    backward:  dgate = dy · up · act'(gate),   dup = dy · act(gate)

Gate and up come either as two tensors ``[..., I]`` or packed in one ``[..., 2·I]`` (first I
columns gate, last I up) as a fused gate-up projection produces; the packed halves are read in
place through their row stride (no split copy) and the packed input's gradient is written
packed, straight from the kernel (no ``cat`` of two halves).

Bytes counted (ideal, per pass), M·I = out.numel(): forward reads gate and up and writes out
(3·M·I elements); backward reads gate, up and dy and writes dgate and dup (5·M·I). The
activation is recomputed in the backward from the saved inputs; nothing else is saved.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import cdiv, empty, empty_like, rows_view, use_triton
from .._launch import PreparedArgs, config_key, fast_launch
from .._op import custom_op
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._activation_math import (
    ACTIVATION_FLOPS, BWD_TILE_ELEMS, FWD_TILE_ELEMS, activation_fwd, activation_fwd_bwd, activation_grad_reference,
    activation_reference, tile_config, tile_rows_cols,
)
from ._common import row_tile_mask_offsets

GELU_APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}   # geglu's approximate= -> activation

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_offsets(rows, cols, n_rows, n_cols, row_stride):
    _, offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, row_stride)
    return offs


@fast_launch
@triton.jit
def glu_fwd_kernel(
    gate_ptr,           # *gate [n_rows, n_cols], unit column stride (a packed input's first half)
    up_ptr,             # *up   [n_rows, n_cols], unit column stride (a packed input's second half)
    y_ptr,              # *out  [n_rows, n_cols], contiguous, gate's dtype
    gate_row_stride,    # elements between rows of gate (2·n_cols when packed)
    up_row_stride,      # elements between rows of up
    y_row_stride,       # elements between rows of out
    n_rows,             # rows (all leading dims flattened)
    n_cols,             # I
    n_col_blocks,       # cdiv(n_cols, BLOCK_N): the grid is row blocks x column blocks
    ACT: tl.constexpr,      # "silu" (swiglu), "gelu" or "gelu_tanh" (geglu)
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # columns per tile (power of two)
):
    rows, _, cols = tile_rows_cols(n_col_blocks, BLOCK_M, BLOCK_N)
    mask, g_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, gate_row_stride)
    g = tl.load(gate_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + _tile_offsets(rows, cols, n_rows, n_cols, up_row_stride), mask=mask, other=0.0)
    y = activation_fwd(g, ACT, y_ptr.dtype.element_ty == tl.float32) * u.to(tl.float32)
    tl.store(y_ptr + _tile_offsets(rows, cols, n_rows, n_cols, y_row_stride), y.to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def glu_bwd_kernel(
    dy_ptr,             # *grad of out [n_rows, n_cols], unit column stride
    gate_ptr,           # *saved gate  [n_rows, n_cols]
    up_ptr,             # *saved up    [n_rows, n_cols]
    dgate_ptr,          # *grad of gate [n_rows, n_cols] (a packed grad's first half)
    dup_ptr,            # *grad of up   [n_rows, n_cols] (a packed grad's second half)
    dy_row_stride,      # elements between rows of dy
    gate_row_stride,    # elements between rows of gate
    up_row_stride,      # elements between rows of up
    dgate_row_stride,   # elements between rows of dgate
    dup_row_stride,     # elements between rows of dup
    n_rows,             # rows
    n_cols,             # I
    n_col_blocks,       # cdiv(n_cols, BLOCK_N)
    ACT: tl.constexpr,      # the forward's activation
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, _, cols = tile_rows_cols(n_col_blocks, BLOCK_M, BLOCK_N)
    mask, g_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, gate_row_stride)
    g = tl.load(gate_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + _tile_offsets(rows, cols, n_rows, n_cols, up_row_stride), mask=mask, other=0.0)
    dy = tl.load(dy_ptr + _tile_offsets(rows, cols, n_rows, n_cols, dy_row_stride), mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    act, dact = activation_fwd_bwd(g, ACT, gate_ptr.dtype.element_ty == tl.float32)
    dgate = dy * u.to(tl.float32) * dact
    tl.store(dgate_ptr + _tile_offsets(rows, cols, n_rows, n_cols, dgate_row_stride),
             dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + _tile_offsets(rows, cols, n_rows, n_cols, dup_row_stride),
             (dy * act).to(dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers (inputs already validated by the public function)
# ----------------------------------------------------------------------------------------------


def _halves(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views: the two tensors, or a packed [..., 2·I] tensor's two halves."""
    if up is not None:
        return gate, up
    i = gate.shape[-1] // 2
    return gate[..., :i], gate[..., i:]


class _Plan(NamedTuple):
    grid: tuple
    prepared: PreparedArgs     # the kernel's integers and constexprs


@functools.lru_cache(maxsize=1024)
def _fwd_plan(n_rows: int, n_cols: int, gate_stride: int, up_stride: int, activation: str,
              config: tuple = ()) -> _Plan:
    """The forward's launch, cached per shape (host time: a small glu's kernel takes a few µs)."""
    cfg = tile_config(n_rows, n_cols, FWD_TILE_ELEMS, dict(config))
    n_col_blocks = cdiv(n_cols, cfg["BLOCK_N"])
    prepared = glu_fwd_kernel.prepare(   # out is contiguous [n_rows, n_cols]: row stride n_cols
        (gate_stride, up_stride, n_cols, n_rows, n_cols, n_col_blocks),
        dict(ACT=activation, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"]))
    return _Plan((cdiv(n_rows, cfg["BLOCK_M"]) * n_col_blocks,), prepared)


@functools.lru_cache(maxsize=1024)
def _bwd_plan(n_rows: int, n_cols: int, strides: tuple, activation: str, config: tuple = ()) -> _Plan:
    """The backward's launch, cached; ``strides``: the row strides of dy, gate, up, dgate, dup."""
    cfg = tile_config(n_rows, n_cols, BWD_TILE_ELEMS, dict(config))
    n_col_blocks = cdiv(n_cols, cfg["BLOCK_N"])
    prepared = glu_bwd_kernel.prepare(
        (*strides, n_rows, n_cols, n_col_blocks),
        dict(ACT=activation, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"]))
    return _Plan((cdiv(n_rows, cfg["BLOCK_M"]) * n_col_blocks,), prepared)


def _launch_fwd(gate, up, activation: str, config: dict | None = None) -> torch.Tensor:
    """``up`` None: ``gate`` is packed. ``config`` keys: BLOCK_M, BLOCK_N, num_warps."""
    g, u = _halves(gate, up)
    if g.numel() == 0:
        return empty(g.shape, gate.dtype, gate.device)
    g2, u2 = rows_view(g), rows_view(u)
    n_rows, n_cols = g2.shape
    y = empty_like(g)        # contiguous [..., I]: row stride n_cols (empty_like: the cheapest allocation)
    plan = _fwd_plan(n_rows, n_cols, g2.stride(0), u2.stride(0), activation, config_key(config))
    glu_fwd_kernel.launch_prepared(plan.grid, (g2, u2, y), plan.prepared)
    return y


def _launch_bwd(dy, gate, up, activation: str, config: dict | None = None):
    """(dgate, dup), or (dpacked, None) when ``up`` is None. ``config`` as _launch_fwd."""
    g, u = _halves(gate, up)
    dgrad = empty_like(gate)                                      # dgate, or the packed grad; contiguous
    dup = empty_like(up) if up is not None else None
    if g.numel() == 0:
        return dgrad, dup
    dg, du = _halves(dgrad, dup)
    dy2, g2, u2, dg2, du2 = rows_view(dy), rows_view(g), rows_view(u), rows_view(dg), rows_view(du)  # dg2, du2: views
    n_rows, n_cols = g2.shape
    strides = (dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0))
    plan = _bwd_plan(n_rows, n_cols, strides, activation, config_key(config))
    glu_bwd_kernel.launch_prepared(plan.grid, (dy2, g2, u2, dg2, du2), plan.prepared)
    return dgrad, dup


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _glu_reference(gate, up, activation: str) -> torch.Tensor:
    g, u = _halves(gate, up)
    return (activation_reference(_wide(g), activation) * _wide(u)).to(gate.dtype)


def swiglu_reference(gate, up=None):
    return _glu_reference(gate, up, "silu")


def geglu_reference(gate, up=None, approximate="none"):
    return _glu_reference(gate, up, GELU_APPROXIMATIONS[approximate])


def _glu_bwd_reference(dy, gate, up, activation):
    """(dgate, dup), or (dpacked, None), in gate's dtype; fp32 math (fp64 for fp64 inputs)."""
    g, u = (_wide(t) for t in _halves(gate, up))
    dyw = _wide(dy)
    dgate = dyw * u * activation_grad_reference(g, activation)
    dup = dyw * activation_reference(g, activation)
    if up is None:
        return torch.cat([dgate, dup], dim=-1).to(gate.dtype), None
    return dgate.to(gate.dtype), dup.to(up.dtype)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::glu_fwd", mutates_args=())
def _glu_fwd_op(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    if use_triton(gate):
        return _launch_fwd(gate, up, activation)
    return _glu_reference(gate, up, activation).contiguous()


@_glu_fwd_op.register_fake
def _(gate, up, activation):
    g, _ = _halves(gate, up)
    return torch.empty(g.shape, dtype=gate.dtype, device=gate.device)


@custom_op("tilefuse::glu_bwd", mutates_args=())
def _glu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor],
                activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), or (dpacked, empty) for a packed input (custom ops return tensors only)."""
    if use_triton(gate):
        dgrad, dup = _launch_bwd(dy, gate, up, activation)
    else:
        dgrad, dup = _glu_bwd_reference(dy, gate, up, activation)
    return dgrad.contiguous(), (dup.contiguous() if dup is not None else gate.new_empty(0))


@_glu_bwd_op.register_fake
def _(dy, gate, up, activation):
    return gate.new_empty(gate.shape), (up.new_empty(up.shape) if up is not None else gate.new_empty(0))


def _setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.activation = activation
    ctx.packed = up is None
    ctx.save_for_backward(gate, up)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgrad, dup = _glu_bwd_op(dy, gate, up, ctx.activation)
    return dgrad, (None if ctx.packed else dup), None


_glu_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _glu(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    check_tensor("gate", gate, min_dim=1)
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"gate: with up=None, gate is a packed [..., 2*I] gate|up tensor and needs an even "
                f"last dimension; got shape {tuple(gate.shape)}"
            )
    else:
        check_tensor("up", up)
        check_shape("up", up, gate.shape, "gate's shape")
        check_same_dtype(gate=gate, up=up)
        check_same_device(gate=gate, up=up)
    return _glu_fwd_op(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``up=None``, ``gate`` is packed ``[..., 2·I]`` (gate | up halves).
    fp32 math; output ``[..., I]`` in gate's dtype."""
    return _glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up``; packing as in :func:`swiglu`. ``approximate``: "none"
    (erf) or "tanh", as ``torch.nn.functional.gelu``."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh'; got {approximate!r}")
    return _glu(gate, up, GELU_APPROXIMATIONS[approximate])


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _make_inputs_with(kwargs):
    def make(shape, dtype, device):
        # scale 2 on the gate: the activation's curved region, not only its linear tails
        gate = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_(True)
        up = torch.randn(shape, device=device).to(dtype).requires_grad_(True)
        return Inputs((gate, up), dict(kwargs), grad_args=(0, 1))
    return make


def _bytes(shape, dtype, pass_):
    # shape = gate's = up's = out's. fwd: gate, up read + out written; bwd: + dy read, dgate, dup written
    return tensor_bytes(shape, dtype) * (3 if pass_ == "fwd" else 5)


def _flops_of(activation: str):
    """fwd: act(g)·u; bwd: dg = dy·u·act'(g), du = dy·act(g) (the references' formulas)."""
    act_fwd, act_grad = ACTIVATION_FLOPS[activation]

    def flops(shape, pass_):
        numel = math.prod(shape)
        return numel * ((act_fwd + 1) if pass_ == "fwd" else (act_grad + 2 + act_fwd + 1))
    return flops


def _torch_swiglu(gate, up=None):
    g, u = _halves(gate, up)
    return F.silu(g) * u


def _torch_geglu(gate, up=None, approximate="none"):
    g, u = _halves(gate, up)
    return F.gelu(g, approximate=approximate) * u


def _liger_function(module: str, name: str):
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), name)
    except Exception:
        return None


def _liger_swiglu():
    """Liger-Kernel's LigerSiLUMulFunction with swiglu's signature, or None."""
    fn = _liger_function("swiglu", "LigerSiLUMulFunction")
    return None if fn is None else (lambda gate, up=None: fn.apply(*_halves(gate, up)))


def _liger_geglu():
    """Liger-Kernel's LigerGELUMulFunction (tanh GELU only) with geglu's signature, or None."""
    fn = _liger_function("geglu", "LigerGELUMulFunction")
    if fn is None:
        return None

    def run(gate, up=None, approximate="none"):
        if approximate != "tanh":
            raise NotImplementedError("Liger's GEGLU has the tanh approximation only")
        return fn.apply(*_halves(gate, up))
    return run


_TEST_SHAPES = [(1, 1), (3, 781), (2, 3, 1000), (7, 2049), (300, 40), (5, 1), (33, 64)]
_GPU_TEST_SHAPES = [(8192, 11008), (4096, 4096 + 3), (65536, 64), (3, 2, 14336)]
_BENCH_SHAPES = [(16384, 14336), (8192, 11008)]   # (tokens, intermediate size): gate, up each [T, I]

register(OpSpec(
    name="swiglu",
    fn=swiglu,
    reference=swiglu_reference,
    make_inputs=_make_inputs_with({}),
    bytes_fn=_bytes,
    flops_fn=_flops_of("silu"),
    test_shapes=_TEST_SHAPES,
    gpu_test_shapes=_GPU_TEST_SHAPES,
    bench_shapes=_BENCH_SHAPES,
    peers={"torch": lambda: _torch_swiglu, "liger": _liger_swiglu},
    description="silu(gate) * up",
))

register(OpSpec(
    name="geglu",
    fn=geglu,
    reference=geglu_reference,
    # tanh: the GEGLU of Gemma, and the only one Liger has (erf is covered by tests/test_glu.py)
    make_inputs=_make_inputs_with({"approximate": "tanh"}),
    bytes_fn=_bytes,
    flops_fn=_flops_of("gelu_tanh"),
    test_shapes=_TEST_SHAPES,
    gpu_test_shapes=_GPU_TEST_SHAPES,
    bench_shapes=_BENCH_SHAPES,
    peers={"torch": lambda: _torch_geglu, "liger": _liger_geglu},
    description="gelu(gate, approximate) * up",
))
