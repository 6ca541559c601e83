"""LayerNorm forward: the x load's L2 policy (X_EVICT) x rows per program x warps, beside a
same-size copy; CUDA-graph and L2-flushed times, 3 rounds interleaved (GPU, PYTHONPATH=src).

    python scripts/layer_norm_fwd_evict.py
"""

import statistics

import torch
import triton

from tilefuse.bench.ceilings import graph_time_ms
from tilefuse.ops import norms as nm
from tilefuse.testing import rel_err

TILES = ((1, 4), (1, 8), (2, 8), (2, 16), (1, 2))   # BLOCK_M, num_warps


def main() -> None:
    torch.manual_seed(0)
    for shape in [(16384, 4096), (16384, 8192)]:
        n = shape[1]
        x = torch.randn(shape, device="cuda").bfloat16()
        w = torch.randn(n, device="cuda").bfloat16()
        b = torch.randn(n, device="cuda").bfloat16()
        ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        nbytes = 2 * x.numel() * 2 + 2 * n * 2
        fns = {}
        for ev in ("", "evict_last", "evict_first"):
            for bm, warps in TILES:
                if bm * n // (32 * warps) > 64:
                    continue
                cfg = {"X_EVICT": ev, "BLOCK_M": bm, "num_warps": warps}
                fn = (lambda cfg=cfg: nm._launch_fwd(x, w, b, None, 1e-5, 0.0, False, cfg)[0])
                assert rel_err(fn(), ref) < 1e-2, cfg
                fns[f"{ev or 'none':11s} {bm}x{warps}w"] = fn
        fns["default"] = lambda: nm._launch_fwd(x, w, b, None, 1e-5, 0.0, False, None)[0]
        src = torch.empty(nbytes // 4, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        fns["copy"] = lambda: dst.copy_(src)
        graph = {k: [] for k in fns}
        flushed = {k: [] for k in fns}
        for _ in range(3):
            for k, fn in fns.items():
                graph[k].append(graph_time_ms(fn, rep=30))
                flushed[k].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
        for k in sorted(fns, key=lambda k: statistics.median(graph[k])):
            mg, mf = statistics.median(graph[k]), statistics.median(flushed[k])
            print(f"RESULT ln fwd {shape[0]}x{n} {k:18s} graph {mg * 1e3:6.1f} us {nbytes / mg / 1e6:5.0f} GB/s  "
                  f"flushed {mf * 1e3:6.1f} us {nbytes / mf / 1e6:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
