"""tilefuse: IO-aware fused GPU kernels for transformers, written in Triton.

CUDA tensors run the Triton kernels; CPU tensors run the PyTorch reference path, or the Triton
kernels through the interpreter when ``TRITON_INTERPRET=1`` is set (see ``tilefuse._dispatch``).
"""

from . import fp8, nn, optim
from .ops.activations import bias_act
from .ops.adamw import adam_step, adamw_step
from .ops.attention import attention, attention_varlen
from .ops.attention_decode import attention_decode
from .ops.cross_entropy import cross_entropy
from .ops.gate_up import swiglu_linear
from .ops.glu import geglu, swiglu
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops._matmul_autotune import set_autotune as set_matmul_autotune
from .ops.matmul import matmul
from .ops.norms import layer_norm, rms_norm
from .ops.qkv_proj import qkv_proj
from .ops.quant import QuantizedWeight, dequantize_weight, quant_linear, quantize_weight
from .ops.rope import rope, rope_cos_sin_table
from .ops.softmax import log_softmax, softmax
from .quantization import QuantLinear, quantize

__version__ = "0.1.0"

__all__ = ["softmax", "log_softmax", "layer_norm", "rms_norm", "bias_act", "swiglu", "geglu", "rope", "rope_cos_sin_table",
           "adam_step", "adamw_step", "optim", "fp8", "nn",
           "cross_entropy", "linear_cross_entropy", "attention", "attention_varlen", "attention_decode",
           "matmul", "set_matmul_autotune", "swiglu_linear", "qkv_proj", "quantize_weight", "dequantize_weight", "quant_linear", "QuantizedWeight", "quantize", "QuantLinear"]
