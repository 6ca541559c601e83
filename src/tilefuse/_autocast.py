"""``torch.autocast`` for tilefuse ops.

torch's autocast casts the inputs of the ops on its lists: a matmul, linear or SDPA runs in the
autocast dtype (its floating inputs cast to fp16 / bf16, weights included, gradients flowing back
to the fp32 parameters through the casts). Custom ops are on no list, and tilefuse's eager path
skips the dispatcher anyway, so the policy is applied here, at each public function, in Python:
the casts are ordinary autograd ops, and torch.compile traces them (``is_autocast_enabled`` and
``get_autocast_dtype`` are constants to dynamo).

* The GEMM family -- ``matmul`` / ``nn.Linear``, ``swiglu_linear``, ``qkv_proj``,
  ``linear_cross_entropy``, ``attention`` / ``attention_varlen`` / the SDPA drop-in -- casts its
  fp32 / fp16 / bf16 tensor inputs to the autocast dtype, as torch's ``linear`` and SDPA do (fp64
  is left alone, as torch leaves it). A ``matmul`` residual keeps its dtype (the output's dtype
  is a's promoted with it, as ``linear(...) + residual`` would be).
* Ops whose operand dtype is fixed by something the call cannot cast: ``quant_linear`` casts x
  and the bias to the quantized weight's dtype (its scales'), ``attention_decode`` casts q and the
  new keys / values to the cache's dtype (the cache is written in place), and ``fp8`` quantizes
  its inputs from whatever dtype they have, returning the autocast dtype from ``fp8.Linear``.
* Row ops (softmax, norms, bias_act, swiglu, rope) keep their input's dtype: they compute in fp32
  inside and read 16-bit inputs as 16-bit (torch's autocast would upcast several of them to fp32,
  twice the bytes); a norm's or bias_act's parameter may be fp32 beside a 16-bit input. The
  cross-entropy losses are fp32, as torch's autocast returns them (only the loss: the logits are
  read as they are).

Inside every op's implementation and backward autocast is off (:func:`autocast_disabled`): the
reference path's fp32 math and any torch op a launcher calls run in the dtypes written there.
"""

from __future__ import annotations

import contextlib

import torch

from ._dispatch import tracing

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


# any autocast enabled, on any device (~0.1 µs): callers test it before anything else
autocast_on = torch._C._is_any_autocast_enabled


def autocast_dtype(t: torch.Tensor | None) -> torch.dtype | None:
    """The dtype autocast would run a matmul on ``t``'s device in; None when autocast is off there
    (~0.1 µs when no autocast is enabled anywhere: the common case)."""
    if not torch._C._is_any_autocast_enabled() or not isinstance(t, torch.Tensor):
        return None
    device_type = t.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_to(dtype: torch.dtype | None, *tensors):
    """Each fp32 / fp16 / bf16 tensor of ``tensors`` in ``dtype`` (None: all unchanged); other
    arguments (None, integer tensors, fp64, fp8) pass as they are."""
    if dtype is None:
        return tensors
    # eagerly the cast's backward (16-bit gradient -> fp32 parameter) takes a Triton pass at twice
    # torch's speed (ops/_cast.py); traced, torch's own cast (the compiler fuses it)
    cast = _cast_eager if _plain_eager() else _cast_traced
    return tuple(cast(t, dtype) if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE and t.dtype != dtype else t
                 for t in tensors)


def _plain_eager() -> bool:
    return not (tracing() or torch._C._are_functorch_transforms_active())


def _cast_traced(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


def _cast_eager(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return t.to(dtype)                       # a tensor subclass: its own cast
    from .ops._cast import AutocastCast          # (ops import this module)
    return AutocastCast.apply(t, dtype)


def autocast_inputs(*tensors):
    """``tensors`` as the autocast in effect on the first one's device would cast a matmul's
    inputs; unchanged when autocast is off."""
    return cast_to(autocast_dtype(tensors[0]), *tensors)


@contextlib.contextmanager
def autocast_disabled():
    """A context with autocast off on every device type (an op's implementation or backward runs in
    it when any autocast is on: its dtypes are the ones it writes)."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield
