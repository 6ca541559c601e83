"""Tensors past 2^31 elements, the sizes real use reaches: long-context activations (norms,
attention, SwiGLU, bias + GELU), large vocabularies (cross-entropy logits, the LM head's output and
its gradient), big KV-cache pools (decode, paged or not). Each kernel must index them with 64-bit
offsets; a 32-bit product wraps and reads or writes the wrong element. GPU only (5-35 GB each);
run this file with few workers.

Each test compares rows (or batch entries, or pages) on both sides of the 2^31 boundary with an
fp32 / fp64 reference of those rows alone, and the full-size reductions (dw, dbias, the LM head's
weight gradient) with a chunked fp32 reference. Outputs start NaN-poisoned (conftest). bf16
bound: relative error norm 1e-2.
"""

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.ops.attention_decode import attention_decode_reference
from tilefuse.testing import rel_err

BIG = 2**31
TOL = 1e-2
pytestmark = [pytest.mark.gpu, pytest.mark.bigmem]


def _randn(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype).normal_()


def _ends(n, k=3):
    """Indices of the first and last ``k`` of ``n`` (the last ones sit past 2^31 elements)."""
    return torch.cat([torch.arange(k), torch.arange(n - k, n)]).cuda()


def _col_sum(fn, n_rows, chunk=1 << 16):
    """``sum over rows of fn(rows)`` in fp32, ``chunk`` rows at a time (bounded memory)."""
    total = None
    for r0 in range(0, n_rows, chunk):
        part = fn(slice(r0, min(r0 + chunk, n_rows))).sum(0)
        total = part if total is None else total + part
    return total


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm", "add_rms_norm"])
def test_norms(norm):
    """add_rms_norm: x is the sum ``h + residual``, also returned (the fused residual add); its
    gradient reaches both h and residual."""
    rows, cols = BIG // 4096 + 5, 4096
    w = (1 + 0.1 * _randn(cols)).requires_grad_()
    b = (0.1 * _randn(cols)).requires_grad_() if norm == "layer_norm" else None
    dy = _randn(rows, cols)
    if norm == "add_rms_norm":
        h, res = _randn(rows, cols).requires_grad_(), _randn(rows, cols).requires_grad_()
        y, x = tilefuse.rms_norm(h, weight=w, residual=res)
        ds = _randn(rows, cols)                          # gradient arriving on the sum
        torch.autograd.backward([y, x], [dy, ds])
        e = _ends(rows)
        assert rel_err(x.detach()[e], h.detach()[e].float() + res.detach()[e].float()) <= TOL
        assert torch.equal(h.grad, res.grad)
        dx, dx_extra = h.grad, ds[e].float()             # the sum's gradient plus the normalization's
    else:
        x = _randn(rows, cols).requires_grad_()
        y = tilefuse.rms_norm(x, weight=w) if b is None else tilefuse.layer_norm(x, weight=w, bias=b)
        y.backward(dy)
        dx, dx_extra = x.grad, 0.0
    assert x.numel() > BIG

    def x_hat(r):
        xf = x.detach()[r].float()
        if b is not None:
            xf = xf - xf.mean(-1, keepdim=True)
            return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)

    ends = _ends(rows)
    ref_y = x_hat(ends) * w.detach().float() + (0 if b is None else b.detach().float())
    assert rel_err(y.detach()[ends], ref_y) <= TOL
    xf = x.detach()[ends].float().requires_grad_()
    ref = (F.rms_norm(xf, (cols,), w.detach().float(), 1e-6) if b is None
           else F.layer_norm(xf, (cols,), w.detach().float(), b.detach().float(), 1e-5))
    ref.backward(dy[ends].float())
    assert rel_err(dx[ends], xf.grad + dx_extra) <= TOL
    assert rel_err(w.grad, _col_sum(lambda r: dy[r].float() * x_hat(r), rows)) <= TOL
    if b is not None:
        assert rel_err(b.grad, _col_sum(lambda r: dy[r].float(), rows)) <= TOL


