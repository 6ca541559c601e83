"""cross_entropy over the last dimension, with the gradient computed in the forward pass.

For one row of logits ``x`` (length V) with target class ``t``, label smoothing ``eps``, z-loss
weight ``z`` and an optional soft cap ``c``:

    x'_j  = c * tanh(x_j / c)                          (Gemma 2 soft cap; x' = x without it)
    lse   = log sum_j exp(x'_j)                        (online over tiles of V: running max/sum)
    loss  = (1 - eps)(lse - x'_t) + eps (lse - mean_j x'_j) + z * lse^2
    dx_j  = scale * (p_j - eps/V - (1 - eps)[j == t] + 2 z lse p_j) * (1 - tanh^2(x_j / c))

with ``p = softmax(x')``. Rows whose target is ``ignore_index`` give loss 0 and gradient 0;
``mean`` divides by max(valid rows, 1), so an all-ignored batch is 0, not NaN. The label-smoothing
term is torch's (``F.cross_entropy(label_smoothing=eps)``), the z-loss PaLM's.

By default the gradient is written in the same kernel as the loss (second walk over the row), as
Liger does: into a fresh [T, V] buffer, or -- ``logits_inplace_grad=True`` -- into the logits' own
storage, so no second [T, V] tensor ever exists. Backward only scales the stored gradient by
grad_output, in place, and skips that pass when grad_output is exactly 1 (``loss.backward()``);
a second backward through the same graph scales a copy (``saved_grads_for_backward``).

``defer_grad=True`` instead saves three fp32 numbers per row (max, log2 of the exp-sum, 1 - p_t)
and computes the gradient in the backward, grad_output applied in the same pass (in place into
the logits with ``logits_inplace_grad``). Passes over [T, V]: grad in forward 2 (grad_output 1)
or 4 (any other grad_output: loss scaling, gradient accumulation, reduction='none'); deferred 3.

Bytes counted (ideal): forward reads the logits once and writes the gradient once (2·T·V elements,
plus the int64 targets and the loss); backward reads and writes the stored gradient (2·T·V).
Deferred: forward reads the logits (T·V) and writes 3·T fp32; backward reads logits and stats and
writes the gradient (2·T·V).
Rows up to 8K classes are read once; longer ones twice from DRAM's point of view only if the
row left L2 in between: the first walk (running max and sum per thread, next tile prefetched)
loads evict_last, the second runs backwards over the row so it starts on the tiles the first
touched last, its loads and the gradient's stores evict_first, and one row is in flight per SM
(32K tiles at 32 warps for V >= 64K). H200, 8192 x 128256 bf16, grad_output 1: 1.14 ms, 2.27x
torch.compile. Kernels and their numerics: ops/_cross_entropy_kernels.py.

Out-of-range targets raise a ``ValueError``. On CUDA the range test is queued before the kernel
and awaited after it is queued (one host sync, with the GPU busy); the kernel reads the test's
flag and writes nothing when it failed, so an in-place call leaves the logits intact for the error
(``check_targets=False`` skips the test; a bad row then gets a NaN loss, never an out-of-bounds read).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .._autocast import autocast_dtype
from .._checks import check_same_device, check_shape, check_tensor
from .._dispatch import empty, rows_view, use_triton
from .._op import custom_op, once_differentiable
from ..registry import Inputs, OpSpec, register, tensor_bytes
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


def cross_entropy_reference(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                            softcap=None, reduction="mean", logits_inplace_grad=False, check_targets=True,
                            defer_grad=False):
    """fp32-or-wider torch composition; same signature as :func:`cross_entropy`."""
    x = _wide(logits) if softcap is None else softcap_reference(_wide(logits), softcap)
    return reference_cross_entropy(x, target, ignore_index, label_smoothing, z_loss, reduction).to(logits.dtype)


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
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


def _forward_into(logits, target, grad, ignore_index, label_smoothing, z_loss, softcap, reduction, check,
                  loss_dtype, stats=None):
    opts = CEOptions(ignore_index, label_smoothing, z_loss, softcap)
    x2 = rows_view(logits)
    t1 = target.reshape(-1).contiguous()   # the kernels read target[row]: unit stride
    scale, finish_check = scan_targets(t1, x2.shape[1], ignore_index, reduction, check)
    # in place, the caller's logits must be intact when the error is raised: the kernel reads the
    # test's device flag and writes nothing when it is set (an out-of-place kernel only masks the
    # bad rows), so no mode waits for the test before its launch
    skip_if = finish_check.any_bad if finish_check is not None else None
    loss_rows = empty((x2.shape[0],), torch.float32, logits.device)
    # sum / none: scale 1, the stored gradient is unscaled, backward multiplies by grad_output
    g2 = None if grad is None else grad.view(x2.shape)
    # the kernel masks an out-of-range target (its row's loss is NaN), so it may be queued before
    # the range test's result is awaited: the GPU does not drain while the host launches it
    cross_entropy_rows(x2, t1, scale, loss_rows, g2, opts, stats=stats, skip_if=skip_if)
    if finish_check is not None:
        finish_check()
    return reduce_loss_rows(loss_rows, scale, reduction, target.shape, loss_dtype)


def _loss_fake(logits, target, reduction, loss_dtype):
    shape = target.shape if reduction == "none" else ()
    return torch.empty(shape, dtype=loss_dtype, device=logits.device)


@custom_op("tilefuse::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
               z_loss: float, softcap: Optional[float], reduction: str, write_grad: bool,
               check_targets: bool, loss_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    grad = empty(logits.shape, logits.dtype, logits.device) if write_grad else logits.new_empty(0)
    loss = _forward_into(logits, target, grad if write_grad else None, ignore_index, label_smoothing,
                         z_loss, softcap, reduction, check_targets, loss_dtype)
    return loss, grad


@_ce_fwd_op.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, write_grad, check_targets,
      loss_dtype):
    grad = torch.empty(logits.shape if write_grad else (0,), dtype=logits.dtype, device=logits.device)
    return _loss_fake(logits, target, reduction, loss_dtype), grad


@custom_op("tilefuse::cross_entropy_fwd_inplace", mutates_args=("logits",))
def _ce_fwd_inplace_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                       z_loss: float, softcap: Optional[float], reduction: str,
                       check_targets: bool, loss_dtype: torch.dtype) -> torch.Tensor:
    """Like cross_entropy_fwd, but the gradient overwrites ``logits`` (contiguous)."""
    return _forward_into(logits, target, logits, ignore_index, label_smoothing, z_loss, softcap,
                         reduction, check_targets, loss_dtype)


@_ce_fwd_inplace_op.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, check_targets, loss_dtype):
    return _loss_fake(logits, target, reduction, loss_dtype)


@custom_op("tilefuse::cross_entropy_fwd_stats", mutates_args=())
def _ce_fwd_stats_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                     z_loss: float, softcap: Optional[float], reduction: str,
                     check_targets: bool, loss_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, stats [3, rows] fp32): the deferred mode's forward, one read of the logits."""
    n_rows = target.numel()
    stats = empty((3, n_rows), torch.float32, logits.device)
    loss = _forward_into(logits, target, None, ignore_index, label_smoothing, z_loss, softcap, reduction,
                         check_targets, loss_dtype, stats=stats)
    return loss, stats


