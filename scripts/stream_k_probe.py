"""Does stream-K over the last waves beat whole tiles on the large GEMMs? (GPU)

    cd scripts && python stream_k_probe.py [--shapes square,llama] [--rounds 7] [--layouts fwd,dgrad,wgrad]

``ops/_stream_k.py``: a persistent GEMM of T tiles on P SMs runs ceil(T / P) tile-times; stream-K
cuts the last partial wave plus one full wave along K into P even runs. Candidates, each checked
against the fp32 product and timed as CUDA-graph replays after an L2 flush, interleaved with
cuBLAS (``matmul_sweep``'s helpers): ``stream-k`` (the default), ``whole`` (STREAM_K off: whole
tiles, with session 46's tail split where it applies) and ``whole-no-split`` (both off). Layouts:
``fwd`` x @ w.t(), ``dgrad`` dy @ w (row-major b), ``wgrad`` dyᵀ @ x (M-major a), and ``fp8``: the
fp8 tl kernel with fast accumulation against ``torch._scaled_mm``. Prints the plan, then each
candidate's ms, TF/s and ratio to the peer, and stream-K's gain over ``whole``.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from matmul_sweep import SHAPES, interleaved_ms, valid_fns
from tilefuse.ops import _matmul_gluon_plan as gp
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops import _stream_k as sk


@contextlib.contextmanager
def switches(stream_k: bool, tail_split: bool):
    """Plans made with the module switches set (graphs are captured inside, so they keep them)."""
    old = sk.STREAM_K, gp.TAIL_SPLIT, sk.STREAM_K_MIN_IDLE_STEPS
    # stream-K at every shape it can take (not only where stream_k_pays expects a gain)
    sk.STREAM_K, gp.TAIL_SPLIT, sk.STREAM_K_MIN_IDLE_STEPS = stream_k, tail_split, 0
    mk._matmul_plan.cache_clear()
    gp._ws_plan.cache_clear()
    try:
        yield
    finally:
        sk.STREAM_K, gp.TAIL_SPLIT, sk.STREAM_K_MIN_IDLE_STEPS = old
        mk._matmul_plan.cache_clear()
        gp._ws_plan.cache_clear()


def operands(m: int, n: int, k: int, layout: str):
    """(a, b) of an [M, K] @ [K, N] product in the layout's views."""
    if layout == "wgrad":       # a = dyᵀ: the transpose of a row-major [K, M]
        a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t()
    else:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    return a, (w.t().contiguous() if layout == "dgrad" else w.t())


def describe(a: torch.Tensor, b: torch.Tensor) -> str:
    (m, k), n = a.shape, b.shape[1]
    sms = mk.num_sms(a)
    plan = mk._matmul_plan(m, n, k, a.dtype, a.dtype, a.stride(), b.stride(), (n, 1), True, sms, True, True,
                           (False, "none", False, False), (), True)
    if plan.ws_plan is None:
        return "tl kernel" if not plan.tail_rows else f"tail split ({plan.tail_rows} rows)"
    tile = dict(plan.ws_tile)
    tiles = -(-m // (64 * tile["CONSUMERS"])) * -(-n // tile["BLOCK_N"])
    sk_tiles = plan.ws_plan.prepared.ints[-1]
    return (f"Gluon {64 * tile['CONSUMERS']}x{tile['BLOCK_N']}: {tiles} tiles = {tiles / sms:.2f} waves, "
            f"stream-K region {sk_tiles} tiles")


def fp8_rows(shapes, rounds: int, gains: list) -> None:
    """fp8 with fast accumulation as ``launch_fp8_gemm`` plans it (since s51 on sm_90 at large M
    the bf16 GEMM's Gluon kernel, ``_fp8_gemm.fast_gluon_plan``; the tl kernel elsewhere):
    stream-K against whole tiles and ``torch._scaled_mm(use_fast_accum=True)``, per-tensor
    scales, bf16 out."""
    from tilefuse.ops import _fp8_gemm as fp8_gemm
    from tilefuse.ops import _fp8_kernels as fk
    for m, n, k in shapes:
        qa = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        qb = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.float8_e4m3fn)
        one = torch.ones(1, device="cuda")
        ref = (qa.float() @ qb.float().t())
        fns = {}
        for name, on in [("stream-k", True), ("whole", False)]:
            with switches(on, True):
                fp8_gemm.FP8_STREAM_K = on
                fk.gemm_plan.cache_clear()
                fns.update(valid_fns({name: lambda: fk.launch_fp8_gemm(qa, one, qb, one, None, torch.bfloat16, True)},
                                     ref, graph=True))
            fp8_gemm.FP8_STREAM_K = False
            fk.gemm_plan.cache_clear()
        fns.update(valid_fns({"scaled_mm": lambda: torch._scaled_mm(qa, qb.t(), one, one, out_dtype=torch.bfloat16,
                                                                    use_fast_accum=True)}, ref, graph=True))
        ms = interleaved_ms(fns, rounds)
        print(f"fp8 fast {m}x{n}x{k}")
        for name, t in ms.items():
            print(f"  {name:15s} {t:.4f} ms {2 * m * n * k / t / 1e9:5.0f} TF/s  {ms['scaled_mm'] / t:5.3f}x _scaled_mm")
        if "stream-k" in ms and "whole" in ms:
            gains.append(("fp8", m, n, k, ms["whole"] / ms["stream-k"], ms["scaled_mm"] / ms["stream-k"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="square,llama")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layouts", default="fwd", help="fwd, dgrad, wgrad (bf16) and fp8 (fast accumulation)")
    args = ap.parse_args()
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    print(torch.cuda.get_device_name(), "bf16, CUDA-graph replays after an L2 flush, interleaved")
    gains = []
    if "fp8" in args.layouts.split(","):
        fp8_rows(shapes, args.rounds, gains)
    for layout in [name for name in args.layouts.split(",") if name != "fp8"]:
        for m, n, k in shapes:
            a, b = operands(m, n, k, layout)
            ref = a.float() @ b.float()
            fns = {}
            for name, flags in [("stream-k", (True, True)), ("whole", (False, True)),
                                ("whole-no-split", (False, False))]:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                with switches(*flags):
                    if name == "stream-k":
                        print(f"{layout} {m}x{n}x{k}  ({describe(a, b)})")
                    fns.update(valid_fns({name: lambda out=out: mk.launch_matmul(a, b, out=out)[0]}, ref, graph=True))
            fns.update(valid_fns({"cublas": lambda: torch.matmul(a, b)}, ref, graph=True))
            ms = interleaved_ms(fns, args.rounds)
            for name, t in ms.items():
                print(f"  {name:15s} {t:.4f} ms {2 * m * n * k / t / 1e9:5.0f} TF/s  {ms['cublas'] / t:5.3f}x cuBLAS")
            if "stream-k" in ms and "whole" in ms:
                gains.append((layout, m, n, k, ms["whole"] / ms["stream-k"], ms["cublas"] / ms["stream-k"]))
    print("\nlayout shape                stream-k vs whole   stream-k vs cuBLAS (fp8: _scaled_mm)")
    for layout, m, n, k, vs_whole, vs_cublas in gains:
        print(f"{layout:6s} {m}x{n}x{k:<10d} {vs_whole:8.3f}x {vs_cublas:17.3f}x")


if __name__ == "__main__":
    main()
