"""tilefuse.matmul: every epilogue combination forward and backward vs the fp64 reference, layouts
(transposed / strided operands), both load paths (pointers, TMA descriptors), launch configs and
the heuristic, empties, bad input, out_dtype, the eager fast path, torch.compile, nn.Linear, and the
registry shapes. The GPU kernels: test_matmul_gpu.py; the Gluon plans: test_matmul_plans.py."""


import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA, count_calls
from hypothesis import given, settings
from hypothesis import strategies as st
from matmul_cases import ACTS, TOL, _check, _rand, _weight_t

from tilefuse.nn.linear import Linear
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops import matmul as mm     # registers "matmul" (until ops/__init__ imports the module)
from tilefuse.ops.matmul import matmul, matmul_reference
from tilefuse.registry import get
from tilefuse.testing import check_impl, rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())


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
