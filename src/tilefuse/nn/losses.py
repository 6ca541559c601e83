"""Loss modules: a drop-in for torch.nn.CrossEntropyLoss and a fused linear + cross-entropy loss."""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.cross_entropy import check_ce_options, cross_entropy
from ..ops.linear_cross_entropy import linear_cross_entropy


def _options_repr(module: torch.nn.Module, *extra: str) -> str:
    """The loss options every cross-entropy module has, then its own (``extra``), as ``name=value``."""
    names = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap") + extra
    return ", ".join(f"{n}={getattr(module, n)!r}" for n in names)


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss(ignore_index, reduction, label_smoothing)``, plus ``z_loss`` and
    ``softcap``; see :func:`tilefuse.cross_entropy`. As torch's, the input is ``[C]``, ``[N, C]`` or
    ``[N, C, d1, ...]`` (classes in dim 1) with target ``[]``, ``[N]`` or ``[N, d1, ...]``; for an LM's
    ``[B, T, V]`` logits flatten them to ``[B·T, V]`` (or call :func:`tilefuse.cross_entropy`, whose
    class dim is the last). ``reduction="none"`` returns target's shape.

    ``logits_inplace_grad=True`` lets the op overwrite the logits with their gradient (no [T, V]
    buffer of its own); only use it where nothing reads the logits after the loss.
    ``defer_grad=True`` computes the gradient in the backward (better when the loss is scaled or
    accumulated before ``backward``; see :func:`tilefuse.cross_entropy`).
    Class weights (torch's ``weight``) are not supported.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        logits_inplace_grad: bool = False,
        defer_grad: bool = False,
    ) -> None:
        super().__init__()
        check_ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
        self.defer_grad = defer_grad
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logits_inplace_grad = logits_inplace_grad

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        if input.dim() > 2:     # torch's [N, C, d1, ...]: the kernels read the class dim last
            input = input.movedim(1, -1)
        return cross_entropy(input, target, self.ignore_index, self.label_smoothing, self.z_loss, self.softcap,
                             self.reduction, logits_inplace_grad=self.logits_inplace_grad,
                             defer_grad=self.defer_grad)

    def extra_repr(self) -> str:
        return _options_repr(self, "logits_inplace_grad", "defer_grad")


class LinearCrossEntropyLoss(torch.nn.Module):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` without materializing the logits; see
    :func:`tilefuse.linear_cross_entropy`. The projection is an argument of ``forward`` (usually
    the model's ``lm_head.weight``), so the module holds no parameters."""

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        reduction: str = "mean",
        chunk_tokens: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.reduction = reduction
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.label_smoothing,
                                    self.z_loss, self.softcap, self.reduction, chunk_tokens=self.chunk_tokens)

    def extra_repr(self) -> str:
        return _options_repr(self, "chunk_tokens")
