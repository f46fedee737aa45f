"""Drawing diagrams as Neural Circuit Diagrams, with matplotlib.

A diagram is drawn left to right: a column of input arrays, one column per *layer* of
equations (equations whose inputs are all ready at the same depth share a column), and a
column of outputs.  Every array is a bundle of parallel horizontal wires, **one wire per
axis**, each labelled with its axis; the array's name and dtype are written once above its
bundle.  Boxes sit on the wires they consume and show, inside, where each axis goes: an axis
that continues is a faint line through the box, a contracted or reduced axis ends on a dot,
an axis created by the box starts on an open circle.

What the picture adds to the listing (:meth:`Diagram.listing`):

* **weaving**: axes that every box carries first (the diagram is broadcast over them) get a
  pale halo on every wire and a frame labelled "weaved over ..." around the boxes;
* **memory levels**: the colour of a wire is the level it lives at (:data:`LEVEL_COLOURS`),
  from the ``levels`` argument and from the diagram's relabelings: ``tile`` and ``stream``
  colour the wires of their axis and relabel them ``q→g_q`` / ``x→s_x``; ``place`` colours
  one array;
* **copy and discard**: a wire that splits has a dot at the split; a discarded wire ends on
  an open circle.

>>> import napkin_cat as nc
>>> from napkin_cat.drawing import to_svg
>>> svg = to_svg(nc.library.matmul())
>>> "<svg" in svg and ">b<" in svg
True

Only :class:`matplotlib.figure.Figure` and the Agg canvas are used, never ``pyplot``: a
drawing never opens a window, never touches the user's backend, and leaves no figure behind
in pyplot's registry, so nothing needs closing.  Coordinates are inches (y grows downward),
so the sizes below are the sizes on paper and labels fit their gaps at any diagram size.
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import is_color_like
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.collections import PathCollection
from matplotlib.patches import Circle, FancyBboxPatch, Polygon, Rectangle
from matplotlib.path import Path
from matplotlib.textpath import TextPath

from ..core.diagram import Array, Diagram
from ..core.errors import DrawingError, NapkinError, TypingError

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

# kind -> (face, edge, outline): outline is "round", "square", "dashed" or "trapezoid"
KIND_STYLES = {
    "contract": ("#fff1c9", "#b8860b", "round"),
    "softmax_contract": ("#fff1c9", "#b8860b", "round"),
    "norm_contract": ("#fff1c9", "#b8860b", "round"),
    "map": ("#e8f0fe", "#4a6fa5", "round"),
    "cast": ("#f2f2f2", "#8a8a8a", "round"),
    "reduce": ("#e3f4e8", "#2e7d32", "round"),
    "softmax": ("#e3f4e8", "#2e7d32", "round"),
    "normalize": ("#e3f4e8", "#2e7d32", "round"),
    "mask": ("#ffffff", "#c62828", "dashed"),
    "index_bias": ("#ffffff", "#c62828", "dashed"),
    "reindex": ("#ececec", "#616161", "trapezoid"),
    "param": ("#f3e5f5", "#6a1b9a", "square"),
    "const": ("#f3e5f5", "#6a1b9a", "square"),
}
_DEFAULT_STYLE = ("#f5f5f5", "#757575", "round")
_CONTRACTING = ("contract", "softmax_contract", "norm_contract")
_NORMALISING = ("softmax", "normalize")

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


# --------------------------------------------------------------------------- public API

def draw(d: Diagram, path: str | None = None, levels: Mapping | None = None, title: str | None = None,
         ax=None, weaved: Sequence[str] | None = None) -> Figure:
    """Draw ``d`` as a Neural Circuit Diagram and return the matplotlib figure.

    ``path`` saves the picture, in the format named by its extension (``.svg``, ``.png`` at
    150 dpi, ``.pdf``).  ``levels`` maps variable ids or array names to memory levels
    (``{"Q": "SMEM", 5: "registers"}``); a level outside :data:`LEVEL_COLOURS` may be any
    matplotlib colour.  ``ax`` draws into an existing axes instead of a new figure.
    ``weaved`` names the axes to show as woven (default: :func:`weaved_axes`; ``()`` for none).

    >>> import napkin_cat as nc
    >>> fig = draw(nc.library.softmax(), title="row softmax")
    >>> bool(fig.get_size_inches()[0] > 1)
    True
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"draw needs a Diagram, got {type(d).__name__}")
    if path is not None:
        _format(path)   # an unknown format is refused before any drawing
    if levels is not None:
        if not hasattr(levels, "items"):
            raise TypingError(f"draw: levels must be a dict {{variable id or array name: level}}, got {levels!r}")
        for k, v in levels.items():
            if not isinstance(v, str):
                raise TypingError(f"draw: level of {k!r} must be a level name or a colour (str), got {v!r}")
    if weaved is not None:
        if isinstance(weaved, str) or not hasattr(weaved, "__iter__"):
            raise TypingError(f"draw: weaved must be a sequence of axis names, got {weaved!r}")
        weaved = tuple(getattr(w, "name", w) for w in weaved)
        names = [a.name for a in d.axes]
        unknown = [w for w in weaved if w not in names]
        if unknown:
            raise TypingError(f"draw: weaved names {unknown}, which are not axes of {d.short()}; its axes are {names}")
    layout = _layout(d)
    woven = tuple(weaved_axes(d) if weaved is None else weaved)
    painter = _Painter(d, layout, _Colours(d, levels or {}), woven, title)
    fig = painter.paint(ax)
    if path is not None:
        save(fig, path)
    return fig


