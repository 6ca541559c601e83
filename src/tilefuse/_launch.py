"""``fast_launch``: Triton launches with less host time.

A ``kernel[grid](...)`` call in Triton 3.6 binds the arguments, builds a specialization key,
reads its knobs and checks global values before it reaches the C launcher: 21.9 µs of host time
per launch on the H200 benchmark machine, against 6.9 µs for the compiled kernel's own launcher
(``scripts/launch_overhead.py``, 2026-11-22). On ops whose kernels take 30-100 µs that host time
is what the benchmark measures.

``@fast_launch`` (above ``@triton.jit``, on kernels that are launched, not on helpers) keeps a
cache of compiled kernels under a key that is at least as fine as Triton's own specialization:

* constexpr parameters and keyword options (``num_warps``...) by value;
* tensors by dtype and 16-byte alignment of the data pointer;
* integers by ``== 1``, divisibility by 16 and the i32 / i64 / u64 range;
* floats as one type; Gluon tensor descriptors by dtype, block shape and layout; anything else
  by value;
* the current CUDA device.

A miss goes through Triton's normal launch (which compiles, specializes and launches) and keeps
the compiled kernel; a hit calls that kernel's launcher directly. Interpreted kernels, callable
grids and active launch hooks (profilers) always take Triton's path. ``TILEFUSE_FAST_LAUNCH=0``
turns the cache off.

Prepared launches (``kernel.prepare(ints, kwargs)`` once per cached op plan, then
``kernel.launch_prepared(grid, tensors, prepared)``) key only the tensors on each call: the
integers a plan fixes are keyed once, when the plan is built (rope passes 32 of them).
"""

from __future__ import annotations

import inspect
import os
from typing import NamedTuple

import torch
import triton
from triton.runtime.jit import JITFunction

_ENABLED = os.environ.get("TILEFUSE_FAST_LAUNCH", "1") != "0"
_I32 = (-(2**31), 2**31)


def _int_key(a: int) -> tuple:
    # i32 / i64 / u64 range, == 1, divisible by 16: what Triton specializes an integer on
    rng = 0 if _I32[0] <= a < _I32[1] else 1 if a < 2**63 else 2
    return ("i", a == 1, a % 16 == 0, rng)


def _arg_key(a):
    t = type(a)     # exact type first: the common cases without isinstance chains
    if t is int:
        return _int_key(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is bool:
        return ("b", a)
    if isinstance(a, int):
        return _int_key(int(a))
    if isinstance(a, float):
        return ("f",)
    if hasattr(a, "launch_key"):      # a cached Gluon host descriptor (_gluon_common.host_descriptor)
        return a.launch_key
    if t.__name__ == "TensorDescriptor" and hasattr(a, "layout"):
        # a Gluon host descriptor: Triton specializes it on dtype, block shape and shared layout
        # (the shape and strides travel in the TMA descriptor the launcher builds on each call)
        return ("d", a.base.dtype, tuple(a.block_shape), a.layout, a.padding)
    return ("v", a)


class FastKernel:
    """A ``JITFunction`` whose ``[grid](...)`` launches through the cache described above."""

    def __init__(self, fn):
        self.fn = fn
        self._cache: dict = {}
        self._prepared_cache: dict = {}
        if isinstance(fn, JITFunction):
            self._names = [p.name for p in fn.params]
            self._constexpr = [p.is_constexpr for p in fn.params]
            self._defaults = [p.default for p in fn.params]
            # leading parameters that are all runtime values: their keys need no constexpr test
            self._runtime_prefix = next((i for i, c in enumerate(self._constexpr) if c), len(self._constexpr))

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        if not (_ENABLED and isinstance(self.fn, JITFunction)) or callable(grid):
            return self.fn[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _key(self, device: int, args: tuple, kwargs: dict) -> tuple:
        # keyword arguments in call-site order (one call site, one order: no sort needed)
        if len(args) > self._runtime_prefix:      # a constexpr passed by position: keyed by value
            keys = tuple(a if c else _arg_key(a) for a, c in zip(args, self._constexpr))
            return (device, keys, tuple(kwargs.items()))
        # the common case, one inline loop: this runs on every launch (~2.6 µs on the CI CPU for
        # 16 arguments, against 4.2 through a helper call per argument); the same keys as _arg_key
        keys = []
        for a in args:
            t = type(a)
            if t is torch.Tensor:
                keys.append((a.dtype, a.data_ptr() % 16 == 0))
            elif t is int:
                keys.append(("i", a == 1, a % 16 == 0, 0 if -2147483648 <= a < 2147483648 else 1 if a < 2**63 else 2))
            elif t is float:
                keys.append(("f",))
            else:   # a cached Gluon host descriptor carries its key (_gluon_common.host_descriptor)
                keys.append(getattr(a, "launch_key", None) or _arg_key(a))
        return (device, tuple(keys), tuple(kwargs.items()))

    def _launch(self, grid, args, kwargs):
        device = torch.cuda.current_device()
        return self._run_keyed(self._cache, self._key(device, args, kwargs), device, grid, args, kwargs)

    def _run_keyed(self, cache: dict, key: tuple, device: int, grid, args: tuple, kwargs: dict):
        """A hit calls the compiled kernel's launcher; a miss (or active hooks) takes Triton's
        path and keeps what it compiled under ``key``."""
        hit = cache.get(key)
        if hit is None or _hooks_active():
            compiled = self.fn[grid](*args, **kwargs)
            if getattr(compiled, "function", None) is not None:
                # the parameters after the positional ones, in order: every value there comes from
                # a keyword (keyed by value) or a default, so the key fixes them
                rest = [kwargs[n] if n in kwargs else d
                        for n, d in zip(self._names[len(args):], self._defaults[len(args):])]
                cache[key] = (compiled, rest)
            return compiled
        compiled, rest = hit
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        compiled.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *rest)
        return compiled

    # ------------------------------------------------------------------------------------------
    # prepared launches: the integer arguments keyed once per plan, not once per call
    # ------------------------------------------------------------------------------------------

    def prepare(self, ints: tuple, kwargs: dict) -> "PreparedArgs":
        """The arguments after the leading tensors of a launch whose values an op's cached plan
        fixes (sizes, strides, constexprs), with their part of the cache key computed once;
        launch with :meth:`launch_prepared`. For kernels whose parameters are tensors first."""
        return PreparedArgs(tuple(ints), dict(kwargs),
                            (tuple(_arg_key(a) for a in ints), tuple(kwargs.items())))

    def launch_prepared(self, grid, tensors: tuple, prepared: "PreparedArgs"):
        """``self[grid](*tensors, *prepared.ints, **prepared.kwargs)``, keyed on the tensors' dtype
        and alignment plus the prepared key: the per-call key work is one pair per tensor."""
        args = (*tensors, *prepared.ints)
        if not (_ENABLED and isinstance(self.fn, JITFunction)):
            return self.fn[grid](*args, **prepared.kwargs)
        device = torch.cuda.current_device()
        key = (device, tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors]), prepared.key)
        return self._run_keyed(self._prepared_cache, key, device, grid, args, prepared.kwargs)


