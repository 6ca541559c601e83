"""nn.Linear-shaped training GEMMs, forward + backward, on the Gluon kernel against the tl kernel and torch.

    python scripts/matmul_train_ab.py [--rounds 5] [--shapes square,llama,midlarge]

One step is ``y = tilefuse.matmul(x, w.t())`` and ``torch.autograd.grad(y, (x, w), dy)``: three
GEMMs (the forward, dx = dy @ w with a row-major b, dw = dyᵀ @ x with an M-major a), end to end
through the custom op. Variants, timed interleaved round by round (the H200's clock drifts under
GEMM load): "gluon" (the default: large-M GEMMs on ``_matmul_gluon``), "tl"
(``_matmul_kernels.GLUON_LARGE_M = False``), "nomemo" (the default with
``_matmul_kernels.MEMO_LAUNCHES = False``: every launch builds its arguments), "torch" (``x @ w.t()``). Each variant's gradients are
checked against torch's first (relative error norm <= 1e-2 against the fp32 product); the table
gives the median of the rounds' do_bench medians, TFLOP/s (6·M·N·K per step) and the ratio to torch.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

import tilefuse
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.testing import rel_err

from matmul_sweep import SHAPES


def step_fn(variant: str, x, w, dy):
    if variant == "torch":
        def step():
            return torch.autograd.grad(x @ w.t(), (x, w), dy)
    else:
        def step():
            return torch.autograd.grad(tilefuse.matmul(x, w.t()), (x, w), dy)
    return step


def configure(variant: str) -> None:
    """The large-M kernel the plans take for this variant (plans are cached: clear them)."""
    mk.GLUON_LARGE_M = variant != "tl"
    mk.MEMO_LAUNCHES = variant != "nomemo"
    mk._matmul_plan.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default="square,llama,midlarge")
    args = ap.parse_args()
    variants = ["gluon", "tl", "nomemo", "torch"]
    print(torch.cuda.get_device_name(), "bf16, fwd+bwd of x @ w.t() (x and w need grad)")
    print(f"{'M x N x K':>20s} " + " ".join(f"{v + ' ms':>9s} {'TF/s':>5s}" for v in variants)
          + "   gluon/torch  tl/torch  nomemo/torch")
    for name in args.shapes.split(","):
        for m, n, k in SHAPES[name]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_(True)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ref = [g.float() for g in torch.autograd.grad(x.float() @ w.float().t(), (x, w), dy.float())]
            steps = {}
            for v in variants:
                configure(v)
                got = step_fn(v, x, w, dy)()
                errs = [rel_err(g, r) for g, r in zip(got, ref)]
                assert max(errs) <= 1e-2, (v, m, n, k, errs)
                steps[v] = step_fn(v, x, w, dy)
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                for v in order:
                    configure(v)
                    times[v].append(triton.testing.do_bench(steps[v], warmup=10, rep=100, return_mode="median"))
            ms = {v: statistics.median(t) for v, t in times.items()}
            tf = {v: 6 * m * n * k / ms[v] / 1e9 for v in variants}
            print(f"{f'{m}x{n}x{k}':>20s} " + " ".join(f"{ms[v]:9.3f} {tf[v]:5.0f}" for v in variants)
                  + f"   {ms['torch'] / ms['gluon']:10.3f}x {ms['torch'] / ms['tl']:8.3f}x"
                  + f" {ms['torch'] / ms['nomemo']:12.3f}x")
    configure("gluon")


if __name__ == "__main__":
    main()
