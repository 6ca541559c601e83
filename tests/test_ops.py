"""Registry-driven correctness: every registered op, every test shape, every dtype.

Each case draws fresh random inputs, runs the tilefuse function (outputs NaN-poisoned before
the launch, see conftest), and compares every output and the gradient of every input that has
one against the op's reference evaluated on float64 copies of the same inputs, by relative
error norm ||out - ref|| / ||ref|| within the spec's per-dtype tolerance.

CPU (CI): the Triton kernels run under the interpreter; bf16 and the large ``gpu_test_shapes``
carry the ``gpu`` marker and run on the GPU.
"""

import pytest
import torch
from conftest import DEVICE

from tilefuse import registry
from tilefuse.registry import as_tuple
from tilefuse.testing import rel_err


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def _cases():
    for spec in registry.all_ops():
        for gpu_shapes, shapes in ((False, spec.test_shapes), (True, spec.gpu_test_shapes)):
            for shape in shapes:
                for dtype in spec.dtypes:
                    marks = [pytest.mark.gpu] if (gpu_shapes or dtype == torch.bfloat16) else []
                    ident = f"{spec.name}-{'x'.join(map(str, shape))}-{_dtype_name(dtype)}"
                    yield pytest.param(spec.name, tuple(shape), dtype, marks=marks, id=ident)


def _grad_outputs(outs):
    return [torch.randn_like(o) if o.requires_grad else None for o in outs]


def check_against_reference(spec, shape, dtype, device, fn=None):
    """Forward and backward of ``fn`` (default: the tilefuse op) vs the fp64 reference."""
    fn = fn or spec.fn
    tol = spec.tolerance[dtype]
    inp = spec.make_inputs(shape, dtype, device)
    ref_inp = inp.detached(dtype=torch.float64)
    outs = as_tuple(fn(*inp.args, **inp.kwargs))
    refs = as_tuple(spec.reference(*ref_inp.args, **ref_inp.kwargs))
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape, f"output {i}: shape {tuple(o.shape)} vs reference {tuple(r.shape)}"
        assert o.dtype == dtype or not o.is_floating_point(), f"output {i} has dtype {o.dtype}"
        err = rel_err(o, r)
        assert err <= tol, f"{spec.name} {shape} {dtype}: output {i} rel err {err:.3g} > {tol:g}"
    if not (spec.has_backward and inp.grad_args):
        return
    gouts = _grad_outputs(outs)
    pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None]
    leaves = [inp.args[i] for i in inp.grad_args]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    ref_pairs = [(r, g.double()) for r, g in zip(refs, gouts) if g is not None]
    ref_leaves = [ref_inp.args[i] for i in inp.grad_args]
    ref_grads = torch.autograd.grad([r for r, _ in ref_pairs], ref_leaves, [g for _, g in ref_pairs], allow_unused=True)
    for i, g, rg in zip(inp.grad_args, grads, ref_grads):
        if rg is None:
            assert g is None or g.abs().max() == 0, f"grad of arg {i} should be zero"
            continue
        assert g is not None, f"{spec.name}: no gradient for arg {i}"
        assert g.shape == rg.shape
        err = rel_err(g, rg)
        assert err <= tol, f"{spec.name} {shape} {dtype}: grad of arg {i} rel err {err:.3g} > {tol:g}"


@pytest.mark.parametrize("name,shape,dtype", list(_cases()))
def test_op_matches_reference(name, shape, dtype):
    check_against_reference(registry.get(name), shape, dtype, DEVICE)


@pytest.mark.parametrize("name", [s.name for s in registry.all_ops()])
def test_compile_fullgraph(name):
    """torch.compile(fullgraph=True) traces through the custom op (fake impl + autograd)."""
    spec = registry.get(name)
    compiled = torch.compile(spec.fn, fullgraph=True, backend="aot_eager")
    check_against_reference(spec, tuple(spec.test_shapes[1]), torch.float32, DEVICE, fn=compiled)


@pytest.mark.parametrize("name", [s.name for s in registry.all_ops()])
def test_cpu_reference_path(name, monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors take the PyTorch reference path and agree too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = registry.get(name)
    check_against_reference(spec, tuple(spec.test_shapes[1]), torch.float32, "cpu")


def test_registry_is_complete():
    for spec in registry.all_ops():
        assert spec.test_shapes and spec.bench_shapes, spec.name
        for shape in spec.bench_shapes:
            for pass_ in ("fwd", "bwd") if spec.has_backward else ("fwd",):
                assert spec.bytes_fn(tuple(shape), torch.bfloat16, pass_) > 0, spec.name
