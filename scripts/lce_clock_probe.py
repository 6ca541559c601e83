"""SM clock and board power during linear cross-entropy steps, tilefuse against eager (GPU;
PYTHONPATH=src:scripts).

    python scripts/lce_clock_probe.py [T H V] [--rounds 3] [--steps 15]

Question: the kernels of one tilefuse step sum to about eager's (s50 profile: 40.7 against 40.3
ms), yet do_bench reads the whole step 2.5-4.6 % slower. Do the two run at different clocks
(the H200 lowers its SM clock under its power limit, and tilefuse's step moves ~26 GB more DRAM
traffic: the 13 read-modify-writes of the 1 GiB grad_weight)? ``nvidia-smi -lms`` samples the
SM clock and power beside interleaved phases of back-to-back steps; each phase's time per step
comes from CUDA events around the whole phase, and the samples inside its host window (between
synchronizes) are averaged.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import tempfile

import torch

from lce_profile import make, step_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 4096, 128256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--impls", nargs="*", default=["eager", "tilefuse", "tilefuse-nocheck"])
    args = ap.parse_args()
    t, hdim, vocab = args.shape
    h, w, target = make(t, hdim, vocab)
    steps = {impl: step_fn(impl, h, w, target) for impl in args.impls}
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
    print(f"{torch.cuda.get_device_name()} T={t} H={hdim} V={vocab} bf16, {args.steps} steps a phase, "
          f"{len(samples)} nvidia-smi samples")
    per_impl: dict = {}
    for impl, start, stop, ms in windows:
        inside = [s for s in samples if start <= s[0] <= stop]
        clock = statistics.mean(s[1] for s in inside) if inside else float("nan")
        power = statistics.mean(s[2] for s in inside) if inside else float("nan")
        temp = max(s[3] for s in inside) if inside else float("nan")
        print(f"PHASE {impl:18s} {ms:7.2f} ms/step  SM {clock:6.0f} MHz  {power:6.0f} W  {temp:3.0f} C  "
              f"({len(inside)} samples)", flush=True)
        per_impl.setdefault(impl, []).append((ms, clock, power))
    for impl, rows in per_impl.items():
        print(f"RESULT {impl:18s} median {statistics.median(r[0] for r in rows):7.2f} ms/step, "
              f"SM {statistics.median(r[1] for r in rows):6.0f} MHz, {statistics.median(r[2] for r in rows):6.0f} W")


if __name__ == "__main__":
    main()
