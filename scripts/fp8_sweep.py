"""tilefuse.fp8 GEMM launch-config sweep on the GPU beside torch._scaled_mm in the same run.

    PYTHONPATH=src python scripts/fp8_sweep.py

Pre-quantized e4m3 operands (per-tensor scales), bf16 output. Each config is validated against
the fp32 product of the dequantized operands (rel err <= 1e-2), then timed with
triton.testing.do_bench (median); TFLOP/s = 2·M·N·K / time. _scaled_mm is timed with and without
use_fast_accum; "precise" configs promote the tensor-core partial sums every BLOCK_K of K.
"""

import time

import torch
import triton.testing

from tilefuse.ops import _fp8_kernels as fk
from tilefuse.ops._fp8_gluon import launch_fp8_gemm_ws
from tilefuse.testing import rel_err

E4 = torch.float8_e4m3fn
CONFIGS = {
    "default": {},                                   # precise: the Gluon kernel on sm_90 (use_warp_specialized)
    "tl-precise": dict(WARP_SPECIALIZE=False),       # precise: the tl kernel (promotion per tl.dot)
    "fast-default": dict(_fast=True),
    # the warp-specialized Gluon kernel's options (_fp8_gluon.WS_CONFIG)
    "ws-g16": dict(_ws=True, GROUP_M=16),
    "ws-p2": dict(_ws=True, PROMOTE_EVERY=2),
    # fast accumulation in the Gluon kernel: one partial sum over the whole K, added once
    "ws-fast": dict(_ws=True, PROMOTE_EVERY=1 << 30),
}


def tflops(fn, m, n, k):
    return 2 * m * n * k / triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e9


def main() -> None:
    for m, n, k in [(8192, 8192, 8192), (8192, 4096, 4096), (4096, 4096, 4096), (8192, 14336, 4096)]:
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
            if cfg.pop("_ws", False):
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                fn = lambda: launch_fp8_gemm_ws(a, sa.reshape(1), b, sb.reshape(1), None, out, cfg)  # noqa: E731
            else:
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
            host = ""
            if name in ("default", "tl-precise"):     # host time per call: back-to-back launches, no sync
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                host = f"  host {(time.perf_counter() - t0) / 50 * 1e6:.0f} us/call"
                torch.cuda.synchronize()
            print(f"  {name:26s} err={err:.2e} {tf:6.0f} TF/s  {tf / slow:5.2f}x _scaled_mm  {tf / fast:5.2f}x fast-accum{host}")


if __name__ == "__main__":
    main()
