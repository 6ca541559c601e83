"""tilefuse.matmul launch-config sweep on the GPU, beside cuBLAS (torch.matmul) in the same run.

    python scripts/matmul_sweep.py [--shapes all|square|llama|small] [--dtype bf16] [--quick]
                                   [--configs NAME,NAME] [--rounds 5] [--graph]

Per (M, N, K): the default config (choose_config + TMA where eligible) and a few declared
alternatives, each checked (rel err vs an fp32 cuBLAS product <= 1e-2), then timed with
triton.testing.do_bench interleaved with cuBLAS over several rounds (the median of the rounds'
medians); TFLOP/s = 2·M·N·K / time. b is a transposed weight view
(``w.t()``, nn.Linear's layout; ``--row-major``: b [K, N] contiguous), and "-rowmajor" rows repeat the
default with b [K, N] contiguous.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tilefuse.ops import _matmul_gluon_plan as gp
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.testing import rel_err

LLAMA = [(8192, n, k) for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]]
SHAPES = {
    "square": [(4096, 4096, 4096), (8192, 8192, 8192)],
    "llama": LLAMA,
    "small": [(m, n, k) for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]
              for m in (1, 16, 128)],
    # the rest of the mid bucket (32 < M <= 256): where the Gluon small-M kernel's tile heuristic decides
    "mid": [(m, n, k) for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)] for m in (64, 256)],
    "m128": [(128, n, k) for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]],
    # just above the mid bucket: where choose_large_ws_tile's one-wave rule hands over to the Gluon kernel
    "midlarge": [(m, n, 4096) for n in (4096, 14336) for m in (384, 1024, 2048)],
}
# large shapes: tiles x epilogue (pointer store / descriptor store in two column halves; with or
# without flatten, which lets the next tile's loads start before this tile's stores)
LARGE_TILE_GRID = {
    "128x256-s3": dict(mk.CONFIGS["tile_128x256"]),
    "128x256-s4": dict(mk.CONFIGS["tile_128x256"], num_stages=4),
    "128x128-s4": dict(mk.CONFIGS["tile_128x128"]),
    "256x128-s3": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
}
EPILOGUES = {
    "": dict(STORE_TMA=False, FLATTEN=False),
    "+tma2": dict(STORE_TMA=True, STORE_SPLIT=2, FLATTEN=False),
    "+tma2-fl": dict(STORE_TMA=True, STORE_SPLIT=2, FLATTEN=True),
}
ALTERNATIVES = {
    "tl": dict(GLUON=False),        # the tl kernel's default config (the Gluon kernel is the default on sm_90)
    **{t + e: dict(tc, **ec) for t, tc in LARGE_TILE_GRID.items() for e, ec in EPILOGUES.items()},
    "128x256-s3+fl": dict(mk.CONFIGS["tile_128x256"], FLATTEN=True),
    "128x256-s3+tma1-fl": dict(mk.CONFIGS["tile_128x256"], STORE_TMA=True, STORE_SPLIT=1, FLATTEN=True),
    "128x256-s3+ws": dict(mk.CONFIGS["tile_128x256"], WARP_SPECIALIZE=True),
    "128x256-s3+tma2-fl-ws": dict(mk.CONFIGS["tile_128x256"], STORE_TMA=True, STORE_SPLIT=2, FLATTEN=True,
                                  WARP_SPECIALIZE=True),
    "128x256-s3+tma2-g16": dict(mk.CONFIGS["tile_128x256"], STORE_TMA=True, STORE_SPLIT=2, GROUP_M=16),
    "128x256-s4+tma2-g16": dict(mk.CONFIGS["tile_128x256"], num_stages=4, STORE_TMA=True, STORE_SPLIT=2, GROUP_M=16),
    "128x256-s4+tma2-g4": dict(mk.CONFIGS["tile_128x256"], num_stages=4, STORE_TMA=True, STORE_SPLIT=2, GROUP_M=4),
    "ptr": dict(USE_TMA=False),
    # the Gluon warp-specialized kernel (_matmul_gluon.gemm_ws_kernel): a TMA loader warp and two
    # consumer groups of 64 rows (linear cross-entropy's 128x256 accumulate tile; 128x128)
    **{f"g{name}": dict(cfg, GLUON=True) for name, cfg in gp.ACCUMULATE_TILES.items()},
    "g128x256-g16": dict(gp.ACCUMULATE_TILES["128x256"], GROUP_M=16, GLUON=True),
    "g128x256-g4": dict(gp.ACCUMULATE_TILES["128x256"], GROUP_M=4, GLUON=True),
}
SMALL_ALTERNATIVES = {
    "ptr": dict(USE_TMA=False),
    "n32": dict(BLOCK_N=32), "n64": dict(BLOCK_N=64), "n128": dict(BLOCK_N=128),
    "k256": dict(BLOCK_K=256, num_stages=3), "w2": dict(num_warps=2),
    # split-K: wider column tiles, each tile's K shared by SPLIT_K programs (~128 units on 132 SMs)
    "n64-sk2": dict(BLOCK_N=64, SPLIT_K=2), "n128-sk4": dict(BLOCK_N=128, SPLIT_K=4),
    "n128-k256-sk4": dict(BLOCK_N=128, BLOCK_K=256, num_stages=3, SPLIT_K=4),
    "n256-sk8": dict(BLOCK_N=256, SPLIT_K=8, num_stages=3),
}
# 32 < M <= 256 (small batches, the M=128 rows of the issue): too few large tiles to fill the SMs,
# so narrow column tiles, long K steps and deep pipelines (memory-bound: bytes in flight per SM)
MID_ALTERNATIVES = {
    "tl": dict(GLUON=False),        # the tl kernel's default config (the Gluon kernel is the default on sm_90)
    "ptr": dict(USE_TMA=False),
    # the Gluon warp-specialized kernel (_matmul_gluon) with each declared tile, and deeper / shallower rings
    **{f"g{name}": dict(cfg, GLUON=True) for name, cfg in gp.WS_TILES.items()},
    "g64x64-k64-s12": dict(gp.WS_TILES["64x64"], BLOCK_K=64, STAGES=12, GLUON=True),
    "g64x128-k128-s4": dict(gp.WS_TILES["64x128"], BLOCK_K=128, STAGES=4, GLUON=True),
    "g128x128-k32-s12": dict(gp.WS_TILES["128x128"], BLOCK_K=32, STAGES=12, GLUON=True),
    "g128x128-k128-s3": dict(gp.WS_TILES["128x128"], BLOCK_K=128, STAGES=3, GLUON=True),
    # tiles 96 wide (a 64- and a 32-column B part): 128 tiles at N = 6144 (cuBLAS's nvjet 96x64 tile there)
    "g64x96": dict(gp.WS_TILES["64x128"], BLOCK_N=96, GLUON=True),
    "g64x96-s10": dict(gp.WS_TILES["64x128"], BLOCK_N=96, STAGES=10, GLUON=True),
    "g64x96-k128-s5": dict(gp.WS_TILES["64x128"], BLOCK_N=96, BLOCK_K=128, STAGES=5, GLUON=True),
    "g128x96": dict(gp.WS_TILES["128x128"], BLOCK_N=96, GLUON=True),
    "flatten": dict(FLATTEN=True),
    "128x32-k128-s5-w4": dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
    "128x64-k128-s4-w4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    "128x64-k64-s6-w4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=6),
    "64x64-k128-s5-w4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
    "64x32-k128-s6-w4": dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=6),
    "64x128-k64-s4-w4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4),
    "128x128-k128-s3": dict(mk.CONFIGS["tile_128x128"], BLOCK_K=128, num_stages=3),
    "128x128-k128-s3+tma2-fl": dict(mk.CONFIGS["tile_128x128"], BLOCK_K=128, num_stages=3, STORE_TMA=True,
                                    STORE_SPLIT=2, FLATTEN=True),
    "default+tma1": dict(STORE_TMA=True, STORE_SPLIT=1),
    # split-K: the largest tiles, each tile's K shared by SPLIT_K programs
    **{f"128x128-k128-sk{s}": dict(mk.CONFIGS["mid_128x128"], SPLIT_K=s) for s in (2, 3, 4)},
    "128x128-k64-s4-sk4": dict(mk.CONFIGS["tile_128x128"], SPLIT_K=4),
    "128x128-k128-sk4+tma2": dict(mk.CONFIGS["mid_128x128"], SPLIT_K=4, STORE_TMA=True, STORE_SPLIT=2),
    "64x128-k128-sk2": dict(mk.CONFIGS["mid_64x128"], SPLIT_K=2),
    "128x64-k128-s4-w4-sk2": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=2),
    "128x64-k128-s4-w4-sk4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=4),
    "64x128-k128": dict(mk.CONFIGS["mid_64x128"]),
    "128x256-k64-sk4": dict(mk.CONFIGS["tile_128x256"], SPLIT_K=4),
    "128x256-k64-sk8": dict(mk.CONFIGS["tile_128x256"], SPLIT_K=8),
}


GATE_UP_ALTERNATIVES = {
    "flatten": dict(FLATTEN=True),
    "ptr": dict(USE_TMA=False),
    "g16": dict(GROUP_M=16),
    "s4": dict(num_stages=4),
    "bn64-w8-s4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
    "bn128-w8-s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "bm64-bn128-w4-s4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
}


def sweep_gate_up(m: int, i: int, k: int, dtype: torch.dtype) -> None:
    """swiglu_linear's gate-up GEMM: configs beside cuBLAS alone and eager cuBLAS + silu·mul."""
    from tilefuse.ops import _gate_up_kernels as gk
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(2 * i, k, device="cuda", dtype=dtype) / k ** 0.5
    gu = (x.float() @ w.float().t())
    ref = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    eager = lambda: (lambda g: torch.nn.functional.silu(g[:, :i]) * g[:, i:])(x @ w.t())  # noqa: E731
    flops = 2 * m * (2 * i) * k
    t_eager = triton.testing.do_bench(eager, warmup=10, rep=50, return_mode="median")
    t_gemm = triton.testing.do_bench(lambda: x @ w.t(), warmup=10, rep=50, return_mode="median")
    print(f"\ngate-up ({m}, 2x{i}, {k}): cuBLAS GEMM {flops / t_gemm / 1e9:.0f} TF/s, eager GEMM+act "
          f"{t_eager:.3f} ms; default {gk.choose_gate_up_config(m, i, k, dtype, torch.cuda.get_device_properties(0).multi_processor_count)}")
    for name, cfg in {"default": {}, **GATE_UP_ALTERNATIVES}.items():
        try:
            fn = lambda cfg=cfg: gk.launch_gate_up(x, w, "silu", config=cfg)[0]   # noqa: E731
            err = rel_err(fn(), ref)
            if err > 1e-2:
                print(f"  {name:18s} WRONG err={err:.3g}")
                continue
            t = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        except Exception as exc:  # noqa: BLE001
            print(f"  {name:18s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
            continue
        print(f"  {name:18s} {t:.3f} ms {flops / t / 1e9:5.0f} TF/s  {t_eager / t:5.2f}x eager  {t_gemm / t:5.2f}x cuBLAS GEMM")


def interleaved_ms(fns: dict, rounds: int) -> dict:
    """Median ms of each function over ``rounds`` rounds, every round timing all of them in a
    rotated order: the H200's clock drifts by several % under sustained GEMM load (cuBLAS timed
    before and after a sequential sweep differed by 3-5 %, 2026-11-24), so a config timed late
    in a sequential sweep looks slower than it is."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(triton.testing.do_bench(fns[name], warmup=5, rep=25, return_mode="median"))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def graphed(fn):
    """``fn`` replayed from a CUDA graph: kernels only, no host time (every caller's host path,
    cuBLAS's and ours, hidden alike); do_bench still flushes L2 before each replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay(fn=fn):
        # fn is kept with the graph: a tensor its closure holds (a caller's ``out``) is written by
        # every replay, and once freed, the next capture's empty_cache() can hand its memory back
        # to the driver (s48: stream_k_probe's replays hit an illegal address that way)
        graph.replay()
    return replay


def valid_fns(candidates: dict, ref: torch.Tensor, graph: bool = False) -> dict:
    """The candidates whose output is right (rel err <= 1e-2 against the fp32 product); the
    others are reported and dropped. ``graph``: each returned as a CUDA-graph replay."""
    fns = {}
    for name, fn in candidates.items():
        try:
            err = rel_err(fn(), ref)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
            print(f"  {name:22s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
            continue
        if err > 1e-2:
            print(f"  {name:22s} WRONG err={err:.3g}")
            continue
        fns[name] = graphed(fn) if graph else fn
    return fns


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="all", choices=["all", "none", *SHAPES])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--quick", action="store_true", help="default config and cuBLAS only")
    p.add_argument("--configs", default="", help="comma-separated names of the alternatives to time (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--gate-up", action="store_true", help="also sweep the swiglu_linear gate-up GEMM")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernel time, no host path)")
    p.add_argument("--row-major", action="store_true", help="b [K, N] contiguous instead of w.t() for every config")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    shapes = ([s for v in SHAPES.values() for s in v] if args.shapes == "all"
              else [] if args.shapes == "none" else SHAPES[args.shapes])
    summary = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        b = w.t().contiguous() if args.row_major else w.t()
        ref = (a.float() @ b.float())
        print(f"\n({m}, {n}, {k}) {args.dtype}: default "
              f"{mk.choose_config(m, n, k, dtype, torch.cuda.get_device_properties(0).multi_processor_count)}")
        alts = {} if args.quick else (SMALL_ALTERNATIVES if m <= 32 else MID_ALTERNATIVES if m <= 256
                                      else ALTERNATIVES)
        if args.configs:
            alts = {name: cfg for name, cfg in alts.items() if name in args.configs.split(",")}
        candidates = {"cuBLAS": lambda: torch.matmul(a, b)}
        candidates.update({name: (lambda cfg=cfg: mk.launch_matmul(a, b, config=cfg)[0])
                           for name, cfg in {"default": {}, **alts}.items()})
        ms = interleaved_ms(valid_fns(candidates, ref, args.graph), args.rounds)
        cublas = 2 * m * n * k / ms.pop("cuBLAS") / 1e9
        for name, t in ms.items():
            tf = 2 * m * n * k / t / 1e9
            print(f"  {name:22s} {tf:7.0f} TF/s  {tf / cublas:5.2f}x cuBLAS ({cublas:.0f})")
        best = max(ms, key=lambda name: -ms[name])
        # b [K, N] row-major, and the weight-gradient GEMM of nn.Linear: dW [N, K] = dyᵀ @ x (A a
        # transposed view with unit M stride), each beside cuBLAS on the same operands
        b_row = w.t().contiguous()
        dy, x = torch.randn(k, m, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype)
        layout_fns = {"default-rowmajor": lambda: mk.launch_matmul(a, b_row)[0],
                      "cuBLAS-rowmajor": lambda: torch.matmul(a, b_row),
                      "default-a-transposed": lambda: mk.launch_matmul(dy.t(), x)[0],
                      "cuBLAS-a-transposed": lambda: torch.matmul(dy.t(), x)}
        if m > 256 and not args.quick:     # the Gluon kernel on the weight gradient's layout (A M-major)
            gl_out = torch.empty(m, n, device="cuda", dtype=dtype)
            layout_fns["gluon-a-transposed"] = lambda: gp.launch_gemm_accumulate(dy.t(), x, gl_out, accumulate=False)
            layout_fns["gluon-rowmajor"] = lambda: mk.launch_matmul(a, b_row, config=dict(
                gp.ACCUMULATE_TILES["128x256"], GLUON=True))[0]
            for name, ref_l in (("gluon-a-transposed", dy.t().float() @ x.float()), ("gluon-rowmajor", ref)):
                err = rel_err(layout_fns[name](), ref_l)
                if err > 1e-2:
                    print(f"  {name:22s} WRONG err={err:.3g}")
                    del layout_fns[name]
        if args.graph:
            layout_fns = {name: graphed(fn) for name, fn in layout_fns.items()}
        layouts = interleaved_ms(layout_fns, args.rounds)
        for name in ("rowmajor", "a-transposed"):
            for who in ("default", "gluon"):
                if f"{who}-{name}" in layouts:
                    ratio = layouts[f"cuBLAS-{name}"] / layouts[f"{who}-{name}"]
                    print(f"  {who + '-' + name:22s} {2 * m * n * k / layouts[who + '-' + name] / 1e9:7.0f} TF/s  "
                          f"{ratio:5.2f}x cuBLAS")
        summary.append((m, n, k, cublas, (best, 2 * m * n * k / ms[best] / 1e9), 2 * m * n * k / ms["default"] / 1e9))
    if args.gate_up:
        sweep_gate_up(8192, 14336, 4096, dtype)
    print("\nsummary: shape, cuBLAS TF/s, default TF/s and ratio, best config, its TF/s and ratio")
    for m, n, k, cublas, (name, tf), tf_default in summary:
        print(f"  ({m}, {n}, {k})  {cublas:6.0f}  default {tf_default:6.0f} {tf_default / cublas:5.2f}x  "
              f"{name:22s} {tf:6.0f}  {tf / cublas:5.2f}x")


if __name__ == "__main__":
    main()
