"""Which path runs an op.

* CUDA tensors run the Triton kernels.
* CPU tensors run the PyTorch reference path (computed in fp32, cast back to the input dtype),
  so tilefuse functions work anywhere torch does.
* With ``TRITON_INTERPRET=1`` in the environment, CPU tensors run the Triton kernels through
  Triton's interpreter instead: that is how CI, which has no GPU, tests the real kernels.
"""

from __future__ import annotations

import functools
import os
import threading

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tracing() -> bool:
    """torch.compile / FakeTensor / functionalization or another dispatch mode is active."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t``'s op should launch the Triton kernel rather than the reference."""
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and interpreting()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def device_major(t: torch.Tensor) -> int:
    """Compute-capability major of t's GPU, 0 off CUDA (a cached plan's device key)."""
    if t.device.type != "cuda":
        return 0
    return _major(t.device.index if t.device.index is not None else torch.cuda.current_device())


def is_hopper_or_newer(t: torch.Tensor) -> bool:
    """t lives on an sm_90+ GPU (TMA descriptors, wgmma); cached per device (the query costs
    several µs of host time per call)."""
    if t.device.type != "cuda":
        return False
    return _major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


def is_ampere_or_newer(t: torch.Tensor) -> bool:
    """t lives on an sm_80+ GPU (``mma.sync`` with bf16, what the Gluon int4 kernel uses)."""
    if t.device.type != "cuda":
        return False
    return _major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 8


def is_hopper(t: torch.Tensor) -> bool:
    """t lives on an sm_90 GPU exactly (warpgroup MMA: not on sm_100+, which has tcgen05 instead)."""
    if t.device.type != "cuda":
        return False
    return _major(t.device.index if t.device.index is not None else torch.cuda.current_device()) == 9


