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

A hit calls the C launcher itself (:class:`_DirectLaunch`), below Triton's two Python wrappers
(``CudaLauncher.__call__`` and the tensor-descriptor expansion), and a host TMA descriptor from
:func:`cached_descriptor` keeps its encoded CUtensorMap: the expansion re-encoded every
descriptor argument on every launch (1.0-1.8 µs each on the H200 host, 13 per attention
backward). Kernels that need global scratch (descriptors built in the kernel) keep Triton's
``run``, with the scratch from a per-stream buffer (:func:`_tma_scratch`).
"""

from __future__ import annotations

import ctypes
import inspect
import os
import threading
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
    if hasattr(a, "launch_key"):      # a cached host descriptor (cached_descriptor)
        return a.launch_key
    if t.__name__ == "TensorDescriptor":
        # a host descriptor: Triton specializes it on dtype, block shape and (Gluon) shared layout;
        # the shape and strides travel in the TMA descriptor the launcher encodes
        return ("d", a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding)
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
            return self._plain(grid)
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _plain(self, grid):
        """Triton's own launch (fast launches off, interpreted kernels, callable grids), after
        :func:`ensure_thread_context`: Triton encodes host descriptors before its launcher runs."""
        launch = self.fn[grid]

        def run(*args, **kwargs):
            ensure_thread_context()
            return launch(*args, **kwargs)
        return run

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
            else:   # a cached host descriptor carries its key (cached_descriptor)
                keys.append(getattr(a, "launch_key", None) or _arg_key(a))
        return (device, tuple(keys), tuple(kwargs.items()))

    def _launch(self, grid, args, kwargs):
        device = torch.cuda.current_device()
        return self._run_keyed(self._cache, self._key(device, args, kwargs), device, grid, args, kwargs)

    def _run_keyed(self, cache: dict, key: tuple, device: int, grid, args: tuple, kwargs: dict):
        """A hit calls the compiled kernel's launcher; a miss (or active hooks) takes Triton's
        path and keeps what it compiled under ``key``."""
        hit = cache.get(key)
        if hit is None or hooks_active():
            ensure_thread_context()     # Triton's path encodes host descriptors before its launcher runs
            compiled = self.fn[grid](*args, **kwargs)
            if getattr(compiled, "function", None) is not None:
                # the parameters after the positional ones, in order: every value there comes from
                # a keyword (keyed by value) or a default, so the key fixes them
                rest = [kwargs[n] if n in kwargs else d
                        for n, d in zip(self._names[len(args):], self._defaults[len(args):])]
                cache[key] = (compiled, rest, _direct_launch(compiled))
            return compiled
        compiled, rest, direct = hit
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream = torch._C._cuda_getCurrentRawStream(device)
        if direct is not None:
            direct(g0, g1, g2, stream, compiled, args, rest)
        else:
            compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *rest)
        return compiled

    # ------------------------------------------------------------------------------------------
    # prepared launches: the integer arguments keyed once per plan, not once per call
    # ------------------------------------------------------------------------------------------

    def prepare(self, ints: tuple, kwargs: dict) -> "PreparedArgs":
        """The arguments after the leading tensors of a launch whose values an op's cached plan
        fixes (sizes, strides, constexprs), with their part of the cache key computed once;
        launch with :meth:`launch_prepared`. For kernels whose parameters are tensors first."""
        return PreparedArgs(tuple(ints), dict(kwargs),
                            key_token((tuple(_arg_key(a) for a in ints), tuple(kwargs.items()))))

    def launch_prepared(self, grid, tensors: tuple, prepared: "PreparedArgs"):
        """``self[grid](*tensors, *prepared.ints, **prepared.kwargs)``, keyed on the tensors' dtype
        and alignment plus the prepared key: the per-call key work is one pair per tensor.
        ``tensors`` may hold host descriptors too (keyed by :func:`_arg_key`: cached ones carry
        their key)."""
        args = (*tensors, *prepared.ints)
        if not (_ENABLED and isinstance(self.fn, JITFunction)):
            return self._plain(grid)(*args, **prepared.kwargs)
        device = torch.cuda.current_device()
        # a cached host descriptor carries its key (launch_key): no _arg_key type chain for it
        key = (device, tuple([(t.dtype, t.data_ptr() % 16 == 0) if type(t) is torch.Tensor
                              else getattr(t, "launch_key", None) or _arg_key(t) for t in tensors]), prepared.key)
        return self._run_keyed(self._prepared_cache, key, device, grid, args, prepared.kwargs)

    def prepared_entry(self, tensors: tuple, prepared: "PreparedArgs") -> tuple | None:
        """The cache entry ``(compiled, rest, direct launcher or None)`` a :meth:`launch_prepared`
        with these arguments hit (or compiled) on the current device; None when there is none yet
        or fast launches are off (the interpreter)."""
        if not (_ENABLED and isinstance(self.fn, JITFunction)):
            return None
        key = (torch.cuda.current_device(), tuple([(t.dtype, t.data_ptr() % 16 == 0) if type(t) is torch.Tensor
                                                   else _arg_key(t) for t in tensors]), prepared.key)
        return self._prepared_cache.get(key)

    def bind_prepared(self, grid, tensors: tuple, prepared: "PreparedArgs") -> "BoundLaunch | None":
        """The cache entry a :meth:`launch_prepared` with these arguments hit (or compiled), as a
        :class:`BoundLaunch` on the current device; None when there is none yet, when it launches
        through Triton's ``run`` (scratch buffers), or when fast launches are off (the interpreter).
        Valid for later tensors with the same dtypes and 16-byte alignment, which the caller checks."""
        hit = self.prepared_entry(tensors, prepared)
        if hit is None or hit[2] is None:
            return None
        compiled, rest, direct = hit
        return BoundLaunch(direct, compiled, rest, (tuple(grid) + (1, 1))[:3], prepared.ints)


class BoundLaunch(NamedTuple):
    """One entry of a kernel's prepared-launch cache, bound for repeated launches of one op plan
    (:meth:`FastKernel.bind_prepared`): a call skips the per-launch key (the caller guarantees its
    tensors key the same: dtypes and 16-byte alignment) and goes straight to the C launcher."""
    direct: "_DirectLaunch"
    compiled: object
    rest: list                 # the parameters after the positional ones (fixed by the key)
    grid: tuple                # (g0, g1, g2)
    ints: tuple                # the prepared integers, after the tensors

    def __call__(self, stream: int, tensors: tuple) -> None:
        g0, g1, g2 = self.grid
        self.direct(g0, g1, g2, stream, self.compiled, (*tensors, *self.ints), self.rest)


class _DirectLaunch:
    """A compiled kernel's C launcher called without Triton's Python wrappers around it, which
    on every launch build the argument list again and re-encode each host TMA descriptor
    (``make_tensordesc_arg``). Here a descriptor from :func:`cached_descriptor` keeps its
    encoded form per kernel metadata (the CUtensorMap depends only on the address, view, box and
    swizzle, all fixed by the cache key); any other descriptor is encoded per launch as Triton
    does. Only for kernels without global or profile scratch (:func:`_direct_launch`)."""

    __slots__ = ("launch", "coop", "pdl", "descs")

    def __init__(self, launch, coop: bool, pdl: bool, descs: tuple):
        self.launch = launch        # the C launcher (mod.launch of Triton's CudaLauncher)
        self.coop = coop
        self.pdl = pdl
        self.descs = descs          # ((argument position, tensordesc metadata), ...) ascending

    def __call__(self, g0, g1, g2, stream, compiled, args: tuple, rest: list):
        if self.descs:
            args = _expand_descriptors(args, self.descs)
        self.launch(g0, g1, g2, stream, compiled.function, self.coop, self.pdl, None, None,
                    compiled.packed_metadata, None, None, None, *args, *rest)


def _expand_descriptors(args: tuple, descs: tuple) -> list:
    """``args`` with each descriptor argument replaced by its encoded form (what Triton's
    ``wrap_handle_tensordesc`` passes the C launcher), cached on cached descriptors."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    out, start = [], 0
    for pos, meta in descs:
        out.extend(args[start:pos])
        desc = args[pos]
        encoded = getattr(desc, "encoded", None)
        if encoded is None:
            ensure_thread_context()
            out.extend(make_tensordesc_arg(desc, meta))
        else:
            key = id(meta)          # kernel metadata lives as long as the compiled kernel: cached for good
            hit = encoded.get(key)
            if hit is None:
                ensure_thread_context()
                hit = encoded[key] = make_tensordesc_arg(desc, meta)
            out.extend(hit)
        start = pos + 1
    out.extend(args[start:])
    return out


