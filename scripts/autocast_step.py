"""A training step under torch.autocast: Llama-style blocks with fp32 parameters, bf16 autocast.

    PYTHONPATH=src python scripts/autocast_step.py [--blocks 2] [--seq 4096] [--dim 4096]

Three models with the same parameters: torch's modules (nn.Linear, nn.RMSNorm, F.sdpa,
F.cross_entropy on the materialized logits) eager, the same under torch.compile, and tilefuse's
drop-ins (nn.Linear, nn.RMSNorm, SwiGLUMLP's fused gate, the SDPA drop-in, linear_cross_entropy).
Each step is forward + backward of the loss; the loss and gradients are checked against the
torch model's first (relative error) before timing (triton.testing.do_bench, median), and the
peak memory above the parameters is reported. The casts of fp32 weights to bf16 are part of every
step in all three (autocast's cast, or tilefuse's at the public function).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

import tilefuse
from tilefuse.testing import LlamaStack as Model, rel_err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--profile", action="store_true", help="after timing: the GPU time by kernel of each model's step")
    ap.add_argument("--profile-sort", default="cuda_time_total",
                    help="the profile table's order: cuda_time_total, or self_cpu_time_total (host time, CPU events)")
    ap.add_argument("--ab-no-check", action="store_true",
                    help="also time tilefuse with check_targets=False (no host sync in the loss)")
    ap.add_argument("--ab-mlp-linear", action="store_true",
                    help="also time tilefuse with its MLP projections as the other Linear class (torch's <-> tilefuse's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dims = (args.blocks, args.dim, args.heads, args.ffn, args.vocab)
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # CPU: the check only (TRITON_INTERPRET=1)
    with torch.device(dev):
        ours, theirs = Model(True, *dims), Model(False, *dims)
    theirs.load_state_dict(ours.state_dict())
    params_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    x = torch.randn(args.batch, args.seq, args.dim, device=dev)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    compiled = torch.compile(theirs)
    amp = torch.bfloat16 if dev == "cuda" else torch.float16     # the interpreter mishandles bf16

    def step(model):
        def run():
            with torch.autocast(dev, dtype=amp):
                loss = model(x, target)
            return loss, torch.autograd.grad(loss, list(model.parameters()))
        return run

    runs = {"torch eager": step(theirs), "torch.compile": step(compiled), "tilefuse": step(ours)}
    if args.ab_no_check:
        with torch.device(dev):
            unchecked = Model(True, *dims)
        unchecked.load_state_dict(ours.state_dict())
        unchecked.check_targets = False
        runs["tilefuse, no target check"] = step(unchecked)
    if args.ab_mlp_linear:
        with torch.device(dev):
            other = Model(True, *dims)
        other.load_state_dict(ours.state_dict())
        for block in other.blocks:
            for proj in (block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj):
                proj.__class__ = torch.nn.Linear if type(proj) is tilefuse.nn.Linear else tilefuse.nn.Linear
        runs["tilefuse, MLP " + type(other.blocks[0].mlp.gate_proj).__module__.split(".")[0]] = step(other)
    ref_loss, ref_grads = runs["torch eager"]()
    if dev == "cpu":
        loss, grads = runs["tilefuse"]()
        print("CPU check: loss rel err", rel_err(loss, ref_loss), "worst grad", max(rel_err(g, r) for g, r in zip(grads, ref_grads)))
        return
    print(f"{torch.cuda.get_device_name()}  blocks {args.blocks}  B×S {args.batch}×{args.seq}  dim {args.dim}  "
          f"ffn {args.ffn}  vocab {args.vocab}  fp32 params {params_bytes / 2**30:.2f} GiB, bf16 autocast")
    print(f"{'model':15s} {'ms / step':>10s} {'peak extra GiB':>15s} {'loss rel err':>13s} {'worst grad rel err':>19s}")
    for name, run in runs.items():
        loss, grads = run()
        loss_err = rel_err(loss, ref_loss)
        grad_err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        del loss, grads
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = triton.testing.do_bench(run, warmup=250, rep=1000, return_mode="median")   # ms: ~5 warm-up, ~20 timed steps
        print(f"{name:15s} {ms:10.2f} {peak:15.2f} {loss_err:13.2e} {grad_err:19.2e}")
    if args.profile:
        for name, run in runs.items():
            run()
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if "cpu" in args.profile_sort:
                activities.append(torch.profiler.ProfilerActivity.CPU)
            with torch.profiler.profile(activities=activities) as prof:
                run()
                torch.cuda.synchronize()
            print(f"\n== {name}: by {args.profile_sort}, one step")
            print(prof.key_averages().table(sort_by=args.profile_sort, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
