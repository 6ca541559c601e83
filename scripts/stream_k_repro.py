"""Stream-K crash hunt (GPU): each (layout, shape) in its own process, so an illegal address in
one does not hide the others. Per case: eager launches (bitwise repeatable, against the fp32
product and the whole-tile kernel), then CUDA-graph replays with do_bench's L2 flush, a sync
after each batch, the workspace flags checked zero.

    cd scripts && python stream_k_repro.py [--cases dgrad:8192x4096x4096,...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CASES = ("dgrad:8192x4096x4096,fwd:8192x4096x4096,wgrad:8192x4096x4096,dgrad:4096x4096x4096,"
         "dgrad:8192x6144x4096,dgrad:8192x14336x4096,dgrad:8192x4096x14336")


def one(layout: str, m: int, n: int, k: int) -> None:
    import torch
    import triton

    from stream_k_probe import operands, switches
    from tilefuse.ops import _matmul_kernels as mk

    a, b = operands(m, n, k, layout)
    ref = a.float() @ b.float()
    with switches(False, False):
        whole = mk.launch_matmul(a, b)[0].float()
    with switches(True, False):
        plan = mk._matmul_plan(m, n, k, a.dtype, a.dtype, a.stride(), b.stride(), (n, 1), True, mk.num_sms(a),
                               True, True, (False, "none", False, False), (), True)
        sk_tiles = plan.ws_plan.prepared.ints[-1] if plan.ws_plan else None
        outs = [mk.launch_matmul(a, b)[0] for _ in range(20)]
        torch.cuda.synchronize()
        same = all(torch.equal(o, outs[0]) for o in outs)
        err = ((outs[0].float() - ref).norm() / ref.norm()).item()
        vs_whole = ((outs[0].float() - whole).norm() / whole.norm()).item()
        flags = mk.split_k_buffers(a.device, 1, 1)[0]
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda: mk.launch_matmul(a, b, out=out)[0]      # noqa: E731
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median")
        torch.cuda.synchronize()
        g_err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"{layout} {m}x{n}x{k}: sk_tiles={sk_tiles} bitwise-repeat={same} err={err:.2e} vs_whole={vs_whole:.2e} "
          f"flags_zero={not flags.any().item()} graph_err={g_err:.2e} graph {ms:.4f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--one", default="")
    args = ap.parse_args()
    if args.one:
        layout, shape = args.one.split(":")
        one(layout, *map(int, shape.split("x")))
        return
    for case in args.cases.split(","):
        r = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True, timeout=240)
        lines = (r.stdout + r.stderr).strip().splitlines()
        print(f"[{case}] rc={r.returncode}", *(lines[-1:] if r.returncode == 0 else lines[-6:]), sep="\n  ", flush=True)


if __name__ == "__main__":
    main()
