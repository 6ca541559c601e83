"""The benchmark loop: validate, then time, every implementation of every registered op.

For one (op, shape, dtype) the runner

1. draws the inputs (seeded, so every implementation sees the same values) and evaluates the
   reference once on float64 copies (:class:`tilefuse.testing.ReferenceCache`);
2. for each implementation -- ``tilefuse``, each available peer (``torch``, ``liger``, ...) and
   ``torch.compile`` of the torch peer (default mode, ``dynamic=False``, compiled afresh for every
   shape after ``torch._dynamo.reset()``) -- checks forward and backward against the reference
   with random grad_outputs; a check over tolerance marks its rows FAILED and skips their timing;
3. times three passes with :func:`time_ms` (median of ``triton.testing.do_bench``):

   * ``fwd``: ``fn(*args)`` with grad-requiring inputs (a training forward, graph built);
   * ``bwd``: ``torch.autograd.grad(outs, grad_inputs, grad_outputs, retain_graph=True)`` on one
     graph built outside the timed region;
   * ``fwd+bwd``: both, a fresh graph per call;

   and records the peak extra memory of one ``fwd+bwd`` (``max_memory_allocated`` after
   ``reset_peak_memory_stats`` minus ``memory_allocated`` before).

``torch.compile`` (and a peer that compiles, such as FlexAttention) cannot replay its backward
with ``retain_graph=True`` when it donates saved buffers (it raises); then, and only then, its
``bwd`` pass is timed on a second compile with ``torch._functorch.config.donated_buffer=False``
(the row carries a ``note``); its ``fwd`` and ``fwd+bwd`` always use the default compile.

Throughput: each pass is placed on the measured roofline by its arithmetic intensity
(``flops_fn`` / ``bytes_fn``). Below the ridge point (matmul TFLOP/s / copy GB/s) it is
memory-bound and reports GB/s = bytes / time and % of the copy ceiling; at or above it TFLOP/s
and % of the bf16 matmul ceiling (a GEMV or decode attention counts as memory-bound although it
has FLOPs). Rows carry both rates. ``fwd+bwd`` counts the bytes (FLOPs) of both passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from ..registry import OpSpec, as_tuple
from ..testing import ReferenceCache, check_impl, grad_leaves, make_grad_outputs
from .ceilings import graph_time_ms, time_ms

PASSES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
COMPILE_MODE = "default"
COMPILE_IMPL = "torch.compile"


def parse_dtype(name: str) -> torch.dtype:
    key = name.strip().lower().replace("torch.", "")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dt: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dt:
            return k
    return str(dt).replace("torch.", "")


def shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


@dataclasses.dataclass
class Settings:
    quick: bool = False
    warmup_ms: int | None = None        # do_bench warmup (ms); default 50, --quick 10
    rep_ms: int | None = None           # do_bench rep (ms); default 200, --quick 40
    compile: bool = True                # add the torch.compile peer
    seed: int = 0
    device: str = "cuda"
    timer: Callable[..., float] | None = None   # timer(fn, warmup=, rep=) -> ms; None: time_ms
    impls: Sequence[str] | None = None  # keep only these implementation names
    cuda_graph: bool = False            # also time each pass replayed from a CUDA graph (graph_ms)

    def __post_init__(self):
        if self.warmup_ms is None:
            self.warmup_ms = 10 if self.quick else 50
        if self.rep_ms is None:
            self.rep_ms = 40 if self.quick else 200


def bench_shapes(spec: OpSpec, quick: bool) -> list[tuple]:
    shapes = [tuple(s) for s in spec.bench_shapes]
    return shapes[:1] if quick else shapes


def pass_cost(spec: OpSpec, shape, dtype, pass_: str) -> tuple[int, int]:
    """(bytes, flops) of a pass; ``fwd+bwd`` is the sum of both."""
    parts = ("fwd", "bwd") if pass_ == "fwd+bwd" else (pass_,)
    nbytes = sum(int(spec.bytes_fn(shape, dtype, p)) for p in parts)
    flops = sum(int(spec.flops_fn(shape, p)) for p in parts)
    return nbytes, flops


# Where the roofs meet when the ceilings were not measured (FLOPs per byte): an H100/H200's
# measured bf16 matmul over its copy bandwidth is 160-230; the ops sit far from it either way
# (elementwise ops and reductions at 0.5-2.5, decode and GEMVs at 1-60, large GEMMs and prefill
# attention at 250+; the M = 128 GEMMs, at 120-125, are the only ones near it).
DEFAULT_RIDGE_FLOPS_PER_BYTE = 160.0


def ridge_point(ceilings: dict | None) -> float:
    """FLOPs per byte at which the measured roofs meet: matmul TFLOP/s / copy GB/s."""
    c = ceilings or {}
    if c.get("matmul_tflops") and c.get("copy_gbps"):
        return c["matmul_tflops"] * 1e12 / (c["copy_gbps"] * 1e9)
    return DEFAULT_RIDGE_FLOPS_PER_BYTE


def throughput(nbytes: int, flops: int, ms: float | None, ceilings: dict | None) -> dict[str, Any]:
    """The pass against the ceiling that binds it on the roofline: ``bound`` is "compute" when its
    arithmetic intensity (flops / nbytes) reaches the ridge point, then metric TFLOP/s and % of the
    bf16 matmul ceiling; else "memory", GB/s and % of copy. Both rates are kept
    (``achieved_gbps``, ``achieved_tflops``)."""
    ceilings = ceilings or {}
    intensity = flops / nbytes if nbytes else (math.inf if flops else 0.0)
    compute = flops > 0 and intensity >= ridge_point(ceilings)
    gbps = nbytes / (ms * 1e-3) / 1e9 if ms else None
    tflops = flops / (ms * 1e-3) / 1e12 if ms and flops else None
    if compute:
        metric, value, ceil = "TFLOP/s", tflops, ceilings.get("matmul_tflops")
    else:
        metric, value, ceil = "GB/s", gbps, ceilings.get("copy_gbps")
    pct = 100.0 * value / ceil if (value is not None and ceil) else None
    return {"metric": metric, "achieved": value, "pct_of_ceiling": pct, "bound": "compute" if compute else "memory",
            "arith_intensity": intensity if math.isfinite(intensity) else None,
            "achieved_gbps": gbps, "achieved_tflops": tflops}


# ----------------------------------------------------------------------------------------------
# implementations
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_donated_buffers():
    try:
        import torch._functorch.config as fconfig

        if hasattr(fconfig, "donated_buffer"):
            with fconfig.patch(donated_buffer=False):
                yield
            return
    except ImportError:
        pass
    yield


def _fresh_peer(factory: Callable[[], Callable]) -> Callable:
    """The peer built anew after a dynamo reset, so whatever it compiles (and the backward that
    AOT autograd compiles lazily, at the first backward call) is compiled again."""
    torch._dynamo.reset()
    return factory()


def _compiled(fn: Callable) -> Callable:
    torch._dynamo.reset()     # a fresh, static compile for this shape (no recompile limit, no dynamic dims)
    return torch.compile(fn, dynamic=False)   # default mode


@dataclasses.dataclass
class Impl:
    name: str
    fn: Callable | None                 # None: unavailable / failed to build
    error: str | None = None
    # a second build for the ``bwd`` pass (torch.compile without donated buffers), run in ``bwd_ctx``
    bwd_build: Callable[[], Callable] | None = None
    bwd_ctx: Callable[[], Any] = contextlib.nullcontext


def implementations(spec: OpSpec, settings: Settings) -> tuple[list[Impl], list[str]]:
    """tilefuse, each available peer, and torch.compile of the torch peer; plus the names of
    peers whose factory returned None (not installed)."""
    impls = [Impl("tilefuse", spec.fn)]
    unavailable: list[str] = []
    for name, factory in spec.peers.items():
        try:
            fn = factory()
        except Exception as exc:  # noqa: BLE001
            impls.append(Impl(name, None, error=f"peer factory raised {type(exc).__name__}: {exc}"))
            continue
        if fn is None:
            unavailable.append(name)
            continue
        # a peer that compiles (flex) may hit the donated-buffer refusal too: rebuilt the same way
        impls.append(Impl(name, fn, bwd_build=lambda f=factory: _fresh_peer(f), bwd_ctx=_no_donated_buffers))
        if name == "torch" and settings.compile:
            # fn is the torch peer: _build compiles it afresh for each shape
            impls.append(Impl(COMPILE_IMPL, fn, bwd_build=lambda f=fn: _compiled(f),
                              bwd_ctx=_no_donated_buffers))
    if settings.impls is not None:
        impls = [i for i in impls if i.name in settings.impls]
    return impls, unavailable


def _build(impl: Impl) -> Callable:
    return _compiled(impl.fn) if impl.name == COMPILE_IMPL else impl.fn


# ----------------------------------------------------------------------------------------------
# one (op, shape, dtype)
# ----------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_extra_bytes(fn: Callable, device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def _err_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]


class _Passes:
    """The three timed closures of one implementation on one set of inputs."""

    def __init__(self, fn: Callable, inputs, seed: int):
        self.fn, self.args, self.kwargs = fn, inputs.args, inputs.kwargs
        self.leaves = grad_leaves(inputs) if inputs.grad_args else []
        outs = as_tuple(fn(*self.args, **self.kwargs))
        gouts = make_grad_outputs(outs, seed=seed)
        self.idx = [i for i, (o, g) in enumerate(zip(outs, gouts))
                    if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        self.gouts = [gouts[i] for i in self.idx]
        self.graph_outs: list | None = None
        del outs

    @property
    def can_backward(self) -> bool:
        return bool(self.idx) and bool(self.leaves)

    def fwd(self):
        return self.fn(*self.args, **self.kwargs)

    def fwd_bwd(self):
        outs = as_tuple(self.fn(*self.args, **self.kwargs))
        return torch.autograd.grad([outs[i] for i in self.idx], self.leaves, self.gouts, allow_unused=True)

    def build_graph(self):
        outs = as_tuple(self.fn(*self.args, **self.kwargs))
        self.graph_outs = [outs[i] for i in self.idx]

    def bwd(self):
        return torch.autograd.grad(self.graph_outs, self.leaves, self.gouts, retain_graph=True, allow_unused=True)

    def free_graph(self):
        self.graph_outs = None


def bench_case(
    spec: OpSpec,
    shape: tuple,
    dtype: torch.dtype,
    settings: Settings,
    ceilings: dict | None,
    on_impl: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows (one per implementation and pass) for one (op, shape, dtype)."""
    device = settings.device
    passes = list(PASSES) if spec.has_backward else ["fwd"]
    impls, _ = implementations(spec, settings)

    def fresh_inputs():
        torch.manual_seed(settings.seed)
        return spec.make_inputs(shape, dtype, device)

    rows: list[dict[str, Any]] = []

    def add(impl: str, pass_: str, status: str, **kw):
        nbytes, flops = pass_cost(spec, shape, dtype, pass_)
        row = {
            "op": spec.name, "shape": list(shape), "dtype": dtype_name(dtype), "pass": pass_,
            "impl": impl, "status": status, "error": None, "rel_err_fwd": None, "rel_err_bwd": None,
            "rel_err": None, "tolerance": spec.tolerance.get(dtype), "ms": None, "bytes": nbytes,
            "flops": flops, "peak_mem_bytes": None, "speedup_vs_best_peer": None, "best_peer": None,
            "speedup_vs": None, "graph_ms": None, "graph_pct_of_ceiling": None, "graph_error": None,
        }
        row.update(throughput(nbytes, flops, None, ceilings))
        row.update(kw)
        if row["ms"] is not None:
            row.update(throughput(nbytes, flops, row["ms"], ceilings))
        if row["graph_ms"] is not None:
            row["graph_pct_of_ceiling"] = throughput(nbytes, flops, row["graph_ms"], ceilings)["pct_of_ceiling"]
        rows.append(row)

    try:
        try:
            ref = ReferenceCache(spec, fresh_inputs())
        except torch.cuda.OutOfMemoryError:     # fp64 copies too big beside the inputs: on the host
            torch.cuda.empty_cache()
            ref = ReferenceCache(spec, fresh_inputs(), device="cpu")
    except Exception as exc:  # noqa: BLE001
        for impl in impls:
            for p in passes:
                add(impl.name, p, "ERROR", error=f"reference failed: {_err_text(exc)}")
        return rows

    timer = settings.timer or time_ms
    tw = dict(warmup=settings.warmup_ms, rep=settings.rep_ms)
    for impl in impls:
        if on_impl:
            on_impl(impl.name)
        if impl.fn is None:
            for p in passes:
                add(impl.name, p, "ERROR", error=impl.error)
            continue
        inputs = fresh_inputs()
        try:
            fn = _build(impl)
        except Exception as exc:  # noqa: BLE001
            for p in passes:
                add(impl.name, p, "ERROR", error=_err_text(exc))
            continue
        chk = check_impl(spec, fn, inputs, dtype, reference=ref, backward="bwd" in passes, seed=settings.seed)
        errs = {"rel_err_fwd": None if math.isinf(chk.fwd_err) and chk.error else chk.fwd_err,
                "rel_err_bwd": chk.bwd_err}
        if chk.error is not None:
            for p in passes:
                add(impl.name, p, "ERROR", error=chk.error, **errs)
            continue
        results: dict[str, dict] = {}
        for p in passes:
            ok = chk.fwd_ok if p == "fwd" else chk.bwd_ok
            gate = chk.fwd_err if (p == "fwd" or not chk.fwd_ok) else max(chk.fwd_err, chk.bwd_err or 0.0)
            tol = chk.fwd_tol if p == "fwd" else max(chk.fwd_tol, chk.bwd_tol)
            results[p] = {"status": "ok" if ok else "FAILED", "rel_err": gate, "tolerance": tol, **errs}
        try:
            bench = _Passes(fn, inputs, settings.seed)
            if results["fwd"]["status"] == "ok":
                results["fwd"]["ms"] = timer(bench.fwd, **tw)
            if "bwd" in passes and not bench.can_backward:
                for p in ("bwd", "fwd+bwd"):
                    results[p].update(status="SKIPPED", error="no output requires grad")
            elif "bwd" in passes and impl.name == "tilefuse" and not spec.repeatable_backward:
                results["bwd"].update(status="SKIPPED", error="the backward writes into a saved input: "
                                                              "timed only inside fwd+bwd")
            if "fwd+bwd" in passes and results["fwd+bwd"]["status"] == "ok":
                results["fwd+bwd"]["peak_mem_bytes"] = _peak_extra_bytes(bench.fwd_bwd, device)
                results["fwd+bwd"]["ms"] = timer(bench.fwd_bwd, **tw)
            if "bwd" in passes and results["bwd"]["status"] == "ok":
                try:
                    results["bwd"]["ms"] = _time_bwd(bench, timer, tw)
                except RuntimeError as exc:
                    # a compiled backward donated saved buffers (torch.compile, flex): it cannot
                    # run with retain_graph=True; recompile without donation for this pass only
                    if impl.bwd_build is None or "donated buffer" not in str(exc):
                        raise
                    bench = None
                    with impl.bwd_ctx():
                        bench = _Passes(impl.bwd_build(), inputs, settings.seed)
                        results["bwd"]["ms"] = _time_bwd(bench, timer, tw)
                    results["bwd"]["note"] = "recompiled with donated_buffer=False (for retain_graph=True)"
            if settings.cuda_graph and bench is not None and spec.graph_capturable:
                _time_graphs(bench, results, passes, settings.rep_ms)
        except Exception as exc:  # noqa: BLE001
            for p in passes:
                if results[p]["status"] == "ok" and results[p].get("ms") is None:
                    results[p].update(status="ERROR", error=f"while timing: {_err_text(exc)}")
        finally:
            bench = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        for p in passes:
            add(impl.name, p, **results[p])
    del ref
    _speedups(rows)
    unsplit_pass_rows(spec, rows)
    return rows


