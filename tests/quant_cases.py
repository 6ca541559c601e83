"""What the weight-only quantization tests share (test_quant.py, test_quant_launch.py,
test_quant_gpu.py): the formats and tolerances, random weights, the fp64 reference, the launcher
with a config override and the plan it makes."""

import torch
import torch.nn.functional as F
from conftest import DEVICE

from tilefuse.ops import _quant_plan as quant_plan
from tilefuse.ops.quant import dequantize_weight, quant_linear, quantize_weight
from tilefuse.testing import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FORMATS = [(8, None), (4, 32), (4, 64), (4, 128)]


def _fmt_id(f):
    return f"int{f[0]}" + (f"-g{f[1]}" if f[1] else "")


def _weight(n, k, dtype, scale=1.0):
    return (torch.randn(n, k, device=DEVICE) * scale).to(dtype)


def _check_linear(x, qw, bias, dtype):
    y = quant_linear(x, qw, bias)
    ref = F.linear(x.double(), dequantize_weight(qw, torch.float64), None if bias is None else bias.double())
    assert y.dtype == dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= TOL[dtype], rel_err(y, ref)


def _launch(x, qw, bias=None, config=None):
    """The launcher itself with a config override (the path quant_linear takes, minus checks)."""
    return quant_plan.launch(x, qw.qweight, qw.scales, qw.zeros, bias, qw.bits, qw.group_size or 0, config)


def _reference(x, qw, bias=None):
    return F.linear(x.double(), dequantize_weight(qw, torch.float64), None if bias is None else bias.double())


def _plan(x, qw, config=None):
    """The plan the launcher makes for x (the Gluon mma path allowed where _launch allows it)."""
    m, k = x.shape
    mma_ok = quant_plan.is_ampere_or_newer(x) and not quant_plan.interpreting()
    return quant_plan.launch_plan(qw.bits, qw.group_size or 0, m, qw.shape[0], k, x.dtype, quant_plan.num_sms(x),
                             tuple(sorted((config or {}).items())), mma_ok, mma_ok and quant_plan.device_major(x) == 9)


def _check_launch(m, n, k, fmt, dtype, config=None, bias=True):
    bits, g = fmt
    qw = quantize_weight(_weight(n, k, dtype, k ** -0.5), bits, g)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    y = _launch(x, qw, b, config)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, _reference(x, qw, b)) <= TOL[dtype], rel_err(y, _reference(x, qw, b))
    return _plan(x, qw, config)
