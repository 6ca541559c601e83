"""GPU time of the one-launch backwards (dw / db partials summed behind a grid barrier, a
cooperative launch) against their two launches, without the bench's flush and host in the way:
100 back-to-back calls between two CUDA events (the host queues ahead: kernels of ~100 µs,
launches of ~30-60 µs), median of 7 interleaved rounds (GPU, PYTHONPATH=src).

    python scripts/coop_probe.py
"""

import statistics

import torch

from tilefuse.ops import _norm_launch as nl
from tilefuse.ops import activations as ba


def loop_us(fn, n: int = 100) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    rows, n = 16384, 4096
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _, _, mean, rstd = nl._launch_fwd(x, w, b, None, 1e-5, 0.0, False)
    cases = {
        "bias_act gelu bwd": lambda fs: (lambda: ba._launch_bwd(dy, x, b, "gelu", 0.0, 0, True, True, n,
                                                                config={"final_sum": fs})),
        "layer_norm bwd": lambda fs: (lambda: nl._launch_bwd(dy, x, w, mean, rstd, None, 0.0, False, True, True,
                                                             torch.bfloat16, torch.bfloat16, config={"final_sum": fs})),
    }
    nbytes = 3 * x.numel() * x.element_size()
    for name, make in cases.items():
        times = {True: [], False: []}
        for _ in range(7):
            for fs in (True, False):
                times[fs].append(loop_us(make(fs)))
        for fs, label in ((True, "one launch (grid barrier)"), (False, "two launches")):
            med = statistics.median(times[fs])
            print(f"{name:20s} {label:28s} {med:7.1f} us/call  {nbytes / med / 1e3:6.0f} GB/s  "
                  f"(rounds {min(times[fs]):.1f}-{max(times[fs]):.1f})", flush=True)


if __name__ == "__main__":
    main()
