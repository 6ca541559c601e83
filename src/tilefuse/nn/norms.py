"""nn.Module drop-ins for torch.nn.LayerNorm / torch.nn.RMSNorm (same arguments and state_dict).

``forward(x, residual=None)``: with a residual the module returns ``(norm(x + residual), x + residual)``
from one fused kernel, the pre-norm transformer's ``hidden = hidden + residual; norm(hidden)``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..ops.norms import layer_norm, rms_norm

_Shape = Union[int, Sequence[int], torch.Size]


def _as_shape(normalized_shape: _Shape) -> tuple:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


class LayerNorm(torch.nn.Module):
    """``torch.nn.LayerNorm`` running tilefuse's kernels (fp32 math for fp16/bf16)."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(
        self,
        normalized_shape: _Shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, residual)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}")


class RMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` running tilefuse's kernels.

    ``offset`` (keyword, tilefuse-only) scales by ``offset + weight``: ``offset=1.0`` is Gemma's
    RMSNorm, whose checkpoints store ``weight - 1``. ``reset_parameters`` sets the weight to
    ``1 - offset`` so a fresh module always starts as the identity scale.
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine", "offset"]

    def __init__(
        self,
        normalized_shape: _Shape,
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        if self.offset and not elementwise_affine:
            raise ValueError("offset scales the weight: it needs elementwise_affine=True")
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, self.offset, residual)

    def extra_repr(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{extra}"
