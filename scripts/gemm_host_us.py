"""Host time per GEMM launch: the Gluon kernel against the tl kernel, at one large-M shape.

    python scripts/gemm_host_us.py [M N K] [--calls 200] [--profile]

Each variant enqueues ``--calls`` launches with no synchronization inside the loop; the loop's
perf_counter time per call is the host's cost as long as the GPU is the slower side (the table
also gives the wall time per call after a final synchronize: when the two agree, the loop was
host-bound). Rows: ``launch_matmul`` on the forward's layout (x @ w.t()), the input gradient's
(dy @ w, row-major b) and the weight gradient's (dyᵀ @ x, M-major a), each with a fresh output,
and a whole ``tilefuse.matmul`` training step (forward + ``autograd.grad`` of x and w), its
forward alone (building the graph), and the step with the backward on the calling thread. Variants:
"gluon" (default) and "tl" (``_matmul_kernels.GLUON_LARGE_M = False``); "torch" for the step.
``--profile``: cProfile of the Gluon forward launch, or of ``--profile-row "step fwd+bwd"``
(top 25 by own and by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import tilefuse
from tilefuse.ops import _matmul_kernels as mk


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host µs per call in the loop, wall µs per call once the GPU is done)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def _one_thread(fn):
    """fn with the autograd engine's backward on the calling thread (no device-thread hand-off)."""
    with torch.autograd.set_multithreading_enabled(False):
        return fn()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[1024, 4096, 4096])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-row", default="fwd x @ w.t()", help="which row --profile profiles")
    args = ap.parse_args()
    m, n, k = args.shape
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w, dy = torch.randn(m, k, **bf), torch.randn(n, k, **bf), torch.randn(m, n, **bf)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rows = {
        "fwd x @ w.t()": lambda: mk.launch_matmul(x, w.t()),
        "dgrad dy @ w": lambda: mk.launch_matmul(dy, w),
        "wgrad dy.t() @ x": lambda: mk.launch_matmul(dy.t(), x),
        "step fwd+bwd": lambda: torch.autograd.grad(tilefuse.matmul(xg, wg.t()), (xg, wg), dy),
        "step fwd only": lambda: tilefuse.matmul(xg, wg.t()),
        "step, 1 thread": lambda: _one_thread(lambda: torch.autograd.grad(tilefuse.matmul(xg, wg.t()), (xg, wg), dy)),
    }
    torch_rows = {
        "step fwd+bwd": lambda: torch.autograd.grad(xg @ wg.t(), (xg, wg), dy),
        "step fwd only": lambda: xg @ wg.t(),
        "step, 1 thread": lambda: _one_thread(lambda: torch.autograd.grad(xg @ wg.t(), (xg, wg), dy)),
    }
    print(torch.cuda.get_device_name(), f"{m}x{n}x{k} bf16: host µs per call in the loop / wall µs per call")
    for name, fn in rows.items():
        cells = []
        for variant in ("gluon", "tl"):
            mk.GLUON_LARGE_M = variant == "gluon"
            mk._matmul_plan.cache_clear()
            host, wall = per_call_us(fn, args.calls)
            cells.append(f"{variant} {host:6.1f} / {wall:6.1f}")
        if name in torch_rows:
            host, wall = per_call_us(torch_rows[name], args.calls)
            cells.append(f"torch {host:6.1f} / {wall:6.1f}")
        print(f"  {name:18s} " + "   ".join(cells))
    mk.GLUON_LARGE_M = True
    mk._matmul_plan.cache_clear()
    if args.profile:
        # a step's backward runs on the calling thread, where cProfile sees it
        row = rows[args.profile_row]
        fn = (lambda: _one_thread(row)) if args.profile_row.startswith("step") else row
        per_call_us(fn, 50)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