_THREAD = threading.local()


def ensure_thread_context() -> None:
    """Make the current device's primary CUDA context current on this thread, once per thread,
    before a host TMA descriptor is encoded: ``cuTensorMapEncodeTiled`` needs a current context,
    and the autograd engine's device threads can have none (c10's ``set_device`` skips
    ``cudaSetDevice`` when the device number already matches, so nothing has made the context
    current there). A backward whose first kernel was a Gluon GEMM failed with "Failed to create
    tensor map descriptor: invalid device context" (H200, 2026-11-29, a fresh process); Triton's
    C launcher makes the context current itself, but only after the descriptors are encoded.
    Nothing happens before CUDA is initialized in the process (CPU and interpreter runs)."""
    if getattr(_THREAD, "ready", False) or not torch.cuda.is_initialized():
        return
    driver = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if driver.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
        dev = ctypes.c_int()
        if (driver.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) != 0
                or driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0
                or driver.cuCtxSetCurrent(ctx) != 0):
            raise RuntimeError("tilefuse: could not make the CUDA primary context current on this thread")
    _THREAD.ready = True


def _direct_launch(compiled) -> "_DirectLaunch | None":
    """The C launcher of ``compiled`` when it can be called directly: Triton 3.6's CUDA launcher,
    no scratch buffers, and (with descriptor arguments) the expansion wrapper's known closure.
    None otherwise: the launch keeps ``compiled.run``."""
    run = getattr(compiled, "run", None)
    if type(run).__name__ != "CudaLauncher" or run.global_scratch_size or run.profile_scratch_size:
        return None
    launch = run.launch
    if getattr(launch, "__name__", "") != "inner":
        return _DirectLaunch(launch, run.launch_cooperative_grid, run.launch_pdl, ())
    cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    positions = sorted(cells["tensordesc_indices"])
    meta = cells["tensordesc_meta"]
    if meta is None or len(meta) != len(positions):
        return None
    return _DirectLaunch(cells["launcher"], run.launch_cooperative_grid, run.launch_pdl,
                         tuple(zip(positions, meta)))


