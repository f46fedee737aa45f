"""Device layouts, and a device's block seen at its global indices.

A split over the devices (``tile(q, DEVICES)``, ``stream(x, DEVICES)``) gives each of ``W``
devices the same share of the axis; its *layout* says which indices that share holds, in the
order the device's shard stores them:

``contiguous`` (the default)  device ``r`` holds ``[r n/W, (r + 1) n/W)``;
``zigzag``                    the axis is cut into ``2W`` chunks of ``n / 2W`` and device ``r``
                              holds chunks ``r`` and ``2W - 1 - r``, concatenated in that order.
                              Under a causal mask chunk ``c`` of the queries keeps ``c + 1`` key
                              chunks, so every device keeps ``(r + 1) + (2W - r) = 2W + 1``:
                              the work is balanced, where the contiguous layout gives the last
                              device ``2W - 1`` times the first one's.

``tile(q, "devices", order="zigzag")`` (and the same on ``stream``) records the layout on the
split; what a device computes does not change, only which global indices its blocks are.

>>> pieces("zigzag", 16, 2, 0), pieces("zigzag", 16, 2, 1), pieces("contiguous", 16, 2, 1)
(((0, 4), (12, 4)), ((4, 4), (8, 4)), ((8, 8),))

A device computes on its pieces with the indices of its shard, which start at 0.  A mask or
bias reading global indices (:mod:`napkin_cat.ops.index`) is therefore rewritten per block by
:func:`block_view`: shifted by the block's global offsets (a causal mask depends on ``i - j``
only, so ``causal(c)`` becomes ``causal(c + q0 - x0)``; an index expression has its indices
replaced by ``i + q0`` and ``j + x0``), dropped where the block is kept whole, and the block is
skipped where a mask that bounds the stream (:mod:`.skipping`) removes all of it.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> att = nc.library.attention(q=q, x=x, d=d, causal=True)
>>> totals, skips = {"q": 8, "x": 8, "d": 2}, (mask_key("q", "x", nc.causal()),)
>>> [block_view(att, {"q": (4, 8), "x": (s, s + 4)}, totals, skips).key for s in (0, 4)]
[(('drop',),), (('causal', 0),)]
>>> block_view(att, {"q": (0, 4), "x": (4, 8)}, totals, skips).empty
True
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.diagram import Diagram, Eqn
from ..core.errors import LoweringError, RelabelError, ShapeError
from ..core.hierarchy import DEVICES
from ..ops.boxes import index_bias_box, mask_box
from ..ops.index import IndexBias, IntAlgebra, Predicate
from ..ops.index_expr import Ix
from ..ops.index_support import BoolLogic
from ..ops.kinds import spec

LAYOUTS = ("contiguous", "zigzag")
CHUNKS = {"contiguous": 1, "zigzag": 2}     # pieces per device


def check_layout(op: str, axis: str, size, order) -> tuple:
    """The ``extra`` of a ``Relabel`` for ``op(axis, size, order=order)``; refuses a layout on a
    split that is not over the devices, and unknown layouts."""
    if order is None:
        return ()
    if size != DEVICES:
        raise RelabelError(f"{op}({axis}, {size!r}, order={order!r}): a layout orders the blocks over the "
                           f"devices; it applies to {op}({axis}, {DEVICES!r}, order=...) only")
    if order not in LAYOUTS:
        raise RelabelError(f"{op}({axis}, {DEVICES!r}, order={order!r}): unknown layout; known: {list(LAYOUTS)}")
    return () if order == "contiguous" else (order,)


def layout_of(d: Diagram, axis: str) -> str:
    """The layout of ``axis`` split over the devices in ``d`` (``contiguous`` when not split)."""
    for r in d.schedule:
        if r.op in ("tile", "stream") and r.size == DEVICES and r.axis == axis and r.extra:
            return r.extra[0]
    return "contiguous"


def device_multiple(d: Diagram) -> int:
    """Each axis split over ``W`` devices in ``d`` must be a multiple of ``W`` times this."""
    return max((CHUNKS[layout_of(d, r.axis)] for r in d.schedule if r.size == DEVICES), default=1)


def device_count(axis: str, sizes: dict) -> int:
    if DEVICES not in sizes:
        raise ShapeError(f"axis {axis} is split over the devices: pass sizes={{{DEVICES!r}: number of devices}}")
    return int(sizes[DEVICES])


def pieces(layout: str, n: int, world: int, rank: int) -> tuple[tuple[int, int], ...]:
    """``(global start, length)`` of each piece of an axis of ``n`` that device ``rank`` of
    ``world`` holds, in the order its shard stores them."""
    k = CHUNKS[layout]
    if world < 1 or n % (k * world):
        what = f"{DEVICES}={world}" if k == 1 else f"2 x {DEVICES}={world} zig-zag chunks"
        raise ShapeError(f"an axis of size {n} does not split over {what}: every device holds an equal "
                         f"block{'' if k == 1 else ' of two equal chunks'}, so {k * world} must divide {n}")
    c = n // (k * world)
    if layout == "zigzag":
        return (rank * c, c), ((2 * world - 1 - rank) * c, c)
    return ((rank * c, c),)


def device_visits(layout: str, kind: str, axis: str, start: int, stop: int, sizes: dict, device: int):
    """``(device or None, start, stop)`` of the blocks a loop over the devices visits, in order:
    a grid loop visits every device's pieces (naming the device), a stream loop on ``device``
    the ring's order (its own block first, then those of ``device - 1``, ``device - 2``, ...)."""
    world = device_count(axis, sizes)
    try:
        own = [pieces(layout, stop - start, world, r) for r in range(world)]
    except ShapeError as e:
        raise ShapeError(f"axis {axis}: {e}") from None
    if kind == "grid":
        return [(r, start + s, start + s + n) for r in range(world) for s, n in own[r]]
    return [(None, start + s, start + s + n) for t in range(world) for s, n in own[(device - t) % world]]


