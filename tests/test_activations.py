"""bias_act beyond the registry sweep: every activation, residual, dropout (statistics, p = 0 and
p = 1 exactly, seeds, the mask across launch configs and between forward and backward),
empties, layouts, bad input, and the FusedBiasActDropout module."""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA, record_returns
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.nn.activations import FusedBiasActDropout
from tilefuse.ops import activations as ba   # registers bias_act (until ops/__init__ imports it)
from tilefuse.ops._activation_math import ACTIVATIONS
from tilefuse.ops._dropout import dropout_keep, dropout_keep_reference, dropout_threshold
from tilefuse.ops.activations import bias_act, bias_act_reference
from tilefuse.testing import rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(shape, dtype, bias=True, residual=False):
    x = (torch.randn(shape, device=DEVICE) * 2).to(dtype).requires_grad_(True)
    b = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_(True) if bias else None
    r = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_(True) if residual else None
    return x, b, r


def _check_vs_reference(shape, dtype, activation, bias, residual, p, seed=1234):
    """Forward and every gradient vs the fp64 reference, which reproduces the dropout mask."""
    x, b, r = _inputs(shape, dtype, bias, residual)
    leaves = [t for t in (x, b, r) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    rx, rb, rr = (ref_leaves.pop(0) if t is not None else None for t in (x, b, r))
    y = bias_act(x, b, activation, p, r, seed=seed)
    y_ref = bias_act_reference(rx, rb, activation, p, rr, seed=seed)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, y_ref) <= TOL[dtype], (activation, p)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_grads = torch.autograd.grad(y_ref, [t for t in (rx, rb, rr) if t is not None], dy.double())
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert rel_err(g, rg) <= TOL[dtype], (activation, p, i)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_activation_with_bias_residual_dropout(activation, dtype):
    _check_vs_reference((6, 37), dtype, activation, bias=True, residual=True, p=0.0)
    _check_vs_reference((2, 3, 70), dtype, activation, bias=True, residual=False, p=0.25)
    _check_vs_reference((5, 9), dtype, activation, bias=False, residual=True, p=0.5)
    _check_vs_reference((45,), dtype, activation, bias=True, residual=False, p=0.1)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), bias=st.booleans(), residual=st.booleans(),
       activation=st.sampled_from(ACTIVATIONS), p=st.sampled_from([0.0, 0.1, 0.9]))
def test_random_shapes_and_options(rows, cols, bias, residual, activation, p):
    _check_vs_reference((rows, cols), torch.float32, activation, bias, residual, p, seed=rows * 1000 + cols)


@pytest.mark.parametrize("approximate,activation", [("none", "gelu"), ("tanh", "gelu_tanh")])
def test_gelu_matches_torch_gelu(approximate, activation):
    x = (torch.randn(4, 513, device=DEVICE) * 4).requires_grad_(True)
    x.data[0, :5] = torch.tensor([-30.0, -8.0, 0.0, 8.0, 30.0])   # tails and the kink
    y = bias_act(x, activation=activation)
    expect = F.gelu(x.detach().double(), approximate=approximate)
    assert rel_err(y, expect) <= 1e-6
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    xd = x.detach().double().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(F.gelu(xd, approximate=approximate).sum(), xd)
    assert rel_err(g, g_ref) <= 1e-6


def test_gelu_16bit_fit_within_rounding_elementwise():
    """fp16 / bf16 outputs evaluate Φ with the short (degree-5) erf fit. Its own error (3.7e-5
    relative) must stay far below the output's rounding: every element of gelu(z) and gelu'(z)
    over z in [-12, 12] within 1.1 half-ulps of the fp64 value (a 1e-5 floor where gelu'
    crosses 0 near z = -0.75, where Φ + zφ cancels)."""
    dtypes = (torch.float16,) + ((torch.bfloat16,) if HAS_CUDA else ())
    for dtype in dtypes:
        half_ulp = 2.0 ** -(11 if dtype == torch.float16 else 8)
        z = torch.linspace(-12, 12, 4099, device=DEVICE).to(dtype).requires_grad_(True)
        y = bias_act(z, activation="gelu")
        (dz,) = torch.autograd.grad(y, z, torch.ones_like(y))
        zd = z.detach().double()
        y_ref = ba.activation_reference(zd, "gelu")
        dz_ref = ba.activation_grad_reference(zd, "gelu")
        bound = 1.1 * half_ulp
        assert ((y.double() - y_ref).abs() <= bound * y_ref.abs() + 2.0 ** -24).all(), dtype
        assert ((dz.double() - dz_ref).abs() <= bound * dz_ref.abs() + 1e-5).all(), dtype


