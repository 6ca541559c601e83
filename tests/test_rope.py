"""rope: HF equivalence (Llama rotate_half, GPT-J rotate_every_two), options and errors.

The registry spec (tests/test_ops.py) covers the default call: NeoX, full rotary, bshd, [S, D]
tables, fwd + bwd for every test shape. Here: both HF formulations written out as HF has them
(and the real Llama one when transformers is importable), position_ids gathers, partial rotary,
GQA, in place, the bhsd layout, packed-qkv views, empty tensors, config overrides, bad input.
"""

import pytest
import torch
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA, count_calls
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse.ops.rope as rope_mod
from tilefuse._dispatch import use_triton
from tilefuse.ops.rope import rope, rope_cos_sin_table, rope_reference, rope_torch

from tilefuse.testing import rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ---- HuggingFace, written out as HF has it -------------------------------------------------


def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_llama_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


def hf_llama_cos_sin(position_ids, dim, base=10000.0):
    """LlamaRotaryEmbedding.forward (default rope type): cos/sin [B, S, dim], in float64 here."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).double() / dim))
    freqs = (inv_freq[None, :, None] * position_ids[:, None, :].double()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def hf_gptj_create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64, device=DEVICE) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(num_pos, dtype=torch.int64, device=DEVICE).double(),
                                inv_freq.double())
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def hf_gptj_rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def hf_gptj_apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (hf_gptj_rotate_every_two(tensor) * sin)


def hf_gptj_attention_rope(query, key, embed_positions, position_ids, rotary_dim):
    """GPTJAttention.forward's rope part; query/key [B, S, H, D] (before the permute)."""
    sincos = embed_positions[position_ids]
    sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    k_rot, k_pass = key[:, :, :, :rotary_dim], key[:, :, :, rotary_dim:]
    q_rot, q_pass = query[:, :, :, :rotary_dim], query[:, :, :, rotary_dim:]
    k_rot = hf_gptj_apply_rotary_pos_emb(k_rot, sin, cos)
    q_rot = hf_gptj_apply_rotary_pos_emb(q_rot, sin, cos)
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


def _rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_(grad)


def _assert_close(outs, refs, dtype):
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == dtype
        assert rel_err(o, r) <= TOL[dtype], rel_err(o, r)


# ---- HF equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_matches_hf_llama(dtype, layout):
    B, S, Hq, Hk, D = 2, 6, 4, 2, 32
    pos = torch.randint(0, 500, (B, S), device=DEVICE)
    cos, sin = hf_llama_cos_sin(pos, D)
    q, k = _rand(B, Hq, S, D, dtype=dtype), _rand(B, Hk, S, D, dtype=dtype)
    ref = hf_llama_apply_rotary_pos_emb(q.double(), k.double(), cos, sin)
    cos_d, sin_d = cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)
    if layout == "bhsd":
        out = rope(q, k, cos_d, sin_d, layout="bhsd")
    else:
        out = [o.transpose(1, 2) for o in rope(q.transpose(1, 2), k.transpose(1, 2), cos_d, sin_d)]
    _assert_close(out, ref, dtype)