# --------------------------------------------------------------------------- a block at global indices

@dataclass(frozen=True)
class BlockView:
    """One block pair of a split: ``empty`` (nothing to compute), or the ``diagram`` a device runs
    on it (its masks and biases shifted to the block's global indices, masks it keeps whole
    dropped); ``key`` identifies the diagram among a device's blocks (equal keys, equal diagrams)."""

    key: tuple
    empty: bool
    diagram: Diagram | None


def mask_key(row: str, col: str, pred: Predicate) -> str:
    """What identifies a mask on (``row``, ``col``) across the diagrams of one split."""
    return f"{row},{col},{pred!r}"


def _unknown_atom(_atom):
    return False, False     # a block table's entries are data: neither full nor empty here


def block_state(pred: Predicate, rows, cols) -> tuple[bool, bool]:
    """``(full, empty)``: whether ``pred`` keeps all, or none, of the global ``rows`` x ``cols``
    (each ``(start, stop)``); a block table's entries are unknown here (neither)."""
    full, empty = pred.chunk_state(rows[0], rows[1], cols[0], cols[1], IntAlgebra, BoolLogic, _unknown_atom)
    return full is True, empty is True


def block_view(d: Diagram, ranges: dict, totals: dict, skips: tuple = ()) -> BlockView:
    """``d`` (the per-device diagram, indices from 0) on the block whose split axes cover the
    global ``ranges`` (axis -> ``(start, stop)``); ``totals`` are the global axis sizes;
    ``skips`` the :func:`mask_key` of the masks that empty a block they
    remove whole (the masks on the ring's stream, :func:`~.skipping.chunk_skips`)."""
    span = lambda a: ranges.get(a, (0, totals[a]))  # noqa: E731
    parts, eqns = [], list(d.eqns)
    for k, e in enumerate(d.eqns):
        box = e.box
        if not spec(box).indexed:
            continue
        row, col = box.param("row"), box.param("col")
        if box.kind == "mask":
            full, empty = block_state(box.param("pred"), span(row), span(col))
            if empty and mask_key(row, col, box.param("pred")) in skips:
                return BlockView(("empty",), True, None)
            if full:
                parts.append(("drop",))
                eqns[k] = None
                continue
        key, new = _shifted(box, span(row)[0], span(col)[0], ranges, totals)
        parts.append(key)
        eqns[k] = Eqn(new, e.ins)
    if not parts:
        return BlockView((), False, d)
    return BlockView(tuple(parts), False, _rebuilt(d, eqns))


