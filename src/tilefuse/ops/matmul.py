"""``tilefuse.matmul``: a persistent tensor-core GEMM with the epilogue fused, forward and backward.

    out = act(a @ b + bias) + residual
        a [..., K] (leading dims flattened to M), b [K, N], bias [N], residual [..., N]
        act in {None, "relu", "gelu", "gelu_tanh", "silu"}; fp32 accumulation
    backward, with z = a @ b + bias (the pre-activation) and dz = dy · act'(z):
        da = dz @ bᵀ,   db = aᵀ @ dz,   dbias = Σ_rows dz,   dresidual = dy

The pre-activation z is *saved* by the forward (one extra [M, N] store in the epilogue, in the
output dtype) when an activation is used and a gradient may be needed; recomputing it would
cost a second forward GEMM in the backward (2·M·N·K FLOPs against M·N bytes). Without an
activation nothing beyond a and b is saved. If z was not saved (grad mode switched on only
after the forward) the backward recomputes it with the same kernel. The two backward GEMMs run
on the forward kernel through transposed views (no copies); when b is a transposed weight view
(``w.t()``, ``nn.Linear``), db is computed as dzᵀ @ a straight into w's row-major layout.

Kernels and launch heuristics: ``_matmul_kernels.py``.

Bytes counted (ideal, per pass): forward reads a, b (and bias, residual) and writes out; the
registry's plain GEMM: (M·K + K·N + M·N) elements. Backward reads dy, a, b and writes da, db:
(M·N + 2·M·K + 2·K·N). FLOPs: 2·M·N·K forward, 4·M·N·K backward.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._autocast import autocast_inputs, autocast_on
from .._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import use_triton
from .._op import CallCache, call_key, custom_op, direct_backward, eager_layout, plain_tensors, records_graph
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._activation_math import ACTIVATIONS, activation_grad_reference, activation_reference
from ._matmul_kernels import launch_act_grad, launch_matmul

# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.float64 else t.float()


def _epilogue_reference(z: torch.Tensor, bias, activation: str, residual) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre-activation, out) in z's (wide) dtype."""
    pre = z if bias is None else z + _wide(bias)
    out = activation_reference(pre, activation)
    return pre, (out if residual is None else out + _wide(residual))


def _matmul_reference_2d(a, b, bias, residual, activation: str, out_dtype: torch.dtype):
    """(out, preact) of 2-D operands, fp32 math (fp64 for fp64 inputs), cast to out_dtype."""
    pre, out = _epilogue_reference(_wide(a) @ _wide(b), bias, activation, residual)
    return out.to(out_dtype), pre.to(out_dtype)


