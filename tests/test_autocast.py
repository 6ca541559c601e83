"""torch.autocast (tilefuse._autocast): the GEMM family computes in the autocast dtype, as torch's
linear / SDPA would; gradients reach fp32 leaves in fp32; row ops keep their input dtype;
implementations run with autocast off.

Each GEMM-family case runs twice on fresh fp32 inputs: under autocast, and outside it on inputs
cast by hand to the autocast dtype. The two must agree (the same kernel on the same operands), in
outputs and in the fp32 leaves' gradients; the output dtype must be torch's. The interpreter
mishandles bf16, so CI runs fp16 autocast and the GPU both.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, HAS_CUDA

import tilefuse
from tilefuse import fp8
from tilefuse.testing import LlamaStack, rel_err

AMP_DTYPES = (torch.float16, torch.bfloat16) if HAS_CUDA else (torch.float16,)


def _tol(dtype):
    """The relative error norm a 16-bit result may have against fp32 / another library's."""
    return 2e-3 if dtype == torch.float16 else 1e-2


def _leaves(*shapes, scale=1.0):
    return [(torch.randn(*s, device=DEVICE) * scale).requires_grad_(True) for s in shapes]


def _same_as_cast_by_hand(fn, leaves, dtype, out_dtype=None):
    """fn(*leaves) under autocast(dtype) against fn(*leaves cast to dtype) outside it: outputs
    (first element of a tuple) equal to fp32 rounding, dtype as expected, fp32 leaf gradients
    equal to the hand-cast run's (cast back)."""
    with torch.autocast(DEVICE, dtype=dtype):
        out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    cast = [t.detach().to(dtype).requires_grad_(True) for t in leaves]
    ref = fn(*cast)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert out.dtype == (out_dtype or dtype)
    assert ref.dtype == out.dtype
    assert rel_err(out, ref) <= 1e-6
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    ref_grads = torch.autograd.grad(ref, cast, dy)
    for g, r, leaf in zip(grads, ref_grads, leaves):
        assert g.dtype == leaf.dtype == torch.float32
        assert rel_err(g, r.float()) <= 1e-5
    return out


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_matmul_and_linear_cast_like_torch_linear(dtype):
    x, w, b = _leaves((5, 3, 40), (24, 40), (24,))
    out = _same_as_cast_by_hand(lambda x, w, b: tilefuse.matmul(x, w.t(), b, activation="gelu"), [x, w, b], dtype)
    layer = tilefuse.nn.Linear(40, 24, device=DEVICE)
    with torch.autocast(DEVICE, dtype=dtype):
        y = layer(x)
        y_torch = F.linear(x, layer.weight, layer.bias)
    assert y.dtype == y_torch.dtype == dtype
    assert rel_err(y, y_torch) <= _tol(dtype)
    assert out.shape == (5, 3, 24)


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_matmul_wider_residual_sets_the_output_dtype(dtype):
    """linear(x) + residual promotes: an fp32 residual stream stays fp32."""
    x, w, r = _leaves((7, 32), (16, 32), (7, 16))
    _same_as_cast_by_hand(lambda x, w: tilefuse.matmul(x, w.t(), residual=r), [x, w], dtype, torch.float32)
    with torch.autocast(DEVICE, dtype=dtype):
        out = tilefuse.matmul(x, w.t(), residual=r)
        ref = F.linear(x, w) + r
    assert out.dtype == ref.dtype == torch.float32
    assert rel_err(out, ref) <= _tol(dtype)


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_gemm_family_casts_its_inputs(dtype):
    x, w_gu, w_qkv = _leaves((6, 32), (48, 32), (64, 32))
    _same_as_cast_by_hand(lambda x, w: tilefuse.swiglu_linear(x, w), [x, w_gu], dtype)
    cos, sin = tilefuse.rope_cos_sin_table(6, 16, device=DEVICE)          # fp32 tables keep their dtype
    _same_as_cast_by_hand(lambda x, w: tilefuse.qkv_proj(x, w, 2, 1, 16, cos=cos, sin=sin), [x, w_qkv], dtype)


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_attention_casts_like_sdpa(dtype):
    q, k, v = _leaves((1, 24, 4, 16), (1, 24, 2, 16), (1, 24, 2, 16))
    _same_as_cast_by_hand(lambda q, k, v: tilefuse.attention(q, k, v, causal=True), [q, k, v], dtype)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE)
    qv, kv, vv = _leaves((24, 4, 16), (24, 2, 16), (24, 2, 16))
    _same_as_cast_by_hand(lambda q, k, v: tilefuse.attention_varlen(q, k, v, cu, cu, 14, 14), [qv, kv, vv], dtype)
    qs, ks, vs = (t.detach().transpose(1, 2) for t in (q, k, v))        # [B, H, S, D]
    with torch.autocast(DEVICE, dtype=dtype):
        out = tilefuse.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    assert out.dtype == ref.dtype == dtype
    assert rel_err(out, ref) <= _tol(dtype)


