"""attention / attention_varlen forward and the SDPA wrapper, beyond the registry sweep.

Rule (flash-attn's): the kernel's max abs error vs the fp64 reference is at most twice the error
PyTorch makes in the same dtype (plain matmul / softmax in that dtype) plus a small atol; fp32
runs by relative error norm. Cases: MHA/GQA/MQA, causal with S_q != S_k both ways, windows,
softcap, custom scale, padded head dims, lengths off the tile, S_q = 1, empties, varlen with
sequences of length 0 and 1, every load path of the kernel, the SDPA wrapper (top-left causal),
torch.compile, the CPU reference path and bad input. Gradients end to end when the backward
module is present (its own tests are tests/test_attention_bwd.py).
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse._dispatch import use_triton
from tilefuse.nn.functional import scaled_dot_product_attention
from tilefuse.ops import attention as attention_module   # registers the ops
from tilefuse.ops._attention_common import attention_reference, attention_varlen_reference, exp2_mixed, visible_mask
from tilefuse._dispatch import device_major, is_hopper
from tilefuse.ops._attention_fwd_kernels import LOAD_MODES, _use_gluon, attention_forward
from tilefuse.ops.attention import attention, attention_varlen
from tilefuse.testing import rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _rand(shape, dtype, grad=False):
    return torch.randn(shape, device=DEVICE).to(dtype).requires_grad_(grad)


def _torch_same_dtype(q, k, v, causal, window, softcap, scale):
    """(out, lse) by plain PyTorch ops in q's dtype: the baseline error of the flash-attn rule."""
    left, right = attention_module.normalize_window(causal, window)
    scale = attention_module.normalize_scale(scale, q.shape[-1])
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    s = (qt @ kt.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = visible_mask(q.shape[1], k.shape[1], left, right, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vt).transpose(1, 2), lse


def _max_err(x, ref):
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(x), torch.isinf(ref)), "-inf rows differ"
    return (x.double()[fin] - ref.double()[fin]).abs().max().item() if fin.any() else 0.0


def _check_dense(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, config=None):
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    if config is None:
        out, lse = attention(q, k, v, return_lse=True, **kw)
    else:   # a specific launch config of the kernel (load path, tiles)
        left, right = attention_module._bounds(causal, window)
        out, lse = attention_forward(q, k, v, scale=attention_module.normalize_scale(scale, q.shape[-1]),
                                     window_left=left, window_right=right, softcap=softcap, config=config)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    if q.dtype == torch.float32:
        assert rel_err(out, ref) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5
        return
    base_out, base_lse = _torch_same_dtype(q, k, v, causal, window, softcap, scale)
    assert _max_err(out, ref) <= 2 * _max_err(base_out, ref) + ATOL[q.dtype]
    assert _max_err(lse, ref_lse) <= 2 * _max_err(base_lse.float(), ref_lse) + ATOL[q.dtype]


