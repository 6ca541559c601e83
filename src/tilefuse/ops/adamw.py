"""AdamW / Adam step over many tensors, in place: the functional, its reference, the custom op
and the registry spec. The kernels, the math and the bytes counted are in ``_adam_kernels``.

Public: :func:`adamw_step` / :func:`adam_step` (lists of params, grads and state; one
multi-tensor launch per call), used by :mod:`tilefuse.optim`. CPU tensors without
``TRITON_INTERPRET=1`` take :func:`adam_reference`, torch's single-tensor loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_tensor
from .._dispatch import use_triton
from .._op import custom_op
from ..registry import Inputs, OpSpec, register
from ._adam_kernels import launch

# ----------------------------------------------------------------------------------------------
# reference (fp32 or wider; also the CPU path): torch's single-tensor loop, same order of ops
# ----------------------------------------------------------------------------------------------


def adam_reference(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=1e-3, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False, *,
                   max_exp_avg_sqs=None, master_params=None, decoupled_weight_decay=True):
    """Same contract as :func:`adamw_step`, one tensor at a time in plain PyTorch (fp64 inputs
    are computed in fp64, everything else in fp32). Reads steps and a tensor lr on the host."""
    lr = float(lr)
    state_steps.add_(1)
    steps = state_steps.tolist()
    masters = list(master_params) if master_params else None
    vmaxes = list(max_exp_avg_sqs) if max_exp_avg_sqs else None
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        wide = torch.float64 if param.dtype == torch.float64 else torch.float32
        p = (masters[i] if masters else param).to(wide, copy=True)
        g = grad.to(wide, copy=True)
        m, v = exp_avg.to(wide, copy=True), exp_avg_sq.to(wide, copy=True)
        if maximize:
            g = -g
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** steps[i]
        bias_correction2_sqrt = (1 - beta2 ** steps[i]) ** 0.5
        v_hat = v
        if vmaxes:
            v_hat = torch.maximum(vmaxes[i].to(wide), v)
            vmaxes[i].copy_(v_hat)
        denom = (v_hat.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        if masters:
            masters[i].copy_(p)
        param.copy_(p)
    return params, exp_avgs, exp_avg_sqs


# ----------------------------------------------------------------------------------------------
# custom op (opaque to torch.compile; mutates its tensor lists in place)
# ----------------------------------------------------------------------------------------------


def _step_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
               lr, beta1, beta2, eps, weight_decay, maximize, decoupled, config=None):
    """The Triton kernels, or the reference on CPU without the interpreter; inputs validated."""
    if not params:
        return
    if use_triton(params[0]):
        launch(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
               lr, beta1, beta2, eps, weight_decay, maximize, decoupled, config)
    else:
        adam_reference(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2, eps,
                       weight_decay, maximize, max_exp_avg_sqs=max_exp_avg_sqs,
                       master_params=master_params, decoupled_weight_decay=decoupled)


@custom_op(
    "tilefuse::adam_step",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params",
                  "state_steps"),
)
def _adam_step_op(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor],
    master_params: list[torch.Tensor], state_steps: torch.Tensor, lr: float,
    lr_tensor: Optional[torch.Tensor], beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, decoupled: bool,
) -> None:
    _step_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
               lr if lr_tensor is None else lr_tensor, beta1, beta2, eps, weight_decay, maximize,
               decoupled)


@_adam_step_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps, lr,
      lr_tensor, beta1, beta2, eps, weight_decay, maximize, decoupled):
    return None


def run_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
             lr, beta1, beta2, eps, weight_decay, maximize, decoupled, config=None):
    """Validated lists in, one step done (tilefuse.optim calls this): the direct path in eager
    mode (no dispatcher overhead on long lists), the custom op while torch.compile traces."""
    if config is None and torch.compiler.is_compiling():
        lr_tensor = lr if isinstance(lr, torch.Tensor) else None
        _adam_step_op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [],
                      master_params or [], state_steps, 0.0 if lr_tensor is not None else float(lr),
                      lr_tensor, beta1, beta2, eps, weight_decay, maximize, decoupled)
    else:
        _step_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
                   lr, beta1, beta2, eps, weight_decay, maximize, decoupled, config)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _as_list(name: str, seq) -> list:
    if isinstance(seq, torch.Tensor):
        if seq.dim() == 0:
            raise ValueError(f"{name} must be a sequence of tensors, or a tensor whose rows are "
                             f"the tensors; got a 0-d tensor")
        return list(seq)
    if not isinstance(seq, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    return list(seq)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (contiguous up to a permutation): one flat block of numel
    elements starting at data_ptr, so the kernel can walk it as a 1-D array."""
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1:
            if t.stride(d) != expected:
                return False
            expected *= t.shape[d]
    return True


