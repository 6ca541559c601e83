"""``tilefuse.fp8``: fp8 GEMMs with current (dynamic) scaling, and an fp8 training ``Linear``.

    from tilefuse import fp8
    q, scale = fp8.quantize_fp8(x, torch.float8_e4m3fn, scaling="row")      # x ≈ q.float() * scale
    y = fp8.scaled_matmul(q, scale, w_q, w_scale, bias)                      # pre-quantized operands
    y = fp8.matmul(x, w, scaling="row")           # quantize both on the fly + fp8 GEMM, differentiable
    layer = fp8.Linear(4096, 4096)                # nn.Linear drop-in, fp8 forward and backward

Training recipe of :class:`Linear` (current scaling: every scale comes from the tensor being
quantized, in the same step; no amax history, no delayed scaling):

* master weight and bias stay in the parameter dtype (fp32 or bf16); the optimizer never sees fp8;
* forward ``y = x Wᵀ + b``: x quantized to e4m3 per row (one scale per token), W to e4m3 per
  output channel (one scale per row of W), one fp8 GEMM with fp32 accumulation, both scales and
  the bias applied in its epilogue; y in x's dtype (the autocast dtype under torch.autocast);
* backward, every operand per-tensor scaled: dy quantized once to ``grad_dtype`` (e5m2 by default:
  gradients need range more than precision; e4m3 selectable) in both layouts from one read,
  ``dx = q(dy) @ q(W)`` (W re-quantized as the K-major ``Wᵀ`` [K, N] by the transposing quantize
  kernel), ``dW = q(dy)ᵀ @ q(x)`` (``dyᵀ`` and ``xᵀ`` written K-major by the same kernel), ``db =
  Σ dy`` in fp32; dx in x's dtype, dW and db in the parameters' dtype;
* saved for the backward: x and W in their own dtype (as nn.Linear saves them), plus the forward
  quantization's per-program amax partials of each (a few floats): the backward's per-tensor
  scales of x and W are their maxima, so its quantizations of x and W skip the amax pass (the same
  scale bit for bit; 9 kernel launches per step instead of 11).

Accuracy (see ``tilefuse.ops.fp8`` for the model): forward relative error ~0.04 (bound 0.09),
backward ~0.06 (bound 0.15) against the exact fp64 product; the loss curve of a small model
trained this way tracks bf16 closely (``scripts/fp8_train_curve.py``).
"""

from __future__ import annotations

import torch

from ._autocast import autocast_dtype
from .ops._fp8_kernels import FP8_DTYPES, FP8_MAX
from .ops.fp8 import (E4M3, E5M2, matmul, matmul_reference, quantize_fp8, quantize_reference, scaled_matmul,
                      scaled_matmul_reference)

__all__ = ["matmul", "scaled_matmul", "quantize_fp8", "Linear", "FP8_DTYPES", "FP8_MAX", "E4M3", "E5M2",
           "matmul_reference", "scaled_matmul_reference", "quantize_reference", "swap_linears"]


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (subclassed: same constructor, parameters, state_dict keys and repr)
    computing ``y = x @ weightᵀ + bias`` in fp8 with the recipe of the module docstring.

    ``grad_dtype``: the output gradient's fp8 format in the backward (``torch.float8_e5m2``
    default, or ``torch.float8_e4m3fn``); ``use_fast_accum``: sm_90's faster, reduced-precision
    tensor-core accumulation."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 grad_dtype: torch.dtype = E5M2, use_fast_accum: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if grad_dtype not in FP8_DTYPES:
            raise TypeError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2; got {grad_dtype}")
        self.grad_dtype = grad_dtype
        self.use_fast_accum = use_fast_accum

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **kwargs) -> "Linear":
        """An fp8 Linear sharing ``linear``'s parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", **kwargs)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y in x's dtype, or autocast's: x and W are quantized from their own dtypes either way
        out_dtype = autocast_dtype(x) or x.dtype
        return matmul(x, self.weight, "row", out_dtype, self.bias, self.grad_dtype, self.use_fast_accum)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grad_dtype={str(self.grad_dtype).replace('torch.', '')}"


def swap_linears(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` inside ``module`` (in place, recursively; at every name
    a layer is registered under) by an fp8 :class:`Linear` sharing its parameters; returns
    ``module``. Linears the model does not use as ``x @ W.T + b`` stay (a subclass with its own
    forward, a forward replaced on the instance, module hooks, ``nn.MultiheadAttention``'s
    ``out_proj``: :func:`tilefuse.quantization.linear_swap_reason`). A bare Linear raises a
    TypeError (it cannot replace itself: use :meth:`Linear.from_linear`)."""
    from .quantization import linear_paths, linear_swap_reason, replace_at

    for layer, names in linear_paths(module, "swap_linears", "fp8.Linear.from_linear(layer)").values():
        if not isinstance(layer, Linear) and linear_swap_reason(module, names, layer) is None:
            replace_at(module, names, Linear.from_linear(layer, **kwargs))
    return module
