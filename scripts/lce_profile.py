"""Where one linear_cross_entropy fwd+bwd step spends its time, kernel by kernel (GPU; PYTHONPATH=src).

    python scripts/lce_profile.py [T H V] [--iters 3] [--ab ROUNDS]

Runs the bench's ``fwd+bwd`` pass (forward with grad-requiring hidden and weight, then
``torch.autograd.grad`` with a random scalar grad_output) for tilefuse and for eager
``F.cross_entropy(h @ W.T)``, each timed with CUDA events around whole steps (after warm-up),
then under ``torch.profiler``: the GPU time summed per kernel name, the kernels' total against the
step's wall time (the rest is GPU idle: host waits, syncs, allocator), and the largest idle gaps
between consecutive kernels with the kernel that follows each.

``--ab ROUNDS [--variants ...]``: instead, interleaved rounds of step wall times (CUDA events,
median of 3 steps per round), do_bench medians of back-to-back steps (as the benchmark times them)
and the peak memory above the inputs, for the variants named (see ``ab``) and eager: the same
process and GPU for all. (Earlier variants -- Gluon or cuBLAS GEMMs, the target test awaited late
or up front, the CE rows' configs -- are in git history.)
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F

from tilefuse.ops.cross_entropy import random_targets
from tilefuse.ops.linear_cross_entropy import linear_cross_entropy


def make(t: int, hdim: int, vocab: int):
    h = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda") * hdim ** -0.5).to(torch.bfloat16).requires_grad_()
    return h, w, random_targets(t, vocab, "cuda")


def step_fn(impl: str, h, w, target):
    g = torch.rand((), device="cuda", dtype=torch.bfloat16) + 0.5

    import tilefuse.ops.linear_cross_entropy as lce

    def step():
        if impl.startswith("tilefuse"):
            # "tilefuse-nodefer": the whole grad_weight in the forward, then the scale pass;
            # "tilefuse-nocheck": check_targets=False; "tilefuse-cublaswg": the accumulating grad_weight
            # GEMMs on cuBLAS, the deferred one on the 128x256 Gluon tile (s49 and before)
            lce.DEFER_LAST_WEIGHT_GRAD = impl != "tilefuse-nodefer"
            lce.GLUON_WEIGHT_GRAD = impl != "tilefuse-cublaswg"
            lce.WEIGHT_GRAD_TILE = "128x256" if impl == "tilefuse-cublaswg" else "128x128-pingpong"
            try:
                loss = linear_cross_entropy(h, w, target, check_targets=impl != "tilefuse-nocheck")
            finally:
                lce.DEFER_LAST_WEIGHT_GRAD = True
                lce.GLUON_WEIGHT_GRAD = True
                lce.WEIGHT_GRAD_TILE = "128x128-pingpong"
        else:
            loss = F.cross_entropy((h @ w.t()).float(), target) if impl == "eager-fp32" else \
                F.cross_entropy(h @ w.t(), target)
        return torch.autograd.grad(loss, (h, w), g)
    return step


def wall_ms(step, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def profile(name: str, step, iters: int) -> None:
    step()
    torch.cuda.synchronize()
    walls = wall_ms(step, iters)
    print(f"\n== {name}: step wall (CUDA events) {', '.join(f'{x:.2f}' for x in walls)} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per_name: dict = defaultdict(lambda: [0, 0.0])
    busy = 0.0
    for e in events:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.time_range.elapsed_us()
        busy += e.time_range.elapsed_us()
    span = (events[-1].time_range.end - events[0].time_range.start) if events else 0
    print(f"kernels {busy / iters / 1e3:.2f} ms per step; first-to-last span {span / iters / 1e3:.2f} ms per step")
    for nm, (cnt, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {us / iters / 1e3:8.3f} ms  {cnt // iters:4d}x  {nm[:110]}")
    gaps = sorted(((b.time_range.start - a.time_range.end, b.name) for a, b in zip(events, events[1:])),
                  reverse=True)
    print("largest idle gaps (us, next kernel):", ", ".join(f"{g:.0f} {n[:40]}" for g, n in gaps[:8]))
    print(f"idle between kernels {sum(max(0, g) for g, _ in gaps) / iters / 1e3:.2f} ms per step")


def peak_extra_mib(step) -> float:
    """Peak memory above what was allocated before the step (gradients included), MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def ab(rounds: int, h, w, target, variants: list[str]) -> None:
    """Interleaved rounds of the named variants: "default", "nodefer" (no deferred last chunk),
    "nocheck" (no target range test), "cublaswg" (the accumulating grad_weight GEMMs on cuBLAS, as
    up to s49), "gluonwg" (on the Gluon accumulate kernel's 128x256 tile; the default: its ping-pong
    tile), "chunkN" (N tokens per chunk), "tlgemm" (the chunks' own
    GEMMs on the tl kernel, not the Gluon one), "eager"; a "-g1" suffix takes grad_output 1.
    (s37 also had "streams": each chunk's grad_hidden GEMM on a side stream beside its grad_weight
    GEMM; 45.85 against 44.53 ms do_bench, slower, removed.)"""
    import statistics

    import triton.testing

    import tilefuse.ops._matmul_kernels as mk
    import tilefuse.ops.linear_cross_entropy as lce

    def configure(name):
        base, _, unit = name.partition("-")
        mk.GLUON_LARGE_M = base != "tlgemm"     # held while this variant is timed
        mk._matmul_plan.cache_clear()
        chunk = int(base[5:]) if base.startswith("chunk") else None
        if base == "eager":
            return step_fn("eager", h, w, target)
        # "-g1": grad_output exactly 1 (no scale pass); else a random one, as the benchmark's
        g = torch.ones((), device="cuda", dtype=torch.bfloat16) if unit == "g1" else \
            torch.rand((), device="cuda", dtype=torch.bfloat16) + 0.5

        def step():
            # "nodefer": the whole grad_weight in the forward, then the scale pass (s41 and before)
            lce.DEFER_LAST_WEIGHT_GRAD = base != "nodefer"
            # "cublaswg": the accumulating grad_weight GEMMs on cuBLAS (GLUON_WEIGHT_GRAD off) and the
            # deferred last one on the 128x256 Gluon tile (s49 and before); "gluonwg": all on that tile;
            # default: all on the ping-pong tile
            lce.GLUON_WEIGHT_GRAD = base != "cublaswg"
            lce.WEIGHT_GRAD_TILE = "128x256" if base in ("gluonwg", "cublaswg") else "128x128-pingpong"
            try:
                # "nocheck": check_targets=False (no range test, so no host wait on it)
                loss = linear_cross_entropy(h, w, target, chunk_tokens=chunk, check_targets=base != "nocheck")
                return torch.autograd.grad(loss, (h, w), g)
            finally:
                lce.DEFER_LAST_WEIGHT_GRAD = True
                lce.GLUON_WEIGHT_GRAD = True
                lce.WEIGHT_GRAD_TILE = "128x128-pingpong"
        return step

    times = {name: [] for name in variants}
    benched = {name: [] for name in variants}
    extra = {}
    for _ in range(rounds):
        for name in variants:
            step = configure(name)
            step()
            extra.setdefault(name, peak_extra_mib(step))
            times[name].append(statistics.median(wall_ms(step, 3)))
            # back to back, as the benchmark times it (no sync between steps but the op's own)
            benched[name].append(triton.testing.do_bench(step, warmup=1, rep=300, return_mode="median"))
    print("step wall after a sync (CUDA events) | do_bench back to back; medians over rounds, ms; peak extra MiB")
    for name in variants:
        ts, bs = times[name], benched[name]
        print(f"  {name:24s} {statistics.median(ts):7.2f} | {statistics.median(bs):7.2f}  {extra[name]:7.0f} MiB"
              f"   rounds {' '.join(f'{t:.2f}' for t in ts)} | {' '.join(f'{b:.2f}' for b in bs)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 4096, 128256])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=["tilefuse", "eager"])
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS")
    ap.add_argument("--variants", nargs="+", default=["default", "eager"])
    args = ap.parse_args()
    t, hdim, vocab = args.shape
    print(torch.cuda.get_device_name(), f"T={t} H={hdim} V={vocab} bf16")
    h, w, target = make(t, hdim, vocab)
    if args.ab:
        ab(args.ab, h, w, target, args.variants)
        return
    for impl in args.impls:
        profile(impl, step_fn(impl, h, w, target), args.iters)


if __name__ == "__main__":
    main()