def _check_like(name: str, t, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """``t`` is a dense tensor of ``dtype`` with ref's shape, strides and device (one flat
    memory walk updates both)."""
    check_tensor(name, t, (dtype,))
    _check_not_negative_view(name, t)
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but the params are on {ref.device}")
    if t.shape != ref.shape or (t.numel() > 1 and t.stride() != ref.stride()):
        raise ValueError(f"{name} has shape {tuple(t.shape)} / strides {t.stride()}; its param has "
                         f"{tuple(ref.shape)} / {ref.stride()}")


def _check_not_negative_view(name: str, t: torch.Tensor) -> None:
    """The step reads and writes each tensor's storage: one with the negative bit set keeps its
    values negated there (s45 audit: a param updated as if its sign were flipped)."""
    if not torch.compiler.is_compiling() and t.is_neg():     # (traced: functionalization resolves it)
        raise TypeError(f"{name} is a negative view (torch._neg_view, z.conj().imag: its values are "
                        f"stored negated); pass t.resolve_neg()")


def _check_hyperparameters(lr, beta1, beta2, eps, weight_decay, device) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"lr as a tensor must be one floating-point element, got shape "
                             f"{tuple(lr.shape)} {lr.dtype}")
        if lr.device != device:
            raise ValueError(f"lr is a tensor on {lr.device} but the params are on {device}")
        _check_not_negative_view("lr", lr)
    elif not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def check_step_inputs(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2, eps,
                      weight_decay, max_exp_avg_sqs=None, master_params=None):
    """Validate everything a step touches before any launch; returns the inputs as lists."""
    given = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
             "max_exp_avg_sqs": max_exp_avg_sqs, "master_params": master_params}
    lists = {name: _as_list(name, seq) for name, seq in given.items() if seq is not None}
    n = len(lists["params"])
    for name, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} tensors but params has {n}")
    if n == 0:
        return lists
    p0 = check_tensor("params[0]", lists["params"][0], FLOAT_DTYPES)
    state_dtype = check_tensor("exp_avgs[0]", lists["exp_avgs"][0], FLOAT_DTYPES).dtype
    if state_dtype not in (p0.dtype, torch.float32):
        raise TypeError(f"exp_avgs have dtype {state_dtype}; they must be float32 or the params' "
                        f"dtype {p0.dtype}")
    for i, p in enumerate(lists["params"]):
        check_tensor(f"params[{i}]", p, FLOAT_DTYPES)
        _check_not_negative_view(f"params[{i}]", p)
        if p.dtype != p0.dtype or p.device != p0.device:
            raise TypeError(f"params[{i}] is {p.dtype} on {p.device} but params[0] is {p0.dtype} "
                            f"on {p0.device}; one step takes one dtype and device (group them)")
        if p.layout != torch.strided or not _dense(p):
            raise ValueError(f"params[{i}] must be dense and non-overlapping (strides {p.stride()})")
        if isinstance(lists["grads"][i], torch.Tensor) and lists["grads"][i].is_sparse:
            raise ValueError(f"grads[{i}] is sparse; Adam needs dense gradients")
        _check_like(f"grads[{i}]", lists["grads"][i], p, p.dtype)
        for name in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            if name in lists:
                _check_like(f"{name}[{i}]", lists[name][i], p, state_dtype)
        if "master_params" in lists:
            _check_like(f"master_params[{i}]", lists["master_params"][i], p, torch.float32)
    check_tensor("state_steps", state_steps, (torch.float32,))
    _check_not_negative_view("state_steps", state_steps)
    if state_steps.dim() != 1 or state_steps.shape[0] != n or not state_steps.is_contiguous():
        raise ValueError(f"state_steps must be a contiguous 1-D tensor with one step per param "
                         f"({n}), got shape {tuple(state_steps.shape)}")
    if state_steps.device != p0.device:
        raise ValueError(f"state_steps is on {state_steps.device} but the params are on {p0.device}")
    _check_hyperparameters(lr, beta1, beta2, eps, weight_decay, p0.device)
    return lists


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=1e-3, beta1=0.9, beta2=0.999,
               eps=1e-8, weight_decay=1e-2, maximize=False, *, max_exp_avg_sqs=None,
               master_params=None, decoupled_weight_decay=True, config=None):
    """One AdamW step on lists of tensors, in place, in one multi-tensor launch (plus a tiny
    per-tensor prep launch that increments ``state_steps``).

    ``params, grads, exp_avgs, exp_avg_sqs`` (and ``max_exp_avg_sqs`` for amsgrad,
    ``master_params`` for fp32 master weights) are equal-length sequences of tensors -- or
    tensors whose rows are the tensors. All params share one dtype (fp32/fp16/bf16) and device;
    the state is in the params' dtype, or fp32. With ``master_params`` the update is applied to
    the fp32 masters and the params receive the rounded result, in the same pass.
    ``state_steps`` is a float32 1-D tensor with each param's step count, incremented on the
    device first (as torch's functional adamw does); ``lr`` may be a one-element device tensor
    (read on the device, so the step can be captured in a CUDA graph).
    Returns ``(params, exp_avgs, exp_avg_sqs)``, the arguments themselves, updated.
    ``config`` (``BLOCK``, ``CHUNK``, ``num_warps``) overrides the launch heuristics.
    """
    lists = check_step_inputs(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2,
                              eps, weight_decay, max_exp_avg_sqs, master_params)
    run_step(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
             lists.get("max_exp_avg_sqs"), lists.get("master_params"), state_steps,
             lr, float(beta1), float(beta2), float(eps), float(weight_decay), bool(maximize),
             bool(decoupled_weight_decay), config)
    return params, exp_avgs, exp_avg_sqs


