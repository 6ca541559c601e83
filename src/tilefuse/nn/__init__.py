"""nn.Module drop-ins with torch's constructor arguments and state_dict keys."""

from .softmax import LogSoftmax, Softmax

__all__ = ["Softmax", "LogSoftmax"]