def _rebuilt(d: Diagram, eqns: list) -> Diagram:
    """``d`` with ``eqns``; a None equation (a mask kept whole) passes its first input through."""
    n = len(d.dom)
    var_map, kept = list(range(n)), []
    for k, e in enumerate(eqns):
        ins = tuple(var_map[v] for v in (e or d.eqns[k]).ins)
        if e is None:
            var_map.append(ins[0])
            continue
        kept.append(Eqn(e.box, ins))
        var_map.extend(range(n, n + len(e.box.cod)))
        n += len(e.box.cod)
    return Diagram(d.dom, d.cod, tuple(kept), tuple(var_map[v] for v in d.outs), d.schedule)


def _shifted(box, orow: int, ocol: int, ranges: dict, totals: dict):
    """``(key, box)``: ``box`` reading the indices of a block whose ``row`` / ``col`` start at
    ``orow`` / ``ocol``."""
    row, col = box.param("row"), box.param("col")
    fn = box.param("pred") if box.kind == "mask" else box.param("bias")
    delta = orow - ocol
    if fn.kind == "causal":                      # j <= i + c  at  (i + orow, j + ocol)
        new, key = Predicate("causal", (fn.args[0] + delta,)), ("causal", fn.args[0] + delta)
    elif fn.kind == "window" and fn.args[0] - delta >= 0 and fn.args[1] + delta >= 0:
        args = (fn.args[0] - delta, fn.args[1] + delta)
        new, key = Predicate("window", args), ("window",) + args
    elif fn.kind in ("window", "alibi"):         # read at i - j + delta: one diagram per delta
        i, j = Ix("idx", (), row), Ix("idx", (), col)
        if fn.kind == "window":
            e = (j >= i - (fn.args[0] - delta)) & (j <= i + (fn.args[1] + delta))
        else:
            e = fn.args[0] * ((j - i) - delta)
        new, key = type(fn)("expr", (e, row, col)), (fn.kind,) + fn.args + (delta,)
    elif fn.kind == "custom":
        user = fn.fn
        new = type(fn)("custom", fn.args, lambda i, j: user(i + orow, j + ocol))
        key = ("custom", id(user), orow, ocol)
    else:
        e = _index_form(box, fn)
        shift = {a: Ix("idx", (), a) + s for a, (s, _) in ranges.items() if s}
        e = _subst(e, shift, totals, set(ranges))
        new, key = type(fn)("expr", (e, row, col)), ("expr", row, col, str(e))
    make = mask_box if box.kind == "mask" else index_bias_box
    return key, make(box.dom[0], row, col, new, box.cod[0].name, aux=list(box.dom[1:]))


def _index_form(box, fn) -> Ix:
    """The index function of ``box`` as an index expression over its row / column axes."""
    row, col = box.param("row"), box.param("col")
    if isinstance(fn, IndexBias):
        if fn.kind == "expr":
            return fn.expr
    else:
        form = fn.index_form()
        if form is not None:
            e, i, j = form
            return e if fn.kind == "expr" else e.subst({i: Ix("idx", (), row), j: Ix("idx", (), col)})
    raise LoweringError(f"{box.name}: {fn!r} has no index form, so its indices cannot be moved to a "
                        f"device's block; write it with nc.mask_mod / nc.bias_mod")


def _subst(e: Ix, table: dict, totals: dict, split: set) -> Ix:
    """``e`` with ``idx`` leaves replaced per ``table`` and the ``size`` of a split axis made
    the constant global size (a device's shard is shorter)."""
    if e.op == "idx" and e.value in table:
        return table[e.value]
    if e.op == "size" and e.value in split:
        return Ix("const", (), int(totals[e.value]))
    if not e.args:
        return e
    return Ix(e.op, tuple(_subst(a, table, totals, split) for a in e.args), e.value)
