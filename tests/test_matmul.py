"""tilefuse.matmul: every epilogue combination forward and backward vs the fp64 reference, layouts
(transposed / strided operands), both load paths (pointers, TMA descriptors), launch configs and
the heuristic, empties, bad input, out_dtype, torch.compile, nn.Linear, and the registry shapes."""

import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA, count_calls
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tilefuse.nn.linear import Linear
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops import matmul as mm     # registers "matmul" (until ops/__init__ imports the module)
from tilefuse.ops.matmul import matmul, matmul_reference
from tilefuse.registry import get
from tilefuse.testing import check_impl, rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]


def _rand(shape, dtype, scale=1.0, grad=True):
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype).requires_grad_(grad)


def _weight_t(n, k, dtype):
    """b = w.t() of an [N, K] weight: unit K stride, as nn.Linear passes it (a leaf view)."""
    return torch.randn(n, k, device=DEVICE).to(dtype).t().detach().requires_grad_(True)


def _torch_eager(a, b, bias, act, residual, out_dtype):
    """The same computation in PyTorch, in the operands' dtype (the flash-attn rule's baseline)."""
    return mm._torch_matmul(a, b, bias, act, residual, out_dtype)


def _check(a, b, bias=None, act=None, residual=None, out_dtype=None, fn=matmul):
    """fn's output and the gradients of every grad-requiring input vs the fp64 reference, each
    within max(TOL, 2 x PyTorch's own error in that dtype on the same inputs)."""
    args = (a, b, bias, act, residual, out_dtype)
    leaves = [t for t in (a, b, bias, residual) if t is not None and t.requires_grad]
    wide = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in args]
    y = fn(*args)
    assert y.dtype == (out_dtype or a.dtype) and y.shape == (*a.shape[:-1], b.shape[1])
    y_ref = matmul_reference(*wide[:5], torch.float64)
    dy = torch.randn(y.shape, device=DEVICE).to(y.dtype)
    grads = torch.autograd.grad(y, leaves, dy) if leaves else ()
    wide_leaves = [w for w, t in zip(wide[:2] + wide[2:3] + wide[4:5], (a, b, bias, residual))
                   if t is not None and t.requires_grad]
    ref_grads = torch.autograd.grad(y_ref, wide_leaves, dy.double()) if leaves else ()
    # flash-attn's rule per tensor: max(TOL, 2 x PyTorch's own error on the same inputs in the same
    # dtype). fp32 too: a gradient that is a short sum with cancellation is ill-conditioned in fp32
    # itself (on the GPU: a grad 1.16e-5 off at M = 29, N = 1, K = 2, gelu_tanh, with a bias)
    base = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in args]
    y_t = _torch_eager(*base)
    base_leaves = [t for t in (base[0], base[1], base[2], base[4]) if t is not None and t.requires_grad]
    t_grads = torch.autograd.grad(y_t, base_leaves, dy.to(y_t.dtype)) if leaves else ()
    tol = max(TOL[a.dtype], 2 * rel_err(y_t, y_ref))
    assert rel_err(y, y_ref) <= tol, f"forward {rel_err(y, y_ref):.3g} > {tol:.3g}"
    for g, r, t_g, leaf in zip(grads, ref_grads, t_grads, leaves):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype
        tol = max(TOL[a.dtype], 2 * rel_err(t_g, r))
        assert rel_err(g, r) <= tol, f"grad of a {tuple(leaf.shape)} input: {rel_err(g, r):.3g} > {tol:.3g}"
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("has_residual", [False, True])
def test_epilogues(dtype, act, has_bias, has_residual):
    a = _rand((2, 9, 24), dtype)
    b = _weight_t(40, 24, dtype) if has_bias else _rand((24, 40), dtype)   # both layouts
    bias = _rand(40, dtype) if has_bias else None
    residual = _rand((2, 9, 40), dtype) if has_residual else None
    _check(a, b, bias, act, residual)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_layouts(dtype):
    """Transposed a, transposed / column-sliced / row-strided b, a strided 3-D a, M = 1, K = 8."""
    _check(_rand((30, 20), dtype).t().detach().requires_grad_(True), _rand((30, 17), dtype), act="silu")
    _check(_rand((20, 30), dtype), _rand((30, 50), dtype)[:, 3:40:2].detach().requires_grad_(True))
    _check(_rand((20, 30), dtype), _rand((60, 13), dtype)[::2].detach().requires_grad_(True), act="relu")
    big = _rand((3, 7, 50), dtype, grad=False)
    _check(big.transpose(0, 1)[..., 5:29].requires_grad_(True), _weight_t(11, 24, dtype), _rand(11, dtype))
    _check(_rand((1, 8), dtype), _weight_t(33, 8, dtype), _rand(33, dtype), "gelu_tanh")
    # a strided bias (every other element of a longer vector)
    _check(_rand((9, 8), dtype), _weight_t(12, 8, dtype), _rand(24, dtype)[::2].detach().requires_grad_(True))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("transposed_b", [False, True])
