"""tilefuse._op.FastOp: eager calls skip the dispatcher, tracing goes through it, results agree."""

import pytest
import torch
from conftest import DEVICE

import tilefuse
from tilefuse._op import custom_op, direct_backward
from tilefuse.testing import rel_err

calls = {"impl": 0}


@custom_op("tilefuse_test::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    calls["impl"] += 1
    return x * factor


@_scale.register_fake
def _(x, factor):
    return torch.empty_like(x)


_scale.register_autograd(lambda ctx, dy: (dy * ctx.factor, None),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]))


@custom_op("tilefuse_test::add_", mutates_args=("x",))
def _add_(x: torch.Tensor, y: torch.Tensor) -> None:
    x.add_(y)


@custom_op("tilefuse_test::triple_bwd", mutates_args=())
def _triple_bwd(dy: torch.Tensor) -> torch.Tensor:
    return dy * 3


@_triple_bwd.register_fake
def _(dy):
    return torch.empty_like(dy)


@custom_op("tilefuse_test::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_triple.register_fake
def _(x):
    return torch.empty_like(x)


_backward_paths: list = []


def _triple_backward(ctx, dy):
    direct = direct_backward(ctx, dy)
    _backward_paths.append(direct)
    return (_triple_bwd.direct if direct else _triple_bwd)(dy)


_triple.register_autograd(_triple_backward)


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("how", ["eager", "subclass grad_output", "compiled"])
def test_direct_backward_only_when_eager_and_plain(how):
    """An eager backward calls its backward op's implementation directly; a gradient that is not
    a plain tensor, or a backward traced by torch.compile, goes through the custom op."""
    x = torch.randn(5, requires_grad=True)
    g = torch.randn(5)
    _backward_paths.clear()
    if how == "compiled":
        f = torch.compile(_triple, fullgraph=True, backend="aot_eager")
        (dx,) = torch.autograd.grad(f(x), x, g)
    else:
        y = _triple(x)
        (dx,) = torch.autograd.grad(y, x, g.as_subclass(_Sub) if how == "subclass grad_output" else g)
    assert torch.equal(dx.as_subclass(torch.Tensor), g * 3)
    assert _backward_paths == [how == "eager"]


def test_eager_autograd_and_kwargs():
    x = torch.randn(5, requires_grad=True)
    y = _scale(x, factor=3.0)                      # keyword argument binds positionally
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.full_like(x, 3.0))
    assert type(y.grad_fn).__name__ == "_EagerBackward"   # the direct path, not the dispatcher's


def test_no_grad_calls_impl_directly():
    before = calls["impl"]
    with torch.no_grad():
        _scale(torch.randn(3, requires_grad=True), 2.0)
    assert calls["impl"] == before + 1


def test_fake_mode_goes_through_dispatcher():
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = calls["impl"]
    with FakeTensorMode():
        out = _scale(torch.empty(4), 2.0)
    assert calls["impl"] == before            # the fake impl ran, not the real one
    assert out.shape == (4,)


def test_mutation_bumps_version_counter():
    x, y = torch.zeros(3), torch.ones(3)
    v = x._version
    _add_(x, y)
    assert x._version > v and torch.equal(x, y)


def test_compiled_matches_eager():
    x = torch.randn(6, 33, device=DEVICE, requires_grad=True)
    f = torch.compile(lambda t: tilefuse.softmax(t) * 2, fullgraph=True, backend="aot_eager")
    assert rel_err(f(x), tilefuse.softmax(x) * 2) == 0.0