def to_svg(d: Diagram, **kw) -> str:
    """The SVG text of :func:`draw` (text stays text, so the labels are searchable)."""
    fig = draw(d, **kw)
    buf = io.StringIO()
    _save(fig, buf, "svg")
    return buf.getvalue()


def formats() -> tuple[str, ...]:
    """The formats :func:`save` writes, named by the path's extension (none: PNG): matplotlib's
    (``svg``, ``png``, ``pdf``, ...)."""
    return tuple(sorted(FigureCanvasAgg(Figure()).get_supported_filetypes()))


def _format(path) -> str:
    import os
    if not isinstance(path, (str, os.PathLike)):
        raise DrawingError(f"draw: path must be a file name (str or Path), got {path!r}")
    name = os.path.basename(os.fspath(path))
    fmt = name.rsplit(".", 1)[-1].lower() if "." in name else "png"
    if fmt not in formats():
        raise DrawingError(f"cannot save {os.fspath(path)!r}: unknown extension '.{fmt}'; supported: "
                           f"{', '.join('.' + f for f in formats())}")
    return fmt


def save(fig: Figure, path: str) -> None:
    """Save ``fig`` to ``path`` in the format its extension names (PNG at 150 dpi)."""
    fmt = _format(path)
    try:
        _save(fig, path, fmt)
    except OSError as e:
        raise DrawingError(f"cannot write {str(path)!r}: {e.strerror or e}") from e


def _save(fig: Figure, target, fmt: str) -> None:
    # text as <text> elements and a fixed id salt: labels are searchable, output is stable
    rc = {"svg.fonttype": "none", "svg.hashsalt": "napkin_cat", "pdf.fonttype": 42}
    meta = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt, {})
    extra = {"metadata": meta} if meta else {}
    with rc_context(rc):
        fig.savefig(target, format=fmt, dpi=150, facecolor="white", **extra)


def weaved_axes(d: Diagram) -> tuple[str, ...]:
    """Axes the diagram is woven over: on every output of every box, and used by none.

    Every box kind broadcasts over the axes it does not mention, so an axis carried through
    every box and named by no box's parameters (the axis of a softmax, the row of a mask, the
    axis a reindexing splits) is one the whole diagram is mapped over: weaving it out and
    back in gives the same diagram.  Inputs may lack it (inner broadcasting: matmul's ``B``
    is shared by every row ``a``)."""
    if not d.eqns:
        return ()
    order = [ax.name for ax in d.axes]
    woven = set(order)
    for e in d.eqns:
        for arr in e.box.cod:
            woven &= set(arr.axis_names)
        for key, value in e.box.params:
            if key in _AXIS_PARAMS:
                woven.discard(getattr(value, "name", value))
    return tuple(n for n in order if n in woven)


_AXIS_PARAMS = ("axis", "row", "col", "outer", "inner", "keep", "drop", "new")


# --------------------------------------------------------------------------- text measurement

_FAMILY = ["DejaVu Sans", "sans-serif"]  # measured with DejaVu; SVG viewers may substitute
_FONTS = {False: FontProperties(family="DejaVu Sans"),
          True: FontProperties(family="DejaVu Sans", weight="bold")}


@lru_cache(maxsize=4096)
def _text_width(text: str, size: float, bold: bool = False) -> float:
    """Width of ``text`` in inches at ``size`` points; layout needs it before any figure exists."""
    if not text:
        return 0.0
    return TextPath((0, 0), text, size=size, prop=_FONTS[bold]).get_extents().width / 72.0


# --------------------------------------------------------------------------- layout

@dataclass
class _Port:
    """A bundle entering or leaving an item; ``offset`` is from the item's top to its top wire."""

    var: int
    offset: float


@dataclass
class _Item:
    """One thing in a column: the input or output end of an array, a box, or a wire passing by."""

    kind: str                 # "input", "output", "box", "pass"
    height: float
    ins: list[_Port] = field(default_factory=list)
    outs: list[_Port] = field(default_factory=list)
    eqn: int | None = None
    width: float = 0.0
    name_lines: tuple[tuple[str, bool], ...] = ()
    top: float = 0.0
    key: tuple = ()           # names the same item in every sweep of the layout
    x0: float = 0.0
    x1: float = 0.0


@dataclass
class _Layout:
    columns: list[list[_Item]]
    types: tuple[Array, ...]
    needed: list[list[int]]          # var -> columns where something reads it
    src_y: list[dict[int, float]]    # column -> var -> y of its top wire leaving the column
    left: list[float] = field(default_factory=list)
    right: list[float] = field(default_factory=list)
    stub_end: list[float] = field(default_factory=list)
    stub_labelled: list[set[int]] = field(default_factory=list)


def _lines(arr: Array) -> int:
    return max(1, len(arr.axes))


def _block(arr: Array) -> float:
    """Vertical room of one bundle: its header plus its wires."""
    return HDR + (_lines(arr) - 1) * DY