@pytest.mark.parametrize("transposed_a", [False, True])
def test_tma_and_pointer_paths(dtype, transposed_a, transposed_b):
    """Descriptor loads (zero fill past the edges) and pointer loads (clamped rows, masked K
    tail) give the reference on the same odd-M/N, K-tail shape."""
    m, n, k = 37, 40, 72          # 16-byte strides for descriptors; K tail for BLOCK_K 32 and 64
    m = 40 if transposed_a else m   # a = xᵀ: x [K, M] rows of M elements must be 16-byte aligned
    a = torch.randn(k, m, device=DEVICE).to(dtype).t() if transposed_a else torch.randn(m, k, device=DEVICE).to(dtype)
    b = torch.randn(n, k, device=DEVICE).to(dtype).t() if transposed_b else torch.randn(k, n, device=DEVICE).to(dtype)
    bias, res = torch.randn(n, device=DEVICE).to(dtype), torch.randn(m, n, device=DEVICE).to(dtype)
    assert mk.tma_layout(a, b) == (True, transposed_a, transposed_b)
    ref = matmul_reference(a.double(), b.double(), bias.double(), "gelu", res.double())
    for cfg in ({"USE_TMA": True}, {"USE_TMA": False}, {"USE_TMA": True, "BLOCK_K": 64, "BLOCK_M": 16},
                {"USE_TMA": True, "STORE_TMA": True, "STORE_SPLIT": 2},
                {"USE_TMA": True, "STORE_TMA": True, "STORE_SPLIT": 1, "FLATTEN": True, "BLOCK_M": 16}):
        out, pre = mk.launch_matmul(a, b, bias, res, "gelu", save_preact=True, config=cfg)
        assert rel_err(out, ref) <= TOL[dtype], cfg
        assert rel_err(pre, a.double() @ b.double() + bias.double()) <= TOL[dtype], cfg


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=1),     # many tiles per program
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, GROUP_M=3),                  # EVEN_K (K = 48)
    dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, FLATTEN=True),
    dict(mk.CONFIGS["small_m16"]), dict(mk.CONFIGS["tile_64x64"]), dict(mk.CONFIGS["mid_64x64"], num_stages=1),   # (fp32 operands: 3 stages overflow shared memory)
])
def test_launch_configs(cfg):
    a, b = torch.randn(45, 48, device=DEVICE), torch.randn(48, 70, device=DEVICE)
    bias = torch.randn(70, device=DEVICE)
    out, _ = mk.launch_matmul(a, b, bias, None, "relu", config=cfg)
    assert rel_err(out, matmul_reference(a.double(), b.double(), bias.double(), "relu")) <= 1e-5


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("cfg", [
    dict(SPLIT_K=3, BLOCK_K=16),                                    # K tail in the last slice
    dict(SPLIT_K=4, BLOCK_K=16, USE_TMA=False),                     # pointer loads from a slice's offset
    dict(SPLIT_K=8, BLOCK_K=64),                                    # more slices than K steps: empty slices
    dict(SPLIT_K=2, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=1),   # many tiles per program
    dict(SPLIT_K=2, BLOCK_K=32, STORE_TMA=True, STORE_SPLIT=2, FLATTEN=True),      # (flatten is dropped)
], ids=str)
def test_split_k(dtype, cfg):
    """Split-K: every epilogue on the summed tile, bit-identical on repeated launches (the last
    slice sums the partials in slice order), and the arrival counters left at zero."""
    m, n, k = 37, 40, 200
    a, w = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(n, k, device=DEVICE).to(dtype)
    bias, res = torch.randn(n, device=DEVICE).to(dtype), torch.randn(m, n, device=DEVICE).to(dtype)
    ref = matmul_reference(a.double(), w.double().t(), bias.double(), "gelu", res.double())
    out, pre = mk.launch_matmul(a, w.t(), bias, res, "gelu", save_preact=True, config=cfg)
    assert rel_err(out, ref) <= TOL[dtype]
    assert rel_err(pre, a.double() @ w.double().t() + bias.double()) <= TOL[dtype]
    assert torch.equal(out, mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0])
    assert not mk.split_k_buffers(a.device, 64, 0)[0].any()


def test_split_k_choice_and_bad_value():
    h100 = 132
    assert mk.split_k_slices(tiles=32, k_tiles=32, sms=h100, min_slice_k_tiles=8) == 4   # 128 of 132 SMs busy
    assert mk.split_k_slices(tiles=32, k_tiles=16, sms=h100, min_slice_k_tiles=8) == 2   # slices keep >= 8 K steps
    assert mk.split_k_slices(tiles=67, k_tiles=64, sms=h100, min_slice_k_tiles=8) == 1   # over half the SMs: no split
    shapes = {(m, n, k): mk.choose_config(m, n, k, torch.bfloat16, h100)
              for m in (1, 16, 128) for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]}
    picks = {shape: (c["BLOCK_M"], c["BLOCK_N"], c.get("SPLIT_K", 1)) for shape, c in shapes.items()}
    assert picks[(16, 4096, 4096)] == picks[(1, 4096, 14336)] == (16, 128, 4)
    assert picks[(1, 6144, 4096)] == (16, 128, 2) and picks[(16, 14336, 4096)] == (16, 128, 1)
    assert picks[(128, 4096, 14336)] == (128, 64, 2) and picks[(128, 6144, 4096)] == (128, 64, 1)
    assert picks[(128, 4096, 4096)] == (64, 64, 1) and picks[(128, 14336, 4096)] == (128, 128, 1)
    for (m, n, k), c in shapes.items():     # every pick gives >= 2/3 of the SMs work
        assert 3 * -(-m // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]) * c.get("SPLIT_K", 1) >= 2 * h100
    assert "SPLIT_K" not in mk.choose_config(8192, 8192, 8192, torch.bfloat16, h100)
    with pytest.raises(ValueError, match="SPLIT_K"):
        mk.launch_matmul(torch.randn(4, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE), config={"SPLIT_K": 0})


def test_choose_config():
    h100 = 132
    for m, n, k, dt in [(1, 4096, 4096, torch.bfloat16), (16, 14336, 4096, torch.float16),
                        (30, 4096, 4096, torch.bfloat16), (8192, 8192, 8192, torch.bfloat16),
                        (128, 4096, 4096, torch.bfloat16), (5, 3, 8, torch.float32), (300, 7, 1, torch.float16)]:
        cfg = mk.choose_config(m, n, k, dt, h100)
        assert all(cfg[key] >= 16 for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")), (m, n, k, cfg)
        assert cfg["BLOCK_K"] <= max(16, k * 2) and cfg["BLOCK_N"] <= max(16, n * 2)
    assert mk.choose_config(1, 4096, 4096, torch.bfloat16, h100)["BLOCK_M"] == 16
    assert mk.choose_config(30, 4096, 4096, torch.bfloat16, h100)["BLOCK_M"] == 32
    assert mk.choose_config(1, 4096, 4096, torch.bfloat16, h100)["BLOCK_N"] == 128   # 32 tiles x 4 K slices
    assert mk.choose_config(8192, 8192, 8192, torch.bfloat16, h100) == mk.CONFIGS["tile_128x256"]
    assert mk.choose_config(64, 64, 64, torch.float32, h100)["BLOCK_K"] == 32


def test_preact_recomputed_when_not_saved():
    """The op called without save_preact (grad enabled after the forward): the backward redoes
    the forward GEMM for z."""
    a, b, bias = _rand((13, 24), torch.float32), _rand((24, 19), torch.float32), _rand(19, torch.float32)
    out, pre = mm._matmul_fwd_op(a, b, bias, None, "gelu", torch.float32, False)
    assert pre.numel() == 0
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b, bias), dy)
    wide = [t.detach().double().requires_grad_(True) for t in (a, b, bias)]
    ref_grads = torch.autograd.grad(matmul_reference(*wide, "gelu"), wide, dy.double())
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 1e-5


def test_out_dtype_wider_than_inputs():
    a, b = _rand((2, 5, 24), torch.float16), _weight_t(17, 24, torch.float16)
    bias, res = _rand(17, torch.float16), _rand((2, 5, 17), torch.float32)
    for act in (None, "silu"):
        _check(a, b, bias, act, res, out_dtype=torch.float32)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 40), transposed=st.booleans(),
       act=st.sampled_from(ACTS), has_bias=st.booleans())
def test_random_shapes(m, n, k, transposed, act, has_bias):
    b = _weight_t(n, k, torch.float32) if transposed else _rand((k, n), torch.float32)
    _check(_rand((m, k), torch.float32), b, _rand(n, torch.float32) if has_bias else None, act)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (37, 45, 70), (64, 32, 0), (130, 17, 33)])