def config_key(config: dict | None) -> tuple:
    """A launch-config override (a sweep's ``config=``) as part of a cached plan's key: hashable,
    () for none."""
    return tuple(config.items()) if config else ()


class PreparedArgs(NamedTuple):
    """What :meth:`FastKernel.prepare` returns (cache it in the op's launch plan)."""
    ints: tuple        # positional arguments after the tensors
    kwargs: dict       # constexprs and launch options (do not mutate: shared by the plan cache)
    key: tuple         # their cache-key part

    def with_first_int(self, value: int) -> "PreparedArgs":
        """The same arguments with the first integer replaced by ``value`` (a per-call value such
        as a dropout seed, which must not key the op's plan: one entry per training step)."""
        return PreparedArgs((value, *self.ints[1:]), self.kwargs, (self.key, _arg_key(value)))


def _hooks_active() -> bool:
    """A profiler (e.g. proton) registered launch hooks: let Triton's own path call them."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def fast_launch(fn):
    """Decorator for launched kernels: ``@fast_launch`` above ``@triton.jit``."""
    return FastKernel(fn)


class UnitValueFallback:
    """A launchable kernel jitted twice from one function: with Triton's integer specialization
    (== 1, divisible by 16) on every argument, and a twin that leaves ``names`` unspecialized.
    Launches where one of those arguments is 1 take the twin; all others keep the specialization.

    Why: Triton folds an integer argument equal to 1 into a constant, and that made the attention
    kernels fail to compile on an H100 ("PassManager::run failed" at S_q = 1, S_k = 21, D = 64;
    a descriptor dimension folded to 1 is the suspect), while dropping the sequence lengths'
    specialization altogether cost the attention backward 10 % on the H200 (273 -> 302 TF/s full,
    310 -> 331 causal at S = 16k, D = 128 with it restored).
    """

    def __init__(self, fn, names: tuple[str, ...]):
        self.specialized = fast_launch(triton.jit(fn))
        self.unspecialized = fast_launch(triton.jit(fn, do_not_specialize=list(names)))
        params = list(inspect.signature(fn).parameters)
        self._positions = tuple(params.index(n) for n in names)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            unit = any(args[i] == 1 for i in self._positions)
            return (self.unspecialized if unit else self.specialized)[grid](*args, **kwargs)
        return launch


def unit_value_fallback(*names: str):
    """Decorator (in place of ``@fast_launch @triton.jit``): see :class:`UnitValueFallback`."""
    return lambda fn: UnitValueFallback(fn, names)


def _tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator hook: global memory for tensor descriptors built inside kernels."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_device_descriptors() -> None:
    """Install the allocator that in-kernel ``tl.make_tensor_descriptor`` needs (process-wide in
    Triton 3.6; every kernel of this package that builds descriptors shares this one)."""
    triton.set_allocator(_tma_scratch)
