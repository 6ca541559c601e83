"""cross_entropy fwd+bwd with the target range test awaited after the kernel is queued (s29; since
s32 from one scan kernel, the in-place kernel reading its flag) against one host sync up front
(before s29), interleaved rounds of do_bench medians (GPU; PYTHONPATH=src).

    python scripts/ce_check_ab.py [T V] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

import tilefuse.ops.cross_entropy as ce
from tilefuse.ops._cross_entropy_shared import check_targets_in_range


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 128256])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    t, v = args.shape
    x = torch.randn(t, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = ce.random_targets(t, v, "cuda")
    g = torch.rand((), device="cuda", dtype=torch.bfloat16) + 0.5
    deferred_check = ce.scan_targets

    def sync_check(tgt, n_classes, ignore_index, reduction, check):
        if check:
            check_targets_in_range(tgt, n_classes, ignore_index)
        return deferred_check(tgt, n_classes, ignore_index, reduction, False)

    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for defer_grad in (False, True):
            for name, check in (("awaited after the kernel", deferred_check), ("sync up front", sync_check)):
                ce.scan_targets = check

                def step():
                    return torch.autograd.grad(ce.cross_entropy(x, target, defer_grad=defer_grad), x, g)
                key = f"defer_grad={defer_grad}, target test {name}"
                times.setdefault(key, []).append(triton.testing.do_bench(step, warmup=25, rep=200,
                                                                         return_mode="median"))
    ce.scan_targets = deferred_check
    print(torch.cuda.get_device_name(), f"T={t} V={v} bf16 fwd+bwd, ms (median of {args.rounds} rounds)")
    for key, ts in times.items():
        print(f"  {key:58s} {statistics.median(ts):.4f}   " + " ".join(f"{x:.4f}" for x in ts))


if __name__ == "__main__":
    main()
