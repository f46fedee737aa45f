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
so the sizes in :mod:`.styles` are the sizes on paper and labels fit their gaps at any
diagram size.

This module is the public face; :mod:`.styles` holds the palette, the per-kind box styles
(:data:`KIND_STYLES`) and the geometry, :mod:`.layout` places columns and items,
:mod:`.paint` draws them.
"""

from __future__ import annotations

import io
from typing import Mapping, Sequence

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..core.diagram import Diagram
from ..core.errors import DrawingError, TypingError
from .layout import layout
from .paint import Painter
from .styles import KIND_STYLES, LEVEL_COLOURS, Colours


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
    lay = layout(d)
    woven = tuple(weaved_axes(d) if weaved is None else weaved)
    painter = Painter(d, lay, Colours(d, levels or {}), woven, title)
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


__all__ = ["draw", "to_svg", "save", "formats", "weaved_axes", "LEVEL_COLOURS", "KIND_STYLES"]