def test_out_may_be_the_residual(dtype, m, n, k):
    """launch_matmul(out=residual): an in-place accumulation (grad += aᵀ b), odd shapes, K = 0, a
    transposed A; a wrong out is a ValueError."""
    a = torch.randn(k, m, device=DEVICE).to(dtype).t()      # a transposed view, as dlogitsᵀ
    b, res = torch.randn(k, n, device=DEVICE).to(dtype), torch.randn(m, n, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    ref = a.double() @ b.double() + bias.double() + res.double()
    acc = res.clone()
    assert mk.launch_matmul(a, b, bias=bias, residual=acc, out=acc)[0] is acc
    assert rel_err(acc, ref) <= TOL[dtype]
    with pytest.raises(ValueError, match="out must be a contiguous"):
        mk.launch_matmul(a, b, out=torch.empty(m + 1, n, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("m,n,k", [(0, 5, 7), (4, 0, 7), (0, 0, 0), (3, 6, 0), (1, 1, 0)])
def test_empty(m, n, k):
    """K = 0: out = act(bias) + residual, the GEMMs' zero contribution; M or N = 0: empty."""
    a, b, bias, res = _rand((m, k), torch.float32), _rand((k, n), torch.float32), _rand(n, torch.float32), \
        _rand((m, n), torch.float32)
    y = matmul(a, b, bias, "silu", res)
    assert y.shape == (m, n)
    # elementwise against the terms: silu(bias) + residual cancels at random (CI: 0.3244 - 0.2945,
    # where fp32's rounding of the two terms alone is 1.2e-6 of the sum); 4 roundings of each term
    act, r = F.silu(bias.detach().double()), res.detach().double()
    assert ((y.double() - (act + r)).abs() <= 4 * 2**-24 * (act.abs() + r.abs())).all()
    grads = torch.autograd.grad(y, (a, b, bias, res), torch.randn_like(y))
    for g, t in zip(grads, (a, b, bias, res)):
        assert g.shape == t.shape and not torch.isnan(g).any()
    if k == 0:
        assert not grads[0].any() and not grads[1].any()


@pytest.mark.parametrize("call,exc,match", [
    (lambda a, b: matmul(a.tolist(), b), TypeError, "a must be a torch.Tensor"),
    (lambda a, b: matmul(a, b.int()), TypeError, "b has dtype int32"),
    (lambda a, b: matmul(a, b[:7]), ValueError, "b has K = 7 rows"),
    (lambda a, b: matmul(a, b[0]), ValueError, "b must be 2-D"),
    (lambda a, b: matmul(a[0, 0], b), ValueError, "a must have at least 1"),
    (lambda a, b: matmul(a, b.half()), TypeError, "b has dtype"),
    (lambda a, b: matmul(a, b, bias=torch.randn(5)), ValueError, "bias has shape"),
    (lambda a, b: matmul(a, b, bias=torch.randn(6).half()), TypeError, "bias has dtype"),
    (lambda a, b: matmul(a, b, residual=torch.randn(3, 5)), ValueError, "residual has shape"),
    (lambda a, b: matmul(a, b, residual=torch.randn(3, 6).half()), TypeError, "residual has dtype"),
    (lambda a, b: matmul(a, b, activation="tanh"), ValueError, "activation must be"),
    (lambda a, b: matmul(a, b, out_dtype=torch.int32), TypeError, "out_dtype must be"),
    (lambda a, b: matmul(a, b.to("meta")), ValueError, "b is on meta"),
    (lambda a, b: matmul(a, b, bias=torch.randn(6, device="meta")), ValueError, "bias is on meta"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.randn(3, 8, device=DEVICE), torch.randn(8, 6, device=DEVICE))


@pytest.fixture
def checked_matmuls(monkeypatch):
    """Counts the calls that take the checked path; empties the fast path's cache first and last."""
    mm._FAST.clear()
    yield count_calls(monkeypatch, mm, "_checked_matmul")
    mm._FAST.clear()


@pytest.mark.parametrize("act", [None, "gelu"])
@pytest.mark.parametrize("lead", [(1,), (2, 3)], ids=["one-row", "3d"])
def test_fast_path_repeats_the_checked_launch(act, lead, checked_matmuls):
    """A repeated no-grad call (a drop-in Linear at inference) skips the checks: the same output
    bitwise, the reference's on new values; a call that needs a gradient is checked every time,
    and other options or layouts are checked again (bad ones still raise)."""
    a, b = _rand((*lead, 40), torch.float32, grad=False), _weight_t(24, 40, torch.float32).detach()
    bias, res = _rand((24,), torch.float32, grad=False), _rand((*lead, 24), torch.float32, grad=False)
    first = matmul(a, b, bias, act, res)
    again = matmul(a, b, bias, act, res)
    assert len(checked_matmuls) == 1 and len(mm._FAST) == 1 and torch.equal(first, again)
    a.copy_(torch.randn_like(a))
    out = matmul(a, b, bias, act, res)
    assert len(checked_matmuls) == 1
    assert rel_err(out, matmul_reference(a.double(), b.double(), bias.double(), act, res.double())) <= 1e-5
    matmul(a, b, bias, "relu", res)                       # another activation: checked
    with pytest.raises(ValueError, match="activation"):
        matmul(a, b, bias, "tanh", res)
    with pytest.raises(TypeError, match="out_dtype"):
        matmul(a, b, bias, act, res, out_dtype=torch.int32)
    b_grad = b.clone().requires_grad_(True)
    for _ in range(2):
        y = matmul(a, b_grad, bias, act, res)
    # a call that records a graph has its own key (with the requires_grad flags): checked once
    assert y.requires_grad and len(checked_matmuls) == 5 and len(mm._FAST) == 3
    # the repeat went through the op's Function: it saved the pre-activation iff there is one
    node = y.grad_fn if y.grad_fn.name() != "ViewBackward0" else y.grad_fn.next_functions[0][0]
    assert (node.saved_tensors[3] is not None) == (act is not None)
    dy = torch.randn_like(y)
    b64 = b.double().requires_grad_(True)
    (db_ref,) = torch.autograd.grad(matmul_reference(a.double(), b64, bias.double(), act, res.double()), b64,
                                    dy.double())
    assert rel_err(torch.autograd.grad(y, b_grad, dy)[0], db_ref) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(lead=st.sampled_from([(7,), (2, 3), (1,)]), n=st.integers(1, 24), k=st.integers(1, 40),
       act=st.sampled_from([None, "relu", "gelu_tanh", "silu"]), has_bias=st.booleans(), has_res=st.booleans(),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
       b_transposed=st.booleans(), checkpointed=st.booleans())
def test_fast_path_training_calls_match_fp64(lead, n, k, act, has_bias, has_res, flags, b_transposed, checkpointed):
    """Whatever a training call's layout, epilogue and requires_grad flags, its repeats (the fast
    path once the first call was checked) give fp64's output and every gradient, on fresh values
    each call, also inside a non-reentrant checkpoint (the recompute takes the fast path too)."""
    from torch.utils.checkpoint import checkpoint
    mm._FAST.clear()
    dtype = torch.float32
    for _ in range(3):
        a = _rand((*lead, k), dtype, grad=flags[0])
        b = _weight_t(n, k, dtype).requires_grad_(flags[1]) if b_transposed else _rand((k, n), dtype, grad=flags[1])
        bias = _rand((n,), dtype, grad=flags[2]) if has_bias else None
        res = _rand((*lead, n), dtype, grad=flags[3]) if has_res else None
        leaves = [t for t in (a, b, bias, res) if t is not None and t.requires_grad]
        fn = (lambda *xs: checkpoint(matmul, *xs, use_reentrant=False)) if checkpointed else matmul
        # _check's bound (max(TOL, 2 x PyTorch's fp32 error)): one output column makes the bias and
        # weight gradients short sums that cancel, and gelu_tanh' underflows far in the lower tail
        # (a bare 1e-5 failed ~5 % of runs: 1.55e-4 on a cancelling sum, 1.0 on an underflow; s45)
        y = _check(a, b, bias, act, res, fn=fn)
        assert y.requires_grad == bool(leaves)
    mm._FAST.clear()


@pytest.mark.parametrize("act", [None, "silu"])
def test_fast_path_with_grad_keys_on_requires_grad(act, checked_matmuls):
    """Training calls repeat through the fast path per set of requires_grad flags: each flag set
    is checked once, every gradient matches fp64 on fresh values, and grad mode off takes the
    no-grad entry."""
    a, w = _rand((2, 5, 40), torch.float32, grad=False), _rand((24, 40), torch.float32, grad=False)
    bias = _rand((24,), torch.float32, grad=False)
    for flags in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        for _ in range(3):
            a.copy_(torch.randn_like(a))
            leaves = [t.detach().clone().requires_grad_(f) for t, f in zip((a, w, bias), flags)]
            y = matmul(leaves[0], leaves[1].t(), leaves[2], act)
            wanted = [t for t, f in zip(leaves, flags) if f]
            dy = torch.randn_like(y)
            grads = torch.autograd.grad(y, wanted, dy)
            ref64 = [t.detach().double().requires_grad_(f) for t, f in zip(leaves, flags)]
            refs = torch.autograd.grad(matmul_reference(ref64[0], ref64[1].t(), ref64[2], act),
                                       [t for t in ref64 if t.requires_grad], dy.double())
            for g, r in zip(grads, refs):
                assert rel_err(g, r) <= 1e-5
    assert len(checked_matmuls) == 4 and len(mm._FAST) == 4
    with torch.no_grad():
        for _ in range(2):
            y = matmul(leaves[0], leaves[1].t(), leaves[2], act)
    assert not y.requires_grad and len(checked_matmuls) == 5 and len(mm._FAST) == 5


def test_compile_fullgraph():
    fn = torch.compile(lambda a, b, bias, r: matmul(a, b, bias, "gelu_tanh", r), fullgraph=True, backend="aot_eager")
    a, b, bias, r = _rand((2, 7, 24), torch.float32), _weight_t(19, 24, torch.float32), \
        _rand(19, torch.float32), _rand((2, 7, 19), torch.float32)
    _check(a, b, bias, "gelu_tanh", r, fn=lambda a, b, bias, act, r, out_dtype: fn(a, b, bias, r))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_a_drop_in(bias):
    ref = torch.nn.Linear(24, 19, bias=bias).to(DEVICE)
    lin = Linear(24, 19, bias=bias).to(DEVICE)
    lin.load_state_dict(ref.state_dict())
    assert list(lin.state_dict()) == list(ref.state_dict()) and isinstance(lin, torch.nn.Linear)
    x = torch.randn(2, 5, 24, device=DEVICE, requires_grad=True)
    y, y_ref = lin(x), ref(x)
    assert rel_err(y, y_ref) <= 1e-5
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *lin.parameters()], dy)
    for g, rg in zip(grads, torch.autograd.grad(y_ref, [x, *ref.parameters()], dy)):
        assert rel_err(g, rg) <= 1e-5
    assert grads[1].is_contiguous()          # dW written in the weight's own [N, K] layout


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", get("matmul").test_shapes)
def test_registry_shapes(shape, dtype):
    """The registry sweep (tests/test_ops.py) for this op, runnable before it is registered there."""
    spec = get("matmul")
    chk = check_impl(spec, spec.fn, spec.make_inputs(shape, dtype, DEVICE), dtype)
    assert chk.error is None and chk.ok, chk
    m, n, k = shape
    assert spec.flops_fn(shape, "bwd") == 2 * spec.flops_fn(shape, "fwd") == 4 * m * n * k


# ----------------------------------------------------------------------------------------------
# GPU: bf16, big shapes, both load paths (run by the lead on the H100/H200)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{"USE_TMA": True}, {"USE_TMA": False},
                                 {"USE_TMA": True, "STORE_TMA": True, "STORE_SPLIT": 2, "FLATTEN": True},
                                 {"USE_TMA": True, "STORE_TMA": True, "STORE_SPLIT": 1}], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (1000, 1031, 8192),
                                   (1000, 1032, 8192),
                                   (4096, 4096, 4096), (2048, 14336, 4096)])