def matmul_reference(a, b, bias=None, activation=None, residual=None, out_dtype=None):
    """Plain PyTorch, differentiable, same signature as :func:`matmul` (the registry's fp64 reference)."""
    _, out = _epilogue_reference(_wide(a) @ _wide(b), bias, activation or "none", residual)
    return out.to(out_dtype or a.dtype)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd (2-D: the public function flattens a's leading dims)
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::matmul_fwd", mutates_args=())
def _matmul_fwd_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
                   residual: Optional[torch.Tensor], activation: str, out_dtype: torch.dtype,
                   save_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, N], preact [M, N] when save_preact else an empty tensor)."""
    if use_triton(a):
        out, pre = launch_matmul(a, b, bias, residual, activation, out_dtype, save_preact)
    else:
        out, pre = _matmul_reference_2d(a, b, bias, residual, activation, out_dtype)
        out = out.contiguous()
    if not save_preact:
        pre = a.new_empty(0, dtype=out_dtype)
    return out, pre.contiguous()


@_matmul_fwd_op.register_fake
def _(a, b, bias, residual, activation, out_dtype, save_preact):
    shape = (a.shape[0], b.shape[1])
    return a.new_empty(shape, dtype=out_dtype), a.new_empty(shape if save_preact else (0,), dtype=out_dtype)


@custom_op("tilefuse::matmul_act_grad", mutates_args=())
def _act_grad_op(dy: torch.Tensor, pre: torch.Tensor, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """dz = dy · act'(pre), [M, N] contiguous, in ``dtype`` (the backward GEMMs' operand dtype)."""
    if use_triton(pre):
        return launch_act_grad(dy, pre, activation, dtype)
    return (_wide(dy) * activation_grad_reference(_wide(pre), activation)).to(dtype).contiguous()


@_act_grad_op.register_fake
def _(dy, pre, activation, dtype):
    return pre.new_empty(pre.shape, dtype=dtype)


def _gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, direct: bool = False) -> torch.Tensor:
    """a @ b through the forward op, no epilogue (the backward GEMMs). ``direct``: an eager
    backward (:func:`direct_backward`) launches the kernel itself, without the op's argument scan,
    guards and empty preact (~10 µs of host time per GEMM on the H200 host)."""
    if direct and use_triton(a):
        return launch_matmul(a, b, None, None, "none", out_dtype, False)[0]
    return _matmul_fwd_op(a, b, None, None, "none", out_dtype, False)[0]


def _setup_context(ctx, inputs, output):
    a, b, bias, residual, activation, out_dtype, save_preact = inputs
    ctx.activation, ctx.out_dtype = activation, out_dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    pre = output[1] if save_preact else None
    ctx.save_for_backward(a, b, bias, pre)
    ctx.mark_non_differentiable(output[1])    # a saved intermediate, never a result


def _backward(ctx, dy, _dpre):
    """_dpre is ignored (preact is non-differentiable). Eager autograd passes None for it
    (materialize_grads=False), where it would zero-fill an [M, N] tensor per backward."""
    a, b, bias, pre = ctx.saved_tensors
    need_da, need_db, need_dbias, need_dres = ctx.needs_input_grad[:4]
    direct = direct_backward(ctx, dy)
    dz = None
    if need_da or need_db or need_dbias:
        if ctx.activation == "none":
            dz = dy.to(a.dtype)
        else:
            if pre is None:     # not saved (grad enabled after the forward): recompute it
                pre = _matmul_fwd_op(a, b, bias, None, "none", ctx.out_dtype, False)[0]
            dz = _act_grad_op(dy, pre, ctx.activation, a.dtype)
    da = _gemm(dz, b.t(), a.dtype, direct) if need_da else None
    db = None
    if need_db:
        # b = wᵀ (unit K stride): dbᵀ = dzᵀ @ a lands in w's row-major layout
        db = (_gemm(dz.t(), a, b.dtype, direct).t() if b.stride(0) == 1 and b.shape[1] > 1
              else _gemm(a.t(), dz, b.dtype, direct))
    # without an activation dz is dy: sum dy itself (dy may be wider than the operand dtype)
    dbias_src = dy if ctx.activation == "none" else dz
    dbias = dbias_src.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if need_dbias else None
    dres = dy.to(ctx.residual_dtype) if need_dres else None
    return da, db, dbias, dres, None, None, None


_matmul_fwd_op.register_autograd(_backward, setup_context=_setup_context, materialize_grads=False)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_inputs(a, b, bias, activation, residual, out_dtype) -> tuple[str, torch.dtype]:
    """Validate everything before any launch; returns (activation name, output dtype)."""
    check_tensor("a", a, min_dim=1)
    check_tensor("b", b)
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D [K, N], got shape {tuple(b.shape)}")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"b has K = {b.shape[0]} rows but a's last dimension is {a.shape[-1]} "
                         f"(a {tuple(a.shape)}, b {tuple(b.shape)})")
    check_same_dtype(a=a, b=b)
    if out_dtype is None:      # a's dtype, or promoted with the residual's (linear(...) + residual)
        wider = isinstance(residual, torch.Tensor) and residual.dtype in FLOAT_DTYPES
        out_dtype = torch.promote_types(a.dtype, residual.dtype) if wider else a.dtype
    elif out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, float16, bfloat16; got {out_dtype}")
    act = "none" if activation is None else activation
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS[1:]}; got {activation!r}")
    n = b.shape[1]
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (n,), "[N], N = b.shape[1]")
        check_same_dtype(a=a, bias=bias)
    if residual is not None:
        check_tensor("residual", residual)
        check_shape("residual", residual, (*a.shape[:-1], n), "a.shape[:-1] + (N,)")
        if residual.dtype != out_dtype:
            raise TypeError(f"residual has dtype {residual.dtype} but the output dtype is {out_dtype}")
    check_same_device(a=a, b=b, bias=bias, residual=residual)
    return act, out_dtype


class _MatmulCall(NamedTuple):
    """A validated eager call layout of :func:`matmul` (the fast path): the launch, or with
    ``graph`` the autograd Function, that the checked path reaches after its checks."""
    act: str
    out_dtype: torch.dtype
    k: int
    n: int
    graph: bool = False         # records a graph: through the op's eager Function
    save_preact: bool = False   # (graph only) the forward saves the pre-activation

    def run(self, a, b, bias, residual):
        flat = a.dim() != 2         # a 2-D a is its own [M, K] (no reshape / view: ~1 µs each)
        a2 = a.reshape(-1, self.k) if flat else a
        res2 = residual.reshape(a2.shape[0], self.n) if flat and residual is not None else residual
        if self.graph:
            out = _matmul_fwd_op.apply_eager(a2, b, bias, res2, self.act, self.out_dtype, self.save_preact)[0]
        else:
            out = launch_matmul(a2, b, bias, res2, self.act, self.out_dtype, False)[0]
        return out.view(*a.shape[:-1], self.n) if flat else out


_FAST = CallCache()       # eager call layout and options -> _MatmulCall


def _fast_key(a, b, bias, activation, residual, out_dtype):
    """The layout key of an eager call (:func:`eager_layout`: with the requires_grad flags when it
    records a graph), the options with their types, the Triton path or not; None: the checked path."""
    return call_key(eager_layout(a, b, bias, residual), (activation, out_dtype))


def _save_preact(act: str, a, b, bias) -> bool:
    """Whether the forward saves the pre-activation: an activation, and a gradient to build."""
    return act != "none" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, bias))


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``act(a @ b + bias) + residual``, one fused kernel, differentiable in a, b, bias, residual.

    a ``[..., K]``, b ``[K, N]`` (any strides: ``w.t()`` of an ``[N, K]`` weight needs no copy),
    same dtype (fp16 / bf16; fp32 computed exactly, without TF32); bias ``[N]`` in a's dtype;
    activation None, "relu", "gelu", "gelu_tanh" or "silu"; residual ``[..., N]`` in the output
    dtype, added after the activation. Accumulates in fp32; returns ``[..., N]`` in ``out_dtype``
    (default a's dtype, promoted with the residual's as ``linear(...) + residual`` would: an fp32
    residual stream beside 16-bit operands stays fp32).

    Under ``torch.autocast`` a, b and bias are cast to the autocast dtype (:mod:`tilefuse._autocast`).

    Host path: a repeated eager call takes the launch (or, recording a graph, the autograd
    Function call) its layout, requires_grad flags and options got the first time, after the
    checks passed then (:func:`_fast_key`)."""
    if autocast_on():
        a, b, bias = autocast_inputs(a, b, bias)
    key = _fast_key(a, b, bias, activation, residual, out_dtype)
    hit = _FAST.get(key)
    if hit is not None:
        return hit.run(a, b, bias, residual)
    out = _checked_matmul(a, b, bias, activation, residual, out_dtype)
    if (key is not None and key[-1] and out.numel() and a.shape[-1] and plain_tensors(a, b, bias, residual)
            and (bias is None or bias.stride(0) == 1)):
        act, out_dtype = _check_inputs(a, b, bias, activation, residual, out_dtype)
        graph = records_graph(key)
        _FAST.put(key, _MatmulCall(act, out_dtype, a.shape[-1], b.shape[1], graph,
                                   graph and _save_preact(act, a, b, bias)))
    return out


