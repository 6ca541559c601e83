"""Where a tilefuse.matmul training step's host time goes on the GPU machine (PYTHONPATH=src).

    python scripts/matmul_host_ladder.py [M N K ...] [--calls 300] [--profile ROW]

At a shape whose kernels take a few µs (default 1024x1024x64: the large-M Gluon path, and
128x1024x64: the small-M one), each row enqueues ``--calls`` calls with no synchronization inside
the loop and reports host µs per call: the ladder from an allocation and a cuBLAS call up to a
whole fwd+bwd step, ours beside torch's. "MT" rows run the backward on the autograd engine's
device thread (the default), "1T" rows on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``). ``in bwd`` is the time spent inside our
Python backward per step (perf_counter around the eager Function's backward), so the rest of a
step's backward is the engine: thread hand-offs and graph bookkeeping.
``--profile ROW``: cProfile of that row (a step row's backward on the calling thread).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from attn_host_probe import us_per_call

import tilefuse
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops import matmul as mm


def host_us(fn, calls: int) -> float:
    """Host µs per call: the best of three loops (the host's noise is one-sided)."""
    return us_per_call(fn, calls, rounds=3)


class BackwardTimer:
    """Seconds spent inside matmul's eager backward, summed (wraps the Function's backward)."""

    def __init__(self):
        self.cls = mm._matmul_fwd_op._function
        self.orig = self.cls.__dict__["backward"]
        self.total = 0.0
        orig = self.orig.__func__

        def timed(ctx, *grads):
            t = time.perf_counter()
            try:
                return orig(ctx, *grads)
            finally:
                self.total += time.perf_counter() - t
        self.cls.backward = staticmethod(timed)

    def restore(self):
        self.cls.backward = self.orig


def _no_memo(fn):
    """fn with the Gluon launches' AddressMemo switched off (the A/B of _matmul_kernels.MEMO_LAUNCHES)."""
    mk.MEMO_LAUNCHES = False
    try:
        return fn()
    finally:
        mk.MEMO_LAUNCHES = True


def one_thread(fn):
    with torch.autograd.set_multithreading_enabled(False):
        return fn()


def ladder(m: int, n: int, k: int, calls: int, profile: str | None) -> None:
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w, dy = torch.randn(m, k, **bf), torch.randn(n, k, **bf), torch.randn(m, n, **bf)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ours_out = tilefuse.matmul(xg, wg.t())
    torch_out = xg @ wg.t()
    step = lambda: torch.autograd.grad(tilefuse.matmul(xg, wg.t()), (xg, wg), dy)      # noqa: E731
    tstep = lambda: torch.autograd.grad(xg @ wg.t(), (xg, wg), dy)                      # noqa: E731
    rows = {
        "torch.empty [M, N]": (lambda: torch.empty(m, n, **bf), None),
        "launch_matmul x @ w.t()": (lambda: mk.launch_matmul(x, w.t()), lambda: torch.mm(x, w.t())),
        "launch_matmul dy @ w": (lambda: mk.launch_matmul(dy, w), lambda: torch.mm(dy, w)),
        "launch_matmul dy.t() @ x": (lambda: mk.launch_matmul(dy.t(), x), lambda: torch.mm(dy.t(), x)),
        "launch_matmul x @ w.t(), no memo": (lambda: _no_memo(lambda: mk.launch_matmul(x, w.t())), None),
        "step, MT, no memo": (lambda: _no_memo(step), None),
        "matmul, no grad": (lambda: tilefuse.matmul(x, w.t()), lambda: x @ w.t()),
        "matmul fwd, graph": (lambda: tilefuse.matmul(xg, wg.t()), lambda: xg @ wg.t()),
        "bwd only, MT": (lambda: torch.autograd.grad(ours_out, (xg, wg), dy, retain_graph=True),
                         lambda: torch.autograd.grad(torch_out, (xg, wg), dy, retain_graph=True)),
        "bwd only, 1T": (lambda: one_thread(lambda: torch.autograd.grad(ours_out, (xg, wg), dy, retain_graph=True)),
                         lambda: one_thread(lambda: torch.autograd.grad(torch_out, (xg, wg), dy, retain_graph=True))),
        "step, MT": (step, tstep),
        "step, 1T": (lambda: one_thread(step), lambda: one_thread(tstep)),
    }
    plan = mk._matmul_plan.cache_info()
    print(f"\n{torch.cuda.get_device_name()} {m}x{n}x{k} bf16, host µs per call (best of 3 loops of {calls})")
    print(f"  {'row':34s} {'tilefuse':>9s} {'torch':>9s}   in our bwd / step")
    for name, (ours, theirs) in rows.items():
        timer = BackwardTimer() if name.startswith(("step", "bwd")) else None
        us = host_us(ours, calls)
        inside = ""
        if timer is not None:
            timer.total = 0.0
            for _ in range(calls):
                ours()
            torch.cuda.synchronize()
            inside = f"{timer.total / calls * 1e6:8.1f}"
            timer.restore()
        them = f"{host_us(theirs, calls):9.1f}" if theirs is not None else " " * 9
        print(f"  {name:34s} {us:9.1f} {them}   {inside}")
    print(f"  (plan cache: {mk._matmul_plan.cache_info()}, before the rows: {plan})")
    if profile:
        fn = rows[profile][0]
        if profile.startswith("step"):
            fn = lambda: one_thread(step)      # noqa: E731
        host_us(fn, 50)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[1024, 1024, 64, 128, 1024, 64])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    shapes = [args.shape[i:i + 3] for i in range(0, len(args.shape), 3)]
    for m, n, k in shapes:
        ladder(m, n, k, args.calls, args.profile)


if __name__ == "__main__":
    main()
