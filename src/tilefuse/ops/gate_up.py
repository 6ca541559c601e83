"""``tilefuse.swiglu_linear``: the SwiGLU / GeGLU front half (gate-up projection + gating) in one GEMM.

    out = act(x @ Wgᵀ) · (x @ Wuᵀ)
        x [..., H] (leading dims flattened to T), w_gate_up [2I, H] packed as a fused
        gate_up_proj stores it (rows 0..I-1 Wg, rows I..2I-1 Wu); out [..., I]
        act in {"silu" (SwiGLU), "gelu", "gelu_tanh" (GeGLU)}; fp32 accumulation
    backward, with g = x @ Wgᵀ, u = x @ Wuᵀ, d = [dg | du] [T, 2I]:
        dg = dy · u · act'(g),   du = dy · act(g)        (glu's backward kernel, packed layout)
        dx = d @ w                [T, 2I] @ [2I, H]
        dw = dᵀ @ x               [2I, T] @ [T, H]        (straight into w's row-major layout)

Forward: one kernel (``_gate_up_kernels.py``); each program accumulates a gate tile and the
matching up tile over the same x tile and writes only act(g)·u: no [T, 2I] product in memory.

Memory of the backward (the choice): when a gradient may be needed the forward also stores
g | u packed, one [T, 2I] tensor in x's dtype (T=8192, I=14336, bf16: 470 MB) -- what eager
PyTorch saves too (its two GEMM outputs). That write costs 2·T·I elements against recomputing
it, a third GEMM of 2·T·H·2I FLOPs (at H=4096, ~0.2 ms of HBM writes vs ~2.8 ms of GEMM on an
H100). Under no_grad / inference nothing is saved. If g | u was not saved (grad enabled only
after the forward) the backward recomputes it with ``tilefuse.matmul``. The backward holds one
more [T, 2I] temporary, d (in x's dtype), the operand of the two backward GEMMs.

Bytes counted (ideal, per pass; the bench's forward is a training one): forward reads x and w,
writes out and the saved g | u: T·H + 2I·H + T·I + 2·T·I elements (without the saved g | u, as
under no_grad, T·H + 2I·H + T·I). Backward reads dy, the saved g | u, x and w and writes dx and
dw: T·I + 2·T·I + 2·T·H + 2·2I·H.
FLOPs: 2·T·H·2I forward, twice that backward (dx and dw).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._autocast import autocast_inputs, autocast_on
from .._checks import check_same_device, check_same_dtype, check_tensor
from .._dispatch import use_triton
from .._op import custom_op, direct_backward
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._activation_math import activation_reference
from ._gate_up_kernels import launch_gate_up
from .glu import _glu_bwd_op
from .matmul import _gemm

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _gate_up_reference_2d(x, w, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, g | u) of 2-D operands in fp32 math (fp64 for fp64 inputs), cast to x's dtype."""
    gu = _wide(x) @ _wide(w).t()
    g, u = gu.chunk(2, dim=-1)
    return (activation_reference(g, activation) * u).to(x.dtype), gu.to(x.dtype)