@_ce_fwd_stats_op.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, check_targets, loss_dtype):
    return (_loss_fake(logits, target, reduction, loss_dtype),
            logits.new_empty((3, target.numel()), dtype=torch.float32))


def _grad_scale(target, grad_output, ignore_index, reduction):
    """grad_output (times 1/n_valid for 'mean') as fp32 [1] or, for 'none', [rows]."""
    go = grad_output.reshape(-1).to(torch.float32)
    return go * mean_scale(target.reshape(-1), ignore_index) if reduction == "mean" else go.contiguous()


def _grad_into(grad, logits, target, stats, grad_output, ignore_index, label_smoothing, z_loss, softcap,
               reduction):
    x2 = rows_view(logits)
    t1 = target.reshape(-1).contiguous()   # the kernel reads target[row]: unit stride
    cross_entropy_grad_rows(x2, t1, stats, _grad_scale(target, grad_output, ignore_index, reduction),
                            grad.view(x2.shape), CEOptions(ignore_index, label_smoothing, z_loss, softcap))


@custom_op("tilefuse::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, grad_output: torch.Tensor,
               ignore_index: int, label_smoothing: float, z_loss: float, softcap: Optional[float],
               reduction: str) -> torch.Tensor:
    grad = empty(logits.shape, logits.dtype, logits.device)
    _grad_into(grad, logits, target, stats, grad_output, ignore_index, label_smoothing, z_loss, softcap, reduction)
    return grad


