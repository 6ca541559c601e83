"""nn.Module drop-in for torch.nn.Linear (same arguments, parameters and state_dict keys).

``forward(x)`` is ``tilefuse.matmul(x, weight.t(), bias)``: the weight is read in place through
its transposed view (no copy), the bias is added in the GEMM's epilogue, and the backward
writes the weight gradient straight into the weight's row-major layout.
"""

from __future__ import annotations

import torch

from ..ops.matmul import matmul


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (subclassed: same constructor, parameters, state_dict and repr)
    running ``tilefuse.matmul``: y = x @ weightᵀ + bias, fp32 accumulation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight.t(), self.bias)