def test_silu_relu_match_torch():
    x = torch.randn(3, 100, device=DEVICE) * 3
    assert rel_err(bias_act(x, activation="silu"), F.silu(x.double())) <= 1e-6
    assert torch.equal(bias_act(x, activation="relu"), torch.relu(x))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_nan_stays_nan(activation):
    """NaN in, NaN out, as torch's activations (relu was Triton's default maximum, maxnum on
    the GPU: relu(NaN) = 0 hid a divergence); here and in the GEMM epilogue. The interpreter's
    maximum propagates NaN either way: the GPU run is the real check."""
    from tilefuse import matmul

    x = torch.randn(2, 70, device=DEVICE)
    x[1, 5] = float("nan")
    y = bias_act(x, torch.randn(70, device=DEVICE), activation=activation)
    assert torch.isnan(y[1, 5]) and torch.isfinite(y[0]).all()
    a = torch.randn(3, 16, device=DEVICE)
    a[1, 2] = float("nan")
    out = matmul(a, torch.randn(16, 20, device=DEVICE), activation=None if activation == "none" else activation)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


# ----------------------------------------------------------------------------------------------
# dropout
# ----------------------------------------------------------------------------------------------


def test_dropout_keep_rate_and_scale_statistics():
    """1e6 elements: the kept fraction is within 4 sigma of 1 - p and kept values are x / (1 - p)."""
    p, n = 0.3, 1 << 20
    x = torch.rand(1024, 1024, device=DEVICE) + 0.5          # never 0: y == 0 means dropped
    y = ba._launch_fwd(x, None, None, "none", p, seed=2024, config={"BLOCK_M": 64, "BLOCK_N": 1024})
    kept = y != 0
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept.double().mean().item() - (1 - p)) <= 4 * sigma
    assert torch.allclose(y[kept], x[kept] / (1 - p), rtol=1e-6, atol=0)
    # the mask is not a pattern: neighbouring columns and rows are independent (Philox lanes mix)
    k = kept.double()
    for a, b in ((k[:, :-1], k[:, 1:]), (k[:-1], k[1:]), (k[:, 0::4], k[:, 1::4])):
        corr = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
        assert abs(corr.item()) <= 4 / math.sqrt(a.numel())


def test_dropout_p0_is_exact_identity_and_eval_mode_has_no_dropout():
    x, b, r = _inputs((7, 45), torch.float32, residual=True)
    plain = bias_act(x, b, "silu", 0.0, r)
    assert torch.equal(bias_act(x, b, "silu", 0.0, r, seed=3), plain)
    assert torch.equal(bias_act(x, b, "silu", 0.7, r, training=False), plain)
    assert torch.equal(bias_act(x, activation="none"), x)


@pytest.mark.parametrize("with_residual", [False, True])
def test_dropout_p1_drops_everything_without_nan(with_residual):
    x, b, r = _inputs((5, 33), torch.float32, residual=with_residual)
    x.data[0, :3] = torch.tensor([math.inf, -math.inf, 1e38])      # 1/(1 - p) must not meet these
    y = bias_act(x, b, "gelu", 1.0, r, seed=9)
    assert torch.equal(y, r.detach() if with_residual else torch.zeros_like(y))
    leaves = [t for t in (x, b, r) if t is not None]
    grads = torch.autograd.grad(y, leaves, torch.randn_like(y))
    assert torch.equal(grads[0], torch.zeros_like(x)) and torch.equal(grads[1], torch.zeros_like(b))


