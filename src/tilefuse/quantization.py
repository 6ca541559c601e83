"""``quantize(model, bits=4, group_size=128)``: swap a model's ``nn.Linear`` layers (and
transformers' ``Conv1D``, GPT-2's transposed linear), in place, for
weight-only quantized :class:`QuantLinear` layers, and report the bytes saved.

A layer is swapped when its input features K are divisible by the group size (int4) and its
qualified name is not skipped; everything else (embeddings, norms, skipped or ineligible
linears) is left untouched. The quantized formats are described in ``tilefuse.ops.quant``.

Bytes counted: a swapped layer's weight before (N·K·element size) against its packed weight +
scales + zero points after; biases are kept as they are and counted on neither side. The model
totals count every parameter and buffer once.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from .ops.quant import QuantizedWeight, _check_format, quant_linear, quantize_weight

SkipRule = Union[None, str, Iterable[str], Callable[[str, nn.Linear], bool]]


class QuantLinear(nn.Module):
    """``y = x @ dequant(W).T + bias`` with W stored quantized (int8 per channel or int4
    group-wise). The quantized tensors are buffers (they follow ``.to()`` and ``state_dict``);
    the bias stays a parameter. Gradients flow to x and the bias, never to the weight."""

    def __init__(self, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Module, bits: int = 4, group_size: Optional[int] = 128) -> "QuantLinear":
        """``linear``: an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2's projections: the same
        map with the weight stored ``[in, out]``). ``group_size`` applies to int4; int8 is per
        output channel (the default 128 is dropped)."""
        w = linear.weight.detach()
        qw = quantize_weight(w.t() if _is_conv1d(linear) else w, bits, None if bits == 8 else group_size)
        return cls(qw, linear.bias)

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                               (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.quantized_weight(), self.bias)

    def extra_repr(self) -> str:
        fmt = "int8 per channel" if self.bits == 8 else f"int4 group {self.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, {fmt}"


@dataclasses.dataclass
class QuantizeReport:
    """What :func:`quantize` did: layer names, and bytes of the swapped weights and of the model."""
    bits: int
    group_size: Optional[int]
    swapped: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)    # name -> reason
    weight_bytes_before: int = 0       # swapped layers' float weights
    weight_bytes_after: int = 0        # their packed weights + scales + zero points
    model_bytes_before: int = 0        # all parameters and buffers
    model_bytes_after: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.weight_bytes_before - self.weight_bytes_after

    @property
    def compression(self) -> float:
        """Swapped weights' size ratio before / after (0 when nothing was swapped)."""
        return self.weight_bytes_before / self.weight_bytes_after if self.weight_bytes_after else 0.0

    def __str__(self) -> str:
        mib = 2.0 ** 20
        fmt = "int8" if self.bits == 8 else f"int4/g{self.group_size}"
        return (f"quantize {fmt}: {len(self.swapped)} linear layers swapped, {len(self.skipped)} skipped; "
                f"weights {self.weight_bytes_before / mib:.2f} -> {self.weight_bytes_after / mib:.2f} MiB "
                f"({self.compression:.2f}x); model {self.model_bytes_before / mib:.2f} -> "
                f"{self.model_bytes_after / mib:.2f} MiB")


def _model_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is not None and t.data_ptr() not in seen:     # tied weights counted once
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _skip_patterns(skip: SkipRule) -> SkipRule:
    """``skip`` as quantize's loop reads it for every layer: patterns as a list, taken once (a
    generator or ``filter`` object was consumed by the first layer, and every later one was
    swapped), a callable or None as given."""
    if skip is None or callable(skip):
        return skip
    patterns = [skip] if isinstance(skip, str) else list(skip)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip patterns must be strings (module names or fnmatch patterns); got {bad[0]!r}")
    return patterns


