"""The large-M GEMM's tail split (``_matmul_gluon_plan.tail_split_rows``): a 128x256 launch whose last
wave is short gives its last row blocks to a second GEMM, where stream-K does not apply (here:
stream-K off). The rule on the CPU; on an sm_90 GPU
the split launch against the fp64 reference (NaN-poisoned outputs, a caller's ``out``, bias and
activation, a graph replay) and through the public op's forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA
from matmul_cases import _assert_graph_replays

from tilefuse.ops import _matmul_gluon_plan as gp
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops import _stream_k as sk
from tilefuse.ops.matmul import matmul, matmul_reference
from tilefuse.testing import rel_err

WIDE = dict(gp.LARGE_WS_TILES["128x256"])
PLAIN = (False, "none", False, False)


@pytest.fixture(autouse=True)
def _no_stream_k(monkeypatch):
    """The tail split is the last-wave fix of plans without stream-K (``_stream_k``, which takes
    precedence where it applies): these tests run with stream-K off."""
    monkeypatch.setattr(sk, "STREAM_K", False)
    mk._matmul_plan.cache_clear()
    gp._ws_plan.cache_clear()
    yield
    mk._matmul_plan.cache_clear()
    gp._ws_plan.cache_clear()


def _plan(m, n, k, epilogue=PLAIN, config=(), sms=132, a_strides=None):
    return mk._matmul_plan(m, n, k, torch.bfloat16, torch.bfloat16, a_strides or (k, 1), (1, k), (n, 1), True, sms,
                           True, True, epilogue, config, True)


def test_tail_split_rule():
    """132 SMs: 8192x14336x4096's 3584 tiles are 27.15 waves; its last row block (56 tiles) covers
    the 20 of the last wave and is 112 128-column tiles, one wave: split. The bench's other large
    shapes need several row blocks, more than a wave of them: no split; nor at short K, with a
    residual or a saved pre-activation, at full waves, or with TAIL_SPLIT off."""
    assert gp.tail_split_rows(8192, 14336, 4096, WIDE, PLAIN, 132) == 128
    assert gp.tail_split_rows(8192, 14336, 4096, WIDE, (True, "gelu", False, False), 132) == 128
    assert gp.tail_split_rows(8192 - 64, 14336, 4096, WIDE, PLAIN, 132) == 64     # a partial last row block
    for m, n, k in [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (8192, 4096, 14336),
                    (8192, 6144, 4096), (14336, 4096, 8192), (8192, 14336, 2048)]:
        assert gp.tail_split_rows(m, n, k, WIDE, PLAIN, 132) == 0, (m, n, k)
    for epilogue in [(False, "none", True, False), (False, "gelu", False, True)]:
        assert gp.tail_split_rows(8192, 14336, 4096, WIDE, epilogue, 132) == 0
    assert gp.tail_split_rows(8192, 14336, 4096, dict(gp.LARGE_WS_TILES["128x128"]), PLAIN, 132) == 0
    assert gp.tail_split_rows(128 * 33, 1024, 4096, WIDE, PLAIN, 132) == 0         # 33 x 4 tiles: one full wave
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gp, "TAIL_SPLIT", False)
        assert gp.tail_split_rows(8192, 14336, 4096, WIDE, PLAIN, 132) == 0


def test_tail_split_plan():
    """The plan carries the rows (and no launch of its own); a config, or another SM count that
    fills the last wave, keeps one launch; the split-off rows' own plan is a one-wave mid-M GEMM."""
    split = _plan(8192, 14336, 4096)
    assert split.tail_rows == 128 and split.ws_plan is None
    assert _plan(8192, 14336, 4096, epilogue=(True, "gelu", False, False)).tail_rows == 128
    forced = _plan(8192, 14336, 4096, config=(("GLUON", True),))
    assert forced.tail_rows == 0 and forced.ws_plan is not None
    assert _plan(8192, 14336, 4096, sms=128).tail_rows == 0                  # 3584 = 28 full waves of 128
    rest = _plan(128, 14336, 4096)
    assert rest.tail_rows == 0 and rest.ws_plan is not None and rest.ws_plan.grid[0] <= 132
    assert _plan(4096, 14336, 8192, a_strides=(1, 4096)).tail_rows == 0     # dW's M-major a: 1792 tiles, 76 in the tail


def _split_shape(k: int = 4096) -> tuple[int, int, int]:
    """A shape whose default plan splits on this GPU's SM count (8192x14336 on 132 SMs)."""
    sms = mk.num_sms(torch.empty(1, device="cuda"))
    for m in range(4096, 16385, 128):
        for n in (14336, 11008, 8192, 12288):
            if _plan(m, n, k, sms=sms).tail_rows:
                return m, n, k
    pytest.skip(f"no tail split among the shapes tried on {sms} SMs")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gluon kernel: sm_90 GPU")
@pytest.mark.parametrize("epilogue,b_layout", [("none", "w.t()"), ("bias-gelu", "w.t()"), ("bias-silu-out", "w.t()"),
                                               ("none", "row-major")])
def test_gpu_tail_split_launch(epilogue, b_layout):
    """The split launch writes every row (NaN-poisoned out) with the product's error of one
    launch: against fp64, and against the unsplit launch (TAIL_SPLIT off) within the dtype's
    rounding; a graph replays it bit for bit. b as a transposed weight (x @ w.t()) or row-major
    [K, N] (dy @ w, an input gradient)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma kernel: sm_90 only")
    m, n, k = _split_shape()
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = w.t() if b_layout == "w.t()" else w.t().contiguous()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if epilogue != "none" else None
    act = {"none": "none", "bias-gelu": "gelu", "bias-silu-out": "silu"}[epilogue]
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got, pre = mk.launch_matmul(a, b, bias, None, act, out=out if epilogue == "bias-silu-out" else None)
    assert pre is None and (got is out) == (epilogue == "bias-silu-out")
    ref = matmul_reference(a.double(), b.double(), None if bias is None else bias.double(), act)
    assert not got.isnan().any()
    assert rel_err(got, ref) <= 1e-2
    rows = m - mk._matmul_plan(m, n, k, a.dtype, a.dtype, a.stride(), b.stride(), (n, 1), True, mk.num_sms(a), True,
                               True, (bias is not None, act, False, False), (), True).tail_rows
    assert rows < m
    assert rel_err(got[rows:], ref[rows:]) <= 1e-2           # the second launch's rows alone
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gp, "TAIL_SPLIT", False)
        mk._matmul_plan.cache_clear()
        one, _ = mk.launch_matmul(a, b, bias, None, act)
    mk._matmul_plan.cache_clear()
    assert torch.equal(got[:rows], one[:rows])                # the first launch: same tile, same sums
    assert rel_err(got, one.double()) <= 1e-2
    target = torch.empty_like(got)
    _assert_graph_replays(lambda: mk.launch_matmul(a, b, bias, None, act, out=target)[0], got)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gluon kernel: sm_90 GPU")
def test_gpu_tail_split_fwd_bwd():
    """tilefuse.matmul at a splitting shape (x @ w.t() + bias, gelu), training: out, dx, dw and
    dbias against the fp64 reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma kernel: sm_90 only")
    m, n, k = _split_shape()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = matmul(x, w.t(), bias, activation="gelu")
    out.backward(dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, bias))
    ref = matmul_reference(x64, w64.t(), b64, "gelu")
    ref.backward(dy.double())
    assert rel_err(out, ref) <= 1e-2
    for got, want in [(x.grad, x64.grad), (w.grad, w64.grad), (bias.grad, b64.grad)]:
        assert rel_err(got, want) <= 1e-2
