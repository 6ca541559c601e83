"""M = 1 int4: the GEMV kernel against the Gluon mma kernel, per group size and x dtype (GPU).

    PYTHONPATH=src:scripts python scripts/int4_m1_path_probe.py [--groups 128] [--shapes 14336x4096 ...] [--reps 2]

Graph time of 20 calls cycling 20 weight copies (reads DRAM, as scripts/quant_sweep.py), each
path checked against the fp32 product with the dequantized weight first. The data behind the
M = 1 default (the GEMV: the mma kernel wins only with bf16 x, group 128 and N >= 2.7 K; NOTES
session 33), and the check of the GEMV's chunk on K that 1024 columns do not divide.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tilefuse.ops import _quant_plan as quant_plan
from tilefuse.ops import quant
from tilefuse.testing import rel_err

import quant_sweep as qs   # scripts/ on PYTHONPATH

SHAPES = [(4096, 4096), (6144, 4096), (11008, 4096), (14336, 4096), (4096, 11008), (4096, 14336), (5120, 13824)]
# mma-r72: the mma kernel capped at 72 registers, 7 programs per SM instead of 6 (80 registers), so
# N = 14336's 896 row blocks fit one wave (ptxas spills 36 bytes; `_quant_plan._maxnreg`)
PATHS = {"gemv": dict(PATH="gemv"), "mma": dict(PATH="mma"), "mma-r72": dict(PATH="mma", MAXNREG=72)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK pairs")
    p.add_argument("--reps", type=int, default=1, help="rounds of the whole table (the spread between rounds)")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    print(torch.cuda.get_device_name(0))
    for rep in range(args.reps):
        dtypes = (torch.bfloat16, torch.float16)[::1 if rep % 2 == 0 else -1]   # order alternates: clocks drift
        print(f"round {rep + 1}")
        table(shapes, args.groups, dtypes)


def table(shapes, groups, dtypes):
    for dtype in dtypes:
        for g in groups:
            for n, k in shapes:
                w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
                qw = quant.quantize_weight(w, 4, g)
                copies = [qw] + [quant.QuantizedWeight(qw.qweight.clone(), qw.scales.clone(), qw.zeros.clone(), 4, g,
                                                       qw.shape) for _ in range(19)]
                x = torch.randn(1, k, device="cuda").to(dtype)
                ref = F.linear(x.float(), quant.dequantize_weight(qw, dtype).float())
                row = []
                for name, cfg in PATHS.items():
                    call = lambda c, cfg=cfg: quant_plan.launch(x, c.qweight, c.scales, c.zeros, None, 4, g, cfg)  # noqa: E731
                    err = rel_err(call(qw), ref)
                    assert err < 1e-2, (name, err)
                    row.append(qs.bench_graph([lambda c=c, call=call: call(c) for c in copies]))
                plan = quant_plan.launch_plan(4, g, 1, n, k, dtype, quant_plan.num_sms(x), (), True, True)
                times = "  ".join(f"{name} {t:6.1f} us" for name, t in zip(PATHS, row))
                print(f"{str(dtype)[6:]:8s} g{g:<3d} {n:5d}x{k:<5d} {times}  "
                      f"gemv/mma {row[0] / row[1]:4.2f}   default: {'mma' if 'MMA_N' in plan.meta else 'gemv'} "
                      f"(gemv BLOCK_K {quant_plan.launch_plan(4, g, 1, n, k, dtype, 132, (('PATH', 'gemv'),)).meta['BLOCK_K']})")


if __name__ == "__main__":
    main()