def test_same_seed_same_mask_on_any_launch_config():
    """The mask keys on (seed, row, col): tile shape, warps and the RNG implementation don't matter,
    and it is bit-identical to the PyTorch mirror of the mask."""
    shape, p, seed = (21, 75), 0.4, 77
    x = torch.rand(shape, device=DEVICE) + 0.5
    configs = [None, {"BLOCK_M": 8, "BLOCK_N": 4, "num_warps": 1}, {"BLOCK_M": 16, "BLOCK_N": 32},
               {"BLOCK_M": 2, "BLOCK_N": 128, "RNG_GROUPED": False},
               {"BLOCK_M": 32, "BLOCK_N": 16, "RNG_GROUPED": False}]
    outs = [ba._launch_fwd(x, None, None, "none", p, seed, config=c) for c in configs]
    for y in outs[1:]:
        assert torch.equal(y, outs[0])
    assert torch.equal(outs[0] != 0, dropout_keep_reference(seed, *shape, p, device=DEVICE))
    # backward on different configs regenerates the same mask too
    dy = torch.randn(shape, device=DEVICE)
    dxs = [ba._launch_bwd(dy, None, None, "none", p, seed, True, False, shape[-1], config=c)[0] for c in configs]
    for dx in dxs:
        assert torch.equal(dx, dxs[0])
        assert torch.equal(dx != 0, outs[0] != 0)


@triton.jit
def _keep_tile_kernel(out_ptr, seed, threshold, first_row, n_cols,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPED: tl.constexpr):
    rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
    keep = dropout_keep(seed, rows, 0, threshold, BLOCK_N, GROUPED)
    offs = tl.arange(0, BLOCK_M)[:, None] * n_cols + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_ptr + offs, keep.to(tl.int8))


@pytest.mark.parametrize("grouped", [True, False])
def test_mask_of_rows_past_2_pow_32(grouped):
    """Row indices past 2**32 (numel past 2**31 at any width) key Philox with their high word."""
    first_row, p, seed = 2**32 - 3, 0.5, 99
    out = torch.empty(8, 16, dtype=torch.int8, device=DEVICE)
    _keep_tile_kernel[(1,)](out, seed, dropout_threshold(p), first_row, 16, BLOCK_M=8, BLOCK_N=16, GROUPED=grouped)
    expect = dropout_keep_reference(seed, 8, 16, p, device=DEVICE, first_row=first_row)
    assert torch.equal(out.bool(), expect)
    assert not torch.equal(expect[4:], dropout_keep_reference(seed, 4, 16, p, device=DEVICE, first_row=1))


def test_backward_mask_is_the_forward_mask():
    x, b, _ = _inputs((19, 130), torch.float32)
    x.data.abs_().add_(1.0)
    b.data.abs_()                                  # z = x + b > 1: relu'(z) = 1, y = 0 iff dropped
    y = bias_act(x, b, "relu", 0.5, seed=123)
    dy = torch.randn_like(y)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    dropped = y == 0
    assert 0.4 < dropped.float().mean().item() < 0.6
    assert torch.equal(dx == 0, dropped)
    assert torch.allclose(dx, torch.where(dropped, 0.0, dy * 2.0))
    assert torch.allclose(db, dx.sum(0), rtol=1e-5, atol=1e-5)


def test_seeds():
    x = torch.rand(8, 64, device=DEVICE) + 0.5
    a, b2 = bias_act(x, dropout_p=0.5, seed=1), bias_act(x, dropout_p=0.5, seed=2)
    assert torch.equal(a, bias_act(x, dropout_p=0.5, seed=1)) and not torch.equal(a, b2)
    torch.manual_seed(5)
    c = bias_act(x, dropout_p=0.5)
    torch.manual_seed(5)
    assert torch.equal(c, bias_act(x, dropout_p=0.5))                    # seed=None follows torch's RNG
    assert not torch.equal(c, bias_act(x, dropout_p=0.5))
    big = bias_act(x, dropout_p=0.5, seed=2**63 - 1)
    assert torch.equal(big != 0, dropout_keep_reference(2**63 - 1, 8, 64, 0.5, device=DEVICE))


