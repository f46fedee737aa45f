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
from .block_table import _arange, _namespace, _slices, _table, bounds
from .boxes import mask_box
from .index import Predicate
from .index_expr import Aux, Ix
from .interval_expr import bounds_or_none


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
    dtype: str = "f32"   # the table input's element type: the scores' (0, 1, 2 are exact in any)

    def values(self, arrays):
        """The table (0 masked, 1 partial, 2 kept per block) of the mask on these arrays (the
        diagram's inputs), in the kind of the first array it reads (numpy, or torch on its
        device), in the table input's dtype (float32 for numpy's lack of bf16)."""
        values = {name: _readable(arrays[k]) for name, k in self.aux}
        xp, like = _namespace(values)
        env = {**values, **{("size", n): s for n, s in self.sizes}}

        def one(at):
            env.update({f"_l{k}": v for k, v in enumerate(at)})
            args = (self.expr, self.n_rows, self.n_cols, self.rows, self.cols, env, xp, like)
            # on the host, bounds over blocks (O(rows + columns + blocks)) where the mask's
            # operations allow; on a GPU the entries, in few large operations (launches cost
            # more there than the work: 0.35 against 1.1 ms at N = 4096 on an H200, BENCHMARKS.md)
            t = None if on_device(like) else interval_table(*args)
            return _table(*args) if t is None else t
        out = _slices(one, self.leads, like)
        if like is not None:
            import torch
            want = {"f16": torch.float16, "bf16": torch.bfloat16}.get(self.dtype, torch.float32)
            return out.to(want).contiguous()
        return out.astype("float16" if self.dtype == "f16" else "float32")


def on_device(like) -> bool:
    """Whether the arrays a table is made from are torch tensors on a GPU."""
    return like is not None and like.device.type != "cpu"


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


def derivation_notes(d: Diagram) -> list[str]:
    """What deriving ``d``'s tables costs at a launch on data it has not seen (not in the
    kernel's counts): the mask evaluated at every entry of its rows by its columns, for each
    value of the indices it reads besides them."""
    out = []
    for e in d.eqns:
        if _wants_table(e.box):
            pred, row, col = e.box.param("pred"), e.box.param("row"), e.box.param("col")
            leads = [a for a in d.axes if a.name in pred.expr.leaves("idx") and a.name not in (row, col)]
            per = "".join(f" x {a.name}={a.size}" for a in leads)
            work = ", ".join(f"{n} {u}" for u, n in sorted(pred.expr.work().items())) or "no arithmetic"
            gathers = sum(n.op == "gather" for n in pred.expr.walk())
            bounded = "the blocks its bounds decide read their rows' and columns' values only; " \
                if bounds_or_none(pred.expr) is not None else ""
            out.append(f"the block table of mask {pred.expr} is derived at a launch on new "
                       f"{', '.join(a.name for a in pred.auxes)}: the mask at up to {d.axis(row).size} x "
                       f"{d.axis(col).size}{per} entries ({work} and {gathers} gather{'s' if gathers != 1 else ''} "
                       f"each; {bounded}one launch of a generated kernel on a GPU, lowering/table_kernel.py), "
                       f"not in the counts; kept for data seen before")
    return out


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
    dtype = d.var_types()[e.ins[0]].dtype   # the scores': a 16-bit kernel keeps a 16-bit table
    spec = DerivedTable(name, roles, n_rows, n_cols, rows, cols, tuple(a.size for a in lead_axes),
                        tuple((a.name, positions[a.name]) for a in pred.auxes),
                        tuple((a.name, a.size) for a in d.axes), tuple(leads), dtype.name)
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


# --------------------------------------------------------------------------- intervals over blocks

def interval_table(e: Ix, n_rows: int, n_cols: int, rows: int, cols: int, env: dict, xp, like):
    """The block table of mask ``e`` from bounds over each block instead of its entries, or
    None where ``e`` holds an operation it cannot bound.  Each value is an interval ``[lo, hi]``
    over a block's entries (``i`` and ``j`` their block's index ranges, a gather of ``i`` or
    ``j`` the least and greatest values the tensor holds over them), each condition a pair
    ``(may, must)``: true for some entry, for every entry.  A block is masked (0) where the mask
    cannot hold, kept (2) where it must, partial (1) otherwise: never 0 or 2 where the entries
    say otherwise, so the table is one the mask agrees with; O(rows + columns + blocks) work
    instead of O(rows x columns).  For data whose values run in order (document ids) the bounds
    are tight and the table is the exact one; where they are not it keeps more blocks partial.

    The rules are :func:`~.interval_expr.block_bounds`' expressions, evaluated here over arrays
    of every block at once; a table kernel evaluates the same expressions per block
    (:mod:`napkin_cat.lowering.table_kernel`)."""
    bounded = bounds_or_none(e)
    if bounded is None:
        return None
    may, must, unknown, gathers = bounded
    R, C = -(-n_rows // rows), -(-n_cols // cols)
    grid = {"i": (R, rows, n_rows), "j": (C, cols, n_cols)}
    vals = dict(env)
    for role, (count, step, n) in grid.items():
        lo = _arange(xp, like, count) * step
        hi = _at_most(lo + step, n) - 1
        shape = (count, 1) if role == "i" else (1, count)
        vals[f"{role}_lo"], vals[f"{role}_hi"] = lo.reshape(shape), hi.reshape(shape)
    for k, g in enumerate(gathers):
        vals[("float", f"_g{k}_lo")], vals[("float", f"_g{k}_hi")] = _gather_bounds(g, env, grid, xp, like)
    with xp.quiet():   # inf * 0 and the like: NaN bounds, noted as unknown
        may, must, unknown = (xp.broadcast_to(_as_array(x.evaluate(xp, vals), xp, like), (R, C))
                              for x in (may, must, unknown))
    out = xp.where(unknown, 1.0, xp.where(must, 2.0, xp.where(may, 1.0, 0.0)))
    return out.astype(xp.float32) if hasattr(out, "astype") else out.float()


def _at_most(a, n: int):
    """``min(a, n)`` elementwise, for a NumPy array or a torch tensor (on its device)."""
    return a.clamp(max=n) if hasattr(a, "clamp") else a.clip(max=n)


def _as_array(v, xp, like):
    if isinstance(v, (bool, int, float)):
        if like is not None:
            import torch
            return torch.tensor(v, device=like.device)
        import numpy as np
        return np.asarray(v)
    return v


def _gather_bounds(g: Ix, env: dict, grid: dict, xp, like):
    """The least and greatest values gather ``g`` (its indices fixed but one, ``i`` or ``j``)
    reads over each block's range of that index, as arrays that broadcast to the table (indices
    clamped into the tensor, as every gather reads them; NaN where the range holds one)."""
    arr = env[g.value.name]
    k = next(m for m, a in enumerate(g.args) if a.op == "idx" and a.value in ("i", "j"))
    at = [None if m == k else min(max(int(a.evaluate(xp, env)), 0), arr.shape[m] - 1) for m, a in enumerate(g.args)]
    line = arr[tuple(slice(None) if m == k else v for m, v in enumerate(at))]
    role = g.args[k].value
    count, step, n = grid[role]
    idx = _at_most(_arange(xp, like, count * step), min(n, line.shape[0]) - 1)
    vals = line[idx].reshape(count, step)
    lo, hi = (vals.amin(1), vals.amax(1)) if like is not None else (vals.min(1), vals.max(1))
    shape = (count, 1) if role == "i" else (1, count)
    return lo.reshape(shape), hi.reshape(shape)
