"""Stage 4, pictures: string diagrams, loop nests and cost curves (matplotlib).

Imports core, ops, relabel and costmodel.  Registers ``Diagram.draw`` and ``_repr_svg_``.
"""

from ..core import registry as _registry
from .diagram import draw, to_svg

_registry.register("draw", draw)
_registry.register("to_svg", to_svg)