@_ce_bwd_op.register_fake
def _(logits, target, stats, grad_output, ignore_index, label_smoothing, z_loss, softcap, reduction):
    return torch.empty_like(logits)


@custom_op("tilefuse::cross_entropy_bwd_inplace", mutates_args=("logits",))
def _ce_bwd_inplace_op(logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, grad_output: torch.Tensor,
                       ignore_index: int, label_smoothing: float, z_loss: float, softcap: Optional[float],
                       reduction: str) -> None:
    """As cross_entropy_bwd, the gradient overwriting ``logits`` (contiguous)."""
    _grad_into(logits, logits, target, stats, grad_output, ignore_index, label_smoothing, z_loss, softcap, reduction)


@_ce_bwd_inplace_op.register_fake
def _(logits, target, stats, grad_output, ignore_index, label_smoothing, z_loss, softcap, reduction):
    return None


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
        factor = go / applied
        g2.copy_((_wide(g2) * (factor[:, None] if factor.numel() > 1 else factor)).to(g.dtype))


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


# create_graph=True through the gradient-in-forward modes: the gradient depends on the logits,
# which they keep no tensor of, so a later second derivative could not be stopped (_op.once_differentiable)
UNANCHORED_GRADIENT = (
    "cross_entropy computed its gradient in the forward, so backward(create_graph=True) through it "
    "cannot keep a second derivative (a gradient penalty) from silently dropping its term; use "
    "cross_entropy(..., defer_grad=True), whose second derivative raises, or torch's F.cross_entropy")


def _ce_setup_context(ctx, inputs, output):
    """The default mode: the gradient the forward wrote (for grad_output 1), scaled by the backward."""
    reduction = inputs[6]
    loss, grad = output
    n_scales = loss.numel() if reduction == "none" else 1
    ctx.save_for_backward(grad, torch.ones(n_scales, dtype=torch.float32, device=grad.device))
    ctx.unanchored_gradient = UNANCHORED_GRADIENT


def _ce_backward(ctx, grad_loss, _grad):
    grad, applied = ctx.saved_tensors
    return (saved_grads_for_backward(ctx, [grad], applied, grad_loss)[0],) + (None,) * 9


# registered on the ops themselves (not only an autograd.Function around them), so torch.export's
# graphs and every dispatcher path keep the gradient (s38 audit: strict export dropped it silently);
# the gradient output is never differentiated: no [T, V] zero-fill for it
_ce_fwd_op.register_autograd(_ce_backward, setup_context=_ce_setup_context, materialize_grads=False)


def _ce_stats_setup_context(ctx, inputs, output):
    """defer_grad: the logits and the forward's row statistics, the gradient written in the backward."""
    logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, _check, _dtype = inputs
    ctx.args = (ignore_index, label_smoothing, z_loss, softcap, reduction)
    ctx.save_for_backward(logits, target, output[1])


def _ce_stats_backward(ctx, grad_loss, _stats):
    logits, target, stats = ctx.saved_tensors
    return (_ce_bwd_op(logits, target, stats, grad_loss, *ctx.args),) + (None,) * 8


_ce_fwd_stats_op.register_autograd(_ce_stats_backward, setup_context=_ce_stats_setup_context,
                                   materialize_grads=False)


