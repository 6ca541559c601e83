"""linear_cross_entropy: chunking, options, bias, partial gradients, edge cases and errors.

Compared with the float64 reference (F.linear then the cross-entropy composition over the full
logits) by relative error norm; the CE kernel runs under the interpreter, the GEMMs in torch.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_DTYPES, DEVICE, count_calls
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse.ops.linear_cross_entropy as lce_mod  # noqa: F401  (registers the op before test_ops)
from tilefuse.nn.losses import LinearCrossEntropyLoss
from tilefuse.ops._cross_entropy_shared import softcap_reference, torch_cross_entropy
from tilefuse.ops.linear_cross_entropy import _chunk_tokens, linear_cross_entropy, linear_cross_entropy_reference
from tilefuse.testing import rel_err


# the interpreter turns scalar kernel arguments into 1-element arrays; range() over them warns
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}   # bf16: GPU tests only
IGNORE = -100


def _inputs(n_tokens, n_hidden, vocab, dtype=torch.float32, bias=False, lead=()):
    hidden = torch.randn(*lead, n_tokens, n_hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, n_hidden, device=DEVICE) * (3 / n_hidden**0.5)).to(dtype)
    b = (torch.randn(vocab, device=DEVICE) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, (*lead, n_tokens), device=DEVICE)
    target[torch.rand(target.shape, device=DEVICE) < 0.2] = IGNORE
    return hidden, weight, b, target


def _check(hidden, weight, bias, target, grads=("hidden", "weight", "bias"), **kw):
    """Loss and the gradients of ``grads`` vs the fp64 reference; returns (loss, grads)."""
    dtype = hidden.dtype
    tensors = {"hidden": hidden, "weight": weight, "bias": bias}
    ours = {k: None if v is None else v.detach().clone().requires_grad_(k in grads) for k, v in tensors.items()}
    refs = {k: None if v is None else v.detach().double().requires_grad_(k in grads) for k, v in tensors.items()}
    out = linear_cross_entropy(ours["hidden"], ours["weight"], target, ours["bias"], **kw)
    ref = linear_cross_entropy_reference(refs["hidden"], refs["weight"], target, refs["bias"], **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype], (rel_err(out, ref), kw)
    names = [k for k in grads if tensors[k] is not None]
    if not names:
        return out, []
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, [ours[k] for k in names], go.to(dtype))
    want = torch.autograd.grad(ref, [refs[k] for k in names], go)
    scales = _uncancelled_norms(refs, target, go, kw)
    for name, g, r in zip(names, got, want):
        assert g.shape == r.shape and g.dtype == dtype
        # relative to ||ref||, or to the norm of the same sums without cancellation when that is
        # larger: a gradient that sums terms of both signs (grad_weight over 2 tokens) can be ~0
        # while each term is O(1), and no summation order keeps ||err|| / ||ref|| small then
        err = (g.double() - r).norm().item()
        # and never below twice the error of storing the exact gradient in `dtype`: a small random
        # scalar go puts fp16 gradients among the subnormals, where rounding alone moves them by several %
        stored = (r.to(dtype).double() - r).norm().item()
        bound = max(TOL[dtype] * max(r.norm().item(), scales[name]), 2 * stored)
        assert err <= bound, (name, rel_err(g, r), scales[name], stored, kw)
    return out, got


def _uncancelled_norms(refs, target, go, kw):
    """||Σ|terms||| of each gradient: with dL = ∂loss/∂logits (fp64, the reference's path),
    grad_weight = dLᵀ·h, grad_hidden = dL·W, grad_bias = Σ_t dL; the same with |dL|, |h|, |W|."""
    h = refs["hidden"].detach().reshape(-1, refs["hidden"].shape[-1])
    w = refs["weight"].detach()
    b = None if refs["bias"] is None else refs["bias"].detach()
    logits = F.linear(h, w, b).requires_grad_(True)
    capped = logits if kw.get("softcap") is None else softcap_reference(logits, kw["softcap"])
    loss = torch_cross_entropy(capped, target.reshape(-1), kw.get("ignore_index", IGNORE),
                               kw.get("label_smoothing", 0.0), kw.get("z_loss", 0.0), None,
                               kw.get("reduction", "mean"))
    d_logits = torch.autograd.grad(loss, logits, go.reshape(loss.shape))[0].abs()
    return {"hidden": (d_logits @ w.abs()).norm().item(), "weight": (d_logits.t() @ h.abs()).norm().item(),
            "bias": d_logits.sum(0).norm().item()}


def _tiny_chunks(monkeypatch, vocab, elem_size, tokens):
    """Chunks of ``tokens`` tokens, so small shapes walk several (and a ragged last one)."""
    monkeypatch.setattr(lce_mod, "CHUNK_LOGITS_BYTES", vocab * elem_size * tokens)
    assert _chunk_tokens(10**6, vocab, elem_size) == tokens


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [None, 4], ids=["one-chunk", "chunks-of-4"])
def test_reductions_and_chunks(monkeypatch, dtype, reduction, chunk):
    if chunk:
        _tiny_chunks(monkeypatch, 70, torch.empty((), dtype=dtype).element_size(), chunk)
    _check(*_inputs(11, 24, 70, dtype, bias=True), reduction=reduction)


@pytest.mark.parametrize(
    "opts", [dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=4.0),
             dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0, reduction="none")],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_options(monkeypatch, opts):
    _tiny_chunks(monkeypatch, 90, 4, 3)
    _check(*_inputs(7, 16, 90, bias=True), **opts)


def test_long_vocab_rows_take_the_looped_kernel(monkeypatch):
    """Vocabulary rows longer than one kernel tile (the looped tier) inside the chunk loop."""
    import tilefuse.ops._cross_entropy_kernels as kernels
    monkeypatch.setattr(kernels, "MAX_SINGLE_TILE", 32)
    monkeypatch.setattr(kernels, "_looped_grad_tile", lambda n_cols, elem_bytes: (64, 4))
    monkeypatch.setattr(kernels, "LOOPED_STATS_BLOCK_V", 64)
    monkeypatch.setattr(kernels, "BWD_BLOCK_V", 64)
    _tiny_chunks(monkeypatch, 200, 4, 2)
    _check(*_inputs(5, 8, 200), label_smoothing=0.1)


@pytest.mark.parametrize("grads", [("hidden",), ("weight",), ("bias",), ()], ids=lambda g: "+".join(g) or "none")
def test_partial_gradients(grads):
    """Only the gradients asked for are computed and returned (a frozen lm_head, say)."""
    _check(*_inputs(6, 16, 40, bias=True), grads=grads)


def test_leading_dims_and_single_token():
    out, _ = _check(*_inputs(5, 16, 33, lead=(2,)), reduction="none")
    assert out.shape == (2, 5)
    _check(*_inputs(1, 8, 7))
    hidden, weight, _, _ = _inputs(1, 8, 7)
    _check(hidden[0], weight, None, torch.tensor(3, device=DEVICE))   # hidden [H], 0-d target


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_and_empty(reduction):
    hidden, weight, bias, target = _inputs(4, 8, 20, bias=True)
    out, grads = _check(hidden, weight, bias, torch.full_like(target, IGNORE), reduction=reduction, z_loss=1e-3)
    assert (out == 0).all() and all((g == 0).all() for g in grads)
    out, grads = _check(hidden[:0], weight, bias, target[:0], reduction=reduction)
    assert all((g == 0).all() for g in grads)


def test_repeated_backward(monkeypatch):
    """retain_graph backward with different grad_outputs: each gradient right (stored grads rescale)."""
    _tiny_chunks(monkeypatch, 30, 4, 3)
    for reduction in ("mean", "none"):
        hidden, weight, _, target = _inputs(7, 8, 30)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        rh, rw = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
        out = linear_cross_entropy(h, w, target, reduction=reduction)
        ref = linear_cross_entropy_reference(rh, rw, target, reduction=reduction)
        for go in (torch.ones_like(ref), torch.randn_like(ref), torch.randn_like(ref)):
            got = torch.autograd.grad(out, [h, w], go.float(), retain_graph=True)
            want = torch.autograd.grad(ref, [rh, rw], go, retain_graph=True)
            assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_strided_target(monkeypatch, reduction):
    """A target sliced with a step was read as if contiguous (a helper's audit, s36)."""
    _tiny_chunks(monkeypatch, 23, 4, 3)
    hidden, weight, _, _ = _inputs(8, 16, 23)
    target = torch.randint(0, 23, (16,), device=DEVICE)[::2]
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    rh, rw = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    out = linear_cross_entropy(h, w, target, reduction=reduction)
    ref = linear_cross_entropy_reference(rh, rw, target.contiguous(), reduction=reduction)
    assert rel_err(out, ref) <= 1e-5
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, [h, w], go.float())
    want = torch.autograd.grad(ref, [rh, rw], go)
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, want))


