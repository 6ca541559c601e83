"""tilefuse._op.FastOp: eager calls skip the dispatcher, tracing goes through it, results agree."""

import torch
from conftest import DEVICE

import tilefuse
from tilefuse._op import custom_op
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
