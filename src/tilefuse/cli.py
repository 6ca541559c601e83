"""The ``tilefuse`` command: ``tilefuse info`` and ``tilefuse bench``.

    tilefuse info [--refresh] [--json PATH]
    tilefuse bench [OP ...] [--quick] [--dtype bf16[,fp16]] [--json PATH] [--md PATH] [--plot PATH] [--roofline PATH]
                   [--save [DIR]] [--no-compile] [--impls tilefuse,torch] [--refresh-ceilings]
    tilefuse bench --list [OP ...]

On a machine without CUDA (or with ``TRITON_INTERPRET=1`` set, or ``--interpret``), ``bench`` checks
every kernel under the Triton interpreter on small test shapes instead of timing it.

Triton decides at ``@triton.jit`` decoration time (``triton.runtime.jit.jit`` reads
``knobs.runtime.interpret``, i.e. ``TRITON_INTERPRET``, when the decorator runs) whether a kernel is
interpreted, and the ``tilefuse`` package imports its op modules on import, so by the time
``main()`` runs the kernels are usually already compiled-mode ``JITFunction`` objects. When that is
so, the interpreter check re-runs this command in a child Python with ``TRITON_INTERPRET=1`` in
its environment (``python -m tilefuse.cli ...``); when no kernel has been decorated yet, the
variable is simply set before the op modules are imported.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

_REEXEC_GUARD = "TILEFUSE_CLI_REEXEC"
_BENCH_DEVICE = "cuda"      # tests point the GPU code path at "cpu" (with a fake timer)


# ----------------------------------------------------------------------------------------------
# the interpreter switch
# ----------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernels_compiled_mode() -> bool:
    """True when some already-imported tilefuse module holds a non-interpreted Triton kernel.
    Gluon kernels do not count: Gluon has no interpreter, and they are only launched on sm_90."""
    try:
        from triton.runtime.jit import JITFunction, KernelInterface
    except ImportError:
        return False
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        GluonJITFunction = ()
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "tilefuse" or name.startswith("tilefuse.")):
            continue
        for v in list(vars(mod).values()):
            seen = 0
            while isinstance(v, KernelInterface) and not isinstance(v, JITFunction) and hasattr(v, "fn") and seen < 8:
                v, seen = v.fn, seen + 1          # autotune / heuristics wrappers
            if isinstance(v, JITFunction) and not isinstance(v, GluonJITFunction):
                return True
    return False


def _rerun_interpreted(argv: Sequence[str]) -> int:
    """Run ``tilefuse <argv>`` again in a child Python with ``TRITON_INTERPRET=1``."""
    import tilefuse

    env = dict(os.environ, TRITON_INTERPRET="1", **{_REEXEC_GUARD: "1"})
    src = str(Path(tilefuse.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.call([sys.executable, "-m", "tilefuse.cli", *argv], env=env)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _split(values: Sequence[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x for x in re.split(r"[,\s]+", v) if x]
    return out


def _select_specs(names: Sequence[str]):
    from . import registry

    specs = registry.all_ops()
    if not names:
        return specs
    by_name = {s.name: s for s in specs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"tilefuse: unknown op(s) {', '.join(unknown)}; registered: {', '.join(sorted(by_name))}")
    return [by_name[n] for n in dict.fromkeys(names)]


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"


def _summary(rows: list[dict]) -> dict:
    return {
        "rows": len(rows),
        "ok": sum(r["status"] == "ok" for r in rows),
        "failed": sum(r["status"] == "FAILED" for r in rows),
        "errors": sum(r["status"] == "ERROR" for r in rows),
        "skipped": sum(r["status"] == "SKIPPED" for r in rows),
        "tilefuse_not_ok": sum(r["impl"] == "tilefuse" and r["status"] in ("FAILED", "ERROR") for r in rows),
    }


def _write_outputs(result: dict, args) -> None:
    from .bench import report

    json_path, md_path, plot_path = args.json, args.md, args.plot
    if args.save is not None:
        stem = Path(args.save) / f"{_slug(result['device'].get('name', 'device'))}-{result['date'][:10]}"
        json_path = json_path or f"{stem}.json"
        md_path = md_path or f"{stem}.md"
        plot_path = plot_path or (f"{stem}.png" if result["mode"] == "gpu" else None)
    if json_path:
        print(f"wrote {report.write_json(result, json_path)}")
    if md_path:
        print(f"wrote {report.write_markdown(result, md_path)}")
    if plot_path:
        written = report.plot(result, plot_path)
        print(f"wrote {written}" if written else f"no chart written to {plot_path}: no timed rows (timings need a GPU)")
    if getattr(args, "roofline", None):
        written = report.plot_roofline(result, args.roofline)
        print(f"wrote {written}" if written else f"no roofline written to {args.roofline}: no timed rows with FLOPs")


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------


def cmd_info(args) -> int:
    from .bench import ceilings, report

    text, facts = ceilings.info_text(refresh=args.refresh)
    print(text)
    if args.json:
        report.write_json(facts, args.json)
    return 0


def cmd_list(args) -> int:
    from .bench import report
    from .bench.runner import parse_dtype

    dtypes = [parse_dtype(d) for d in _split(args.dtype)] or [parse_dtype("bf16")]
    report.list_ops(_select_specs(args.ops), dtypes[0])
    return 0


def cmd_check(args, argv: Sequence[str]) -> int:
    """No GPU: every kernel under the Triton interpreter vs the fp64 reference."""
    if not _interpreting():
        if _kernels_compiled_mode():
            if os.environ.get(_REEXEC_GUARD):
                print("tilefuse: kernels are still not interpreted after re-running with TRITON_INTERPRET=1",
                      file=sys.stderr)
                return 2
            return _rerun_interpreted(argv)
        os.environ["TRITON_INTERPRET"] = "1"       # before any op module decorates its kernels
    import torch

    from .bench import ceilings, report
    from .bench.runner import check_interpreted, parse_dtype

    reason = ("TRITON_INTERPRET is set" if not args.interpret and ceilings.cuda_available()
              else "--interpret given" if args.interpret else "no CUDA device is visible")
    print(f"tilefuse bench: {reason}, so nothing is timed -- timings need a GPU. Checking every kernel "
          "under the Triton interpreter (CPU tensors) against the fp64 reference instead.", flush=True)
    specs = _select_specs(args.ops)
    dtypes = [parse_dtype(d) for d in _split(args.dtype)] or [torch.float32, torch.float16]
    n_shapes = 2 if args.quick else 3
    with report.Progress("interpreter check", enabled=not args.no_progress) as prog:
        rows = check_interpreted(specs, dtypes, n_shapes=n_shapes, seed=args.seed, progress=prog)
    cpu = ceilings.cpu_info()
    result = {
        "schema": "tilefuse-bench/1",
        "mode": "interpreter",
        "date": _now(),
        "device": {"name": f"CPU ({cpu['model']})", "sms": None, "cpu": cpu},
        "ceilings": None,
        "versions": ceilings.versions(),
        "compile_mode": None,
        "settings": {"quick": args.quick, "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                     "ops": [s.name for s in specs], "test_shapes_per_op": n_shapes, "seed": args.seed},
        "notes": ["no timings: they need a GPU; rows are interpreter correctness checks"],
        "rows": rows,
    }
    result["summary"] = _summary(rows)
    if not rows:
        print("tilefuse bench: nothing to check (no test shapes for these ops and dtypes)", file=sys.stderr)
        return 2
    report.print_check(result)
    s = result["summary"]
    bad = s["rows"] - s["ok"]
    print(f"{s['ok']} of {s['rows']} checks passed" + (f"; {bad} FAILED" if bad else "") + ".")
    _write_outputs(result, args)
    return 1 if bad else 0


def cmd_bench(args, argv: Sequence[str]) -> int:
    if args.list:
        return cmd_list(args)
    import torch

    from .bench import ceilings

    if args.interpret or _interpreting() or not ceilings.cuda_available():
        return cmd_check(args, argv)

    from .bench import report
    from .bench.runner import COMPILE_MODE, Settings, parse_dtype, run_bench

    specs = _select_specs(args.ops)
    dtypes = [parse_dtype(d) for d in _split(args.dtype)] or [torch.bfloat16]
    dev = ceilings.gpu_info()
    print(f"{dev['name']}: {dev['sms']} SMs; measuring ceilings (cached per device)...", flush=True)
    ceil = ceilings.get_ceilings(refresh=args.refresh_ceilings)
    settings = Settings(quick=args.quick, warmup_ms=args.warmup, rep_ms=args.rep, compile=not args.no_compile,
                        seed=args.seed, device=_BENCH_DEVICE, impls=_split(args.impls) or None,
                        cuda_graph=args.cuda_graph)
    with report.Progress("bench", enabled=not args.no_progress) as prog:
        rows, notes = run_bench(specs, dtypes, settings, ceil, progress=prog)
    result = {
        "schema": "tilefuse-bench/1",
        "mode": "gpu",
        "date": _now(),
        "device": dev,
        "ceilings": ceil,
        "versions": ceilings.versions(),
        "compile_mode": COMPILE_MODE if settings.compile else None,
        "settings": {
            "quick": settings.quick, "warmup_ms": settings.warmup_ms, "rep_ms": settings.rep_ms,
            "dtypes": [str(d).replace("torch.", "") for d in dtypes], "ops": [s.name for s in specs],
            "seed": settings.seed, "impls": settings.impls, "compile": settings.compile,
            "compile_dynamic": False, "timer": "triton.testing.do_bench(return_mode='median')",
            "fwd_with_grad": True, "grad_outputs": "random normal in the output dtype",
        },
        "notes": notes,
        "rows": rows,
    }
    result["summary"] = _summary(rows)
    if not rows:
        print("tilefuse bench: nothing to run: " + ("; ".join(notes) or "no ops selected"), file=sys.stderr)
        return 2
    report.print_bench(result)
    s = result["summary"]
    print(f"{s['ok']} of {s['rows']} rows validated and timed; {s['failed']} FAILED, {s['errors']} ERROR, "
          f"{s['skipped']} skipped.")
    _write_outputs(result, args)
    return 1 if s["tilefuse_not_ok"] else 0


# ----------------------------------------------------------------------------------------------
# argument parsing
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilefuse", description="tilefuse: fused Triton kernels for transformers")
    sub = p.add_subparsers(dest="command")

    info = sub.add_parser("info", help="GPU, SMs, memory and measured ceilings (copy GB/s, bf16 matmul TFLOP/s)")
    info.add_argument("--refresh", action="store_true", help="remeasure the ceilings instead of using the cache")
    info.add_argument("--json", metavar="PATH", help="also write the facts as JSON")

    b = sub.add_parser("bench", help="validate and time every op against its peers (no GPU: interpreter check)")
    b.add_argument("ops", nargs="*", metavar="OP", help="ops to run (default: all registered)")
    b.add_argument("--list", action="store_true", help="list the registered ops, bench shapes and byte formulas")
    b.add_argument("--quick", action="store_true", help="first bench shape per op, fewer reps")
    b.add_argument("--dtype", action="append", metavar="DT",
                   help="bf16 | fp16 | fp32, comma-separated or repeated (default: bf16 on GPU, fp32,fp16 without)")
    b.add_argument("--json", metavar="PATH", help="write all results as JSON (the source of truth)")
    b.add_argument("--md", metavar="PATH", help="write a Markdown report (benchmarks/results/<gpu>-<date>.md)")
    b.add_argument("--plot", metavar="PATH", help="write a PNG chart of achieved bandwidth / TFLOP/s")
    b.add_argument("--roofline", metavar="PATH",
                   help="write a PNG roofline chart (arithmetic intensity vs TFLOP/s, both measured ceilings)")
    b.add_argument("--save", nargs="?", const="benchmarks/results", metavar="DIR",
                   help="write <gpu>-<date>.json/.md/.png into DIR (default benchmarks/results)")
    b.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    b.add_argument("--cuda-graph", action="store_true",
                   help="also time every pass replayed from a CUDA graph (kernels only, no host time)")
    b.add_argument("--impls", action="append", metavar="NAMES",
                   help="only these implementations (tilefuse, torch, torch.compile, liger, ...)")
    b.add_argument("--warmup", type=int, default=None, metavar="MS", help="do_bench warmup in ms")
    b.add_argument("--rep", type=int, default=None, metavar="MS", help="do_bench rep in ms")
    b.add_argument("--refresh-ceilings", action="store_true", help="remeasure the ceilings")
    b.add_argument("--interpret", action="store_true", help="run the interpreter check even with a GPU")
    b.add_argument("--seed", type=int, default=0, help="input / grad_output seed")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "bench":
        return cmd_bench(args, argv)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
