"""nn.Module drop-ins for torch.nn.LayerNorm / torch.nn.RMSNorm (same arguments and state_dict).

``forward(x, residual=None)``: with a residual the module returns ``(norm(x + residual), x + residual)``
from one fused kernel, the pre-norm transformer's ``hidden = hidden + residual; norm(hidden)``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..ops.norms import layer_norm, rms_norm

_Shape = Union[int, Sequence[int], torch.Size]


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (subclassed: same constructor, parameters, state_dict and repr)
    running tilefuse's kernels (fp32 math for fp16/bf16); ``forward`` also takes a residual."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, residual)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (subclassed: same constructor, parameters, state_dict and repr)
    running tilefuse's kernels; ``forward`` also takes a residual.

    ``offset`` (keyword, tilefuse-only) scales by ``offset + weight``: ``offset=1.0`` is Gemma's
    RMSNorm, whose checkpoints store ``weight - 1``. ``reset_parameters`` sets the weight to
    ``1 - offset`` so a fresh module always starts as the identity scale.
    """

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
        self.offset = float(offset)
        if self.offset and not elementwise_affine:
            raise ValueError("offset scales the weight: it needs elementwise_affine=True")
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, self.offset, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", offset={self.offset}" if self.offset else "")
