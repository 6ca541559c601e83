"""What cross_entropy and linear_cross_entropy share: the fp32-or-wider references (also the CPU
path), the row kernels' dispatch, the target range test, the loss reduction, the backward's
scaling of gradients a forward computed, and the option checks. The math is in
ops/cross_entropy.py's docstring; the kernels are in ops/_cross_entropy_kernels.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .._autocast import autocast_dtype
from .._checks import check_same_device, check_shape, check_tensor
from .._dispatch import use_triton
from .._op import custom_op
from ._cross_entropy_kernels import (
    TARGET_SCAN_MAX,
    CEOptions,
    launch_cross_entropy_bwd,
    launch_cross_entropy_rows,
    launch_scale_rows,
    launch_target_scan,
)

REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def torch_cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction):
    """The op as a composition of torch ops, in logits' dtype (autograd gives the gradient)."""
    x = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    x2 = x.reshape(-1, x.shape[-1] if x.dim() else 1)
    t = target.reshape(-1).long()
    valid = t != ignore_index
    rows = F.cross_entropy(x2, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    if z_loss:
        rows = rows + z_loss * torch.where(valid, torch.logsumexp(x2, -1) ** 2, 0.0)
    if reduction == "none":
        return rows.reshape(target.shape)
    total = rows.sum()
    return total if reduction == "sum" else total / valid.sum().clamp(min=1)


def softcap_reference(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """c·tanh(x/c) whose autograd slope stays accurate where tanh saturates: torch.tanh's backward
    1 - tanh^2 cancels there (even in fp64, past |x/c| ~ 15), while sign·(1 - e)/(1 + e) with
    e = exp(-2|x/c|) differentiates to 4e/(1 + e)^2. torch.tanh below |x/c| = 1/2, where 1 - e
    would cancel instead."""
    y = x / softcap
    e = torch.exp(-2 * y.abs())
    tail = torch.sign(y) * (1 - e) / (1 + e)
    return softcap * torch.where(y.abs() < 0.5, torch.tanh(y), tail)


def reference_cross_entropy(x, target, ignore_index, label_smoothing, z_loss, reduction):
    """torch_cross_entropy (no soft cap) as a reference whose autograd gradient is accurate for
    confident rows too: -log p_t = logsumexp_j (x_j - x_t) with the target's own term a constant 0,
    so the target's gradient is -sum_{j != t} p_j. F.cross_entropy's backward forms p_t - 1 there,
    which cancels to the ulp of 1 even in fp64 (a 0.6 % error at 1 - p_t = 1e-14: logits
    [-15.3, 16.9], seen on a GPU run where the kernel, which sums q over the other classes, was right)."""
    x2 = x.reshape(-1, x.shape[-1] if x.dim() else 1)
    t = target.reshape(-1).long()
    valid = t != ignore_index
    t_safe = torch.where(valid, t, 0)
    onehot = torch.arange(x2.shape[-1], device=x2.device) == t_safe[:, None]
    x_t = x2.gather(1, t_safe[:, None])
    rows = torch.logsumexp(torch.where(onehot, 0.0, x2 - x_t), -1)
    lse = torch.logsumexp(x2, -1)
    if label_smoothing:   # torch's eps·(lse - mean_j x_j), only when on (a -inf logit would give 0·inf)
        rows = (1 - label_smoothing) * rows + label_smoothing * (lse - x2.mean(-1))
    if z_loss:
        rows = rows + z_loss * lse ** 2
    rows = torch.where(valid, rows, 0.0)
    if reduction == "none":
        return rows.reshape(target.shape)
    total = rows.sum()
    return total if reduction == "sum" else total / valid.sum().clamp(min=1)


def _cross_entropy_rows_torch(logits, target, row_scale, loss_rows, grad, opts: CEOptions, stats=None):
    """The kernel's contract (see launch_cross_entropy_rows) in closed form, in fp32: CPU path.
    Same numerics as the kernel: -log p_t from q = 1 - p_t where p_t > 1/2, q summed over the
    other classes. (The CPU path's deferred backward recomputes from the logits; ``stats`` gets
    the kernel's (m, log2 s, q) all the same.)"""
    x = _wide(logits)
    if opts.softcap is not None:
        x = opts.softcap * torch.tanh(x / opts.softcap)
    n_cols = x.shape[-1]
    t = target.long()
    valid = t != opts.ignore_index
    onehot = torch.arange(n_cols, device=x.device) == t[:, None]   # all False for an out-of-range t
    logp = torch.log_softmax(x, -1)   # subtracts the max first, never x - lse
    p = logp.exp()
    q = torch.where(onehot, 0.0, p).sum(-1)
    nll = torch.where(q <= 0.5, -torch.log1p(-q), -torch.where(onehot, logp, 0.0).sum(-1))
    loss = torch.where(onehot.any(-1), nll, float("nan"))
    eps = opts.label_smoothing
    if eps:   # terms only when on, as in the kernel (0 * a -inf logit would be NaN)
        loss = (1 - eps) * loss - eps * logp.mean(-1)
    lse = torch.logsumexp(x, -1)
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    loss_rows.copy_(torch.where(valid, loss, 0.0))
    if stats is not None:
        m = x.amax(-1)
        stats.copy_(torch.stack([m, (lse - m) / math.log(2), q]))
    if grad is None:
        return
    uniform = eps / max(n_cols, 1)
    g = torch.where(onehot, (eps - q - uniform)[:, None], p - uniform)
    if opts.z_loss:
        g = g + p * (2 * opts.z_loss * lse)[:, None]
    if opts.softcap is not None:   # 1 - tanh^2 = 4e/(1 + e)^2, e = exp(-2|x|/c): no cancellation
        e = torch.exp(-2 * _wide(logits).abs() / opts.softcap)
        g = g * (4 * e / (1 + e) ** 2)
    g = g * torch.where(valid, row_scale.to(g.dtype), 0.0)[:, None]
    grad.copy_(g)


def cross_entropy_rows(logits, target, row_scale, loss_rows, grad, opts: CEOptions, config=None, stats=None,
                       skip_if=None):
    """Kernel on CUDA (and under the interpreter), closed-form torch otherwise. Shared with
    linear_cross_entropy, which calls it on each chunk of logits. ``skip_if``: a device flag (0-d
    bool) that, when set, makes the kernel write nothing (a failed target check: see TargetCheck)."""
    if use_triton(logits):
        launch_cross_entropy_rows(logits, target, row_scale, loss_rows, grad, opts, config, stats, skip_if)
    else:
        _cross_entropy_rows_torch(logits, target, row_scale, loss_rows, grad, opts, stats)


def cross_entropy_grad_rows(logits, target, stats, row_scale, grad, opts: CEOptions, config=None):
    """The deferred backward: grad = row_scale · dloss/dlogits (grad may be logits itself)."""
    if use_triton(logits):
        launch_cross_entropy_bwd(logits, target, stats, row_scale, grad, opts, config)
    else:
        loss_rows = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        _cross_entropy_rows_torch(logits, target, row_scale, loss_rows, grad, opts)


def check_targets_in_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """One host sync: every target is ignore_index or in [0, n_classes)."""
    bad = _bad_targets(target, n_classes, ignore_index)
    if target.numel() and bool(bad.any()):
        _raise_bad_target(target, bad, n_classes, ignore_index)


class TargetCheck:
    """:func:`check_targets_in_range` in two halves, so that the GPU need not drain: the test is
    queued at construction and its result copied to pinned host memory behind an event; calling
    the object waits for that event alone (work queued after the test keeps running) and raises as
    check_targets_in_range does. ``any_bad`` is the test's result on the device (a 0-d bool, None
    off CUDA): a kernel queued before the call can read it and write nothing when it is set, so
    even an in-place kernel may be launched before the host knows (cross_entropy's in-place mode).
    linear_cross_entropy queues its first logits GEMM before the call, so the host's work up to
    that GEMM no longer runs on an idle GPU (a 0.6 ms gap per step under the profiler, H200 s29)."""

    def __init__(self, target: torch.Tensor, n_classes: int, ignore_index: int, any_bad=None):
        """``any_bad``: the test's device result when already queued (scan_targets), else None."""
        self.target, self.n_classes, self.ignore_index = target, n_classes, ignore_index
        self.any_bad = None
        if target.device.type != "cuda" or target.numel() == 0:
            check_targets_in_range(target, n_classes, ignore_index)
            return
        self.any_bad = _bad_targets(target, n_classes, ignore_index).any() if any_bad is None else any_bad
        self.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.flag.copy_(self.any_bad, non_blocking=True)
        self.tested = torch.cuda.Event()
        self.tested.record()

    def __call__(self) -> None:
        if self.any_bad is None:
            return
        self.tested.synchronize()
        if bool(self.flag):
            _raise_bad_target(self.target, _bad_targets(self.target, self.n_classes, self.ignore_index),
                              self.n_classes, self.ignore_index)


def scan_targets(target: torch.Tensor, n_classes: int, ignore_index: int, reduction: str,
                 check: bool) -> tuple[torch.Tensor, Optional[TargetCheck]]:
    """(row scale, range test or None) of 1-D targets: the gradient scale ([1] fp32: 1 / n_valid
    for ``mean``, else 1) and, with ``check``, the queued range test. On the kernel path both come
    from one launch (launch_target_scan) for up to TARGET_SCAN_MAX targets; else torch ops."""
    mean = reduction == "mean"
    if use_triton(target) and 0 < target.numel() <= TARGET_SCAN_MAX:
        any_bad, scale = launch_target_scan(target, n_classes, ignore_index, mean)
        return scale, (TargetCheck(target, n_classes, ignore_index, any_bad) if check else None)
    finish = TargetCheck(target, n_classes, ignore_index) if check else None
    scale = mean_scale(target, ignore_index) if mean else torch.ones(1, dtype=torch.float32, device=target.device)
    return scale, finish


def _bad_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    return ((target < 0) | (target >= n_classes)) & (target != ignore_index)


def _raise_bad_target(target, bad, n_classes: int, ignore_index: int):
    first = int(target[bad][0])
    raise ValueError(f"target holds class {first}, outside [0, {n_classes}) and not ignore_index "
                     f"({ignore_index}); pass check_targets=False to skip this check")


def mean_scale(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """1 / max(valid rows, 1) as a 1-element fp32 device tensor (no host sync)."""
    n_valid = (target != ignore_index).sum().clamp(min=1)
    return n_valid.to(torch.float32).reciprocal().reshape(1)


def reduce_loss_rows(loss_rows, scale, reduction, shape, dtype):
    if reduction == "none":       # a copy, never a view of the rows: callers may edit it in place
        return loss_rows.reshape(shape).to(dtype, copy=True)
    total = loss_rows.sum()
    return (total if reduction == "sum" else total * scale[0]).to(dtype)


# ----------------------------------------------------------------------------------------------
# gradients computed in the forward, scaled by the backward
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::scale_saved_grads_", mutates_args=("grads", "applied"))
def _scale_saved_grads_op(grads: list[torch.Tensor], applied: torch.Tensor, grad_output: torch.Tensor) -> None:
    """grads *= grad_output / applied (per row of each grad's rows view when grad_output has one
    value per row), then applied = grad_output: a repeated backward (retain_graph) stays right."""
    go = grad_output.reshape(-1).to(torch.float32).contiguous()
    for g in grads:
        rescale_(g, applied, go)
    applied.copy_(go)


def rescale_(g: torch.Tensor, applied: torch.Tensor, go: torch.Tensor) -> None:
    """g *= go / applied in place (fp32 [1] each, or one per row of g's [rows, last dim] view)."""
    if g.numel() == 0:
        return
    g2 = g.view(-1, g.shape[-1]) if g.dim() else g.view(1, 1)
    if use_triton(g):
        launch_scale_rows(g2, applied, go)
    else:
        g.copy_(_scaled(g, applied, go))


def _scaled(g: torch.Tensor, applied: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """g * grad_output / applied out of place, in torch ops: rescale_'s CPU path, and its form under
    functorch transforms (vmap has no rule for an op that mutates)."""
    if g.numel() == 0:
        return g
    factor = grad_output.reshape(-1).to(torch.float32) / applied
    g2 = g.reshape(-1, g.shape[-1]) if g.dim() else g.reshape(1, 1)
    return (_wide(g2) * (factor[:, None] if factor.numel() > 1 else factor)).to(g.dtype).reshape(g.shape)


@_scale_saved_grads_op.register_fake
def _(grads, applied, grad_output):
    return None


def scale_saved_grads_(grads: list, applied: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Scale gradients stored by a forward in place, from inside an eager backward. The saved
    tensors' version counters are preserved, so a second backward over the same graph
    (retain_graph=True) can unpack them again."""
    with contextlib.ExitStack() as stack:
        for t in [*grads, applied]:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
        _scale_saved_grads_op(grads, applied, grad_output)


def _scaling_lost_values(grads: list, applied: torch.Tensor) -> str:
    """Why the first backward's in-place scaling by ``applied`` left stored gradients that a
    rescale cannot bring back, or "" (one host sync; repeated backwards only). A zero grad_output
    erases them. In float16 a grad_output below 1 in magnitude pushes the small entries into the
    subnormal range, where their low bits are lost (first 1e-4, then 1: 7.1e-3 relative error
    against 9.6e-5 from a fresh graph; s40 audit), and one above 1 can overflow them to inf;
    bfloat16 and float32 keep float32's exponent range, so a rescale there costs one rounding."""
    if bool((applied == 0).any()):
        return ("the first backward's grad_output was 0 and scaled the gradient computed in the forward "
                "to zeros in place, so it is gone")
    fp16 = [g for g in grads if g.dtype == torch.float16 and g.numel()]
    if fp16:
        if bool((applied.abs() < 1).any()):
            return ("the first backward's grad_output was below 1 in magnitude and scaled the float16 gradient "
                    "computed in the forward in place, into float16's subnormal range where its small entries "
                    "lose their low bits")
        if not all(bool(torch.isfinite(g).all()) for g in fp16):
            return ("the first backward's grad_output scaled the float16 gradient computed in the forward in "
                    "place past float16's range (inf)")
    return ""


def saved_grads_for_backward(ctx, grads: list, applied: torch.Tensor, grad_output: torch.Tensor) -> list:
    """The gradients a forward computed (for grad_output 1), scaled by this backward's grad_output.

    The first backward scales them in place and hands the buffers out: no second [T, V] (or
    [V, H]) tensor exists. Those buffers then belong to the caller (a returned gradient, a leaf's
    ``.grad``), so a later backward through the same graph (``retain_graph=True``) scales fresh
    copies of them and leaves what it handed out alone. Where the values are gone it raises
    instead of answering wrong: a buffer modified in place since (``.grad`` accumulation, an
    optimizer step, ``clip_grad_norm_``: autograd's own version check on the saved tensors), or a
    first grad_output whose scaling lost values (:func:`_scaling_lost_values`). Traced
    graphs functionalize the scaling (no aliasing).
    """
    if torch.compiler.is_compiling():
        _scale_saved_grads_op(grads, applied, grad_output)
        return grads
    if torch._C._are_functorch_transforms_active():     # (vmap has no rule for an op that mutates)
        return [_scaled(g, applied, grad_output) for g in grads]
    if not getattr(ctx, "grads_handed_out", False):
        scale_saved_grads_(grads, applied, grad_output)
        ctx.grads_handed_out = True
        return grads
    lost = _scaling_lost_values(grads, applied)
    if lost:
        raise RuntimeError(
            f"a second backward through this loss: {lost}; compute it in the backward instead "
            "(cross_entropy(defer_grad=True), or linear_cross_entropy(reduction='none') reduced by hand)")
    fresh = [g.clone() for g in grads]
    _scale_saved_grads_op(fresh, applied.clone(), grad_output)
    return fresh


# ----------------------------------------------------------------------------------------------
# options and argument checks
# ----------------------------------------------------------------------------------------------


def check_ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction) -> None:
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    for name, v in (("label_smoothing", label_smoothing), ("z_loss", z_loss), ("softcap", softcap)):
        if (v is not None or name != "softcap") and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise TypeError(f"{name} must be a number{' or None' if name == 'softcap' else ''}, "
                            f"got {type(v).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not 0.0 <= float(z_loss) < float("inf"):
        raise ValueError(f"z_loss must be finite and >= 0, got {z_loss}")
    if softcap is not None and not 0.0 < float(softcap) < float("inf"):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")


def check_target(target, expected_shape, like: torch.Tensor, like_name: str) -> None:
    check_tensor("target", target, TARGET_DTYPES)
    check_shape("target", target, expected_shape, f"{like_name}'s leading dimensions")
    check_same_device(**{like_name: like, "target": target})


def loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The loss's dtype: the logits' (hidden's), or fp32 under autocast on their device (torch's
    autocast runs cross-entropy in fp32; the kernels do anyway, so only the loss's dtype differs)."""
    return torch.float32 if autocast_dtype(logits) is not None else logits.dtype
