"""out += a @ b with a short K: tilefuse's Gluon accumulate GEMM against cuBLAS (GPU, sm_90;
PYTHONPATH=src).

    python scripts/gemm_accumulate_probe.py [--rounds 5] [--shape M N K]

The shape that matters is linear cross-entropy's grad_weight (M = V = 128256, N = H = 4096,
K = 512 tokens of a chunk): a = dlogitsᵀ (the chunk's [C, V] buffer read transposed), b = the
chunk's hidden rows [C, H], out the [V, H] bf16 gradient read and written once per chunk.
First a correctness pass (NaN-free, rel err against fp32 products, ragged shapes, each operand
layout and tile), then the variants timed in interleaved rounds (do_bench medians, L2 flushed;
the median over rounds is printed): an isolated GEMM timing moves ±8 % between machines.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

from tilefuse.ops import _matmul_gluon_plan as gp
from tilefuse.ops._matmul_kernels import launch_matmul
from tilefuse.testing import rel_err


def check(m: int, n: int, k: int, a_m_major: bool, b_k_major: bool, tile: str) -> float:
    a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if a_m_major else \
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_k_major else \
        torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = out.double() + a.double() @ b.double()
    gp.launch_gemm_accumulate(a, b, out, config=gp.ACCUMULATE_TILES[tile])
    return rel_err(out, ref)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", nargs=3, type=int, default=[128256, 4096, 512])
    ap.add_argument("--long-k", action="store_true", help="also the one-GEMM equivalent at 16x the K")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--pingpong-variants", action="store_true", help="also the ping-pong tile's GROUP_M / ring variants")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for tile in [] if args.no_check else gp.ACCUMULATE_TILES:
        for (m, n, k) in [(1000, 768, 512), (136, 200, 40), (128256, 4096, 512), (64, 256, 8)]:
            for a_m_major, b_k_major in [(True, False), (False, False), (False, True)]:
                err = check(m, n, k, a_m_major, b_k_major, tile)
                print(f"check {tile} {m}x{n}x{k} a_m_major={a_m_major} b_k_major={b_k_major}: rel err {err:.2e}",
                      "OK" if err < 8e-3 else "FAIL")

    m, n, k = args.shape
    dl = torch.randn(k, m, device="cuda", dtype=torch.bfloat16) * 1e-2     # the chunk's dlogits [C, V]
    h = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)             # the chunk's hidden [C, H]
    gw = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    tmp = torch.empty_like(gw)
    variants = {
        "cuBLAS gwᵀ.addmm_(hᵀ, dl) (LCE today)": lambda: gw.t().addmm_(h.t(), dl),
        "cuBLAS gw.addmm_(dlᵀ, h)": lambda: gw.addmm_(dl.t(), h),
        "cuBLAS mm(dlᵀ, h) (no accumulator)": lambda: torch.mm(dl.t(), h, out=tmp),
        "tilefuse tl mm(dlᵀ, h) (no accumulator)": lambda: launch_matmul(dl.t(), h, out=tmp),
    }
    for tile, cfg in gp.ACCUMULATE_TILES.items():
        variants[f"tilefuse accumulate {tile}"] = lambda cfg=cfg: gp.launch_gemm_accumulate(dl.t(), h, gw, config=cfg)
        variants[f"tilefuse {tile} (no accumulator)"] = lambda cfg=cfg: gp.launch_gemm_accumulate(
            dl.t(), h, tmp, config=cfg, accumulate=False)
    if args.pingpong_variants:     # the ping-pong tile's tile order and ring depth
        base = gp.ACCUMULATE_TILES["128x128-pingpong"]
        for name, cfg in {"g4": dict(base, GROUP_M=4), "g16": dict(base, GROUP_M=16), "g32": dict(base, GROUP_M=32),
                          "s4": dict(base, STAGES=4), "k32-s10": dict(base, BLOCK_K=32, STAGES=10)}.items():
            variants[f"tilefuse accumulate pingpong {name}"] = lambda cfg=cfg: gp.launch_gemm_accumulate(
                dl.t(), h, gw, config=cfg)
    if args.long_k:     # the same FLOPs in one GEMM of K x16 (eager's grad_weight at T = 8192), time / 16
        dl16 = torch.randn(16 * k, m, device="cuda", dtype=torch.bfloat16) * 1e-2
        h16 = torch.randn(16 * k, n, device="cuda", dtype=torch.bfloat16)
        variants["cuBLAS mm(dlᵀ, h), K x16, / 16"] = lambda: torch.mm(dl16.t(), h16, out=tmp)
        for tile, cfg in gp.ACCUMULATE_TILES.items():
            variants[f"tilefuse {tile}, K x16, / 16"] = lambda cfg=cfg: gp.launch_gemm_accumulate(
                dl16.t(), h16, tmp, config=cfg, accumulate=False)
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    flops = 2 * m * n * k
    print(f"\nM={m} N={n} K={k} bf16, {args.rounds} interleaved rounds")
    print(f"{'variant':44s} {'ms':>7s} {'TFLOP/s':>8s}  rounds")
    for name, ts in times.items():
        med = statistics.median(ts) / (16 if "x16" in name else 1)
        ts = [t / (16 if "x16" in name else 1) for t in ts]
        print(f"{name:44s} {med:7.3f} {flops / med / 1e9:8.0f}  " + " ".join(f"{t:.3f}" for t in ts))


if __name__ == "__main__":
    main()