def test_matches_real_transformers_llama():
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    B, S, Hq, Hk, D = 2, 5, 4, 2, 16
    cos, sin = hf_llama_cos_sin(torch.arange(S, device=DEVICE)[None].expand(B, S), D)
    q, k = _rand(B, Hq, S, D).double(), _rand(B, Hk, S, D).double()
    ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    _assert_close(rope(q.float(), k.float(), cos.float(), sin.float(), layout="bhsd"), ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_hf_gptj_partial_with_position_ids(dtype):
    B, S, Hq, Hk, D, r, max_pos = 2, 5, 3, 1, 24, 8, 64
    embed_positions = hf_gptj_create_sinusoidal_positions(max_pos, r)
    pos = torch.randint(0, max_pos, (B, S), device=DEVICE)
    q, k = _rand(B, S, Hq, D, dtype=dtype), _rand(B, S, Hk, D, dtype=dtype)
    ref = hf_gptj_attention_rope(q.double(), k.double(), embed_positions, pos, r)
    sin_half, cos_half = embed_positions.split(r // 2, dim=-1)
    cos = cos_half.repeat_interleave(2, -1).to(DEVICE, dtype)
    sin = sin_half.repeat_interleave(2, -1).to(DEVICE, dtype)
    out = rope(q, k, cos, sin, position_ids=pos.to(DEVICE), interleaved=True, rotary_dim=r)
    _assert_close(out, ref, dtype)
    for o, x in zip(out, (q, k)):   # the pass-through features are copied bit for bit
        assert torch.equal(o[..., r:], x[..., r:])


def test_cos_sin_table_matches_hf():
    cos, sin = rope_cos_sin_table(40, 16, dtype=torch.float64, device=DEVICE)
    hf_cos, hf_sin = hf_llama_cos_sin(torch.arange(40, device=DEVICE)[None], 16)
    assert torch.allclose(cos, hf_cos[0]) and torch.allclose(sin, hf_sin[0])
    cos_j, sin_j = rope_cos_sin_table(40, 16, interleaved=True, dtype=torch.float64, device=DEVICE)
    sin_h, cos_h = hf_gptj_create_sinusoidal_positions(40, 16).split(8, -1)
    assert torch.allclose(cos_j[:, 0::2], cos_h) and torch.allclose(sin_j[:, 1::2], sin_h)


# ---- options vs the fp64 reference, forward and backward -------------------------------------


def _check(q, k, cos, sin, dtype, **kw):
    """rope(q, k, ...) and the grads of q and k vs the fp64 reference."""
    out = rope(q, k, cos, sin, **kw)
    ref_args = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                for t in (q, k, cos, sin)]
    ref = rope_reference(*ref_args, **kw)
    _assert_close(out, ref, dtype)
    if q.requires_grad:
        g = [torch.randn_like(o) for o in out]
        grads = torch.autograd.grad(out, (q, k), g)
        ref_grads = torch.autograd.grad(ref, ref_args[:2], [x.double() for x in g])
        _assert_close(grads, ref_grads, dtype)
    return out


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 6), Hq=st.integers(1, 5), Hk=st.integers(1, 3),
       half=st.integers(1, 12), tail=st.integers(0, 5), interleaved=st.booleans(),
       layout=st.sampled_from(["bshd", "bhsd"]), table=st.sampled_from(["S", "1S", "BS", "ids", "ids1d"]),
       dtype=st.sampled_from(DTYPES))
