"""The op registry: every op is described once, as data; tests and `tilefuse bench` iterate it.

An :class:`OpSpec` says how to build inputs for a shape, how to run the tilefuse kernel and the
PyTorch reference on them, how many bytes and FLOPs the op must move per pass, which shapes the
tests and the benchmark use, and which peers the benchmark puts beside it.

Passes are named ``"fwd"`` and ``"bwd"``; ``bytes_fn(shape, dtype, pass_)`` counts the ideal
traffic of that pass (each input read once, each output written once; small vectors such as a
norm's weight or per-row statistics are counted too, they are exact, not rounded away).

``flops_fn(shape, pass_)`` counts the arithmetic of the op's formula as its reference writes it:
one FLOP per scalar add, subtract, multiply, divide or comparison (a max), one per call of an
elementary function (exp, log, sqrt, rsqrt, erfc, sigmoid: what one SFU call or a short
polynomial does), two per multiply-add of a matrix product; a reduction over n values counts
n - 1 adds. Every op declares it, memory-bound ones too: the benchmark divides FLOPs by bytes
(the arithmetic intensity) and reports a pass against the ceiling that binds it on the measured
roofline (``bench.runner.throughput``): below the ridge point (matmul TFLOP/s / copy GB/s) in
GB/s and % of copy, above it in TFLOP/s and % of the bf16 matmul.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

Shape = tuple[int, ...]


@dataclasses.dataclass
class Inputs:
    """Arguments for one call: ``fn(*args, **kwargs)``.

    ``grad_args`` are the positions in ``args`` whose tensors receive gradients in the backward
    check; they are leaf tensors with ``requires_grad=True``.
    """

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    grad_args: tuple[int, ...] = ()

    def detached(self, dtype: torch.dtype | None = None, device: Any = None) -> "Inputs":
        """A copy whose tensors are fresh leaves (optionally cast/moved), same grad_args."""

        def conv(i, a):
            if not isinstance(a, torch.Tensor):
                return a
            b = a.detach()
            if dtype is not None and b.is_floating_point():
                b = b.to(dtype)
            if device is not None:
                b = b.to(device)
            return b.requires_grad_(i in self.grad_args)

        return Inputs(tuple(conv(i, a) for i, a in enumerate(self.args)), dict(self.kwargs), self.grad_args)

    def cloned(self) -> "Inputs":
        """Fresh leaves with their own storage: for running an implementation that may update
        its inputs in place (an optimizer step, an in-place gradient) without touching these."""
        def conv(i, a):
            if not isinstance(a, torch.Tensor):
                return a
            return a.detach().clone().requires_grad_(i in self.grad_args)

        return Inputs(tuple(conv(i, a) for i, a in enumerate(self.args)), dict(self.kwargs), self.grad_args)


@dataclasses.dataclass
class OpSpec:
    name: str
    fn: Callable[..., Any]                       # the public tilefuse function
    reference: Callable[..., Any]                # plain PyTorch, same signature; run on fp64 inputs
    make_inputs: Callable[[Shape, torch.dtype, Any], Inputs]  # (shape, dtype, device) -> fresh random Inputs
    bytes_fn: Callable[[Shape, torch.dtype, str], int]         # ideal bytes moved by one pass
    flops_fn: Callable[[Shape, str], int] = lambda shape, pass_: 0   # FLOPs of one pass (module docstring)
    test_shapes: Sequence[Shape] = ()            # small, odd, every code path; CI runs them interpreted
    gpu_test_shapes: Sequence[Shape] = ()        # large shapes, run only on CUDA
    bench_shapes: Sequence[Shape] = ()           # real LLM sizes, for the GPU
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16)
    # peers: name -> factory returning a callable with fn's signature, or None when unavailable
    peers: dict[str, Callable[[], Callable[..., Any] | None]] = dataclasses.field(default_factory=dict)
    # relative-error-norm bound per dtype (see tests/README of tolerances in tests/conftest.py)
    tolerance: dict[torch.dtype, float] = dataclasses.field(
        default_factory=lambda: {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    )
    has_backward: bool = True
    # False for ops that compute their gradients inside the forward (cross-entropy, linear
    # cross-entropy): their fwd and bwd passes do other work than a peer's, so the benchmark
    # reports no per-pass throughput for them -- only fwd+bwd is comparable
    split_passes: bool = True
    # False for ops whose calls cannot be captured in a CUDA graph (``tilefuse bench --cuda-graph``
    # skips them): a forward that checks its inputs on the host, a gradient written into an input
    # in place. A capture that fails half-way leaves torch's CUDA RNG unusable for the process.
    graph_capturable: bool = True
    # False when the backward writes its gradient into a tensor the forward saved (the deferred
    # cross-entropy's gradient lands in the logits): it cannot be replayed with retain_graph, so
    # the benchmark times it only inside fwd+bwd and marks the bwd row SKIPPED
    repeatable_backward: bool = True
    description: str = ""


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"op {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> OpSpec:
    _load_ops()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def all_ops() -> list[OpSpec]:
    _load_ops()
    return list(_REGISTRY.values())


def _load_ops() -> None:
    # importing the ops package registers every op (each op file calls register() at import)
    import tilefuse.ops  # noqa: F401


def as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def tensor_bytes(shape: Shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()
