"""One module per op family; importing a module registers its ops (see tilefuse.registry)."""

from . import activations, adamw, glu, norms, rope, softmax  # noqa: F401
