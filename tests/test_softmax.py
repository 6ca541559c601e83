"""softmax / log_softmax beyond the registry sweep: extremes, dims, empties, bad input, tiers."""

import math

import pytest
import torch
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
import tilefuse.nn
from tilefuse.ops import softmax as sm
from tilefuse.testing import rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits_are_finite_and_exact(log, dtype):
    """Logits of +-1e4 (overflow exp without the max shift) give the fp64 answer, no inf/NaN."""
    n = 777
    x = torch.randn(4, n, device=DEVICE) * 3
    x[0, 5] = 1e4                  # one huge logit: exp(1e4) overflows without the max shift
    x[1] = -1e4
    x[1, 3] = 1e4                  # log_softmax reaches -2e4, still inside fp16's range
    x[2, ::7] = 1e4                # ties at the maximum
    x[3, ::3] = -1e4
    x = x.to(dtype)
    fn = tilefuse.log_softmax if log else tilefuse.softmax
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    y = fn(x)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= 1e-2 if dtype == torch.bfloat16 else rel_err(y, ref) <= 2e-3


@pytest.mark.parametrize("n", [5, 4097, sm.MAX_FUSED_N + 3])
def test_row_of_neg_inf_except_one(n, monkeypatch):
    """A row that is -inf except one entry: softmax is one-hot, log_softmax is 0 / -inf, as torch."""
    x = torch.full((3, n), -math.inf, device=DEVICE)
    hot = torch.tensor([0, n // 2, n - 1])
    x[torch.arange(3), hot] = torch.randn(3, device=DEVICE)
    x.requires_grad_(True)
    y = tilefuse.softmax(x)
    expect = torch.zeros(3, n, device=DEVICE)
    expect[torch.arange(3), hot] = 1.0
    assert torch.equal(y.detach(), expect)
    ly = tilefuse.log_softmax(x)
    assert torch.equal(ly.detach(), torch.log_softmax(x.detach(), -1))
    # gradient of softmax at a one-hot point is exactly zero: y*(dy - y.dy)
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.all(g.abs() < 1e-6)


@pytest.mark.parametrize("config", [{}, {"LANE_STATS": True, "PREFETCH": True, "REVERSE": True}],
                         ids=["tile-max", "lane-max-prefetch-reverse"])
def test_looped_neg_inf_prefix_and_lanes(config):
    """The looped forward's per-thread maxima: rows whose first tiles, and some lanes throughout,
    are all -inf (an -inf running max must not make NaN)."""
    x = torch.randn(3, 1000, device=DEVICE) * 3
    x[:, :300] = -math.inf
    x[:, 700::7] = -math.inf
    cfg = {"looped": True, "BLOCK_N": 128, "num_warps": 4, **config}
    for log in (False, True):
        ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
        y = sm._launch_fwd(x, log, cfg)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(y), finite) and rel_err(y[finite], ref[finite]) <= 1e-5


def test_long_row_default_config(monkeypatch):
    """The long-row defaults (per-thread maxima, prefetch, reversed second walks) through the public
    API, with LONG_ROW lowered so a short row takes them; fp32 takes half the bf16 tile's columns."""
    for cache in (sm._cached_config, sm._fwd_plan, sm._bwd_plan):
        cache.cache_clear()
    monkeypatch.setattr(sm, "LONG_ROW", 200)
    try:
        assert sm._launch_config(2, 40000, True, None, 4)["BLOCK_N"] == 16384
        x = (torch.randn(3, 40000, device=DEVICE) * 3).requires_grad_(True)
        ref_x = x.detach().double().requires_grad_(True)
        y, ref = tilefuse.softmax(x), torch.softmax(ref_x, -1)
        assert rel_err(y, ref) <= 1e-5
        dy = torch.randn_like(y)
        (g,), (rg,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(ref, ref_x, dy.double())
        assert rel_err(g, rg) <= 1e-5
    finally:
        for cache in (sm._cached_config, sm._fwd_plan, sm._bwd_plan):
            cache.cache_clear()


def test_all_neg_inf_row_matches_torch():
    x = torch.full((2, 9), -math.inf, device=DEVICE)
    assert torch.isnan(tilefuse.softmax(x)).all() and torch.isnan(torch.softmax(x, -1)).all()


@pytest.mark.parametrize("dim", [0, 1, -3])
def test_other_dims(dim):
    x = torch.randn(5, 6, 7, device=DEVICE, requires_grad=True)
    y = tilefuse.softmax(x, dim=dim)
    xr = x.detach().double().requires_grad_(True)
    r = torch.softmax(xr, dim)
    assert rel_err(y, r) <= 1e-5
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    (gr,) = torch.autograd.grad(r, xr, dy.double())
    assert rel_err(g, gr) <= 1e-5


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0,), (2, 0, 3)])
def test_empty(shape):
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    y = tilefuse.softmax(x)
    assert y.shape == x.shape
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert g.shape == x.shape


def test_scalar_and_single_element():
    x = torch.randn((), device=DEVICE)
    assert tilefuse.softmax(x).item() == 1.0
    assert tilefuse.log_softmax(torch.randn(3, 1, device=DEVICE)).abs().max().item() == 0.0


