"""Where everything goes: columns of items (inputs, boxes, passing wires, outputs), their
vertical positions (fewest crossings over a few sweeps) and the x position of every column.

Coordinates are inches, y grows downward.  Nothing here draws: :mod:`.paint` turns a
:class:`Layout` into matplotlib artists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from ..core.diagram import Array, Diagram
from ..ops.kinds import spec
from .styles import (APPROACH, BOX_FONT, BOX_PAD, DY, FONT, GAP, HDR, MIN_BOX_W, MIN_STUB, NAME_LINE,
                     PAD, PORT_GAP, text_width)


@dataclass
class Port:
    """A bundle entering or leaving an item; ``offset`` is from the item's top to its top wire."""

    var: int
    offset: float


@dataclass
class Item:
    """One thing in a column: the input or output end of an array, a box, or a wire passing by."""

    kind: str                 # "input", "output", "box", "pass"
    height: float
    ins: list[Port] = field(default_factory=list)
    outs: list[Port] = field(default_factory=list)
    eqn: int | None = None
    width: float = 0.0
    name_lines: tuple[tuple[str, bool], ...] = ()
    top: float = 0.0
    key: tuple = ()           # names the same item in every sweep of the layout
    x0: float = 0.0
    x1: float = 0.0


@dataclass
class Layout:
    columns: list[list[Item]]
    types: tuple[Array, ...]
    needed: list[list[int]]          # var -> columns where something reads it
    src_y: list[dict[int, float]]    # column -> var -> y of its top wire leaving the column
    left: list[float] = field(default_factory=list)
    right: list[float] = field(default_factory=list)
    stub_end: list[float] = field(default_factory=list)
    stub_labelled: list[set[int]] = field(default_factory=list)


def wire_count(arr: Array) -> int:
    return max(1, len(arr.axes))


def _block(arr: Array) -> float:
    """Vertical room of one bundle: its header plus its wires."""
    return HDR + (wire_count(arr) - 1) * DY


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


def contracts(box) -> bool:
    """Whether ``box`` is a contraction: a reduction that sums the axes its inputs have and its
    output lacks (an einsum: no single ``axis`` parameter), or a fused normalise-then-contract.
    A plain ``reduce`` names its one axis in its label and is not one."""
    s = spec(box)
    return s.shape == "reduction" and (s.axis is None or s.fused)


def display_names(d: Diagram) -> tuple[str, ...]:
    """The name each variable is drawn with: inputs and outputs keep theirs; an intermediate
    whose name an input, an output or an earlier intermediate already has gets primes
    (``S``, ``S′``, ``S″``), so no two wires of the picture carry the same name.

    >>> import napkin_cat as nc
    >>> display_names(nc.library.attention())
    ('Q', 'K', 'V', 'S', 'S′', 'P', 'O')
    """
    names = list(d.var_names())
    ends = set(range(len(d.dom))) | set(d.outs)
    taken = {names[v] for v in ends}
    for v in range(len(names)):
        if v in ends:
            continue
        base, k, name = names[v], 0, names[v]
        while name in taken:
            k += 1
            name = base + (_PRIMES[k - 1] if k <= len(_PRIMES) else f"_{k}")
        names[v] = name
        taken.add(name)
    return tuple(names)


_PRIMES = ("′", "″", "‴")


def _box_name_lines(box) -> tuple[tuple[str, bool], ...]:
    """Lines of a box's label as ``(text, is_note)``: its name, broken at its first bracket
    when long, then a note in small type: the summed axes of a contraction, the constant of
    a scale or shift (``scale`` alone does not say by what)."""
    name = box.name
    lines = [(name, False)]
    if len(name) > 18 and "(" in name[1:]:
        cut = name.index("(", 1)
        lines = [(name[:cut], False), (name[cut:], False)]
    if contracts(box):
        out = {n for a in box.cod for n in a.axis_names}
        gone = []
        for a in box.dom:
            gone.extend(n for n in a.axis_names if n not in out and n not in gone)
        if gone:
            lines.append(("Σ " + " ".join(gone), True))
    c = box.param("c", None)   # the constant of a map with one (FUNCTIONS[fn].constant)
    if c is not None:
        sign = "×" if box.param("fn") == "scale" else "+"
        lines.append((f"{sign} {_constant_text(c)}", True))
    return tuple(lines)


