"""Where does stream-K's fixed ~14 µs go? DRAM and L2 counters of the Gluon GEMM, stream-K against
whole tiles (GPU machine, under Nsight Compute):

    ncu --profile-from-start off --clock-control none -k regex:gemm_ws --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,... python scripts/stream_k_ncu.py [--shapes ...]

Session 48 measured stream-K's time as the even share of the work plus ~14 µs at every shape
(``_stream_k.STREAM_K_MIN_IDLE_STEPS``); its leading suspect is lost L2 reuse: in the stream-K
region the 132 programs work on tiles ~1.76 apart at unaligned K offsets, so the operands they
read at one time span more of A and B than the data-parallel part's 132 consecutive tiles do.
If so, the stream-K launch reads more DRAM bytes than the whole-tile one for the same product.
Every case is compiled and run first; then one eager launch per case runs between
cudaProfilerStart / Stop, in the order printed, so ncu's rows map to the printed cases (a
CUDA-graph replay of the Gluon kernel failed to launch under ncu's kernel replay, s49).
"""

from __future__ import annotations

import argparse

import torch

from stream_k_probe import describe, operands, switches
from tilefuse.ops import _matmul_kernels as mk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096x4096,8192x4096x4096,8192x8192x8192")
    ap.add_argument("--layouts", default="fwd")
    args = ap.parse_args()
    cases = []
    for layout in args.layouts.split(","):
        for text in args.shapes.split(","):
            m, n, k = (int(v) for v in text.split("x"))
            a, b = operands(m, n, k, layout)
            ref = a.float() @ b.float()
            for mode, flags in [("stream-k", (True, True)), ("whole", (False, False))]:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                with switches(*flags):
                    plan = describe(a, b)
                    mk.launch_matmul(a, b, out=out)     # compiles
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                cases.append((f"{layout} {m}x{n}x{k} {mode}", plan, err, flags, a, b, out))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, plan, err, flags, a, b, out in cases:
        with switches(*flags):      # the plan made again with the case's switches
            mk.launch_matmul(a, b, out=out)
            torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    for i, (name, plan, err, *_) in enumerate(cases):
        print(f"case {i}: {name:32s} rel err {err:.2e}  {plan}")


if __name__ == "__main__":
    main()
