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
    """Errors of one implementation against the fp64 reference, one per output and per gradient.

    Each tensor passes against its own bound, the largest of
    * the spec's ``tolerance`` for the dtype;
    * twice the error PyTorch's own implementation (the spec's "torch" peer) makes on that tensor
      in the same dtype on the same inputs -- flash-attn's rule (``torch_*_errs``; a peer that
      fails or returns NaN / inf sets no bound);
    * the rounding floor (``*_floors``): how far the exact result itself moves when every input
      and output gradient is rounded once more in fp32 (:func:`rounding_floors`). It is ~1e-7
      where a result is well conditioned and only matters where one cancels.
    """

    fwd_errs: tuple                # rel err per output
    bwd_errs: tuple | None         # rel err per gradient (None: no backward checked)
    tolerance: float               # the spec's bound for this dtype
    error: str | None = None       # an exception raised by the implementation, if any
    torch_fwd_errs: tuple | None = None    # PyTorch's errors on the same inputs (None: not measured)
    torch_bwd_errs: tuple | None = None
    fwd_floors: tuple | None = None        # rounding floors (None: not needed, see check_impl)
    bwd_floors: tuple | None = None

    def _bounds(self, errs: tuple, torch_errs: tuple | None, floors: tuple | None) -> tuple:
        twice_torch = [2 * e if math.isfinite(e) else 0.0 for e in torch_errs or ()]
        return tuple(max((self.tolerance, *twice_torch[i:i + 1], *(floors or ())[i:i + 1]))
                     for i in range(len(errs)))

    @staticmethod
    def _worst(errs: tuple, bounds: tuple) -> tuple[float, float]:
        """(err, bound) of the tensor closest to (or furthest past) its bound."""
        pairs = list(zip(errs, bounds))
        if not pairs:
            return 0.0, math.inf
        return max(pairs, key=lambda p: p[0] / p[1] if p[1] > 0 else math.inf)

    @property
    def fwd_bounds(self) -> tuple:
        return self._bounds(self.fwd_errs, self.torch_fwd_errs, self.fwd_floors)

    @property
    def bwd_bounds(self) -> tuple:
        return self._bounds(self.bwd_errs or (), self.torch_bwd_errs, self.bwd_floors)

    @property
    def fwd_err(self) -> float:
        """The error of the output closest to its bound (with one output, its error)."""
        return self._worst(self.fwd_errs, self.fwd_bounds)[0] if self.fwd_errs else math.inf

    @property
    def fwd_tol(self) -> float:
        return self._worst(self.fwd_errs, self.fwd_bounds)[1] if self.fwd_errs else self.tolerance

    @property
    def bwd_err(self) -> float | None:
        return None if self.bwd_errs is None else self._worst(self.bwd_errs, self.bwd_bounds)[0]

    @property
    def bwd_tol(self) -> float:
        return self._worst(self.bwd_errs, self.bwd_bounds)[1] if self.bwd_errs else self.tolerance

    @property
    def torch_fwd_err(self) -> float | None:
        return max(self.torch_fwd_errs, default=0.0) if self.torch_fwd_errs is not None else None

    @property
    def torch_bwd_err(self) -> float | None:
        return max(self.torch_bwd_errs, default=0.0) if self.torch_bwd_errs is not None else None

    @property
    def fwd_ok(self) -> bool:
        return (self.error is None and bool(self.fwd_errs)
                and all(e <= b for e, b in zip(self.fwd_errs, self.fwd_bounds)))

    @property
    def bwd_ok(self) -> bool:
        return self.fwd_ok and (self.bwd_errs is None
                                or all(e <= b for e, b in zip(self.bwd_errs, self.bwd_bounds)))

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
    PyTorch peer runs on a copy of the same inputs and its error on each tensor widens that
    tensor's bound (flash-attn's rule): a low-precision backward that consumes a rounded saved
    output cannot beat what that rounding costs PyTorch itself. fp32 is included because a
    one-element case can land where the result cancels (gelu'(z) crosses 0 at z = -0.7518:
    measured, PyTorch's own fp32 backward there is 1.3e-5 off, as is ours).

    PyTorch's error is one sample, though: on a sum that cancels (bias_act's dbias over 5 rows,
    terms of ~1 summing to 8e-4) it can land lucky (3.7e-6) where the terms' own fp32 rounding
    allows ~2e-4 (ours: 7e-5; CI, session 28). So a tensor still past both bounds gets the
    rounding floor as a third (:func:`rounding_floors`), computed only then.
    """
    tol = spec.tolerance.get(dtype, max(spec.tolerance.values(), default=1e-2))
    if backward is None:
        backward = spec.has_backward and bool(inputs.grad_args)
    baseline = None
    try:
        # the reference first, from the untouched inputs (the baseline runs on clones)
        ref = reference if reference is not None else ReferenceCache(spec, inputs)
    except Exception as exc:  # noqa: BLE001
        return CheckResult((math.inf,), None, tol, error=f"reference: {type(exc).__name__}: {exc}".strip()[:500])
    if torch_baseline and dtype != torch.float64 and "torch" in spec.peers:
        baseline = _torch_errors(spec, inputs, ref, backward, seed)
    try:
        fwd_errs, bwd_errs, gouts = _errors(fn, inputs, ref, backward, seed)
    except Exception as exc:  # noqa: BLE001 - any failure of an implementation is a FAILED row
        return CheckResult((math.inf,), None, tol, error=f"{type(exc).__name__}: {exc}".strip()[:500])
    chk = CheckResult(fwd_errs, bwd_errs, tol, torch_fwd_errs=baseline and baseline[0],
                      torch_bwd_errs=baseline and baseline[1])
    if not chk.ok and not _nonfinite(fwd_errs + (bwd_errs or ())):
        try:
            floors = rounding_floors(spec, ref, gouts, backward, dtype, seed)
        except Exception:  # noqa: BLE001 - no floor: the other bounds alone apply
            floors = None
        if floors is not None:
            chk = dataclasses.replace(chk, fwd_floors=floors[0], bwd_floors=floors[1])
    return chk


def _nonfinite(errs: tuple) -> bool:
    return any(not math.isfinite(e) for e in errs)


def _per_tensor_errs(outs: Sequence[Any], refs: Sequence[Any]) -> tuple:
    """:func:`rel_err` per pair of the flattened sequences; ``(inf,)`` if their lengths differ."""
    outs, refs = _flatten(outs), _flatten(refs)
    if len(outs) != len(refs):
        return (math.inf,)
    return tuple(rel_err(o, r) for o, r in zip(outs, refs))


def _errors(fn, inputs: Inputs, ref: ReferenceCache, backward: bool, seed: int) -> tuple[tuple, tuple | None, tuple]:
    """(errors per output, errors per gradient or None, the output gradients drawn)."""
    with torch.enable_grad():
        outs = as_tuple(fn(*inputs.args, **inputs.kwargs))
        fwd_errs = _per_tensor_errs(outs, ref.outs)
        bwd_errs, gouts = None, ()
        if backward:
            gouts = make_grad_outputs(outs, seed=seed)
            grads = backward_grads(outs, inputs, gouts)
            bwd_errs = _per_tensor_errs(grads, ref.grads(gouts, seed=seed))
    return fwd_errs, bwd_errs, gouts


def _torch_errors(spec, inputs, reference, backward, seed) -> tuple[tuple, tuple | None] | None:
    """The errors of the spec's PyTorch peer on a fresh copy of ``inputs`` (None if it fails)."""
    try:
        peer = spec.peers["torch"]()
        if peer is None:
            return None
        ref = reference if reference is not None else ReferenceCache(spec, inputs)
        return _errors(peer, inputs.cloned(), ref, backward, seed)[:2]
    except Exception:  # noqa: BLE001 - no baseline: the spec's bound alone applies
        return None