@pytest.mark.parametrize("defer_grad", [False, True])
def test_cross_entropy(defer_grad):
    vocab = 151936
    rows = BIG // vocab + 2
    logits = _randn(rows, vocab).mul_(3).requires_grad_()
    assert logits.numel() > BIG
    target = torch.randint(0, vocab, (rows,), device="cuda")
    loss = tilefuse.cross_entropy(logits, target, reduction="none", defer_grad=defer_grad)
    g = torch.rand(rows, device="cuda")
    loss.backward(g)
    ends = _ends(rows)
    xf = logits.detach()[ends].double().requires_grad_()
    ref = F.cross_entropy(xf, target[ends], reduction="none")
    ref.backward(g[ends].double())
    assert rel_err(loss.detach()[ends], ref) <= TOL          # the loss comes back in bf16, as torch's does
    assert rel_err(logits.grad[ends], xf.grad) <= TOL


@pytest.mark.parametrize("op", ["swiglu", "bias_gelu"])
def test_glu_and_bias_act(op):
    cols = 14336
    rows = BIG // cols + 3
    x = _randn(rows, cols).requires_grad_()
    other = _randn(rows, cols).requires_grad_() if op == "swiglu" else _randn(cols).requires_grad_()
    assert x.numel() > BIG
    y = tilefuse.swiglu(x, other) if op == "swiglu" else tilefuse.bias_act(x, other, activation="gelu")
    dy = _randn(rows, cols)
    y.backward(dy)
    ends = _ends(rows)
    xf = x.detach()[ends].float().requires_grad_()
    of = (other.detach()[ends] if op == "swiglu" else other.detach()).float().requires_grad_()
    ref = F.silu(xf) * of if op == "swiglu" else F.gelu(xf + of)
    ref.backward(dy[ends].float())
    assert rel_err(y.detach()[ends], ref.detach()) <= TOL
    assert rel_err(x.grad[ends], xf.grad) <= TOL
    if op == "swiglu":
        assert rel_err(other.grad[ends], of.grad) <= TOL
    else:
        def dbias(r):
            z = (x.detach()[r].float() + other.detach().float()).requires_grad_()
            return torch.autograd.grad(F.gelu(z), z, dy[r].float())[0]
        assert rel_err(other.grad, _col_sum(dbias, rows, chunk=1 << 14)) <= TOL