# (B, S_q, S_k, H_q, H_kv, D, causal, window, softcap, scale)
CASES = [
    (2, 19, 19, 2, 2, 32, False, (-1, -1), 0.0, None),      # MHA
    (1, 23, 37, 4, 2, 24, True, (-1, -1), 0.0, None),       # GQA, causal S_q < S_k
    (1, 37, 23, 3, 1, 40, True, (-1, -1), 0.0, None),       # MQA, causal S_q > S_k: rows see nothing
    (1, 33, 33, 2, 1, 64, False, (5, -1), 0.0, None),       # left window only
    (1, 30, 41, 2, 2, 16, False, (-1, 4), 0.0, None),       # right window only
    (2, 35, 28, 2, 2, 8, True, (6, 3), 0.0, None),          # both (causal tightens right to 0)
    (1, 29, 29, 2, 2, 32, True, (-1, -1), 3.0, None),       # softcap
    (1, 17, 40, 2, 1, 48, False, (-1, -1), 0.0, 0.37),      # custom scale, D padded to 64
    (2, 1, 21, 2, 2, 32, True, (-1, -1), 0.0, None),        # S_q = 1 (decode-like)
    (1, 48, 48, 2, 2, 32, True, (-1, -1), 0.0, None),       # lengths a multiple of the tile
    (1, 5, 9, 2, 1, 16, False, (-1, 2**31 - 1), 0.0, None),  # int32-max windows equal none: no
    (1, 9, 5, 2, 1, 16, True, (2**31 - 3, 0), 0.0, None),    # wrap-around in the kernels' sums
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-c{int(c[6])}-w{c[7]}-s{c[8]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_matches_reference(case, dtype):
    b, s_q, s_k, h_q, h_kv, d, causal, window, softcap, scale = case
    q, k, v = _rand((b, s_q, h_q, d), dtype), _rand((b, s_k, h_kv, d), dtype), _rand((b, s_k, h_kv, d), dtype)
    _check_dense(q, k, v, causal, window, softcap, scale)


@pytest.mark.parametrize("load", LOAD_MODES)
def test_every_load_path(load):
    q = _rand((2, 21, 4, 40), torch.float32)
    k, v = _rand((2, 34, 2, 40), torch.float32), _rand((2, 34, 2, 40), torch.float32)
    _check_dense(q, k, v, causal=True, config={"LOAD": load})
    _check_dense(q, k, v, window=(7, 2), softcap=2.0, config={"LOAD": load, "BLOCK_M": 32, "BLOCK_N": 16})


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("load", LOAD_MODES)
def test_interior_lengths_and_scale_sign(load, lag):
    """Lengths that give the unmasked interior 0, 1, 2 and several 16-key blocks, with and without
    a window and softcap, and a negative scale (the max does not commute with it: the unfolded
    scale path); PV_LAG: the interior's P·V one block late (its first and last steps)."""
    cfg = {"LOAD": load, "BLOCK_M": 16, "BLOCK_N": 16, "PV_LAG": lag}
    for s_k in (9, 16, 33, 80):
        q, k, v = _rand((2, 24, 2, 32), torch.float32), _rand((2, s_k, 1, 32), torch.float32), _rand((2, s_k, 1, 32), torch.float32)
        _check_dense(q, k, v, config=cfg)
        _check_dense(q, k, v, causal=True, config=cfg)
        _check_dense(q, k, v, window=(20, 3), softcap=5.0, config=cfg)
        _check_dense(q, k, v, scale=-0.2, config=cfg)


@triton.jit
def _exp2_mixed_kernel(x_ptr, y_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, PARTS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(y_ptr + offs, exp2_mixed(tl.load(x_ptr + offs), ROWS, COLS, PARTS))


@pytest.mark.parametrize("parts", [0, 2, 4, 8])
def test_exp2_mixed_elementwise(parts):
    """Every element within 1e-4 relative of fp64 exp2 (the polynomial's fit: 7.5e-5; MUFU's and
    the interpreter's exp2: ~1e-7), the last 1/parts of the columns on the polynomial, exponents
    from 0 down to -140 (clamped to 2^-125 on the polynomial's columns only)."""
    x = -torch.rand(32, 64, device=DEVICE) * 30
    x[:, ::7] = torch.linspace(-140, 0, 32, device=DEVICE)[:, None]
    x[0, :] = 0.0
    y = torch.full_like(x, float("nan"))
    _exp2_mixed_kernel[(1,)](x, y, 32, 64, parts)
    ref = torch.exp2(x.double())
    poly = torch.zeros(64, dtype=torch.bool, device=DEVICE)
    if parts:
        poly[64 - 64 // parts:] = True
    normal = x > -125
    rel = (y.double() - ref).abs() / ref
    assert rel[normal].max() <= 1e-4
    assert rel[normal & ~poly].max() <= 1e-6                   # MUFU (or torch) columns
    if parts:   # the polynomial ran there: its error shows
        assert (rel[normal & poly] > 1e-6).sum() > 0.5 * (normal & poly).sum()
    tiny = ~normal
    assert ((y[tiny & poly].double() * 2.0 ** 125 - 1).abs() <= 1e-4).all()
    assert (y[tiny & ~poly].double() - ref[tiny & ~poly]).abs().max() <= 2.0 ** -125


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_exp2_on_fma_pipe(parts):
    """EXP2_FMA_PARTS: 1/parts of the interior blocks' exp2s by the FMA-pipe polynomial (fp16: the
    16-bit probabilities it feeds); masked edge blocks keep MUFU, rows that see nothing stay -inf."""
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "EXP2_FMA_PARTS": parts}
    q, k, v = _rand((2, 40, 2, 32), torch.float16), _rand((2, 70, 1, 32), torch.float16), _rand((2, 70, 1, 32), torch.float16)
    _check_dense(q, k, v, config=cfg)
    _check_dense(q, k, v, causal=True, config=cfg)
    _check_dense(q * 8, k, v, window=(30, 2), config=cfg)       # sharper rows: exponents far below 0
    _check_dense(q[:, :60], k[:, :20], v[:, :20], causal=True, config=cfg)     # S_q > S_k: empty rows


def test_strided_inputs():
    """q, k, v as views into one packed qkv tensor, and [B, H, S, D] tensors transposed."""
    qkv = _rand((2, 25, 3, 4, 32), torch.float32)
    _check_dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    q, k, v = (_rand((2, 4, 25, 32), torch.float32).transpose(1, 2) for _ in range(3))
    _check_dense(q, k, v)
    _check_dense(q[..., :24], k[..., :24], v[..., :24], config={"LOAD": "desc_bhsd"})   # rows not 16-B aligned


@settings(max_examples=8, deadline=None)
@given(s_q=st.integers(1, 40), s_k=st.integers(1, 40), group=st.sampled_from([1, 2]), d=st.sampled_from([8, 24, 32]),
       causal=st.booleans(), left=st.integers(-1, 12), right=st.integers(-1, 12), softcap=st.sampled_from([0.0, 4.0]))
def test_random_shapes(s_q, s_k, group, d, causal, left, right, softcap):
    q = _rand((1, s_q, 2 * group, d), torch.float32)
    k, v = _rand((1, s_k, 2, d), torch.float32), _rand((1, s_k, 2, d), torch.float32)
    _check_dense(q, k, v, causal, (left, right), softcap)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 2))])