# a result as accurate as its inputs allow is a few roundings per term off; the floor is this many
# times the reference's own movement under one rounding of every input (a random-sign sample)
ROUNDING_FLOOR_FACTOR = 4
ROUNDING_FLOOR_DRAWS = 2


def rounding_floors(spec: OpSpec, ref: ReferenceCache, grad_outputs: tuple, backward: bool,
                    dtype: torch.dtype, seed: int = 0) -> tuple[tuple, tuple | None]:
    """Per output and per gradient, the larger of two movements of the fp64 reference, each the
    largest relative change over ``ROUNDING_FLOOR_DRAWS`` draws in which every floating input and
    output gradient is multiplied by (1 ± u), signs random:

    * ``ROUNDING_FLOOR_FACTOR`` times the movement at u = fp32's unit roundoff (``dtype``'s if
      finer): the accuracy a kernel that accumulates in fp32 cannot beat on these very inputs. A
      sum of terms ~1 that cancels to 8e-4 moves by ~u·‖terms‖ / 8e-4 ≈ 2e-4 relative, a well
      conditioned result by ~u ≈ 6e-8.
    * for 16-bit dtypes, the movement at u = ``dtype``'s own unit roundoff: the backward error a
      16-bit input carries anyway. A well conditioned result moves by ~u (below the dtype's
      tolerance); one that cancels, by what one rounding of its inputs costs it. (bias_act's
      fp16 gradient at 1 x 1: gelu'(z) crosses 0 at z = -0.7518, where the 16-bit path's short erf
      fit, 2.4e-5 relative on Φ, left 6.9 % of a tiny result, and PyTorch's own error was 2.6e-4
      only when x + b happened to be exact in fp16: ~1e-3 of CI runs failed; s45.)

    Non-finite values (a reference that is exactly 0) give 0."""
    u32 = 2.0 ** -24 if torch.finfo(dtype).bits <= 32 else torch.finfo(dtype).eps / 2
    fwd, bwd = _reference_movement(spec, ref, grad_outputs, backward, u32, seed, draws=seed)
    fwd, bwd = [ROUNDING_FLOOR_FACTOR * e for e in fwd], bwd and [ROUNDING_FLOOR_FACTOR * e for e in bwd]
    if torch.finfo(dtype).bits == 16:
        fwd16, bwd16 = _reference_movement(spec, ref, grad_outputs, backward, torch.finfo(dtype).eps / 2, seed,
                                           draws=seed + 1)
        fwd = [max(a, b) for a, b in zip(fwd, fwd16)]
        bwd = bwd and [max(a, b) for a, b in zip(bwd, bwd16)]

    def finite(errs):
        return tuple(e if math.isfinite(e) else 0.0 for e in errs)

    return finite(fwd), None if bwd is None else finite(bwd)


