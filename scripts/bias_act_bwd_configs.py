"""bias_act (bias + GELU) backward: tiles x grid sizes, timed as CUDA graphs, 3 rounds interleaved
(GPU, PYTHONPATH=src).

    python scripts/bias_act_bwd_configs.py

The grid is row chunks x column blocks. "k4" rows ask for 4 programs per SM rounded *down* to
whole chunks (the launcher's rule), "k4up" rounded up (the rule before session 10): rounding up
can leave a few programs of a last wave running alone. One RESULT row per config, fastest first.
"""

import statistics

import torch

from tilefuse import registry
from tilefuse.bench.ceilings import graph_time_ms
from tilefuse.ops import activations as ba
from tilefuse.testing import rel_err

SHAPES = [(16384, 14336), (16384, 4096), (8192, 11008)]
TILES = ((2, 1024, 4), (16, 512, 8), (8, 1024, 8), (4, 2048, 4))   # BLOCK_M, BLOCK_N, warps


def candidates(n_cols: int, sms: int) -> dict:
    out = {"default": None}
    for bm, bn, w in TILES:
        blocks = -(-n_cols // bn)
        for k in (2, 4, 8):
            out[f"{bm}x{bn}w{w}k{k}"] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                                             REDUCE_PROGRAMS=max(1, k * sms // blocks) * blocks)
        up = -(-4 * sms // blocks) * blocks
        out[f"{bm}x{bn}w{w}k4up"] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, REDUCE_PROGRAMS=up)
    return out


def main() -> None:
    spec = registry.get("bias_act")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    for shape in SHAPES:
        n = shape[-1]
        x = (torch.randn(shape, device="cuda") * 2).bfloat16()
        b = torch.randn(n, device="cuda").bfloat16()
        dy = torch.randn_like(x)
        dx_ref, db_ref = ba._bias_act_bwd_reference(dy.double(), x.double(), b.double(), "gelu", 0.0, 0)
        nbytes = spec.bytes_fn(shape, torch.bfloat16, "bwd")
        fns = {}
        for name, cfg in candidates(n, sms).items():
            fn = (lambda cfg=cfg: ba._launch_bwd(dy, x, b, "gelu", 0.0, 0, True, True, n, cfg))
            dx, db = fn()[:2]
            print(name, shape, f"err dx {rel_err(dx, dx_ref):.2g} db {rel_err(db, db_ref):.2g}")
            fns[name] = fn
        del dx_ref, db_ref
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, fn in fns.items():
                times[k].append(graph_time_ms(fn, rep=30))
        for k, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            ms = statistics.median(ts)
            print(f"RESULT bwd {shape[0]}x{shape[1]} {k:14s} {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s",
                  flush=True)


if __name__ == "__main__":
    main()
