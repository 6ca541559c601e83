"""One module per op family; importing a module registers its ops (see tilefuse.registry)."""

from . import activations, adamw, attention, attention_decode, cross_entropy, glu, linear_cross_entropy, norms, rope, softmax  # noqa: F401