def test_gpu_bf16_large(m, n, k, cfg):
    """Both load paths and both store paths (the descriptor store needs 16-byte rows: N = 1032)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for b in (w.t(), w.t().contiguous()):
        out, _ = mk.launch_matmul(a, b, config=cfg)
        assert rel_err(out, a.double() @ b.double()) <= 1e-2


def _assert_graph_replays(fn, expected):
    """``fn`` (compiled first) captured in a CUDA graph: two replays into a NaN-poisoned output
    give ``expected`` bit for bit."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4, 7])
@pytest.mark.parametrize("store_tma", [False, True])
@pytest.mark.parametrize("use_tma", [False, True])
def test_gpu_split_k(split, store_tma, use_tma):
    """Split-K on the GPU (real concurrency between the slices of a tile): bias + gelu + residual
    at M = 128 and an odd shape, bit-identical over repeated launches, and inside a CUDA graph
    (its own counters, zeroed by the captured memset) replayed twice."""
    for m, n, k in [(128, 4096, 4096), (77, 1000, 3000)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias, res = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        cfg = dict(SPLIT_K=split, USE_TMA=use_tma, STORE_TMA=store_tma)
        ref = matmul_reference(a.double(), w.double().t(), bias.double(), "gelu", res.double())
        out = mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0]
        assert rel_err(out, ref) <= 1e-2
        for _ in range(3):
            assert torch.equal(out, mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0])
        _assert_graph_replays(lambda: mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["64x64", "64x128", "128x128", "64x96", "128x96"])
@pytest.mark.parametrize("dtype,out_dtype,row_major_b", [
    (torch.bfloat16, None, False), (torch.float16, None, False), (torch.bfloat16, torch.float32, False),
    (torch.bfloat16, None, True), (torch.float16, torch.float32, True)], ids=str)
