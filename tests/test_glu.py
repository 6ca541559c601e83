"""swiglu / geglu beyond the registry sweep: packed gate|up input and its packed gradient, erf
geglu, layouts, launch configs, empties, bad input, and SwiGLUMLP (LlamaMLP state_dict)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.nn.activations import SwiGLUMLP
from tilefuse.ops import glu   # registers swiglu / geglu (until ops/__init__ imports the module)
from tilefuse.ops.glu import geglu, swiglu
from tilefuse.testing import rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (tilefuse function, kwargs, the same in eager PyTorch on gate and up)
VARIANTS = {
    "swiglu": (swiglu, {}, lambda g, u: F.silu(g) * u),
    "geglu_erf": (geglu, {}, lambda g, u: F.gelu(g) * u),
    "geglu_tanh": (geglu, {"approximate": "tanh"}, lambda g, u: F.gelu(g, approximate="tanh") * u),
}


def _rand(shape, dtype, scale=1.0):
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype).requires_grad_(True)


def _check(variant, gate, up, dtype):
    """fn(gate, up) and its gradients vs eager PyTorch in fp64 (up=None: gate is packed)."""
    fn, kw, eager = VARIANTS[variant]
    leaves = [t for t in (gate, up) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    y = fn(gate, up, **kw)
    g, u = ref_leaves if up is not None else ref_leaves[0].chunk(2, dim=-1)
    y_ref = eager(g, u)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert rel_err(y, y_ref) <= TOL[dtype]
    dy = torch.randn_like(y)
    for grad, ref in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, ref_leaves, dy.double())):
        assert grad.shape == ref.shape
        assert rel_err(grad, ref) <= TOL[dtype]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_separate_and_packed(variant, dtype):
    _check(variant, _rand((2, 3, 50), dtype, 2), _rand((2, 3, 50), dtype), dtype)
    _check(variant, _rand((2, 3, 100), dtype, 2), None, dtype)
    _check(variant, _rand((9, 2), dtype, 2), None, dtype)        # I = 1


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 30), cols=st.integers(1, 300), packed=st.booleans(), variant=st.sampled_from(list(VARIANTS)))
def test_random_shapes(rows, cols, packed, variant):
    if packed:
        _check(variant, _rand((rows, 2 * cols), torch.float32, 2), None, torch.float32)
    else:
        _check(variant, _rand((rows, cols), torch.float32, 2), _rand((rows, cols), torch.float32), torch.float32)


def test_packed_equals_separate_bit_for_bit():
    gate, up = torch.randn(7, 130, device=DEVICE) * 2, torch.randn(7, 130, device=DEVICE)
    packed = torch.cat([gate, up], -1).requires_grad_(True)
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    y_packed, y = swiglu(packed), swiglu(g, u)
    assert torch.equal(y_packed, y)
    dy = torch.randn_like(y)
    (d_packed,) = torch.autograd.grad(y_packed, packed, dy)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    assert d_packed.shape == packed.shape and d_packed.is_contiguous()
    assert torch.equal(d_packed, torch.cat([dg, du], -1))


def test_strided_inputs():
    """Transposed gate, row-strided up, and a packed tensor that is itself a column slice."""
    gate = (torch.randn(40, 24, device=DEVICE) * 2).t().requires_grad_(True)        # [24, 40]
    up = torch.randn(24, 90, device=DEVICE)[:, 5:45].requires_grad_(True)
    _check("geglu_erf", gate, up, torch.float32)
    wide = torch.randn(6, 3, 130, device=DEVICE)
    packed = wide[..., :100].requires_grad_(True)     # row stride 130, last dim contiguous
    _check("swiglu", packed, None, torch.float32)
    _check("swiglu", wide.transpose(0, 1)[..., :100].requires_grad_(True), None, torch.float32)


def test_launch_configs_agree():
    gate, up = torch.randn(37, 203, device=DEVICE) * 2, torch.randn(37, 203, device=DEVICE)
    dy = torch.randn(37, 203, device=DEVICE)
    packed = torch.cat([gate, up], -1)
    base = glu._launch_fwd(gate, up, "gelu_tanh")
    base_bwd = glu._launch_bwd(dy, packed, None, "gelu_tanh")[0]
    configs = ({"BLOCK_M": 1, "BLOCK_N": 64, "num_warps": 1}, {"BLOCK_M": 64, "BLOCK_N": 16},
               {"BLOCK_M": 4, "BLOCK_N": 256})
    for cfg in configs:
        assert torch.equal(glu._launch_fwd(gate, up, "gelu_tanh", config=cfg), base)
        assert torch.equal(glu._launch_fwd(packed, None, "gelu_tanh", config=cfg), base)
        assert torch.equal(glu._launch_bwd(dy, packed, None, "gelu_tanh", config=cfg)[0], base_bwd)


def test_gelu_tails_and_matches_torch():
    g = torch.tensor([-30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0], device=DEVICE)
    u = torch.ones_like(g)
    for approximate in ("none", "tanh"):
        y = geglu(g, u, approximate=approximate)
        assert rel_err(y, F.gelu(g.double(), approximate=approximate)) <= 1e-6


@pytest.mark.parametrize("shape", [(0, 6), (3, 0), (2, 0, 4)])
def test_empty(shape):
    gate, up = _rand(shape, torch.float32), _rand(shape, torch.float32)
    y = swiglu(gate, up)
    assert y.shape == shape
    dg, du = torch.autograd.grad(y, (gate, up), torch.randn_like(y))
    assert dg.shape == shape and du.shape == shape
    packed = _rand(shape[:-1] + (2 * shape[-1],), torch.float32)
    yp = geglu(packed)
    assert yp.shape == shape
    (dp,) = torch.autograd.grad(yp, packed, torch.randn_like(yp))
    assert dp.shape == packed.shape


@pytest.mark.parametrize("call,exc,match", [
    (lambda g, u: swiglu(g.tolist(), u), TypeError, "gate must be a torch.Tensor"),
    (lambda g, u: swiglu(g, u.tolist()), TypeError, "up must be a torch.Tensor"),
    (lambda g, u: swiglu(g.int(), None), TypeError, "gate has dtype int32"),
    (lambda g, u: swiglu(g[0, 0], None), ValueError, "gate must have at least 1"),
    (lambda g, u: swiglu(g[:, :7]), ValueError, "even last dimension"),
    (lambda g, u: swiglu(g, u[:, :5]), ValueError, "up has shape"),
    (lambda g, u: swiglu(g, u.half()), TypeError, "up has dtype"),
    (lambda g, u: geglu(g, u, approximate="erf"), ValueError, "approximate must be"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.randn(3, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# SwiGLUMLP
# ----------------------------------------------------------------------------------------------


class _HandBuiltLlamaMLP(torch.nn.Module):
    """What transformers' LlamaMLP is: three Linear layers, down(act(gate(x)) * up(x))."""

    def __init__(self, hidden, inter, bias, act):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("hidden_act,act", [
    ("silu", F.silu), ("gelu", F.gelu), ("gelu_pytorch_tanh", lambda z: F.gelu(z, approximate="tanh")),
])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_mlp_loads_a_llama_mlp_state_dict(hidden_act, act, bias):
    ref = _HandBuiltLlamaMLP(24, 56, bias, act).to(DEVICE)
    mlp = SwiGLUMLP(24, 56, bias=bias, hidden_act=hidden_act).to(DEVICE)
    mlp.load_state_dict(ref.state_dict())                 # strict: the same keys, the same shapes
    assert list(mlp.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 5, 24, device=DEVICE, requires_grad=True)
    y, y_ref = mlp(x), ref(x)
    assert rel_err(y, y_ref) <= 1e-5
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    ref_grads = torch.autograd.grad(y_ref, [x, *ref.parameters()], dy)
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) <= 1e-5


def test_swiglu_mlp_matches_transformers_llama_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_attention_heads=4,
                                      hidden_act="silu", mlp_bias=False)
    ref = LlamaMLP(config).to(DEVICE)
    mlp = SwiGLUMLP(32, 88).to(DEVICE)
    mlp.load_state_dict(ref.state_dict())
    x = torch.randn(3, 32, device=DEVICE)
    assert rel_err(mlp(x), ref(x)) <= 1e-5


def test_swiglu_mlp_rejects_unknown_act():
    with pytest.raises(ValueError, match="hidden_act"):
        SwiGLUMLP(8, 16, hidden_act="relu")