@pytest.mark.parametrize("dtype", AMP_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_casts_hidden_and_weight(dtype, reduction):
    """The linear in the autocast dtype, the loss in fp32 (torch's autocast cross-entropy's dtype),
    not rounded through the 16-bit dtype on the way."""
    h, w = _leaves((9, 32), (70, 32))
    target = torch.randint(0, 70, (9,), device=DEVICE)
    with torch.autocast(DEVICE, dtype=dtype):
        loss = tilefuse.linear_cross_entropy(h, w, target, reduction=reduction)
        ref = F.cross_entropy(F.linear(h, w), target, reduction=reduction)
    assert loss.dtype == ref.dtype == torch.float32
    h16, w16 = (t.detach().to(dtype).requires_grad_(True) for t in (h, w))
    # the logits in the autocast dtype (as torch's linear leaves them), the loss in fp64 from them
    exact = F.cross_entropy(F.linear(h16, w16).double(), target, reduction=reduction)
    assert rel_err(loss, exact) <= 1e-5        # no 16-bit rounding of the loss itself (~2e-4 in fp16)
    # |dy| >= 0.5: both sides carry the logits' gradient in the 16-bit dtype, and a scalar dy near 0
    # (mean) puts it among fp16's subnormals, where its rounding alone is several % (s45)
    dy = (torch.randint(0, 2, loss.shape, device=DEVICE) * 2 - 1) * (0.5 + torch.rand_like(loss))
    grads = torch.autograd.grad(loss, (h, w), dy)
    refs = torch.autograd.grad(exact, (h16, w16), dy.double())
    for g, r in zip(grads, refs):
        assert g.dtype == torch.float32 and rel_err(g, r) <= _tol(dtype)


@pytest.mark.parametrize("dtype", AMP_DTYPES)
@pytest.mark.parametrize("mode", [{}, {"defer_grad": True}, {"logits_inplace_grad": True}])
def test_cross_entropy_loss_is_fp32_under_autocast(dtype, mode):
    """16-bit logits under autocast: torch's cross-entropy returns fp32; ours too (the logits are
    not upcast: only the loss, which the kernels compute in fp32 anyway)."""
    logits = torch.randn(7, 50, device=DEVICE).to(dtype).requires_grad_(True)
    target = torch.randint(0, 50, (7,), device=DEVICE)
    with torch.autocast(DEVICE, dtype=dtype):
        ref = F.cross_entropy(logits.double(), target)
        loss = tilefuse.cross_entropy(logits * 1, target, **mode)
        assert F.cross_entropy(logits, target).dtype == torch.float32
    assert loss.dtype == torch.float32 and rel_err(loss, ref) <= 1e-6
    (g,) = torch.autograd.grad(loss, logits)
    (r,) = torch.autograd.grad(ref, logits)
    assert g.dtype == dtype and rel_err(g, r) <= _tol(dtype)
    assert tilefuse.cross_entropy(logits, target).dtype == dtype          # outside autocast: logits' dtype


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_quant_linear_computes_in_the_weights_dtype(dtype):
    """x and the bias follow the quantized weight's dtype (its scales'); an fp32-quantized weight
    keeps fp32 math, unchanged by autocast (the reference path runs with autocast off)."""
    w = torch.randn(24, 64, device=DEVICE)
    x = torch.randn(5, 64, device=DEVICE)
    bias = torch.randn(24, device=DEVICE)
    qw16 = tilefuse.quantize_weight(w.to(dtype), 4, 32)
    with torch.autocast(DEVICE, dtype=dtype):
        out = tilefuse.quant_linear(x, qw16, bias)
    assert out.dtype == dtype
    assert torch.equal(out, tilefuse.quant_linear(x.to(dtype), qw16, bias.to(dtype)))
    qw32 = tilefuse.quantize_weight(w, 8)
    with torch.autocast(DEVICE, dtype=dtype):
        out32 = tilefuse.quant_linear(x, qw32, bias)
    assert out32.dtype == torch.float32
    assert torch.equal(out32, tilefuse.quant_linear(x, qw32, bias))


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_attention_decode_follows_the_cache_dtype(dtype):
    k_cache = torch.randn(2, 32, 2, 16, device=DEVICE).to(dtype)
    v_cache = torch.randn(2, 32, 2, 16, device=DEVICE).to(dtype)
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    q, k_new, v_new = (torch.randn(2, 1, n, 16, device=DEVICE) for n in (4, 2, 2))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    with torch.autocast(DEVICE, dtype=dtype):
        out = tilefuse.attention_decode(q, *caches[0], seqlens, k_new=k_new, v_new=v_new)
    ref = tilefuse.attention_decode(q.to(dtype), *caches[1], seqlens, k_new=k_new.to(dtype), v_new=v_new.to(dtype))
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_fp8_linear_returns_the_autocast_dtype(dtype):
    layer = fp8.Linear(64, 32, device=DEVICE)
    x = torch.randn(16, 64, device=DEVICE)
    with torch.autocast(DEVICE, dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype
    assert torch.equal(y, fp8.matmul(x, layer.weight, "row", dtype, layer.bias))


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_row_ops_keep_their_dtype_and_answer(dtype):
    """fp32 inputs to row ops are left alone under autocast: the same bits as outside it."""
    x = torch.randn(6, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE)
    target = torch.randint(0, 40, (6,), device=DEVICE)
    ops = [lambda: tilefuse.softmax(x, -1), lambda: tilefuse.rms_norm(x, (40,), w),
           lambda: tilefuse.layer_norm(x, (40,), w, w), lambda: tilefuse.cross_entropy(x, target),
           lambda: tilefuse.bias_act(x, w, "gelu")]          # (cross_entropy: fp32 logits, fp32 loss)
    for op in ops:
        with torch.autocast(DEVICE, dtype=dtype):
            out = op()
        assert out.dtype == torch.float32
        assert torch.equal(out, op())


@pytest.mark.parametrize("dtype", AMP_DTYPES)
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_bias_act_takes_an_fp32_bias_beside_16bit_x(dtype, activation):
    """What a FusedBiasActDropout with fp32 parameters sees after a Linear under autocast; the
    bias gradient comes back in fp32, summed in fp32."""
    x = torch.randn(33, 48, device=DEVICE).to(dtype).requires_grad_(True)
    bias = torch.randn(48, device=DEVICE, requires_grad=True)
    y = tilefuse.bias_act(x, bias, activation, dropout_p=0.25, seed=7)
    ref = tilefuse.ops.activations.bias_act_reference(x.double(), bias.double(), activation, 0.25, seed=7)
    assert y.dtype == dtype
    assert rel_err(y, ref) <= _tol(dtype)
    dy = torch.randn_like(y)
    dx, db = torch.autograd.grad(y, (x, bias), dy)
    rdx, rdb = torch.autograd.grad(ref, (x, bias), dy.double())
    assert dx.dtype == dtype and db.dtype == torch.float32
    assert rel_err(dx, rdx) <= _tol(dtype)
    assert rel_err(db, rdb) <= 1e-5


def test_reference_path_runs_with_autocast_off(monkeypatch):
    """CPU tensors without the interpreter take the reference path: its fp32 matmuls must stay
    fp32 under the caller's CPU autocast (bf16 math labelled fp32 before)."""
    if DEVICE != "cpu":
        pytest.skip("the reference path runs on CPU tensors")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = torch.randn(24, 64)
    x = torch.randn(5, 64, requires_grad=True)
    qw = tilefuse.quantize_weight(w, 8)
    out = tilefuse.quant_linear(x, qw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = tilefuse.quant_linear(x, qw)
        (g_amp,) = torch.autograd.grad(tilefuse.matmul(x, w.t(), out_dtype=torch.float32).sum(), x)
    assert torch.equal(out, amp)
    x16, w16 = x.detach().bfloat16().requires_grad_(True), w.bfloat16()
    (g16,) = torch.autograd.grad(tilefuse.matmul(x16, w16.t(), out_dtype=torch.float32).sum(), x16)
    assert rel_err(g_amp, g16.float()) <= 1e-6


def test_compiled_linear_under_autocast():
    """torch.compile traces the casts: the compiled module returns what eager does."""
    layer = tilefuse.nn.Linear(32, 16, device=DEVICE)
    x = torch.randn(4, 32, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.autocast(DEVICE, dtype=torch.float16):
        out, ref = compiled(x), layer(x)
    assert out.dtype == ref.dtype == torch.float16
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_training_step_of_a_block_under_autocast(dtype):
    """The drop-ins in a model under autocast: loss and every parameter's gradient against the
    fp64 torch model, within twice the error of the same torch model under the same autocast
    (flash-attn's rule) plus 1e-4."""
    with torch.device(DEVICE):
        ours, theirs, exact = (LlamaStack(fused, 1, 64, 4, 128, 100) for fused in (True, False, False))
    theirs.load_state_dict(ours.state_dict())
    exact.double()
    exact.load_state_dict(ours.state_dict())
    x = torch.randn(2, 16, 64, device=DEVICE)
    target = torch.randint(0, 100, (2, 16), device=DEVICE)
    results = []
    for model in (ours, theirs):
        with torch.autocast(DEVICE, dtype=dtype):
            loss = model(x, target)
        assert loss.dtype == torch.float32
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    ref = exact(x.double(), target)
    ref_grads = torch.autograd.grad(ref, list(exact.parameters()))
    (loss, grads), (torch_loss, torch_grads) = results
    assert rel_err(loss, ref) <= 2 * rel_err(torch_loss, ref) + 1e-4
    for (name, _), g, tg, r in zip(ours.named_parameters(), grads, torch_grads, ref_grads):
        assert g.dtype == torch.float32, name
        assert rel_err(g, r) <= 2 * rel_err(tg, r) + 1e-4, (name, rel_err(g, r), rel_err(tg, r))


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16])
def test_upcast_kernel_is_exact(src):
    """The autocast cast's backward (16-bit gradient -> fp32): bit-equal to torch's .to on a
    contiguous tensor, a transposed weight view (same strides out), a strided slice (torch's path),
    odd and empty sizes; inf and NaN kept."""
    from tilefuse.ops._cast import upcast

    base = torch.randn(37, 129, device=DEVICE) * 1e3
    base[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    b16 = base.to(src)
    for t16 in (b16, b16.t(), b16[:, ::2], b16[:0], b16.reshape(-1)[:4097]):
        out = upcast(t16, torch.float32)
        assert out.dtype == torch.float32 and out.shape == t16.shape
        if t16 is b16 or t16.dim() == 2 and t16.t().is_contiguous():
            assert out.stride() == t16.stride()
        assert torch.equal(out.nan_to_num(), t16.to(torch.float32).nan_to_num())
        assert torch.isnan(out).sum() == torch.isnan(t16).sum()