def test_gpu_gluon_small_m(tile, dtype, out_dtype, row_major_b):
    """The Gluon small-M kernel with each tile (forced through config, so it runs on any sm_90
    GPU whatever the heuristic picks; 96 wide: two B parts of 64 + 32 columns), b as x @ w.t() or
    row-major [K, N]: ragged M / N / K (TMA
    zero fill and clipped stores), every epilogue, output NaN-poisoned first, bit-identical
    relaunches, the residual as the output itself, and a CUDA graph replay."""
    from tilefuse.ops import _matmul_gluon as g
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    rows, width = (int(v) for v in tile.split("x"))     # 96 wide: a 64- and a 32-column part
    cfg = dict(g.WS_TILES[f"{rows}x128"] if width == 96 else g.WS_TILES[tile], BLOCK_N=width, GLUON=True)
    shapes = [(128, 6144, 4096), (200, 1000, 3000), (33, 136, 72), (1, 64, 8)]
    for (m, n, k), act in zip(shapes, ["gelu", "silu", None, "relu"]):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        b = w.t().contiguous() if row_major_b else w.t()
        assert mk._matmul_plan(m, n, k, dtype, out_dtype or dtype, a.stride(), b.stride(), (n, 1), True, 132, True,
                               True, (False, "none", False, False), mk.config_key(cfg)).ws_tile
        bias, res = torch.randn(n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=out_dtype or dtype)
        ref = matmul_reference(a.double(), b.double(), bias.double(), act, res.double())
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype or dtype)
        out, pre = mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype, save_preact=act is not None,
                                    config=cfg, out=out)
        assert rel_err(out, ref) <= TOL[dtype], (m, n, k)
        if act is not None:
            assert rel_err(pre, matmul_reference(a.double(), b.double(), bias.double())) <= TOL[dtype]
        plain = mk.launch_matmul(a, b, config=cfg)[0]
        assert rel_err(plain, a.double() @ b.double()) <= TOL[dtype]
        for _ in range(2):
            assert torch.equal(out, mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype, config=cfg)[0])
        inplace = res.clone()
        mk.launch_matmul(a, b, bias, inplace, act or "none", out_dtype=out_dtype, config=cfg, out=inplace)
        assert torch.equal(inplace, out)
    _assert_graph_replays(lambda: mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype,
                                                   config=cfg)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["128x256", "128x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["a-m-major", "row-major", "b-k-major"])
def test_gpu_gluon_large_m(tile, dtype, layout):
    """The Gluon kernel at M > MID_MAX_M with each large tile (forced through config): a row-major
    or M-major (dyᵀ, the weight gradient), b a transposed weight or row-major; ragged M / N / K
    (TMA zero fill and clipped stores), K shorter than the ring, the epilogues the tile's heuristic
    allows (128x256: bias + activation; 128x128: also residual and pre-activation, and fp32 out),
    output NaN-poisoned, bit-identical relaunches and a CUDA graph replay."""
    from tilefuse.ops import _matmul_gluon as g
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    cfg = dict(g.LARGE_WS_TILES[tile], GLUON=True)
    full = tile == "128x128"            # residual / preact / fp32 out fit its registers and shared memory
    for (m, n, k), act in zip([(1000, 768, 3000), (300, 136, 40), (4104, 520, 1032), (2049, 4096, 8)],
                              ["gelu", "silu", None, "relu"]):
        if layout == "a-m-major":       # descriptors read aᵀ [K, M]: 16-byte rows (M a multiple of 8)
            m = (m + 7) // 8 * 8
        a = torch.randn(k, m, device="cuda", dtype=dtype).t() if layout == "a-m-major" else \
            torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype).t() if layout == "b-k-major" else \
            torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
        out_dtype = torch.float32 if full and act == "silu" else dtype
        plan = mk._matmul_plan(m, n, k, dtype, out_dtype, a.stride(), b.stride(), (n, 1), True, 132, True, True,
                               (True, act or "none", full, full and act is not None), mk.config_key(cfg))
        assert dict(plan.ws_tile)["A_M_MAJOR"] == (layout == "a-m-major")
        bias = torch.randn(n, device="cuda", dtype=dtype)
        res = torch.randn(m, n, device="cuda", dtype=out_dtype) if full else None
        ref = matmul_reference(a.double(), b.double(), bias.double(), act, res.double() if full else None)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        out, pre = mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype,
                                    save_preact=full and act is not None, config=cfg, out=out)
        assert rel_err(out, ref) <= TOL[dtype], (m, n, k)
        if pre is not None:
            assert rel_err(pre, matmul_reference(a.double(), b.double(), bias.double())) <= TOL[dtype]
        plain = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        mk.launch_matmul(a, b, config=cfg, out=plain)
        assert rel_err(plain, a.double() @ b.double()) <= TOL[dtype]
        assert torch.equal(out, mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype, config=cfg)[0])
    _assert_graph_replays(lambda: mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype,
                                                   config=cfg)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [192, 1000])
@pytest.mark.parametrize("epilogue", ["none", "bias-gelu-residual-preact"])
def test_gpu_gluon_launch_memo_by_address(m, epilogue):
    """Repeated Gluon GEMMs at the same addresses go through the plan's AddressMemo (from the
    second sighting on): new values at those addresses give the new product every time (the
    memo keeps addresses, never values), outputs NaN-poisoned before each launch; other
    addresses, a bias of the same address in another dtype's plan and a CUDA graph replay are right too."""
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    n, k, dtype = 2048, 320, torch.bfloat16
    full = epilogue != "none"
    a = torch.empty(m, k, device="cuda", dtype=dtype)
    w = torch.empty(n, k, device="cuda", dtype=dtype)
    bias = torch.empty(n, device="cuda", dtype=dtype) if full else None
    res = torch.empty(m, n, device="cuda", dtype=dtype) if full else None
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    act = "gelu" if full else "none"
    # every argument positional, as launch_matmul passes them (lru_cache keys on how they are passed)
    plan = mk._matmul_plan(m, n, k, dtype, dtype, a.stride(), w.t().stride(), (n, 1), True, mk.num_sms(a), True, True,
                           (full, act, full, full), (), True)
    assert plan.ws_plan is not None, "this shape must take the Gluon kernel"
    plan.memo._entries.clear()
    plan.memo._seen.clear()
    for i in range(5):
        for t in (a, w, bias, res):
            if t is not None:
                t.normal_()
        out.fill_(float("nan"))
        got, pre = mk.launch_matmul(a, w.t(), bias, res, act, save_preact=full, out=out)
        ref = matmul_reference(a.double(), w.double().t(), bias.double() if full else None, act,
                               res.double() if full else None)
        assert got is out and rel_err(out, ref) <= TOL[dtype], i
        if full:    # preact is a fresh tensor: its address may change, so only out's part is fixed
            assert rel_err(pre, a.double() @ w.double().t() + bias.double()) <= TOL[dtype], i
    assert len(plan.memo) >= 1, "repeats at one address tuple must be kept"
    a2 = torch.randn_like(a)        # another address: a miss, right
    got, _ = mk.launch_matmul(a2, w.t(), bias, res, act, save_preact=full)
    ref = matmul_reference(a2.double(), w.double().t(), bias.double() if full else None, act,
                           res.double() if full else None)
    assert rel_err(got, ref) <= TOL[dtype]
    _assert_graph_replays(lambda: mk.launch_matmul(a, w.t(), bias, res, act, save_preact=full, out=out)[0],
                          mk.launch_matmul(a, w.t(), bias, res, act, save_preact=full)[0].clone())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 1024])