def _reference_movement(spec: OpSpec, ref: ReferenceCache, grad_outputs: tuple, backward: bool, u: float,
                        seed: int, draws: int) -> tuple[list, list | None]:
    """The largest relative change of each reference output (and gradient) over the draws of
    :func:`rounding_floors` at unit roundoff ``u``; ``seed``: the grad_outputs' (the reference's
    cached gradients), ``draws``: the signs'."""
    gen = torch.Generator().manual_seed(draws)

    def nudge(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        sign = torch.randint(0, 2, t.shape, generator=gen, dtype=torch.float64).mul_(2).sub_(1)
        return t.detach().to(torch.float64) * (1 + u * sign.to(t.device))

    fwd = [0.0] * len(_flatten(ref.outs))
    bwd = None
    base_grads = _flatten(ref.grads(grad_outputs, seed=seed)) if backward else []
    if backward:
        bwd = [0.0] * len(base_grads)
    for _ in range(ROUNDING_FLOOR_DRAWS):
        args = tuple(nudge(a) for a in ref.inputs.args)
        moved = Inputs(tuple(a.requires_grad_(i in ref.inputs.grad_args) if isinstance(a, torch.Tensor) else a
                             for i, a in enumerate(args)), dict(ref.inputs.kwargs), ref.inputs.grad_args)
        with torch.enable_grad():
            outs = as_tuple(spec.reference(*moved.args, **moved.kwargs))
            fwd = [max(f, e) for f, e in zip(fwd, _per_tensor_errs(outs, ref.outs))]
            if backward:
                gs = tuple(None if g is None else nudge(g.to(ref.device) if ref.device is not None else g)
                           for g in grad_outputs)
                errs = _per_tensor_errs(backward_grads(outs, moved, gs), base_grads)
                bwd = [max(f, e) for f, e in zip(bwd, errs)]
    return fwd, bwd


# ----------------------------------------------------------------------------------------------
# a small Llama-style model, in tilefuse's drop-ins or in torch's modules (same parameter names):
# tests/test_autocast.py checks a training step of it, scripts/autocast_step.py times one
# ----------------------------------------------------------------------------------------------


class LlamaBlock(torch.nn.Module):
    """RMSNorm, fused-qkv causal attention, SwiGLU MLP, residual stream in the parameters' dtype.
    ``fused``: tilefuse's Linear / RMSNorm / SDPA / fused gate; else torch's modules and ops."""

    def __init__(self, fused: bool, dim: int, heads: int, ffn: int):
        super().__init__()
        from . import nn as tnn

        linear = tnn.Linear if fused else torch.nn.Linear
        norm = tnn.RMSNorm if fused else torch.nn.RMSNorm
        self.fused, self.heads = fused, heads
        self.norm1, self.norm2 = norm(dim, eps=1e-6), norm(dim, eps=1e-6)
        self.qkv = linear(dim, 3 * dim, bias=False)
        self.o = linear(dim, dim, bias=False)
        self.mlp = tnn.SwiGLUMLP(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from . import nn as tnn

        b, s, d = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2))
        sdpa = tnn.functional.scaled_dot_product_attention if self.fused else torch.nn.functional.scaled_dot_product_attention
        x = x + self.o(sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        if self.fused:
            return x + self.mlp(h)
        mlp = self.mlp
        return x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


class LlamaStack(torch.nn.Module):
    """``blocks`` :class:`LlamaBlock` s and an LM head; ``forward(x, target)`` is the loss
    (tilefuse: linear_cross_entropy, ``check_targets`` as set; torch: the logits, then F.cross_entropy)."""

    def __init__(self, fused: bool, blocks: int, dim: int, heads: int, ffn: int, vocab: int):
        super().__init__()
        self.fused = fused
        self.check_targets = True      # the range test's host sync (linear_cross_entropy's default)
        self.blocks = torch.nn.ModuleList(LlamaBlock(fused, dim, heads, ffn) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from .ops.linear_cross_entropy import linear_cross_entropy

        for block in self.blocks:
            x = block(x)
        if self.fused:
            return linear_cross_entropy(x, self.head.weight, target, check_targets=self.check_targets)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), target.flatten())
