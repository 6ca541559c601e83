"""nn.Module drop-ins for torch.nn.Softmax / torch.nn.LogSoftmax (same arguments, no state)."""

from __future__ import annotations

import torch

from ..ops.softmax import log_softmax, softmax


class Softmax(torch.nn.Module):
    """``torch.nn.Softmax(dim)`` running tilefuse's kernel (fp32 math for fp16/bf16)."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, -1 if self.dim is None else self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """``torch.nn.LogSoftmax(dim)`` running tilefuse's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, -1 if self.dim is None else self.dim)
