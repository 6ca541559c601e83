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

from typing import Optional

import torch

from .._checks import check_tensor
from .._dispatch import empty, rows_view
from .._op import custom_op, once_differentiable
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._cross_entropy_kernels import CEOptions
from ._cross_entropy_shared import (
    _wide,
    check_ce_options,
    check_target,
    cross_entropy_grad_rows,
    cross_entropy_rows,
    loss_dtype,
    mean_scale,
    reduce_loss_rows,
    reference_cross_entropy,
    saved_grads_for_backward,
    scan_targets,
    softcap_reference,
    torch_cross_entropy,
)


# the op's reference (the shared references, the CPU path and the checks: ops/_cross_entropy_shared.py)
def cross_entropy_reference(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                            softcap=None, reduction="mean", logits_inplace_grad=False, check_targets=True,
                            defer_grad=False):
    """fp32-or-wider torch composition; same signature as :func:`cross_entropy`."""
    x = _wide(logits) if softcap is None else softcap_reference(_wide(logits), softcap)
    return reference_cross_entropy(x, target, ignore_index, label_smoothing, z_loss, reduction).to(logits.dtype)


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


def _inplace_allowed() -> bool:
    """The in-place modes run eagerly and under torch.compile; under another dispatch mode
    (selective activation checkpointing caches op results: the cached in-place op never re-ran,
    and the saved "gradient" was the recomputed logits, s38 audit), under torch.export and under
    a functorch transform (torch.func.grad / vmap: the logits are its wrappers) the buffered
    modes run instead (same values)."""
    if _is_exporting() or torch._C._are_functorch_transforms_active():
        return False
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() == 0


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


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


# The function's must-move bytes, the same for both registrations (they compute the same loss and
# gradient; how our two modes split the work is theirs, and their fwd / bwd rows are not compared,
# ``split_passes=False``). grad_output is not known when the forward runs, so three passes over
# [T, V] are the minimum: the forward reads the logits; the backward reads them again and writes
# the gradient (the in-forward mode instead writes the gradient in the forward and reads and writes
# it in the backward: 4 passes, counted as 3). Per row also the int64 target (read each pass) and
# the log-sum-exp the backward needs (fp32, written and read back).
def _bytes(shape, dtype, pass_):
    n_rows, _ = shape
    if pass_ == "fwd":   # logits + targets read, the loss and the rows' lse written
        return tensor_bytes(shape, dtype) + n_rows * (8 + 4) + tensor_bytes((), dtype)
    # logits, targets, lse and grad_output read, the gradient written
    return 2 * tensor_bytes(shape, dtype) + n_rows * (8 + 4) + tensor_bytes((), dtype)


# FLOPs per row of V (the bench's inputs: no smoothing, z-loss or softcap; mean reduction), the same
# for both registrations: forward, the log-sum-exp m (V - 1 compares), x - m, exp, s (V - 1 adds),
# m + log s (2); the loss lse - x_t (1); the mean over the T rows (T). Backward, the gradient
# (exp(x - lse) - [j = t]) · scale (3V + 1, grad_output folded into the row scale).
def _flops(shape, pass_):
    n_rows, n_cols = shape
    if pass_ == "fwd":
        return n_rows * (4 * n_cols + 1) + n_rows
    return n_rows * (3 * n_cols + 1)


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
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(1, 7), (5, 33), (3, 4097), (2, 17000)],
    gpu_test_shapes=[(8192, 128256), (37, 32000)],
    bench_shapes=[(8192, 128256)],
    peers={"torch": _torch_peer, "liger": _liger_peer},
    description="cross_entropy(defer_grad=True): gradient computed in the backward from saved row stats",
))