def test_gpu_gluon_gemm_first_in_a_fresh_backward(m):
    """A process whose first backward kernel is a Gluon GEMM (dx = dy @ w at M = 128 and 1024),
    after the same GEMMs ran on the main thread: its host TMA descriptors are encoded on the
    autograd engine's device thread, where no CUDA context is current until some CUDA runtime
    call makes it so (with the allocator's cache warm, the gradients' allocations make none).
    Failed with "Failed to create tensor map descriptor: invalid device context" before
    ``_launch.ensure_thread_context`` (H200, 2026-11-29, scripts/gemm_host_us.py's step row);
    now the gradients match fp64. In a child process: the first backward of a process is the case.
    ``TILEFUSE_TEST_NO_CONTEXT_FIX=1`` runs the child without the fix (to see the failure)."""
    code = (f"import os, torch, tilefuse, tilefuse._launch as L\n"
            f"from tilefuse.ops import _matmul_kernels as mk\n"
            f"from tilefuse.testing import rel_err\n"
            f"if os.environ.get('TILEFUSE_TEST_NO_CONTEXT_FIX') == '1': L.ensure_thread_context = lambda: None\n"
            f"x = torch.randn({m}, 4096, device='cuda', dtype=torch.bfloat16)\n"
            f"w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16) / 64\n"
            f"dy = torch.randn({m}, 4096, device='cuda', dtype=torch.bfloat16)\n"
            f"for _ in range(20):\n"
            f"    mk.launch_matmul(x, w.t()), mk.launch_matmul(dy, w), mk.launch_matmul(dy.t(), x)\n"
            f"torch.cuda.synchronize()\n"
            f"xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)\n"
            f"got = torch.autograd.grad(tilefuse.matmul(xg, wg.t()), (xg, wg), dy)\n"
            f"xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)\n"
            f"ref = torch.autograd.grad(xd @ wd.t(), (xd, wd), dy.double())\n"
            f"print(max(rel_err(g, r) for g, r in zip(got, ref)))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "gelu"])
def test_gpu_gluon_large_m_by_default_fwd_bwd(act):
    """M = 2048 through the public op on sm_90: the forward, the input gradient (dz @ w) and the
    weight gradient (xᵀ @ dz, a M-major) each take the Gluon kernel by default; outputs and every
    gradient vs the fp64 reference."""
    if torch.cuda.get_device_capability()[0] == 9:
        for a_strides, b_strides, epilogue in [((4096, 1), (1, 4096), (True, act or "none", True, act is not None)),
                                               ((4096, 1), (4096, 1), (False, "none", False, False)),
                                               ((1, 4096), (4096, 1), (False, "none", False, False))]:
            assert mk._matmul_plan(4096, 4096, 4096, torch.bfloat16, torch.bfloat16, a_strides, b_strides,
                                   (4096, 1), True, 132, True, True, epilogue, ()).ws_tile
    _check(_rand((2, 2048, 4096), torch.bfloat16), _weight_t(4096, 4096, torch.bfloat16), _rand(4096, torch.bfloat16),
           act, _rand((2, 2048, 4096), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["128x256", "128x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["a-m-major", "row-major", "b-k-major"])
def test_gpu_gluon_accumulate(tile, dtype, layout):
    """out += a @ b on the Gluon kernel (linear cross-entropy's grad_weight): a as dyᵀ (the
    transpose of a row-major [K, M]) or row-major, b row-major or a transposed weight; ragged M / N
    and K below, at and over the ring depth; one rounding of the sum (against the fp64 sum of the
    old tile and the product); relaunches give the same bits; accumulate=False writes a @ b into a
    NaN-poisoned out; ``scale`` multiplies the sum; the launch replays in a CUDA graph."""
    from tilefuse.ops import _matmul_gluon as g
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    cfg = g.ACCUMULATE_TILES[tile]
    for m, n, k in [(1000, 768, 512), (136, 200, 40), (64, 256, 8), (4104, 520, 1032)]:
        a = torch.randn(k, m, device="cuda", dtype=dtype).t() if layout == "a-m-major" else \
            torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype).t() if layout == "b-k-major" else \
            torch.randn(k, n, device="cuda", dtype=dtype)
        old = torch.randn(m, n, device="cuda", dtype=dtype) * 8
        ref = old.double() + a.double() @ b.double()
        out = g.launch_gemm_accumulate(a, b, old.clone(), config=cfg)
        assert rel_err(out, ref) <= (4e-3 if dtype == torch.bfloat16 else 1e-3), (m, n, k)
        assert torch.equal(out, g.launch_gemm_accumulate(a, b, old.clone(), config=cfg))
        fresh = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        g.launch_gemm_accumulate(a, b, fresh, config=cfg, accumulate=False)
        assert rel_err(fresh, a.double() @ b.double()) <= (4e-3 if dtype == torch.bfloat16 else 1e-3)
        scale = torch.rand(1, device="cuda") * 4 - 2      # out = scale · (old + a @ b), one rounding
        scaled = g.launch_gemm_accumulate(a, b, old.clone(), config=cfg, scale=scale)
        assert rel_err(scaled, ref * scale.double()) <= (4e-3 if dtype == torch.bfloat16 else 1e-3), (m, n, k)
    graph_out = old.clone()

    def relaunch():
        graph_out.copy_(old)
        return g.launch_gemm_accumulate(a, b, graph_out, config=cfg)
    _assert_graph_replays(relaunch, out)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "gelu"])
def test_gpu_gluon_small_m_by_default_fwd_bwd(act):
    """M = 128 through the public op on sm_90 takes the Gluon kernel by default for the forward and
    the input gradient (dy @ w: row-major b), the tl kernel for the weight gradient (a transposed
    a): outputs and every gradient vs the fp64 reference."""
    if torch.cuda.get_device_capability()[0] == 9:      # (4096 columns: 128 tiles of 64x64 fill the SMs)
        for b_strides, epilogue in [((1, 4096), (True, act or "none", True, act is not None)),     # x @ w.t()
                                    ((4096, 1), (False, "none", False, False))]:                  # dz @ w
            assert mk._matmul_plan(128, 4096, 4096, torch.bfloat16, torch.bfloat16, (4096, 1), b_strides, (4096, 1),
                                   True, 132, True, True, epilogue, ()).ws_tile
    _check(_rand((2, 64, 4096), torch.bfloat16), _weight_t(4096, 4096, torch.bfloat16), _rand(4096, torch.bfloat16), act,
           _rand((2, 64, 4096), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_gpu_bf16_epilogues_fwd_bwd(act):
    a = _rand((4, 256, 1024), torch.bfloat16)
    _check(a, _weight_t(1536, 1024, torch.bfloat16), _rand(1536, torch.bfloat16), act,
           _rand((4, 256, 1536), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(FLATTEN=True), dict(mk.CONFIGS["tile_128x128"]), dict(mk.CONFIGS["tile_64x128"]),
                                 dict(mk.CONFIGS["small_m32"], BLOCK_N=128)])
def test_gpu_configs_compile_and_agree(cfg):
    a = torch.randn(3000, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 2999, device="cuda", dtype=torch.float16)
    for use_tma in (True, False):
        out, _ = mk.launch_matmul(a, b, config=dict(cfg, USE_TMA=use_tma))
        assert rel_err(out, a.double() @ b.double()) <= 2e-3


def test_one_row_a_with_any_row_stride():
    """M = 1 with a's (unused) row stride 1, as dyᵀ of a [K, 1] gradient: the same result as a
    contiguous row (the launcher gives the row an aligned stride so descriptors can read it)."""
    dy, x = torch.randn(64, 1, device=DEVICE), torch.randn(64, 24, device=DEVICE)
    assert dy.t().stride() == (1, 1)
    out, _ = mk.launch_matmul(dy.t(), x)
    assert torch.equal(out, mk.launch_matmul(dy.t().contiguous(), x)[0])
    assert rel_err(out, dy.double().t() @ x.double()) <= 1e-5


def test_gluon_small_m_plan():
    """On sm_90 (hopper_exact) mid-M x @ w.t() and row-major-b GEMMs take the Gluon kernel with the
    tile of least stream cost (as measured best); M <= 32, a transposed a, fp32, unaligned outputs,
    tl configs and GLUON=False keep the tl kernel; GLUON=True takes it at any M, with its tile keys
    overriding."""
    def plan(m, n=4096, k=4096, config=(), b_strides=None, a_strides=None, dtype=torch.bfloat16, exact=True):
        b_strides = b_strides or (1, k)
        a_strides = a_strides or (k, 1)
        return mk._matmul_plan(m, n, k, dtype, dtype, a_strides, b_strides, (n, 1), True, 132, True, exact,
                               (False, "none", False, False), config)
    tile = lambda p: dict(p.ws_tile)    # noqa: E731
    assert (tile(plan(128))["CONSUMERS"], tile(plan(128))["BLOCK_N"]) == (1, 64)            # 128 tiles
    assert (tile(plan(128, 14336))["CONSUMERS"], tile(plan(128, 14336))["BLOCK_N"]) == (2, 128)   # 112
    assert (tile(plan(128, 6144))["CONSUMERS"], tile(plan(128, 6144))["BLOCK_N"]) == (1, 128)     # 96
    assert tile(plan(256, 4096))["BLOCK_N"] == 128 and plan(mk.MID_MAX_M).ws_tile
    assert tile(plan(64))["BLOCK_N"] == 64 and tile(plan(256, 6144))["CONSUMERS"] == 2
    assert not plan(64, n=1024).ws_tile         # 16 tiles of 64x64: the tl kernel's split-K
    assert not plan(16).ws_tile
    assert tile(plan(mk.MID_MAX_M + 1))["BLOCK_N"] == 128      # large M: test_gluon_large_m_plan
    assert not plan(128, exact=False).ws_tile and not plan(128, dtype=torch.float32).ws_tile
    assert tile(plan(128, b_strides=(4096, 1)))["B_K_MAJOR"] is False and tile(plan(128))["B_K_MAJOR"] is True
    assert not plan(128, a_strides=(1, 128)).ws_tile
    assert not plan(128, n=4100).ws_tile         # out rows not 16-byte aligned for the TMA store
    assert not plan(128, config=(("SPLIT_K", 2),)).ws_tile and not plan(128, config=(("GLUON", False),)).ws_tile
    forced = plan(16, config=(("GLUON", True), ("STAGES", 4)))
    assert tile(forced)["STAGES"] == 4 and tile(forced)["BLOCK_N"] == 64


def test_gluon_large_m_plan():
    """On sm_90, 16-bit GEMMs above MID_MAX_M take the Gluon kernel: the 128x256 tile with enough
    waves of it and no fuller waves of 128x128, else 128x128; 128x128 when the epilogue has a
    residual or a saved pre-activation or the output is fp32 (registers / shared memory); a
    transposed a (the weight gradient) read M-major; too few tiles, an unaligned output, non-sm_90
    GPUs and tl configs keep the tl kernel."""
    def plan(m, n=4096, k=4096, epilogue=(False, "none", False, False), a_strides=None, out_dtype=torch.bfloat16,
             out_aligned=True, config=(), exact=True):
        a_strides = a_strides or (k, 1)
        return mk._matmul_plan(m, n, k, torch.bfloat16, out_dtype, a_strides, (1, k), (n, 1), True, 132, True, exact,
                               epilogue, config, out_aligned)
    tile = lambda p: dict(p.ws_tile)    # noqa: E731
    big = tile(plan(8192))
    assert (big["CONSUMERS"], big["BLOCK_N"], big["A_M_MAJOR"]) == (2, 256, False)
    assert tile(plan(8192, epilogue=(True, "gelu", False, False)))["BLOCK_N"] == 256
    for epilogue in [(True, "gelu", True, False), (False, "none", False, True)]:
        assert tile(plan(8192, epilogue=epilogue))["BLOCK_N"] == 128
    assert tile(plan(8192, out_dtype=torch.float32))["BLOCK_N"] == 128
    assert tile(plan(4096, k=8192, a_strides=(1, 4096)))["A_M_MAJOR"] is True
    for m, n, width in [(4096, 4096, 256), (8192, 14336, 256), (2048, 14336, 256), (640, 128256, 256),
                        (1024, 4096, 128), (1024, 14336, 128), (384, 14336, 128), (384, 4096, 128)]:
        assert tile(plan(m, n))["BLOCK_N"] == width, (m, n)     # as measured best (choose_large_ws_tile)
    assert not plan(300, n=1024).ws_tile                        # 3 x 8 = 24 tiles: the tl kernel's split-K
    assert not plan(8192, out_aligned=False).ws_tile and not plan(8192, exact=False).ws_tile
    assert not plan(8192, config=(("BLOCK_N", 128),)).ws_tile and not plan(8192, config=(("GLUON", False),)).ws_tile
    assert not plan(128, a_strides=(1, 128)).ws_tile            # mid M reads a row-major only


@pytest.mark.parametrize("a_m_major", [False, True])
@pytest.mark.parametrize("b_k_major", [True, False])
@pytest.mark.parametrize("width", [256, 96])
def test_gluon_planned_launch_passes_the_operands_views(a_m_major, b_k_major, width, monkeypatch):
    """The Gluon GEMM's planned launch (``launch_ws_plan``, the plan made once in
    ``_matmul_plan``) hands the kernel the descriptors of the right views: a [M, K] (or aᵀ's
    row-major [K, M] when M-major), b's [N, K] rows when K-major (``w.t()``) else [K, N], out in
    one or two column parts (a 96-wide tile is 64 + 32), and the tensors after them, checked field
    by field against descriptors of explicitly made views (the kernel itself runs on sm_90 only:
    test_gpu_gluon_large_m / test_gpu_gluon_small_m)."""
    from tilefuse.ops import _gluon_common as gc
    from tilefuse.ops import _matmul_gluon as g
    m, n, k = 512, 1024, 320
    a = torch.randn(k, m, dtype=torch.bfloat16).t() if a_m_major else torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, k, dtype=torch.bfloat16).t() if b_k_major else torch.randn(k, n, dtype=torch.bfloat16)
    out, bias = torch.empty(m, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    tile = dict(g.LARGE_WS_TILES["128x128"], BLOCK_N=width, BLOCK_K=128, B_K_MAJOR=b_k_major, A_M_MAJOR=a_m_major)
    plan = g._ws_plan(m, n, k, 2, 2, b_k_major, 132, (True, "gelu", False, False), (n, 1), tuple(tile.items()))
    seen = []
    monkeypatch.setattr(g.gemm_ws_kernel, "launch_prepared", lambda grid, tensors, prepared: seen.append(tensors))
    g.launch_ws_plan(plan, a, b, out, bias)
    (a_d, b_d, b2_d, c_d, c2_d, *rest), = seen
    parts = [64, 32] if width == 96 else [width, width]
    bk = plan.block_k
    expect = [gc.matrix_descriptor(a.t(), (bk, 64)) if a_m_major else gc.matrix_descriptor(a, (64, bk))]
    expect += [gc.matrix_descriptor(b.t(), (p, bk)) if b_k_major else gc.matrix_descriptor(b, (bk, p)) for p in parts]
    expect += [gc.matrix_descriptor(out, (64, p)) for p in parts]
    for got, want in zip((a_d, b_d, b2_d, c_d, c2_d), expect):
        assert (got.base.data_ptr(), got.shape, got.strides, got.block_shape, got.layout) == \
            (want.base.data_ptr(), want.shape, want.strides, want.block_shape, want.layout)
    assert rest[0] is bias and all(t is out for t in rest[1:])


def _strided(rows: int, cols: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] CPU tensor: row-major, the transpose of a row-major [cols, rows], or
    row-major with 8 elements of padding per row (a slice of a wider buffer)."""
    if layout == "t":
        return torch.randn(cols, rows).to(dtype).t()
    if layout == "pad":
        return torch.randn(rows, cols + 8).to(dtype)[:, :cols]
    return torch.randn(rows, cols).to(dtype)


def _mostly_multiples_of_8(top: int):
    """Sizes that are multiples of 8 (TMA-aligned rows of 16-bit data) three times in four."""
    eights = st.integers(1, top // 8).map(lambda v: 8 * v)
    return st.one_of(eights, eights, eights, st.integers(1, top))


@settings(max_examples=200, deadline=None)
@example(m=1024, n=2048, k=64, a_layout="t", b_layout="t", dtype=torch.bfloat16, wide_out=False, epilogue="bias-gelu", sms=2)
@example(m=1024, n=2048, k=72, a_layout="rm", b_layout="pad", dtype=torch.float16, wide_out=True, epilogue="residual",
         sms=2)
@given(m=_mostly_multiples_of_8(1200), n=_mostly_multiples_of_8(1200), k=_mostly_multiples_of_8(96), a_layout=st.sampled_from(["rm", "t", "pad"]),
       b_layout=st.sampled_from(["rm", "t", "pad"]), dtype=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16,
                                                                             torch.float32]),
       wide_out=st.booleans(), epilogue=st.sampled_from(["none", "bias-gelu", "residual", "preact"]),
       sms=st.sampled_from([2, 8, 132]))
def test_gluon_plans_build_valid_descriptors(m, n, k, a_layout, b_layout, dtype, wide_out, epilogue, sms):
    """Any GEMM the sm_90 plan gives the Gluon kernel can be read and written through TMA
    descriptors, as the planned launch builds them (the descriptor constructor asserts 16-byte
    strides), with the tile's limits kept: 16-bit operands, K > 0, a M-major only at large M,
    128x256 only with a 2-byte output and no residual / pre-activation. Random shapes and strides
    on the CPU, the SM count shrunk so that small shapes reach every tile rule."""
    from tilefuse.ops import _matmul_gluon as g
    a, b = _strided(m, k, a_layout, dtype), _strided(k, n, b_layout, dtype)
    out_dtype = torch.float32 if wide_out else dtype
    out = torch.empty(m, n, dtype=out_dtype)
    has_bias, act = epilogue == "bias-gelu", "gelu" if epilogue in ("bias-gelu", "preact") else "none"
    residual = torch.randn(m, n).to(out_dtype) if epilogue == "residual" else None
    preact = torch.empty(m, n, dtype=out_dtype) if epilogue == "preact" else None
    aligned = a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    plan = mk._matmul_plan(m, n, k, dtype, out_dtype, a.stride(), b.stride(), (n, 1), aligned, sms, True, True,
                           (has_bias, act, residual is not None, preact is not None), (), out.data_ptr() % 16 == 0)
    if plan.ws_plan is None:
        return
    tile = dict(plan.ws_tile)
    assert dtype != torch.float32 and k > 0
    assert not tile["A_M_MAJOR"] or m > mk.MID_MAX_M
    if tile["BLOCK_N"] == 256:
        assert out_dtype != torch.float32 and residual is None and preact is None
    seen = []
    bias = torch.randn(n).to(dtype) if has_bias else None
    with mock.patch.object(g.gemm_ws_kernel, "launch_prepared", lambda grid, tensors, prepared: seen.append(tensors)):
        plan.ws_launch(plan.ws_plan, a, b, out, bias, residual, preact)     # builds every descriptor
    a_desc, b_desc, _, c_desc, _ = seen[0][:5]
    assert list(a_desc.shape) == ([k, m] if tile["A_M_MAJOR"] else [m, k])
    assert list(b_desc.shape) == ([n, k] if tile["B_K_MAJOR"] else [k, n]) and list(c_desc.shape) == [m, n]


def test_descriptors_by_default_only_above_mid_m():
    """On an sm_90 GPU (hopper=True) the plan reads K-contiguous operands (x @ w.t()) through
    descriptors for large M only; small and mid M keep pointer loads (cheaper launch). Other
    layouts (b row-major [K, N], a transposed) keep descriptors; USE_TMA still forces either way."""
    def plan(m, config=(), b_strides=(1, 4096), a_strides=(4096, 1)):
        return mk._matmul_plan(m, 4096, 4096, torch.bfloat16, torch.bfloat16, a_strides, b_strides, (4096, 1),
                               True, 132, True, False, (False, "none", False, False), config)
    assert not plan(1).uses_tma and not plan(mk.MID_MAX_M).uses_tma
    assert plan(16, b_strides=(4096, 1)).uses_tma and plan(16, a_strides=(1, 4096)).uses_tma
    assert plan(mk.MID_MAX_M + 1).uses_tma and plan(8192).uses_tma
    assert plan(128, (("USE_TMA", True),)).uses_tma and not plan(8192, (("USE_TMA", False),)).uses_tma