class _InplaceCrossEntropy(torch.autograd.Function):
    # the in-place modes only: they mutate logits, and register_autograd takes functional ops; the
    # kernels still run as custom ops
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, check, loss_dtype,
                defer):
        args = (ignore_index, label_smoothing, z_loss, softcap, reduction)
        ctx.deferred = defer
        if defer:
            loss, stats = _ce_fwd_stats_op(logits, target, *args, check, loss_dtype)
            ctx.args = args
            ctx.save_for_backward(logits, target, stats)
            return loss
        loss = _ce_fwd_inplace_op(logits, target, *args, check, loss_dtype)
        n_scales = loss.numel() if reduction == "none" else 1
        ctx.save_for_backward(logits.detach(), torch.ones(n_scales, dtype=torch.float32, device=logits.device))
        ctx.unanchored_gradient = UNANCHORED_GRADIENT
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        nones = (None,) * 9
        if ctx.deferred:
            logits, target, stats = ctx.saved_tensors
            # logits become their gradient (a second backward then raises: version); not in a
            # traced backward: AOT autograd copies a backward's mutation of a forward input back
            # into it, and logits is a leaf that requires grad (it raises, seen on the H200)
            if not torch.compiler.is_compiling():
                _ce_bwd_inplace_op(logits, target, stats, grad_loss, *ctx.args)
                return (logits.detach(),) + nones
            return (_ce_bwd_op(logits, target, stats, grad_loss, *ctx.args),) + nones
        grad, applied = ctx.saved_tensors
        return (saved_grads_for_backward(ctx, [grad], applied, grad_loss)[0],) + nones