def test_options_match_reference(B, S, Hq, Hk, half, tail, interleaved, layout, table, dtype):
    r, D = 2 * half, 2 * half + tail
    qs, ks = ((B, S, Hq, D), (B, S, Hk, D)) if layout == "bshd" else ((B, Hq, S, D), (B, Hk, S, D))
    q, k = _rand(*qs, dtype=dtype, grad=True), _rand(*ks, dtype=dtype, grad=True)
    max_pos = S + 7
    cos, sin = rope_cos_sin_table(max_pos, r, interleaved=interleaved, dtype=dtype, device=DEVICE)
    kw = dict(interleaved=interleaved, rotary_dim=r if tail else None, layout=layout)
    if table == "ids":
        kw["position_ids"] = torch.randint(0, max_pos, (B, S), device=DEVICE, dtype=torch.int32)
    elif table == "ids1d":
        kw["position_ids"] = torch.randperm(max_pos, device=DEVICE)[:S]
    else:
        perm = torch.randint(0, max_pos, (B, S), device=DEVICE)
        cos, sin = cos[perm], sin[perm]                      # [B, S, r]: a table per sequence
        cos, sin = {"S": (cos[0], sin[0]), "1S": (cos[:1], sin[:1]), "BS": (cos, sin)}[table]
    _check(q, k, cos, sin, dtype, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_qkv_views_no_copy(dtype):
    B, S, Hq, Hk, D = 2, 5, 4, 2, 16
    qkv = _rand(B, S, Hq + 2 * Hk, D, dtype=dtype, grad=True)
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
    cos, sin = rope_cos_sin_table(S, D, dtype=dtype, device=DEVICE)
    out = rope(q, k, cos, sin)
    ref = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    _assert_close(out, ref, dtype)
    assert out[0].is_contiguous() and out[1].is_contiguous()
    (g,) = torch.autograd.grad(out, qkv, [torch.ones_like(o) for o in out])
    assert torch.equal(g[:, :, Hq + Hk:], torch.zeros_like(g[:, :, Hq + Hk:]))   # v gets nothing


def test_output_keeps_memory_order():
    q = _rand(2, 5, 3, 8).transpose(1, 2)          # HF: [B, H, S, D] view of bshd memory
    k = _rand(2, 1, 5, 8)                           # contiguous bhsd
    cos, sin = rope_cos_sin_table(5, 8, device=DEVICE)
    q_out, k_out = rope(q, k, cos, sin, layout="bhsd")
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_last_dim_strided_input_out_of_place():
    q = _rand(1, 4, 8, 2).transpose(-1, -2)        # [1, 4, 2, 8] with stride 2 along D
    k = _rand(1, 4, 1, 8)
    cos, sin = rope_cos_sin_table(4, 8, device=DEVICE)
    assert q.stride(-1) != 1
    _check(q, k, cos, sin, torch.float32)


def test_inplace_matches_out_of_place_and_leaves_tail_and_v():
    B, S, Hq, Hk, D, r = 2, 5, 3, 1, 20, 12
    qkv = _rand(B, S, Hq + 2 * Hk, D)
    before = qkv.clone()
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
    cos, sin = rope_cos_sin_table(S, r, device=DEVICE)
    expect = rope(q, k, cos, sin, rotary_dim=r)
    q_ptr = q.data_ptr()
    q_out, k_out = rope(q, k, cos, sin, rotary_dim=r, inplace=True)
    assert q_out is q and k_out is k and q.data_ptr() == q_ptr
    assert rel_err(q, expect[0]) <= 1e-6 and rel_err(k, expect[1]) <= 1e-6
    assert torch.equal(qkv[..., r:], before[..., r:])                # tail untouched
    assert torch.equal(qkv[:, :, Hq + Hk:], before[:, :, Hq + Hk:])  # v untouched


def test_inplace_refuses_autograd():
    q, k = _rand(1, 3, 2, 8, grad=True), _rand(1, 3, 1, 8)
    cos, sin = rope_cos_sin_table(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="q requires grad"):
        rope(q, k, cos, sin, inplace=True)
    with torch.no_grad():
        rope(q, k, cos, sin, inplace=True)   # inference: fine


def test_only_q_used_gives_zero_grad_for_k():
    q, k = _rand(1, 3, 2, 8, grad=True), _rand(1, 3, 1, 8, grad=True)
    cos, sin = rope_cos_sin_table(3, 8, device=DEVICE)
    rope(q, k, cos, sin)[0].sum().backward()
    assert k.grad is None or torch.equal(k.grad, torch.zeros_like(k))


@pytest.mark.parametrize("shape", [(0, 4, 2, 1, 8), (2, 0, 2, 1, 8), (1, 3, 0, 0, 8)])
def test_empty(shape):
    B, S, Hq, Hk, D = shape
    q, k = _rand(B, S, Hq, D, grad=True), _rand(B, S, Hk, D, grad=True)
    cos, sin = rope_cos_sin_table(S, D, device=DEVICE)
    out = rope(q, k, cos, sin)
    assert out[0].shape == q.shape and out[1].shape == k.shape
    sum(o.sum() for o in out).backward()
    assert q.grad.shape == q.shape


def test_three_dim_varlen_tokens():
    T, Hq, Hk, D = 9, 4, 2, 16                     # [total_tokens, H, D] with per-token positions
    q, k = _rand(T, Hq, D, grad=True), _rand(T, Hk, D, grad=True)
    cos, sin = rope_cos_sin_table(32, D, device=DEVICE)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 0, 1, 2], device=DEVICE)
    _check(q, k, cos, sin, torch.float32, position_ids=pos)


def test_many_tokens_per_program_and_head_loop():
    # 150 short tokens: several tokens per program with spare slots in the last program
    q, k = _rand(3, 50, 1, 8, grad=True), _rand(3, 50, 1, 8, grad=True)
    cos, sin = rope_cos_sin_table(50, 8, device=DEVICE)
    _check(q, k, cos, sin, torch.float32)
    # config override (GPU sweeps): heads walked 2 at a time, 3 tokens per program
    q, k = _rand(2, 5, 5, 12), _rand(2, 5, 3, 12)
    if not use_triton(q):
        pytest.skip("the launcher needs CUDA or TRITON_INTERPRET=1")
    cos, sin = rope_cos_sin_table(5, 8, interleaved=True, device=DEVICE)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    rope_mod._launch(q, k, q_out, k_out, cos, sin, None, True, 8, False, False,
                     config=dict(BLOCK_HQ=2, BLOCK_HK=2, TOKENS=3, num_warps=1))
    _assert_close((q_out, k_out), rope_reference(q.double(), k.double(), cos.double(), sin.double(),
                                                 interleaved=True, rotary_dim=8), torch.float32)


def test_compile_options_and_inplace():
    B, S, Hq, Hk, D, r = 2, 4, 2, 1, 16, 8
    cos, sin = rope_cos_sin_table(10, r, interleaved=True, device=DEVICE)
    pos = torch.randint(0, 10, (B, S), device=DEVICE)
    kw = dict(position_ids=pos, interleaved=True, rotary_dim=r, layout="bhsd")
    compiled = torch.compile(rope, fullgraph=True, backend="aot_eager")
    q, k = _rand(B, Hq, S, D, grad=True), _rand(B, Hk, S, D, grad=True)
    _check(q, k, cos, sin, torch.float32, **kw)
    out = compiled(q, k, cos, sin, **kw)
    _assert_close(out, rope_reference(q.double(), k.double(), cos.double(), sin.double(), **kw), torch.float32)
    qkv = _rand(B, Hq + Hk, S, D)
    expect = rope(qkv[:, :Hq], qkv[:, Hq:], cos, sin, **kw)
    with torch.no_grad():
        compiled(qkv[:, :Hq], qkv[:, Hq:], cos, sin, inplace=True, **kw)
    _assert_close((qkv[:, :Hq], qkv[:, Hq:]), expect, torch.float32)


@pytest.mark.parametrize("kw", [dict(), dict(interleaved=True, rotary_dim=8, layout="bhsd"),
                                dict(position_ids=True, rotary_dim=12), dict(inplace=True)])
def test_torch_peer_matches_reference(kw):
    """The benchmark's eager peer computes the same function (in the input dtype, as HF does)."""
    q, k = _rand(2, 5, 3, 16), _rand(2, 5, 1, 16)
    if kw.get("layout") == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    r = kw.get("rotary_dim", 16)
    cos, sin = rope_cos_sin_table(9, r, interleaved=kw.get("interleaved", False), device=DEVICE)
    if kw.get("position_ids"):
        kw = dict(kw, position_ids=torch.randint(0, 9, (2, 5), device=DEVICE))
    else:
        cos, sin = cos[:5], sin[:5]
    ref = rope_reference(q.double(), k.double(), cos.double(), sin.double(), **dict(kw, inplace=False))
    _assert_close(rope_torch(q, k, cos, sin, **kw), ref, torch.float32)
    if kw.get("inplace"):
        _assert_close((q, k), ref, torch.float32)


# ---- the eager fast path --------------------------------------------------------------------


@pytest.fixture
def checked_ropes(monkeypatch):
    """Counts the calls that take the checked path; empties the fast path's cache first and last."""
    rope_mod._FAST.clear()
    yield count_calls(monkeypatch, rope_mod, "_checked_rope")
    rope_mod._FAST.clear()


