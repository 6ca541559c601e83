"""``tilefuse bench`` and ``tilefuse info``: measured ceilings, the benchmark loop, and reports.

* :mod:`.ceilings` -- device facts, :func:`time_ms` (the one timing helper), copy / matmul ceilings
  with their per-device JSON cache.
* :mod:`.runner` -- validation-then-timing of tilefuse and its peers per (op, shape, dtype, pass);
  the no-GPU interpreter check.
* :mod:`.report` -- terminal tables, progress bar, JSON, Markdown and the PNG chart.

Importing this package does not import matplotlib or rich; those load when a report needs them.
"""

from .ceilings import cuda_available, get_ceilings, host_us, time_ms
from .runner import PASSES, Settings, bench_case, check_interpreted, parse_dtype, run_bench

__all__ = [
    "PASSES",
    "Settings",
    "bench_case",
    "check_interpreted",
    "cuda_available",
    "get_ceilings",
    "host_us",
    "parse_dtype",
    "run_bench",
    "time_ms",
]
