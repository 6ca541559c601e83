"""Why the first case of a bench group can read host-bound (attention_causal D = 64, S = 1k bwd).

    PYTHONPATH=src python scripts/first_case_probe.py

In one fresh process: the tilefuse backward timed the bench's way (autograd.grad on a retained
graph, do_bench median) every ~1 s for a while after start, with the host time per call and the
count / CPU time of child processes (inductor's compile workers) beside; then again after a
torch.compile of a trivial function has started inductor's worker pool.
"""

import os
import time

import torch
import triton.testing

import tilefuse
from tilefuse.bench import host_us


def children():
    """(count, summed CPU seconds) of this process's child processes, from /proc."""
    me, n, cpu = os.getpid(), 0, 0.0
    tck = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            n += 1
            cpu += (int(fields[11]) + int(fields[12])) / tck
    return n, cpu


t0 = time.time()
b, s, h, d = 16, 1024, 16, 64
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = tilefuse.attention(q, k, v, causal=True)
do = torch.randn_like(out)
bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)   # noqa: E731
bwd()
torch.cuda.synchronize()


def sample(tag, n):
    for _ in range(n):
        ms = triton.testing.do_bench(bwd, return_mode="median")
        print(f"{tag:14s} t={time.time() - t0:6.1f}s bwd {ms * 1e3:7.1f} us  host {host_us(bwd, 100):7.1f} us/call"
              f"  children {children()}", flush=True)


sample("fresh", 8)
f = torch.compile(lambda x: torch.sin(x) * 2)
f(torch.randn(8, device="cuda"))
print(f"compiled a trivial fn at t={time.time() - t0:.1f}s", flush=True)
sample("after compile", 12)
