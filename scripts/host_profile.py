"""Where tilefuse's host time goes on the GPU machine: cProfile of rms_norm's forward and of its
backward custom op called directly on the main thread, and of small-M matmuls (the autograd engine runs backward on its
device thread, which cProfile of the main thread cannot see). PYTHONPATH=src.

    python scripts/host_profile.py [--matmul-grad [MxNxK ...]]

``--matmul-grad``: only the matmul forward with grad-requiring a and b (the benchmark's ``fwd``
pass: a training forward that records the graph), beside torch.matmul's, at M = 1 and 128.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

import tilefuse
from tilefuse.ops import norms as nm


CUMULATIVE = False      # also print the top functions by cumulative time (--matmul-grad)


def _profile(label, fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    print(f"\n== {label}: {(time.perf_counter() - t) / n * 1e6:.1f} µs per call (no profiler)")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    if CUMULATIVE:
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


def _matmul_grad(shapes) -> None:
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        # the benchmark's b: a transposed weight view when N is odd, else row-major [K, N]
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        _profile(f"matmul {m}x{n}x{k} fwd, grad inputs", lambda: tilefuse.matmul(a, b), n=1000)
        _profile(f"torch.matmul {m}x{n}x{k} fwd, grad inputs", lambda: torch.matmul(a, b), n=1000)


def main() -> None:
    import sys

    if "--matmul-grad" in sys.argv:
        global CUMULATIVE
        CUMULATIVE = True
        shapes = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:] if a[0].isdigit()]
        _matmul_grad(shapes or [(1, 4096, 4096), (128, 4096, 4096)])
        return
    x = torch.randn(8, 4096, device="cuda")
    w = torch.randn(4096, device="cuda")
    dy = torch.randn_like(x)
    _, _, _, rstd = nm._norm_fwd_op(x, w, None, None, 1e-6, 0.0, True)
    _profile("rms_norm fwd (no grad)", lambda: tilefuse.rms_norm(x, None, w))
    _profile("norm_bwd op (direct)", lambda: nm._norm_bwd_op(dy, x, w, None, rstd, None, 0.0, True, True, False,
                                                             torch.float32, torch.float32))
    for m in (1, 16, 128):
        a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        wt = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        _profile(f"matmul {m}x4096x4096 fwd", lambda: tilefuse.matmul(a, wt))
    _profile("torch.empty_like x4", lambda: (torch.empty_like(x), torch.empty_like(x), torch.empty_like(x),
                                              torch.empty_like(x)))
    _profile("x.device / data_ptr / stride x10", lambda: [(x.device, x.data_ptr(), x.stride()) for _ in range(10)])


if __name__ == "__main__":
    main()