def _constant_text(c) -> str:
    """``AxisPower(d, -0.5)`` as ``1/√d``; other constants in short form."""
    axis, power, coeff = getattr(c, "axis", None), getattr(c, "power", None), getattr(c, "coeff", 1.0)
    if axis is None:
        return f"{c:g}" if isinstance(c, (int, float)) else str(c)
    base = {-0.5: f"1/√{axis.name}", 0.5: f"√{axis.name}", -1.0: f"1/{axis.name}", 1.0: axis.name}.get(
        power, f"{axis.name}^{power:g}")
    return base if coeff == 1.0 else f"{coeff:g}·{base}"


def axis_links(box) -> dict[str, tuple[str, ...]]:
    """Output axis -> the input axes it is made of, where a reindexing renames axes.

    Every other box keeps an axis's name, and the default (the axis itself) covers it."""
    if spec(box).shape != "reindex":
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
    if op in ("rename", "unfold"):
        made = (box.param("new"), box.param("window", None))
        return {n: (box.param("axis"),) for n in made if n is not None}
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


def _box_item(d: Diagram, k: int, outs: Sequence[int]) -> Item:
    """Equation ``k`` as a box: its name on top, its input and output bundles centred below."""
    e = d.eqns[k]
    lines = _box_name_lines(e.box)
    name_h = BOX_PAD / 2 + NAME_LINE * len(lines)
    area = max(_stack_height(e.box.dom), _stack_height(e.box.cod), HDR)
    ins = [Port(v, off) for v, off in zip(e.ins, _stack(e.box.dom, name_h, area))]
    out_ports = [Port(v, off) for v, off in zip(outs, _stack(e.box.cod, name_h, area))]
    width = max(MIN_BOX_W, max(text_width(t, FONT if note else BOX_FONT, bold=not note) for t, note in lines)
                + 2 * BOX_PAD)
    return Item("box", name_h + area + BOX_PAD, ins, out_ports, k, width, lines, key=("box", k))


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


def layout(d: Diagram, sweeps: int = 3) -> Layout:
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


def _sweep(d: Diagram, orders: dict[int, list[tuple]] | None) -> Layout:
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
        inputs.append(Item("input", _block(arr), outs=[Port(v, HDR)], top=y, key=("in", v)))
        y += _block(arr) + GAP
    columns = [inputs]
    src_y = [{v: it.top + HDR for v, it in enumerate(inputs)}]

    for c in range(1, out_col + 1):
        prev = src_y[-1]
        if c == out_col:
            items = [Item("output", _block(types[v]), ins=[Port(v, HDR)], key=("out", i))
                     for i, v in enumerate(d.outs)]
        else:
            items = [_box_item(d, k, eqn_outs[k]) for k in range(len(d.eqns)) if layers[k] == c]
            items += [Item("pass", _block(types[v]), [Port(v, HDR)], [Port(v, HDR)], key=("pass", v))
                      for v in sorted(prev) if any(n > c for n in needed[v])]
        desired, weights = [], []
        for it in items:
            if it.ins:
                desired.append(sum(prev[p.var] - p.offset for p in it.ins) / len(it.ins))
                weights.append(sum(wire_count(types[p.var]) for p in it.ins) * (2 if it.kind == "pass" else 1))
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
    return Layout(columns, types, needed, src_y)


def _connections(lay: Layout, c: int) -> list[tuple[float, float]]:
    """(source y, target y) of every wire in the gap after column ``c``."""
    wires = []
    for it in lay.columns[c + 1]:
        for p in it.ins:
            for i in range(wire_count(lay.types[p.var])):
                wires.append((lay.src_y[c][p.var] + i * DY, it.top + p.offset + i * DY))
    return wires


def _crossings(lay: Layout) -> int:
    """Pairs of wires that cross between columns: the score that picks the best sweep."""
    n = 0
    for c in range(len(lay.columns) - 1):
        wires = _connections(lay, c)
        for i, (s1, t1) in enumerate(wires):
            n += sum(1 for s2, t2 in wires[i + 1:] if (s1 - s2) * (t1 - t2) < -1e-9)
    return n


def _reader_orders(lay: Layout) -> dict[int, list[tuple]]:
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


def _sourceless_target(d: Diagram, item: Item, prev: dict[int, float]) -> float:
    """Where a box with no inputs (param, const) goes: beside the other inputs of its reader."""
    mine = {p.var for p in item.outs}
    for k, e in enumerate(d.eqns):
        if mine & set(e.ins):
            others = [prev[v] for v in e.ins if v in prev]
            if others:
                return sum(others) / len(others) + DY
    return max(prev.values(), default=0.0) + 2 * DY


def place_columns(lay: Layout, label_width) -> None:
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
