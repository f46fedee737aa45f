"""How a drawing looks: the palette of memory levels, one style per box kind, the geometry
(in inches) and fonts, and the colour of each wire (the level it lives at).

>>> from napkin_cat.ops.kinds import SPECS
>>> sorted(KIND_STYLES) == sorted(SPECS)
True
>>> KIND_STYLES["param"].outline, LEVEL_COLOURS["SMEM"]
('square', '#1f6fd1')
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from matplotlib.colors import is_color_like
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextPath

from ..core.diagram import Array, Diagram, _relabel_str
from ..core.errors import DrawingError, NapkinError
from ..ops.kinds import spec


# --------------------------------------------------------------------------- palette and styles

LEVEL_COLOURS = {
    "HBM": "#262626",
    "L2": "#7b3fa0",
    "cluster": "#0f8b8d",
    "SMEM": "#1f6fd1",
    "registers": "#ee8600",
    "tensor": "#2a9d4b",
}
"""Wire colour of each memory level (the names of :mod:`napkin_cat.core.hierarchy`)."""

_SPARE_COLOURS = ("#c0392b", "#8e6c00", "#d63384", "#5d6d7e")  # levels not in the palette


@dataclass(frozen=True, slots=True)
class KindStyle:
    """How a box of one kind is drawn: fill, edge colour, outline and edge width.

    ``outline`` is ``"round"``, ``"square"``, ``"dashed"`` (a rounded box with a dashed
    edge) or ``"trapezoid"`` (narrowing to the right, for reindexings)."""

    face: str
    edge: str
    outline: str
    line_width: float = 1.0


# one entry per kind of napkin_cat.ops.kinds.SPECS: contractions gold, normalisers and
# reductions green, elementwise blue or grey, index-reading boxes dashed red, sources violet
KIND_STYLES: dict[str, KindStyle] = {
    "contract": KindStyle("#fff1c9", "#b8860b", "round"),
    "softmax_contract": KindStyle("#fff1c9", "#b8860b", "round"),
    "norm_contract": KindStyle("#fff1c9", "#b8860b", "round"),
    "map": KindStyle("#e8f0fe", "#4a6fa5", "round"),
    "cast": KindStyle("#f2f2f2", "#8a8a8a", "round"),
    "reduce": KindStyle("#e3f4e8", "#2e7d32", "round"),
    "softmax": KindStyle("#e3f4e8", "#2e7d32", "round"),
    "normalize": KindStyle("#e3f4e8", "#2e7d32", "round"),
    "mask": KindStyle("#ffffff", "#c62828", "dashed"),
    "index_bias": KindStyle("#ffffff", "#c62828", "dashed"),
    "index_map": KindStyle("#ffffff", "#c62828", "dashed"),
    "scatter_aux": KindStyle("#e3f4e8", "#c62828", "dashed"),
    "reindex": KindStyle("#ececec", "#616161", "trapezoid"),
    "param": KindStyle("#f3e5f5", "#6a1b9a", "square", line_width=1.3),
    "const": KindStyle("#f3e5f5", "#6a1b9a", "square"),
}
"""Box style of each kind of :data:`napkin_cat.ops.kinds.SPECS` (the drawing's rule table)."""


def kind_style(box) -> KindStyle:
    """The style of ``box``'s kind; an unknown kind, or one without a style, is refused by name."""
    kind = spec(box).name
    try:
        return KIND_STYLES[kind]
    except KeyError:
        raise DrawingError(f"no drawing style for box kind {kind!r}; add it to "
                           f"napkin_cat.drawing.styles.KIND_STYLES") from None


# weaving is drawn in neutral greys so it never reads as a memory level's colour
WEAVE_HALO = "#d4d4d4"
WEAVE_FRAME = "#f6f6f4"
WEAVE_EDGE = "#a3a3a3"
WEAVE_TEXT = "#5f5f5f"

# geometry, in inches
DY = 0.20          # distance between the wires of one bundle
HDR = 0.26         # room above a bundle's top wire: the name/dtype line and the first axis label
GAP = 0.16         # vertical gap between neighbouring items of a column
PORT_GAP = 0.10    # vertical gap between two bundles entering or leaving one box
NAME_LINE = 0.17   # height of one line of a box's name
BOX_PAD = 0.10     # padding inside a box: around its name, below its ports, beside its text
MIN_BOX_W = 0.62
PAD = 0.06         # horizontal padding around labels
APPROACH = 0.10    # straight wire entering a box after a bend
MIN_STUB = 0.18

FONT = 6.5         # axis labels
HEADER_FONT = 7.0  # array name and dtype
BOX_FONT = 7.5     # box names
WIRE_LW = 1.1


# --------------------------------------------------------------------------- text measurement

FAMILY = ["DejaVu Sans", "sans-serif"]  # measured with DejaVu; SVG viewers may substitute
_FONTS = {False: FontProperties(family="DejaVu Sans"),
          True: FontProperties(family="DejaVu Sans", weight="bold")}


@lru_cache(maxsize=4096)
def text_width(text: str, size: float, bold: bool = False) -> float:
    """Width of ``text`` in inches at ``size`` points; layout needs it before any figure exists."""
    if not text:
        return 0.0
    return TextPath((0, 0), text, size=size, prop=_FONTS[bold]).get_extents().width / 72.0


# --------------------------------------------------------------------------- wire colours: memory levels

def _final_form_levels(d: Diagram) -> dict[int, str]:
    """Where each array is resident inside the loop nest: an input at the level its last load
    brings it to (``Q`` tiled over ``q`` sits in SMEM, all of its wires), an intermediate or
    output at the level the final form allocates it (score chunks in registers).  The arrays
    start and end in the top level (HBM): the caps at the picture's edges."""
    if not any(r.op in ("tile", "stream") for r in d.schedule):
        return {}
    from ..relabel.loopnest import Compute, Finalise, Load, final_form
    try:
        ff = final_form(d)
    except NapkinError:  # an unfinished schedule (e.g. needing order()) still draws
        return {}
    if len(ff.diagram.var_types()) != len(d.var_types()):
        return {}
    out = {}
    for node, loops in ff.walk():
        if isinstance(node, Load) and node.final:
            out[node.var] = node.level
        elif isinstance(node, Compute):
            for v in ff.diagram.eqn_outputs(node.eqn):
                out[v] = ff.var_level(v, loops)
        elif isinstance(node, Finalise):
            for v in ff.diagram.eqn_outputs(ff.accumulators[node.acc].eqn):
                out[v] = ff.var_level(v, loops)
    return out


def relabel_text(r) -> str:
    """A relabeling as the call that made it: ``stream(x, s_x)``, ``tile(q, 32, L2)``,
    ``place(S, registers)``, ``require(q, 16)``, ``order(x, b)``, ``tile(q, devices,
    order=zigzag)``, ``tile(x, g_x, partial=sum)`` (SMEM, the default level of ``tile`` and
    ``stream``, is left out): the diagram's own text, with the levels.

    >>> from napkin_cat.core.types import Relabel
    >>> relabel_text(Relabel("place", "", None, "registers", ("S",)))
    'place(S, registers)'
    >>> import napkin_cat as nc
    >>> zig = nc.library.attention(causal=True).tile("q", "devices", order="zigzag")
    >>> relabel_text(zig.schedule[0]), relabel_text(zig.tile("q", 8, level="L2").schedule[1])
    ('tile(q, devices, order=zigzag)', 'tile(q, 8, L2)')
    """
    return _relabel_str(r, levels=True)


def schedule_text(d: Diagram) -> str:
    """Every relabeling of ``d``, in order, as calls: ``stream(x, s_x), tile(q, g_q)``."""
    return ", ".join(relabel_text(r) for r in d.schedule)


class Colours:
    """Wire colour of (variable, axis): the memory level it lives at.

    Precedence, most specific first: the caller's ``levels`` (by variable id, then array
    name), a ``place`` relabeling of the array, the level the final form keeps the array at
    (:func:`_final_form_levels`), a ``tile``/``stream`` relabeling of the axis, and HBM."""

    def __init__(self, d: Diagram, levels: Mapping):
        self.types = d.var_types()
        self.levels = dict(levels)
        self.placed: dict[str, str] = {}
        self.axis_level: dict[str, str] = {}
        self.axis_label: dict[str, str] = {}
        self.notes: list[str] = []
        for r in d.schedule:
            if r.op in ("tile", "stream"):
                letter = "g" if r.op == "tile" else "s"
                self.axis_level[r.axis] = r.level or "SMEM"
                self.axis_label[r.axis] = f"{r.axis}→{letter}_{r.axis}"
                self.notes.append(f"{r.axis}→{letter}_{r.axis}: {relabel_text(r)}")
            else:
                if r.op == "place":
                    self.placed[str(r.axis or (r.extra[0] if r.extra else ""))] = r.level
                self.notes.append(relabel_text(r))
        self.used: dict[str, str] = {}
        self.derived = _final_form_levels(d)

    def level(self, var: int, axis: str | None) -> str:
        name = self.types[var].name
        if var in self.levels:
            return self.levels[var]
        if name in self.levels:
            return self.levels[name]
        if name in self.placed:
            return self.placed[name]
        if var in self.derived:
            return self.derived[var]
        if axis in self.axis_level:
            return self.axis_level[axis]
        return "HBM"

    def colour(self, var: int, axis: str | None) -> str:
        level = self.level(var, axis)
        if level not in self.used:
            if level in LEVEL_COLOURS:
                self.used[level] = LEVEL_COLOURS[level]
            elif is_color_like(level):
                self.used[level] = level
            else:
                spare = [c for c in _SPARE_COLOURS if c not in self.used.values()] or list(_SPARE_COLOURS)
                self.used[level] = spare[0]
        return self.used[level]

    def axis_text(self, arr: Array, i: int) -> str:
        ax = arr.axes[i]
        return self.axis_label.get(ax.name, ax.describe())