def test_repeated_backward_accumulates_into_grad(monkeypatch):
    """.grad of a leaf that was None takes the handed-out buffer; a second backward
    (retain_graph) used to rescale that buffer in place: h.grad came out 6 g for g + 3 g (a
    helper's audit, s36)."""
    _tiny_chunks(monkeypatch, 23, 4, 3)
    hidden, weight, _, target = _inputs(8, 16, 23)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    rh, rw = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    loss = linear_cross_entropy(h, w, target)
    loss.backward(retain_graph=True)
    loss.backward(torch.tensor(3.0, device=DEVICE), retain_graph=True)
    linear_cross_entropy_reference(rh, rw, target).backward(torch.tensor(4.0, device=DEVICE, dtype=torch.float64))
    assert rel_err(h.grad, rh.grad) <= 1e-5 and rel_err(w.grad, rw.grad) <= 1e-5


def test_repeated_backward_fp16_refuses_lost_values(monkeypatch):
    """float16: a second backward after a first grad_output below 1 raises (the stored gradients
    were scaled into the subnormal range in place); after one above 1 it is right."""
    _tiny_chunks(monkeypatch, 23, 2, 3)
    hidden, weight, _, target = _inputs(8, 16, 23, dtype=torch.float16)
    rh, rw = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want = torch.autograd.grad(linear_cross_entropy_reference(rh, rw, target), [rh, rw])
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, target)
    torch.autograd.grad(loss, [h, w], torch.tensor(1e-4, device=DEVICE), retain_graph=True)
    with pytest.raises(RuntimeError, match="subnormal"):
        torch.autograd.grad(loss, [h, w])
    loss = linear_cross_entropy(h, w, target)
    g3 = torch.autograd.grad(loss, [h, w], torch.tensor(3.0, device=DEVICE), retain_graph=True)
    g1 = torch.autograd.grad(loss, [h, w])
    assert all(rel_err(a, 3 * r) <= 2e-3 and rel_err(b, r) <= 2e-3 for a, b, r in zip(g3, g1, want))