def test_varlen_matches_reference(dtype, causal, window):
    lens_q, lens_k = [17, 0, 1, 9, 33, 1], [20, 5, 0, 1, 33, 1]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = _rand((sum(lens_q), 4, 24), dtype)
    k, v = _rand((sum(lens_k), 2, 24), dtype), _rand((sum(lens_k), 2, 24), dtype)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window=window,
                                return_lse=True)
    ref, ref_lse = attention_varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                                              window=window, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(out, ref) <= tol and rel_err(lse, ref_lse) <= 1e-5
    # a sequence equals the dense op on it alone (the 4th: 9 queries, 1 key at rows 25..25)
    dense = attention(q[18:27][None], k[25:26][None], v[25:26][None], causal=causal, window=window)
    assert rel_err(out[18:27], dense[0]) <= tol


@pytest.mark.parametrize("load", ["ptr", "desc_device"])
def test_varlen_load_paths(load):
    """Both varlen load paths, tiles smaller than the sequences and longer than some: pointer
    loads, and descriptors built in the kernel per (sequence, head), whose bounds must zero the
    rows of the next sequence and clip the output tile's store at the sequence's end; the lagged
    P·V (PV_LAG) on both."""
    lens_q, lens_k = [37, 0, 1, 16, 50], [40, 7, 0, 17, 50]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = _rand((sum(lens_q), 4, 32), torch.float32)
    k, v = _rand((sum(lens_k), 2, 32), torch.float32), _rand((sum(lens_k), 2, 32), torch.float32)
    for causal in (False, True):
        for lag in (False, True):
            cfg = {"LOAD": load, "BLOCK_M": 16, "BLOCK_N": 16, "PV_LAG": lag}
            out, lse = attention_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale=0.3,
                                         window_right=0 if causal else None, config=cfg)
            ref, ref_lse = attention_varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                      causal=causal, scale=0.3, return_lse=True)
            assert rel_err(out, ref) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5, (causal, lag)


