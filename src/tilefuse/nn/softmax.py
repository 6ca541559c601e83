"""nn.Module drop-ins for torch.nn.Softmax / torch.nn.LogSoftmax (same arguments, no state)."""

from __future__ import annotations

import torch

from ..ops.softmax import log_softmax, softmax


def _dim(dim: int | None, x: torch.Tensor) -> int:
    """torch.nn.Softmax's dim; None is torch's legacy implicit choice (0 for 0-, 1- and 3-D
    input, else 1; torch warns that it is deprecated), so a module built without dim agrees."""
    if dim is not None:
        return dim
    return 0 if x.dim() in (0, 1, 3) else 1


class Softmax(torch.nn.Module):
    """``torch.nn.Softmax(dim)`` running tilefuse's kernel (fp32 math for fp16/bf16)."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, _dim(self.dim, x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """``torch.nn.LogSoftmax(dim)`` running tilefuse's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, _dim(self.dim, x))
