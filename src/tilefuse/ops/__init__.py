"""One module per op family; importing a module registers its ops (see tilefuse.registry)."""

from . import (  # noqa: F401
    activations, adamw, attention, attention_decode, cross_entropy, gate_up, glu, linear_cross_entropy, matmul, norms, quant,
    fp8, qkv_proj, rope, softmax,
)
