"""What the host does while the GPU idles in one linear_cross_entropy fwd+bwd step (GPU;
PYTHONPATH=src).

    python scripts/lce_host_gaps.py [T H V] [--gap-us 50] [--trace PATH]

Profiles one step (after warm-up) with CPU and CUDA activities and Python stacks, finds the GPU's
idle gaps longer than ``--gap-us`` between consecutive kernels, and prints for each the Python
frames (tilefuse's, torch's) that ran on the host during it, longest first. The chrome trace is
written to ``--trace`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tilefuse.ops.cross_entropy import random_targets
from tilefuse.ops.linear_cross_entropy import linear_cross_entropy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 4096, 128256])
    ap.add_argument("--gap-us", type=float, default=50.0)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    t, hdim, vocab = args.shape
    h = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda") * hdim ** -0.5).to(torch.bfloat16).requires_grad_()
    target = random_targets(t, vocab, "cuda")
    g = torch.rand((), device="cuda", dtype=torch.bfloat16) + 0.5

    def step():
        return torch.autograd.grad(linear_cross_entropy(h, w, target), (h, w), g)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op") and "dur" in e]
    print(torch.cuda.get_device_name(), f"T={t} H={hdim} V={vocab}: {len(kernels)} kernels, "
          f"span {(kernels[-1]['ts'] + kernels[-1]['dur'] - kernels[0]['ts']) / 1e3:.2f} ms")
    idle = 0.0
    for prev, nxt in zip(kernels, kernels[1:]):
        gap_start, gap_end = prev["ts"] + prev["dur"], nxt["ts"]
        gap = gap_end - gap_start
        idle += max(gap, 0)
        if gap < args.gap_us:
            continue
        print(f"\ngap {gap:.0f} us after {prev['name'][:50]} before {nxt['name'][:50]}")
        overlap = defaultdict(float)
        for e in host:
            lo, hi = max(e["ts"], gap_start), min(e["ts"] + e["dur"], gap_end)
            if hi > lo:
                overlap[(e["cat"], e["name"][:110])] += hi - lo
        for (cat, name), us in sorted(overlap.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {us:7.0f} us  {cat[:6]:6s} {name}")
    print(f"\nGPU idle between kernels: {idle / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
