"""Would split-K help the M = 128 GEMMs (#5)? A probe before building it.

At M = 128 the weight is streamed once and every CTA also reads its K range of x. With whole-K
tiles of 64 rows (today's 64x128 at N = 6144) each weight tile is read by two CTAs and x by all
96, ~144 MB from L2 for 50 MB of weight; a 128-row tile split over K reads the weight once and
each CTA only its K slice of x (~96 MB). cuBLAS gets the same effect from 2-CTA clusters that
multicast the weight tile, which Gluon 3.6 lacks.

This times, as CUDA-graph replays after an L2 flush (interleaved rounds), the Gluon small-M kernel
on shapes whose per-CTA work equals a split-K launch's, without the fixup: e.g. split 2 of
128x6144x4096 with 128x128 tiles = 96 CTAs of 128x128x2048 = the GEMM 128x12288x2048. If those
are not clearly under cuBLAS's time at the real shape, split-K cannot win once the partials are
summed. Also timed: torch summing the fp32 partials (the cost of a separate fixup pass).

    PYTHONPATH=src python scripts/splitk_emulation_probe.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from matmul_sweep import graphed, interleaved_ms  # noqa: E402

from tilefuse.ops import _matmul_gluon_plan as gp  # noqa: E402
from tilefuse.ops import _matmul_kernels as mk  # noqa: E402
from tilefuse.testing import rel_err  # noqa: E402

T128 = gp.WS_TILES["128x128"]
T256 = dict(CONSUMERS=2, BLOCK_N=256, BLOCK_K=64, STAGES=4, GROUP_M=8)
# real shape -> [(label, emulated (m, n, k), tile config, split)]
CASES = {
    (128, 6144, 4096): [("ws 128x128 split2", (128, 12288, 2048), T128, 2),
                        ("ws 128x256 split4", (128, 24576, 1024), T256, 4),
                        ("ws 128x128 split2 k128s3", (128, 12288, 2048), dict(T128, BLOCK_K=128, STAGES=3), 2)],
    (128, 14336, 4096): [("ws 128x256 split2", (128, 28672, 2048), T256, 2)],
    (128, 4096, 4096): [("ws 128x128 split4", (128, 16384, 1024), T128, 4),
                        ("ws 128x256 split8", (128, 32768, 512), T256, 8)],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    dt = torch.bfloat16
    for (m, n, k), emulations in CASES.items():
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt)
        ref = a.float() @ w.float().t()
        fns = {"cuBLAS": lambda: torch.matmul(a, w.t()),
               "tilefuse default": lambda: mk.launch_matmul(a, w.t())[0]}
        for name, fn in fns.items():
            err = rel_err(fn(), ref)
            assert err < 1e-2, (name, err)
        for label, (em, en, ek), cfg, split in emulations:
            ea = torch.randn(em, ek, device="cuda", dtype=dt)
            ew = torch.randn(en, ek, device="cuda", dtype=dt)
            eout = torch.empty(em, en, device="cuda", dtype=dt)
            fn = (lambda ea=ea, ew=ew, eout=eout, cfg=cfg: gp.launch_gemm_ws(ea, ew.t(), eout, config=cfg))
            err = rel_err(fn(), ea.float() @ ew.float().t())
            assert err < 1e-2, (label, err)
            fns[f"{label} (no fixup)"] = fn
            parts = torch.randn(split, m, n, device="cuda", dtype=torch.float32)
            fns[f"torch sum of {split} fp32 partials"] = lambda parts=parts: parts.sum(0).to(dt)
        ms = interleaved_ms({name: graphed(fn) for name, fn in fns.items()}, args.rounds)
        base = ms["cuBLAS"]
        print(f"\n({m}, {n}, {k}) bf16, graph replays after an L2 flush, median of {args.rounds} rounds")
        for name, t in ms.items():
            print(f"  {name:40s} {t * 1e3:7.2f} us  {base / t:5.2f}x cuBLAS")


if __name__ == "__main__":
    main()
