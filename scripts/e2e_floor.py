"""What end-to-end timing can show for a memory-bound op of a given size (GPU machine, PYTHONPATH=src).

    python scripts/e2e_floor.py

``tilefuse bench`` reports % of the copy ceiling, measured on a 1 GiB ``copy_`` where the fixed
cost of one timed call is negligible. At 8192×4096 bf16 softmax (134 MB moved) it is not. Per
shape this prints, end to end (``triton.testing.do_bench``: L2 flushed, CUDA events around one
call) and as CUDA-graph replays (back to back, the bench's graph column): an empty Triton kernel,
``copy_`` of the same bytes (half read, half written), and the op itself, each as µs and % of the
1 GiB copy ceiling measured here.
"""

from __future__ import annotations

import torch
import triton

import tilefuse
from tilefuse.bench.ceilings import graph_time_ms, measure_copy_gbps, time_ms


@triton.jit
def empty_kernel(x_ptr):
    pass


def row(name: str, fn, nbytes: int, gbps: float) -> None:
    e2e, graph = time_ms(fn) * 1e3, graph_time_ms(fn) * 1e3
    floor = nbytes / gbps / 1e3 if nbytes else 0.0      # µs at the ceiling
    pct = (lambda us: f"{100 * floor / us:5.1f} %") if nbytes else (lambda us: "    -  ")
    print(f"{name:40s} e2e {e2e:7.1f} us {pct(e2e)}   graph {graph:7.1f} us {pct(graph)}", flush=True)


def main() -> None:
    gbps = measure_copy_gbps()["copy_gbps"]
    print(f"{torch.cuda.get_device_name()}: 1 GiB copy ceiling {gbps:,.0f} GB/s, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    x = torch.empty(1, device="cuda")
    row("empty Triton kernel", lambda: empty_kernel[(1,)](x), 0, gbps)
    for rows, cols in ((8192, 1024), (8192, 4096), (4096, 32768), (16384, 4096)):
        a = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        b = torch.empty_like(a)
        nbytes = 2 * a.numel() * a.element_size()
        row(f"copy_ {rows}x{cols} bf16", lambda: b.copy_(a), nbytes, gbps)
        row(f"tilefuse.softmax {rows}x{cols} bf16", lambda: tilefuse.softmax(a, -1), nbytes, gbps)


if __name__ == "__main__":
    main()