def test_seeds_alternating_through_one_launch_plan():
    """The launch plan is cached per shape and p, the seed is keyed per call: seeds that Triton
    specializes differently (== 1, multiples of 16, the i64 range) alternate through one plan, and
    each forward and backward mask must be that seed's own."""
    shape, p = (6, 40), 0.5
    x = torch.rand(shape, device=DEVICE) + 0.5
    dy = torch.rand(shape, device=DEVICE) + 0.5
    for _ in range(2):                                  # second round: every launch a cache hit
        for seed in (1, 16, 17, 2**31 + 5, 2**62, 0):
            keep = dropout_keep_reference(seed, *shape, p, device=DEVICE)
            assert torch.equal(ba._launch_fwd(x, None, None, "none", p, seed) != 0, keep), seed
            dx, _ = ba._launch_bwd(dy, None, None, "none", p, seed, True, False, shape[-1])
            assert torch.equal(dx != 0, keep), seed


def test_cpu_reference_path_draws_the_same_mask(monkeypatch):
    """Without the interpreter, CPU tensors take the PyTorch path: same mask, bit for bit."""
    x, b, r = _inputs((9, 50), torch.float32, residual=True)
    y_kernel = bias_act(x, b, "gelu_tanh", 0.3, r, seed=42)
    g_kernel = torch.autograd.grad(y_kernel, (x, b, r), torch.ones_like(y_kernel))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    xc, bc, rc = (t.detach().cpu().requires_grad_(True) for t in (x, b, r))
    y_cpu = bias_act(xc, bc, "gelu_tanh", 0.3, rc, seed=42)
    g_cpu = torch.autograd.grad(y_cpu, (xc, bc, rc), torch.ones_like(y_cpu))
    assert rel_err(y_cpu, y_kernel) <= 1e-6
    x_pos = torch.rand(9, 50, device=DEVICE) + 0.5                     # act(x) != 0: 0 means dropped
    mask_kernel = bias_act(x_pos, activation="silu", dropout_p=0.3, seed=42) == 0
    assert torch.equal(bias_act(x_pos.cpu(), activation="silu", dropout_p=0.3, seed=42) == 0, mask_kernel.cpu())
    for g, gc in zip(g_kernel, g_cpu):
        assert rel_err(gc, g) <= 1e-6


# ----------------------------------------------------------------------------------------------
# shapes, layouts, the reduction, empties, bad input
# ----------------------------------------------------------------------------------------------


def test_dbias_partials_over_many_row_chunks():
    """Backward with several tiles per program and several programs per column block."""
    x, b, _ = _inputs((203, 70), torch.float32)
    dy = torch.randn(203, 70, device=DEVICE)
    xd = x.detach().double().requires_grad_(True)
    bd = b.detach().double().requires_grad_(True)
    dx_ref, db_ref = torch.autograd.grad(bias_act_reference(xd, bd, "silu"), (xd, bd), dy.double())
    for cfg in ({"BLOCK_M": 8, "BLOCK_N": 32, "REDUCE_PROGRAMS": 6},
                {"BLOCK_M": 2, "BLOCK_N": 128, "REDUCE_PROGRAMS": 1}):
        dx, db = ba._launch_bwd(dy, x.detach(), b.detach(), "silu", 0.0, 0, True, True, 70, config=cfg)
        assert rel_err(dx, dx_ref) <= 1e-5 and rel_err(db, db_ref) <= 1e-5


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(37, 300), pytest.param((3000, 4096), marks=pytest.mark.gpu),
                                   pytest.param((777, 1000), marks=pytest.mark.gpu)])
