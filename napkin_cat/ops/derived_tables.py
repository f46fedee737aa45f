"""Block tables a kernel derives from its inputs: block sparsity from a mask that reads data.

A mask that gathers from an auxiliary tensor (``doc[i] == doc[j]``: packed documents) has no
support a kernel can derive from its definition: which chunks it masks depends on the values.
:func:`with_tables` rewrites such a mask as :func:`~.block_table.blocked` would, reading a table
of the diagram's own blocks (its row tile by its column chunk), a new input after the diagram's
own; :class:`DerivedTable` fills it from the diagram's inputs with the mask's own NumPy / torch
meaning (:func:`~.block_table.block_table`'s evaluation).  The blocked mask equals the mask
wherever the table is the mask's, so the rewrite changes no result: the lowering runs it
(:mod:`napkin_cat.lowering.tabled`) and the cost model counts what it skips when given the data
(:func:`for_cost`).

A mask that reads an index other than its rows' and columns' (``doc[b, i] == doc[b, j]``, a
window of each head ``w[h]``) gets a table of each value of those indices (the lead axes, in the
diagram's axis order), read by a block that holds one of each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..core.diagram import Diagram, Eqn
from ..core.types import Array, Axis
from .block_table import _namespace, _table, bounds
from .boxes import mask_box
from .index import Predicate
from .index_expr import Aux, Ix


@dataclass(frozen=True)
class DerivedTable:
    """How one block table is filled from a call's arrays: ``expr`` (the mask over ``i``,
    ``j`` and the lead names ``_l0``, ...), the mask's extents and blocks, the leads' sizes,
    the positions of the auxiliary inputs it reads among the diagram's inputs, and the sizes
    its ``size`` leaves read."""

    name: str
    expr: Ix
    n_rows: int
    n_cols: int
    rows: int
    cols: int
    leads: tuple[int, ...]
    aux: tuple[tuple[str, int], ...]
    sizes: tuple[tuple[str, int], ...]
    lead_names: tuple[str, ...] = ()   # the diagram's axes the leads are

    def values(self, arrays):
        """The table (0 masked, 1 partial, 2 kept per block) of the mask on these arrays (the
        diagram's inputs), in the kind and dtype of the first array it reads (numpy, or torch on
        its device)."""
        values = {name: _readable(arrays[k]) for name, k in self.aux}
        first = next(iter(values.values()))
        xp, like = _namespace(values)
        env = {**values, **{("size", n): s for n, s in self.sizes}}
        slices = []
        for at in itertools.product(*(range(n) for n in self.leads)):
            env.update({f"_l{k}": v for k, v in enumerate(at)})
            slices.append(_table(self.expr, self.n_rows, self.n_cols, self.rows, self.cols, env, xp, like))
        if like is not None:
            import torch
            out = torch.stack(slices).reshape(*self.leads, *slices[0].shape).to(first.dtype)
            return out.contiguous()
        import numpy as np
        return np.stack(slices).reshape(*self.leads, *slices[0].shape).astype(first.dtype)


def _readable(x):
    """An array the mask's NumPy / torch meaning can read: numba device arrays come to the host."""
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return x


def derivable(d: Diagram) -> bool:
    """Whether ``d`` has a mask that reads data and no block table (so one would be derived)."""
    return any(_wants_table(e.box) for e in d.eqns)


def _wants_table(box) -> bool:
    if box.kind != "mask":
        return False
    pred = box.param("pred")
    return pred.kind == "expr" and bool(pred.auxes) and not pred.block_atoms()


def with_tables(d: Diagram) -> tuple[Diagram, tuple[DerivedTable, ...]]:
    """``d`` (every block size an int) with each mask that reads data rewritten to read a block
    table of ``d``'s blocks on its rows and columns, the tables new inputs after ``d``'s own;
    and how to fill each.  Masks whose rows and columns are neither streamed nor tiled are left
    alone (a table of one block skips nothing)."""
    blocks = {}
    for r in d.schedule:   # the outermost block of each axis: what one thread block holds
        if r.op in ("tile", "stream") and isinstance(r.size, int):
            blocks.setdefault(r.axis, r.size)
    streamed = {r.axis for r in d.schedule if r.op == "stream"}
    taken = {a.name for a in (*d.dom, *d.var_types())} | {a.name for a in d.axes}
    n_in, tables, specs, rewritten, made, preds = len(d.dom), [], [], {}, {}, {}
    for k, e in enumerate(d.eqns):
        row, col = e.box.param("row", None), e.box.param("col", None)
        if not _wants_table(e.box) or not ({row, col} & streamed):
            continue
        same = (e.box.param("pred").expr.key(), row, col)   # a backward's two masks share one table
        if same not in made:
            name = _fresh("bt", taken)
            taken.add(name)
            made[same] = len(tables), name
            arr, spec = _table_of(d, e, name, blocks, taken)
            tables.append(arr)
            specs.append(spec)
        at, name = made[same]
        rewritten[k] = at, _tabled_mask(d, e, tables[at], specs[at], preds)
    if not tables:
        return d, ()
    shift = len(tables)
    moved = lambda v: v if v < n_in else v + shift
    eqns = []
    for k, e in enumerate(d.eqns):
        if k in rewritten:
            (at, box), (s, *aux_vars) = rewritten[k], e.ins
            by_name = dict(zip((a.name for a in e.box.param("pred").auxes), aux_vars))
            ins = [moved(s)] + [n_in + at if a.name == tables[at].name else moved(by_name[a.name])
                                for a in box.param("pred").auxes]
            eqns.append(Eqn(box, tuple(ins)))
        else:
            eqns.append(Eqn(e.box, tuple(map(moved, e.ins))))
    out = Diagram((*d.dom, *tables), d.cod, eqns, tuple(map(moved, d.outs)), d.schedule)
    return out, tuple(specs)