def num_sms(t: torch.Tensor) -> int:
    """Multiprocessors of t's device; a small stand-in under the interpreter (grid sizes only)."""
    if t.device.type == "cuda":
        return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def device_traits(device: torch.device) -> tuple[int, bool, bool]:
    """(SMs, sm_90, sm_90 or newer) of a device: the part of a launch plan's key it fixes, looked
    up once per device (three separate queries cost ~2 µs of host time per launch)."""
    probe = torch.empty(0, device=device)
    return num_sms(probe), is_hopper(probe), is_hopper_or_newer(probe)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last_dim]`` tensor with unit column stride (a view when possible)."""
    if x.dim() == 2 and x.stride(1) == 1:      # the common case, without a reshape (~1 µs)
        return x
    n = x.shape[-1] if x.dim() else 1
    m = 1
    for s in x.shape[:-1]:
        m *= s
    x2 = x.reshape(m, n)        # explicit row count: reshape(-1, 0) is ambiguous
    if x2.stride(-1) != 1 and n > 1:
        x2 = x2.contiguous()
    return x2


# Tests set this (tilefuse.testing.poison_outputs) so every output buffer starts as NaN: an
# element a kernel forgets to write then fails the comparison instead of passing by luck.
POISON_OUTPUTS = False


def contiguous_strides(shape: tuple) -> tuple:
    """The strides (elements) of a contiguous tensor of ``shape`` (a cached plan's view of an
    output it allocates per call)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; NaN-filled while POISON_OUTPUTS is on (tests).
    (An int or a tuple of ints as ``shape`` costs ~1 µs of host time less than a torch.Size.)"""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def packed_output(shape, dtype: torch.dtype, device, cu_seqlens: torch.Tensor, fill: float = 0.0,
                  row_dim: int = 0) -> torch.Tensor:
    """Output of a varlen kernel, which writes only the rows ``[cu_seqlens[0], cu_seqlens[-1])``
    along ``row_dim`` (a packed buffer may hold padding before or after the sequences): the
    others are ``fill``. While POISON_OUTPUTS is on (tests), the rows the kernel must write start
    as NaN (reading the offsets there is a host sync: tests only)."""
    t = torch.full(shape, fill, dtype=dtype, device=device)
    if POISON_OUTPUTS and t.numel() and cu_seqlens.numel():
        n = t.shape[row_dim]
        lo, hi = (min(max(int(x), 0), n) for x in (cu_seqlens[0], cu_seqlens[-1]))
        t.narrow(row_dim, lo, max(hi - lo, 0)).fill_(float("nan"))
    return t


_GRID_SYNC: dict = {}


def grid_sync_counters(device: torch.device) -> "torch.Tensor | None":
    """Two zeroed int32 counters for a kernel's grid barrier (one that counts its programs in and
    out and leaves both counters zero), per (device, stream, host thread): launches on one stream
    run one after another, so one pair serves them all. None under CUDA-graph capture (a replay
    may run beside eager work on the same stream): the caller takes its barrier-free path."""
    if device.type != "cuda":        # the interpreter: launches run to completion one by one
        key = (str(device), None, threading.get_ident())
    elif torch.cuda.is_current_stream_capturing():
        return None
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident())
    counters = _GRID_SYNC.get(key)
    if counters is None:
        counters = _GRID_SYNC[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counters


COOPERATIVE_REFUSED: set = set()   # refusal keys of grids a GPU would not co-schedule (two launches)


def collectives_may_overlap() -> bool:
    """torch.distributed is initialized, so collectives may run beside compute on another stream.
    NCCL's kernels hold their SMs whole, and a cooperative grid sized to every SM cannot start
    until all its programs fit: the launch would wait for the collective and lose the overlap
    that DDP / FSDP are built on. The one-launch backwards (a grid barrier) then take their two
    launches."""
    return _DIST_AVAILABLE and torch.distributed.is_initialized()


_DIST_AVAILABLE = torch.distributed.is_available()


def cooperative_launch(kernel, grid: tuple, tensors: tuple, prepared, refusal_key) -> "torch.Tensor | None":
    """Launch a prepared kernel whose programs meet at a grid barrier (``prepared`` has
    ``launch_cooperative_grid=True``; the barrier's counters, :func:`grid_sync_counters`, go in
    as its last tensor argument), so CUDA runs it only if every program is resident at once.
    Returns the counters; None, with nothing launched, under CUDA-graph capture, beside possible
    collectives (:func:`collectives_may_overlap`), or where the GPU refuses the grid (another
    process holding SMs, a sweep's programs per SM; remembered under ``refusal_key`` -- device,
    grid, plan -- so later calls skip the try): the caller then takes
    its barrier-free path (a second launch)."""
    if refusal_key in COOPERATIVE_REFUSED or collectives_may_overlap():
        return None
    sync = grid_sync_counters(tensors[0].device)
    if sync is None:
        return None
    try:
        kernel.launch_prepared(grid, (*tensors, sync), prepared)
    except RuntimeError as exc:    # refused before anything ran
        if "cooperative" not in str(exc).lower():
            raise
        COOPERATIVE_REFUSED.add(refusal_key)
        return None
    return sync


_WORKSPACES: dict = {}
WORKSPACE_ENTRIES = 32      # kept before the cache starts over (distinct shapes, streams, threads)


def workspace(purpose: str, shapes: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
    """Contiguous tensors of ``shapes`` (one buffer) for intermediates an op writes and reads
    back within one call, in stream order (split-KV partials, dw / db partials, row statistics).

    ``purpose`` names the buffer's role (one per buffer an op holds at once: two roles of one
    call with equal shapes must not share memory). The tensors are reused across calls, per
    (purpose, device, stream, host thread, dtype, shapes): a ``torch.empty`` costs 5-8 µs of
    host time on the H200 host, a lookup well under one. That is
    safe because the next call from the same thread on the same stream runs after this call's
    last read of them; another stream or thread gets its own. (CPU tensors reach the kernels only
    under the interpreter, which runs each launch to completion: reused the same way, so CI tests
    this path.) Fresh memory instead under CUDA-graph capture (a replay may run beside eager work
    on this stream) and while tests poison outputs (NaN: an element a kernel forgets to write
    must not read a previous call's value)."""
    cuda = device.type == "cuda"
    if POISON_OUTPUTS or (cuda and torch.cuda.is_current_stream_capturing()):
        return tuple(empty(s, dtype, device) for s in shapes)
    if cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (purpose, index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident(), dtype, shapes)
    else:
        key = (purpose, str(device), None, threading.get_ident(), dtype, shapes)
    views = _WORKSPACES.get(key)
    if views is None:
        if len(_WORKSPACES) >= WORKSPACE_ENTRIES:
            _WORKSPACES.clear()      # the caching allocator reuses freed blocks in stream order
        sizes = [functools.reduce(lambda a, b: a * b, s, 1) for s in shapes]
        starts = [0]
        for n in sizes:              # each view 64-byte aligned (16 elements of up to 4 bytes)
            starts.append(starts[-1] + -(-n // 16) * 16)
        buf = torch.empty(starts[-1], dtype=dtype, device=device)
        views = _WORKSPACES[key] = tuple(buf[o:o + n].view(s) for o, n, s in zip(starts, sizes, shapes))
    return views


def clear_workspaces() -> None:
    """Release the buffers :func:`workspace` keeps (to the caching allocator)."""
    _WORKSPACES.clear()


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous output of x's shape (``empty`` semantics): ``torch.empty_like`` is the
    cheapest allocation on the host (~1.5 µs against ~3.5 for ``torch.empty(x.shape)``)."""
    t = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    if POISON_OUTPUTS and t.is_floating_point():
        t.fill_(float("nan"))
    return t


# Host-side integer helpers. triton.cdiv and triton.next_power_of_2 are constexpr functions in
# Triton 3.6: every host call unwraps its arguments through the constexpr machinery (~4 µs on the
# CI CPU, 4-8 calls per op call). Launchers use these plain versions (same results).


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), as ``triton.cdiv``."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (0 for n = 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
