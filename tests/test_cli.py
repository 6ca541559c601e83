"""The ``tilefuse`` CLI, the benchmark plumbing, the reports, and the shared testing helpers.

On CPU (CI) ``tilefuse bench`` runs its no-GPU mode: the kernels under the Triton interpreter
(conftest sets ``TRITON_INTERPRET=1`` before tilefuse is imported, so ``main()`` runs in-process).
The GPU code path (validate, time, speed-ups) is exercised on CPU with fake ops and a fake timer;
the real timings run in the ``gpu``-marked tests on the device machine.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA

from tilefuse import registry
from tilefuse.bench import report
from tilefuse.bench.runner import Settings, bench_case, pass_cost, run_bench, throughput
from tilefuse.cli import _kernels_compiled_mode, main
from tilefuse.registry import Inputs, OpSpec, tensor_bytes
from tilefuse.testing import ReferenceCache, check_impl, make_grad_outputs, rel_err, run_fwd_bwd, run_reference

no_gpu = pytest.mark.skipif(HAS_CUDA, reason="tests the no-GPU mode")
SRC = str(Path(__file__).resolve().parents[1] / "src")


# ----------------------------------------------------------------------------------------------
# fake ops: cheap, no Triton, registered only for the duration of a test
# ----------------------------------------------------------------------------------------------


def _scale_inputs(shape, dtype, device):
    x = torch.randn(shape, device=device, dtype=torch.float32).to(dtype).requires_grad_(True)
    return Inputs((x,), grad_args=(0,))


def _fake_spec(name="fake_scale", fn=None, peers=None, flops=0, bench_shapes=((4, 8),)):
    return OpSpec(
        name=name,
        fn=fn or (lambda x: x * 2),
        reference=lambda x: x * 2,
        make_inputs=_scale_inputs,
        bytes_fn=lambda shape, dtype, p: tensor_bytes(shape, dtype) * (2 if p == "fwd" else 2),
        flops_fn=lambda shape, p: flops,
        test_shapes=[(3, 5), (2, 7)],
        bench_shapes=list(bench_shapes),
        dtypes=(torch.float32, torch.float16),
        peers=peers if peers is not None else {"torch": lambda: (lambda x: x * 2)},
    )


@pytest.fixture
def fake_op(monkeypatch):
    def add(spec):
        monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
        return spec
    return add


def _const_timer(fn, warmup=None, rep=None):
    fn()
    return 1.0


# ----------------------------------------------------------------------------------------------
# rel_err
# ----------------------------------------------------------------------------------------------


def test_rel_err_values():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert rel_err(ref.clone(), ref) == 0.0
    assert rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    # computed in float64: fp16 values whose squares overflow fp16 / fp32 sums
    big = torch.full((1000,), 60000.0, dtype=torch.float16)
    assert rel_err(big, big.double()) == 0.0
    assert rel_err(big, big.double() * 2) == pytest.approx(0.5)


def test_rel_err_edge_cases():
    z = torch.zeros(3)
    assert rel_err(z, torch.zeros(3, dtype=torch.float64)) == 0.0           # both zero
    assert rel_err(torch.ones(3), z) == math.inf                           # only ref zero
    assert rel_err(torch.empty(0), torch.empty(0)) == 0.0
    assert rel_err(torch.tensor([1.0, float("nan")]), torch.ones(2)) == math.inf
    assert rel_err(torch.ones(2), torch.tensor([1.0, float("nan")])) == math.inf
    assert rel_err(torch.ones(2, 3), torch.ones(3, 2)) == math.inf         # shape mismatch
    assert rel_err(torch.ones(6), torch.ones(2, 3)) == math.inf
    assert rel_err(None, torch.ones(2)) == math.inf
    inf = float("inf")
    assert rel_err(torch.tensor([inf, 1.0]), torch.tensor([inf, 1.0])) == 0.0   # matching infs
    assert rel_err(torch.tensor([-inf, 1.0]), torch.tensor([inf, 1.0])) == math.inf
    assert rel_err(torch.tensor([inf, 1.0]), torch.tensor([2.0, 1.0])) == math.inf
    assert rel_err(torch.ones(2, dtype=torch.int64), torch.ones(2)) == 0.0


# ----------------------------------------------------------------------------------------------
# run_fwd_bwd and friends
# ----------------------------------------------------------------------------------------------


def _two_outputs(x, w, k=3):
    # a float output that depends on x only, an integer output that needs no grad
    return x * k, torch.argmax(x, dim=-1)


def test_run_fwd_bwd_tuple_outputs_and_unused_input():
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)          # unused: its gradient is zeros, not None
    inp = Inputs((x, w), {"k": 2}, grad_args=(0, 1))
    g = torch.randn(4, 5)
    outs, grads = run_fwd_bwd(_two_outputs, inp, [g, None])
    assert len(outs) == 2 and outs[1].dtype == torch.int64
    assert len(grads) == 2
    torch.testing.assert_close(grads[0], 2 * g)
    assert torch.count_nonzero(grads[1]) == 0 and grads[1].shape == w.shape
    # a single tensor, a callable and "random" are accepted as grad_outputs too
    _, g1 = run_fwd_bwd(_two_outputs, inp, g)
    _, g2 = run_fwd_bwd(_two_outputs, inp, lambda outs: [torch.ones_like(outs[0])])
    _, g3 = run_fwd_bwd(_two_outputs, inp, "random")
    torch.testing.assert_close(g1[0], 2 * g)
    torch.testing.assert_close(g2[0], torch.full_like(x, 2.0))
    assert g3[0].abs().sum() > 0
    outs, grads = run_fwd_bwd(_two_outputs, inp)          # no grad_outputs: forward only
    assert grads == ()


def test_make_grad_outputs_random_in_output_dtype():
    a = torch.randn(3, 4, requires_grad=True).half()
    b = torch.arange(3)
    ga, gb = make_grad_outputs((a, b), seed=1)
    assert gb is None and ga.dtype == torch.float16 and ga.shape == a.shape
    assert not torch.all(ga == 1)                          # random, not ones
    torch.testing.assert_close(make_grad_outputs((a, b), seed=1)[0], ga)   # reproducible


def test_reference_and_check_impl():
    spec = _fake_spec()
    inp = spec.make_inputs((3, 5), torch.float32, "cpu")
    outs, grads = run_reference(spec, inp, "random")
    assert outs[0].dtype == torch.float64 and grads[0].dtype == torch.float64
    ref = ReferenceCache(spec, inp)
    same = inp.detached()                                   # same values, fresh leaves
    ok = check_impl(spec, spec.fn, same, torch.float32, reference=ref)
    assert ok.ok and ok.fwd_err == 0 and ok.bwd_err == 0
    bad_bwd = check_impl(spec, lambda x: x.detach() * 2 + x * 0, inp, torch.float32)
    assert bad_bwd.fwd_ok and not bad_bwd.bwd_ok
    boom = check_impl(spec, lambda x: 1 / 0, inp, torch.float32)
    assert not boom.ok and "ZeroDivisionError" in boom.error


# ----------------------------------------------------------------------------------------------
# the GPU code path, on CPU with a fake timer
# ----------------------------------------------------------------------------------------------


def test_bench_case_rows_statuses_and_speedups(fake_op):
    def broken():
        raise RuntimeError("no such library")

    spec = fake_op(_fake_spec(peers={
        "torch": lambda: (lambda x: x * 2),
        "wrong": lambda: (lambda x: x * 3),            # validation fails: FAILED, not timed
        "broken": broken,                              # factory raises: ERROR
        "absent": lambda: None,                        # not installed: left out
        "raises": lambda: (lambda x: x.view(-1, 7)),   # raises when called: ERROR
    }))
    settings = Settings(device="cpu", timer=_const_timer, compile=False)
    ceil = {"copy_gbps": 1.0, "matmul_tflops": 1.0}
    rows = bench_case(spec, (4, 8), torch.float32, settings, ceil)
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert {r["impl"] for r in rows} == {"tilefuse", "torch", "wrong", "broken", "raises"}
    assert {r["pass"] for r in rows} == {"fwd", "bwd", "fwd+bwd"}
    for p in ("fwd", "bwd", "fwd+bwd"):
        t = by[("tilefuse", p)]
        assert t["status"] == "ok" and t["ms"] == 1.0
        assert t["best_peer"] == "torch" and t["speedup_vs_best_peer"] == pytest.approx(1.0)
        assert set(t["speedup_vs"]) == {"torch"}
        assert by[("wrong", p)]["status"] == "FAILED" and by[("wrong", p)]["ms"] is None
        assert by[("broken", p)]["status"] == "ERROR" and "no such library" in by[("broken", p)]["error"]
        assert by[("raises", p)]["status"] == "ERROR"
    f = by[("tilefuse", "fwd")]
    nbytes = tensor_bytes((4, 8), torch.float32) * 2
    assert f["metric"] == "GB/s" and f["bytes"] == nbytes
    assert f["achieved"] == pytest.approx(nbytes / 1e-3 / 1e9)
    assert f["pct_of_ceiling"] == pytest.approx(100 * f["achieved"])
    assert by[("tilefuse", "fwd+bwd")]["bytes"] == 2 * nbytes
    json.dumps(report.sanitize(rows), allow_nan=False)


def test_unrepeatable_backward_is_timed_only_in_fwd_bwd(fake_op):
    """A backward that writes into a saved input (deferred cross-entropy) cannot be replayed with
    retain_graph: its bwd row is SKIPPED with the reason, fwd and fwd+bwd are timed; peers keep
    their bwd row."""
    spec = fake_op(dataclasses.replace(_fake_spec(), repeatable_backward=False))
    rows = bench_case(spec, (4, 8), torch.float32, Settings(device="cpu", timer=_const_timer, compile=False),
                      {"copy_gbps": 1.0, "matmul_tflops": 1.0})
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert by[("tilefuse", "bwd")]["status"] == "SKIPPED" and "fwd+bwd" in by[("tilefuse", "bwd")]["error"]
    assert by[("tilefuse", "fwd")]["status"] == by[("tilefuse", "fwd+bwd")]["status"] == "ok"
    assert by[("torch", "bwd")]["status"] == "ok"


def test_unsplit_passes_compare_fwd_bwd_only(fake_op, tmp_path):
    """An op whose forward computes the gradients (``split_passes=False``: the cross-entropies):
    its fwd / bwd rows keep their times but no throughput, %, speed-up or graph %; the markdown's
    speed-up table, the graph-best table and the roofline leave them out; fwd+bwd is compared."""
    spec = fake_op(dataclasses.replace(_fake_spec(flops=10**6), split_passes=False))
    rows = bench_case(spec, (4, 8), torch.float32, Settings(device="cpu", timer=_const_timer, compile=False),
                      {"copy_gbps": 1.0, "matmul_tflops": 1.0})
    by = {(r["impl"], r["pass"]): r for r in rows}
    for impl in ("tilefuse", "torch"):
        for p in ("fwd", "bwd"):
            r = by[(impl, p)]
            assert r["ms"] == 1.0 and r["unsplit"] and "fwd+bwd" in r["note"]
            assert r["achieved"] is None and r["pct_of_ceiling"] is None and not r.get("speedup_vs")
            assert r.get("speedup_vs_best_peer") is None and r.get("best_peer") is None
    t = by[("tilefuse", "fwd+bwd")]
    assert t["speedup_vs_best_peer"] == pytest.approx(1.0) and t["achieved"] is not None and not t.get("unsplit")
    for r in rows:                        # as if both had been replayed from CUDA graphs
        r["graph_ms"] = 0.5 if r["impl"] == "tilefuse" else 1.0
    result = {"rows": report.sanitize(rows), "ceilings": {"copy_gbps": 1.0, "matmul_tflops": 1.0}}
    assert [key[3] for key in report._graph_best_peers(rows)] == ["fwd+bwd"]
    plotted = []
    real_scatter = __import__("matplotlib.axes", fromlist=["Axes"]).Axes.scatter

    def scatter(ax, xs, ys, **kw):
        plotted.extend(xs)
        return real_scatter(ax, xs, ys, **kw)

    import matplotlib.axes
    orig, matplotlib.axes.Axes.scatter = matplotlib.axes.Axes.scatter, scatter
    try:
        assert report.plot_roofline(result, tmp_path / "roof.png") is not None
    finally:
        matplotlib.axes.Axes.scatter = orig
    assert len(plotted) == 2               # fwd+bwd of tilefuse and of torch, not the six rows

def test_compute_bound_metric_and_run_bench(fake_op):
    spec = fake_op(_fake_spec(name="fake_gemm", flops=2 * 10**9, bench_shapes=[(4, 8), (2, 3)]))
    assert pass_cost(spec, (4, 8), torch.float32, "fwd+bwd")[1] == 4 * 10**9
    assert throughput(0, 2 * 10**9, 1.0, {"matmul_tflops": 4.0})["pct_of_ceiling"] == pytest.approx(50.0)
    rows, notes = run_bench([spec], [torch.float32, torch.bfloat16],
                            Settings(device="cpu", timer=_const_timer, compile=False, quick=True),
                            {"copy_gbps": 1.0, "matmul_tflops": 4.0})
    assert {tuple(r["shape"]) for r in rows} == {(4, 8)}           # --quick: first bench shape
    assert all(r["metric"] == "TFLOP/s" for r in rows)
    assert any("bf16 not supported" in n for n in notes)


def test_compile_peer_bwd_with_donated_buffers(fake_op, monkeypatch):
    """torch.compile's backward that donates saved buffers refuses retain_graph=True: the bwd pass
    is then timed on a recompile without donation (aot_eager here: same AOTAutograd, no C++)."""
    from tilefuse.bench import runner

    def aot_eager(fn):
        torch._dynamo.reset()
        return torch.compile(fn, dynamic=False, backend="aot_eager")

    monkeypatch.setattr(runner, "_compiled", aot_eager)

    def make(shape, dtype, device):
        ts = [torch.randn(shape, device=device).to(dtype).requires_grad_(True) for _ in range(3)]
        return Inputs(tuple(ts), grad_args=(0, 1, 2))

    mlp = lambda x, w, w2: (x @ w).relu() @ w2          # saves an intermediate: donated in bwd
    spec = fake_op(OpSpec("fake_mlp", mlp, mlp, make, lambda s, d, p: 1, flops_fn=lambda s, p: 4 * 16**3,
                          bench_shapes=[(16, 16)], peers={"torch": lambda: mlp}))
    rows = bench_case(spec, (16, 16), torch.float32, Settings(device="cpu", timer=_const_timer),
                      {"matmul_tflops": 1.0})
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert all(r["status"] == "ok" and r["metric"] == "TFLOP/s" for r in rows), rows
    assert "donated_buffer=False" in by[("torch.compile", "bwd")]["note"]
    assert by[("tilefuse", "bwd")]["speedup_vs"].keys() == {"torch", "torch.compile"}
    torch._dynamo.reset()


def test_compiling_peer_bwd_with_donated_buffers(fake_op):
    """A peer that compiles itself (as the FlexAttention peer does) and whose backward donates
    buffers: its bwd pass is rebuilt after a dynamo reset without donation, not an ERROR row."""
    def make(shape, dtype, device):
        ts = [torch.randn(shape, device=device).to(dtype).requires_grad_(True) for _ in range(3)]
        return Inputs(tuple(ts), grad_args=(0, 1, 2))

    mlp = lambda x, w, w2: (x @ w).relu() @ w2          # noqa: E731 - saves an intermediate
    torch._dynamo.reset()
    peer = lambda: torch.compile(mlp, dynamic=False, backend="aot_eager")   # noqa: E731
    spec = fake_op(OpSpec("fake_mlp_peer", mlp, mlp, make, lambda s, d, p: 1, flops_fn=lambda s, p: 4 * 16**3,
                          bench_shapes=[(16, 16)], peers={"compiled_peer": peer}))
    rows = bench_case(spec, (16, 16), torch.float32,
                      Settings(device="cpu", timer=_const_timer, compile=False), {"matmul_tflops": 1.0})
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert all(r["status"] == "ok" for r in rows), [(r["impl"], r["pass"], r.get("error")) for r in rows]
    assert "donated_buffer=False" in by[("compiled_peer", "bwd")]["note"]
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# the CLI without a GPU
# ----------------------------------------------------------------------------------------------


@no_gpu
def test_bench_quick_interpreter_json_md(tmp_path, capsys):
    assert not _kernels_compiled_mode()            # conftest set TRITON_INTERPRET before import
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = main(["bench", "softmax", "--quick", "--dtype", "fp32", "--json", str(out), "--md", str(md),
               "--plot", str(tmp_path / "r.png"), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "timings need a GPU" in text
    data = json.loads(out.read_text())
    assert data["mode"] == "interpreter" and data["ceilings"] is None
    assert {"device", "versions", "date", "rows", "summary", "settings"} <= set(data)
    rows = data["rows"]
    assert len(rows) == 2 * 2                       # 2 test shapes (--quick) x fwd, bwd
    assert all(r["op"] == "softmax" and r["ok"] and r["rel_err"] <= r["tolerance"] for r in rows)
    assert "interpreter check" in md.read_text()
    assert not (tmp_path / "r.png").exists()        # nothing timed, nothing plotted


@no_gpu
def test_bench_failed_check_exits_nonzero(fake_op, tmp_path, capsys):
    fake_op(_fake_spec(name="fake_wrong", fn=lambda x: x * 2.5))
    rc = main(["bench", "fake_wrong", "--quick", "--json", str(tmp_path / "w.json"), "--no-progress"])
    assert rc == 1
    rows = json.loads((tmp_path / "w.json").read_text())["rows"]
    assert rows and all(r["status"] == "FAILED" and not r["ok"] for r in rows)
    assert "FAILED" in capsys.readouterr().out


def test_bench_unknown_op():
    with pytest.raises(SystemExit, match="unknown op"):
        main(["bench", "no_such_op", "--quick"])


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for spec in registry.all_ops():
        assert spec.name in out
    spec = registry.get("softmax")
    fwd = spec.bytes_fn(tuple(spec.bench_shapes[0]), torch.bfloat16, "fwd")
    assert f"{fwd:,}" in out


@no_gpu
def test_info_without_gpu(capsys, tmp_path):
    assert main(["info", "--json", str(tmp_path / "i.json")]) == 0
    out = capsys.readouterr().out
    assert "No CUDA device" in out and "CPU:" in out
    assert json.loads((tmp_path / "i.json").read_text())["cuda"] is False


@no_gpu
def test_cli_reruns_itself_interpreted():
    """A bare `tilefuse bench` (kernels decorated before main() runs) re-runs under the interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEFUSE_CLI_REEXEC")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "tilefuse.cli", "bench", "log_softmax", "--quick", "--dtype", "fp32", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreter" in proc.stdout and "4 of 4 checks passed" in proc.stdout