def unsplit_pass_rows(spec: OpSpec, rows: list[dict[str, Any]]) -> None:
    """For ops whose forward already computes the gradients (``spec.split_passes`` False), drop
    every per-pass comparison of fwd and bwd rows: the throughput would divide one
    implementation's work split by another's byte/FLOP model, and a speed-up would set our
    forward (loss and gradients) beside a peer's (loss alone). Times stay; ``unsplit`` marks the
    rows for the report and the roofline; fwd+bwd rows are the comparison."""
    if spec.split_passes:
        return
    for r in rows:
        if r.get("pass") in ("fwd", "bwd"):
            r.update(achieved=None, pct_of_ceiling=None, graph_pct_of_ceiling=None, speedup_vs=None,
                     unsplit=True, note="gradients are computed in the forward: compare fwd+bwd only")
            for key in ("best_peer", "speedup_vs_best_peer"):
                r.pop(key, None)


def _time_bwd(bench: _Passes, timer, tw) -> float:
    bench.build_graph()
    try:
        return timer(bench.bwd, **tw)
    finally:
        bench.free_graph()


def _time_graphs(bench: _Passes, results: dict, passes: list, rep_ms: int) -> None:
    """``graph_ms`` of each timed pass: the same closure replayed from a CUDA graph (kernels
    only, no host time). A closure that cannot be captured gets ``graph_error`` instead."""
    closures = {"fwd": bench.fwd, "fwd+bwd": bench.fwd_bwd, "bwd": bench.bwd}
    for p in passes:
        if results[p].get("ms") is None:
            continue
        try:
            if p == "bwd":   # the backward's kernels run on its forward's stream: build it there
                def setup():
                    bench.build_graph()
                    _no_host_sync(bench.bwd)

                results[p]["graph_ms"] = graph_time_ms(bench.bwd, rep=rep_ms, setup=setup)
                continue
            _no_host_sync(closures[p])
            results[p]["graph_ms"] = graph_time_ms(closures[p], rep=rep_ms)
        except Exception as exc:  # noqa: BLE001
            results[p]["graph_error"] = _err_text(exc)
            torch.cuda.synchronize()
        finally:
            bench.free_graph()