@pytest.mark.parametrize("n_tokens", [9, 10, 3])
def test_last_chunk_weight_grad_deferred_to_backward(monkeypatch, n_tokens):
    """With several chunks the forward leaves the last chunk's grad_weight GEMM to the backward,
    which applies grad_output in it: one finishing call per graph, none for a single chunk, none
    after the first backward (a retained graph's second backward rescales the finished gradient);
    every gradient against fp64 for grad_output 1 and a random one."""
    _tiny_chunks(monkeypatch, 29, 4, 4)       # 9 tokens: chunks 4 + 4 + 1; 10: 4 + 4 + 2; 3: one chunk
    finishes = count_calls(monkeypatch, lce_mod, "_finish_weight_grad_op")
    gemms = count_calls(monkeypatch, lce_mod, "_weight_grad_gemm")
    hidden, weight, bias, target = _inputs(n_tokens, 12, 29, bias=True)
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    rh, rw, rb = (t.double().requires_grad_(True) for t in (hidden, weight, bias))
    out = linear_cross_entropy(h, w, target, b)
    ref = linear_cross_entropy_reference(rh, rw, target, rb)
    chunks = -(-n_tokens // 4)
    assert len(gemms) == chunks - (chunks > 1) and not finishes
    for go in (torch.randn_like(ref), torch.ones_like(ref)):
        got = torch.autograd.grad(out, [h, w, b], go.float(), retain_graph=True)
        want = torch.autograd.grad(ref, [rh, rw, rb], go, retain_graph=True)
        assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want)), [rel_err(g, r) for g, r in zip(got, want)]
        assert len(finishes) == (chunks > 1)


@pytest.mark.parametrize("rematerialize", ["checkpoint", "copying-hooks"])
def test_deferred_gemm_on_rematerialized_saved_tensors(monkeypatch, rematerialize):
    """A later backward (retain_graph) whose saved tensors are fresh copies of the forward's (a
    non-reentrant checkpoint's recompute; saved-tensor hooks that copy, as save_on_cpu does for
    CUDA tensors) still gets the deferred chunk in grad_weight: s42 audit, 0.31 relative error
    before (the "already finished" state lived on ctx, not with the saved tensors)."""
    from torch.utils.checkpoint import checkpoint

    _tiny_chunks(monkeypatch, 29, 4, 4)
    hidden, weight, bias, target = _inputs(10, 12, 29, bias=True)
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    rh, rw, rb = (t.double().requires_grad_(True) for t in (hidden, weight, bias))
    fn = lambda h, w, b: linear_cross_entropy(h, w, target, b)      # noqa: E731
    if rematerialize == "checkpoint":
        out = checkpoint(fn, h, w, b, use_reentrant=False)
    else:
        with torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x.clone()):
            out = fn(h, w, b)
    ref = linear_cross_entropy_reference(rh, rw, target, rb)
    for go in (1.0, 2.0, -0.5):
        got = torch.autograd.grad(out, [h, w, b], torch.tensor(go), retain_graph=True)
        want = torch.autograd.grad(ref, [rh, rw, rb], torch.tensor(go, dtype=torch.float64), retain_graph=True)
        assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want)), (go, [rel_err(g, r) for g, r in zip(got, want)])