def _checked_matmul(a, b, bias, activation, residual, out_dtype):
    act, out_dtype = _check_inputs(a, b, bias, activation, residual, out_dtype)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()        # the kernel reads bias with unit stride
    lead, (k, n) = a.shape[:-1], b.shape
    if a.dim() == 2:                # (as the fast path: its own [M, K], no reshape / view)
        return _matmul_fwd_op(a, b, bias, residual, act, out_dtype, _save_preact(act, a, b, bias))[0]
    a2 = a.reshape(-1, k) if k else a.reshape(lead.numel(), 0)
    res2 = residual.reshape(a2.shape[0], n) if residual is not None else None
    out, _ = _matmul_fwd_op(a2, b, bias, res2, act, out_dtype, _save_preact(act, a, b, bias))
    return out.view(*lead, n)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _make_inputs(shape, dtype, device):
    """a [M, K] and b [K, N]; b is a transposed weight view (w.t(), unit K stride) when N is odd,
    so the registry sweep covers both layouts."""
    m, n, k = shape
    a = torch.randn(m, k, device=device).to(dtype).requires_grad_(True)
    if n % 2:
        b = torch.randn(n, k, device=device).to(dtype).t().detach().requires_grad_(True)
    else:
        b = torch.randn(k, n, device=device).to(dtype).requires_grad_(True)
    return Inputs((a, b), {}, grad_args=(0, 1))


def _bytes(shape, dtype, pass_):
    m, n, k = shape
    a, b, c = tensor_bytes((m, k), dtype), tensor_bytes((k, n), dtype), tensor_bytes((m, n), dtype)
    return a + b + c if pass_ == "fwd" else c + 2 * a + 2 * b


def _flops(shape, pass_):
    m, n, k = shape
    return (2 if pass_ == "fwd" else 4) * m * n * k


def _torch_matmul(a, b, bias=None, activation=None, residual=None, out_dtype=None):
    """cuBLAS GEMM, then the epilogue as separate eager ops."""
    z = torch.matmul(a, b)
    if bias is not None:
        z = z + bias
    z = activation_reference(z, activation or "none") if activation else z
    if residual is not None:
        z = z + residual
    return z.to(out_dtype) if out_dtype is not None else z


_LLAMA_8B_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]

register(OpSpec(
    name="matmul",
    fn=matmul,
    reference=matmul_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    # (M, N, K): M = 1, K = 8, odd M / N / K, b transposed (odd N)
    test_shapes=[(1, 16, 8), (37, 29, 45), (5, 3, 8), (64, 64, 64), (17, 40, 1), (2, 1, 33)],
    gpu_test_shapes=[(1, 4096, 4096), (130, 4097, 1000), (2048, 1024, 8192), (16, 14336, 4096)],
    bench_shapes=[(4096, 4096, 4096), (8192, 8192, 8192)]
    + [(8192, n, k) for n, k in _LLAMA_8B_NK]
    + [(m, n, k) for n, k in _LLAMA_8B_NK for m in (1, 16, 128)],     # decode / small batches
    peers={"torch": lambda: _torch_matmul},
    description="act(a @ b + bias) + residual, persistent tensor-core GEMM",
))
