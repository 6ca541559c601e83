"""Rendering of benchmark results: terminal tables, progress, JSON, Markdown and a PNG chart.

The JSON written by :func:`write_json` is the source of truth; the Markdown (:func:`to_markdown`)
and the chart (:func:`plot`) are rendered from the same dict, so they can be regenerated later
from a saved JSON (``tilefuse.bench.report.load_json``).

JSON (``"schema": "tilefuse-bench/1"``), top level: ``schema, mode ("gpu" | "interpreter"), date,
device {name, sms, total_memory_bytes, capability, cuda, ...}, ceilings {copy_gbps, matmul_tflops,
copy_ms, matmul_ms, copy_bytes, measured_at, cached, key} (null without a GPU), versions {tilefuse,
torch, triton, python, cuda, liger}, compile_mode ("default"), settings, notes, rows, summary``.

A GPU row: ``op, shape, dtype, pass ("fwd" | "bwd" | "fwd+bwd"), impl ("tilefuse", "torch",
"torch.compile", "liger", ...), status ("ok" | "FAILED" | "ERROR" | "SKIPPED"), error, rel_err_fwd,
rel_err_bwd, rel_err, tolerance, ms, bytes, flops, bound ("memory" | "compute": the pass's side
of the measured roofline's ridge point), arith_intensity (flops / bytes), metric ("GB/s" for
memory-bound, "TFLOP/s" for compute-bound), achieved (in metric), achieved_gbps, achieved_tflops,
pct_of_ceiling (of copy or of the bf16 matmul, per metric), peak_mem_bytes (fwd+bwd rows), speedup_vs_best_peer, best_peer, speedup_vs
{peer: peer_ms / tilefuse_ms} (the last three on tilefuse rows), case_seconds, unsplit (fwd / bwd
rows of an op whose forward computes the gradients: no throughput, % or speed-up; compare its
fwd+bwd row)``. An interpreter row:
``op, shape, dtype, pass, impl, status, ok, rel_err, tolerance, error, seconds``. Infinite errors are
written as the string ``"inf"`` (the file is strict JSON).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

MiB = 1 << 20


# ----------------------------------------------------------------------------------------------
# formatting helpers
# ----------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if x in ("inf", "Infinity"):
        return math.inf
    return None


def fmt(x: Any, digits: int = 3) -> str:
    v = _num(x)
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def fmt_err(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else f"{v:.2e}"


def shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def _speedup(r: dict) -> str:
    s = r.get("speedup_vs_best_peer")
    return f"{_x(s)} ({r.get('best_peer')})" if s else "-"


def _x(s: float) -> str:
    return f"{s:.2f}x" if s >= 0.1 else f"{s:.2g}x"


def _mem(r: dict) -> str:
    b = r.get("peak_mem_bytes")
    return "-" if b is None else f"{b / MiB:,.1f}"


def _throughput(r: dict) -> str:
    v = r.get("achieved")
    return "-" if v is None else f"{fmt(v)} {r.get('metric', '')}"


def _graph_cells(r: dict) -> list[str]:
    """CUDA-graph replay time and its % of the ceiling; "n/a" when the call could not be captured."""
    if r.get("graph_ms") is None:
        return ["n/a" if r.get("graph_error") else "-", "-"]
    pct = r.get("graph_pct_of_ceiling")
    return [f"{r['graph_ms']:.4f}", "-" if pct is None else f"{pct:.1f}%"]


def _pct(r: dict) -> str:
    v = r.get("pct_of_ceiling")
    return "-" if v is None else f"{v:.1f}%"


# ----------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------


def sanitize(obj: Any) -> Any:
    """JSON-safe copy: inf/nan floats become the strings "inf"/"nan", tuples lists, paths strs."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sanitize(result), indent=1, allow_nan=False) + "\n")
    return path


