"""tilefuse.fp8 GEMM launch-config sweep on the GPU beside torch._scaled_mm in the same run.

    PYTHONPATH=src python scripts/fp8_sweep.py

Pre-quantized e4m3 operands (per-tensor scales), bf16 output. Each config is validated against
the fp32 product of the dequantized operands (rel err <= 1e-2), then timed with
triton.testing.do_bench (median); TFLOP/s = 2·M·N·K / time. _scaled_mm is timed with and without
use_fast_accum; "precise" configs promote the tensor-core partial sums every BLOCK_K of K.
"""

import torch
import triton.testing

from tilefuse.ops import _fp8_kernels as fk
from tilefuse.testing import rel_err

E4 = torch.float8_e4m3fn
CONFIGS = {
    "default": {},
    "fast-default": dict(_fast=True),
    "fast-128x256x128-s3": dict(_fast=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
    "fast-128x256x128-s4": dict(_fast=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=4),
    "fast-128x128x128-s5": dict(_fast=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5),
    "fast-128x256x64-s5": dict(_fast=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=5),
    "fast-256x128x128-s3": dict(_fast=True, BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    "precise-128x256x128-s3": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
    "precise-128x128x128-s5": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5),
    "precise-128x128x256-s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3),
    "fast-g16": dict(_fast=True, GROUP_M=16),
    "promote4-128x128x128-s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, PROMOTE_EVERY=4),
    "promote2-128x128x128-s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, PROMOTE_EVERY=2),
    "promote4-128x256x128-s3": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, PROMOTE_EVERY=4),
    "promote4-128x128x128-s4-flat": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4,
                                         PROMOTE_EVERY=4, FLATTEN=True),
    "precise-128x256x128-s3-acc256": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3,
                                          MAX_IMPRECISE_ACC=256),
    "precise-128x256x128-s4-acc512": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=4,
                                          MAX_IMPRECISE_ACC=512),
    "precise-128x256x128-s4-acc1024": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=4,
                                           MAX_IMPRECISE_ACC=1024),
    "precise-128x256x128-s4-flatten": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=4,
                                           FLATTEN=True),
    "fast-flatten": dict(_fast=True, FLATTEN=True),
}


def tflops(fn, m, n, k):
    return 2 * m * n * k / triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e9


def main() -> None:
    for m, n, k in [(8192, 8192, 8192), (8192, 4096, 4096)]:
        a = (torch.randn(m, k, device="cuda") * 4).to(E4)
        b = (torch.randn(n, k, device="cuda") * 4).to(E4)
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
        ref = (a.float() @ b.float().t()) * 0.125
        slow = tflops(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16), m, n, k)
        fast = tflops(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True), m, n, k)
        print(f"\n({m}, {n}, {k}): _scaled_mm {slow:.0f} TF/s, fast accum {fast:.0f}; default "
              f"{fk.choose_gemm_config(m, n, k, 132)}", flush=True)
        for name, cfg in CONFIGS.items():
            cfg = dict(cfg)
            fast_accum = cfg.pop("_fast", False)
            fn = lambda: fk.launch_fp8_gemm(a, sa.reshape(1), b, sb.reshape(1), None, torch.bfloat16,  # noqa: E731
                                            fast_accum=fast_accum, config=cfg)
            try:
                err = rel_err(fn(), ref)
                if err > 1e-2:
                    print(f"  {name:24s} WRONG err={err:.3g}")
                    continue
                tf = tflops(fn, m, n, k)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
                print(f"  {name:24s} FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            print(f"  {name:24s} {tf:6.0f} TF/s  {tf / slow:5.2f}x _scaled_mm  {tf / fast:5.2f}x fast-accum")


if __name__ == "__main__":
    main()