def test_non_contiguous_input():
    base = torch.randn(64, 40, device=DEVICE)
    x = base[::2, 3:37]                     # row stride 80, not contiguous
    assert not x.is_contiguous()
    assert rel_err(tilefuse.softmax(x), torch.softmax(x.double(), -1)) <= 1e-5
    xt = torch.randn(30, 20, device=DEVICE).t()  # column-major: last dim has stride 20
    assert rel_err(tilefuse.log_softmax(xt), torch.log_softmax(xt.double(), -1)) <= 1e-5


def test_bad_input():
    with pytest.raises(TypeError, match="x"):
        tilefuse.softmax([1.0, 2.0])
    with pytest.raises(TypeError, match="x has dtype int64"):
        tilefuse.softmax(torch.arange(4))
    with pytest.raises(TypeError, match="float64"):
        tilefuse.softmax(torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="dim 2 out of range"):
        tilefuse.softmax(torch.randn(4, 4), dim=2)
    for dim in ("a", None, 1.0, True):
        with pytest.raises(TypeError, match="dim must be an int"):
            tilefuse.softmax(torch.randn(4, 4), dim=dim)


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
@pytest.mark.parametrize("shape", [(5,), (2, 5), (2, 3, 5), (2, 3, 4, 5)])
def test_module_without_dim_is_torchs_implicit_dim(shape):
    """nn.Softmax() / nn.LogSoftmax() with dim=None pick torch's legacy implicit dim."""
    x = torch.randn(*shape, device=DEVICE)
    for ours, theirs in ((tilefuse.nn.Softmax(), torch.nn.Softmax()), (tilefuse.nn.LogSoftmax(), torch.nn.LogSoftmax())):
        assert rel_err(ours(x), theirs(x.double())) <= 1e-5


@pytest.mark.parametrize("n", [sm.FWD_MAX_FUSED_N, sm.FWD_MAX_FUSED_N + 1, sm.BWD_MAX_FUSED_N, sm.BWD_MAX_FUSED_N + 1])
def test_tier_boundary(n):
    """The last fused width and the first looped width agree with the reference (fwd + bwd)."""
    x = (torch.randn(2, n, device=DEVICE) * 3).requires_grad_(True)
    for fn, ref in ((tilefuse.softmax, torch.softmax), (tilefuse.log_softmax, torch.log_softmax)):
        y = fn(x)
        xr = x.detach().double().requires_grad_(True)
        r = ref(xr, -1)
        assert rel_err(y, r) <= 1e-5
        dy = torch.randn_like(y)
        assert rel_err(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(r, xr, dy.double())[0]) <= 1e-5


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 3000),
    log=st.booleans(),
    half=st.booleans(),
    scale=st.floats(0.1, 30.0),
)
def test_random_shapes(rows, cols, log, half, scale):
    dtype = torch.float16 if half else torch.float32
    x = (torch.randn(rows, cols, device=DEVICE) * scale).to(dtype)
    fn, ref = (tilefuse.log_softmax, torch.log_softmax) if log else (tilefuse.softmax, torch.softmax)
    assert rel_err(fn(x), ref(x.double(), -1)) <= (2e-3 if half else 1e-5)


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 8, "num_warps": 8},
    {"BLOCK_M": 1, "num_warps": 4},
    {"looped": True, "BLOCK_N": 64, "num_warps": 4},    # the looped tier on a short row, many tiles
    {"looped": True, "BLOCK_N": 64, "num_warps": 4, **sm.LOOPED_EVICT},   # with the L2 hints
    {"looped": True, "BLOCK_N": 64, "num_warps": 4, **sm.LOOPED_EVICT, "LANE_STATS": True, "PREFETCH": True,
     "REVERSE": True},
    {"looped": True, "BLOCK_N": 128, "num_warps": 4, "LANE_STATS": True, "PREFETCH": False, "REVERSE": True},
    {"looped": True, "BLOCK_N": 128, "num_warps": 4, "PREFETCH": True, "REVERSE": True},   # the backward prefetching
])
def test_launch_configs_agree(config):
    """Every launch configuration a sweep may pick computes the same function (fwd and bwd)."""
    x = torch.randn(37, 300, device=DEVICE) * 3
    for log in (False, True):
        ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
        y = sm._launch_fwd(x, log, config)
        assert rel_err(y, ref) <= 1e-5
        dy = torch.randn_like(x)
        dx_ref = sm._softmax_bwd_reference(ref, dy.double(), log)
        assert rel_err(sm._launch_bwd(y, dy, log, config), dx_ref) <= 1e-5


def test_nn_softmax_module():
    m = tilefuse.nn.Softmax(dim=1)
    assert m.state_dict() == {} and "dim=1" in repr(m)
    x = torch.randn(3, 4, 5, device=DEVICE)
    assert rel_err(m(x), torch.nn.Softmax(dim=1)(x.double())) <= 1e-5
    assert rel_err(tilefuse.nn.LogSoftmax(dim=-1)(x), torch.log_softmax(x.double(), -1)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.bigmem
def test_large_row_count_int64_offsets():
    """rows * row_stride passes 2**31 elements: offsets must be 64-bit (4 GiB of fp16 input)."""
    n_cols = 4096
    n_rows = (2**31) // n_cols + 64
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.float16)
    y = tilefuse.softmax(x)
    tail = slice(n_rows - 64, n_rows)
    assert rel_err(y[tail], torch.softmax(x[tail].double(), -1)) <= 2e-3
    del x, y
