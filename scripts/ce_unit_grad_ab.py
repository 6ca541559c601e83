"""cross_entropy fwd+bwd as ``loss.backward()`` runs it (grad_output exactly 1), the case the
gradient-in-forward mode is built for: its backward then moves no bytes. Interleaved rounds of
do_bench medians, and the peak extra memory of one step, for each mode and for torch.compile and
Liger (when installed) on the same logits (GPU; PYTHONPATH=src).

    python scripts/ce_unit_grad_ab.py [T V] [--rounds 5] [--config JSON] [--stats-config JSON]

``--config`` adds a row: the in-place gradient-in-forward mode with that override of the looped
tier's launch config (e.g. '{"BLOCK_V": 8192, "num_warps": 16}'), interleaved with the rest;
``--stats-config`` likewise a row of the deferred mode with the loss-only forward's config overridden.

The benchmark (``tilefuse bench cross_entropy``) draws a random grad_output instead, which costs the
gradient-in-forward mode a scaling pass (4 passes over [T, V] against the deferred mode's 3).
The in-place modes overwrite the logits with the gradient on every step: the timed values drift
(to softmax - onehot of the previous step), the bytes moved do not.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton.testing

import tilefuse.ops._cross_entropy_kernels as kernels
import tilefuse.ops.cross_entropy as ce


def _with_config(fn, override: dict, write_grad: bool = True):
    """fn run with the looped tier's config overridden for the gradient-writing kernel (or, with
    write_grad=False, the loss-only one)."""
    def run():
        base = kernels._looped_config
        kernels._looped_config = lambda wg, *shape: {**base(wg, *shape), **(override if wg == write_grad else {})}
        try:
            return fn()
        finally:
            kernels._looped_config = base
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 128256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--config", type=json.loads, default=None)
    ap.add_argument("--stats-config", type=json.loads, default=None)
    args = ap.parse_args()
    t, v = args.shape
    x = torch.randn(t, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = ce.random_targets(t, v, "cuda")
    compiled = torch.compile(F.cross_entropy)
    variants = {
        "tilefuse grad in forward, in place": lambda: ce.cross_entropy(x, target, logits_inplace_grad=True),
        "tilefuse grad in forward, own buffer": lambda: ce.cross_entropy(x, target),
        "tilefuse deferred, in place": lambda: ce.cross_entropy(x, target, defer_grad=True, logits_inplace_grad=True),
        "torch.compile": lambda: compiled(x, target),
    }
    if args.config:
        variants[f"in place, {json.dumps(args.config)}"] = _with_config(
            lambda: ce.cross_entropy(x, target, logits_inplace_grad=True), args.config)
    if args.stats_config:
        variants[f"deferred in place, {json.dumps(args.stats_config)}"] = _with_config(
            lambda: ce.cross_entropy(x, target, defer_grad=True, logits_inplace_grad=True), args.stats_config, False)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
        variants["liger"] = lambda: liger_cross_entropy(x, target)
    except ImportError:
        pass
    steps = {name: (lambda f=f: torch.autograd.grad(f(), x)) for name, f in variants.items()}
    times = {name: [] for name in steps}
    extra = {}
    for name, step in steps.items():   # warm-up (compiles) and the peak memory of one step
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        extra[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(triton.testing.do_bench(step, warmup=5, rep=100, return_mode="median"))
    ideal_gb = 2 * t * v * x.element_size() / 1e9   # read the logits once, write the gradient once
    print(f"{torch.cuda.get_device_name()} T={t} V={v} bf16, grad_output 1; medians over {args.rounds} rounds")
    ref = statistics.median(times["torch.compile"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:48s} {ms:6.3f} ms  {ideal_gb / ms:5.2f} TB/s over 2 passes  {ref / ms:4.2f}x compile  "
              f"extra {extra[name]:8.1f} MiB   rounds {' '.join(f'{x:.3f}' for x in ts)}")


if __name__ == "__main__":
    main()