def _eqn_layers(d: Diagram) -> list[int]:
    """Column of each equation: one more than the deepest producer of its inputs.

    Longest-path depth puts independent equations side by side, so a diagram ``f @ g`` is
    as wide as the wider of ``f`` and ``g``, not as their sum."""
    depth = [0] * len(d.dom)
    layers = []
    for e in d.eqns:
        k = 1 + max((depth[v] for v in e.ins), default=0)
        layers.append(k)
        depth.extend([k] * len(e.box.cod))
    return layers


def _box_name_lines(box) -> tuple[tuple[str, bool], ...]:
    """Lines of a box's label as ``(text, is_note)``: its name, broken at its first bracket
    when long, then a note in small type: the summed axes of a contraction, the constant of
    a scale or shift (``scale`` alone does not say by what)."""
    name = box.name
    lines = [(name, False)]
    if len(name) > 18 and "(" in name[1:]:
        cut = name.index("(", 1)
        lines = [(name[:cut], False), (name[cut:], False)]
    if box.kind in _CONTRACTING:
        out = {n for a in box.cod for n in a.axis_names}
        gone = []
        for a in box.dom:
            gone.extend(n for n in a.axis_names if n not in out and n not in gone)
        if gone:
            lines.append(("Σ " + " ".join(gone), True))
    if box.kind == "map" and box.param("c", None) is not None:
        sign = "×" if box.param("fn") == "scale" else "+"
        lines.append((f"{sign} {_constant_text(box.param('c'))}", True))
    return tuple(lines)


def _constant_text(c) -> str:
    """``AxisPower(d, -0.5)`` as ``1/√d``; other constants in short form."""
    axis, power, coeff = getattr(c, "axis", None), getattr(c, "power", None), getattr(c, "coeff", 1.0)
    if axis is None:
        return f"{c:g}" if isinstance(c, (int, float)) else str(c)
    base = {-0.5: f"1/√{axis.name}", 0.5: f"√{axis.name}", -1.0: f"1/{axis.name}", 1.0: axis.name}.get(
        power, f"{axis.name}^{power:g}")
    return base if coeff == 1.0 else f"{coeff:g}·{base}"


def _axis_links(box) -> dict[str, tuple[str, ...]]:
    """Output axis -> the input axes it is made of, where a reindexing renames axes.

    Every other box keeps an axis's name, and the default (the axis itself) covers it."""
    if box.kind != "reindex":
        return {}
    op = box.param("op", "")
    if op == "split":
        return {box.param("outer"): (box.param("axis"),), box.param("inner"): (box.param("axis"),)}
    if op == "merge":
        return {box.param("axis"): (box.param("outer"), box.param("inner"))}
    if op == "slice":
        return {box.param("new"): (box.param("axis"),)}
    if op == "diagonal":
        return {box.param("keep"): (box.param("keep"), box.param("drop"))}
    return {}


def _stack_height(arrays: Sequence[Array]) -> float:
    return sum(_block(a) for a in arrays) + PORT_GAP * max(0, len(arrays) - 1)


def _stack(arrays: Sequence[Array], start: float, area: float) -> list[float]:
    """Top-wire offsets of bundles stacked and centred in a port area starting at ``start``."""
    y = start + (area - _stack_height(arrays)) / 2
    offsets = []
    for a in arrays:
        offsets.append(y + HDR)
        y += _block(a) + PORT_GAP
    return offsets


def _box_item(d: Diagram, k: int, outs: Sequence[int]) -> _Item:
    """Equation ``k`` as a box: its name on top, its input and output bundles centred below."""
    e = d.eqns[k]
    lines = _box_name_lines(e.box)
    name_h = BOX_PAD / 2 + NAME_LINE * len(lines)
    area = max(_stack_height(e.box.dom), _stack_height(e.box.cod), HDR)
    ins = [_Port(v, off) for v, off in zip(e.ins, _stack(e.box.dom, name_h, area))]
    out_ports = [_Port(v, off) for v, off in zip(outs, _stack(e.box.cod, name_h, area))]
    width = max(MIN_BOX_W, max(_text_width(t, FONT if note else BOX_FONT, bold=not note) for t, note in lines)
                + 2 * BOX_PAD)
    return _Item("box", name_h + area + BOX_PAD, ins, out_ports, k, width, lines, key=("box", k))


