"""Shared input validation: every public op checks its inputs here before any launch.

Each helper raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape, device, layout)
with a message that names the argument, so a user sees which input was wrong, never garbage.
"""

from __future__ import annotations

from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    t: object,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    min_dim: int = 0,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported: {allowed}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors live on one device; the message names the odd one out."""
    first_name, device = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            first_name, device = name, t.device
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {device}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int], what: str = "") -> None:
    if tuple(t.shape) != tuple(shape):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}{extra}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Row kernels walk the last dim with stride 1 and leading dims as one flattened row index."""
    if t.dim() and t.stride(-1) != 1 and t.numel() > 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride()})")


def check_writable(name: str, t: torch.Tensor, what: str) -> None:
    """A tensor written in place must not have elements sharing memory (an ``expand``-ed view):
    each write would land on the shared element, and the last one win. torch raises for the same
    write ("more than one element of the written-to tensor refers to a single memory location")."""
    if any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride())):   # torch's "YES" overlap case
        raise ValueError(f"{name} is written in place ({what}) but several of its elements share memory "
                         f"(strides {t.stride()}, e.g. an expanded view): pass a tensor of its own (.clone())")


def check_dim(name: str, t: torch.Tensor, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__}")
    nd = max(t.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"{name}: dim {dim} out of range for a tensor of {t.dim()} dimension(s)")
    return dim % nd