@pytest.mark.skipif(not use_triton(torch.empty(0, device=DEVICE)), reason="the fast path keeps Triton launches")
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("with_pos", [False, True])
def test_fast_path_repeats_the_checked_launch(inplace, with_pos, checked_ropes):
    """A repeated no-grad call (a decode step) skips the checks: bitwise the first call's output,
    the reference's on new values, in place bumping q's and k's versions as the op would; other
    options, layouts and a call that needs a gradient are checked again (bad ones still raise)."""
    B, S, Hq, Hk, D, r = 2, 3, 4, 2, 16, 12
    qkv = _rand(B, S, Hq + 2 * Hk, D)                       # packed-qkv views, GPT-J partial rotary
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
    cos, sin = rope_cos_sin_table(7 if with_pos else S, r, interleaved=True, device=DEVICE)
    pos = torch.tensor([[4, 0, 6], [1, 1, 2]], device=DEVICE) if with_pos else None
    kw = dict(position_ids=pos, interleaved=True, rotary_dim=r, inplace=inplace)

    def call():
        before = (q.clone(), k.clone())
        version = q._version
        out = rope(q, k, cos, sin, **kw)
        assert not inplace or (out[0] is q and out[1] is k and q._version > version)
        ref = rope_reference(before[0].double(), before[1].double(), cos.double(), sin.double(),
                             **dict(kw, inplace=False))
        return [o.clone() for o in out], before, ref

    first, before, ref = call()
    _assert_close(first, ref, torch.float32)
    if inplace:
        q.copy_(before[0]), k.copy_(before[1])
    again, _, _ = call()
    assert len(checked_ropes) == 1 and len(rope_mod._FAST) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    qkv.copy_(torch.randn_like(qkv))
    out, _, ref = call()
    assert len(checked_ropes) == 1
    _assert_close(out, ref, torch.float32)
    rope(q, k, cos, sin, **dict(kw, interleaved=False))        # another option: checked
    with pytest.raises(ValueError, match="rotary_dim"):
        rope(q, k, cos, sin, **dict(kw, rotary_dim=14))
    with pytest.raises(TypeError, match="interleaved"):
        rope(q, k, cos, sin, **dict(kw, interleaved=1))
    rope(q.contiguous(), k, cos, sin, **kw)                    # another layout of q: checked
    assert len(checked_ropes) == 5 and len(rope_mod._FAST) == 3
    if with_pos:                                               # ids of another layout: checked
        kw["position_ids"] = pos[1]
        out, _, ref = call()
        _assert_close(out, ref, torch.float32)
        assert len(checked_ropes) == 6
    n_checked = len(checked_ropes)
    q_grad = q.detach().clone().requires_grad_(True)
    if inplace:
        with pytest.raises(ValueError, match="q requires grad"):
            rope(q_grad, k, cos, sin, **kw)
    else:
        for _ in range(2):
            out = rope(q_grad, k, cos, sin, **kw)
        assert out[0].requires_grad and len(checked_ropes) == n_checked + 2


# ---- bad input -----------------------------------------------------------------------------


def _good():
    cos, sin = rope_cos_sin_table(5, 16, device=DEVICE)
    return dict(q=_rand(2, 5, 4, 16), k=_rand(2, 5, 2, 16), cos=cos, sin=sin)


@pytest.mark.parametrize("change,err,match", [
    (dict(cos=torch.ones(5, 8)), ValueError, "cos"),                        # last dim != rotary_dim
    (dict(cos=torch.ones(6, 16), sin=torch.ones(6, 16)), ValueError, "cos/sin"),   # wrong S
    (dict(cos=torch.ones(3, 5, 16), sin=torch.ones(3, 5, 16)), ValueError, "cos/sin"),  # wrong B
    (dict(rotary_dim=7), ValueError, "rotary_dim"),
    (dict(rotary_dim=18), ValueError, "rotary_dim"),
    (dict(rotary_dim=8.0), TypeError, "rotary_dim"),
    (dict(k=torch.ones(2, 5, 2, 8)), ValueError, "head_dim"),
    (dict(k=torch.ones(2, 4, 2, 16)), ValueError, "q .* and k"),
    (dict(q=torch.ones(2, 5, 4, 16, dtype=torch.float64)), TypeError, "q has dtype"),
    (dict(q=torch.ones(2, 5, 4, 16, dtype=torch.int32)), TypeError, "q has dtype"),
    (dict(k=torch.ones(2, 5, 2, 16, dtype=torch.float16)), TypeError, "k has dtype"),
    (dict(sin=torch.ones(5, 16, dtype=torch.float16)), TypeError, "sin has dtype"),
    (dict(q=torch.ones(5, 4, 16, 1, 1)), ValueError, "q must be 4-D"),
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(interleaved=1), TypeError, "interleaved"),
    (dict(position_ids=torch.zeros(2, 5)), TypeError, "position_ids has dtype"),
    (dict(position_ids=torch.zeros(2, 4, dtype=torch.long)), ValueError, "position_ids has shape"),
    (dict(position_ids=torch.zeros(2, 5, dtype=torch.long), cos=torch.ones(2, 5, 16),
          sin=torch.ones(2, 5, 16)), ValueError, "max_pos, r"),
])
def test_bad_input(change, err, match):
    args = _good()
    args.update({key: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for key, v in change.items()})
    with pytest.raises(err, match=match):
        rope(**args)


