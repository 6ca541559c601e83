"""tilefuse.qkv_proj launch-config sweep on the GPU (Llama-8B: T=8192, hidden 4096, 32 q / 8 kv
heads of 128, NeoX RoPE), beside cuBLAS alone and cuBLAS + tilefuse.rope in the same run.

    PYTHONPATH=src python scripts/qkv_sweep.py

Each config is validated (q, k, v vs the un-fused fp32 product, rel err <= 1e-2), then timed with
triton.testing.do_bench (median); TFLOP/s = 2·T·hidden·(Hq+2Hkv)·D / time.
"""

import torch
import triton.testing

from tilefuse.ops import _qkv_proj_kernels as qk
from tilefuse.ops.qkv_proj import qkv_proj_reference
from tilefuse.ops.rope import rope, rope_cos_sin_table
from tilefuse.testing import rel_err

CONFIGS = {
    "default": {},
    "bm256-w8": dict(BLOCK_M=256, num_warps=8),
    "s4": dict(num_stages=4),
    "g16": dict(GROUP_M=16),
    "bk128-s3": dict(BLOCK_K=128, num_stages=3),
    "w4": dict(num_warps=4),
    "ptr": dict(USE_TMA=False),
    "flatten": dict(FLATTEN=True),
    "bm64-w4-s4": dict(BLOCK_M=64, num_warps=4, num_stages=4),
    "bm256-w8-s4": dict(BLOCK_M=256, num_warps=8, num_stages=4),
    "bm128-bk128-s3-g16": dict(BLOCK_K=128, num_stages=3, GROUP_M=16),
    "bm256-w8-bk128-s2": dict(BLOCK_M=256, num_warps=8, BLOCK_K=128, num_stages=2),
}


def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> None:
    t, hidden, hq, hkv, d = 8192, 4096, 32, 8, 128
    dt = torch.bfloat16
    n = (hq + 2 * hkv) * d
    x = torch.randn(t, hidden, device="cuda", dtype=dt)
    w = (torch.randn(n, hidden, device="cuda") / hidden ** 0.5).to(dt)
    cos, sin = rope_cos_sin_table(t, d, dtype=dt, device="cuda")
    flops = 2 * t * hidden * n
    refs = qkv_proj_reference(x.float(), w.float(), hq, hkv, None, None, cos.float(), sin.float())

    def unfused():
        qkv = x @ w.t()
        q, k, v = qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
        return (*rope(q.unsqueeze(0), k.unsqueeze(0), cos, sin), v)

    t_gemm, t_unfused = ms(lambda: x @ w.t()), ms(unfused)
    print(f"T={t} hidden={hidden} heads {hq}/{hkv} D={d}: cuBLAS GEMM {t_gemm:.3f} ms ({flops / t_gemm / 1e9:.0f} TF/s), "
          f"cuBLAS + tilefuse.rope {t_unfused:.3f} ms; default {qk.choose_qkv_config(t, hq + 2 * hkv, 2 * 64, hidden, dt, 132)}")
    for name, cfg in CONFIGS.items():
        fn = lambda cfg=cfg: qk.launch_qkv_proj(x, w, None, cos, sin, None, hq, hkv, d, t, False, d, config=cfg)  # noqa: E731
        try:
            outs = fn()
            err = max(rel_err(o, r) for o, r in zip(outs, refs))
            if err > 1e-2:
                print(f"  {name:14s} WRONG err={err:.3g}")
                continue
            tm = ms(fn)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
            print(f"  {name:14s} FAILED {type(exc).__name__}: {str(exc)[:150]}")
            continue
        print(f"  {name:14s} {tm:.3f} ms {flops / tm / 1e9:5.0f} TF/s  {t_unfused / tm:5.2f}x cuBLAS+rope  "
              f"{t_gemm / tm:5.2f}x cuBLAS GEMM alone")


if __name__ == "__main__":
    main()
