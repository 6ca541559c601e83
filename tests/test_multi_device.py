"""Tensors on a GPU other than the current one (two GPUs or more).

Triton launches on the current device and stream; torch's own ops follow their tensors. Every op
of the registry runs here on cuda:1 while cuda:0 is current, forward and backward, checked against
its reference; each case also runs twice so the eager fast paths' second call is covered. Before
the device guard (``tilefuse._op.op_impl``) such a launch went to cuda:0 with cuda:1 pointers.

Run this file in its own pytest process: a kernel launched on the wrong GPU is an illegal memory
access, which poisons the CUDA context of the worker for every later test.
"""

import pytest
import torch
from conftest import HAS_CUDA
from test_ops import check_against_reference

from tilefuse import registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                                                  reason="needs two GPUs")]


@pytest.mark.parametrize("name", [s.name for s in registry.all_ops()])
def test_op_on_a_non_current_gpu(name):
    spec = registry.get(name)
    dtype = torch.float16 if torch.float16 in spec.dtypes else spec.dtypes[0]
    with torch.cuda.device(0):
        for shape in spec.test_shapes[:2]:
            for _ in range(2):
                check_against_reference(spec, tuple(shape), dtype, "cuda:1")
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0


def test_module_on_a_non_current_gpu():
    """A model placed on cuda:1 (no torch.cuda.set_device): Linear + RMSNorm + attention + loss."""
    import tilefuse

    with torch.cuda.device(0):
        dev = torch.device("cuda:1")
        lin = tilefuse.nn.Linear(64, 64, device=dev, dtype=torch.bfloat16)
        norm = tilefuse.nn.RMSNorm(64, eps=1e-6, device=dev, dtype=torch.bfloat16)
        x = torch.randn(2, 32, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        h = norm(lin(x))
        q = h.view(2, 32, 4, 16)
        out = tilefuse.attention(q, q, q, causal=True).reshape(64, 64)
        target = torch.randint(0, 64, (64,), device=dev)
        loss = tilefuse.cross_entropy(out.float(), target)
        loss.backward()
        ref_h = torch.nn.functional.rms_norm(torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()),
                                             (64,), norm.weight.float(), eps=1e-6)
        assert (h.float() - ref_h).norm() / ref_h.norm() < 1e-2
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
        assert torch.cuda.current_device() == 0
