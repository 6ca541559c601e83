"""Weight-only int4 / int8 quant_linear launch-config sweep on the GPU, beside tinygemm and cuBLAS.

    python scripts/quant_sweep.py [--bits 4 8] [--m 1 4 16 64] [--quick] [--graph-calls 20] [--dtype bf16]

Per (bits, M, N, K), bf16 x, int4 group 128: the default launch (``quant_plan.launch_plan``) and the
declared alternatives (config overrides passed to the launcher, as scripts/matmul_sweep.py does
for matmul), each checked against the fp32 product with the dequantized weight (rel err <= 1e-2)
and timed two ways:

* ``e2e``: triton.testing.do_bench median of the whole call (host included; the default row is
  the public ``quant_linear``, alternatives call the launcher with their config);
* ``graph``: 20 calls captured in one CUDA graph, replayed; time / 20 = GPU time without host
  gaps. The 20 calls cycle through 20 copies of the weight so that they read DRAM, not the L2
  (do_bench flushes the L2 before each call itself).

GB/s counts the bytes the registry's formula says the op must move (``quant._bytes_fn``: packed
weight, scales, zero points, x, y) over the graph time; ``%copy`` relates that to a device-to-device
copy measured here (read + write bytes / time). ``x tg`` / ``x cuBLAS``: how many times faster than
tinygemm (``torch._weight_int4pack_mm`` via ``quant._tinygemm_peer``, int4 only) and than bf16
cuBLAS ``F.linear`` on the dequantized weight, timed the same two ways (e2e / graph).
"""

from __future__ import annotations

import argparse
import re
import time

import torch
import torch.nn.functional as F
import triton.testing

from tilefuse.ops import _quant_plan as quant_plan
from tilefuse.ops import quant
from tilefuse.testing import rel_err

DEVICE = "cuda"
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
GROUP_SIZE = 128
# M = 1: the GEMV kernel's knobs, and the tensor-core kernel instead. "no-xp": X_PAIRS off, bf16 x
# loaded as bf16 and converted instead of read as int32 pairs (the default; int4 with bf16 x only,
# so left out of other runs). 16 rows x 1024 columns, 4 warps, 3 stages unless named.
GEMV_ALTERNATIVES = {
    "gemv-n8-w2": dict(PATH="gemv", BLOCK_N=8, num_warps=2),
    "gemv-n32": dict(PATH="gemv", BLOCK_N=32),
    "gemv-k-half": dict(PATH="gemv", BLOCK_K="half"),
    "gemv-s4": dict(PATH="gemv", NUM_STAGES=4),
    "gemv-no-xp": dict(PATH="gemv", X_PAIRS=False),
    "dot-n64": dict(PATH="dot", BLOCK_N=64),
}
# M = 4..64: tensor-core tile shapes, the operand order (W xᵀ "wx" / x Wᵀ "xw"), split-K on / off
DOT_ALTERNATIVES = {
    "fp32-dequant": dict(PACKED=False),
    "split2": dict(SPLITS=2),
    "split4": dict(SPLITS=4),
    "k128": dict(BLOCK_K=128),
    "k128-split4": dict(BLOCK_K=128, SPLITS=4),
    "no-split": dict(SPLITS=1),
    "wx-n128-w8": dict(SWAP_AB=True, BLOCK_N=128, BLOCK_K=128, num_warps=8),
    "xw-m64-n64": dict(SWAP_AB=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128),
}
SMALL_M_ALTERNATIVES = {"gemv": dict(PATH="gemv")}     # M <= quant_plan.GEMV_MAX_ROWS: one program per row
# int4, M <= quant_plan.MMA_MAX_ROWS: the Gluon kernel (PATH="mma", not a default) and its knobs, added
# to the tl kernels' alternatives. 4 warps on groups (WARPS_K), 1 row tile of 16 per warp (REPS),
# 1 group per warp and step, up to 8 steps, split-K to ~2 programs per SM unless named.
MMA_ALTERNATIVES = {
    "mma": dict(PATH="mma"),
    "mma-r2": dict(PATH="mma", REPS=2),
    "mma-gps2": dict(PATH="mma", GROUPS_PER_STEP=2),
    "mma-wk2-wn2": dict(PATH="mma", WARPS_K=2, WARPS_N=2),
    "mma-wk8": dict(PATH="mma", WARPS_K=8),
    "mma-wk1-wn4": dict(PATH="mma", WARPS_K=1, WARPS_N=4),
    "mma-split1": dict(PATH="mma", SPLITS=1),
}
# int4 group 128, M <= quant_plan.WGMMA_MAX_ROWS on sm_90: the Hopper kernel (PATH="wgmma") and its knobs:
# 4 warps x 2 row blocks of 64 (128 rows), z / s for 4 steps per body, 4 ring stages unless named
WGMMA_ALTERNATIVES = {
    "wg": dict(PATH="wgmma"),
    "wg-w8-r1": dict(PATH="wgmma", num_warps=8, REPS=1),
    "wg-w4-r1": dict(PATH="wgmma", REPS=1),
    "wg-st8-c8": dict(PATH="wgmma", STAGES=8, CHUNK=8),
    "wg-w8-st8-c8": dict(PATH="wgmma", num_warps=8, REPS=1, STAGES=8, CHUNK=8),
    "wg-st2": dict(PATH="wgmma", STAGES=2),
    "wg-split2": dict(PATH="wgmma", SPLITS=2),
    "wg-w8-split2": dict(PATH="wgmma", num_warps=8, REPS=1, SPLITS=2),
}