def test_deferred_gemm_refuses_hidden_edited_in_place(monkeypatch):
    """The deferred GEMM reads hidden's last chunk in the backward: hidden edited in place after
    the forward raises (autograd's version check) instead of giving grad_weight from new values."""
    _tiny_chunks(monkeypatch, 29, 4, 4)
    hidden, weight, _, target = _inputs(10, 12, 29)
    leaf, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h = leaf * 1.0
    loss = linear_cross_entropy(h, w, target)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_deferred_pending_shape_matches_fake(monkeypatch):
    """The forward's pending dlogits output has the shape its fake implementation promises
    (rows of the last chunk when there are several, else [0]), with and without deferral."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _tiny_chunks(monkeypatch, 29, 4, 4)
    for n_tokens, defer in [(10, True), (8, True), (3, True), (10, False), (0, True)]:
        hidden, weight, _, target = _inputs(n_tokens, 12, 29)
        args = (hidden, weight, target, None, IGNORE, 0.0, 0.0, None, "mean", True, True, False, True, 0,
                torch.float32, defer)
        real = lce_mod._lce_fwd_op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = lce_mod._lce_fwd_op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake], (n_tokens, defer)
        assert real[4].shape[0] == ({10: 2, 8: 4}.get(n_tokens, 0) if defer else 0)    # chunks of 4 tokens


def test_compiled_does_not_defer(monkeypatch):
    """Under torch.compile the forward computes the whole grad_weight (the traced backward scales
    the stored gradients as one functional op, which a deferred GEMM would break on a second
    backward); the gradients match fp64."""
    _tiny_chunks(monkeypatch, 29, 4, 4)
    finishes = count_calls(monkeypatch, lce_mod, "_finish_weight_grad_op")
    hidden, weight, _, target = _inputs(10, 12, 29)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    rh, rw = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    out = torch.compile(linear_cross_entropy, fullgraph=True, backend="aot_eager")(h, w, target)
    ref = linear_cross_entropy_reference(rh, rw, target)
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, [h, w], go.float())
    want = torch.autograd.grad(ref, [rh, rw], go)
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want)) and not finishes


def test_no_grad_is_loss_only():
    hidden, weight, _, target = _inputs(4, 8, 20)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(True), weight, target)
    assert not loss.requires_grad
    assert rel_err(loss, linear_cross_entropy_reference(hidden.double(), weight.double(), target)) <= 1e-5


def test_cpu_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _tiny_chunks(monkeypatch, 50, 4, 4)
    _check(*_inputs(9, 16, 50, bias=True), label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    _check(*_inputs(9, 16, 50), reduction="none")


def test_chunk_heuristic_memory_budget():
    """The issue's shape: 640-token chunks, 157 MiB of chunk logits; with the 1002 MiB bf16
    grad_weight and the 64 MiB grad_hidden the peak stays under 1.2 GiB extra (one more 128-row
    step would not)."""
    chunk = _chunk_tokens(8192, 128256, 2)
    grads = 128256 * 4096 * 2 + 8192 * 4096 * 2
    assert chunk == 640 and chunk * 128256 * 2 + grads <= 1.2 * 2**30
    assert (chunk + lce_mod.CHUNK_ROWS_ALIGN) * 128256 * 2 + grads > 1.2 * 2**30
    assert _chunk_tokens(5, 128256, 2) == 5 and _chunk_tokens(10**6, 10**9, 4) == 1


def test_module():
    hidden, weight, bias, target = _inputs(6, 16, 40, bias=True)
    loss_fn = LinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    ref = linear_cross_entropy_reference(hidden.double(), weight.double(), target, bias.double(),
                                         label_smoothing=0.1, reduction="sum")
    assert rel_err(loss_fn(hidden, weight, target, bias), ref) <= 1e-5
    assert "reduction='sum'" in repr(loss_fn) and "chunk_tokens=None" in repr(loss_fn)


def test_bad_inputs():
    hidden, weight, bias, target = _inputs(4, 8, 20, bias=True)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[:, :7], target)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[0], target)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(hidden, weight, target, bias[:5])
    with pytest.raises(TypeError, match="weight"):
        linear_cross_entropy(hidden, weight.half(), target)
    with pytest.raises(TypeError, match="target"):
        linear_cross_entropy(hidden, weight, target.float())
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(hidden, weight, target[:2])
    with pytest.raises(ValueError, match="target holds class 20"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 20, 1, 2], device=DEVICE))
    # on CUDA the range test is awaited after the first GEMM is queued: nothing is left pending
    assert rel_err(linear_cross_entropy(hidden, weight, target),
                   linear_cross_entropy_reference(hidden.double(), weight.double(), target)) <= 1e-5
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(hidden, weight, target, softcap=-1.0)
    with pytest.raises(ValueError, match="reduction"):
        LinearCrossEntropyLoss(reduction="batchmean")


@settings(max_examples=15, deadline=None)
@given(
    n_tokens=st.integers(1, 9),
    n_hidden=st.integers(1, 20),
    vocab=st.integers(2, 120),   # V=1 has an (exactly) zero or z-loss-only gradient: ill-posed relative errors
    chunk=st.integers(1, 10),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    label_smoothing=st.sampled_from([0.0, 0.1]),
    z_loss=st.sampled_from([0.0, 1e-2]),
    softcap=st.sampled_from([None, 3.0]),
    bias=st.booleans(),
)
def test_hypothesis(n_tokens, n_hidden, vocab, chunk, reduction, label_smoothing, z_loss, softcap, bias):
    old = lce_mod.CHUNK_LOGITS_BYTES
    lce_mod.CHUNK_LOGITS_BYTES = vocab * 4 * chunk
    try:
        assert _chunk_tokens(n_tokens, vocab, 4) == min(chunk, n_tokens)
        _check(*_inputs(n_tokens, n_hidden, vocab, bias=bias), reduction=reduction, label_smoothing=label_smoothing,
               z_loss=z_loss, softcap=softcap)
    finally:
        lce_mod.CHUNK_LOGITS_BYTES = old


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunk_tokens(chunk, reduction):
    """Any chunk size gives the same loss and gradients (the last chunk ragged or not)."""
    _check(*_inputs(13, 16, 50, bias=True), reduction=reduction, chunk_tokens=chunk)


@pytest.mark.parametrize("n_hidden, vocab", [(1, 2), (1, 50), (3, 2), (2, 1)])
def test_size_one_dims(n_hidden, vocab):
    """H = 1 or V = 1 over several chunks: the accumulated grad_weight's transposed view has
    degenerate strides there (on CUDA, cuBLASLt rejected it: found by test_hypothesis, H200)."""
    if vocab > 1:
        _check(*_inputs(13, n_hidden, vocab, bias=True), chunk_tokens=2)
    else:   # V = 1: the exact gradients are 0 (ill-posed relative errors): the forward, and a backward that runs
        h, w, b, t = _inputs(5, n_hidden, 1, bias=True)
        _check(h, w, b, t, grads=(), chunk_tokens=2)
        out = linear_cross_entropy(h.requires_grad_(), w.requires_grad_(), t, chunk_tokens=2)
        assert all(g.abs().max() <= 1e-6 for g in torch.autograd.grad(out, (h, w)))


def test_chunk_tokens_bad_values():
    h, w, b, t = _inputs(4, 8, 10)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunk_tokens"):
            linear_cross_entropy(h, w, t, chunk_tokens=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tile", ["128x128-pingpong", "128x256"])
def test_gpu_gluon_gemms(monkeypatch, dtype, tile):
    """The Gluon GEMM paths on sm_90 (lce_mod.GLUON_LOGITS, off by default, and GLUON_WEIGHT_GRAD
    with each WEIGHT_GRAD_TILE; the default is the ping-pong one): several chunks, so grad_weight
    is written by the first chunk and accumulated by the others."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma kernel: sm_90 only")
    monkeypatch.setattr(lce_mod, "GLUON_LOGITS", True)
    monkeypatch.setattr(lce_mod, "GLUON_WEIGHT_GRAD", True)
    monkeypatch.setattr(lce_mod, "WEIGHT_GRAD_TILE", tile)
    hidden, weight, _, target = _inputs(1000, 264, 4104, dtype=dtype)
    for chunk in (128, None):
        _check(hidden, weight, None, target, grads=("hidden", "weight"), chunk_tokens=chunk)