def _no_host_sync(fn: Callable) -> None:
    """Run ``fn`` once with CUDA sync debugging set to raise: a call that synchronizes with the
    host (``.item()``, a data-dependent check) cannot be captured, and a capture that fails
    half-way leaves torch's CUDA RNG unusable for the rest of the process."""
    if not torch.cuda.is_available():
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        raise RuntimeError(f"synchronizes with the host, not capturable: {exc}") from None
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _speedups(rows: list[dict[str, Any]]) -> None:
    """On each tilefuse row: peer_ms / tilefuse_ms per peer, and for the fastest peer."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], tuple(r["shape"]), r["dtype"], r["pass"]), []).append(r)
    for grp in groups.values():
        tf = [r for r in grp if r["impl"] == "tilefuse" and r["ms"]]
        if not tf:
            continue
        t = tf[0]
        peers = {r["impl"]: r["ms"] for r in grp if r["impl"] != "tilefuse" and r["ms"]}
        t["speedup_vs"] = {k: v / t["ms"] for k, v in peers.items()}
        if peers:
            best = min(peers, key=peers.get)
            t["best_peer"] = best
            t["speedup_vs_best_peer"] = peers[best] / t["ms"]


# ----------------------------------------------------------------------------------------------
# all ops
# ----------------------------------------------------------------------------------------------


def plan(specs: Iterable[OpSpec], dtypes: Sequence[torch.dtype], quick: bool) -> tuple[list[tuple], list[str]]:
    """The (spec, shape, dtype) cases to run, and notes on what was left out and why."""
    cases, notes = [], []
    for spec in specs:
        shapes = bench_shapes(spec, quick)
        if not shapes:
            notes.append(f"{spec.name}: no bench shapes")
        for dt in dtypes:
            if dt not in spec.dtypes:
                notes.append(f"{spec.name}: {dtype_name(dt)} not supported")
                continue
            cases.extend((spec, s, dt) for s in shapes)
    return cases, notes


def run_bench(
    specs: Sequence[OpSpec],
    dtypes: Sequence[torch.dtype],
    settings: Settings,
    ceilings: dict | None,
    progress=None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every case of :func:`plan`; ``progress`` (optional) has ``step(label)`` and ``advance()``."""
    cases, notes = plan(specs, dtypes, settings.quick)
    if progress is not None:
        progress.start(len(cases))
    rows: list[dict[str, Any]] = []
    for spec, shape, dt in cases:
        label = f"{spec.name} {shape_str(shape)} {dtype_name(dt)}"
        if progress is not None:
            progress.step(label)
        t0 = time.perf_counter()
        case_rows = bench_case(
            spec, shape, dt, settings, ceilings,
            on_impl=(lambda name, label=label: progress.step(f"{label} · {name}")) if progress else None,
        )
        for r in case_rows:
            r["case_seconds"] = round(time.perf_counter() - t0, 2)
        rows.extend(case_rows)
        if progress is not None:
            progress.advance()
    if settings.compile:
        torch._dynamo.reset()
    for spec in specs:
        _, unavailable = implementations(spec, Settings(compile=False, device=settings.device))
        for u in unavailable:
            notes.append(f"{spec.name}: peer '{u}' not available (not installed)")
    return rows, notes


