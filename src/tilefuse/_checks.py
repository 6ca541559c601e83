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


def _injective(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a strided layout's dims nest (each stride beyond the reach of the smaller-strided
    dims), so that no two indices share an element. Sufficient, not necessary: every slice and
    permutation of a contiguous tensor passes."""
    reach = 0
    for n, st in sorted(((n, st) for n, st in zip(shape, strides) if n > 1), key=lambda p: p[1]):
        if st <= reach:
            return False
        reach += (n - 1) * st
    return True


def byte_span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last (non-negative strides)."""
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0


def may_share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` can have a memory element in common: False when their byte ranges
    are disjoint; exact for two views of one layout that differ in one dim's range (q and k
    sliced from a packed qkv buffer, along the heads or any other dim); True when the layouts
    are such that it cannot tell (the caller refuses the call). ``torch._C._overlaps`` is no
    help: it calls a packed buffer's q and k slices overlapping."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    size = a.element_size()
    delta = b.data_ptr() - a.data_ptr()
    if delta >= byte_span(a) or -delta >= byte_span(b):   # live tensors of two storages never share addresses
        return False
    if (b.element_size() != size or a.dim() != b.dim() or delta % size
            or any(min(st) < 0 for st in zip(a.stride(), b.stride()))):
        return True
    delta //= size
    for m in range(a.dim()):
        others_same = all(a.shape[i] == b.shape[i] and (a.shape[i] == 1 or a.stride(i) == b.stride(i))
                          for i in range(a.dim()) if i != m)
        st = a.stride(m)
        if not others_same or st <= 0 or delta % st or (a.shape[m] > 1 and b.shape[m] > 1 and b.stride(m) != st):
            continue
        c = delta // st     # b's range along dim m starts c steps past a's
        lo, hi = min(0, c), max(a.shape[m], c + b.shape[m])
        extended = list(a.shape)
        extended[m] = hi - lo
        if _injective(extended, a.stride()):
            return max(0, c) < min(a.shape[m], c + b.shape[m])    # do [0, n_a) and [c, c + n_b) meet
    return True


class DisjointByOffset:
    """An eager fast path's memory of which address offsets between two arguments were proven to
    share no element, for one call layout (shapes and strides fixed by the cache key, addresses
    not): a call passes at once when the byte ranges are apart or its offset was proven before
    (a packed buffer's two slices keep theirs), else ``refuse(a, b)`` runs the full test (and
    raises where the two may share)."""
    __slots__ = ("span_a", "span_b", "proven")

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.span_a, self.span_b, self.proven = byte_span(a), byte_span(b), set()

    def check(self, a: torch.Tensor, b: torch.Tensor, refuse) -> None:
        delta = b.data_ptr() - a.data_ptr()
        if delta >= self.span_a or -delta >= self.span_b or delta in self.proven:
            return
        refuse(a, b)
        if len(self.proven) < 64:
            self.proven.add(delta)