def test_bench_gpu_mode_end_to_end_with_fakes(fake_op, monkeypatch, tmp_path, capsys):
    """cmd_bench's GPU branch (ceilings, rows, JSON / Markdown / PNG) with a CPU device and timer."""
    import tilefuse.cli as cli
    from tilefuse.bench import ceilings, runner

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(cli, "_BENCH_DEVICE", "cpu")
    monkeypatch.setattr(runner, "time_ms", _const_timer)
    monkeypatch.setattr(ceilings, "cuda_available", lambda: True)
    monkeypatch.setattr(ceilings, "gpu_info", lambda index=None: {"name": "Fake GPU", "sms": 7, "capability": "9.0",
                                                                  "total_memory_bytes": 1 << 30})
    monkeypatch.setattr(ceilings, "get_ceilings", lambda refresh=False: {"copy_gbps": 0.001, "matmul_tflops": 1.0,
                                                                        "cached": True})
    fake_op(_fake_spec(name="fake_gpu"))
    rc = main(["bench", "fake_gpu", "--no-progress", "--impls", "tilefuse,torch", "--dtype", "fp32", "--save", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    stem = tmp_path / f"fake-gpu-{json.loads(next(tmp_path.glob('*.json')).read_text())['date'][:10]}"
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["mode"] == "gpu" and data["compile_mode"] == "default" and data["device"]["sms"] == 7
    assert {"versions", "ceilings", "settings", "rows", "summary", "notes", "date"} <= set(data)
    assert {r["impl"] for r in data["rows"]} == {"tilefuse", "torch"}     # --impls filter
    assert stem.with_suffix(".md").read_text().startswith("# tilefuse benchmarks -- Fake GPU")
    assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "torch.compile mode=default" in out


def test_ceilings_cache(monkeypatch, tmp_path):
    from tilefuse.bench import ceilings

    calls = []
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(ceilings, "measure_ceilings",
                        lambda: calls.append(1) or {"copy_gbps": 1.0, "matmul_tflops": 2.0, "copy_ms": 1.0,
                                                    "matmul_ms": 1.0, "measured_at": "now"})
    first = ceilings.get_ceilings()
    again = ceilings.get_ceilings()
    fresh = ceilings.get_ceilings(refresh=True)
    assert (first["cached"], again["cached"], fresh["cached"]) == (False, True, False) and len(calls) == 2
    assert again["copy_gbps"] == 1.0 and again["key"] == f"Fake GPU | torch {torch.__version__}"
    stored = json.loads((tmp_path / "ceilings.json").read_text())
    assert list(stored["entries"]) == [again["key"]]


# ----------------------------------------------------------------------------------------------
# reports from a synthetic GPU result
# ----------------------------------------------------------------------------------------------


def _row(op, shape, pass_, impl, ms, status="ok", metric="GB/s", achieved=None, **kw):
    r = {"op": op, "shape": list(shape), "dtype": "bf16", "pass": pass_, "impl": impl, "status": status,
         "error": None, "rel_err_fwd": 1e-3, "rel_err_bwd": 2e-3, "rel_err": 2e-3, "tolerance": 1e-2,
         "ms": ms, "bytes": 10**9, "flops": 0 if metric == "GB/s" else 10**12, "metric": metric,
         "achieved": achieved if achieved is not None else (None if ms is None else 1.0 / ms * 1000),
         "pct_of_ceiling": None if ms is None else 33.3, "peak_mem_bytes": 3 << 20 if pass_ == "fwd+bwd" else None,
         "speedup_vs_best_peer": None, "best_peer": None, "speedup_vs": None}
    r.update(kw)
    return r


def _synthetic_result():
    rows = []
    for shape in ((8192, 1024), (4096, 32768)):
        for p in ("fwd", "bwd", "fwd+bwd"):
            rows.append(_row("softmax", shape, p, "tilefuse", 0.5, speedup_vs_best_peer=1.6, best_peer="torch.compile",
                             speedup_vs={"torch": 2.0, "torch.compile": 1.6}))
            rows.append(_row("softmax", shape, p, "torch", 1.0))
            rows.append(_row("softmax", shape, p, "torch.compile", 0.8))
            rows.append(_row("softmax", shape, p, "liger", None, status="FAILED", rel_err="inf",
                             error="rel err inf > 1e-2 | with a [bracket]"))
    rows.append(_row("matmul", (4096, 4096, 4096), "fwd", "tilefuse", 0.25, metric="TFLOP/s", achieved=550.0,
                     speedup_vs_best_peer=0.9, best_peer="torch", speedup_vs={"torch": 0.9}))
    rows.append(_row("matmul", (4096, 4096, 4096), "fwd", "torch", 0.225, metric="TFLOP/s", achieved=611.0))
    return {
        "schema": "tilefuse-bench/1", "mode": "gpu", "date": "2026-01-02T03:04:05+00:00",
        "device": {"name": "NVIDIA H100 80GB HBM3", "sms": 132, "total_memory_bytes": 80 << 30, "capability": "9.0"},
        "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 750.0, "measured_at": "2026-01-01", "cached": True},
        "versions": {"tilefuse": "0.1.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3",
                     "cuda": "13.0", "liger": "0.6.1"},
        "compile_mode": "default",
        "settings": {"quick": False, "warmup_ms": 50, "rep_ms": 200},
        "notes": ["log_softmax: peer 'liger' not available"],
        "rows": rows,
        "summary": {"rows": len(rows)},
    }


def test_report_markdown_png_json_from_synthetic_result(tmp_path, capsys):
    res = _synthetic_result()
    md = report.to_markdown(res)
    assert md.startswith("# tilefuse benchmarks -- NVIDIA H100 80GB HBM3 -- 2026-01-02")
    for needle in ("torch 2.11.0+cu130", "triton 3.6.0", "liger 0.6.1", "3,000 GB/s", "750 TFLOP/s",
                   "## Speed-up vs best peer", "## Validation", "## softmax", "## matmul", "**1.60x**",
                   "FAILED", "`default`"):
        assert needle in md, needle
    assert "\\|" in md                                    # a '|' in an error does not break the table
    png = report.plot(res, tmp_path / "chart.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    roof = report.plot_roofline(res, tmp_path / "roof.png")
    assert roof is not None and roof.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.plot_roofline(res, tmp_path / "none.png", ops=["no-such-op"]) is None
    p = report.write_json(res, tmp_path / "r.json")
    assert report.load_json(p)["rows"][3]["rel_err"] == "inf"
    report.write_markdown(report.load_json(p), tmp_path / "r.md")     # renders from the saved JSON too
    report.print_bench(res)
    out = capsys.readouterr().out
    assert "NVIDIA H100" in out and "1.60x (torch.compile)" in out


def test_report_plain_text_fallback(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_rich(name, *a, **k):
        if name.startswith("rich") or name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    res = _synthetic_result()
    report.print_bench(res)
    with report.Progress("x") as prog:
        prog.start(1)
        prog.step("one")
        prog.advance()
    captured = capsys.readouterr()
    assert "softmax" in captured.out and "[1/1] one" in captured.err


# ----------------------------------------------------------------------------------------------
# on the GPU (device machine)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bench_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["info"]) == 0
    assert (tmp_path / "cache" / "ceilings.json").exists()
    out = tmp_path / "g.json"
    rc = main(["bench", "softmax", "--quick", "--json", str(out), "--md", str(tmp_path / "g.md"),
               "--plot", str(tmp_path / "g.png"), "--no-progress"])
    data = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert data["mode"] == "gpu" and data["compile_mode"] == "default"
    assert data["ceilings"]["copy_gbps"] > 100 and data["ceilings"]["matmul_tflops"] > 10
    impls = {r["impl"] for r in data["rows"]}
    assert {"tilefuse", "torch", "torch.compile"} <= impls
    tf = [r for r in data["rows"] if r["impl"] == "tilefuse"]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["speedup_vs_best_peer"] for r in tf)
    assert (tmp_path / "g.png").exists()


def test_cuda_graph_column(fake_op, monkeypatch, capsys):
    """--cuda-graph: every timed pass gets graph_ms (here from a fake graph timer), an uncapturable
    one graph_error; the reports add the two graph columns only when present."""
    from tilefuse.bench import runner

    calls = []

    def fake_graph_timer(fn, rep=100, setup=None):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        if setup is not None:      # the bwd pass builds its forward graph first
            setup()
        fn()
        return 0.5

    monkeypatch.setattr(runner, "graph_time_ms", fake_graph_timer)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    spec = fake_op(_fake_spec(peers={"torch": lambda: (lambda x: x * 2)}))
    settings = Settings(device="cpu", timer=_const_timer, compile=False, cuda_graph=True)
    rows = bench_case(spec, (4, 8), torch.float32, settings, {"copy_gbps": 1.0, "matmul_tflops": 1.0})
    assert len(calls) == 6                                    # 2 impls x 3 passes
    graphed = [r for r in rows if r["graph_ms"] is not None]
    assert len(graphed) == 5 and all(r["graph_ms"] == 0.5 for r in graphed)
    assert all(r["graph_pct_of_ceiling"] == pytest.approx(2 * r["pct_of_ceiling"]) for r in graphed)
    failed = [r for r in rows if r["graph_error"]]
    assert len(failed) == 1 and "capturing" in failed[0]["graph_error"] and failed[0]["ms"] == 1.0
    res = _synthetic_result()
    res["rows"] = rows
    md = report.to_markdown(res)
    assert "CUDA-graph ms" in md and "0.5000" in md and "n/a" in md
    assert "speed-up (graph)" in md                           # tilefuse and the peer both replayed
    report.print_bench(res)
    assert "graph ms" in capsys.readouterr().out
    assert "CUDA-graph ms" not in report.to_markdown(_synthetic_result())
