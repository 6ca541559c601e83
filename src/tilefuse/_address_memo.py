"""``AddressMemo``: an op plan's launches kept by the addresses of their tensors.

A cached op plan (``_matmul_kernels._matmul_plan``) fixes every argument of its kernel's launch
except the tensors' addresses. So a launch repeated at the addresses of an earlier one -- a
training step's GEMMs at the caching allocator's addresses of the step before, a decode step's
at those of the token before -- can call the compiled kernel's C launcher with the argument list
the first one built, below ``fast_launch``'s per-launch key, descriptor lookups and expansion.
On the H200 host a Gluon GEMM launch went 42-59 -> 17-23 µs this way (cuBLAS 15-21; session 44).
"""

from __future__ import annotations

import weakref

import torch

from ._launch import FastKernel, PreparedArgs, _expand_descriptors, _tma_scratch, hooks_active

MEMO_KEYS = 16384       # address tuples held by all AddressMemos together (a few KiB each at most)
_MEMO_HELD = [0]        # how many they hold now (an upper bound: a memo's own clears are not subtracted)
_MEMOS = weakref.WeakSet()


class AddressMemo:
    """The launches of one cached op plan, kept by the addresses of their tensors.

    A plan fixes every argument of its launch but the addresses: sizes, strides, dtypes,
    constexprs, the grid, and each host descriptor's view and box. Two launches of one plan at the
    same addresses therefore pass the same arguments, so a repeat (a training step's GEMMs at the
    caching allocator's addresses of the step before) calls the C launcher with the argument list
    the first one built: descriptors already encoded, pointers as integers (the launcher then
    skips its per-pointer ``cuPointerGetAttribute``). No per-launch key, descriptor lookups or
    expansion. The caller's ``key`` must hold every address, and the dtype of each tensor the plan
    does not fix.

    An address tuple is kept the second time it is seen (a stream of fresh addresses pays one set
    insertion per launch, not a binding); ``limit`` entries, then the memo starts over, and every
    memo starts over once all of them together hold :data:`MEMO_KEYS` addresses tuples (seen or
    kept: bounded host memory however many plans there are). A kernel
    that builds descriptors in the kernel (Triton's ``run`` with a global scratch buffer) is kept
    too: a hit takes the scratch from :func:`_tma_scratch` for the current stream, as Triton's
    allocator hook would. One whose launches cannot be bound (profile scratch, an unknown
    launcher) turns the memo off for good."""

    __slots__ = ("_entries", "_seen", "limit", "off", "__weakref__")

    def __init__(self, limit: int = 1024):
        self._entries: dict = {}
        self._seen: set = set()
        self.limit = limit
        self.off = False
        _MEMOS.add(self)

    def _count(self) -> None:
        """One more address tuple held here: past MEMO_KEYS in all memos, every memo starts over."""
        _MEMO_HELD[0] += 1
        if _MEMO_HELD[0] > MEMO_KEYS:
            for memo in list(_MEMOS):
                memo._entries.clear()
                memo._seen.clear()
            _MEMO_HELD[0] = 1

    def launch(self, key: tuple) -> bool:
        """Launch the launch kept for ``key`` on the current stream of its device; False when
        there is none (or a profiler's launch hooks must see it: Triton's path then)."""
        entry = self._entries.get(key)
        if entry is None or hooks_active():
            return False
        launch, g0, g1, g2, function, coop, pdl, meta, args, device, scratch, _compiled = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        launch(g0, g1, g2, stream, function, coop, pdl, scratch and _tma_scratch(scratch[0], scratch[1], stream),
               None, meta, None, None, None, *args)
        return True

    def keep(self, key: tuple, kernel: FastKernel, grid, tensors: tuple, prepared: PreparedArgs) -> None:
        """After ``kernel.launch_prepared(grid, tensors, prepared)`` at ``key``'s addresses:
        keep that launch for the next one at the same addresses (from the second sighting on)."""
        if self.off:
            return
        if key not in self._seen:
            if len(self._seen) >= self.limit:
                self._seen.clear()
            self._count()
            self._seen.add(key)
            return
        hit = kernel.prepared_entry(tensors, prepared)
        launcher = hit and _memo_launcher(hit, grid)
        if not launcher:        # (the launch just made is cached if it can be: this one never is)
            self.off = True
            return
        launch, coop, pdl, descs, scratch = launcher
        compiled, rest, _ = hit
        # the launch's own arguments, tensors as their addresses (the launcher reads an int as is).
        # Every tensor, Parameters too: a Parameter kept as the object is read at its storage's
        # address *then* (its .data may be reassigned since: a swapped operand, s45 audit) and stays alive
        args = (*[t.data_ptr() if isinstance(t, torch.Tensor) else t for t in tensors], *prepared.ints)
        if descs:
            args = _expand_descriptors(args, descs)
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._count()
        if key not in self._seen:       # (every memo started over just now)
            return
        # (the compiled kernel is kept too: its CUfunction handle lives as long as it does)
        self._entries[key] = (launch, *(tuple(grid) + (1, 1))[:3], compiled.function, coop, pdl,
                              compiled.packed_metadata, (*args, *rest), torch.cuda.current_device(), scratch, compiled)

    def __len__(self) -> int:
        return len(self._entries)


def _memo_launcher(hit: tuple, grid) -> tuple | None:
    """(C launcher, cooperative, pdl, host-descriptor positions, global scratch (bytes, alignment)
    or None) of a prepared-cache entry, for :class:`AddressMemo`; None when it cannot be called
    directly. A kernel with a global scratch buffer (descriptors built in the kernel) gets its
    size as Triton's ``CudaLauncher.__call__`` computes it: programs × CTAs × bytes per CTA."""
    compiled, _, direct = hit
    if direct is not None:
        return direct.launch, direct.coop, direct.pdl, direct.descs, None
    run = getattr(compiled, "run", None)
    if (type(run).__name__ != "CudaLauncher" or run.profile_scratch_size or not run.global_scratch_size
            or getattr(run.launch, "__name__", "") == "inner"):     # (host descriptors with scratch: no)
        return None
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    scratch = (g0 * g1 * g2 * run.num_ctas * run.global_scratch_size, run.global_scratch_align)
    return run.launch, run.launch_cooperative_grid, run.launch_pdl, (), scratch