def test_inplace_refuses_q_and_k_in_the_same_memory():
    """rope(x, x, inplace=True) rotated x twice, and so did q and k that overlap (0.62 / 0.68
    off, s43 audit); the eager fast path skipped the test (a call of the same layout with
    distinct tensors first, then rope(x, x): 0.67 off, s43 audit). q and k slices of one fused
    qkv buffer (no shared element), along the heads or the positions, stay allowed, also on
    the fast path."""
    cos, sin = rope_cos_sin_table(6, 16, device=DEVICE)
    for pick in [lambda t: (t, t), lambda t: (t[:, :, 0:3], t[:, :, 1:4]), lambda t: (t[:, :, 1:3], t[:, :, 0:2]),
                 lambda t: (t[:, 0:4], t[:, 2:6])]:
        # the same views of two buffers first: disjoint, and this layout's fast path is made
        (q, _), (_, k) = pick(_rand(2, 6, 4, 16)), pick(_rand(2, 6, 4, 16))
        rope(q, k, cos[:q.shape[1]], sin[:q.shape[1]], inplace=True, layout="bshd")
        q, k = pick(_rand(2, 6, 4, 16))
        with pytest.raises(ValueError, match="same memory"):
            rope(q, k, cos[:q.shape[1]], sin[:q.shape[1]], inplace=True, layout="bshd")
    qkv, x = _rand(2, 6, 3, 4, 16), _rand(2, 6, 4, 16)
    packed = _rand(2, 6, 6, 16)      # GQA-style: 4 q heads, then 2 k heads
    for q, k in [(qkv[:, :, 0], qkv[:, :, 1]), (packed[:, :, :4], packed[:, :, 4:]), (x[:, 0:3], x[:, 3:6]),
                 (qkv[:, :, 1], qkv[:, :, 0])]:
        for _ in range(2):
            ref_q, ref_k = rope(q, k, cos[:q.shape[1]], sin[:q.shape[1]], layout="bshd")
            rope(q, k, cos[:q.shape[1]], sin[:q.shape[1]], inplace=True, layout="bshd")
            assert rel_err(q, ref_q) <= 1e-6 and rel_err(k, ref_k) <= 1e-6


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_may_share_elements_is_never_wrong_when_it_says_no(data):
    """``_checks.may_share_elements`` against the element sets themselves, on random views of
    one small buffer (slices, steps, transposes, one-dim offsets of one layout): "no" is always
    right, and for two slices of one layout along one dim the answer is exact."""
    from tilefuse._checks import may_share_elements
    base = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)

    def view():
        t = base.permute(*data.draw(st.permutations(range(3))))
        for d in range(3):
            n = t.shape[d]
            lo = data.draw(st.integers(0, n - 1))
            hi = data.draw(st.integers(lo + 1, n))
            step = data.draw(st.sampled_from([1, 1, 2]))
            t = t.narrow(d, lo, hi - lo)[(slice(None),) * d + (slice(None, None, step),)]
        return t
    a, b = view(), view()
    truth = bool(set(a.flatten().tolist()) & set(b.flatten().tolist()))
    assert may_share_elements(a, b) or not truth
    # two ranges of one layout along one dim: exact
    d = data.draw(st.integers(0, 2))
    n = base.shape[d]
    lo1, lo2 = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    len1, len2 = data.draw(st.integers(1, n - lo1)), data.draw(st.integers(1, n - lo2))
    a, b = base.narrow(d, lo1, len1), base.narrow(d, lo2, len2)
    truth = bool(set(a.flatten().tolist()) & set(b.flatten().tolist()))
    assert may_share_elements(a, b) == truth


def test_ambiguous_layout_needs_to_be_named():
    """A Hugging Face [B, H, S, D] pair with H = S passes every shape check read as [B, S, H, D]
    and came out rotated along the heads (5.43 off, s37 audit): layout=None refuses that case;
    naming either layout works, and S = H = 1 (where both readings agree) needs no name."""
    q, k = _rand(1, 4, 4, 8), _rand(1, 4, 4, 8)
    cos, sin = rope_cos_sin_table(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="layout is ambiguous"):
        rope(q, k, cos, sin)
    for layout in ("bshd", "bhsd"):
        ref = rope_reference(q.double(), k.double(), cos.double(), sin.double(), layout=layout)
        assert all(rel_err(a, b) <= 1e-6 for a, b in zip(rope(q, k, cos, sin, layout=layout), ref))
    one = _rand(2, 1, 1, 8)
    assert rope(one, one.clone(), *rope_cos_sin_table(1, 8, device=DEVICE))[0].shape == one.shape