def bench_e2e(fn) -> float:
    """Median µs of one call, L2 flushed before each (triton.testing.do_bench)."""
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def bench_graph(fns, replays: int = 5) -> float:
    """µs per call: ``fns`` (one call each) captured back to back in one CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm up (compiles, allocator) outside the capture
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * len(fns))


def copy_bandwidth() -> float:
    """Bytes/s of a 512 MiB device-to-device copy (read + write)."""
    src = torch.empty(2**29, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = bench_e2e(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


def _full_config(cfg: dict, bits: int, x: torch.Tensor, n: int) -> dict:
    """BLOCK_K "half": half the GEMV's default (launch_plan applies the rest of an override on
    top of its PATH's defaults)."""
    if cfg.get("BLOCK_K") == "half":
        cfg = dict(cfg, BLOCK_K=quant_plan._gemv_config(bits, n, quant_plan.num_sms(x))["BLOCK_K"] // 2)
    return cfg


def _x_pairs_only(cfg: dict) -> bool:
    """An X_PAIRS alternative (on or off) changes nothing but the int4 GEMV with bf16 x."""
    return "X_PAIRS" in cfg


def _plan_text(x, bits, n, cfg) -> str:
    m, k = x.shape
    plan = quant_plan.launch_plan(bits, GROUP_SIZE if bits == 4 else 0, m, n, k, x.dtype, quant_plan.num_sms(x),
                             tuple(sorted(cfg.items())), True, torch.cuda.get_device_capability()[0] == 9)
    meta = plan.meta
    if "ACC_LAYOUT" in meta:
        return (f"wgmma n{meta['BLOCK_N']} w{meta['num_warps']} chunk{meta['CHUNK']} stages{meta['STAGES']} "
                f"mma_n{meta['MMA_N']} groups/split {plan.chunks_per_split} splits{plan.splits} grid{plan.grid}")
    if "MMA_N" in meta:
        return (f"mma n{meta['BLOCK_N']} slots{meta['SLOTS']} steps{meta['STEPS']} w{meta['num_warps']} mma_n{meta['MMA_N']} "
                f"groups/split {plan.chunks_per_split} splits{plan.splits} grid{plan.grid}")
    path = ("gemv" if plan.kernel is quant_plan.quant_gemv_kernel
            else f"dot-{'wx' if meta['SWAP_AB'] else 'xw'} m{meta['BLOCK_M']}")
    xp = " xpairs" if meta.get("X_PAIRS") else ""
    return (f"{path} n{meta['BLOCK_N']} k{meta['BLOCK_K']} s{meta['NUM_STAGES']} w{meta['num_warps']}{xp} "
            f"splits{plan.splits} grid{plan.grid}")


def sweep_shape(bits: int, m: int, n: int, k: int, copy_bw: float, args) -> dict:
    g = GROUP_SIZE if bits == 4 else None
    dtype = args.dtype
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    qw = quant.quantize_weight(w, bits, g)
    copies = [qw] + [quant.QuantizedWeight(qw.qweight.clone(), qw.scales.clone(),
                                           None if qw.zeros is None else qw.zeros.clone(), bits, g, qw.shape)
                     for _ in range(args.graph_calls - 1)]
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w_deq = quant.dequantize_weight(qw, dtype)
    ref = F.linear(x.float(), w_deq.float())
    nbytes = quant._bytes_fn(bits)((m, n, k), dtype, "fwd")

    print(f"\nint{bits} ({m}, {n}, {k}) {str(dtype)[6:]}, {nbytes / 1e6:.1f} MB; default: {_plan_text(x, bits, n, {})}")
    # peers, timed the same two ways
    peers = {}
    deq_copies = [w_deq] + [w_deq.clone() for _ in range(min(args.graph_calls, 2 ** 33 // max(w_deq.nbytes, 1)) - 1)]
    peers["cuBLAS"] = (bench_e2e(lambda: F.linear(x, w_deq)),
                       bench_graph([lambda d=d: F.linear(x, d) for d in deq_copies]))
    del deq_copies
    if bits == 4 and dtype == torch.bfloat16 and quant._tinygemm_peer() is not None:
        try:
            tgs = [(quant._tinygemm_peer(), c) for c in copies]       # one conversion cache per copy
            for tg, c in tgs:
                tg(x, c)
            err = rel_err(tgs[0][0](x, qw), ref)
            peers["tinygemm"] = (bench_e2e(lambda: tgs[0][0](x, qw)),
                                 bench_graph([lambda tg=tg, c=c: tg(x, c) for tg, c in tgs]))
            if err > 1e-2:
                print(f"  (tinygemm rel err {err:.3g})")
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            print(f"  tinygemm FAILED {type(exc).__name__}: {str(exc)[:120]}")
    print("  " + "  ".join(f"{p} {e:.1f} / {gr:.1f} us" for p, (e, gr) in peers.items()) + "   (e2e / graph)")

    alts = {} if args.quick else dict(GEMV_ALTERNATIVES if m == 1 else DOT_ALTERNATIVES)
    if bits == 4 and m <= quant_plan.MMA_MAX_ROWS and not args.quick:
        alts = dict(alts, **MMA_ALTERNATIVES)
    if (bits == 4 and m <= quant_plan.WGMMA_MAX_ROWS and not args.quick and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability()[0] == 9):
        alts = dict(alts, **WGMMA_ALTERNATIVES)
    if args.only:
        alts = {name: cfg for name, cfg in alts.items() if re.search(args.only, name)}
    if bits != 4 or dtype != torch.bfloat16:
        alts = {name: cfg for name, cfg in alts.items() if not _x_pairs_only(cfg)}
    if args.grid:                                   # the named alternatives replaced by a grid
        alts = {"-".join(f"{k}{v}" for k, v in cfg.items()): cfg for cfg in _grid(args.grid)}
    elif 1 < m <= quant_plan.GEMV_MAX_ROWS and not args.quick:
        alts.update(SMALL_M_ALTERNATIVES)
    rows = {}
    for name, cfg in {"default": {}, **alts}.items():
        cfg = _full_config(cfg, bits, x, n)
        try:
            if name == "default":
                call = lambda c=qw: quant.quant_linear(x, c)                       # noqa: E731
            else:
                call = lambda c=qw, cfg=cfg: quant_plan.launch(x, c.qweight, c.scales, c.zeros, None, bits,  # noqa: E731
                                                           GROUP_SIZE if bits == 4 else 0, cfg)
            err = rel_err(call(), ref)
            if err > 1e-2:
                print(f"  {name:14s} WRONG rel err {err:.3g}")
                continue
            e2e = bench_e2e(call)
            graph = bench_graph([lambda c=c, call=call: call(c) for c in copies])
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
            print(f"  {name:14s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
            continue
        rows[name] = (e2e, graph)
        gbs = nbytes / (graph * 1e-6) / 1e9
        ratios = "  ".join(f"x{p} {pe / e2e:4.2f}/{pg / graph:4.2f}" for p, (pe, pg) in peers.items())
        print(f"  {name:14s} {e2e:7.1f} / {graph:6.1f} us  {gbs:6.0f} GB/s {100 * gbs * 1e9 / copy_bw:5.1f}% copy  "
              f"{ratios}   [{_plan_text(x, bits, n, cfg)}]")
    return dict(bits=bits, shape=(m, n, k), nbytes=nbytes, peers=peers, rows=rows)


def _grid(spec: str) -> list:
    """``"SPLITS=2,4 BLOCK_K=128,256"`` -> every combination, as config dicts (ints where they parse)."""
    import itertools
    axes = [(k, [int(v) if v.lstrip("-").isdigit() else v for v in vals.split(",")])
            for k, vals in (item.split("=", 1) for item in spec.split())]
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--quick", action="store_true", help="default config and the peers only")
    p.add_argument("--graph-calls", type=int, default=20, help="calls per CUDA graph (weight copies cycled)")
    p.add_argument("--grid", default="", help='a config grid instead of the named alternatives: "SPLITS=2,4 BLOCK_K=128,256"')
    p.add_argument("--shapes", default="", help='N×K pairs instead of the three Llama ones: "14336x4096 4096x14336"')
    p.add_argument("--only", default="", help="a regex: only the named alternatives it matches (and the default)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="x (tinygemm takes bf16 only)")
    args = p.parse_args()
    args.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    t0 = time.time()
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: device copy {copy_bw / 1e12:.2f} TB/s (read + write)")
    shapes = [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split()] or SHAPES
    results = [sweep_shape(bits, m, n, k, copy_bw, args) for bits in args.bits for m in args.m for n, k in shapes]

    print("\nsummary (us e2e / graph; GB/s and %copy on graph time; xPeer = peer time / ours, e2e/graph)")
    print(f"  {'shape':22s} {'default':>15s} {'%copy':>6s} {'best':>14s} {'us':>15s} {'%copy':>6s}  ratios of best")
    for r in results:
        bits, (m, n, k) = r["bits"], r["shape"]
        if not r["rows"]:
            print(f"  int{bits} ({m}, {n}, {k}): no config ran")
            continue
        pct = lambda t: 100 * r["nbytes"] / (t * 1e-6) / copy_bw       # noqa: E731
        d = r["rows"].get("default", (float("nan"), float("nan")))
        best, (be, bg) = min(r["rows"].items(), key=lambda kv: kv[1][1])
        ratios = "  ".join(f"x{p} {pe / be:4.2f}/{pg / bg:4.2f}" for p, (pe, pg) in r["peers"].items())
        print(f"  int{bits} ({m:2d}, {n:5d}, {k:5d}) {d[0]:6.1f} / {d[1]:6.1f} {pct(d[1]):5.1f}% {best:>14s} "
              f"{be:6.1f} / {bg:6.1f} {pct(bg):5.1f}%  {ratios}")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
