"""A/B of matmul's end-to-end (host + kernel) time at small M between two source trees (GPU):

    python scripts/host_ab.py <src dir> [<src dir> ...]   (each measured in its own process, twice, alternating)

Per tree: tilefuse.matmul(x, w.t()) forward with grad-requiring inputs, as the bench's fwd row,
and torch.matmul beside it, median µs of triton.testing.do_bench."""

import os
import subprocess
import sys

SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (16, 6144, 4096), (128, 6144, 4096), (128, 14336, 4096),
          (16, 4096, 14336)]


def one() -> None:
    import torch
    import triton

    import tilefuse
    cells = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ours = triton.testing.do_bench(lambda: tilefuse.matmul(x, w.t()), warmup=50, rep=200, return_mode="median")
        peer = triton.testing.do_bench(lambda: torch.matmul(x, w.t()), warmup=50, rep=200, return_mode="median")
        cells.append(f"{m}x{n}x{k} {1e3 * ours:6.1f}/{1e3 * peer:5.1f}")
    print(tilefuse.__file__.split("/src/")[0], " ".join(cells), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one()
    else:
        for _ in range(2):
            for src in sys.argv[1:]:
                subprocess.run([sys.executable, __file__, "--one"], env={**os.environ, "PYTHONPATH": src},
                               timeout=200)
