"""What autograd's zero-filled gradient of a side output cost (session 26's fix), on the GPU.

    PYTHONPATH=src python scripts/side_output_probe.py [--rounds 5]

Attention's lse, a matmul's saved pre-activation and the gate-up GEMM's saved g | u are outputs
of their custom ops that never get a gradient. Until session 26 the eager path let autograd
"materialize" one for each: a zero-filled tensor of the output's shape allocated per backward
(an [M, N] fill for a matmul with an activation). Now they are registered with
``materialize_grads=False``. This probe times fwd + bwd both ways in one process: "before" puts
the materialization back (``ctx.set_materialize_grads(True)`` after the op's forward), "after" is
the code as it is. do_bench medians (L2 flushed), the two interleaved over ``--rounds``, plus the
peak memory of one fwd + bwd above what the inputs hold, and the largest gradient difference
between the two (0 unless a kernel sums in a run-dependent order).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

import tilefuse
from tilefuse.ops import attention as attention_mod
from tilefuse.ops import gate_up as gate_up_mod
from tilefuse.ops import matmul as matmul_mod


def _materializing(fast_op):
    """A context in which ``fast_op``'s eager Function materializes grads again (the old code)."""
    function = fast_op._function
    original = function.__dict__["forward"]

    class Restore:
        def __enter__(self):
            def forward(ctx, *args):
                out = original.__func__(ctx, *args)
                ctx.set_materialize_grads(True)
                return out
            function.forward = staticmethod(forward)

        def __exit__(self, *exc):
            function.forward = original

    return Restore()


def _cases():
    bf16, dev = torch.bfloat16, "cuda"

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(bf16).requires_grad_(True)

    for m, n, k in ((8192, 14336, 4096), (8192, 4096, 4096)):
        a, w = leaf(m, k), leaf(n, k, scale=k ** -0.5)
        yield (f"matmul gelu {m}x{n}x{k}", matmul_mod._matmul_fwd_op,
               lambda a=a, w=w: tilefuse.matmul(a, w.t(), activation="gelu"), (a, w))
    x, wg = leaf(8192, 4096), leaf(2 * 14336, 4096, scale=4096 ** -0.5)
    yield ("swiglu_linear 8192x4096 -> 14336", gate_up_mod._gate_up_fwd_op,
           lambda: tilefuse.swiglu_linear(x, wg), (x, wg))
    for s, d in ((1024, 64), (4096, 128)):
        q, k_, v = (leaf(16384 // s, s, 16, d) for _ in range(3))
        yield (f"attention causal S={s} D={d}", attention_mod._attention_fwd_op,
               lambda q=q, k_=k_, v=v: tilefuse.attention(q, k_, v, causal=True), (q, k_, v))


def _step(forward, leaves, grad):
    return torch.autograd.grad(forward(), leaves, grad)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    rounds = ap.parse_args().rounds
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':36s} {'before ms':>10s} {'after ms':>9s} {'speedup':>8s} {'peak before':>12s} {'peak after':>11s}")
    for name, op, forward, leaves in _cases():
        grad = torch.randn_like(forward())
        results, samples, peaks = {}, {"before": [], "after": []}, {}
        for mode in ("before", "after"):
            ctx = _materializing(op) if mode == "before" else None
            with ctx if ctx else torch.enable_grad():
                results[mode] = _step(forward, leaves, grad)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                _step(forward, leaves, grad)
                torch.cuda.synchronize()
                peaks[mode] = (torch.cuda.max_memory_allocated() - base) / 2**20
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["before"], results["after"]))
        for r in range(rounds):
            for mode in (("before", "after") if r % 2 == 0 else ("after", "before")):
                ctx = _materializing(op) if mode == "before" else None
                with ctx if ctx else torch.enable_grad():
                    samples[mode].append(triton.testing.do_bench(lambda: _step(forward, leaves, grad),
                                                                 return_mode="median"))
        t0, t1 = statistics.median(samples["before"]), statistics.median(samples["after"])
        print(f"{name:36s} {t0:10.3f} {t1:9.3f} {t0 / t1:7.3f}x {peaks['before']:9.0f} MiB {peaks['after']:7.0f} MiB"
              f"  grads max |diff| {diff:.2g}", flush=True)


if __name__ == "__main__":
    main()