def adam_step(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=1e-3, beta1=0.9, beta2=0.999,
              eps=1e-8, weight_decay=0.0, maximize=False, *, max_exp_avg_sqs=None,
              master_params=None, config=None):
    """:func:`adamw_step` with torch.optim.Adam's L2 weight decay (``g += wd·p``)."""
    return adamw_step(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2, eps,
                      weight_decay, maximize, max_exp_avg_sqs=max_exp_avg_sqs,
                      master_params=master_params, decoupled_weight_decay=False, config=config)


def adamw_reference(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=1e-3, beta1=0.9,
                    beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False):
    """The spec's reference: :func:`adam_reference` with decoupled weight decay."""
    return adam_reference(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2, eps,
                          weight_decay, maximize, decoupled_weight_decay=True)


# ----------------------------------------------------------------------------------------------
# registry: shape = (n_tensors, numel_per_tensor); the tensors are the rows of 2-D tensors, so
# the harness's fp64 copies are separate tensors the reference updates on its own
# ----------------------------------------------------------------------------------------------

_HYPERPARAMETERS = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False)


def _make_inputs(shape, dtype, device):
    n, numel = shape
    params = torch.randn(n, numel, device=device).to(dtype)
    grads = torch.randn(n, numel, device=device).to(dtype)
    exp_avgs = (0.1 * torch.randn(n, numel, device=device)).to(dtype)
    exp_avg_sqs = (0.01 * torch.rand(n, numel, device=device) + 1e-3).to(dtype)
    # different steps per tensor: the bias corrections are per tensor
    state_steps = torch.randint(0, 20, (n,), device=device).to(torch.float32)
    return Inputs((params, grads, exp_avgs, exp_avg_sqs, state_steps), dict(_HYPERPARAMETERS))


def _bytes(shape, dtype, pass_):
    n, numel = shape
    elem = torch.empty((), dtype=dtype).element_size()
    # param r+w, grad r, exp_avg r+w, exp_avg_sq r+w per element; the fp32 step r+w per tensor
    return 7 * elem * n * numel + 8 * n


def _flops(shape, pass_):
    # per element, as torch's AdamW writes it: p·(1 - lr·wd) (1), m.lerp_(g, 1 - b1) (3),
    # v·b2 + (1 - b2)·g·g (4), sqrt(v) / sqrt(bc2) + eps (3), p - step·m / denom (3)
    n, numel = shape
    return 14 * n * numel


def _peer_lists(params, grads, exp_avgs, exp_avg_sqs, state_steps):
    return list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(state_steps.unbind(0))


def _torch_fused_adamw():
    """torch.optim.AdamW(fused=True)'s kernel: torch._fused_adamw_ (steps incremented first)."""
    if not hasattr(torch, "_fused_adamw_"):
        return None

    def step(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=1e-3, beta1=0.9, beta2=0.999,
             eps=1e-8, weight_decay=1e-2, maximize=False):
        ps, gs, ms, vs, steps = _peer_lists(params, grads, exp_avgs, exp_avg_sqs, state_steps)
        state_steps.add_(1)
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize,
                            grad_scale=None, found_inf=None)
        return params, exp_avgs, exp_avg_sqs

    return step


def _torch_foreach_adamw():
    """torch.optim.AdamW(foreach=True, capturable=True)'s math: device steps, no host sync; the
    bench's torch.compile of this peer is inductor's fused optimizer kernel."""

    def step(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=1e-3, beta1=0.9, beta2=0.999,
             eps=1e-8, weight_decay=1e-2, maximize=False):
        from torch.optim.adam import adam

        ps, gs, ms, vs, steps = _peer_lists(params, grads, exp_avgs, exp_avg_sqs, state_steps)
        adam(ps, gs, ms, vs, [], steps, foreach=True, capturable=state_steps.is_cuda,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
             weight_decay=weight_decay, eps=eps, maximize=maximize)
        return params, exp_avgs, exp_avg_sqs

    return step


register(OpSpec(
    name="adamw",
    fn=adamw_step,
    reference=adamw_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(1, 1), (3, 1000), (5, 4097), (2, 20000)],
    gpu_test_shapes=[(64, 65536 + 3), (7, 1_000_003), (300, 1024)],
    bench_shapes=[(64, 4194304)],
    peers={"torch": _torch_foreach_adamw, "torch_fused": _torch_fused_adamw},
    has_backward=False,
    description="AdamW step over many tensors (one multi-tensor launch)",
))