@pytest.mark.parametrize("varlen", [False, True])
def test_attention(varlen):
    """8193 sequences of 128 tokens, 16 heads of 128: q, k, v, out and every gradient pass 2^31
    elements; the last sequences' rows lie past it."""
    batch, seq, heads, d = BIG // (128 * 16 * 128) + 1, 128, 16, 128
    q, k, v = (_randn(batch, seq, heads, d).requires_grad_() for _ in range(3))
    assert q.numel() > BIG
    if varlen:
        cu = torch.arange(0, (batch + 1) * seq, seq, device="cuda", dtype=torch.int32)
        out = tilefuse.attention_varlen(q.view(-1, heads, d), k.view(-1, heads, d), v.view(-1, heads, d),
                                        cu, cu, seq, seq, causal=True).view(batch, seq, heads, d)
    else:
        out = tilefuse.attention(q, k, v, causal=True)
    do = _randn(batch, seq, heads, d)
    out.backward(do)
    ends = _ends(batch, 2)
    qf, kf, vf = (t.detach()[ends].float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ref.backward(do[ends].float().transpose(1, 2))
    assert rel_err(out.detach()[ends], ref.detach().transpose(1, 2)) <= TOL
    for t, tf in ((q, qf), (k, kf), (v, vf)):
        assert rel_err(t.grad[ends], tf.grad.transpose(1, 2)) <= TOL


@pytest.mark.parametrize("paged", [False, True])
def test_attention_decode(paged):
    """A KV cache past 2^31 elements: a contiguous [3, 2^20, 8, 128] cache (batch row 2 starts
    past it) or a paged pool of 131136 pages of 16 slots whose last pages lie past it. New keys
    are appended in place there too."""
    h_q, h_kv, d = 32, 8, 128
    seqlens = [700, 1000, 1500]
    batch = len(seqlens)
    if paged:
        page = 16
        pages = BIG // (page * h_kv * d) + 64
        k_cache, v_cache = _randn(pages, page, h_kv, d), _randn(pages, page, h_kv, d)
        per_row = -(-max(seqlens) // page)
        # row 0 takes the first pages, rows 1 and 2 the pool's last ones (past 2^31 elements)
        ids = [torch.arange(per_row), torch.arange(pages - 2 * per_row, pages - per_row),
               torch.arange(pages - per_row, pages)]
        block_table = torch.stack(ids).to(torch.int32).cuda()
    else:
        k_cache, v_cache = _randn(batch, 2**20, h_kv, d), _randn(batch, 2**20, h_kv, d)
        block_table = None
    assert k_cache.numel() > BIG
    q, k_new, v_new = _randn(batch, 1, h_q, d), _randn(batch, 1, h_kv, d), _randn(batch, 1, h_kv, d)
    cache_seqlens = torch.tensor([n - 1 for n in seqlens], device="cuda", dtype=torch.int32)
    out = tilefuse.attention_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new=k_new, v_new=v_new)

    def rows(cache):                                                   # [batch, L, H_kv, D] views
        if not paged:
            return cache
        return torch.stack([cache[block_table[b].long()].flatten(0, 1) for b in range(batch)])

    k_rows, v_rows = rows(k_cache), rows(v_cache)
    for b, n in enumerate(seqlens):                                     # the appended slot
        assert torch.equal(k_rows[b][n - 1], k_new[b, 0]) and torch.equal(v_rows[b][n - 1], v_new[b, 0])
    # the op's own reference, on the cache as the append left it
    ref = attention_decode_reference(q, k_cache, v_cache, cache_seqlens + 1, block_table)
    assert rel_err(out, ref) <= TOL


def test_swiglu_linear():
    """The fused gate-up GEMM's [tokens, I] output and its saved [tokens, 2I] g | u past 2^31
    elements (the backward's d of that size too)."""
    t, h, i = BIG // 14336 + 3, 4096, 14336
    x = (_randn(t, h) / 8).requires_grad_()
    w = (_randn(2 * i, h) / 8).requires_grad_()
    y = tilefuse.swiglu_linear(x, w)
    assert y.numel() > BIG
    dy = _randn(t, i)
    y.backward(dy)
    ends = _ends(t)
    xf = x.detach()[ends].float().requires_grad_()
    wf = w.detach().float()
    ref = F.silu(xf @ wf[:i].t()) * (xf @ wf[i:].t())
    ref.backward(dy[ends].float())
    assert rel_err(y.detach()[ends], ref.detach()) <= TOL
    assert rel_err(x.grad[ends], xf.grad) <= TOL
    rows = _ends(i)                                     # dw rows of gate and up, summed over all tokens

    def dw_rows(r):
        xr = x.detach()[r].float()
        g, u = xr @ wf[:i].t(), xr @ wf[i:].t()
        dyr = dy[r].float()
        sig = torch.sigmoid(g)
        dg = dyr * u * sig * (1 + g * (1 - sig))
        du = dyr * g * sig
        return torch.cat([dg[:, rows], du[:, rows]], 1)[:, :, None] * xr[:, None, :]
    ref_dw = _col_sum(dw_rows, t, chunk=1 << 12)
    assert rel_err(torch.cat([w.grad[rows], w.grad[i + rows]]), ref_dw) <= TOL


def test_lm_head_matmul():
    """The LM head's [tokens, vocab] output past 2^31 elements (x @ w.t()), and its backward:
    dy of that size read for dx = dy @ w and dw = dyᵀ @ x."""
    m, n, k = 16384, BIG // 16384 + 129, 4096
    x = (_randn(m, k) / 8).requires_grad_()
    w = (_randn(n, k) / 8).requires_grad_()
    y = tilefuse.matmul(x, w.t())
    assert y.numel() > BIG
    dy = _randn(m, n) / 64
    y.backward(dy)
    ends = _ends(m)
    xf, wf = x.detach().float(), w.detach().float()
    assert rel_err(y.detach()[ends], xf[ends] @ wf.t()) <= TOL
    cols = _ends(n)
    assert rel_err(y.detach()[:, cols], xf @ wf[cols].t()) <= TOL
    assert rel_err(x.grad[ends], dy[ends].float() @ wf) <= TOL
    assert rel_err(w.grad[cols], dy[:, cols].float().t() @ xf) <= TOL