def _conv1d_type() -> Optional[type]:
    """transformers' ``Conv1D`` (``y = x @ W + b``, W ``[in, out]``: GPT-2, GPT-J's ancestors) if
    transformers is loaded; a model holding one has imported it."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _is_conv1d(layer: nn.Module) -> bool:
    conv1d = _conv1d_type()
    return conv1d is not None and isinstance(layer, conv1d)


def _features(layer: nn.Module) -> tuple:
    """(in, out) features of an nn.Linear or a Conv1D."""
    return (layer.nx, layer.nf) if _is_conv1d(layer) else (layer.in_features, layer.out_features)


def _skip_reason(name: str, layer: nn.Module, skip: SkipRule, group_size: Optional[int]) -> Optional[str]:
    if callable(skip):
        if skip(name, layer):
            return "skipped by the skip callable"
    elif skip is not None:
        for p in skip:
            if fnmatch.fnmatchcase(name, p) or name.split(".")[-1] == p:
                return f"matches skip pattern {p!r}"
    k, n = _features(layer)
    if k == 0 or n == 0:
        return f"empty weight ({n} x {k})"
    if layer.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"weight dtype {layer.weight.dtype} is not fp32/fp16/bf16"
    if group_size is not None and k % group_size:
        return f"in_features {k} is not a multiple of group_size {group_size}"
    return None


# torch modules that read their Linear children's .weight themselves (MultiheadAttention never
# calls out_proj; the Transformer layers pass linear1 / linear2 weights to their fused fast path)
_READ_WEIGHTS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


# per-module hooks a swap would leave behind on the old module (the new one starts with none)
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def linear_swap_reason(model: nn.Module, names: list, layer: nn.Linear) -> Optional[str]:
    """Why swapping ``layer`` (registered in ``model`` under ``names``) for another Linear module
    would change the model, or None. A subclass with its own ``forward``, or a ``forward``
    replaced on the instance (accelerate's ``add_hook_to_module`` does that), computes something
    else than ``x @ W.T + b`` (a mask, a scale, a device move), which the swap would drop; so
    would it drop the layer's forward / backward hooks (a hook that edited the input or the
    output changed the result by 100 in an audit, 2026-12-07); ``nn.MultiheadAttention`` never
    calls its ``out_proj`` and the Transformer layers read ``linear1.weight`` themselves (a
    swapped module has none: the next forward raised)."""
    from . import fp8
    from .nn import Linear as TfLinear

    conv1d = _conv1d_type()
    if type(layer).forward not in (nn.Linear.forward, TfLinear.forward, fp8.Linear.forward,
                                   conv1d.forward if conv1d is not None else None):
        return f"{type(layer).__name__} has its own forward (not x @ W.T + b)"
    if "forward" in vars(layer):
        return "its forward is replaced on the instance (a wrapper the swap would drop)"
    hooks = [h for h in _MODULE_HOOKS if getattr(layer, h, None)]
    if hooks:
        return f"it has module hooks ({', '.join(h.strip('_') for h in hooks)}) that the swap would drop"
    for name in names:
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, _READ_WEIGHTS):
            return f"its weight is read directly by {type(parent).__name__}"
    return None


def linear_paths(model: nn.Module, op: str, instead: str, conv1d: bool = False) -> dict:
    """``id -> (layer, names)``: every ``nn.Linear`` inside ``model`` (subclasses too:
    tilefuse.nn.Linear, fp8.Linear; with ``conv1d`` transformers' Conv1D too) with every name it
    is registered under, so that a module registered twice is swapped at both. ``op`` and
    ``instead`` word the TypeError for a model that is not a Module, or is a bare Linear (which
    cannot replace itself in place)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear) or (conv1d and _is_conv1d(model)):
        raise TypeError(f"{op} replaces the Linear layers inside a model in place, and a bare Linear cannot "
                        f"replace itself: use {instead}")
    kinds = (nn.Linear,) + ((_conv1d_type(),) if conv1d and _conv1d_type() is not None else ())
    paths: dict = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, kinds):
            paths.setdefault(id(mod), (mod, []))[1].append(name)
    return paths


def replace_at(model: nn.Module, names: list, new: nn.Module) -> None:
    """Register ``new`` at each qualified name of ``names`` inside ``model``."""
    for path in names:
        parent_name, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize(model: nn.Module, bits: int = 4, group_size: Optional[int] = 128,
             skip: SkipRule = None) -> QuantizeReport:
    """Replace every eligible ``nn.Linear`` (or subclass computing ``x @ W.T + b``; or transformers'
    ``Conv1D``, GPT-2's ``x @ W + b``) of ``model`` (in place) by a :class:`QuantLinear`; a layer
    whose weight is tied to another module's parameter (an LM head tied to the embedding) is
    skipped: the float copy would stay, so nothing would be saved.

    ``bits`` 4 (group-wise, ``group_size`` 32/64/128) or 8 (per channel; ``group_size`` is
    ignored and taken as None). ``skip``: a name, an fnmatch pattern or a list of them (matched
    against the qualified module name, or its last component: ``"lm_head"``), or a callable
    ``(name, layer) -> bool``. Linears whose K is not a multiple of the group size are skipped
    and listed in the report with the reason, as are Linears the model does not use as
    ``x @ W.T + b`` (:func:`linear_swap_reason`). Returns a :class:`QuantizeReport`."""
    paths = linear_paths(model, "quantize", "QuantLinear.from_linear(layer, bits, group_size)", conv1d=True)
    group_size = _check_format(bits, None if bits == 8 else group_size)
    skip = _skip_patterns(skip)
    report = QuantizeReport(bits, group_size, model_bytes_before=_model_bytes(model))
    owners: dict = {}        # parameter storage -> the modules' names holding it
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(p.data_ptr(), set()).add(name)
    for layer, names in paths.values():
        name = names[0]
        reason = _skip_reason(name, layer, skip, group_size) or linear_swap_reason(model, names, layer)
        shared = owners.get(layer.weight.data_ptr(), set()) - set(names)
        if reason is None and shared:
            reason = f"weight tied to {sorted(shared)[0]} (quantizing it would keep the float copy too)"
        if reason is not None:
            report.skipped[name] = reason
            continue
        new = QuantLinear.from_linear(layer, bits, group_size)
        replace_at(model, names, new)
        report.swapped.append(name)
        report.weight_bytes_before += layer.weight.numel() * layer.weight.element_size()
        report.weight_bytes_after += new.quantized_weight().nbytes()
    report.model_bytes_after = _model_bytes(model)
    return report
