"""``tilefuse bench`` of one op on shapes chosen here instead of the registry's (a short device
call: the full matmul group takes ~8 minutes). PYTHONPATH=src.

    python scripts/bench_shapes.py OP SHAPE [SHAPE ...] [-- tilefuse bench options]

SHAPE: sizes joined by "x" (``128x4096x4096``). The rest goes to ``tilefuse bench`` as is.
"""

from __future__ import annotations

import sys

import tilefuse.ops  # noqa: F401  (registers every op)
from tilefuse import registry
from tilefuse.cli import main as cli_main


def main(argv: list[str]) -> int:
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    head = argv[:argv.index("--")] if "--" in argv else argv
    op, shapes = head[0], [tuple(int(v) for v in s.split("x")) for s in head[1:]]
    spec = registry.get(op)
    object.__setattr__(spec, "bench_shapes", shapes)      # (frozen or not: this run only)
    return cli_main(["bench", op, *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