def _fresh(stem: str, taken: set) -> str:
    return next(n for n in (stem if k == 0 else f"{stem}{k}" for k in itertools.count()) if n not in taken)


def _table_of(d: Diagram, e: Eqn, name: str, blocks: dict, taken: set) -> tuple[Array, DerivedTable]:
    """The table input of mask equation ``e`` over ``d``'s blocks, and how to fill it."""
    pred, row, col = e.box.param("pred"), e.box.param("row"), e.box.param("col")
    n_rows, n_cols = d.axis(row).size, d.axis(col).size
    rows, cols = blocks.get(row, n_rows), blocks.get(col, n_cols)
    leads = [a.name for a in d.axes if a.name in pred.expr.leaves("idx") and a.name not in (row, col)]
    positions = {a.name: k for k, a in enumerate(d.dom)}
    missing = [a.name for a in pred.auxes if a.name not in positions]
    if missing:   # data computed inside the diagram: the table cannot be filled before the launch
        raise NotInputs(missing)
    roles = pred.expr.subst({row: Ix("idx", (), "i"), col: Ix("idx", (), "j"),
                             **{n: Ix("idx", (), f"_l{k}") for k, n in enumerate(leads)}})
    lead_axes = [Axis(_fresh(f"{name}_{n}", taken), d.axis(n).size) for n in leads]
    grid = [Axis(_fresh(f"{name}_{r}", taken), -(-n // b)) for r, n, b in (("r", n_rows, rows), ("c", n_cols, cols))]
    dtype = d.var_types()[e.ins[1]].dtype   # the table in the dtype of the data it comes from
    spec = DerivedTable(name, roles, n_rows, n_cols, rows, cols, tuple(a.size for a in lead_axes),
                        tuple((a.name, positions[a.name]) for a in pred.auxes),
                        tuple((a.name, a.size) for a in d.axes), tuple(leads))
    return Array((*lead_axes, *grid), dtype, name), spec


def _tabled_mask(d: Diagram, e: Eqn, table: Array, spec: DerivedTable, preds: dict):
    """Mask equation ``e``'s box reading ``table``: ``blocked``'s form (:mod:`..ops.block_table`)
    on the box's own axes, with the mask's data-free bounds kept beside it; one predicate object
    per table (``preds``), as the masks of one diagram share theirs."""
    pred, row, col = e.box.param("pred"), e.box.param("row"), e.box.param("col")
    if table.name not in preds:
        at = lambda n: Ix("idx", (), n)
        t = Aux(table.name, table.axes)[(*map(at, spec.lead_names), at(row) // spec.rows, at(col) // spec.cols)]
        blocked = (t >= 2) | ((t >= 1) & pred.expr)
        for c in bounds(spec.expr):   # the mask's own data-free bounds (j <= i): the loops stop where they do
            blocked = blocked & c.subst({"i": at(row), "j": at(col)})
        preds[table.name] = Predicate("expr", (blocked, row, col))
    new = preds[table.name]
    types = d.var_types()
    arrays = {a.name: types[v] for a, v in zip(pred.auxes, e.ins[1:])} | {table.name: table}
    return mask_box(types[e.ins[0]], d.axis(row), d.axis(col), new, e.box.cod[0].name,
                    aux=[arrays[a.name] for a in new.auxes])


class NotInputs(Exception):
    def __init__(self, names):
        super().__init__(names)
        self.names = names


def for_cost(d: Diagram, data: dict | None):
    """``(d, data)`` for the cost model: where ``data`` holds the values a mask that reads data
    gathers from and ``d``'s blocks are ints, ``d`` with the tables of :func:`with_tables` and
    ``data`` with their values, so the chunks they mask are counted as a kernel skips them;
    else as given.  Also the names of the masks' data ``data`` lacks (for a note)."""
    if not derivable(d):
        return d, data, ()
    wanted = tuple(dict.fromkeys(a.name for e in d.eqns if _wants_table(e.box) for a in e.box.param("pred").auxes))
    missing = tuple(n for n in wanted if n not in (data or {}))
    if missing or any(r.op in ("tile", "stream") and not isinstance(r.size, int) for r in d.schedule):
        return d, data, missing
    try:
        d2, tables = with_tables(d)
    except NotInputs:
        return d, data, ()
    names = [a.name for a in d.dom]
    arrays = [data.get(n) for n in names]
    return d2, {**data, **{t.name: t.values(arrays) for t in tables}}, ()
