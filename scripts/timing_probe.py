"""Four ways to time one call of an op, side by side (GPU machine, PYTHONPATH=src).

    python scripts/timing_probe.py [OP:SHAPE ...] [--dtype bf16] [--peers torch,sdpa]

Why: ``tilefuse bench`` times each call with ``triton.testing.do_bench``, which flushes L2 before
every call by ``zero_()``-ing a 256 MB buffer. That leaves up to an L2's worth (~50 MB on an H200)
of *dirty* lines, which the timed call must write back to DRAM as it allocates its own lines: for
a kernel that only reads (decode attention, a GEMV) those are bytes it did not ask to move, and
the bench has called the gap to the graph figure "host time". This script separates the causes:

- ``zero flush``: do_bench's own loop (flush by ``zero_``, CUDA events around one call, median);
- ``read flush``: the same loop, the flush a *read* of the 256 MB buffer (``sum``): it evicts
  the op's inputs just as well, and leaves L2 holding clean lines, so nothing is written back
  inside the timed call that the call did not write;
- ``stream``: N calls back to back over C copies of the inputs (each copy's bytes evicted by the
  others before it comes round again), events around the whole loop, no flush: the steady state
  of a program that calls the op repeatedly, host time included (if the host is slower than the
  kernels, this shows it);
- ``graph``: the same N calls replayed from one CUDA graph: the kernels alone, inputs from DRAM.

Each figure is µs per call and % of the 1 GiB copy ceiling measured in this run (the bench's
ceiling, zero-flush do_bench of ``copy_``); the copy ceiling itself is printed under each method.
Forward passes only: ``OP:SHAPE`` names a registered op and one of its shapes (``x``-separated).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import triton

from tilefuse import registry
from tilefuse.bench.ceilings import measure_copy_gbps

FLUSH_BYTES = 256 * 1000 * 1000         # do_bench's flush buffer (get_empty_cache_for_benchmark)
L2_COVER_BYTES = 3 * 60 * 1000 * 1000   # the copies of the inputs cycled by stream/graph: > 3 L2s


@triton.jit
def empty_kernel(x_ptr):
    pass


def events_loop_ms(fn, flush, reps: int = 200, warmup: int = 20) -> float:
    """do_bench's loop with a chosen flush: median of CUDA-event times around one call."""
    for _ in range(warmup):
        flush()
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def stream_ms(fns, calls: int, rounds: int = 7) -> float:
    """Per-call time of ``calls`` back-to-back calls cycling over ``fns`` (median of rounds)."""
    for f in fns:
        f()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for i in range(calls):
            fns[i % len(fns)]()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)


def graph_ms(fns, calls: int, rounds: int = 7) -> float:
    """The same back-to-back calls replayed from one CUDA graph (side stream, as the bench)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for i in range(calls):
                fns[i % len(fns)]()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)


def warm_up(fn, ms: float = 100.0) -> None:
    """Run ``fn`` for about ``ms`` of GPU time first: after a row of tiny kernels the GPU's clocks
    are down, and the first method timed would read them ramping up (s34: a 16384×4096 rms_norm
    read 131.7 µs after 1×4096 rows, 68.5 µs warm)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    for _ in range(min(10_000, int(ms / max(s.elapsed_time(e), 1e-3)))):
        fn()
    torch.cuda.synchronize()


def methods(fns, calls: int) -> dict[str, float]:
    """µs per call by each of the four methods (fns: one callable per input copy)."""
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    warm_up(fns[0])
    times = {
        "zero flush": events_loop_ms(fns[0], buf.zero_) * 1e3,
        "read flush": events_loop_ms(fns[0], buf.sum) * 1e3,
        "stream": stream_ms(fns, calls) * 1e3,
    }
    try:
        times["graph"] = graph_ms(fns, calls) * 1e3
    except RuntimeError as exc:     # a peer that syncs with the host (SDPA's .tolist()) cannot be captured
        print(f"  (not capturable: {str(exc).splitlines()[0][:80]})")
        torch.cuda.synchronize()
        times["graph"] = float("nan")
    return times


def copies_for(nbytes: int) -> int:
    """Input copies so the cycle's bytes exceed a few L2s (2 at least, 16 at most)."""
    return max(2, min(16, math.ceil(L2_COVER_BYTES / max(nbytes, 1))))


def print_row(name: str, nbytes: int, times: dict[str, float], gbps: float) -> None:
    cells = []
    for us in times.values():
        pct = f"{100 * nbytes / (us * 1e-6) / 1e9 / gbps:5.1f}%" if nbytes and us == us else "     -"
        cells.append(f"{us:9.1f} {pct}")
    print(f"{name:44s} " + "  ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["softmax:8192x4096", "attention_decode:1x1x32x8x32768x128",
                                                 "attention_decode:16x1x32x8x8192x128"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--peers", default="torch,sdpa", help="comma-separated peer names to time beside tilefuse")
    ap.add_argument("--no-copies", dest="copies", action="store_false", help="skip the copy_ rows")
    ap.add_argument("--calls", type=int, default=40, help="calls per stream / graph round")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    gbps = measure_copy_gbps()["copy_gbps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy ceiling (1 GiB copy_, zero-flush do_bench) {gbps:,.0f} GB/s")
    print(f"{'case':44s} " + "  ".join(f"{m:>16s}" for m in ("zero flush", "read flush", "stream", "graph")))
    print(f"{'':44s} " + "  ".join(f"{'us  % copy':>16s}" for _ in range(4)))

    x = torch.empty(1, device="cuda")
    print_row("empty Triton kernel", 0, methods([lambda: empty_kernel[(1,)](x)], a.calls), gbps)
    for nbytes in ((1 << 30, 64 << 20) if a.copies else ()):        # copy_ of 1 GiB (the ceiling) and of 64 MiB
        srcs = [torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16) for _ in range(copies_for(2 * nbytes))]
        dsts = [torch.empty_like(s) for s in srcs]
        fns = [lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)]
        print_row(f"copy_ {nbytes >> 20} MiB -> {nbytes >> 20} MiB", 2 * nbytes, methods(fns, a.calls), gbps)
        del srcs, dsts, fns
        torch.cuda.empty_cache()

    for case in a.cases:
        name, shape_s = case.split(":")
        shape = tuple(int(n) for n in shape_s.split("x"))
        spec = registry.get(name)
        nbytes = spec.bytes_fn(shape, dtype, "fwd")
        impls = {"tilefuse": spec.fn}
        for peer in a.peers.split(","):
            factory = spec.peers.get(peer)
            fn = factory() if factory else None
            if fn is not None:
                impls[peer] = fn
        inputs = [spec.make_inputs(shape, dtype, "cuda") for _ in range(copies_for(nbytes))]
        for impl, fn in impls.items():
            with torch.no_grad():
                fns = [lambda i=i, fn=fn: fn(*i.args, **i.kwargs) for i in inputs]
                print_row(f"{name} {shape_s} {impl}", nbytes, methods(fns, a.calls), gbps)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
