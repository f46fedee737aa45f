"""Stage 4, pictures: string diagrams, loop nests and cost curves (matplotlib).

Imports core, ops, relabel and costmodel.  Registers ``Diagram.draw``, ``_repr_svg_`` and the
final form's HTML table (:mod:`.notebook`, ``FinalForm._repr_html_``).
:mod:`.diagram` is the public face, :mod:`.styles` the palette and the per-kind box styles
(:data:`KIND_STYLES`, one entry per kind of :data:`napkin_cat.ops.kinds.SPECS`),
:mod:`.layout` the placement, :mod:`.paint` the matplotlib artists, :mod:`.plots` the cost
curves.
"""

from ..core import registry as _registry
from .diagram import draw, formats, save, to_svg, weaved_axes
from .notebook import final_form_html
from .styles import KIND_STYLES, LEVEL_COLOURS, KindStyle

_registry.register("draw", draw)
_registry.register("to_svg", to_svg)
_registry.register("final_form_html", final_form_html)

__all__ = ["KIND_STYLES", "LEVEL_COLOURS", "KindStyle", "draw", "final_form_html", "formats", "save", "to_svg",
           "weaved_axes"]