def _zero_fills(step) -> list:
    """(op, shapes) of every zero fill ``step`` runs, from the profiler's CPU events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return [(e.name, e.input_shapes) for e in prof.events() if e.name in ("aten::zero_", "aten::zeros")]


def _side_output_cases():
    dt = torch.float32
    q, k, v = (torch.randn(2, 33, 4, 16, device=DEVICE, dtype=dt, requires_grad=True) for _ in range(3))
    yield "attention lse [B, H, S]", [2, 4, 33], lambda: tilefuse.attention(q, k, v, causal=True)
    a = torch.randn(17, 24, device=DEVICE, dtype=dt, requires_grad=True)
    w = torch.randn(40, 24, device=DEVICE, dtype=dt, requires_grad=True)
    yield "matmul preact [M, N]", [17, 40], lambda: tilefuse.matmul(a, w.t(), activation="gelu")
    wg = torch.randn(2 * 40, 24, device=DEVICE, dtype=dt, requires_grad=True)
    yield "gate_up g | u [T, 2I]", [17, 80], lambda: tilefuse.swiglu_linear(a, wg)


def test_backward_zero_fills_no_side_output():
    """A side output that never gets a gradient (attention's lse, a saved preact, the gate-up
    GEMM's g | u) must not cost a zero-filled tensor of its shape per eager backward: autograd
    materializes one unless the op registers ``materialize_grads=False``. Measured before the
    fix: an [M, N] zero fill in every backward of a matmul with an activation."""
    for what, shape, forward in _side_output_cases():
        out = forward()
        fills = _zero_fills(lambda: out.sum().backward())
        assert not [f for f in fills if f[1] and f[1][0] == shape], f"{what}: {fills}"


def test_workspace_roles_never_share_memory(monkeypatch):
    """Two roles of one call with equal shapes get distinct buffers; a role's second call gets its
    first call's views back (reuse); tests' poisoning gets fresh NaN buffers instead."""
    from tilefuse import _dispatch

    monkeypatch.setattr(_dispatch, "POISON_OUTPUTS", False)
    _dispatch.clear_workspaces()
    a = _dispatch.workspace("role_a", ((3, 5), (3, 5)), torch.float32, torch.device(DEVICE))
    b = _dispatch.workspace("role_b", ((3, 5),), torch.float32, torch.device(DEVICE))
    ptrs = [t.data_ptr() for t in (*a, *b)]
    assert len(set(ptrs)) == 3 and all(t.shape == (3, 5) and t.is_contiguous() for t in (*a, *b))
    assert a[1].data_ptr() - a[0].data_ptr() >= 15 * 4                 # the two views do not overlap
    again = _dispatch.workspace("role_a", ((3, 5), (3, 5)), torch.float32, torch.device(DEVICE))
    assert [t.data_ptr() for t in again] == ptrs[:2]
    monkeypatch.setattr(_dispatch, "POISON_OUTPUTS", True)
    fresh = _dispatch.workspace("role_a", ((3, 5),), torch.float32, torch.device(DEVICE))
    assert fresh[0].isnan().all()
    _dispatch.clear_workspaces()


def test_forward_mode_ad_raises():
    """Dual tensors (torch.autograd.forward_ad): the kernels have no JVP and the tangent vanished
    from the output, on the direct path, the fast paths and the dispatcher alike (s38 audit)."""
    import torch.autograd.forward_ad as fwAD

    from tilefuse.ops.matmul import _matmul_fwd_op

    a, b = torch.randn(4, 8, device=DEVICE), torch.randn(8, 5, device=DEVICE)
    with fwAD.dual_level():
        dual = fwAD.make_dual(a, torch.randn_like(a))
        calls = [lambda: tilefuse.matmul(dual, b), lambda: tilefuse.matmul(dual, b),      # checked, then cached
                 lambda: tilefuse.rms_norm(dual), lambda: tilefuse.softmax(dual),
                 lambda: _matmul_fwd_op.op(dual, b, None, None, "none", torch.float32, False)]
        for call in calls:
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                call()
        assert torch.equal(tilefuse.matmul(a, b), tilefuse.matmul(a, b))      # no tangent: runs


def test_meta_tensors_repeat():
    """Meta tensors take the reference path (shapes only); the fast-path key said "the Triton path
    runs" for any device under the interpreter, so a repeated call launched the cached kernel on
    meta tensors ("Cannot copy out of meta tensor", s38 audit)."""
    a, b = torch.randn(6, 8, device="meta"), torch.randn(8, 5, device="meta")
    cos, sin = tilefuse.rope_cos_sin_table(4, 8, device="meta")
    q = torch.randn(1, 4, 2, 8, device="meta")
    for _ in range(2):
        assert tilefuse.matmul(a, b).shape == (6, 5)
        assert tilefuse.rms_norm(a).shape == (6, 8)
        assert tilefuse.rope(q, q.clone(), cos, sin)[0].shape == (1, 4, 2, 8)


def _penalty_cases():
    w = torch.randn(33, device=DEVICE)
    yield "rms_norm (saves its input)", lambda h: tilefuse.rms_norm(h, None, w)
    yield "softmax (saves its output)", lambda h: tilefuse.softmax(h)
    yield "bias_act", lambda h: tilefuse.bias_act(h, w, activation="gelu")


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
@pytest.mark.parametrize("case", range(3))
def test_gradient_penalty_through_an_op_raises(case, how):
    """A second derivative through an op (a gradient penalty) raises, whether by ``.backward()``
    or by ``autograd.grad(penalty, params)``; the latter used to drop the op's term without a word
    (dW 0.5 off for rms_norm: the error node's edges led only to fresh leaves). The first-order
    gradient built with create_graph=True is unchanged."""
    what, op = list(_penalty_cases())[case]
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    W = torch.randn(33, 16, device=DEVICE, requires_grad=True)
    weights = torch.linspace(-1, 1, 33, device=DEVICE)
    (gx,) = torch.autograd.grad((op(x @ W.t()) * weights).sum(), x, create_graph=True)
    (plain,) = torch.autograd.grad((op(x @ W.t()) * weights).sum(), x)
    assert torch.equal(gx.detach(), plain), what
    with pytest.raises(RuntimeError, match="not differentiable"):
        if how == "backward":
            gx.pow(2).sum().backward()
        else:
            torch.autograd.grad(gx.pow(2).sum(), W)


def test_jacrev_matches_torch():
    """torch.func.jacrev (vmap over vjp: batched cotangents into the backward) through ops with
    one and with several differentiable inputs."""
    x, w = torch.randn(3, 6, device=DEVICE), torch.randn(6, 4, device=DEVICE)
    got = torch.func.jacrev(tilefuse.softmax)(x)
    want = torch.func.jacrev(lambda t: torch.softmax(t, -1))(x)
    assert rel_err(got, want) <= 1e-5
    got = torch.func.jacrev(tilefuse.matmul, argnums=(0, 1))(x, w)
    want = torch.func.jacrev(torch.matmul, argnums=(0, 1))(x, w)
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want))


def test_per_sample_gradients_of_a_model():
    """Per-sample gradients the torch.func way (functional_call, grad, vmap) of a Llama block
    built from tilefuse's modules (norms, linears, attention, fused SwiGLU MLP, linear
    cross-entropy) equal those of the same weights in torch's modules."""
    from tilefuse.testing import LlamaStack

    ours, theirs = LlamaStack(True, 1, 32, 2, 64, 50).to(DEVICE), LlamaStack(False, 1, 32, 2, 64, 50).to(DEVICE)
    theirs.load_state_dict(ours.state_dict())
    x, target = torch.randn(3, 1, 5, 32, device=DEVICE), torch.randint(0, 50, (3, 1, 5), device=DEVICE)

    def per_sample(model):
        params = {k: v.detach() for k, v in model.named_parameters()}
        loss = lambda p, xi, ti: torch.func.functional_call(model, p, (xi, ti))     # noqa: E731
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, target)

    got, want = per_sample(ours), per_sample(theirs)
    assert got.keys() == want.keys()
    for name in got:
        assert rel_err(got[name], want[name]) <= 1e-5, name