def test_out_of_range_position_ids_read_zero_tables():
    """Ids outside [0, max_pos) rotate with cos = sin = 0 on every path (the reference used to
    raise an IndexError, or wrap -1 to the last row, where the kernel reads zeros)."""
    q, k = _rand(2, 5, 3, 12), _rand(2, 5, 1, 12)
    cos, sin = rope_cos_sin_table(6, 8, device=DEVICE)
    pos = torch.tensor([[0, 5, 6, -1, 2], [7, 1, 2, 3, 100]], device=DEVICE)
    out = rope(q, k, cos, sin, position_ids=pos, rotary_dim=8)
    bad = (pos < 0) | (pos >= 6)
    for x, o in zip((q, k), out):
        assert (o[..., :8][bad] == 0).all() and torch.equal(o[..., 8:], x[..., 8:])
        good = rope_reference(x[~bad][None].double(), x[~bad][None].double(), cos.double(), sin.double(),
                              position_ids=pos[~bad], rotary_dim=8)[0][0]
        assert rel_err(o[~bad], good) <= 1e-6
    ref = rope_reference(q.double(), k.double(), cos.double(), sin.double(), position_ids=pos, rotary_dim=8)
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(out, ref))     # the CPU path's reference agrees


@pytest.mark.parametrize("args, err", [((10, 5), ValueError), ((-1, 4), ValueError), ((4, -2), ValueError),
                                       ((3.0, 4), TypeError), ((4, True), TypeError)])
def test_cos_sin_table_bad_input(args, err):
    with pytest.raises(err, match="max_pos|rotary_dim"):
        rope_cos_sin_table(*args)


@pytest.mark.parametrize("which", ["q", "k"])
def test_inplace_refuses_expanded_tensors(which):
    """In place into an expanded view, each batch row rotated the shared row again (0.53 off, a
    helper's audit, s36): refused as torch refuses such writes; out of place it is fine."""
    args = _good()
    t = args[which]
    args[which] = t[:1].clone().expand(t.shape)
    with pytest.raises(ValueError, match=f"{which} is written in place"):
        rope(**args, inplace=True)
    out = rope(**args)
    ref = rope_reference(**{n: (v.double() if n in ("q", "k") else v) for n, v in args.items()})
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(out, ref))


# ---- GPU: bf16 options, int64 offsets ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_bf16_options(interleaved):
    q, k = _rand(2, 300, 8, 80, dtype=torch.bfloat16, grad=True), _rand(2, 300, 2, 80, dtype=torch.bfloat16, grad=True)
    cos, sin = rope_cos_sin_table(4096, 64, interleaved=interleaved, dtype=torch.bfloat16, device=DEVICE)
    pos = torch.randint(0, 4096, (2, 300), device=DEVICE)
    _check(q, k, cos, sin, torch.bfloat16, position_ids=pos, interleaved=interleaved, rotary_dim=64)


@pytest.mark.gpu
@pytest.mark.bigmem
def test_int64_offsets():
    S, H, D = 140_000, 128, 128                    # q has 2.29e9 > 2^31 elements (4.6 GB in bf16)
    q = torch.empty(1, S, H, D, dtype=torch.bfloat16, device=DEVICE).normal_()
    k = _rand(1, S, 1, D, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin_table(S, D, dtype=torch.bfloat16, device=DEVICE)
    assert q.numel() > 2**31
    q_out, k_out = rope(q, k, cos, sin)
    for tokens in (slice(0, 3), slice(S - 3, S)):   # the last tokens' offsets pass 2^31
        ref = rope_reference(*(t[:, tokens].double() for t in (q, k)), cos[tokens].double(), sin[tokens].double())
        assert rel_err(q_out[:, tokens], ref[0]) <= TOL[torch.bfloat16]
        assert rel_err(k_out[:, tokens], ref[1]) <= TOL[torch.bfloat16]
