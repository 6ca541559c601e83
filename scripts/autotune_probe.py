"""Does opt-in autotuning (``TILEFUSE_AUTOTUNE=1``) beat the heuristic's plan? (GPU)

    cd scripts && python autotune_probe.py [--shapes square,llama,m128] [--layouts fwd] [--rounds 5]

Per shape and layout (``stream_k_probe.operands``: fwd x @ w.t(), dgrad dy @ w, wgrad dyᵀ @ x):
the first autotuned call tunes (its wall time printed, with the chosen config); then the
heuristic's plan, the tuned plan and cuBLAS are timed as CUDA-graph replays after an L2 flush,
interleaved (``matmul_sweep.interleaved_ms``), each checked against the fp32 product first.
"""

from __future__ import annotations

import argparse
import time

import torch

from matmul_sweep import SHAPES, interleaved_ms, valid_fns
from stream_k_probe import operands
from tilefuse.ops import _matmul_autotune as autotune
from tilefuse.ops import _matmul_kernels as mk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="square,llama,m128")
    ap.add_argument("--layouts", default="fwd")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    print(torch.cuda.get_device_name(), "bf16, CUDA-graph replays after an L2 flush, interleaved")
    rows = []
    for layout in args.layouts.split(","):
        for m, n, k in shapes:
            a, b = operands(m, n, k, layout)
            ref = a.float() @ b.float()
            out_h = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            out_t = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            autotune.set_autotune(True)
            before = dict(autotune._CHOICES)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mk.launch_matmul(a, b, out=out_t)
            torch.cuda.synchronize()
            tune_s = time.perf_counter() - t0
            chosen = [v for key, v in autotune._CHOICES.items() if key not in before]
            fns = valid_fns({"tuned": lambda: mk.launch_matmul(a, b, out=out_t)[0]}, ref, graph=True)
            autotune.set_autotune(False)
            fns.update(valid_fns({"heuristic": lambda: mk.launch_matmul(a, b, out=out_h)[0],
                                  "cublas": lambda: torch.matmul(a, b)}, ref, graph=True))
            ms = interleaved_ms(fns, args.rounds)
            print(f"{layout} {m}x{n}x{k}: tuned in {tune_s:.1f} s, choice {chosen[0] if chosen else '(cached)'}")
            for name, t in ms.items():
                print(f"  {name:10s} {t:.4f} ms {2 * m * n * k / t / 1e9:5.0f} TF/s  {ms['cublas'] / t:5.3f}x cuBLAS")
            if "tuned" in ms and "heuristic" in ms:
                rows.append((layout, m, n, k, ms["heuristic"] / ms["tuned"], ms["cublas"] / ms["tuned"],
                             ms["cublas"] / ms["heuristic"]))
    print("\nlayout shape              tuned vs heuristic   tuned vs cuBLAS   heuristic vs cuBLAS")
    for layout, m, n, k, gain, tuned, heur in rows:
        print(f"{layout:6s} {m}x{n}x{k:<10d} {gain:10.3f}x {tuned:16.3f}x {heur:18.3f}x")


if __name__ == "__main__":
    main()