def load_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# ----------------------------------------------------------------------------------------------
# progress
# ----------------------------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr: rich if importable, else tqdm, else one line per step."""

    def __init__(self, description: str = "bench", enabled: bool = True):
        self.description, self.enabled = description, enabled
        self._rich = self._tqdm = None
        self._task = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, total: int) -> None:
        if not self.enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RProgress
            from rich.progress import TextColumn, TimeElapsedColumn

            self._rich = RProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[label]}"),
                console=Console(stderr=True), transient=False,
            )
            self._rich.start()
            self._task = self._rich.add_task(self.description, total=total, label="")
            return
        except ImportError:
            pass
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=self.description, file=sys.stderr, leave=True)
        except ImportError:
            self._total, self._done = total, 0

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, label=label)
        elif self._tqdm is not None:
            self._tqdm.set_postfix_str(label)
        else:
            print(f"[{self._done + 1}/{self._total}] {label}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.advance(self._task)
        elif self._tqdm is not None:
            self._tqdm.update(1)
        else:
            self._done += 1

    def close(self) -> None:
        if self._rich is not None:
            self._rich.update(self._task, label="done")
            self._rich.stop()
            self._rich = None
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None


# ----------------------------------------------------------------------------------------------
# terminal tables
# ----------------------------------------------------------------------------------------------


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str = "",
                sections: Sequence[int] = (), styles: Sequence[str | None] | None = None,
                file=None) -> None:
    """A rich table when rich is importable, else aligned plain text. ``sections``: indices of
    rows after which a separator is drawn; ``styles``: a rich style per row."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        from rich.text import Text

        table = Table(title=Text(title) if title else None, title_justify="left", show_lines=False)
        for i, h in enumerate(headers):
            table.add_column(Text(h), justify="left" if i < 5 else "right", no_wrap=i < 5)
        for i, r in enumerate(rows):   # Text(): cells are never parsed as rich markup
            table.add_row(*(Text(c) for c in r), style=(styles[i] if styles else None), end_section=i in sections)
        tty = hasattr(file, "isatty") and file.isatty()
        width = None if tty else max(100, min(220, _plain_width(headers, rows) + 10))
        Console(file=file, width=width).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    if title:
        print(title, file=file)
    print(line(headers), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for i, r in enumerate(rows):
        print(line(r), file=file)
        if i in sections and i != len(rows) - 1:
            print("", file=file)


def _plain_width(headers, rows) -> int:
    return sum(max([len(h)] + [len(r[i]) for r in rows]) + 3 for i, h in enumerate(headers))


def bench_title(result: dict) -> str:
    dev = result.get("device", {})
    c = result.get("ceilings") or {}
    v = result.get("versions", {})
    ceil = (f"copy {fmt(c.get('copy_gbps'))} GB/s, bf16 matmul {fmt(c.get('matmul_tflops'))} TFLOP/s"
            if c else "no ceilings")
    return (f"tilefuse bench -- {dev.get('name', '?')} ({dev.get('sms', '?')} SMs) -- {ceil} -- "
            f"torch.compile mode={result.get('compile_mode')} -- torch {v.get('torch')}, triton {v.get('triton')}")


BENCH_HEADERS = ["op", "shape", "dtype", "pass", "impl", "ms", "throughput", "% ceil",
                 "speed-up vs best peer", "peak MiB", "status"]


def _bench_cells(r: dict) -> list[str]:
    status = r["status"] if r["status"] == "ok" else f"{r['status']}" + (
        f" (err {fmt_err(r.get('rel_err'))})" if r["status"] == "FAILED" else "")
    return [r["op"], shape_str(r["shape"]), r["dtype"], r["pass"], r["impl"],
            "-" if r.get("ms") is None else f"{r['ms']:.4f}", _throughput(r), _pct(r),
            _speedup(r) if r["impl"] == "tilefuse" else "", _mem(r), status]


def _sections(rows: Sequence[dict]) -> list[int]:
    out = []
    for i in range(len(rows) - 1):
        a, b = rows[i], rows[i + 1]
        if (a["op"], a["shape"], a["dtype"], a["pass"]) != (b["op"], b["shape"], b["dtype"], b["pass"]):
            out.append(i)
    return out


def ordered_rows(rows: Iterable[dict]) -> list[dict]:
    """Rows grouped by (op, shape, dtype, pass), tilefuse first within a group (stable otherwise)."""
    rows = list(rows)
    keyorder: dict = {}
    for r in rows:
        keyorder.setdefault((r["op"], tuple(r["shape"]), r["dtype"]), len(keyorder))
    passes = {"fwd": 0, "bwd": 1, "fwd+bwd": 2}
    return sorted(rows, key=lambda r: (keyorder[(r["op"], tuple(r["shape"]), r["dtype"])],
                                       passes.get(r["pass"], 9), r["impl"] != "tilefuse"))


def print_bench(result: dict, file=None) -> None:
    rows = ordered_rows(result["rows"])
    styles = ["bold" if r["impl"] == "tilefuse" else ("red" if r["status"] != "ok" else None) for r in rows]
    graphs = any(r.get("graph_ms") is not None or r.get("graph_error") for r in rows)
    headers = BENCH_HEADERS[:8] + (["graph ms", "% (graph)"] if graphs else []) + BENCH_HEADERS[8:]
    cells = [(c[:8] + (_graph_cells(r) if graphs else []) + c[8:]) for r in rows for c in [_bench_cells(r)]]
    print_table(headers, cells, title=bench_title(result), sections=_sections(rows), styles=styles, file=file)
    for n in result.get("notes", []):
        print(f"note: {n}", file=file or sys.stdout)


CHECK_HEADERS = ["op", "shape", "dtype", "pass", "rel err", "tolerance", "ok"]


def _check_cells(r: dict) -> list[str]:
    ok = "ok" if r["ok"] else (r["status"] + (f": {r['error']}" if r.get("error") else ""))
    return [r["op"], shape_str(r["shape"]), r["dtype"], r["pass"], fmt_err(r.get("rel_err")),
            f"{r['tolerance']:.0e}" if _num(r.get("tolerance")) is not None else "-", ok]


def print_check(result: dict, file=None) -> None:
    rows = result["rows"]
    title = ("tilefuse kernels under the Triton interpreter (CPU) vs the fp64 reference -- "
             "correctness only: timings need a GPU")
    styles = [None if r["ok"] else "red" for r in rows]
    print_table(CHECK_HEADERS, [_check_cells(r) for r in rows], title=title, styles=styles, file=file)


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 4,
              right: Iterable[int] | None = None) -> list[str]:
    esc = lambda s: str(s).replace("|", "\\|")
    right = set(right) if right is not None else set(range(right_from, len(headers)))
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return out


def _versions_line(v: dict) -> str:
    parts = [f"{k} {v[k]}" for k in ("tilefuse", "torch", "triton", "python", "cuda") if v.get(k)]
    parts.append(f"liger {v['liger']}" if v.get("liger") else "liger not installed")
    return " · ".join(parts)


def to_markdown(result: dict) -> str:
    v = result.get("versions", {})
    dev = result.get("device", {})
    date = str(result.get("date", ""))[:10]
    lines: list[str] = []
    if result.get("mode") == "interpreter":
        lines += [f"# tilefuse interpreter check -- {dev.get('name', 'cpu')} -- {date}", "",
                  _versions_line(v), "",
                  "No GPU: the Triton kernels ran under the interpreter on CPU tensors and were "
                  "compared with the fp64 reference. Timings need a GPU.", ""]
        lines += _md_table(CHECK_HEADERS, [_check_cells(r) for r in result["rows"]])
        n_ok = sum(bool(r.get("ok")) for r in result["rows"])
        lines += ["", f"**{n_ok} ok, {len(result['rows']) - n_ok} not ok** of {len(result['rows'])} checks.", ""]
        return "\n".join(lines)

    c = result.get("ceilings") or {}
    st = result.get("settings", {})
    mem = dev.get("total_memory_bytes")
    lines += [f"# tilefuse benchmarks -- {dev.get('name', '?')} -- {date}", "",
              _versions_line(v), "",
              f"{dev.get('sms', '?')} SMs" + (f", {mem / (1 << 30):.0f} GiB" if mem else "")
              + f", compute capability {dev.get('capability', '?')}. "
              f"torch.compile mode: `{result.get('compile_mode')}` (dynamic=False, compiled once per shape, "
              "warmed before timing).", "",
              "## Ceilings (measured)", ""]
    lines += _md_table(["ceiling", "value", "how"], [
        ["copy", f"{fmt(c.get('copy_gbps'))} GB/s", "`dst.copy_(src)`, bytes = 2 x nbytes (read + write)"],
        ["bf16 matmul", f"{fmt(c.get('matmul_tflops'))} TFLOP/s", "`torch.matmul` 8192³, FLOPs = 2·M·N·K"],
    ], right={1})
    lines += ["", f"Times: median of `triton.testing.do_bench` (CUDA events, L2 flushed; warmup "
              f"{st.get('warmup_ms')} ms, rep {st.get('rep_ms')} ms){' -- quick run' if st.get('quick') else ''}. "
              "`fwd` runs with grad-requiring inputs; `bwd` is `torch.autograd.grad(..., retain_graph=True)` "
              "on a graph built outside the timed region; `fwd+bwd` both. GB/s counts the ideal bytes of "
              "`bytes_fn`; % is of the copy ceiling (TFLOP/s and the matmul ceiling for compute-bound ops). "
              "Every implementation is validated against the fp64 reference before it is timed.", ""]

    rows = ordered_rows(result["rows"])
    tf = [r for r in rows if r["impl"] == "tilefuse"]
    graph_best = _graph_best_peers(rows)
    lines += ["## Speed-up vs best peer", ""]
    if graph_best:
        lines += ["The CUDA-graph columns compare replayed kernels alone (no host time between launches, "
                  "L2 not flushed), the best peer chosen by its own graph time.", ""]

    def graph_cells(r) -> list[str]:
        g = graph_best.get(_case_key(r))
        if not graph_best:
            return []
        if g is None:
            return ["-", "-", "-"]
        peer, speedup = g
        pct = r.get("graph_pct_of_ceiling")
        return [peer, f"**{_x(speedup)}**", "-" if pct is None else f"{pct:.1f}%"]

    lines += _md_table(["op", "shape", "dtype", "pass", "tilefuse ms", "best peer", "peer ms", "speed-up", "tilefuse % ceil"]
                       + (["best peer (graph)", "speed-up (graph)", "% ceil (graph)"] if graph_best else []), [
        [r["op"], shape_str(r["shape"]), r["dtype"], r["pass"],
         "-" if r.get("ms") is None else f"{r['ms']:.4f}", r.get("best_peer") or "-",
         "-" if not r.get("best_peer") else f"{r['ms'] * r['speedup_vs_best_peer']:.4f}",
         "-" if not r.get("speedup_vs_best_peer") else f"**{_x(r['speedup_vs_best_peer'])}**", _pct(r)]
        + graph_cells(r)
        for r in tf])
    bad = [r for r in rows if r["status"] != "ok"]
    n_ok = sum(r["status"] == "ok" for r in rows)
    lines += ["", "## Validation", "",
              f"{n_ok} of {len(rows)} rows passed validation and were timed; {len(bad)} did not"
              + (" (FAILED: over tolerance, not timed; ERROR: raised; SKIPPED: not applicable)." if bad
                 else ": every implementation matched the reference."), ""]
    if bad:
        lines += _md_table(["op", "shape", "dtype", "pass", "impl", "status", "rel err", "error"], [
            [r["op"], shape_str(r["shape"]), r["dtype"], r["pass"], r["impl"], r["status"],
             fmt_err(r.get("rel_err")), (r.get("error") or "")[:120]] for r in bad], right={6})
        lines.append("")
    for op in dict.fromkeys(r["op"] for r in rows):
        op_rows = [r for r in rows if r["op"] == op]
        metrics = {r.get("metric") for r in op_rows}
        tp = metrics.pop() if len(metrics) == 1 else "throughput"
        graphs = any(r.get("graph_ms") is not None or r.get("graph_error") for r in op_rows)
        lines += [f"## {op}", ""]
        lines += _md_table(["shape", "dtype", "pass", "impl", "ms", tp, "% ceil", "speed-up vs best peer"]
                           + (["CUDA-graph ms", "% ceil (graph)"] if graphs else [])
                           + ["peak MiB (fwd+bwd)", "rel err", "status"], [
            [shape_str(r["shape"]), r["dtype"], r["pass"],
             f"**{r['impl']}**" if r["impl"] == "tilefuse" else r["impl"],
             "-" if r.get("ms") is None else f"{r['ms']:.4f}",
             fmt(r.get("achieved")) if tp != "throughput" else _throughput(r), _pct(r),
             _speedup(r) if r["impl"] == "tilefuse" else ""]
            + (_graph_cells(r) if graphs else [])
            + [_mem(r), fmt_err(r.get("rel_err")), r["status"]] for r in op_rows])
        lines.append("")
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def _case_key(r: dict) -> tuple:
    return r["op"], tuple(r["shape"]), r["dtype"], r["pass"]


def _graph_best_peers(rows: list[dict]) -> dict:
    """(op, shape, dtype, pass) -> (fastest peer by CUDA-graph time, its graph ms / tilefuse's),
    where tilefuse and at least one peer were replayed from a graph."""
    out = {}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r.get("unsplit"):     # fwd / bwd of an op whose forward computes the gradients
            groups.setdefault(_case_key(r), []).append(r)
    for key, grp in groups.items():
        ours = [r["graph_ms"] for r in grp if r["impl"] == "tilefuse" and r.get("graph_ms")]
        peers = {r["impl"]: r["graph_ms"] for r in grp if r["impl"] != "tilefuse" and r.get("graph_ms")}
        if ours and peers:
            best = min(peers, key=peers.get)
            out[key] = (best, peers[best] / ours[0])
    return out


def write_markdown(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(result))
    return path


# ----------------------------------------------------------------------------------------------
# chart
# ----------------------------------------------------------------------------------------------


def plot(result: dict, path: str | Path) -> Path | None:
    """Grouped bars of achieved throughput per (op, shape, dtype), one bar per implementation, one
    panel per pass (and per metric when compute-bound ops are present), a dashed line at the
    measured ceiling. Returns None (writes nothing) when no row has a timing."""
    rows = [r for r in ordered_rows(result.get("rows", [])) if _num(r.get("achieved")) is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ceilings = result.get("ceilings") or {}
    panels = list(dict.fromkeys((r.get("metric", "GB/s"), r["pass"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}
    n_groups = max(len({(r["op"], tuple(r["shape"]), r["dtype"]) for r in rows if (r.get("metric"), r["pass"]) == p})
                   for p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 1.1 * n_groups * max(1, len(impls)) * 0.45 + 3),
                                                       3.6 * len(panels)), squeeze=False)
    for ax, (metric, pass_) in zip(axes[:, 0], panels):
        prow = [r for r in rows if r.get("metric", "GB/s") == metric and r["pass"] == pass_]
        groups = list(dict.fromkeys((r["op"], tuple(r["shape"]), r["dtype"]) for r in prow))
        width = 0.8 / max(1, len(impls))
        for j, name in enumerate(impls):
            xs, ys = [], []
            for g, key in enumerate(groups):
                match = [r for r in prow if r["impl"] == name and (r["op"], tuple(r["shape"]), r["dtype"]) == key]
                if match:
                    xs.append(g - 0.4 + width * (j + 0.5))
                    ys.append(float(match[0]["achieved"]))
            if xs:
                ax.bar(xs, ys, width=width, label=name, color=colors[name])
            for g, key in enumerate(groups):     # implementations that were not timed: say why
                for r in result.get("rows", []):
                    if (r["impl"] == name and r["pass"] == pass_ and r["status"] != "ok"
                            and (r["op"], tuple(r["shape"]), r["dtype"]) == key):
                        ax.text(g - 0.4 + width * (j + 0.5), 0, r["status"], rotation=90, fontsize=7,
                                ha="center", va="bottom", color="red")
        ceil = ceilings.get("matmul_tflops" if metric == "TFLOP/s" else "copy_gbps")
        if _num(ceil):
            what = "bf16 matmul" if metric == "TFLOP/s" else "copy"
            ax.axhline(float(ceil), color="black", linestyle="--", linewidth=1,
                       label=f"{what} ceiling {fmt(ceil)} {metric}")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{op}\n{shape_str(s)} {dt}" for op, s, dt in groups], fontsize=8)
        ax.set_ylabel(metric)
        ax.set_title(f"{pass_}: achieved {metric}", fontsize=10, loc="left")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    dev = result.get("device", {}).get("name", "?")
    fig.suptitle(f"tilefuse -- {dev} -- {str(result.get('date', ''))[:10]}", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_roofline(result: dict, path: str | Path, ops: Sequence[str] | None = None,
                  prefer_graph: bool = True) -> Path | None:
    """Roofline chart: arithmetic intensity (FLOPs / ideal bytes) on x, achieved TFLOP/s on y (both
    log), one marker per (implementation, op), every timed row with a FLOP count but the
    ``unsplit`` fwd / bwd rows (restricted to ``ops`` when given); the measured ceilings as the
    roof min(matmul TFLOP/s, AI x copy GB/s).
    With ``prefer_graph`` a row's CUDA-graph replay time is used where it was measured (the
    kernels without host gaps: small shapes are otherwise host-bound), else its end-to-end time.
    Returns None when no row qualifies."""
    rows = [r for r in ordered_rows(result.get("rows", []))
            if _num(r.get("ms")) and _num(r.get("flops")) and _num(r.get("bytes")) and r["status"] == "ok"
            and not r.get("unsplit") and (ops is None or r["op"] in ops)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ceilings = result.get("ceilings") or {}
    peak, bw = _num(ceilings.get("matmul_tflops")), _num(ceilings.get("copy_gbps"))
    def ms(r):
        g = _num(r.get("graph_ms")) if prefer_graph else None
        return g if g else float(r["ms"])

    ai = [float(r["flops"]) / float(r["bytes"]) for r in rows]
    tf = [float(r["flops"]) / ms(r) / 1e9 for r in rows]
    graphed = prefer_graph and any(_num(r.get("graph_ms")) for r in rows)
    fig, ax = plt.subplots(figsize=(9.5, 6.0))
    if peak and bw:
        lo, hi = min(ai) / 2, max(ai) * 2
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], color="black", linewidth=1.2,
                label=f"roof: bf16 matmul {fmt(peak)} TFLOP/s, copy {fmt(bw)} GB/s")
        ax.axvline(peak * 1e3 / bw, color="gray", linestyle=":", linewidth=0.8)
    keys = list(dict.fromkeys((r["impl"], r["op"]) for r in rows))
    markers = "osD^v<>pPX*h"
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ops_seen = list(dict.fromkeys(r["op"] for r in rows))
    for impl, op in keys:
        pts = [(a, t) for a, t, r in zip(ai, tf, rows) if (r["impl"], r["op"]) == (impl, op)]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=36, alpha=0.85,
                   marker=markers[ops_seen.index(op) % len(markers)],
                   color=plt.get_cmap("tab10")(impls.index(impl) % 10), label=f"{op}: {impl}")
    for a, t, r in zip(ai, tf, rows):
        if r["impl"] == "tilefuse":
            ax.annotate(f"{shape_str(r['shape'])} {r['pass']}", (a, t), fontsize=6, alpha=0.7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per ideal byte)")
    ax.set_ylabel("achieved TFLOP/s" + (" (CUDA-graph replay where measured)" if graphed else ""))
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    dev = result.get("device", {}).get("name", "?")
    ax.set_title(f"tilefuse roofline -- {dev} -- {str(result.get('date', ''))[:10]}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# --list
# ----------------------------------------------------------------------------------------------


def _shape_list(shapes: Sequence, most: int = 3) -> str:
    """The first ``most`` shapes and a count of the rest: a long list would squeeze the byte and
    FLOP columns out of the table."""
    shown = " ".join(shape_str(x) for x in shapes[:most])
    return (shown + (f" (+{len(shapes) - most})" if len(shapes) > most else "")) or "-"


def list_ops(specs: Sequence, dtype, file=None) -> None:
    """Registered ops with their bench shapes and the byte / FLOP formulas at the first shape."""
    from .runner import dtype_name, pass_cost

    headers = ["op", "bwd", "dtypes", "bench shapes", "first shape", "bytes fwd", "bytes bwd", "FLOPs fwd",
               "FLOPs bwd", "peers"]
    rows = []
    for s in specs:
        shapes = [tuple(x) for x in s.bench_shapes]
        cells = [s.name, "yes" if s.has_backward else "no", ",".join(dtype_name(d) for d in s.dtypes),
                 _shape_list(shapes)]
        if shapes:
            sh = shapes[0]
            bf, ff = pass_cost(s, sh, dtype, "fwd")
            bb, fb = pass_cost(s, sh, dtype, "bwd") if s.has_backward else (None, None)
            cells += [f"{shape_str(sh)} {dtype_name(dtype)}", _bytes(bf), _bytes(bb), _flops(ff), _flops(fb)]
        else:
            cells += ["-"] * 5
        cells.append(",".join(s.peers) or "-")
        rows.append(cells)
    print_table(headers, rows, title="registered ops (bytes: ideal traffic per pass from bytes_fn)", file=file)
    for s in specs:
        if s.description:
            print(f"  {s.name}: {s.description}", file=file or sys.stdout)


def _bytes(n) -> str:
    return "-" if n is None else f"{n:,} ({n / MiB:,.1f} MiB)"


def _flops(n) -> str:
    return "-" if n is None else f"{n:.3e}"
