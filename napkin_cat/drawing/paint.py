"""Painting a :class:`~.layout.Layout`: wires, labels, boxes with their inner wiring, the
weaving frame and the legend, as matplotlib artists (a Figure and the Agg canvas, never
pyplot).
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch, Polygon, Rectangle
from matplotlib.path import Path

from ..core.diagram import Diagram
from ..ops.kinds import axis_of, spec
from .layout import Item, Layout, axis_links, contracts, display_names, place_columns, wire_count
from .styles import (APPROACH, BOX_FONT, BOX_PAD, DY, FAMILY, FONT, HDR, HEADER_FONT, LEVEL_COLOURS,
                     NAME_LINE, PAD, WEAVE_EDGE, WEAVE_FRAME, WEAVE_HALO, WEAVE_TEXT, WIRE_LW, Colours,
                     kind_style, text_width)


def _bend(x0: float, y0: float, x1: float, y1: float) -> Path:
    """A wire from (x0, y0) to (x1, y1) leaving and arriving horizontally."""
    if abs(y0 - y1) < 1e-9:
        return Path([(x0, y0), (x1, y1)])
    xm = (x0 + x1) / 2
    return Path([(x0, y0), (xm, y0), (xm, y1), (x1, y1)],
                [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4])


class Painter:
    """Turns a layout into matplotlib artists; one method per kind of mark."""

    def __init__(self, d: Diagram, lay: Layout, colours: Colours, woven: tuple[str, ...], title):
        self.d, self.lay, self.col, self.woven, self.title = d, lay, colours, set(woven), title
        self.woven_order = tuple(woven)
        self.types = lay.types
        self.names = display_names(d)
        self.marks: set[str] = set()   # the symbols drawn, each explained in the legend
        self.ax = None
        self.strokes: dict[tuple, list[tuple[Path, str]]] = {}
        place_columns(lay, self.label_width)

    def label_width(self, v: int) -> float:
        arr = self.types[v]
        widths = [text_width(self.header(v), HEADER_FONT, bold=True)]
        widths += [text_width(self.col.axis_text(arr, i), FONT) for i in range(len(arr.axes))]
        return max(widths)

    def header(self, v: int) -> str:
        return f"{self.names[v]} : {self.types[v].dtype.name}"

    # ---- wires
    def wire(self, v: int, i: int, path: Path) -> None:
        arr = self.types[v]
        axis = arr.axes[i].name if arr.axes else None
        if axis in self.woven:
            self.marks.add("halo")
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
        for i in range(wire_count(self.types[v])):
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
        self.ax.text(x, y, s, fontsize=size, parse_math=False, zorder=6, fontfamily=FAMILY, **kw)

    def dot(self, x: float, y: float, filled: bool = True, r: float = 0.03, colour: str = "#111111") -> None:
        self.ax.add_patch(Circle((x, y), r, facecolor=colour if filled else "white", edgecolor=colour,
                                 lw=0.9, zorder=5))

    # ---- the whole picture
    def paint(self, ax) -> Figure:
        """Everything, then the legend: it explains only the levels and symbols drawn, so it is
        laid out last and the figure is sized to hold it."""
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
        ymin = top - head - 0.15
        own = ax is None
        if own:
            fig = Figure(figsize=(max(xmax - xmin, 1.0), max(bottom - ymin, 1.0)))
            FigureCanvasAgg(fig)
            ax = fig.add_axes((0, 0, 1, 1))
        else:
            fig = ax.figure
            ax.set_aspect("equal")
        self.ax = ax
        ax.set_axis_off()

        if self.title:  # centred: a wider legend or title widens both sides alike
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

        legend_rows = self.legend_rows(xmax - xmin)
        foot = 0.12 + 0.2 * len(legend_rows)
        width = max(xmax - xmin, max((sum(w for w, _ in row) for row in legend_rows), default=0) + 0.3,
                    text_width(self.title or "", 10, bold=True) + 0.3)
        xmin -= (width - (xmax - xmin)) / 2  # a long title or legend: centre the diagram under it
        xmax = xmin + width
        ymax = bottom + foot
        if own:
            fig.set_size_inches(width, ymax - ymin)
        ax.set_xlim(xmin, xmax)
        ax.set_ylim(ymax, ymin)
        self.legend(legend_rows, xmin + 0.15, bottom + 0.2)
        self.flush_strokes()
        return fig

    def paint_inputs(self) -> None:
        """Input column: a cap on each wire and dashed lines between the input arrays."""
        for it in self.lay.columns[0]:
            self.caps(it.outs[0].var, 0.0, it.top + HDR)
        self.separators(self.lay.columns[0], 0.0, self.lay.stub_end[0] - PAD)

    def separators(self, items: list[Item], x0: float, x1: float) -> None:
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
                for i in range(wire_count(self.types[p.var])):
                    colour = self.col.colour(p.var, self._axis(p.var, i))
                    if n == 0:
                        self.marks.add("discard")
                        self.dot(end, y + i * DY, filled=False, r=0.032, colour=colour)
                    elif n > 1:
                        self.marks.add("copy")
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

    def paint_output(self, it: Item) -> None:
        v = it.ins[0].var
        y = it.top + HDR
        self.bundle(v, it.x0, y, it.x1, y)
        self.labels(v, it.x0 + PAD, y)
        self.caps(v, it.x1, y)

    def caps(self, v: int, x: float, y: float) -> None:
        """Short ticks where a diagram's input starts or its output ends."""
        for i in range(wire_count(self.types[v])):
            yi = y + i * DY
            self.stroke(Path([(x, yi - 0.05), (x, yi + 0.05)]), "#555555", lw=0.8, zorder=3)

    # ---- boxes
    def paint_box(self, it: Item) -> None:
        box = self.d.eqns[it.eqn].box
        style = kind_style(box)
        face, edge, outline = style.face, style.edge, style.outline
        x0, x1, y0, y1 = it.x0, it.x1, it.top, it.top + it.height
        if outline == "trapezoid":
            inset = min(0.08, (y1 - y0) / 6)
            patch = Polygon([(x0, y0), (x1, y0 + inset), (x1, y1 - inset), (x0, y1)], closed=True)
        elif outline == "square":
            patch = Rectangle((x0, y0), x1 - x0, y1 - y0)
        else:
            patch = FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.07")
        patch.set(facecolor=face, edgecolor=edge, lw=style.line_width,
                  linestyle=(0, (3, 2)) if outline == "dashed" else "-", zorder=3)
        self.ax.add_patch(patch)
        for j, (line, note) in enumerate(it.name_lines):
            self.text((x0 + x1) / 2, y0 + BOX_PAD / 2 + NAME_LINE * (j + 0.5), line,
                      FONT if note else BOX_FONT, ha="center", va="center",
                      color=edge if note else "#111111", weight="normal" if note else "bold")
        self.inner_wiring(it, box)

    def inner_wiring(self, it: Item, box) -> None:
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
        traits = spec(box)
        marked = {axis_of(box)} if traits.shape == "normaliser" else set()
        indexed = {box.param("row"), box.param("col")} if traits.indexed else set()
        links = axis_links(box)
        kept = set()
        for name, targets in outs.items():
            sources = [src for n in links.get(name, (name,)) for src in ins.get(n, ())]
            kept.update(n for n in links.get(name, (name,)) if n in ins)
            for y_out in targets:
                for y_in, v in sources:
                    self.inner(_bend(lo, y_in, hi, y_out), self.col.colour(v, self._in_axis(v, y_in, it)))
                if not sources:
                    self.marks.add("new")
                    self.inner(_bend(xm, y_out, hi, y_out), "#555555")
                    self.dot(xm, y_out, filled=False, r=0.028, colour="#555555")
                if name in marked:  # the axis a softmax / normalisation runs along
                    self.marks.add("diamond")
                    self.ax.plot([xm], [y_out], zorder=5, **_SYMBOLS["diamond"])
                if name in indexed:  # the row and column indices a mask / bias reads
                    self.marks.add("x")
                    self.ax.plot([xm], [y_out], zorder=5, **_SYMBOLS["x"])
        for name, sources in ins.items():
            if name in kept:
                continue
            yd = sum(y for y, _ in sources) / len(sources)
            xd = xm if contracts(box) else xm + 0.08
            for y_in, v in sources:
                self.inner(_bend(lo, y_in, xd, yd), self.col.colour(v, name))
            self.marks.add("sum")
            self.dot(xd, yd, r=0.036)

    def _in_axis(self, v: int, y: float, it: Item) -> str | None:
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

    def legend_rows(self, width: float) -> list[list[tuple[float, tuple[str, str, str | None]]]]:
        """Legend entries wrapped into rows of ``width`` inches: the levels of the wires, the
        symbols drawn, the relabelings.  An entry is ``(text, swatch, colour)``, the swatch a
        level's line, a symbol of :data:`LEGEND_SYMBOLS` or ``"note"`` (text alone)."""
        for v, arr in enumerate(self.types):  # colour every wire once so the used levels are known
            for i in range(wire_count(arr)):
                self.col.colour(v, arr.axes[i].name if arr.axes else None)
        entries: list[tuple[str, str, str | None]] = []
        if len(self.col.used) > 1 or self.d.schedule or self.col.levels:
            rank = {name: i for i, name in enumerate(LEVEL_COLOURS)}
            used = sorted(self.col.used.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            entries += [(name, "level", colour) for name, colour in used]
        if self.col.derived and self.d.dom:
            self.marks.add("cap")
        entries += [(text, mark, None) for mark, text in LEGEND_SYMBOLS.items() if mark in self.marks]
        entries += [(note, "note", None) for note in self.col.notes]
        rows: list[list] = [[]]
        used_w = 0.0
        for text, swatch, colour in entries:
            w = text_width(text, FONT + 0.5) + _SWATCH_W.get(swatch, 0.2) + 0.25
            if rows[-1] and used_w + w > max(width, 3.0):
                rows.append([])
                used_w = 0.0
            rows[-1].append((w, (text, swatch, colour)))
            used_w += w
        return [r for r in rows if r]

    def legend(self, rows, x: float, y: float) -> None:
        for r, row in enumerate(rows):
            xx = x
            yy = y + 0.2 * r
            for w, (text, swatch, colour) in row:
                if swatch == "note":
                    self.text(xx, yy, text, FONT + 0.5, va="center", color="#333333")
                    xx += w
                    continue
                self.swatch(swatch, colour, xx, yy)
                self.text(xx + _SWATCH_W.get(swatch, 0.2), yy, text, FONT + 0.5, va="center")
                xx += w

    def swatch(self, kind: str, colour: str | None, x: float, y: float) -> None:
        """The legend's sample of a level's wire or of a symbol, drawn as in the picture."""
        if kind == "level":
            self.ax.plot([x, x + 0.25], [y, y], color=colour, lw=2.2, zorder=6)
        elif kind == "halo":
            self.stroke(Path([(x, y), (x + 0.25, y)]), WEAVE_HALO, lw=5.5, alpha=0.65, zorder=1)
            self.stroke(Path([(x, y), (x + 0.25, y)]), "#555555", lw=WIRE_LW, zorder=2)
        elif kind in ("sum", "copy"):
            self.dot(x + 0.07, y, r=0.036 if kind == "sum" else 0.03)
        elif kind in ("new", "discard"):
            self.dot(x + 0.07, y, filled=False, r=0.03, colour="#555555")
        elif kind == "cap":
            self.stroke(Path([(x + 0.07, y - 0.05), (x + 0.07, y + 0.05)]), "#555555", lw=0.8, zorder=3)
            self.stroke(Path([(x + 0.07, y), (x + 0.16, y)]), "#555555", lw=WIRE_LW, zorder=2)
        else:
            self.ax.plot([x + 0.07], [y], zorder=6, **_SYMBOLS[kind])


LEGEND_SYMBOLS = {
    "cap": "in / out of HBM",
    "halo": "weaved axis",
    "sum": "summed or reduced axis",
    "copy": "copied wire",
    "new": "axis a box creates",
    "discard": "discarded wire",
    "diamond": "axis normalised along",
    "x": "index read (mask, bias)",
}
"""What each symbol of a picture means: the legend lists those the picture uses."""

_SYMBOLS = {
    "diamond": dict(marker="D", markersize=3.2, color="#2e7d32", linestyle="none"),
    "x": dict(marker="x", markersize=3.5, mew=1.1, color="#c62828", linestyle="none"),
}
_SWATCH_W = {"level": 0.32, "halo": 0.32, "note": 0.0}