_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The loss's dtype: the logits' (hidden's), or fp32 under autocast on their device (torch's
    autocast runs cross-entropy in fp32; the kernels do anyway, so only the loss's dtype differs)."""
    return torch.float32 if autocast_dtype(logits) is not None else logits.dtype


def _inplace_allowed() -> bool:
    """The in-place modes run eagerly and under torch.compile; under another dispatch mode
    (selective activation checkpointing caches op results: the cached in-place op never re-ran,
    and the saved "gradient" was the recomputed logits, s38 audit) and under torch.export the
    buffered modes run instead (same values)."""
    if _is_exporting():
        return False
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() == 0


# ----------------------------------------------------------------------------------------------
# public API
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


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    logits_inplace_grad: bool = False,
    check_targets: bool = True,
    defer_grad: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(logits, target)`` over the last dim of ``logits [..., V]`` (``target
    [...]`` int64/int32), plus ``z_loss`` (z·lse² per valid row) and ``softcap`` (logits →
    c·tanh(logits/c) first). fp32 math; the loss has logits' dtype, or fp32 under ``torch.autocast``
    (as torch's autocast cross-entropy returns it; the logits are not upcast, only the loss).

    The gradient is computed in this call. ``logits_inplace_grad=True`` writes it into ``logits``
    (which then no longer holds the logits: don't reuse them, and nothing else may have saved them
    for backward -- autograd raises if something did), so the op needs no [T, V] buffer of its own;
    with False a [T, V] gradient buffer is allocated here, as torch's backward would.
    ``check_targets`` costs one host sync; False skips it (a bad target then gives a NaN loss).

    ``defer_grad=True`` computes the gradient in the backward instead (module docstring): 3 passes
    over the logits instead of 2 when grad_output is exactly 1, but instead of 4 when it is not
    (loss scaling, gradient accumulation, ``reduction='none'``); with ``logits_inplace_grad`` the
    backward overwrites the logits.
    """
    check_tensor("logits", logits, min_dim=1)
    check_target(target, logits.shape[:-1], logits, "logits")
    check_ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    # no gradient wanted (no_grad, eval, frozen logits): loss only, logits left alone
    write_grad = logits.requires_grad and torch.is_grad_enabled()
    args = (ignore_index, float(label_smoothing), float(z_loss), None if softcap is None else float(softcap),
            reduction)
    check = bool(check_targets)
    # the in-place mode needs logits' own rows; other layouts take the buffered path
    if write_grad and logits_inplace_grad and logits.is_contiguous() and _inplace_allowed():
        return _InplaceCrossEntropy.apply(logits, target, *args, check, loss_dtype(logits), bool(defer_grad))
    if write_grad and defer_grad:
        return _ce_fwd_stats_op(logits, target, *args, check, loss_dtype(logits))[0]
    return _ce_fwd_op(logits, target, *args, write_grad, check, loss_dtype(logits))[0]


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------

IGNORE_FRACTION = 0.1


def random_targets(n_rows: int, n_classes: int, device, ignore_index: int = -100) -> torch.Tensor:
    """Random classes with ~10 % of rows set to ignore_index."""
    target = torch.randint(0, max(n_classes, 1), (n_rows,), device=device)
    target[torch.rand(n_rows, device=device) < IGNORE_FRACTION] = ignore_index
    return target


def _make_inputs(shape, dtype, device):
    n_rows, n_cols = shape
    # scale 3: a real spread of probabilities; in-place gradient: the memory-lean mode is what runs
    logits = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_(True)
    return Inputs((logits, random_targets(n_rows, n_cols, device)), {"logits_inplace_grad": True}, grad_args=(0,))


def _make_deferred_inputs(shape, dtype, device):
    inputs = _make_inputs(shape, dtype, device)
    inputs.kwargs["defer_grad"] = True
    return inputs


def _deferred_bytes(shape, dtype, pass_):
    n_rows, _ = shape
    if pass_ == "fwd":   # logits + targets read, loss and 3 fp32 stats per row written
        return tensor_bytes(shape, dtype) + n_rows * (8 + 12) + tensor_bytes((), dtype)
    # logits, targets, stats, grad_output read + gradient written
    return 2 * tensor_bytes(shape, dtype) + n_rows * (8 + 12) + tensor_bytes((), dtype)


def _bytes(shape, dtype, pass_):
    n_rows, _ = shape
    if pass_ == "fwd":   # logits read + gradient written + int64 targets read + loss written
        return 2 * tensor_bytes(shape, dtype) + n_rows * 8 + tensor_bytes((), dtype)
    # backward: the stored gradient read and written (skipped when grad_output == 1) + grad_output
    return 2 * tensor_bytes(shape, dtype) + tensor_bytes((), dtype)


# FLOPs per row of V (the bench's inputs: no smoothing, z-loss or softcap; mean reduction): the
# log-sum-exp m (V - 1 compares), x - m, exp, s (V - 1 adds), m + log s (2); the loss lse - x_t
# (1); the gradient (exp(x - lse) - [j = t]) · scale (3V + 1); the mean over the T rows (T).
def _flops(shape, pass_):
    n_rows, n_cols = shape
    if pass_ == "fwd":       # the gradient is computed in the forward
        return n_rows * (7 * n_cols + 2) + n_rows
    return n_rows * n_cols   # grad_output scales the stored gradient


def _deferred_flops(shape, pass_):
    n_rows, n_cols = shape
    if pass_ == "fwd":
        return n_rows * (4 * n_cols + 1) + n_rows
    return n_rows * (3 * n_cols + 1)    # grad_output folded into the row scale


def _torch_peer():
    def eager_cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                            reduction="mean", logits_inplace_grad=False, check_targets=True, defer_grad=False):
        return torch_cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction)
    return eager_cross_entropy


def _liger_peer():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy  # type: ignore
    except Exception:
        return None

    def liger(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
              reduction="mean", logits_inplace_grad=False, check_targets=True, defer_grad=False):
        # Liger always writes the gradient into logits; it takes [T, V] rows only
        loss = liger_cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                   ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   lse_square_scale=z_loss, softcap=softcap, reduction=reduction)
        return loss.reshape(target.shape) if reduction == "none" else loss
    return liger


register(OpSpec(
    name="cross_entropy",
    split_passes=False,
    graph_capturable=False,   # the target range check syncs with the host; gradients land in the logits
    fn=cross_entropy,
    reference=cross_entropy_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(1, 7), (5, 33), (8, 1000), (3, 4097), (2, 17000)],
    gpu_test_shapes=[(8192, 128256), (4096, 151936), (1024, 256000), (37, 32000)],
    bench_shapes=[(8192, 128256)],
    peers={"torch": _torch_peer, "liger": _liger_peer},
    description="cross-entropy over the last dim (gradient computed in the forward)",
))

register(OpSpec(
    name="cross_entropy_deferred",
    split_passes=False,
    graph_capturable=False,   # the target range check syncs with the host; gradients land in the logits
    repeatable_backward=False,
    fn=cross_entropy,
    reference=cross_entropy_reference,
    make_inputs=_make_deferred_inputs,
    bytes_fn=_deferred_bytes,
    flops_fn=_deferred_flops,
    test_shapes=[(1, 7), (5, 33), (3, 4097), (2, 17000)],
    gpu_test_shapes=[(8192, 128256), (37, 32000)],
    bench_shapes=[(8192, 128256)],
    peers={"torch": _torch_peer, "liger": _liger_peer},
    description="cross_entropy(defer_grad=True): gradient computed in the backward from saved row stats",
))