def swiglu_linear_reference(x, w_gate_up, activation="silu"):
    """Plain PyTorch, differentiable, same signature as :func:`swiglu_linear` (the fp64 reference)."""
    i = w_gate_up.shape[0] // 2
    g = _wide(x) @ _wide(w_gate_up[:i]).t()
    u = _wide(x) @ _wide(w_gate_up[i:]).t()
    return (activation_reference(g, activation) * u).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# custom op + autograd (2-D: the public function flattens x's leading dims)
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::gate_up_fwd", mutates_args=())
def _gate_up_fwd_op(x: torch.Tensor, w: torch.Tensor, activation: str,
                    save_gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, I], g | u [T, 2I] when save_gate_up else an empty tensor)."""
    if use_triton(x):
        out, gate_up = launch_gate_up(x, w, activation, save_gate_up)
    else:
        out, gate_up = _gate_up_reference_2d(x, w, activation)
        out = out.contiguous()
    if not save_gate_up:
        gate_up = x.new_empty(0)
    return out, gate_up.contiguous()


@_gate_up_fwd_op.register_fake
def _(x, w, activation, save_gate_up):
    t, two_i = x.shape[0], w.shape[0]
    return x.new_empty((t, two_i // 2)), x.new_empty((t, two_i) if save_gate_up else (0,))


def _setup_context(ctx, inputs, output):
    x, w, activation, save_gate_up = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, w, output[1] if save_gate_up else None)
    ctx.mark_non_differentiable(output[1])    # a saved intermediate, never a result


def _backward(ctx, dy, _dgate_up):
    """_dgate_up is ignored (g | u is non-differentiable). Eager autograd passes None for it
    (materialize_grads=False), where it would zero-fill a [T, 2I] tensor per backward."""
    x, w, gate_up = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if not (need_dx or need_dw):
        return None, None, None, None
    direct = direct_backward(ctx, dy)       # an eager backward: the GEMMs launch without the op's dispatch
    if gate_up is None:     # not saved (grad enabled after the forward): recompute it
        gate_up = _gemm(x, w.t(), x.dtype, direct)
    d_gate_up, _ = _glu_bwd_op(dy.to(x.dtype), gate_up, None, ctx.activation)    # packed [dg | du]
    dx = _gemm(d_gate_up, w, x.dtype, direct) if need_dx else None
    dw = _gemm(d_gate_up.t(), x, w.dtype, direct) if need_dw else None
    return dx, dw, None, None


_gate_up_fwd_op.register_autograd(_backward, setup_context=_setup_context, materialize_grads=False)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_inputs(x, w_gate_up, activation) -> None:
    """Validate everything before any launch."""
    check_tensor("x", x, min_dim=1)
    check_tensor("w_gate_up", w_gate_up)
    if w_gate_up.dim() != 2:
        raise ValueError(f"w_gate_up must be 2-D [2*I, H], got shape {tuple(w_gate_up.shape)}")
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up must have an even number of rows (gate | up halves, [2*I, H]); "
                         f"got shape {tuple(w_gate_up.shape)}")
    if w_gate_up.shape[1] != x.shape[-1]:
        raise ValueError(f"w_gate_up has H = {w_gate_up.shape[1]} columns but x's last dimension is "
                         f"{x.shape[-1]} (x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)})")
    check_same_dtype(x=x, w_gate_up=w_gate_up)
    check_same_device(x=x, w_gate_up=w_gate_up)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")


def swiglu_linear(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(x @ Wgᵀ) * (x @ Wuᵀ)`` with ``w_gate_up = cat([Wg, Wu])`` ``[2·I, H]``, one fused
    kernel, differentiable in x and w_gate_up.

    x ``[..., H]``; fp16 / bf16 (fp32 computed without TF32); activation "silu" (SwiGLU), "gelu"
    or "gelu_tanh" (GeGLU). Accumulates in fp32; returns ``[..., I]`` in x's dtype (under
    ``torch.autocast`` x and w_gate_up are cast to its dtype first, as ``linear``'s are)."""
    if autocast_on():
        x, w_gate_up = autocast_inputs(x, w_gate_up)
    _check_inputs(x, w_gate_up, activation)
    lead, (two_i, h) = x.shape[:-1], w_gate_up.shape
    x2 = x.reshape(-1, h) if h else x.reshape(lead.numel(), 0)
    save = torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad)
    out, _ = _gate_up_fwd_op(x2, w_gate_up, activation, save)
    return out.view(*lead, two_i // 2)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _make_inputs(shape, dtype, device):
    """x [T, H] and w_gate_up [2I, H] scaled by 2/√H: gate pre-activations ~ N(0, 4), the
    activation's curved region as well as its tails."""
    t, h, i = shape
    x = torch.randn(t, h, device=device).to(dtype).requires_grad_(True)
    w = (torch.randn(2 * i, h, device=device) * (2.0 / max(h, 1) ** 0.5)).to(dtype).requires_grad_(True)
    return Inputs((x, w), {}, grad_args=(0, 1))


def _bytes(shape, dtype, pass_):
    t, h, i = shape
    x, w, out = tensor_bytes((t, h), dtype), tensor_bytes((2 * i, h), dtype), tensor_bytes((t, i), dtype)
    # fwd (training): out and the saved g|u (2 out) written; bwd: dy and that g|u read
    return x + w + 3 * out if pass_ == "fwd" else 3 * out + 2 * x + 2 * w


def _flops(shape, pass_):
    t, h, i = shape
    return (2 if pass_ == "fwd" else 4) * t * h * 2 * i


def _torch_swiglu_linear(x, w_gate_up, activation="silu"):
    """Two cuBLAS GEMMs, then the activation and the product as separate eager kernels."""
    i = w_gate_up.shape[0] // 2
    g, u = x @ w_gate_up[:i].t(), x @ w_gate_up[i:].t()
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")
    return act * u


register(OpSpec(
    name="swiglu_linear",
    fn=swiglu_linear,
    reference=swiglu_linear_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    # (T, H, I): T = 1, odd T / H / I, H = 8 (shorter than a K step), I = 1
    test_shapes=[(1, 16, 8), (37, 45, 29), (5, 8, 3), (64, 64, 32), (3, 33, 1)],
    gpu_test_shapes=[(1, 4096, 14336), (130, 4097, 1000), (2048, 4096, 14336), (16, 4096, 11008)],
    bench_shapes=[(8192, 4096, 14336)],
    peers={"torch": lambda: _torch_swiglu_linear},
    description="act(x @ Wg.T) * (x @ Wu.T) from one packed gate|up weight, one GEMM",
))
