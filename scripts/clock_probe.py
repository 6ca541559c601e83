"""SM clock and board power while tilefuse and its peers run, phase by phase (GPU;
PYTHONPATH=src:scripts).

    python scripts/clock_probe.py lce [T H V] [--rounds 3] [--steps 15]
    python scripts/clock_probe.py gemm [M N K] [--rounds 3] [--steps 200]
    python scripts/clock_probe.py fp8 [M N K] [--rounds 3] [--steps 200]

Question: the kernels of one linear cross-entropy step sum to about eager's (s50 profile: 40.7
against 40.3 ms), yet do_bench reads the whole step 2.5-4.6 % slower. Do the two run at different
clocks? The H200 lowers its SM clock under its 700 W limit, and tilefuse's step moves ~26 GB more
DRAM traffic (the 13 read-modify-writes of the 1 GiB grad_weight) and more L2 traffic (128x128
weight-gradient tiles). ``gemm``: the same for ``tilefuse.matmul`` against ``torch.matmul``
(cuBLAS multicasts operand tiles within 2-CTA clusters; Gluon 3.6 cannot).
``nvidia-smi -lms`` samples the SM clock and power beside interleaved phases of back-to-back
steps; each phase's time per step comes from CUDA events around the whole phase, and the samples
inside its host window (between synchronizes) are averaged.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import tempfile

import torch

from lce_profile import make, step_fn


def lce_steps(shape, impls) -> tuple:
    t, hdim, vocab = shape or (8192, 4096, 128256)
    h, w, target = make(t, hdim, vocab)
    return {impl: step_fn(impl, h, w, target) for impl in impls or ("eager", "tilefuse", "tilefuse-nocheck")}, \
        f"linear_cross_entropy T={t} H={hdim} V={vocab} bf16"


def gemm_steps(shape, impls) -> tuple:
    import tilefuse

    m, n, k = shape or (8192, 4096, 4096)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    fns = {"torch": lambda: torch.matmul(a, w.t()), "tilefuse": lambda: tilefuse.matmul(a, w.t())}
    return {name: fns[name] for name in impls or fns}, f"x @ w.t() {m}x{n}x{k} bf16"


def fp8_steps(shape, impls) -> tuple:
    """fp8 e4m3 with fast accumulation, per-tensor scales, bf16 out: tilefuse's scaled_matmul
    (the Gluon GEMM, s51) against torch._scaled_mm(use_fast_accum=True)."""
    from tilefuse.ops.fp8 import scaled_matmul

    m, n, k = shape or (8192, 8192, 8192)
    qa = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    qb = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    fns = {"scaled_mm": lambda: torch._scaled_mm(qa, qb.t(), one, one, out_dtype=torch.bfloat16,
                                                 use_fast_accum=True),
           "tilefuse": lambda: scaled_matmul(qa, one, qb, one, out_dtype=torch.bfloat16, use_fast_accum=True)}
    return {name: fns[name] for name in impls or fns}, f"fp8 e4m3 fast accumulation {m}x{n}x{k}, bf16 out"


WORKLOADS = {"lce": lce_steps, "gemm": gemm_steps, "fp8": fp8_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=tuple(WORKLOADS))
    ap.add_argument("shape", nargs="*", type=int)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="calls a phase (lce 15, gemm 200)")
    ap.add_argument("--impls", nargs="*")
    args = ap.parse_args()
    steps, what = WORKLOADS[args.workload](args.shape, args.impls)
    args.steps = args.steps or (15 if args.workload == "lce" else 200)
    for fn in steps.values():       # compile, plan, warm the allocator
        fn()
    torch.cuda.synchronize()
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "20"], stdout=log, text=True)
    windows = []        # (impl, start, end, ms per step)
    try:
        for _ in range(args.rounds):
            for impl, fn in steps.items():
                torch.cuda.synchronize()
                start_wall = datetime.datetime.now()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(args.steps):
                    fn()
                end.record()
                torch.cuda.synchronize()
                windows.append((impl, start_wall, datetime.datetime.now(), begin.elapsed_time(end) / args.steps))
    finally:
        smi.terminate()
        smi.wait()
    log.seek(0)
    samples = []
    for line in log:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3])))
        except ValueError:
            continue
    print(f"{torch.cuda.get_device_name()} {what}, {args.steps} calls a phase, {len(samples)} nvidia-smi samples")
    per_impl: dict = {}
    for impl, start, stop, ms in windows:
        inside = [s for s in samples if start <= s[0] <= stop]
        clock = statistics.mean(s[1] for s in inside) if inside else float("nan")
        power = statistics.mean(s[2] for s in inside) if inside else float("nan")
        temp = max(s[3] for s in inside) if inside else float("nan")
        print(f"PHASE {impl:18s} {ms:8.3f} ms/step  SM {clock:6.0f} MHz  {power:6.0f} W  {temp:3.0f} C  "
              f"({len(inside)} samples)", flush=True)
        per_impl.setdefault(impl, []).append((ms, clock, power))
    for impl, rows in per_impl.items():
        print(f"RESULT {impl:18s} median {statistics.median(r[0] for r in rows):8.3f} ms/step, "
              f"SM {statistics.median(r[1] for r in rows):6.0f} MHz, {statistics.median(r[2] for r in rows):6.0f} W")


if __name__ == "__main__":
    main()
