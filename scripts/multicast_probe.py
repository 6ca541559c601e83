"""Does TMA multicast of the B tile (2-CTA clusters) make our GEMM cheaper? (``ops/_matmul_multicast``)

    python scripts/multicast_probe.py check                 # correctness, small and odd shapes
    python scripts/multicast_probe.py time [--rounds 3]     # do_bench and sustained loops vs cuBLAS and tilefuse

Correctness: every output element against an fp32 torch product (relative norm ≤ 1e-2, output
poisoned with NaN first), at shapes with an odd number of row tiles (the last cluster's second
CTA has no rows), ragged N and K, and the persistent loop's several tiles per cluster.
Timing: ``triton.testing.do_bench`` medians (L2 flushed) and sustained phases (back-to-back calls
for ``--seconds``, CUDA events around the phase, interleaved round by round) of the multicast
kernel, tilefuse.matmul's default and torch.matmul (cuBLAS) on x @ w.t().
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, "src")
sys.path.insert(0, "scripts")
import multicast_gemm as mc                                          # noqa: E402
from tilefuse.ops._gluon_common import matrix_descriptor            # noqa: E402

TILES = {   # name: (CONSUMERS, BLOCK_N, BLOCK_K, STAGES[, DIRECT_STORE])
    "128x256": (2, 256, 64, 3),
    "128x256s4": (2, 256, 64, 4, True),
    "128x256k32": (2, 256, 32, 6),
    "128x128": (2, 128, 64, 6),
    "64x128": (1, 128, 64, 8),
    "64x64": (1, 64, 128, 6),
}
_compiled: dict = {}


VARIANTS = {"mc": (True, 2), "nomc": (False, 2)}   # (MULTICAST, CTAs per cluster)


def launcher(m, n, k, tile, programs, variant="mc", dtype=torch.bfloat16):
    """A callable (a, w, out) -> None for the kernel at this shape and tile: ``mc`` multicasts B in
    2-CTA clusters; ``nomc`` each CTA loads all of B (same clusters)."""
    multicast, ctas = VARIANTS[variant]
    cons, bn, bk, stages, *direct = TILES[tile]
    a = torch.empty(m, k, dtype=dtype, device="cuda")
    w = torch.empty(n, k, dtype=dtype, device="cuda")
    c = torch.empty(m, n, dtype=dtype, device="cuda")

    def descs(a, w, c):
        return (matrix_descriptor(a, (64, bk)), matrix_descriptor(w, (bn, bk)),
                matrix_descriptor(w, (bn // 2, bk)), matrix_descriptor(c, (64, bn)))
    key = (tile, programs, variant, dtype)
    if key not in _compiled:
        d = descs(a, w, c)
        args = dict(a_desc=d[0], b_desc=d[1], bh_desc=d[2], c_desc=d[3], c_ptr=c, stride_cm=n, M=m, N=n, K=k)
        cx = dict(NUM_PROGRAMS=programs, GROUP_M=8, STAGES=stages, CONSUMERS=cons, CONSUMER_REGS=232,
                  MULTICAST=multicast, DIRECT_STORE=bool(direct and direct[0]))
        comp, offs, final = mc.compile_multicast(args, cx, triton.runtime.driver.active.get_current_target())
        comp._init_handles()
        md = comp.packed_metadata
        comp.packed_metadata = (md[0], ctas, md[2])   # launch as clusters of 2 CTAs (or none)
        comp.tf_constexprs = final
        print(f"  compiled {tile} x{programs} {variant}: offsets {offs}, {final['BH_PARAM']}, {comp.metadata.shared} B smem",
              flush=True)
        _compiled[key] = comp
    comp = _compiled[key]

    def run(a, w, c):
        # the launcher takes every parameter in order, constexprs included (it skips those)
        values = dict(zip(("a_desc", "b_desc", "bh_desc", "c_desc"), descs(a, w, c)),
                      c_ptr=c, stride_cm=c.stride(0), M=a.shape[0], N=w.shape[0], K=a.shape[1],
                      **comp.tf_constexprs)
        comp[(programs // ctas, 1, 1)](*[values[p.name] for p in mc.mc_gemm_kernel.params])
    return run


def check(args):
    torch.manual_seed(0)
    cases = [(320, 512, 256, "128x256"), (128, 4096, 4096, "64x128"), (192, 1000, 200, "64x128"),
             (384, 768, 4096, "128x128"), (64, 256, 64, "64x64"), (2048, 2048, 1024, "128x256"),
             (1, 384, 128, "64x128"), (4096, 4096, 4096, "128x256")]
    bad = 0
    for m, n, k, tile in cases:
        for programs in (132, 8):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            launcher(m, n, k, tile, programs)(a, w, c)
            torch.cuda.synchronize()
            ref = a.float() @ w.float().t()
            err = ((c.float() - ref).norm() / ref.norm()).item()
            ok = err <= 1e-2 and not c.isnan().any().item()
            bad += not ok
            print(f"{m}x{n}x{k} {tile} x{programs}: rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    print("check:", "all ok" if bad == 0 else f"{bad} FAILED")
    return bad == 0


def sustained(fn, seconds):
    """ms per call over back-to-back calls for ~``seconds`` (events around the phase)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn()
    end.record()
    end.synchronize()
    per = start.elapsed_time(end) / 10
    reps = max(10, int(seconds * 1e3 / per))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def time_shapes(args):
    import tilefuse
    shapes = [(8192, 4096, 4096, "128x256"), (8192, 4096, 14336, "128x256"), (8192, 8192, 8192, "128x256"),
              (8192, 6144, 4096, "128x256"), (128, 6144, 4096, "64x128"), (128, 14336, 4096, "64x128"),
              (128, 4096, 4096, "64x64"), (128, 4096, 14336, "64x128")]
    if args.shapes:
        shapes = [s for i, s in enumerate(shapes) if str(i) in args.shapes.split(",")]
    if args.cases:      # "M,N,K,tile" each
        shapes = [tuple(int(x) for x in c.split(",")[:3]) + (c.split(",")[3],) for c in args.cases]
    rows = []
    for m, n, k, tile in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().t()
        impls = {}
        for programs in args.programs:
            for variant in args.variants:
                run = launcher(m, n, k, tile, programs, variant)
                out.fill_(float("nan"))
                run(a, w, out)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (m, n, k, tile, programs, err)
                impls[f"{variant}-{tile}-x{programs}"] = lambda run=run: run(a, w, out)
        impls["tilefuse"] = lambda: tilefuse.matmul(a, w.t())
        impls["cublas"] = lambda: torch.matmul(a, w.t())
        for name, fn in impls.items():
            fn()
        bench = {name: [] for name in impls}
        sus = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                bench[name].append(do_bench(fn, warmup=25, rep=100))
            for name, fn in impls.items():
                sus[name].append(sustained(fn, args.seconds))
        flops = 2 * m * n * k
        base_b = min(bench["cublas"])
        base_s = min(sus["cublas"])
        print(f"\n{m}x{n}x{k} ({tile}):")
        for name in impls:
            b, s = min(bench[name]), min(sus[name])
            print(f"  {name:22s} do_bench {b * 1e3:9.1f} us ({flops / b / 1e9:6.1f} TF/s, {base_b / b:.3f}x cuBLAS)  "
                  f"sustained {s * 1e3:9.1f} us ({base_s / s:.3f}x)  rounds {[round(x * 1e3, 1) for x in sus[name]]}",
                  flush=True)
            rows.append((f"{m}x{n}x{k}", name, base_b / b, base_s / s))
    print("\nshape | impl | do_bench vs cuBLAS | sustained vs cuBLAS")
    for r in rows:
        print(f"{r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["check", "time", "both"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--programs", type=int, nargs="+", default=[132])
    p.add_argument("--shapes", default="")
    p.add_argument("--variants", nargs="+", default=["mc"])
    p.add_argument("--cases", nargs="+", default=[])
    a = p.parse_args()
    torch.cuda.init()
    if a.mode in ("check", "both"):
        if not check(a) and a.mode == "both":
            sys.exit(1)
    if a.mode in ("time", "both"):
        time_shapes(a)