# ----------------------------------------------------------------------------------------------
# cached host TMA descriptors
# ----------------------------------------------------------------------------------------------


class DeviceAddress:
    """What a launch reads of a host descriptor's tensor -- its address and dtype -- without the
    tensor: a cached descriptor must not keep its memory alive."""
    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr


_HOST_DESCRIPTORS: dict = {}
HOST_DESCRIPTOR_CACHE = 4096    # entries kept before the cache starts over
_LAYOUT_TOKENS: dict = {}       # shared layout -> a small int, one per distinct value (never reused)


def cached_descriptor(t: torch.Tensor, shape: tuple, strides: tuple, block: tuple, layout=None):
    """The host TMA descriptor of ``t``'s memory viewed as ``shape`` / ``strides`` (elements) with
    ``block`` boxes -- Gluon's (``layout`` given) or Triton's -- cached by (address, dtype, view,
    block, layout). Building one cost 5.8 µs of host time on the H200 host (session 21); a lookup
    ~0.5. A descriptor holds only the address, dims, strides and box, so a later tensor at the
    same address with the same view gets a descriptor that is exactly right for it; the cached one
    holds the address, not the tensor, and carries its fast_launch key (``launch_key``) and its
    encoded CUtensorMaps (``encoded``, :class:`_DirectLaunch`). (Device addresses are unique
    across the GPUs of a process: unified virtual addressing.) A Triton descriptor of a CPU
    tensor (the interpreter, which reads the tensor itself) is built plain, uncached."""
    if layout is None and t.device.type != "cuda":
        return _new_descriptor(t, shape, strides, block, layout)
    # the layout by identity (hashing one runs Python code, and every launch would hash it twice):
    # the entry's descriptor holds the layout, so its id is not reused while the entry lives
    key = (t.data_ptr(), t.dtype, shape, strides, block, id(layout))
    desc = _HOST_DESCRIPTORS.get(key)
    if desc is None:
        if len(_HOST_DESCRIPTORS) >= HOST_DESCRIPTOR_CACHE:
            _HOST_DESCRIPTORS.clear()
        desc = _new_descriptor(DeviceAddress(key[0], t.dtype), shape, strides, block, layout)
        # fast_launch's key of this argument (what Triton specializes a descriptor on), computed
        # once: the layout as a token of its value, so equal layouts share compiled kernels
        token = None if layout is None else _LAYOUT_TOKENS.setdefault(layout, len(_LAYOUT_TOKENS))
        desc.launch_key = ("d", t.dtype, tuple(block), token, desc.padding)
        desc.encoded = {}
        _HOST_DESCRIPTORS[key] = desc
    return desc