@pytest.mark.parametrize("s_q,s_k,h_q,h_kv", [(19, 19, 2, 2), (29, 13, 4, 2), (13, 29, 4, 1), (1, 9, 2, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_wrapper(s_q, s_k, h_q, h_kv, is_causal):
    """Top-left causal as torch's SDPA, GQA via enable_gqa, [B, H, S, D] in and out."""
    q = _rand((2, h_q, s_q, 32), torch.float32)
    k, v = _rand((2, h_kv, s_k, 32), torch.float32), _rand((2, h_kv, s_k, 32), torch.float32)
    gqa = h_q != h_kv
    out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=0.2)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                         enable_gqa=gqa, scale=0.2)
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5


def test_sdpa_wrapper_fallbacks():
    """attn_mask, dropout and unsupported head dims run torch's SDPA (the same numbers)."""
    q, k, v = (_rand((1, 2, 9, 32), torch.float32) for _ in range(3))
    mask = torch.rand(9, 9, device=DEVICE) > 0.3
    assert torch.equal(scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    q12, k12, v12 = (_rand((1, 2, 9, 12), torch.float32) for _ in range(3))
    assert torch.equal(scaled_dot_product_attention(q12, k12, v12), F.scaled_dot_product_attention(q12, k12, v12))
    torch.manual_seed(3)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(a, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    k1, v1 = k[:, :1], v[:, :1]             # 2 query heads, 1 kv head, no enable_gqa: torch broadcasts
    assert torch.equal(scaled_dot_product_attention(q, k1, v1), F.scaled_dot_product_attention(q, k1, v1))
    k3 = _rand((1, 3, 9, 32), torch.float32)
    with pytest.raises(RuntimeError):       # head counts that do not match: torch's own error
        scaled_dot_product_attention(q, k3, k3)
    q0 = _rand((1, 0, 9, 32), torch.float32)  # no heads: torch's empty output
    assert scaled_dot_product_attention(q0, q0, q0).shape == q0.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_group_orders_programs_only(dtype):
    """B·H = 6, causal and left-windowed: every HEAD_GROUP dividing 6 (the program order of
    ``schedule_grid``) gives the same output and lse, bitwise, within the reference's tolerance;
    on sm_90 at D = 64 / 128 in bf16 this runs the Gluon forward. A group that does not divide
    B·H is a ValueError."""
    d, s = (64, 300) if HAS_CUDA else (16, 90)      # the interpreter: few blocks
    q, k, v = (_rand((2, s, 3, d), dtype) for _ in range(3))
    for left, right in ((None, 0), (40, None)):
        run = lambda g: attention_forward(q, k, v, scale=d ** -0.5, window_left=left, window_right=right,  # noqa: E731
                                          config=None if g is None else {"HEAD_GROUP": g})
        first = run(1)
        for g in (2, 3, 6, None):
            out, lse = run(g)
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), g
        with pytest.raises(ValueError, match="HEAD_GROUP"):
            run(4)
    _check_dense(q, k, v, causal=True, config={"HEAD_GROUP": 3})


def test_empty():
    f32 = torch.float32
    assert attention(_rand((0, 5, 2, 16), f32), _rand((0, 7, 2, 16), f32), _rand((0, 7, 2, 16), f32)).shape == (0, 5, 2, 16)
    out, lse = attention(_rand((2, 0, 2, 16), f32), _rand((2, 7, 2, 16), f32), _rand((2, 7, 2, 16), f32), return_lse=True)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    out, lse = attention(_rand((2, 3, 2, 16), f32), _rand((2, 0, 1, 16), f32), _rand((2, 0, 1, 16), f32), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    cu = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    out, lse = attention_varlen(_rand((0, 2, 16), f32), _rand((0, 2, 16), f32), _rand((0, 2, 16), f32), cu, cu, 0, 0,
                                return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_lse_has_no_gradient():
    q, k, v = (_rand((1, 5, 2, 16), torch.float32, grad=True) for _ in range(3))
    out, lse = attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_compile_fullgraph():
    q, k, v = (_rand((1, 13, 2, 16), torch.float32) for _ in range(3))
    fn = torch.compile(lambda a, b, c: attention(a, b, c, causal=True, window=(5, -1)) * 2, fullgraph=True,
                       backend="aot_eager")
    assert rel_err(fn(q, k, v), attention(q, k, v, causal=True, window=(5, -1)) * 2) == 0.0


@pytest.mark.parametrize("path", ["kernels", "cpu-reference"])
def test_compiled_backward(monkeypatch, path):
    """The backward through torch.compile's graph (the dispatcher path): the CPU reference's
    backward builds its graph by autograd, which recorded nothing below the Autograd keys and
    raised "element 0 of tensors does not require grad" (s37 finding)."""
    if path == "cpu-reference":
        if DEVICE != "cpu":
            pytest.skip("the reference path is the CPU path")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (_rand((1, 11, 2, 16), torch.float32, grad=True) for _ in range(3))
    fn = torch.compile(lambda a, b, c: attention(a, b, c, causal=True), fullgraph=True, backend="aot_eager")
    dout = torch.randn(1, 11, 2, 16, device=DEVICE)
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    refs = torch.autograd.grad(attention(q, k, v, causal=True), (q, k, v), dout)
    for g, r in zip(grads, refs):
        assert rel_err(g, r) <= 1e-6


@pytest.mark.parametrize("path", ["kernels", "cpu-reference"])
def test_varlen_padded_buffers(monkeypatch, path):
    """Packed buffers with rows before cu[0] and after cu[-1] (padding): those rows get out 0,
    lse -inf and zero dq / dk / dv; the kernels left them unwritten (NaN under poison, stale
    memory otherwise: dk of 1e35 that then reached the weight gradients; s37 audit) and the CPU
    path returned only the covered rows."""
    if path == "cpu-reference":
        if DEVICE != "cpu":
            pytest.skip("the reference path is the CPU path")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = _rand((14, 2, 16), torch.float32, grad=True)
    k, v = (_rand((15, 2, 16), torch.float32, grad=True) for _ in range(2))
    cu_q = torch.tensor([2, 5, 11], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([1, 6, 13], dtype=torch.int32, device=DEVICE)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 6, 7, causal=True, return_lse=True)
    ref, ref_lse = attention_varlen_reference(*(t.double() for t in (q, k, v)), cu_q, cu_k, causal=True,
                                              return_lse=True)
    assert out.shape == q.shape and rel_err(out, ref) <= 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.isinf(lse[:, :2]).all()
    assert not out[:2].any() and not out[11:].any()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = torch.autograd.grad(ref, (q, k, v), dout.double())
    for g, r, (lo, hi) in zip(grads, refs, ((2, 11), (1, 13), (1, 13))):
        assert rel_err(g, r) <= 1e-5 and not g[:lo].any() and not g[hi:].any()


def test_compile_dynamic_shapes_default_options():
    """dynamic=True turns the float defaults into SymFloats: math.isinf on softcap failed to trace
    (the s37 audit); the options are now checked by comparisons."""
    q, k, v = (_rand((1, n, 2, 16), torch.float32) for n in (9, 12, 12))
    fn = torch.compile(lambda a, b, c: attention(a, b, c, causal=True), fullgraph=True, dynamic=True,
                       backend="eager")
    assert rel_err(fn(q, k, v), attention(q, k, v, causal=True)) == 0.0


def test_varlen_plan_checks_the_tensors_own_strides():
    """The varlen plan adds a batch stride 0 in front of each tensor's strides; the descriptor test
    zipped those against the 3-D shapes, one dim off, so a head stride of 72 bytes (a slice of a
    [.., 36] buffer) got in-kernel TMA descriptors (base / stride not 16-byte aligned)."""
    from tilefuse.ops._attention_fwd_kernels import _forward_plan

    x = torch.randn(40, 4, 36, dtype=torch.float16)
    q, k = x[..., :32], torch.randn(40, 2, 32, dtype=torch.float16)
    plan = _forward_plan(tuple(q.shape), tuple(k.shape), (q.stride(), k.stride(), k.stride()), torch.float16, 9, True,
                         True, 1, 4096, 4096, 0.1, None, None, 0.0, (), 132)
    assert plan.load == "ptr"
    plan = _forward_plan(tuple(k.shape), tuple(k.shape), (k.stride(),) * 3, torch.float16, 9, True,
                         True, 1, 4096, 4096, 0.1, None, None, 0.0, (), 132)
    assert plan.load == "desc_device"     # aligned: the descriptors stay


def test_cpu_reference_path(monkeypatch):
    """Without the interpreter CPU tensors take the reference path, internal bounds included."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = torch.randn(1, 3, 11, 16), torch.randn(1, 3, 7, 16), torch.randn(1, 3, 7, 16)
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert rel_err(scaled_dot_product_attention(q, k, v, is_causal=causal), ref) <= 1e-5
        ref = F.scaled_dot_product_attention(q[:, :, :5], k, v, is_causal=causal)
        assert rel_err(scaled_dot_product_attention(q[:, :, :5], k, v, is_causal=causal), ref) <= 1e-5


@pytest.mark.parametrize("path", ["kernels", "cpu-reference"])
def test_windows_past_int64_are_no_windows(monkeypatch, path):
    """A side of 2^64 or more (past int64) is no bound on every path: the CPU reference compared
    it with its int64 index tensors and raised OverflowError (s37 audit)."""
    if path == "cpu-reference":
        if DEVICE != "cpu":
            pytest.skip("the reference path is the CPU path")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    from tilefuse import attention_decode

    q, k = torch.randn(1, 5, 2, 16, device=DEVICE), torch.randn(1, 7, 2, 16, device=DEVICE)
    assert torch.equal(attention(q, k, k, window=(2**64, 0)), attention(q, k, k, window=(-1, 0)))
    assert torch.equal(attention(q, k, k, window=(-1, 2**70)), attention(q, k, k))
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (5, 7))
    assert torch.equal(attention_varlen(q[0], k[0], k[0], cu_q, cu_k, 5, 7, window=(2**64, 0)),
                       attention_varlen(q[0], k[0], k[0], cu_q, cu_k, 5, 7, window=(-1, 0)))
    kc, lens = torch.randn(1, 40, 2, 16, device=DEVICE), torch.tensor([20], dtype=torch.int32, device=DEVICE)
    assert torch.equal(attention_decode(q[:, :1], kc, kc, lens, window=(2**64, 0)),
                       attention_decode(q[:, :1], kc, kc, lens, window=(-1, 0)))


def test_bad_input():
    f32 = torch.float32
    q, k, v = _rand((1, 4, 4, 16), f32), _rand((1, 4, 2, 16), f32), _rand((1, 4, 2, 16), f32)
    with pytest.raises(ValueError, match="multiple of k's"):
        attention(_rand((1, 4, 3, 16), f32), k, v)
    with pytest.raises(ValueError, match="head dim"):
        attention(*(_rand((1, 4, 2, 264), f32) for _ in range(3)))
    with pytest.raises(ValueError, match="head dim"):
        attention(*(_rand((1, 4, 2, 12), f32) for _ in range(3)))
    with pytest.raises(TypeError, match="q has dtype"):
        attention(q.double(), k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        attention(q, k.half(), v)
    with pytest.raises(TypeError, match="window"):
        attention(q, k, v, window=(1.5, 2))
    with pytest.raises(TypeError, match="window"):
        attention(q, k, v, window=4)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match="causal"):
        attention(q, k, v, causal=1)
    for softcap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            attention(q, k, v, softcap=softcap)
    for scale in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="v has shape"):
        attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="is on meta"):
        attention(q, k.to("meta"), v)
    qp, kp, vp = q[0], k[0], v[0]
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        attention_varlen(qp, kp, vp, cu.long(), cu, 2, 2)
    with pytest.raises(ValueError, match="cu_seqlens_k has 2 entries"):
        attention_varlen(qp, kp, vp, cu, cu[:2], 2, 2)
    with pytest.raises(ValueError, match="1-D"):
        attention_varlen(qp, kp, vp, cu[None], cu[None], 2, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q is on meta"):
        attention_varlen(qp, kp, vp, cu.to("meta"), cu, 2, 2)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        attention_varlen(qp, kp, vp, cu, cu, 2.0, 2)
    with pytest.raises(TypeError, match="window"):
        attention_varlen(qp, kp, vp, cu, cu, 2, 2, window=(None, 1))
    with pytest.raises(ValueError, match="3-D"):
        attention_varlen(q, k, v, cu, cu, 2, 2)
    if DEVICE != "cpu":
        return          # on a GPU the offsets' values fail a device assertion: the subprocess test below
    bad = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)          # past the 4 rows
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 5"):
        attention_varlen(qp, kp, vp, bad, cu, 3, 2)
    with pytest.raises(ValueError, match="cu_seqlens_k must start"):
        attention_varlen(qp, kp, vp, cu, torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE), 2, 3)
    with pytest.raises(ValueError, match="max_seqlen_k=1"):
        attention_varlen(qp, kp, vp, cu, cu, 2, 1)


@pytest.mark.parametrize("change", [None, ("q", 1, 9), ("k", 0, -1), ("k", 2, 2), ("q", 3, 20), ("max_q", 0, 4)])
def test_cu_seqlens_check_kernel(change):
    """The GPU's offset check (a flag, then a queued assertion), run by the interpreter here:
    valid offsets pass, each rule broken once fails."""
    if not use_triton(torch.empty(0, device=DEVICE)):
        pytest.skip("the kernel runs on the GPU or under the interpreter")
    cu = {"q": [0, 5, 5, 12], "k": [0, 3, 8, 8]}
    bounds = {"max_q": 7, "max_k": 5}
    if change is not None and change[0] in cu:
        cu[change[0]][change[1]] = change[2]
    elif change is not None:
        bounds[change[0]] = change[2]
    ok = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
    cu_q, cu_k = (torch.tensor(cu[n], dtype=torch.int32, device=DEVICE) for n in "qk")
    attention_module.cu_seqlens_check_kernel[(1,)](cu_q, cu_k, ok, 4, 12, 8, bounds["max_q"], bounds["max_k"],
                                                   BLOCK=2)
    assert ok.item() == (change is None)


# ---- end to end with the backward (skipped while its module is missing) ----------------------


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (5, 3), 2.0)])
def test_autograd_dense(causal, window, softcap):
    pytest.importorskip("tilefuse.ops._attention_bwd")
    q = _rand((2, 19, 4, 24), torch.float32, grad=True)
    k, v = _rand((2, 26, 2, 24), torch.float32, grad=True), _rand((2, 26, 2, 24), torch.float32, grad=True)
    kw = dict(causal=causal, window=window, softcap=softcap)
    out = attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_grads = torch.autograd.grad(attention_reference(*leaves, **kw), leaves, dout.double())
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 1e-5


def test_autograd_varlen_and_sdpa():
    pytest.importorskip("tilefuse.ops._attention_bwd")
    lens = [9, 0, 1, 14]
    cu = torch.tensor([0, 9, 9, 10, 24], dtype=torch.int32, device=DEVICE)
    q, k, v = (_rand((sum(lens), 2, 16), torch.float32, grad=True) for _ in range(3))
    out = attention_varlen(q, k, v, cu, cu, 14, 14, causal=True)
    dout = torch.randn_like(out)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = attention_varlen_reference(*leaves, cu, cu, causal=True)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, leaves, dout.double())):
        assert rel_err(g, r) <= 1e-5
    qs = _rand((1, 2, 11, 16), torch.float32, grad=True)
    ks, vs = _rand((1, 2, 7, 16), torch.float32, grad=True), _rand((1, 2, 7, 16), torch.float32, grad=True)
    out = scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    leaves = [t.detach().double().requires_grad_(True) for t in (qs, ks, vs)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (qs, ks, vs), dout), torch.autograd.grad(ref, leaves, dout.double())):
        assert rel_err(g, r) <= 1e-5


# ---- GPU: bf16, large and odd shapes, every load path and tile config ----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256, 136])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(d, causal, dtype):
    q, k, v = _rand((2, 1000, 8, d), dtype), _rand((2, 1531, 2, d), dtype), _rand((2, 1531, 2, d), dtype)
    _check_dense(q, k, v, causal=causal)
    _check_dense(q[:, :777], k[:, :777], v[:, :777], causal=causal, window=(300, 17), softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("load", LOAD_MODES)
@pytest.mark.parametrize("tiles", [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2)])
@pytest.mark.parametrize("lag", [False, True])
def test_gpu_configs(load, tiles, lag):
    bm, bn, w, s = tiles
    q, k, v = (_rand((2, 2048, 4, 128), torch.bfloat16) for _ in range(3))
    cfg = {"LOAD": load, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "PV_LAG": lag}
    _check_dense(q, k, v, config=cfg)
    _check_dense(q, k, v, causal=True, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_exp2_on_fma_pipe(parts, dtype):
    q, k, v = (_rand((2, 2048, 4, 128), dtype) for _ in range(3))
    for tiles in ((128, 128, 8, 3), (64, 64, 4, 3)):
        cfg = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tiles), EXP2_FMA_PARTS=parts)
        _check_dense(q, k, v, config=cfg)
        _check_dense(q, k, v, causal=True, config=cfg)
        _check_dense(q * 4, k, v, softcap=30.0, config=cfg)


# (B, S_q, S_k, H_q, H_kv): S_q = 1, both lengths off the 128-row / key tiles with GQA, S_q > S_k
# (causal rows that see nothing), several hundred key blocks per program
WS_SHAPES = [(1, 1, 21, 2, 2), (2, 65, 129, 4, 2), (1, 1000, 1531, 8, 2), (1, 300, 200, 2, 1), (2, 2048, 2048, 4, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [{}, {"STAGES": 2}, {"BLOCK_N": 64, "EXP2_FMA_PARTS": 0}], ids=["default", "stages2", "n64"])
def test_gpu_warp_specialized_forward(d, dtype, cfg):
    """The Gluon kernel (sm_90) by the flash-attn rule at every masking mode, a negative scale
    (no folding into the exp2) and softcap; its output also within bf16 rounding of the tl kernel's."""
    if not is_hopper(torch.empty(0, device=DEVICE)):
        pytest.skip("the warp-specialized forward is sm_90 only")
    config = dict(cfg, GLUON=True)
    for b, s_q, s_k, h_q, h_kv in WS_SHAPES:
        q, k, v = _rand((b, s_q, h_q, d), dtype), _rand((b, s_k, h_kv, d), dtype), _rand((b, s_k, h_kv, d), dtype)
        _check_dense(q, k, v, config=config)
        _check_dense(q, k, v, causal=True, config=config)
        _check_dense(q, k, v, window=(100, 7), softcap=20.0, config=config)
        _check_dense(q, k, v, causal=True, scale=-0.3, config=config)
        ws, ws_lse = attention_forward(q, k, v, scale=d ** -0.5, window_right=0, config=config)
        tl_out, tl_lse = attention_forward(q, k, v, scale=d ** -0.5, window_right=0, config={"GLUON": False})
        assert rel_err(ws, tl_out) <= 1e-2 and rel_err(ws_lse, tl_lse) <= 1e-5


@pytest.mark.gpu
def test_gpu_default_forward_is_warp_specialized():
    """On sm_90 the public API reaches the Gluon kernel for dense 16-bit D = 64 / 128 where it is
    the faster kernel, and the tl kernel otherwise."""
    x = _rand((1, 64, 2, 128), torch.bfloat16)
    hopper = is_hopper(x)
    major = device_major(x)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert _use_gluon(major, bf16, 128, False, "desc_bhsd", None, False, 4096) == hopper
    assert not _use_gluon(major, bf16, 128, False, "desc_bhsd", None, True, 1024)          # short causal: tl
    assert not _use_gluon(major, bf16, 128, True, "desc_device", None, False, 4096)        # varlen
    assert not _use_gluon(major, fp32, 128, False, "desc_bhsd", None, False, 4096)         # fp32
    assert not _use_gluon(major, bf16, 96, False, "desc_bhsd", None, False, 4096)          # D = 96
    assert not _use_gluon(major, bf16, 128, False, "desc_bhsd", {"BLOCK_M": 64}, False, 4096)   # a tl tile config
    assert _use_gluon(major, bf16, 128, False, "desc_bhsd", {"BLOCK_M": 64, "GLUON": True}, True, 64) == hopper


@pytest.mark.gpu
def test_gpu_flex_peer_backward_retains_graph():
    """The bench times a backward with retain_graph=True, twice on one graph: the FlexAttention
    peer must allow it (compiled without donated buffers)."""
    flex = attention_module._flex_peer()
    if flex is None:
        pytest.skip("no FlexAttention in this torch")
    q, k, v = (_rand((1, 256, 2, 64), torch.bfloat16).requires_grad_(True) for _ in range(3))
    out = flex(q, k, v, causal=True)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
    assert rel_err(out, ref) <= 1e-2
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("load", ["ptr", "desc_device"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_varlen_load_paths(load, d):
    """Both varlen load paths on the GPU with the GPU's tiles (128x128 with P·V lag at D = 128):
    sequences of 0, 1, off-tile and multi-tile lengths, S_q != S_k, causal and windowed."""
    lens_q, lens_k = [1000, 0, 1, 517, 4100, 77], [1000, 9, 0, 600, 4100, 77]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = _rand((sum(lens_q), 8, d), torch.bfloat16)
    k, v = _rand((sum(lens_k), 2, d), torch.bfloat16), _rand((sum(lens_k), 2, d), torch.bfloat16)
    for right, left in ((None, None), (0, None), (0, 300)):
        out, lse = attention_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale=d ** -0.5,
                                     window_left=left, window_right=right, config={"LOAD": load})
        ref, ref_lse = attention_varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                  window=(-1 if left is None else left, -1 if right is None else right),
                                                  return_lse=True)
        assert rel_err(out, ref) <= 1e-2 and rel_err(lse, ref_lse) <= 1e-4, (right, left)


@pytest.mark.gpu
def test_gpu_bad_cu_seqlens_stop_before_the_kernels():
    """Offsets past the rows on the GPU: the queued assertion fails (in a child process: it ends
    the CUDA context) instead of the kernels writing out of bounds."""
    code = ("import torch, tilefuse\n"
            "q = torch.randn(30, 2, 64, device='cuda', dtype=torch.bfloat16)\n"
            "cu = torch.tensor([0, 40], dtype=torch.int32, device='cuda')\n"
            "tilefuse.attention_varlen(q, q, q, cu, cu, 40, 40)\n"
            "torch.cuda.synchronize()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "assert" in run.stderr.lower(), run.stderr[-2000:]


@pytest.mark.gpu
def test_gpu_varlen_fp32_and_sdpa():
    lens = [1000, 0, 1, 517, 2048]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        q, k, v = (_rand((sum(lens), 8, 128), dtype) for _ in range(3))
        out = attention_varlen(q, k, v, cu, cu, 2048, 2048, causal=True)
        assert rel_err(out, attention_varlen_reference(q.double(), k.double(), v.double(), cu, cu, causal=True)) <= tol
    q, k, v = (_rand((2, 16, 1024, 128), torch.bfloat16) for _ in range(3))
    assert rel_err(scaled_dot_product_attention(q, k, v, is_causal=True),
                   F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)) <= 1e-2


@pytest.mark.parametrize("case", [
    (2, 19, 27, 4, 2, 24, True, (-1, -1), 0.0),
    (1, 30, 13, 2, 2, 40, True, (3, -1), 2.0),     # rows that see no key; softcap
    (1, 17, 17, 3, 1, 8, False, (-1, 2), 0.0),
    (2, 5, 40, 2, 1, 16, False, (-1, -1), 5.0),
])
def test_chunked_reference_matches_plain(case):
    """The query-chunked reference (used for the benchmark's long sequences, O(S) memory) gives
    the plain reference's out, lse and gradients: it is the same oracle, only cheaper."""
    from tilefuse.ops._attention_common import attention_reference
    from tilefuse.testing import rel_err
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q = torch.randn(b, sq, hq, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    o1, l1 = attention_reference(q, k, v, causal, window, softcap, return_lse=True)
    o2, l2 = attention_reference(q, k, v, causal, window, softcap, return_lse=True, chunk_rows=4)
    g = torch.randn_like(o1)
    g1, g2 = torch.autograd.grad(o1, (q, k, v), g), torch.autograd.grad(o2, (q, k, v), g)
    assert rel_err(o2, o1) < 1e-13 and rel_err(l2, l1) < 1e-13
    assert all(rel_err(a, b_) < 1e-13 for a, b_ in zip(g2, g1))


@settings(max_examples=60, deadline=None)
@given(s_q=st.integers(0, 70), s_k=st.integers(0, 70), heads=st.integers(1, 4), d=st.sampled_from([16, 64, 128]))
def test_flops_count_the_visible_pairs(s_q, s_k, heads, d):
    """The registry's FLOPs (4·D per (query, key) pair the mask keeps) on the pairs the kernels'
    own mask rule keeps: causal S_q ≠ S_k was counted as the full S_q·S_k (1.5-4.3× at the
    audit's shapes); decode counts through the same helper."""
    from tilefuse.ops import attention_decode as decode_module
    from tilefuse.ops._attention_fwd_kernels import attention_flops

    pairs = int(visible_mask(s_q, s_k, -1, 0).sum())
    assert attention_flops(2, s_q, s_k, heads, d, causal=True) == 4 * 2 * heads * d * pairs
    assert attention_flops(2, s_q, s_k, heads, d, causal=False) == 4 * 2 * heads * d * s_q * s_k
    if s_q <= s_k:
        assert decode_module._flops((3, s_q, heads, 1, s_k, d), "fwd") == 4 * 3 * heads * d * pairs
    from tilefuse import registry

    spec = registry.get("attention_causal")
    assert spec.flops_fn((2, s_q, s_k, heads, heads, d), "fwd") == 4 * 2 * heads * d * pairs
