"""Correctness helpers shared by the test suite and ``tilefuse bench``.

* :func:`rel_err` -- the one error metric: ``||out - ref|| / ||ref||`` in float64.
* :func:`make_grad_outputs` -- random (never all-ones) output gradients in each output's dtype.
* :func:`run_fwd_bwd` -- run a callable on :class:`~tilefuse.registry.Inputs`, return its outputs
  and the gradients of every ``inputs.grad_args`` position.
* :func:`reference_inputs` / :func:`run_reference` -- the same through ``spec.reference`` on
  float64 copies of the inputs.
* :func:`check_impl` -- forward and backward of one implementation against the fp64 reference,
  as numbers (``CheckResult``), never an assertion; the benchmark marks rows FAILED with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch

from .registry import Inputs, OpSpec, as_tuple

GradOutputs = Any   # None | Tensor | Sequence[Tensor | None] | Callable[[tuple], Sequence[Tensor | None]]


# ----------------------------------------------------------------------------------------------
# the error metric
# ----------------------------------------------------------------------------------------------


def rel_err(out: Any, ref: Any) -> float:
    """Relative error norm ``||out - ref||_2 / ||ref||_2``, computed in float64.

    * 0.0 when both are all zeros (or both empty); ``inf`` when only ``ref`` is zero.
    * ``inf`` when shapes differ, when either side is not a tensor, or on NaN anywhere
      (a NaN in ``out`` is always an error; a NaN in ``ref`` means the check is meaningless).
    * Matching ``±inf`` entries (same sign, same position) count as exact; any other inf is ``inf``.
    """
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return math.inf
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    if out.numel() == 0:
        return 0.0
    wide = torch.complex128 if (out.is_complex() or ref.is_complex()) else torch.float64
    r = ref.detach().to(wide)
    o = out.detach().to(device=r.device, dtype=wide)     # on ref's device (a CPU reference stays there)
    if bool(torch.isnan(o).any()) or bool(torch.isnan(r).any()):
        return math.inf
    o_inf, r_inf = torch.isinf(o), torch.isinf(r)
    if bool(o_inf.any()) or bool(r_inf.any()):
        if not bool(torch.equal(o_inf, r_inf)) or not bool((o[o_inf] == r[r_inf]).all()):
            return math.inf
        finite = ~o_inf
        o, r = o[finite], r[finite]
    num = float(torch.linalg.vector_norm(o - r))
    den = float(torch.linalg.vector_norm(r))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    if math.isnan(num) or math.isnan(den):
        return math.inf
    return num / den


def _flatten(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    return [x]


def max_rel_err(outs: Sequence[Any], refs: Sequence[Any]) -> float:
    """Worst :func:`rel_err` over paired sequences, nested lists / tuples flattened (an op may
    return a list of tensors); ``inf`` if the flattened lengths differ."""
    outs, refs = _flatten(outs), _flatten(refs)
    if len(outs) != len(refs):
        return math.inf
    errs = [rel_err(o, r) for o, r in zip(outs, refs)]
    return max(errs, default=0.0)


# ----------------------------------------------------------------------------------------------
# forward + backward of a callable
# ----------------------------------------------------------------------------------------------


def _wants_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())


def make_grad_outputs(outs: Any, seed: int = 0) -> tuple:
    """One random gradient per output that requires grad (``None`` for the others).

    Drawn in float32 from a generator seeded with ``seed + index`` and cast to the output's dtype,
    so two implementations with the same output shapes get the same values (up to rounding).
    """
    grads = []
    for i, o in enumerate(as_tuple(outs)):
        if not _wants_grad(o):
            grads.append(None)
            continue
        gen = torch.Generator(device=o.device)
        gen.manual_seed(seed + i)
        g = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32)
        grads.append(g.to(o.dtype))
    return tuple(grads)


def _resolve_grad_outputs(outs: tuple, grad_outputs: GradOutputs) -> tuple:
    if callable(grad_outputs) and not isinstance(grad_outputs, torch.Tensor):
        grad_outputs = grad_outputs(outs)
    if isinstance(grad_outputs, str):
        if grad_outputs != "random":
            raise ValueError(f"grad_outputs={grad_outputs!r}: the only string accepted is 'random'")
        grad_outputs = make_grad_outputs(outs)
    gs = list(as_tuple(grad_outputs))
    if len(gs) > len(outs):
        raise ValueError(f"{len(gs)} grad_outputs for {len(outs)} outputs")
    gs += [None] * (len(outs) - len(gs))
    return tuple(gs)


def grad_leaves(inputs: Inputs) -> list:
    """The tensors at ``inputs.grad_args``, each made a grad-requiring leaf if it was not one."""
    leaves = []
    for i in inputs.grad_args:
        a = inputs.args[i]
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"grad_args names position {i}, which is {type(a).__name__}, not a tensor")
        if not a.requires_grad and a.is_leaf:
            a.requires_grad_(True)
        leaves.append(a)
    return leaves


def backward_grads(outs: Any, inputs: Inputs, grad_outputs: GradOutputs, retain_graph: bool = False) -> tuple:
    """``torch.autograd.grad`` of ``outs`` w.r.t. every ``inputs.grad_args`` tensor.

    Outputs that do not require grad, or whose grad_output is ``None``, are left out. An input that
    no output depends on gets a zero gradient (never ``None``), so callers can always compare.
    """
    outs = as_tuple(outs)
    gs = _resolve_grad_outputs(outs, grad_outputs)
    leaves = grad_leaves(inputs)
    pairs = [(o, g.to(o.dtype) if g.dtype != o.dtype else g)
             for o, g in zip(outs, gs) if g is not None and _wants_grad(o)]
    if not leaves:
        return ()
    if not pairs:
        return tuple(torch.zeros_like(a) for a in leaves)
    grads = torch.autograd.grad(
        [o for o, _ in pairs], leaves, [g for _, g in pairs],
        retain_graph=retain_graph, allow_unused=True,
    )
    return tuple(torch.zeros_like(a) if g is None else g for a, g in zip(leaves, grads))


def run_fwd_bwd(
    fn: Callable[..., Any] | OpSpec,
    inputs: Inputs,
    grad_outputs: GradOutputs = None,
    retain_graph: bool = False,
) -> tuple[tuple, tuple]:
    """Run ``fn(*inputs.args, **inputs.kwargs)``; then, unless ``grad_outputs`` is None, backward.

    ``fn`` may be an :class:`OpSpec` (its ``fn`` runs). ``grad_outputs`` is a tensor, a sequence
    (``None`` entries skip an output; a short sequence is padded with ``None``), the string
    ``"random"`` (:func:`make_grad_outputs`), or a callable ``outs -> sequence``.
    Returns ``(outputs, grads)``: outputs as a tuple, grads one per ``inputs.grad_args`` entry
    (zeros where the input is unused; ``()`` when ``grad_outputs`` is None).
    """
    if isinstance(fn, OpSpec):
        fn = fn.fn
    outs = as_tuple(fn(*inputs.args, **inputs.kwargs))
    if grad_outputs is None or not inputs.grad_args:
        return outs, ()
    return outs, backward_grads(outs, inputs, grad_outputs, retain_graph=retain_graph)


# ----------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------


def reference_inputs(inputs: Inputs) -> Inputs:
    """Float64 copies of ``inputs`` (fresh leaves; same grad_args; non-float tensors unchanged)."""
    return inputs.detached(dtype=torch.float64)


def run_reference(spec: OpSpec, inputs: Inputs, grad_outputs: GradOutputs = None) -> tuple[tuple, tuple]:
    """``spec.reference`` on float64 copies of ``inputs``; grad_outputs are cast to float64."""
    ref_in = reference_inputs(inputs)

    def as_f64(outs):
        gs = _resolve_grad_outputs(outs, grad_outputs)
        return tuple(None if g is None else g.detach().to(torch.float64) for g in gs)

    return run_fwd_bwd(spec.reference, ref_in, None if grad_outputs is None else as_f64)


# ----------------------------------------------------------------------------------------------
# one implementation vs the reference
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CheckResult:
    fwd_err: float                 # worst rel err over the outputs
    bwd_err: float | None          # worst rel err over the grads (None: no backward checked)
    tolerance: float               # the spec's bound for this dtype
    error: str | None = None       # an exception raised by the implementation, if any
    # flash-attn's rule: also allowed is twice the error PyTorch's own implementation (the spec's
    # "torch" peer) makes in the same dtype on the same inputs; None when no peer was measured
    torch_fwd_err: float | None = None
    torch_bwd_err: float | None = None

    @property
    def fwd_tol(self) -> float:
        return max(self.tolerance, 2 * self.torch_fwd_err) if self.torch_fwd_err is not None else self.tolerance

    @property
    def bwd_tol(self) -> float:
        return max(self.tolerance, 2 * self.torch_bwd_err) if self.torch_bwd_err is not None else self.tolerance

    @property
    def fwd_ok(self) -> bool:
        return self.error is None and self.fwd_err <= self.fwd_tol

    @property
    def bwd_ok(self) -> bool:
        return self.fwd_ok and (self.bwd_err is None or self.bwd_err <= self.bwd_tol)

    @property
    def ok(self) -> bool:
        return self.bwd_ok


class ReferenceCache:
    """The fp64 reference for one (spec, inputs): forward once, backward once per grad dtypes.

    ``device`` moves the fp64 copies (e.g. ``"cpu"`` when they do not fit beside the GPU inputs)."""

    def __init__(self, spec: OpSpec, inputs: Inputs, device: Any = None):
        self.spec = spec
        moved = inputs if device is None else inputs.detached(device=device)   # move, then widen
        self.inputs = reference_inputs(moved)
        self.device = device
        self.outs = as_tuple(spec.reference(*self.inputs.args, **self.inputs.kwargs))
        self._grads: dict = {}

    def grads(self, grad_outputs: tuple, seed: int | None = None) -> tuple:
        """Reference grads for ``grad_outputs`` (cast to fp64). With ``seed`` (the seed that
        :func:`make_grad_outputs` drew them with) results are reused for equal dtypes and shapes."""
        key = (seed, tuple(None if g is None else (g.dtype, tuple(g.shape)) for g in grad_outputs))
        if seed is None:
            self._grads.pop(key, None)
        if key not in self._grads:
            gs = tuple(None if g is None else g.detach().to(device=self.device, dtype=torch.float64)
                       for g in grad_outputs)
            self._grads[key] = backward_grads(self.outs, self.inputs, gs, retain_graph=True)
        return self._grads[key]


def check_impl(
    spec: OpSpec,
    fn: Callable[..., Any],
    inputs: Inputs,
    dtype: torch.dtype,
    reference: ReferenceCache | None = None,
    backward: bool | None = None,
    seed: int = 0,
    torch_baseline: bool = True,
) -> CheckResult:
    """Forward (and backward, when the spec has one) of ``fn`` on ``inputs`` vs the fp64 reference.

    Exceptions from ``fn`` are caught and reported in ``error`` (the result is then not ok).
    ``inputs`` are used as given (pass fresh ones if ``fn`` may modify them in place).
    With ``torch_baseline`` (and a "torch" peer in the spec, and a dtype below fp64), the spec's
    PyTorch peer runs on a copy of the same inputs and its error sets the flash-attn bound
    (``CheckResult.fwd_tol``/``bwd_tol``): a low-precision backward that consumes a rounded saved
    output cannot beat what that rounding costs PyTorch itself. fp32 is included because a
    one-element case can land where the result cancels (gelu'(z) crosses 0 at z = -0.7518:
    measured, PyTorch's own fp32 backward there is 1.3e-5 off, as is ours); the bound only ever
    widens past the spec's tolerance when PyTorch itself misses it on those very inputs.
    """
    tol = spec.tolerance.get(dtype, max(spec.tolerance.values(), default=1e-2))
    if backward is None:
        backward = spec.has_backward and bool(inputs.grad_args)
    baseline = None
    try:
        # the reference first, from the untouched inputs (the baseline runs on clones)
        ref = reference if reference is not None else ReferenceCache(spec, inputs)
    except Exception as exc:  # noqa: BLE001
        return CheckResult(math.inf, None, tol, error=f"reference: {type(exc).__name__}: {exc}".strip()[:500])
    if torch_baseline and dtype != torch.float64 and "torch" in spec.peers:
        baseline = _torch_errors(spec, inputs, ref, backward, seed)
    try:
        fwd_err, bwd_err = _errors(fn, inputs, ref, backward, seed)
    except Exception as exc:  # noqa: BLE001 - any failure of an implementation is a FAILED row
        return CheckResult(math.inf, None, tol, error=f"{type(exc).__name__}: {exc}".strip()[:500])
    return CheckResult(fwd_err, bwd_err, tol, torch_fwd_err=baseline and baseline[0],
                       torch_bwd_err=baseline and baseline[1])


def _errors(fn, inputs: Inputs, ref: ReferenceCache, backward: bool, seed: int) -> tuple[float, float | None]:
    with torch.enable_grad():
        outs = as_tuple(fn(*inputs.args, **inputs.kwargs))
        fwd_err = max_rel_err(outs, ref.outs)
        bwd_err = None
        if backward:
            gouts = make_grad_outputs(outs, seed=seed)
            grads = backward_grads(outs, inputs, gouts)
            bwd_err = max_rel_err(grads, ref.grads(gouts, seed=seed))
    return fwd_err, bwd_err


def _torch_errors(spec, inputs, reference, backward, seed) -> tuple[float, float | None] | None:
    """The errors of the spec's PyTorch peer on a fresh copy of ``inputs`` (None if it fails)."""
    try:
        peer = spec.peers["torch"]()
        if peer is None:
            return None
        ref = reference if reference is not None else ReferenceCache(spec, inputs)
        return _errors(peer, inputs.cloned(), ref, backward, seed)
    except Exception:  # noqa: BLE001 - no baseline: the spec's bound alone applies
        return None
