"""One module per op family; importing a module registers its ops (see tilefuse.registry)."""

from . import norms, rope, softmax  # noqa: F401