def test_backward_final_sum_in_kernel(shape, p, monkeypatch):
    """dbias summed inside the backward kernel behind a grid barrier (one launch: on the GPU by
    default, under the interpreter with one program) agrees with the two-launch path and the fp64
    reference, with and without dropout; calls in a row and one on another stream start with the
    barrier's counters at zero and leave them there."""
    import contextlib

    from tilefuse._dispatch import _GRID_SYNC

    launched = record_returns(monkeypatch, ba, "cooperative_launch")
    n = shape[-1]
    x, b = torch.randn(*shape, device=DEVICE), torch.randn(n, device=DEVICE)
    dy = torch.randn_like(x)
    one_program = {} if DEVICE == "cuda" else {"REDUCE_PROGRAMS": 1, "BLOCK_N": 512}
    want = ba._bias_act_bwd_reference(dy.double(), x.double(), b.double(), "gelu", p, 1234)
    two = ba._launch_bwd(dy, x, b, "gelu", p, 1234, True, True, n, config={**one_program, "final_sum": False})
    assert not launched
    streams = [None, None, torch.cuda.Stream() if DEVICE == "cuda" else None]
    for stream in streams:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            got = ba._launch_bwd(dy, x, b, "gelu", p, 1234, True, True, n, config={**one_program, "final_sum": True})
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(got[0], two[0])
        for g, t, r in zip(got, two, want):
            assert rel_err(g, r) <= 1e-5 and rel_err(g, t) <= 1e-6
    assert len(launched) == 3 and all(s is not None for s in launched), "the one-launch path did not run"
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in _GRID_SYNC.values())


def test_backward_takes_two_launches_beside_collectives(monkeypatch):
    """With torch.distributed initialized a collective may hold SMs on another stream, and the
    one-launch backward (a cooperative grid over every SM) would wait for it: the two launches
    run instead, with the same answers."""
    launched = record_returns(monkeypatch, ba, "cooperative_launch")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    x, b = torch.randn(37, 300, device=DEVICE), torch.randn(300, device=DEVICE)
    dy = torch.randn_like(x)
    one_program = {} if DEVICE == "cuda" else {"REDUCE_PROGRAMS": 1, "BLOCK_N": 512}
    got = ba._launch_bwd(dy, x, b, "gelu", 0.0, 0, True, True, 300, config={**one_program, "final_sum": True})
    want = ba._bias_act_bwd_reference(dy.double(), x.double(), b.double(), "gelu", 0.0, 0)
    assert launched == [None] and all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want))


def test_strided_inputs():
    base = torch.randn(40, 30, device=DEVICE) * 2
    x = base.t().requires_grad_(True)                      # [30, 40], column stride 30
    b = torch.randn(80, device=DEVICE)[::2].requires_grad_(True)   # stride-2 bias
    r = torch.randn(30, 80, device=DEVICE)[:, :40]         # row stride 80
    y = bias_act(x, b, "gelu", residual=r)
    assert rel_err(y, F.gelu(x.double() + b.double()) + r.double()) <= 1e-6
    dx, db = torch.autograd.grad(y, (x, b), torch.ones_like(y))
    xd = x.detach().double().requires_grad_(True)
    (g,) = torch.autograd.grad(F.gelu(xd + b.double()).sum(), xd)
    assert rel_err(dx, g) <= 1e-6 and rel_err(db, g.sum(0)) <= 1e-6


def test_only_bias_needs_grad_and_only_residual_needs_grad():
    x = torch.randn(6, 20, device=DEVICE)
    b = torch.randn(20, device=DEVICE, requires_grad=True)
    r = torch.randn(6, 20, device=DEVICE, requires_grad=True)
    y = bias_act(x, b, "silu", 0.2, r, seed=8)
    dy = torch.randn_like(y)
    db, dr = torch.autograd.grad(y, (b, r), dy)
    bd = b.detach().double().requires_grad_(True)
    (db_ref,) = torch.autograd.grad(bias_act_reference(x.double(), bd, "silu", 0.2, seed=8), bd, dy.double())
    assert rel_err(db, db_ref) <= 1e-5 and torch.equal(dr, dy)


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (2, 0, 5)])
@pytest.mark.parametrize("p", [0.0, 0.5])
def test_empty(shape, p):
    x, b, r = _inputs(shape, torch.float32, residual=True)
    y = bias_act(x, b, "gelu", p, r, seed=1)
    assert y.shape == x.shape
    dx, db, dr = torch.autograd.grad(y, (x, b, r), torch.randn_like(y), allow_unused=True)
    assert dx.shape == x.shape and dr.shape == r.shape
    assert torch.equal(db, torch.zeros_like(b))


