"""Where does a small-M GEMM's time go? For M in (1, 16, 128), N = K = 4096, bf16, both weight
layouts (b = w.t() and b row-major [K, N]): do_bench median (L2 flushed, what the benchmark
reports), CUDA-graph replay (kernel alone, L2 warm), and the host time per call, for the raw
launcher with a few configs, the public function (with and without grad) and cuBLAS.

    PYTHONPATH=src python scripts/matmul_probe.py
"""

import torch
import triton.testing

import tilefuse
from tilefuse.bench import host_us
from tilefuse.bench.ceilings import graph_time_ms
from tilefuse.ops import _matmul_kernels as mk

CONFIGS = {
    "default": {},
    "ptr": dict(USE_TMA=False),
    "k256": dict(BLOCK_K=256, num_stages=3),
    "128x64-k128-s4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    "ptr-128x32-k128-s5": dict(USE_TMA=False, BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
}



def row(name, fn, flops):
    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    g = graph_time_ms(fn, rep=40)
    print(f"  {name:34s} do_bench {ms * 1e3:7.1f} us ({flops / ms / 1e9:5.0f} TF/s)  graph {g * 1e3:7.1f} us "
          f"host {host_us(fn, 100):7.1f} us", flush=True)


def main() -> None:
    dt = torch.bfloat16
    for m in (1, 16, 128):
        n = k = 4096
        flops = 2 * m * n * k
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt)
        for layout, b in (("w.t()", w.t()), ("row-major", w.t().contiguous())):
            print(f"M={m} N={n} K={k} b {layout}: default config "
                  f"{mk.choose_config(m, n, k, dt, torch.cuda.get_device_properties(0).multi_processor_count)}")
            row("cuBLAS torch.matmul", lambda: torch.matmul(a, b), flops)
            for name, cfg in CONFIGS.items():
                row(f"launch_matmul {name}", lambda cfg=cfg: mk.launch_matmul(a, b, config=cfg), flops)
            row("tilefuse.matmul (no grad)", lambda: tilefuse.matmul(a, b), flops)
            ag, bg = a.clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
            row("tilefuse.matmul (requires grad)", lambda: tilefuse.matmul(ag, bg), flops)
            row("torch.matmul (requires grad)", lambda: torch.matmul(ag, bg), flops)


if __name__ == "__main__":
    main()
