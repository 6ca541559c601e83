"""Measured hardware ceilings, the yardsticks of ``tilefuse bench``: copy bandwidth and bf16 matmul.

* copy: ``dst.copy_(src)`` of a 1 GiB tensor into another (2 GiB allocated), median time from
  ``triton.testing.do_bench``; bytes moved = 2 x nbytes (one read + one write), reported in GB/s
  (10^9 bytes per second).
* matmul: bf16 ``torch.matmul`` of random 8192 x 8192 matrices; FLOPs = 2·M·N·K, in TFLOP/s.

Measurements are cached per device name and torch version in ``~/.cache/tilefuse/ceilings.json``
(``$XDG_CACHE_HOME`` or ``$TILEFUSE_CACHE_DIR`` move it); ``refresh=True`` remeasures.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

COPY_BYTES_PER_TENSOR = 1 << 30        # src and dst are 1 GiB each: 2 GiB allocated, 2 GiB moved
MATMUL_N = 8192                        # bf16 8192^3
CACHE_VERSION = 1


# ----------------------------------------------------------------------------------------------
# timing: the one place do_bench is called
# ----------------------------------------------------------------------------------------------


def time_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds: ``triton.testing.do_bench`` (CUDA events, L2
    flushed before each call, the flush outside the timed region), ``return_mode="median"``.
    ``warmup`` and ``rep`` are in milliseconds of GPU time, as in do_bench."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_time_ms(fn, rep: int = 100, setup=None) -> float:
    """Median time of ``fn()`` replayed from a CUDA graph: the kernels alone, with no host time
    between launches. Beside :func:`time_ms` it tells a kernel that is slow from a call whose host
    side is (no L2 flush between replays). As ``triton.testing.do_bench_cudagraph`` (one replay of
    5 calls estimates the count that fills ``rep`` ms, then 10 replays of that many calls), except
    that everything -- ``setup()``, warm-up and capture -- runs on one side stream: a backward
    built by ``setup`` (a forward pass) runs its kernels on its forward's stream, which must be the
    capturing one."""
    import statistics

    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if setup is not None:
            setup()
        fn()
        torch.cuda.synchronize()

        def capture(n: int):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(n):
                    fn()
            torch.cuda.synchronize()
            return g

        def replay_ms(g) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        estimate = replay_ms(capture(5)) / 5
        n_repeat = 1 if estimate == 0 else max(1, int(rep / estimate))
        g = capture(n_repeat)
        times = [replay_ms(g) / n_repeat for _ in range(10)]
    torch.cuda.current_stream().wait_stream(stream)
    return float(statistics.median(times))


def host_us(fn, n: int = 300) -> float:
    """Host time per call of ``fn()`` in microseconds: a Python loop, synchronized once at the end
    (so it is max(host time, GPU time) per call; ``scripts/overhead.py`` sets the two side by side)."""
    import time

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


# ----------------------------------------------------------------------------------------------
# device description
# ----------------------------------------------------------------------------------------------


def cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 - a broken driver reads as "no GPU"
        return False


def gpu_info(index: int | None = None) -> dict[str, Any]:
    """Name, SM count, memory and compute capability of a CUDA device."""
    if index is None:
        index = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    free, _ = torch.cuda.mem_get_info(index)
    return {
        "name": p.name,
        "index": index,
        "sms": p.multi_processor_count,
        "total_memory_bytes": int(p.total_memory),
        "free_memory_bytes": int(free),
        "capability": f"{p.major}.{p.minor}",
        "cuda": torch.version.cuda,
    }


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_info() -> dict[str, Any]:
    """What can honestly be said about the host when there is no GPU."""
    affinity = None
    if hasattr(os, "sched_getaffinity"):
        try:
            affinity = len(os.sched_getaffinity(0))
        except OSError:
            affinity = None
    return {
        "model": _cpu_model(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _meminfo_total(),
        "platform": platform.platform(),
    }


def versions() -> dict[str, Any]:
    import sys

    import triton

    import tilefuse

    out = {
        "tilefuse": getattr(tilefuse, "__version__", None),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "liger": None,
    }
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            out["liger"] = version("liger-kernel")
        except PackageNotFoundError:
            import liger_kernel  # type: ignore  # noqa: F401 - on PYTHONPATH, not installed

            out["liger"] = getattr(liger_kernel, "__version__", "unknown (on PYTHONPATH)")
    except Exception:  # noqa: BLE001
        pass
    return out


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------


def measure_copy_gbps(nbytes: int = COPY_BYTES_PER_TENSOR, rep: int = 300) -> dict[str, Any]:
    """Device-to-device copy bandwidth: ``dst.copy_(src)``, bytes = 2 x nbytes (read + write)."""
    free, _ = torch.cuda.mem_get_info()
    while nbytes > (64 << 20) and 2 * nbytes > 0.8 * free:   # a busy GPU: fall back to smaller
        nbytes //= 2

    def run() -> tuple[float, int]:
        src = torch.randn(nbytes // 2, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        dst = torch.empty_like(src)
        return time_ms(lambda: dst.copy_(src), warmup=50, rep=rep), 2 * src.numel() * src.element_size()

    ms, moved = run()
    torch.cuda.empty_cache()
    return {"copy_gbps": moved / (ms * 1e-3) / 1e9, "copy_ms": ms, "copy_bytes": moved}


def measure_matmul_tflops(n: int = MATMUL_N, rep: int = 300) -> dict[str, Any]:
    """bf16 ``torch.matmul`` of random n x n matrices; FLOPs = 2·n³."""

    def run() -> float:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)   # random, never zeros
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        return time_ms(lambda: torch.matmul(a, b), warmup=100, rep=rep)

    ms = run()
    flops = 2 * n * n * n
    torch.cuda.empty_cache()
    return {"matmul_tflops": flops / (ms * 1e-3) / 1e12, "matmul_ms": ms, "matmul_shape": [n, n, n]}


def measure_ceilings() -> dict[str, Any]:
    out: dict[str, Any] = {}
    out.update(measure_copy_gbps())
    out.update(measure_matmul_tflops())
    out["measured_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return out


# ----------------------------------------------------------------------------------------------
# cache
# ----------------------------------------------------------------------------------------------


def cache_path() -> Path:
    base = os.environ.get("TILEFUSE_CACHE_DIR")
    if base:
        return Path(base) / "ceilings.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "tilefuse" / "ceilings.json"


def cache_key(device_name: str) -> str:
    return f"{device_name} | torch {torch.__version__}"


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("version") == CACHE_VERSION:
            return data
    except (OSError, ValueError):
        pass
    return {"version": CACHE_VERSION, "entries": {}}


def get_ceilings(refresh: bool = False, path: Path | None = None) -> dict[str, Any]:
    """Ceilings of the current CUDA device, from the cache unless ``refresh`` or missing.

    Returns ``{copy_gbps, matmul_tflops, copy_ms, matmul_ms, measured_at, key, cached}``.
    """
    path = path or cache_path()
    key = cache_key(torch.cuda.get_device_name())
    data = _load_cache(path)
    entry = data["entries"].get(key)
    if entry is not None and not refresh:
        return {**entry, "key": key, "cached": True, "cache_path": str(path)}
    entry = measure_ceilings()
    data["entries"][key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        entry = {**entry, "cache_error": str(exc)}
    return {**entry, "key": key, "cached": False, "cache_path": str(path)}


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def info_text(refresh: bool = False) -> tuple[str, dict[str, Any]]:
    """The ``tilefuse info`` report as text, and the same facts as a dict."""
    v = versions()
    vline = "  ".join(f"{k} {val}" for k, val in v.items() if val)
    if not cuda_available():
        c = cpu_info()
        lines = [
            "No CUDA device is visible: the ceilings (copy GB/s, bf16 matmul TFLOP/s) need a GPU, so none",
            "were measured. tilefuse still runs: CPU tensors take the PyTorch reference path, or the",
            "Triton kernels under the interpreter with TRITON_INTERPRET=1 (see `tilefuse bench`).",
            "",
            f"CPU:      {c['model']} ({c['machine']})",
            f"cores:    {c['logical_cpus']} logical, {c['usable_cpus']} usable, torch threads {c['torch_threads']}",
            f"memory:   {fmt_bytes(c['memory_bytes'])}",
            f"platform: {c['platform']}",
            f"versions: {vline}",
        ]
        return "\n".join(lines), {"cuda": False, "cpu": c, "versions": v}
    g = gpu_info()
    ceil = get_ceilings(refresh=refresh)
    src = f"cached {ceil.get('measured_at', '?')}" if ceil["cached"] else "measured now"
    lines = [
        f"GPU:      {g['name']} (cc {g['capability']}, CUDA {g['cuda']})",
        f"SMs:      {g['sms']}",
        f"memory:   {fmt_bytes(g['total_memory_bytes'])} total, {fmt_bytes(g['free_memory_bytes'])} free",
        f"ceilings ({src}; key '{ceil['key']}', {ceil['cache_path']}; --refresh remeasures):",
        f"  copy    {ceil['copy_gbps']:8.0f} GB/s      dst.copy_(src), {fmt_bytes(ceil.get('copy_bytes'))}"
        f" moved per copy (read + write), median {ceil['copy_ms']:.3f} ms",
        f"  matmul  {ceil['matmul_tflops']:8.1f} TFLOP/s   bf16 torch.matmul 8192^3, median {ceil['matmul_ms']:.3f} ms",
        f"versions: {vline}",
    ]
    return "\n".join(lines), {"cuda": True, "device": g, "ceilings": ceil, "versions": v}
