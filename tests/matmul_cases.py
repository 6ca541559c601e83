"""What the matmul tests share (test_matmul.py, test_matmul_gpu.py, test_matmul_plans.py,
test_matmul_stream_k.py, test_matmul_tail_split.py): tolerances, operands, the checked forward and
backward against fp64 and PyTorch's own error, and the CUDA-graph replay check."""


import torch
from conftest import DEVICE

from tilefuse.ops import matmul as mm     # registers "matmul" (until ops/__init__ imports the module)
from tilefuse.ops.matmul import matmul, matmul_reference
from tilefuse.testing import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]


def _rand(shape, dtype, scale=1.0, grad=True):
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype).requires_grad_(grad)


def _weight_t(n, k, dtype):
    """b = w.t() of an [N, K] weight: unit K stride, as nn.Linear passes it (a leaf view)."""
    return torch.randn(n, k, device=DEVICE).to(dtype).t().detach().requires_grad_(True)


def _torch_eager(a, b, bias, act, residual, out_dtype):
    """The same computation in PyTorch, in the operands' dtype (the flash-attn rule's baseline)."""
    return mm._torch_matmul(a, b, bias, act, residual, out_dtype)


def _check(a, b, bias=None, act=None, residual=None, out_dtype=None, fn=matmul):
    """fn's output and the gradients of every grad-requiring input vs the fp64 reference, each
    within max(TOL, 2 x PyTorch's own error in that dtype on the same inputs)."""
    args = (a, b, bias, act, residual, out_dtype)
    leaves = [t for t in (a, b, bias, residual) if t is not None and t.requires_grad]
    wide = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in args]
    y = fn(*args)
    assert y.dtype == (out_dtype or a.dtype) and y.shape == (*a.shape[:-1], b.shape[1])
    y_ref = matmul_reference(*wide[:5], torch.float64)
    dy = torch.randn(y.shape, device=DEVICE).to(y.dtype)
    grads = torch.autograd.grad(y, leaves, dy) if leaves else ()
    wide_leaves = [w for w, t in zip(wide[:2] + wide[2:3] + wide[4:5], (a, b, bias, residual))
                   if t is not None and t.requires_grad]
    ref_grads = torch.autograd.grad(y_ref, wide_leaves, dy.double()) if leaves else ()
    # flash-attn's rule per tensor: max(TOL, 2 x PyTorch's own error on the same inputs in the same
    # dtype). fp32 too: a gradient that is a short sum with cancellation is ill-conditioned in fp32
    # itself (on the GPU: a grad 1.16e-5 off at M = 29, N = 1, K = 2, gelu_tanh, with a bias)
    base = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in args]
    y_t = _torch_eager(*base)
    base_leaves = [t for t in (base[0], base[1], base[2], base[4]) if t is not None and t.requires_grad]
    t_grads = torch.autograd.grad(y_t, base_leaves, dy.to(y_t.dtype)) if leaves else ()
    tol = max(TOL[a.dtype], 2 * rel_err(y_t, y_ref))
    assert rel_err(y, y_ref) <= tol, f"forward {rel_err(y, y_ref):.3g} > {tol:.3g}"
    for g, r, t_g, leaf in zip(grads, ref_grads, t_grads, leaves):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype
        tol = max(TOL[a.dtype], 2 * rel_err(t_g, r))
        assert rel_err(g, r) <= tol, f"grad of a {tuple(leaf.shape)} input: {rel_err(g, r):.3g} > {tol:.3g}"
    return y


def _assert_graph_replays(fn, expected):
    """``fn`` (compiled first) captured in a CUDA graph: two replays into a NaN-poisoned output
    give ``expected`` bit for bit."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
