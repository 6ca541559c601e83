"""A timeline of the persistent Gluon GEMM's programs: where stream-K's extra time goes (GPU).

    cd scripts && python stream_k_trace.py [--shapes 4096x4096x4096,...] [--reps 3]

Session 48 measured stream-K's time as the even share of the work plus ~14 µs; session 49's ncu
counters (``stream_k_ncu.py``) put it at ~0.37 of a tile-time at K = 4096 and K = 8192 alike. This
sets ``_matmul_gluon.TRACE`` before anything compiles, so every consumer group stores the global
timer (ns) at: 0 its start, 1 the end of its data-parallel tiles, 2 the end of its stream-K run's
whole tiles, 3 after publishing its head's partial, 4 before collecting the previous program's
partial (after its tail's K steps), 5 once that partial's flag is up, 7 its last epilogue issued
(before the final TMA store wait), 6 its end (a timer after the partial's add made the consumer
spill: the add and the epilogue are timed together, 5 to 7). Per shape, stream-K and whole tiles
(STREAM_K off) are launched after an L2 flush; the last of ``--reps`` launches is read. Printed:
the kernel's span, the spread of the data-parallel part's end, the stream-K segments' time per K
step against the data-parallel part's, the collect-to-end time, and the last program's path.
"""

from __future__ import annotations

import argparse
import statistics

from triton.experimental.gluon import language as gl

from tilefuse.ops import _matmul_gluon as g
from tilefuse.ops import _matmul_gluon_plan as gp

g.TRACE = gl.constexpr(True)        # before the first compile of gemm_ws_kernel in this process

import torch  # noqa: E402

from tilefuse.ops import _stream_k as sk  # noqa: E402
from tilefuse.ops._matmul_kernels import split_k_buffers  # noqa: E402


def traced_launch(a, b, out, stream_k: bool, reps: int):
    """[programs, consumers, 8] int64 timer values (ns) of the last of ``reps`` launches."""
    (m, k), n = a.shape, b.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = dict(gp.LARGE_WS_TILES["128x256"], STREAM_K=stream_k)
    sk.STREAM_K_MIN_IDLE_STEPS = 0
    plan = gp._ws_plan(m, n, k, 2, 2, b.stride(0) == 1, sms, (False, "none", False, False), (n, 1),
                      tuple(cfg.items()))
    programs = plan.grid[0]
    trace = torch.full((programs, cfg["CONSUMERS"], g.TRACE_EVENTS.value), -1, dtype=torch.int64, device="cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(reps):
        flush.zero_()
        trace.fill_(-1)
        bufs = split_k_buffers(a.device, plan.sk_slots, plan.sk_workspace) if plan.sk_slots else None
        gp.launch_ws_plan(plan, a, b, out, preact=trace, sk_buffers=bufs)
    torch.cuda.synchronize()
    sk_tiles = plan.prepared.ints[-1]
    return trace.cpu(), programs, sk_tiles


def summarize(name, trace, programs, sk_tiles, m, n, k):
    t = trace[:, 0, :].double()          # consumer group 0 (group 1 runs the same schedule)
    t0 = t[:, 0].min()
    rel = (t - t0) / 1000.0              # µs from the first program's start
    k_tiles = -(-k // 64)
    tiles = -(-m // 128) * -(-n // 256)
    dp = tiles - sk_tiles
    end = rel[:, 6].max().item()
    print(f"  {name:9s} span {end:7.1f} µs; starts {rel[:, 0].min():.1f}-{rel[:, 0].max():.1f}; "
          f"data-parallel end {rel[:, 1].min():.1f} / {statistics.median(rel[:, 1].tolist()):.1f} / "
          f"{rel[:, 1].max():.1f} (min / median / max); program ends {rel[:, 6].min():.1f}-{end:.1f}")
    dp_tiles = [len(range(p, dp, programs)) for p in range(programs)]
    step_us = statistics.median([(rel[p, 1] - rel[p, 0]).item() / (dp_tiles[p] * k_tiles)
                                 for p in range(programs) if dp_tiles[p]])
    print(f"  {'':9s} data-parallel: {step_us * 1000:.0f} ns per K step ({step_us * k_tiles:.1f} µs a tile)")
    if not sk_tiles:
        tail_us = statistics.median((rel[:, 6] - rel[:, 7]).tolist())
        print(f"  {'':9s} last epilogue issued to end (median): {tail_us:.1f} µs")
        return
    whole_s, head_s, tail_s, ends, waits, adds, stores = [], [], [], [], [], [], []
    for p in range(programs):
        segs = sk.stream_k_segments(sk_tiles, k_tiles, programs, p)
        whole = sum(e - s for role, _, s, e in segs if role == "whole")
        head = sum(e - s for role, _, s, e in segs if role == "publish")
        tail = sum(e - s for role, _, s, e in segs if role == "collect")
        if whole:
            whole_s.append((rel[p, 2] - rel[p, 1]).item() * 1000 / whole)
        if head:
            head_s.append((rel[p, 3] - rel[p, 2]).item() * 1000 / head)
        if tail:
            tail_s.append((rel[p, 4] - rel[p, 3]).item() * 1000 / tail)
            ends.append((rel[p, 6] - rel[p, 4]).item())
            waits.append((rel[p, 5] - rel[p, 4]).item())
            adds.append((rel[p, 7] - rel[p, 5]).item())
            stores.append((rel[p, 6] - rel[p, 7]).item())
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    print(f"  {'':9s} stream-K ns per K step (median): whole tiles {med(whole_s):.0f}, heads {med(head_s):.0f}, "
          f"tails {med(tail_s):.0f}; collect to end {med(ends):.1f} µs (max {max(ends) if ends else 0:.1f}): "
          f"flag wait {med(waits):.1f} (max {max(waits) if waits else 0:.1f}), add + epilogue {med(adds):.1f}, "
          f"last store {med(stores):.1f}")
    last = int(rel[:, 6].argmax())
    r = rel[last]
    print(f"  {'':9s} last program {last}: start {r[0]:.1f}, dp end {r[1]:.1f}, whole {r[2]:.1f}, published "
          f"{r[3]:.1f}, tail done {r[4]:.1f}, flag {r[5]:.1f}, epilogue {r[7]:.1f}, end {r[6]:.1f}; segments "
          f"{sk.stream_k_segments(sk_tiles, k_tiles, programs, last)}")
    ideal = rel[:, 1].median().item() + (sk_tiles * k_tiles / programs) * step_us
    print(f"  {'':9s} even share after the median data-parallel end: {ideal:.1f} µs; "
          f"span - that = {end - ideal:.1f} µs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096x4096,8192x4096x4096,8192x8192x8192,8192x6144x4096")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "bf16 x @ w.t(), 128x256 tiles, one traced launch after an L2 flush")
    for text in args.shapes.split(","):
        m, n, k = (int(v) for v in text.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().t()
        print(f"{m}x{n}x{k}")
        for name, on in [("stream-k", True), ("whole", False)]:
            trace, programs, sk_tiles = traced_launch(a, w.t(), out, on, args.reps)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if (trace[:, :, [0, 1, 6]] < 0).any():
                print(f"  {name}: events missing (a kernel compiled without TRACE?)")
                continue
            print(f"  {name:9s} rel err {err:.2e}, stream-K region {sk_tiles} tiles")
            summarize(name, trace, programs, sk_tiles, m, n, k)


if __name__ == "__main__":
    main()
