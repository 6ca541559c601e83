"""nn.Module wrappers of bias_act and the gated MLP (swiglu / geglu)."""

from __future__ import annotations

import torch

from ..ops._activation_math import ACTIVATIONS
from ..ops.activations import bias_act
from ..ops.glu import geglu, swiglu

# Hugging Face ``hidden_act`` names of the gated MLPs -> (gated unit, its gelu approximation)
_GATED_ACTS = {
    "silu": (swiglu, None),
    "swish": (swiglu, None),
    "gelu": (geglu, "none"),
    "gelu_pytorch_tanh": (geglu, "tanh"),
    "gelu_tanh": (geglu, "tanh"),
}


class FusedBiasActDropout(torch.nn.Module):
    """``dropout(act(x + bias), p) [+ residual]`` in one kernel; dropout only in training mode.

    Holds ``bias`` (``[hidden_size]``, state_dict key ``bias``; zeros at init, as the bias of
    a layer whose matmul ran without one) unless ``bias=False``. ``forward(x, residual=None,
    seed=None)``: see :func:`tilefuse.ops.activations.bias_act`.
    """

    def __init__(self, hidden_size: int, activation: str = "gelu", p: float = 0.0, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.hidden_size, self.activation, self.p = hidden_size, activation, float(p)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                seed: int | None = None) -> torch.Tensor:
        return bias_act(x, self.bias, self.activation, self.p, residual, seed, training=self.training)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, activation={self.activation!r}, p={self.p}, bias={self.bias is not None}"


class SwiGLUMLP(torch.nn.Module):
    """The gated MLP of Llama-style models, ``down_proj(act(gate_proj(x)) * up_proj(x))``, with
    the gating fused in one kernel (:func:`swiglu`, or :func:`geglu` for the gelu ``hidden_act``
    values). Parameter names match Hugging Face's ``LlamaMLP``, so its state_dict loads as is.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu", device=None, dtype=None) -> None:
        super().__init__()
        if hidden_act not in _GATED_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(map(repr, _GATED_ACTS))}; got {hidden_act!r}")
        self.hidden_size, self.intermediate_size, self.hidden_act = hidden_size, intermediate_size, hidden_act
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated, approximate = _GATED_ACTS[self.hidden_act]
        gate, up = self.gate_proj(x), self.up_proj(x)
        h = gated(gate, up) if approximate is None else gated(gate, up, approximate=approximate)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"hidden_act={self.hidden_act!r}"
