"""Where split-K's time goes at M = 128 (H200 2026-11-24 probe): one K slice per program with and
without the fixup, beside cuBLAS, all as CUDA-graph replays (kernel time only).

    python scripts/splitk_probe.py [slices|fixed]

* sk4 (128, 4096, 4096): 32 tiles x 4 slices of K = 1024 on 128 programs, partials + fixup;
* sk1 (128, 16384, 1024): 128 tiles of the same slice work and the same 32 MB of weight, no fixup;
* sk1 (128, 4096, 1024): the 32 programs of one slice round alone.
"""

from __future__ import annotations

import torch
import triton.testing

from tilefuse.ops import _matmul_kernels as mk

TILE = dict(mk.CONFIGS["mid_128x128"])


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return 1e3 * triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median")


CASES = {
    "slices": [(128, 4096, 4096, dict(TILE, SPLIT_K=4)), (128, 4096, 4096, dict(TILE, SPLIT_K=2)),
               (128, 16384, 1024, dict(TILE)), (128, 4096, 1024, dict(TILE)),
               (128, 8192, 2048, dict(TILE)), (128, 4096, 4096, dict(TILE)),
               (128, 4096, 4096, dict(TILE, SPLIT_K=4, STORE_TMA=True)), (128, 4096, 4096, {})],
    # the fixed cost of one launch: a single tile, then one slice round with more or less
    # shared memory (stages), without descriptors, and with the default tile
    "fixed": [(128, 128, 128, {}), (128, 128, 128, dict(USE_TMA=False)), (128, 128, 1024, dict(TILE)),
              (128, 4096, 1024, dict(TILE)), (128, 4096, 1024, dict(TILE, USE_TMA=False)),
              (128, 4096, 1024, dict(TILE, num_stages=2)), (128, 4096, 1024, dict(TILE, BLOCK_K=64, num_stages=4)),
              (128, 4096, 1024, dict(TILE, BLOCK_K=64, num_stages=2)), (128, 4096, 1024, {})],
}


def main() -> None:
    import sys
    rows = []
    for m, n, k, cfg in CASES[sys.argv[1] if len(sys.argv) > 1 else "slices"]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            ours = graph_us(lambda: mk.launch_matmul(a, w.t(), config=cfg))
        except Exception as exc:  # noqa: BLE001 - a config over the shared memory is reported
            print(f"  ({m}, {n}, {k}) {cfg}: FAILED {type(exc).__name__}")
            continue
        cublas = graph_us(lambda: torch.matmul(a, w.t()))
        gb = (m * k + n * k + m * n) * 2 / 1e3
        rows.append((m, n, k, cfg, ours, cublas, gb))
    print("shape, config, ours us, cuBLAS us, ideal-bytes GB/s ours / cuBLAS")
    for m, n, k, cfg, ours, cublas, gb in rows:
        print(f"  ({m}, {n}, {k}) {cfg or 'default'}: {ours:6.1f} {cublas:6.1f}   {gb / ours:6.0f} / {gb / cublas:6.0f}")


if __name__ == "__main__":
    main()
