"""tilefuse.matmul launch-config sweep on the GPU, beside cuBLAS (torch.matmul) in the same run.

    python scripts/matmul_sweep.py [--shapes all|square|llama|small] [--dtype bf16] [--quick]

Per (M, N, K): the default config (choose_config + TMA where eligible) and a few declared
alternatives, each checked (rel err vs an fp32 cuBLAS product <= 1e-2) and timed with
triton.testing.do_bench (median); TFLOP/s = 2·M·N·K / time. b is a transposed weight view
(``w.t()``, nn.Linear's layout), and "-rowmajor" rows repeat the default with b [K, N] contiguous.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tilefuse.ops import _matmul_kernels as mk
from tilefuse.testing import rel_err

LLAMA = [(8192, n, k) for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]]
SHAPES = {
    "square": [(4096, 4096, 4096), (8192, 8192, 8192)],
    "llama": LLAMA,
    "small": [(m, 4096, 4096) for m in (1, 16, 128)] + [(m, 14336, 4096) for m in (1, 16, 128)],
}
ALTERNATIVES = {
    "ptr": dict(USE_TMA=False),
    "flatten": dict(FLATTEN=True),
    "128x256-s4": dict(mk.CONFIGS["tile_128x256"], num_stages=4),
    "128x128-w4": dict(mk.CONFIGS["tile_128x128"], num_warps=4),
    "128x128-k128-s3": dict(mk.CONFIGS["tile_128x128"], BLOCK_K=128, num_stages=3),
    "64x256": dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "g16": dict(GROUP_M=16),
}
SMALL_ALTERNATIVES = {
    "ptr": dict(USE_TMA=False),
    "n32": dict(BLOCK_N=32), "n64": dict(BLOCK_N=64), "n128": dict(BLOCK_N=128),
    "k256": dict(BLOCK_K=256, num_stages=3), "w2": dict(num_warps=2),
}


def tflops(fn, m, n, k) -> float:
    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return 2 * m * n * k / ms / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="all", choices=["all", *SHAPES])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--quick", action="store_true", help="default config and cuBLAS only")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    shapes = [s for v in SHAPES.values() for s in v] if args.shapes == "all" else SHAPES[args.shapes]
    summary = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        b = w.t()
        ref = (a.float() @ b.float())
        cublas = tflops(lambda: torch.matmul(a, b), m, n, k)
        print(f"\n({m}, {n}, {k}) {args.dtype}: cuBLAS {cublas:.0f} TF/s; default "
              f"{mk.choose_config(m, n, k, dtype, torch.cuda.get_device_properties(0).multi_processor_count)}")
        alts = {} if args.quick else (SMALL_ALTERNATIVES if m <= 32 else ALTERNATIVES)
        best = ("default", 0.0)
        for name, cfg in {"default": {}, **alts}.items():
            try:
                fn = lambda cfg=cfg: mk.launch_matmul(a, b, config=cfg)[0]   # noqa: E731
                err = rel_err(fn(), ref)
                if err > 1e-2:
                    print(f"  {name:18s} WRONG err={err:.3g}")
                    continue
                tf = tflops(fn, m, n, k)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
                print(f"  {name:18s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
                continue
            print(f"  {name:18s} {tf:7.0f} TF/s  {tf / cublas:5.2f}x cuBLAS")
            best = max(best, (name, tf), key=lambda x: x[1])
        b_row = w.t().contiguous()
        tf_row = tflops(lambda: mk.launch_matmul(a, b_row)[0], m, n, k)
        cublas_row = tflops(lambda: torch.matmul(a, b_row), m, n, k)
        print(f"  {'default-rowmajor':18s} {tf_row:7.0f} TF/s  {tf_row / cublas_row:5.2f}x cuBLAS ({cublas_row:.0f})")
        summary.append((m, n, k, cublas, best))
    print("\nsummary: shape, cuBLAS TF/s, best config, its TF/s, ratio")
    for m, n, k, cublas, (name, tf) in summary:
        print(f"  ({m}, {n}, {k})  {cublas:6.0f}  {name:18s} {tf:6.0f}  {tf / cublas:5.2f}x")


if __name__ == "__main__":
    main()