def cached_by_view(build):
    """Decorator for a descriptor builder ``build(t, *params)`` that derives the view from ``t``'s
    shape and strides and calls :func:`cached_descriptor`: memoized by (address, dtype, shape,
    strides, params) of CUDA tensors, so a hit skips the derivation and the layout lookup (a
    cached ``_descriptor`` call cost 3.3-3.7 µs of host time on the H200 host, session 22, and an
    attention fwd + bwd makes 17). Other tensors call ``build``."""
    memo: dict = {}

    def lookup(t: torch.Tensor, *params):
        if not t.is_cuda:
            return build(t, *params)
        key = (t.data_ptr(), t.dtype, t.shape, t.stride(), params)
        desc = memo.get(key)
        if desc is None:
            if len(memo) >= HOST_DESCRIPTOR_CACHE:
                memo.clear()
            desc = memo[key] = build(t, *params)
        return desc

    lookup.__doc__, lookup.__name__, lookup.__wrapped__ = build.__doc__, build.__name__, build
    return lookup


def _new_descriptor(base, shape, strides, block, layout):
    if layout is None:
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(base, list(shape), list(strides), list(block))
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    return GluonDescriptor(base, list(shape), list(strides), list(block), layout)


def config_key(config: dict | None) -> tuple:
    """A launch-config override (a sweep's ``config=``) as part of a cached plan's key: hashable,
    () for none."""
    return tuple(config.items()) if config else ()


_KEY_TOKENS: dict = {}     # a prepared key -> its token (one per distinct key, never reused)


def key_token(key: tuple) -> int:
    """A small int standing for ``key`` in per-call cache keys: equal keys, equal tokens. A
    prepared key can hold Gluon layouts, whose hashes cost ~10 µs per launch on the H200 host
    when the key is hashed on every call (the int4 Hopper kernel, s34)."""
    token = _KEY_TOKENS.get(key)
    if token is None:
        token = _KEY_TOKENS[key] = len(_KEY_TOKENS)
    return token


class PreparedArgs(NamedTuple):
    """What :meth:`FastKernel.prepare` returns (cache it in the op's launch plan)."""
    ints: tuple        # positional arguments after the tensors
    kwargs: dict       # constexprs and launch options (do not mutate: shared by the plan cache)
    key: object        # their cache-key part (a token of it: :func:`key_token`)

    def with_first_int(self, value: int) -> "PreparedArgs":
        """The same arguments with the first integer replaced by ``value`` (a per-call value such
        as a dropout seed, which must not key the op's plan: one entry per training step)."""
        return PreparedArgs((value, *self.ints[1:]), self.kwargs, (self.key, _arg_key(value)))


def hooks_active() -> bool:
    """A profiler (e.g. proton) registered launch hooks: let Triton's own path call them (a
    :class:`BoundLaunch` would skip them)."""
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

    def prepare(self, ints: tuple, kwargs: dict) -> "PreparedArgs":
        """As :meth:`FastKernel.prepare` (the key is finer than either twin's specialization)."""
        return self.specialized.prepare(ints, kwargs)

    def launch_prepared(self, grid, tensors: tuple, prepared: "PreparedArgs"):
        """As :meth:`FastKernel.launch_prepared`, on the twin the integers ask for."""
        n = len(tensors)
        unit = any(prepared.ints[i - n] == 1 for i in self._positions if i >= n)
        return (self.unspecialized if unit else self.specialized).launch_prepared(grid, tensors, prepared)


def unit_value_fallback(*names: str):
    """Decorator (in place of ``@fast_launch @triton.jit``): see :class:`UnitValueFallback`."""
    return lambda fn: UnitValueFallback(fn, names)


_SCRATCH: dict = {}     # (device, stream) -> the largest scratch buffer a launch on it asked for


def _tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator hook: global memory for tensor descriptors built inside kernels. One
    buffer per (device, stream), reused by every launch on that stream: the launches run in
    stream order, so none overwrites a buffer another is still reading (the per-launch
    ``torch.empty`` this replaces got the same block back from the caching allocator, at ~5 µs
    of host time). Under CUDA-graph capture each launch gets its own buffer from the graph's
    pool: a replay may run beside eager work on the stream the buffer belongs to."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buf


def use_device_descriptors() -> None:
    """Install the allocator that in-kernel ``tl.make_tensor_descriptor`` needs (process-wide in
    Triton 3.6; every kernel of this package that builds descriptors shares this one)."""
    triton.set_allocator(_tma_scratch)
