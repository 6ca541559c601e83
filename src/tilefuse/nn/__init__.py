"""nn.Module drop-ins with torch's constructor arguments and state_dict keys."""

from . import functional  # noqa: F401 (tilefuse.nn.functional.scaled_dot_product_attention)
from .activations import FusedBiasActDropout, SwiGLUMLP
from .linear import Linear
from .losses import CrossEntropyLoss, LinearCrossEntropyLoss
from .norms import LayerNorm, RMSNorm
from .softmax import LogSoftmax, Softmax

__all__ = ["Softmax", "LogSoftmax", "LayerNorm", "RMSNorm", "FusedBiasActDropout", "SwiGLUMLP",
           "CrossEntropyLoss", "LinearCrossEntropyLoss", "Linear"]
