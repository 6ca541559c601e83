"""Opt-in runtime autotuning of tilefuse.matmul (``ops/_matmul_autotune.py``), on the CPU through
the interpreter with the timer replaced: the candidates, the choice (fastest that answers like
the heuristic), its cache per problem (no second timing), wrong or failing candidates dropped,
no tuning while off, the cache file across processes. On a GPU: the autotuned GEMM against fp64
and the heuristic's, forward and backward."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import HAS_CUDA

import tilefuse
from tilefuse._dispatch import use_triton
from tilefuse.ops import _matmul_autotune as at
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops.matmul import matmul, matmul_reference
from tilefuse.testing import rel_err

pytestmark = pytest.mark.skipif(not (HAS_CUDA or use_triton(torch.empty(0))),
                                reason="the Triton path: a GPU, or the interpreter on the CPU")


@pytest.fixture
def tuning(monkeypatch):
    """Autotuning on, no cache file, a fresh choice table, the CPU allowed to "time": the timer
    ranks candidates by ``ranking`` (lower is faster; unlisted ones 100 ms) and records them."""
    if not use_triton(torch.empty(0)):     # a GPU machine's CPU tensors take the reference path
        pytest.skip("the CPU tests run the kernels under the interpreter (TRITON_INTERPRET=1)")
    calls, ranking = [], {}

    def fake_time(run, candidate):
        run(candidate)
        calls.append(candidate)
        return ranking.get(candidate, 100.0)
    monkeypatch.setattr(at, "ENABLED", True)
    monkeypatch.setattr(at, "CACHE_FILE", None)
    monkeypatch.setattr(at, "time_candidate", fake_time)
    monkeypatch.setattr(at, "can_time", lambda t: True)
    at.clear()
    mk._matmul_plan.cache_clear()
    yield calls, ranking
    at.clear()
    mk._matmul_plan.cache_clear()


def test_candidates():
    """() first (the heuristic), the tl tiles of the M bucket with split-K below large M, Gluon
    tiles only on sm_90 with 16-bit operands (large M: with and without stream-K), no duplicates."""
    large = at.matmul_candidates(4096, torch.bfloat16, hopper_exact=True)
    assert large[0] == () and len(set(large)) == len(large)
    gluon = [dict(c) for c in large if dict(c).get("GLUON") is True]
    assert len(gluon) == 4                                                   # 128x256, 128x128
    assert sorted((g["BLOCK_N"], g["STREAM_K"]) for g in gluon) == [(128, False), (128, True), (256, False),
                                                                     (256, True)]
    assert all(dict(c).get("SPLIT_K", 1) == 1 for c in large)
    mid = at.matmul_candidates(128, torch.bfloat16, hopper_exact=False)
    assert not any(dict(c).get("GLUON") is True for c in mid)
    assert {dict(c).get("SPLIT_K") for c in mid[1:]} == {1, 2, 4}
    assert len(at.matmul_candidates(1, torch.float16, hopper_exact=False)) == 1 + 3 * 3
    assert all(dict(c).get("BLOCK_K") == 32 for c in at.matmul_candidates(64, torch.float32, True)[1:])


def test_off_by_default():
    assert not at.ENABLED or __import__("os").environ.get("TILEFUSE_AUTOTUNE")
    assert tilefuse.set_matmul_autotune is at.set_autotune


def test_tuned_choice_is_the_fastest_valid_and_cached(tuning):
    calls, ranking = tuning
    a, w = torch.randn(37, 45, dtype=torch.float16), torch.randn(29, 45, dtype=torch.float16)
    cands = at.matmul_candidates(37, torch.float16, False)
    ranking.update({c: 50.0 for c in cands})
    ranking[cands[3]] = 1.0                                 # the fastest
    out = matmul(a, w.t())
    assert rel_err(out, matmul_reference(a.double(), w.double().t())) <= 2e-3
    key = next(iter(at._CHOICES))
    assert at._CHOICES[key] == cands[3] and key[:3] == (37, 29, 45)
    timed = len(calls)
    assert timed == len(cands)
    again = matmul(a, w.t())                                # same problem: the choice, no timing
    assert len(calls) == timed and torch.equal(again, out)
    matmul(torch.randn(40, 45, dtype=torch.float16), w.t())     # another M: tuned on its own
    assert len(calls) == 2 * timed and len(at._CHOICES) == 2


def test_wrong_or_failing_candidates_are_dropped(tuning, monkeypatch):
    """A candidate whose output differs from the heuristic's is never chosen, however fast; one
    that raises is skipped."""
    calls, ranking = tuning
    cands = at.matmul_candidates(37, torch.float16, False)
    bad, broken = cands[1], cands[2]
    ranking.update({c: 50.0 for c in cands})
    ranking[bad] = ranking[broken] = 0.1
    real = mk.launch_matmul

    def launch(a, b, bias=None, residual=None, activation="none", out_dtype=None, save_preact=False, config=None,
               out=None):
        if config is not None and tuple(config.items()) == broken:
            raise ValueError("config the problem cannot take")
        res = real(a, b, bias, residual, activation, out_dtype, save_preact, config, out)
        if config is not None and tuple(config.items()) == bad:
            res[0].add_(1.0)                                 # a wrong answer
        return res
    monkeypatch.setattr(mk, "launch_matmul", launch)
    a, w = torch.randn(37, 45, dtype=torch.float16), torch.randn(29, 45, dtype=torch.float16)
    matmul(a, w.t())
    (choice,) = at._CHOICES.values()
    assert choice not in (bad, broken)


def test_epilogue_and_backward_problems_tuned_apart(tuning):
    """bias + gelu and the two backward GEMMs are problems of their own; every result stays right."""
    calls, ranking = tuning
    a = torch.randn(33, 40, dtype=torch.float32, requires_grad=True)
    w = torch.randn(24, 40, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(24, dtype=torch.float32, requires_grad=True)
    out = matmul(a, w.t(), bias, activation="gelu")
    out.backward(torch.ones_like(out))
    a64, w64, b64 = (t.detach().double().requires_grad_() for t in (a, w, bias))
    ref = matmul_reference(a64, w64.t(), b64, "gelu")
    ref.backward(torch.ones_like(ref))
    assert rel_err(out, ref) <= 1e-5
    for got, want in [(a.grad, a64.grad), (w.grad, w64.grad), (bias.grad, b64.grad)]:
        assert rel_err(got, want) <= 1e-5
    epilogues = {key[12] for key in at._CHOICES}
    assert (True, "gelu", False, True) in epilogues and (False, "none", False, False) in epilogues
    assert len(at._CHOICES) == 3                             # forward, da, dbᵀ


def test_non_finite_operands_do_not_tune(tuning):
    """A call whose output has an inf or NaN cannot tell candidates apart: the heuristic's config,
    nothing kept, and the next finite call tunes."""
    calls, _ = tuning
    w = torch.randn(29, 45, dtype=torch.float16)
    a = torch.randn(37, 45, dtype=torch.float16)
    a[3, 4] = float("nan")
    assert matmul(a, w.t())[3].isnan().all() and not at._CHOICES
    matmul(torch.randn(37, 45, dtype=torch.float16), w.t())
    assert len(at._CHOICES) == 1 and len(calls) == len(at.matmul_candidates(37, torch.float16, False))


def test_off_means_untimed(tuning, monkeypatch):
    calls, _ = tuning
    monkeypatch.setattr(at, "ENABLED", False)
    matmul(torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 8, dtype=torch.float16))
    assert not calls and not at._CHOICES


def test_cache_file_round_trip(tuning, tmp_path, monkeypatch):
    """Choices written to TILEFUSE_AUTOTUNE_CACHE are read back by a fresh process (here: a
    cleared table) without timing; an unreadable file means no choices, not an error."""
    calls, ranking = tuning
    path = tmp_path / "tune" / "matmul.json"
    monkeypatch.setattr(at, "CACHE_FILE", str(path))
    cands = at.matmul_candidates(37, torch.float16, False)
    ranking.update({c: 50.0 for c in cands})
    ranking[cands[-1]] = 1.0
    a, w = torch.randn(37, 45, dtype=torch.float16), torch.randn(29, 45, dtype=torch.float16)
    first = matmul(a, w.t())
    data = json.loads(path.read_text())
    assert data["version"] == at.CACHE_VERSION and len(next(iter(data["entries"].values()))) == 1
    at.clear()
    mk._matmul_plan.cache_clear()
    timed = len(calls)
    second = matmul(a, w.t())
    assert len(calls) == timed and torch.equal(first, second)
    assert next(iter(at._CHOICES.values())) == cands[-1]
    path.write_text("{not json")
    at.clear()
    matmul(a, w.t())                                        # tuned again, the file rewritten
    assert len(calls) == 2 * timed and json.loads(path.read_text())["version"] == at.CACHE_VERSION


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="times on the GPU")
@pytest.mark.parametrize("m,n,k", [(128, 4096, 4096), (1, 4096, 4096), (2048, 4096, 4096)])
def test_gpu_autotuned_matmul(m, n, k, monkeypatch):
    """On the GPU with the real timer: the autotuned forward and backward match fp64 and the
    heuristic's results; the choice is made once per problem."""
    monkeypatch.setattr(at, "ENABLED", True)
    monkeypatch.setattr(at, "CACHE_FILE", None)
    at.clear()
    mk._matmul_plan.cache_clear()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = matmul(x, w.t())
    out.backward(dy)
    chosen = dict(at._CHOICES)
    assert len(chosen) == 3
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    ref = matmul_reference(x64, w64.t())
    ref.backward(dy.double())
    assert rel_err(out, ref) <= 1e-2 and rel_err(x.grad, x64.grad) <= 1e-2 and rel_err(w.grad, w64.grad) <= 1e-2
    assert torch.equal(matmul(x.detach(), w.detach().t()), matmul(x.detach(), w.detach().t()))
    assert at._CHOICES == chosen
    at.clear()
    mk._matmul_plan.cache_clear()
