"""fp8 (e4m3) GEMMs with fast accumulation on the warp-specialized Gluon GEMM (GPU; PYTHONPATH=src).

    python scripts/fp8_ws_probe.py [--shapes 8192,8192,8192 ...] [--rounds 7]

Question: does ``_matmul_gluon.gemm_ws_kernel`` (the bf16 large-M kernel: a producer warp, two
consumer warp groups, 1.03-1.05x cuBLAS at 8192³ in bf16) beat the fp8 ``tl`` kernel that
``tilefuse.fp8.matmul`` runs with ``fast_accum=True`` (0.93-1.02x ``torch._scaled_mm``)? The
Gluon kernel takes 8-bit operands once its wgmma layout reduces 32 bytes of K per instruction
(``_matmul_gluon.wgmma_layout``); 128-deep K steps keep the 128-byte swizzle and the bf16 tiles'
48 KB stages. Scales are per-tensor 1.0 here (the epilogue multiply is not what is timed), bf16 out;
every candidate is checked against the fp32 product of the fp8 operands first (rel err <= 1e-2),
then timed as CUDA-graph replays after an L2 flush in interleaved rounds (``matmul_sweep``).
"""

from __future__ import annotations

import argparse

import torch

from matmul_sweep import interleaved_ms, valid_fns
from tilefuse.ops import _fp8_kernels as fk
from tilefuse.ops import _matmul_gluon_plan as gp

# (name, config of launch_gemm_ws): the bf16 large-M tiles with 128-deep (fp8) K steps
GLUON_FP8 = {
    "gluon 128x256": dict(gp.LARGE_WS_TILES["128x256"], BLOCK_K=128),
    "gluon 128x256 stream-K": dict(gp.LARGE_WS_TILES["128x256"], BLOCK_K=128, STREAM_K=True),
    "gluon 128x128": dict(gp.LARGE_WS_TILES["128x128"], BLOCK_K=128),
    "gluon 128x128 ping-pong": dict(gp.ACCUMULATE_TILES["128x128-pingpong"], BLOCK_K=128),
}


def rows(m: int, n: int, k: int, rounds: int) -> None:
    qa = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    qb = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    ref = qa.float() @ qb.float().t()
    candidates = {
        "scaled_mm": lambda: torch._scaled_mm(qa, qb.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "tl (default)": lambda: fk.launch_fp8_gemm(qa, one, qb, one, None, torch.bfloat16, True),
    }
    for name, cfg in GLUON_FP8.items():
        # an output of its own, NaN-poisoned once: an unwritten element fails the check
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        candidates[name] = lambda cfg=cfg, out=out: gp.launch_gemm_ws(qa, qb.t(), out, config=cfg)
    fns = valid_fns(candidates, ref, graph=True)
    ms = interleaved_ms(fns, rounds)
    print(f"fp8 e4m3 fast accumulation {m}x{n}x{k}, bf16 out")
    for name, t in ms.items():
        print(f"  {name:26s} {t:.4f} ms {2 * m * n * k / t / 1e9:6.0f} TF/s  {ms['scaled_mm'] / t:5.3f}x _scaled_mm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096,4096,4096", "8192,8192,8192", "8192,4096,4096",
                                                     "8192,14336,4096"])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for shape in args.shapes:
        rows(*map(int, shape.split(",")), args.rounds)


if __name__ == "__main__":
    main()