def _pack(desired: Sequence[float], heights: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Tops of items kept in order and ``GAP`` apart, as close as possible to ``desired``.

    Weighted least squares under ordering constraints is isotonic regression after
    subtracting each item's cumulative offset, solved exactly by pool-adjacent-violators:
    wires run straight wherever the column has room, and bend only where items collide."""
    offsets, acc = [], 0.0
    for h in heights:
        offsets.append(acc)
        acc += h + GAP
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for t, o, w in zip(desired, offsets, weights):
        blocks.append([(t - o) * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += c
    z = []
    for s, w, c in blocks:
        z.extend([s / w] * int(c))
    return [zi + o for zi, o in zip(z, offsets)]


def _layout(d: Diagram, sweeps: int = 3) -> _Layout:
    """Columns of items and the vertical position of every item; x positions come after.

    The first sweep orders each column by where its wires come from.  That leaves a wire
    crossing its neighbours whenever the order the wires arrive in differs from the order
    their reader's ports want (the box's domain fixes its ports), so later sweeps first order
    the columns right to left by where their wires go, then place them again left to right.
    The sweep with the fewest wire crossings is kept (as in Sugiyama's layered drawing)."""
    lay = _sweep(d, None)
    best = (_crossings(lay), 0, lay)
    for sweep in range(1, max(1, sweeps)):
        lay = _sweep(d, _reader_orders(lay))
        best = min(best, (_crossings(lay), sweep, lay), key=lambda b: b[:2])
    return best[2]


def _sweep(d: Diagram, orders: dict[int, list[tuple]] | None) -> _Layout:
    """One left-to-right placement; ``orders`` fixes the order of items (by key) per column,
    otherwise each column is sorted by where its wires come from."""
    types = d.var_types()
    layers = _eqn_layers(d)
    out_col = max(layers, default=0) + 1
    eqn_outs = [d.eqn_outputs(k) for k in range(len(d.eqns))]
    needed: list[list[int]] = [[] for _ in types]
    for k, e in enumerate(d.eqns):
        for v in e.ins:
            needed[v].append(layers[k])
    for v in d.outs:
        needed[v].append(out_col)

    inputs = []
    y = 0.0
    for v, arr in enumerate(d.dom):
        inputs.append(_Item("input", _block(arr), outs=[_Port(v, HDR)], top=y, key=("in", v)))
        y += _block(arr) + GAP
    columns = [inputs]
    src_y = [{v: it.top + HDR for v, it in enumerate(inputs)}]

    for c in range(1, out_col + 1):
        prev = src_y[-1]
        if c == out_col:
            items = [_Item("output", _block(types[v]), ins=[_Port(v, HDR)], key=("out", i))
                     for i, v in enumerate(d.outs)]
        else:
            items = [_box_item(d, k, eqn_outs[k]) for k in range(len(d.eqns)) if layers[k] == c]
            items += [_Item("pass", _block(types[v]), [_Port(v, HDR)], [_Port(v, HDR)], key=("pass", v))
                      for v in sorted(prev) if any(n > c for n in needed[v])]
        desired, weights = [], []
        for it in items:
            if it.ins:
                desired.append(sum(prev[p.var] - p.offset for p in it.ins) / len(it.ins))
                weights.append(sum(_lines(types[p.var]) for p in it.ins) * (2 if it.kind == "pass" else 1))
            else:
                desired.append(_sourceless_target(d, it, prev))
                weights.append(1e-3)
        order = list(range(len(items)))
        if c != out_col:  # the output tuple's order is the codomain's; a layer's is free
            if orders and c in orders:
                place = {key: n for n, key in enumerate(orders[c])}
                order.sort(key=lambda i: place.get(items[i].key, len(place)))
            else:
                order.sort(key=lambda i: (desired[i], items[i].kind != "pass", i))
        tops = _pack([desired[i] for i in order], [items[i].height for i in order],
                     [weights[i] for i in order])
        for i, t in zip(order, tops):
            items[i].top = t
        columns.append([items[i] for i in order])
        src_y.append({p.var: it.top + p.offset for it in items for p in it.outs})
    return _Layout(columns, types, needed, src_y)


def _connections(lay: _Layout, c: int) -> list[tuple[float, float]]:
    """(source y, target y) of every wire in the gap after column ``c``."""
    wires = []
    for it in lay.columns[c + 1]:
        for p in it.ins:
            for i in range(_lines(lay.types[p.var])):
                wires.append((lay.src_y[c][p.var] + i * DY, it.top + p.offset + i * DY))
    return wires


def _crossings(lay: _Layout) -> int:
    """Pairs of wires that cross between columns: the score that picks the best sweep."""
    n = 0
    for c in range(len(lay.columns) - 1):
        wires = _connections(lay, c)
        for i, (s1, t1) in enumerate(wires):
            n += sum(1 for s2, t2 in wires[i + 1:] if (s1 - s2) * (t1 - t2) < -1e-9)
    return n


def _reader_orders(lay: _Layout) -> dict[int, list[tuple]]:
    """Right to left, order each column by where its wires are read in the next column.

    Each column is packed at the tops its readers want before moving on, so the column to
    its left is ordered against the new positions: one backward pass straightens a crossing
    however far back it started."""
    orders: dict[int, list[tuple]] = {}
    reads_y = {id(it): it.top for it in lay.columns[-1]}
    for c in range(len(lay.columns) - 2, 0, -1):
        reads: dict[int, list[float]] = {}
        for it in lay.columns[c + 1]:
            for p in it.ins:
                reads.setdefault(p.var, []).append(reads_y[id(it)] + p.offset)
        want = []
        for it in lay.columns[c]:
            ys = [y - p.offset for p in it.outs for y in reads.get(p.var, [])]
            want.append(sum(ys) / len(ys) if ys else it.top)
        order = sorted(range(len(want)), key=lambda i: (want[i], i))
        items = lay.columns[c]
        tops = _pack([want[i] for i in order], [items[i].height for i in order], [1.0] * len(order))
        reads_y.update({id(items[i]): t for i, t in zip(order, tops)})
        orders[c] = [items[i].key for i in order]
    return orders


def _sourceless_target(d: Diagram, item: _Item, prev: dict[int, float]) -> float:
    """Where a box with no inputs (param, const) goes: beside the other inputs of its reader."""
    mine = {p.var for p in item.outs}
    for k, e in enumerate(d.eqns):
        if mine & set(e.ins):
            others = [prev[v] for v in e.ins if v in prev]
            if others:
                return sum(others) / len(others) + DY
    return max(prev.values(), default=0.0) + 2 * DY


def _place_columns(lay: _Layout, label_width) -> None:
    """x positions: each column is as wide as its widest box, each gap as wide as its labels
    plus a bend long enough for the vertical distance its wires travel."""
    n = len(lay.columns)
    out_col = n - 1
    x = 0.0
    for c, items in enumerate(lay.columns):
        if c == 0:
            width = 0.0
        elif c == out_col:
            width = 2 * PAD + max((label_width(p.var) for it in items for p in it.ins), default=0.0)
        else:
            width = max((it.width for it in items), default=MIN_BOX_W)
        lay.left.append(x)
        lay.right.append(x + width)
        for it in items:
            w = it.width if it.kind == "box" else width
            it.x0, it.x1 = x + (width - w) / 2, x + (width + w) / 2
        if c == out_col:
            break
        labelled = {p.var for it in items if it.kind in ("input", "box") for p in it.outs
                    if not (set(lay.needed[p.var]) == {out_col} and c == out_col - 1 and c > 0)}
        lay.stub_labelled.append(labelled)
        stub = max([MIN_STUB] + [2 * PAD + label_width(v) for v in labelled])
        lay.stub_end.append(x + width + stub)
        travel = [abs(it.top + p.offset - lay.src_y[c][p.var]) for it in lay.columns[c + 1] for p in it.ins]
        bend = 0.25 + 0.35 * min(3.0, math.sqrt(max(travel, default=0.0)))
        x = x + width + stub + bend + APPROACH


# --------------------------------------------------------------------------- colours

def _final_form_levels(d: Diagram) -> dict[int, str]:
    """Levels of the intermediates computed inside the loop nest (e.g. score chunks in
    registers), so the picture shows what the final form allocates.  Inputs and outputs keep
    the colour of their partitioned axes."""
    if not any(r.op in ("tile", "stream") for r in d.schedule):
        return {}
    from ..relabel.loopnest import Compute, final_form
    try:
        ff = final_form(d)
    except NapkinError:  # an unfinished schedule (e.g. needing order()) still draws
        return {}
    if len(ff.diagram.var_types()) != len(d.var_types()):
        return {}
    out = {}
    for node, loops in ff.walk():
        if isinstance(node, Compute):
            for v in ff.diagram.eqn_outputs(node.eqn):
                if v not in d.outs:
                    out[v] = ff.var_level(v, loops)
    return out


class _Colours:
    """Wire colour of (variable, axis): the memory level it lives at.

    Precedence, most specific first: the caller's ``levels`` (by variable id, then array
    name), a ``place`` relabeling of the array, a ``tile``/``stream`` relabeling of the axis,
    and HBM."""

    def __init__(self, d: Diagram, levels: Mapping):
        self.types = d.var_types()
        self.levels = dict(levels)
        self.placed: dict[str, str] = {}
        self.axis_level: dict[str, str] = {}
        self.axis_label: dict[str, str] = {}
        self.notes: list[str] = []
        for r in d.schedule:
            size = "" if r.size is None else f"={r.size}"
            if r.op in ("tile", "stream"):
                letter = "g" if r.op == "tile" else "s"
                self.axis_level[r.axis] = r.level or "SMEM"
                self.axis_label[r.axis] = f"{r.axis}→{letter}_{r.axis}"
                self.notes.append(f"{r.axis}→{letter}_{r.axis}{size} ({r.op}, {r.level or 'SMEM'})")
            elif r.op == "place":
                target = r.axis or (r.extra[0] if r.extra else "")
                self.placed[str(target)] = r.level
                self.notes.append(f"place {target} in {r.level}")
            elif r.op == "require":
                self.notes.append(f"{r.axis} multiple of {r.size}")
            else:
                what = " ".join(map(str, r.extra)) if r.extra else r.axis
                self.notes.append(f"{r.op} {what}".strip())
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


# --------------------------------------------------------------------------- painting

def _bend(x0: float, y0: float, x1: float, y1: float) -> Path:
    """A wire from (x0, y0) to (x1, y1) leaving and arriving horizontally."""
    if abs(y0 - y1) < 1e-9:
        return Path([(x0, y0), (x1, y1)])
    xm = (x0 + x1) / 2
    return Path([(x0, y0), (xm, y0), (xm, y1), (x1, y1)],
                [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4])


class _Painter:
    """Turns a layout into matplotlib artists; one method per kind of mark."""

    def __init__(self, d: Diagram, lay: _Layout, colours: _Colours, woven: tuple[str, ...], title):
        self.d, self.lay, self.col, self.woven, self.title = d, lay, colours, set(woven), title
        self.woven_order = tuple(woven)
        self.types = lay.types
        self.ax = None
        self.strokes: dict[tuple, list[tuple[Path, str]]] = {}
        _place_columns(lay, self.label_width)

    def label_width(self, v: int) -> float:
        arr = self.types[v]
        widths = [_text_width(self.header(v), HEADER_FONT, bold=True)]
        widths += [_text_width(self.col.axis_text(arr, i), FONT) for i in range(len(arr.axes))]
        return max(widths)

    def header(self, v: int) -> str:
        arr = self.types[v]
        return f"{arr.name} : {arr.dtype.name}"

    # ---- wires
    def wire(self, v: int, i: int, path: Path) -> None:
        arr = self.types[v]
        axis = arr.axes[i].name if arr.axes else None
        if axis in self.woven:
            self.stroke(path, WEAVE_HALO, lw=5.5, alpha=0.65, zorder=1)
        self.stroke(path, self.col.colour(v, axis), lw=WIRE_LW, dashed=not arr.axes, zorder=2)

    def stroke(self, path: Path, colour: str, lw: float, alpha: float = 1.0, zorder: float = 2,
               dashed: bool = False) -> None:
        """Queue a line; :meth:`flush_strokes` draws all lines of one style as one collection,
        which is many times faster to build and save than one patch per wire."""
        self.strokes.setdefault((lw, alpha, zorder, dashed), []).append((path, colour))

    def flush_strokes(self) -> None:
        for (lw, alpha, zorder, dashed), items in self.strokes.items():
            paths, colours = zip(*items)
            coll = PathCollection(list(paths), facecolors="none", edgecolors=list(colours), linewidths=lw,
                                  linestyles=(0, (2, 1.5)) if dashed else "solid", alpha=alpha, zorder=zorder)
            coll.set_capstyle("butt")
            self.ax.add_collection(coll, autolim=False)
        self.strokes = {}

    def bundle(self, v: int, x0: float, y0: float, x1: float, y1: float) -> None:
        """Every wire of ``v`` from top-wire position (x0, y0) to (x1, y1)."""
        for i in range(_lines(self.types[v])):
            self.wire(v, i, _bend(x0, y0 + i * DY, x1, y1 + i * DY))

    def labels(self, v: int, x: float, y: float) -> None:
        """Axis names above each wire and the array's name and dtype above the bundle."""
        arr = self.types[v]
        for i in range(len(arr.axes)):
            axis = arr.axes[i].name
            self.text(x, y + i * DY - 0.025, self.col.axis_text(arr, i), FONT, va="bottom",
                      color=self.col.colour(v, axis))
        self.text(x, y - HDR + 0.005, self.header(v), HEADER_FONT, va="top", weight="bold", color="#333333")

    def text(self, x, y, s, size, **kw) -> None:
        kw.setdefault("ha", "left")
        self.ax.text(x, y, s, fontsize=size, parse_math=False, zorder=6, fontfamily=_FAMILY, **kw)

    def dot(self, x: float, y: float, filled: bool = True, r: float = 0.03, colour: str = "#111111") -> None:
        self.ax.add_patch(Circle((x, y), r, facecolor=colour if filled else "white", edgecolor=colour,
                                 lw=0.9, zorder=5))

    # ---- the whole picture
    def paint(self, ax) -> Figure:
        lay = self.lay
        items = [it for col in lay.columns for it in col]
        top = min((it.top for it in items), default=0.0)
        bottom = max((it.top + it.height for it in items), default=0.0)
        xmin, xmax = -0.15, (lay.right[-1] if lay.right else 0.0) + 0.15
        head = 0.0
        if self.woven_order and self.d.eqns:
            head += 0.30
        if self.title:
            head += 0.35
        legend_rows = self.legend_rows(xmax - xmin)
        foot = 0.12 + 0.2 * len(legend_rows)
        width = max(xmax - xmin, max((sum(w for w, _ in row) for row in legend_rows), default=0) + 0.3,
                    _text_width(self.title or "", 10, bold=True) + 0.3)
        xmin -= (width - (xmax - xmin)) / 2  # a long title or legend: centre the diagram under it
        xmax = xmin + width
        ymin, ymax = top - head - 0.15, bottom + foot
        if ax is None:
            fig = Figure(figsize=(width, ymax - ymin))
            FigureCanvasAgg(fig)
            ax = fig.add_axes((0, 0, 1, 1))
        else:
            fig = ax.figure
            ax.set_aspect("equal")
        self.ax = ax
        ax.set_xlim(xmin, xmax)
        ax.set_ylim(ymax, ymin)
        ax.set_axis_off()

        if self.title:
            self.text((xmin + xmax) / 2, ymin + 0.12, self.title, 10, ha="center", va="top", weight="bold")
        if self.woven_order and self.d.eqns:
            self.weave_frame()
        self.paint_inputs()
        for c in range(1, len(lay.columns)):
            self.paint_gap(c - 1)
            for it in lay.columns[c]:
                if it.kind == "box":
                    self.paint_box(it)
                elif it.kind == "pass":
                    self.bundle(it.ins[0].var, it.x0, it.top + HDR, it.x1, it.top + HDR)
                else:
                    self.paint_output(it)
        self.separators(lay.columns[-1], lay.left[-1], lay.right[-1])
        self.legend(legend_rows, xmin + 0.15, bottom + 0.2)
        self.flush_strokes()
        return fig

    def paint_inputs(self) -> None:
        """Input column: a cap on each wire and dashed lines between the input arrays."""
        for it in self.lay.columns[0]:
            self.caps(it.outs[0].var, 0.0, it.top + HDR)
        self.separators(self.lay.columns[0], 0.0, self.lay.stub_end[0] - PAD)

    def separators(self, items: list[_Item], x0: float, x1: float) -> None:
        """Dashed lines between the arrays of a tuple, as NCD separates tuple segments."""
        for a, b in zip(items, items[1:]):
            y = (a.top + a.height + b.top) / 2
            self.ax.plot([x0, x1], [y, y], color="#9a9a9a", lw=0.8, linestyle=(0, (4, 3)), zorder=1.5)

    def emerge(self, c: int) -> None:
        """Wires leaving column ``c``: straight stubs carrying the labels, discards, copy dots."""
        lay = self.lay
        end = lay.stub_end[c]
        readers: dict[int, int] = {}
        if c + 1 < len(lay.columns):
            for it in lay.columns[c + 1]:
                for p in it.ins:
                    readers[p.var] = readers.get(p.var, 0) + 1
        for it in lay.columns[c]:
            for p in it.outs:
                y = it.top + p.offset
                self.bundle(p.var, it.x1, y, end, y)
                if p.var in lay.stub_labelled[c]:
                    self.labels(p.var, lay.right[c] + PAD, y)
                n = readers.get(p.var, 0)
                for i in range(_lines(self.types[p.var])):
                    colour = self.col.colour(p.var, self._axis(p.var, i))
                    if n == 0:
                        self.dot(end, y + i * DY, filled=False, r=0.032, colour=colour)
                    elif n > 1:
                        self.dot(end, y + i * DY, colour=colour)

    def _axis(self, v: int, i: int) -> str | None:
        arr = self.types[v]
        return arr.axes[i].name if arr.axes else None

    def paint_gap(self, c: int) -> None:
        """Stubs after column ``c`` and the bends into column ``c + 1``."""
        self.emerge(c)
        lay = self.lay
        for it in lay.columns[c + 1]:
            for p in it.ins:
                y0, y1 = lay.src_y[c][p.var], it.top + p.offset
                xa = lay.left[c + 1] - APPROACH
                self.bundle(p.var, lay.stub_end[c], y0, xa, y1)
                self.bundle(p.var, xa, y1, it.x0, y1)

    def paint_output(self, it: _Item) -> None:
        v = it.ins[0].var
        y = it.top + HDR
        self.bundle(v, it.x0, y, it.x1, y)
        self.labels(v, it.x0 + PAD, y)
        self.caps(v, it.x1, y)

    def caps(self, v: int, x: float, y: float) -> None:
        """Short ticks where a diagram's input starts or its output ends."""
        for i in range(_lines(self.types[v])):
            yi = y + i * DY
            self.stroke(Path([(x, yi - 0.05), (x, yi + 0.05)]), "#555555", lw=0.8, zorder=3)

    # ---- boxes
    def paint_box(self, it: _Item) -> None:
        box = self.d.eqns[it.eqn].box
        face, edge, outline = KIND_STYLES.get(box.kind, _DEFAULT_STYLE)
        x0, x1, y0, y1 = it.x0, it.x1, it.top, it.top + it.height
        if outline == "trapezoid":
            inset = min(0.08, (y1 - y0) / 6)
            patch = Polygon([(x0, y0), (x1, y0 + inset), (x1, y1 - inset), (x0, y1)], closed=True)
        elif outline == "square":
            patch = Rectangle((x0, y0), x1 - x0, y1 - y0)
        else:
            patch = FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.07")
        patch.set(facecolor=face, edgecolor=edge, lw=1.3 if box.kind == "param" else 1.0,
                  linestyle=(0, (3, 2)) if outline == "dashed" else "-", zorder=3)
        self.ax.add_patch(patch)
        for j, (line, note) in enumerate(it.name_lines):
            self.text((x0 + x1) / 2, y0 + BOX_PAD / 2 + NAME_LINE * (j + 0.5), line,
                      FONT if note else BOX_FONT, ha="center", va="center",
                      color=edge if note else "#111111", weight="normal" if note else "bold")
        self.inner_wiring(it, box)

    def inner_wiring(self, it: _Item, box) -> None:
        """Where each axis goes inside the box: the einsum (or broadcast) drawn as wires.

        An output wire joins every input wire of the same axis; input axes that no output keeps
        end together on one dot (contraction, reduction); output axes no input has start on an
        open circle (parameters, constants, splits)."""
        x0, x1 = it.x0, it.x1
        xm = (x0 + x1) / 2
        lo = x0 + 0.04
        hi = x1 - 0.04
        ins: dict[str, list[tuple[float, int]]] = {}
        for p in it.ins:
            arr = self.types[p.var]
            for i, ax in enumerate(arr.axes):
                ins.setdefault(ax.name, []).append((it.top + p.offset + i * DY, p.var))
        outs: dict[str, list[float]] = {}
        for p in it.outs:
            arr = self.types[p.var]
            for i, ax in enumerate(arr.axes):
                outs.setdefault(ax.name, []).append(it.top + p.offset + i * DY)
        marked = {box.param("axis", None)} if box.kind in _NORMALISING else set()
        indexed = {box.param("row"), box.param("col")} if box.kind in ("mask", "index_bias") else set()
        links = _axis_links(box)
        kept = set()
        for name, targets in outs.items():
            sources = [src for n in links.get(name, (name,)) for src in ins.get(n, ())]
            kept.update(n for n in links.get(name, (name,)) if n in ins)
            for y_out in targets:
                for y_in, v in sources:
                    self.inner(_bend(lo, y_in, hi, y_out), self.col.colour(v, self._in_axis(v, y_in, it)))
                if not sources:
                    self.inner(_bend(xm, y_out, hi, y_out), "#555555")
                    self.dot(xm, y_out, filled=False, r=0.028, colour="#555555")
                if name in marked:  # the axis a softmax / normalisation runs along
                    self.ax.plot([xm], [y_out], marker="D", markersize=3.2, color="#2e7d32", zorder=5)
                if name in indexed:  # the row and column indices a mask / bias reads
                    self.ax.plot([xm], [y_out], marker="x", markersize=3.5, mew=1.1, color="#c62828",
                                 zorder=5)
        for name, sources in ins.items():
            if name in kept:
                continue
            yd = sum(y for y, _ in sources) / len(sources)
            xd = xm if box.kind in _CONTRACTING else xm + 0.08
            for y_in, v in sources:
                self.inner(_bend(lo, y_in, xd, yd), self.col.colour(v, name))
            self.dot(xd, yd, r=0.036)

    def _in_axis(self, v: int, y: float, it: _Item) -> str | None:
        """The axis of the input wire of ``v`` at height ``y`` in box item ``it``."""
        for p in it.ins:
            if p.var == v:
                i = round((y - it.top - p.offset) / DY)
                if 0 <= i < len(self.types[v].axes):
                    return self.types[v].axes[i].name
        return None

    def inner(self, path: Path, colour: str) -> None:
        self.stroke(path, colour, lw=0.8, alpha=0.55, zorder=4)

    # ---- weaving, legend
    def weave_frame(self) -> None:
        """A pale frame around the layers of boxes: the diagram is broadcast over these axes."""
        lay = self.lay
        inner = [it for col in lay.columns[1:-1] for it in col]
        boxes = [it for it in inner if it.kind == "box"]
        if not boxes:
            return
        last = len(lay.columns) - 2
        top = min(it.top for it in inner) - 0.08
        bottom = max(it.top + it.height for it in inner) + 0.08
        x0 = min(it.x0 for it in boxes) - 0.08
        x1 = max(it.x1 for it in boxes) + 0.08
        if lay.stub_labelled[last]:  # keep the last layer's labels inside, clear of the edge
            x1 = lay.stub_end[last] - PAD / 2
        self.ax.add_patch(FancyBboxPatch((x0, top), x1 - x0, bottom - top,
                                         boxstyle="round,pad=0,rounding_size=0.1", facecolor=WEAVE_FRAME,
                                         edgecolor=WEAVE_EDGE, lw=0.9, linestyle=(0, (5, 3)), zorder=0))
        self.text(x0 + 0.05, top - 0.05, "weaved over " + ", ".join(self.woven_order), FONT + 0.5,
                  va="bottom", color=WEAVE_TEXT, style="italic")

    def legend_rows(self, width: float) -> list[list[tuple[float, tuple[str, str | None]]]]:
        """Legend entries (level swatches, relabelings) wrapped into rows of ``width`` inches."""
        for v, arr in enumerate(self.types):  # colour every wire once so the used levels are known
            for i in range(_lines(arr)):
                self.col.colour(v, arr.axes[i].name if arr.axes else None)
        entries: list[tuple[str, str | None]] = []
        if len(self.col.used) > 1 or self.d.schedule or self.col.levels:
            rank = {name: i for i, name in enumerate(LEVEL_COLOURS)}
            used = sorted(self.col.used.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            entries += [(name, colour) for name, colour in used]
        entries += [(note, None) for note in self.col.notes]
        rows: list[list] = [[]]
        used = 0.0
        for text, colour in entries:
            w = _text_width(text, FONT + 0.5) + (0.32 if colour else 0.0) + 0.25
            if rows[-1] and used + w > max(width, 3.0):
                rows.append([])
                used = 0.0
            rows[-1].append((w, (text, colour)))
            used += w
        return [r for r in rows if r]

    def legend(self, rows, x: float, y: float) -> None:
        for r, row in enumerate(rows):
            xx = x
            yy = y + 0.2 * r
            for w, (text, colour) in row:
                if colour:
                    self.ax.plot([xx, xx + 0.25], [yy, yy], color=colour, lw=2.2, zorder=6)
                    self.text(xx + 0.32, yy, text, FONT + 0.5, va="center")
                else:
                    self.text(xx, yy, text, FONT + 0.5, va="center", color="#333333")
                xx += w


__all__ = ["draw", "to_svg", "save", "weaved_axes", "LEVEL_COLOURS", "KIND_STYLES"]