# ----------------------------------------------------------------------------------------------
# no GPU: the kernels under the Triton interpreter
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _poisoned_outputs():
    """NaN-fill kernel outputs before launch when the dispatcher supports it (unwritten = error)."""
    from .. import _dispatch

    if not hasattr(_dispatch, "POISON_OUTPUTS"):
        yield
        return
    old = _dispatch.POISON_OUTPUTS
    _dispatch.POISON_OUTPUTS = True
    try:
        yield
    finally:
        _dispatch.POISON_OUTPUTS = old


def check_interpreted(
    specs: Sequence[OpSpec],
    dtypes: Sequence[torch.dtype],
    n_shapes: int = 3,
    seed: int = 0,
    progress=None,
) -> list[dict[str, Any]]:
    """Forward and backward of each op's Triton kernels (interpreted, CPU tensors) vs the fp64
    reference on the first ``n_shapes`` test shapes. One row per (op, shape, dtype, pass)."""
    cases = [(s, tuple(sh), dt) for s in specs for sh in list(s.test_shapes)[:n_shapes]
             for dt in dtypes if dt in s.dtypes]
    if progress is not None:
        progress.start(len(cases))
    rows = []
    for spec, shape, dt in cases:
        if progress is not None:
            progress.step(f"{spec.name} {shape_str(shape)} {dtype_name(dt)}")
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with _poisoned_outputs():
            try:
                inputs = spec.make_inputs(shape, dt, "cpu")
                backward = spec.has_backward and bool(inputs.grad_args)
                chk = check_impl(spec, spec.fn, inputs, dt, backward=backward, seed=seed)
            except Exception as exc:  # noqa: BLE001
                from ..testing import CheckResult

                backward = spec.has_backward
                chk = CheckResult((math.inf,), None, spec.tolerance.get(dt, 0.0), error=_err_text(exc))
        secs = round(time.perf_counter() - t0, 2)
        base = {"op": spec.name, "shape": list(shape), "dtype": dtype_name(dt), "impl": "tilefuse",
                "error": chk.error, "seconds": secs}
        rows.append({**base, "pass": "fwd", "rel_err": chk.fwd_err, "ok": chk.fwd_ok, "tolerance": chk.fwd_tol,
                     "status": "ok" if chk.fwd_ok else ("ERROR" if chk.error else "FAILED")})
        if backward:
            ok = chk.bwd_ok
            rows.append({**base, "pass": "bwd", "rel_err": chk.bwd_err, "ok": ok, "tolerance": chk.bwd_tol,
                         "status": "ok" if ok else ("ERROR" if chk.error else "FAILED")})
        if progress is not None:
            progress.advance()
    return rows