@pytest.mark.parametrize("call,exc,match", [
    (lambda x, b: bias_act(x.tolist(), b), TypeError, "x must be a torch.Tensor"),
    (lambda x, b: bias_act(x.long(), None), TypeError, "x has dtype int64"),
    (lambda x, b: bias_act(x[0, 0], None), ValueError, "x must have at least 1"),
    (lambda x, b: bias_act(x, b[:-1]), ValueError, "bias has shape"),
    (lambda x, b: bias_act(x, b.long()), TypeError, "bias has dtype"),
    (lambda x, b: bias_act(x, b, residual=x[:1]), ValueError, "residual has shape"),
    (lambda x, b: bias_act(x, b, residual=x.half()), TypeError, "residual has dtype"),
    (lambda x, b: bias_act(x, b, activation="tanh"), ValueError, "activation must be one of"),
    (lambda x, b: bias_act(x, b, dropout_p=1.5), ValueError, "dropout_p must be in"),
    (lambda x, b: bias_act(x, b, dropout_p=True), TypeError, "dropout_p must be a float"),
    (lambda x, b: bias_act(x, b, dropout_p=0.1, seed=-1), ValueError, "seed must be in"),
    (lambda x, b: bias_act(x, b, dropout_p=0.1, seed=1.5), TypeError, "seed must be an int"),
    (lambda x, b: bias_act(x, b, training=1), TypeError, "training must be a bool"),
])
def test_bad_input(call, exc, match):
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(exc, match=match):
        call(x, torch.randn(8, device=DEVICE))


def test_compile_fullgraph_with_dropout():
    fn = torch.compile(lambda x, b: bias_act(x, b, "gelu", 0.3, seed=11), fullgraph=True, backend="aot_eager")
    x, b, _ = _inputs((4, 24), torch.float32)
    y = fn(x, b)
    assert torch.equal(y, bias_act(x, b, "gelu", 0.3, seed=11))
    g = torch.autograd.grad(y, (x, b), torch.ones_like(y))
    g_eager = torch.autograd.grad(bias_act(x, b, "gelu", 0.3, seed=11), (x, b), torch.ones_like(y))
    assert all(torch.equal(a, e) for a, e in zip(g, g_eager))


# ----------------------------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------------------------


def test_fused_bias_act_dropout_module():
    m = FusedBiasActDropout(48, activation="gelu", p=0.5).to(DEVICE)
    assert list(m.state_dict()) == ["bias"] and m.bias.shape == (48,)
    with torch.no_grad():
        m.bias.normal_()
    x = torch.rand(5, 48, device=DEVICE) + 0.5
    m.eval()
    assert torch.equal(m(x), bias_act(x, m.bias, "gelu"))
    m.train()
    y = m(x, seed=4)
    assert torch.equal(y, bias_act(x, m.bias, "gelu", 0.5, seed=4))
    y.sum().backward()
    assert m.bias.grad is not None and m.bias.grad.shape == (48,)
    no_bias = FusedBiasActDropout(48, activation="silu", bias=False)
    assert no_bias.bias is None and not list(no_bias.state_dict())
    r = torch.randn_like(x)
    assert torch.equal(no_bias.eval()(x, residual=r), bias_act(x, None, "silu", residual=r))
    with pytest.raises(ValueError, match="activation"):
        FusedBiasActDropout(8, activation="elu")
    with pytest.raises(ValueError, match="p must be"):
        FusedBiasActDropout(8, p=2.0)
