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
        first = next(iter(values.values()))
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
            out.append(f"the block table of mask {pred.expr} is derived at a launch on new "
                       f"{', '.join(a.name for a in pred.auxes)}: the mask at {d.axis(row).size} x "
                       f"{d.axis(col).size}{per} entries ({work} and {gathers} gather{'s' if gathers != 1 else ''} each; one launch of a "
                       f"generated kernel on a GPU, lowering/table_kernel.py), not in the counts; kept for "
                       f"data seen before")
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

class _Unsupported(Exception):
    """An operation the interval evaluation does not bound: the table is evaluated entry by entry."""


def interval_table(e: Ix, n_rows: int, n_cols: int, rows: int, cols: int, env: dict, xp, like):
    """The block table of mask ``e`` from bounds over each block instead of its entries, or
    None where ``e`` holds an operation it cannot bound.  Each value is an interval ``[lo, hi]``
    over a block's entries (``i`` and ``j`` their block's index ranges, a gather of ``i`` or
    ``j`` the least and greatest values the tensor holds over them), each condition a pair
    ``(may, must)``: true for some entry, for every entry.  A block is masked (0) where the mask
    cannot hold, kept (2) where it must, partial (1) otherwise: never 0 or 2 where the entries
    say otherwise, so the table is one the mask agrees with; O(rows + columns + blocks) work
    instead of O(rows x columns).  For data whose values run in order (document ids) the bounds
    are tight and the table is the exact one; where they are not it keeps more blocks partial."""
    R, C = -(-n_rows // rows), -(-n_cols // cols)
    ev = _Intervals(xp, like, env, {"i": (R, rows, n_rows), "j": (C, cols, n_cols)})
    try:
        with xp.quiet():   # inf * 0 and the like: NaN bounds, noted as unknown
            may, must = ev.cond(e)
    except _Unsupported:
        return None
    may, must = xp.broadcast_to(ev.arr(may), (R, C)), xp.broadcast_to(ev.arr(must), (R, C))
    out = xp.where(must, 2.0, xp.where(may, 1.0, 0.0))
    if ev.unknown:   # a bound that is NaN (NaN data, inf - inf) bounds nothing: partial
        u = ev.unknown[0]
        for v in ev.unknown[1:]:
            u = u | v
        out = xp.where(u, 1.0, out)
    return out.astype(xp.float32) if hasattr(out, "astype") else out.float()


_SCALARS = (bool, int, float)


def _lo(a, b):
    """The least of ``a`` and ``b`` (arrays or Python numbers; no device copy of a number)."""
    return _bound(a, b, min, "max", "minimum")


def _hi(a, b):
    return _bound(a, b, max, "min", "maximum")


def _bound(a, b, pick, clamp: str, ufunc: str):
    if isinstance(a, _SCALARS) and isinstance(b, _SCALARS):
        return pick(a, b)
    if isinstance(a, _SCALARS):
        a, b = b, a
    if hasattr(a, "clamp") and isinstance(b, _SCALARS):   # torch: a number bounds without becoming a tensor
        return a.clamp(**{clamp: b})
    if hasattr(a, "clamp"):
        import torch as xp
    else:
        import numpy as xp
    return getattr(xp, ufunc)(a, b)


def _not(a):
    return (not a) if isinstance(a, bool) else ~a


def _both(a, b):
    return (a and b) if isinstance(a, bool) and isinstance(b, bool) else a & b


def _either(a, b):
    return (a or b) if isinstance(a, bool) and isinstance(b, bool) else a | b


class _Intervals:
    def __init__(self, xp, like, env, grid):
        self.xp, self.like, self.env, self.grid = xp, like, env, grid
        self.unknown: list = []   # where a bound is NaN, per block (arrays that broadcast to the table)

    def arr(self, v):
        if isinstance(v, _SCALARS):
            if self.like is not None:
                import torch
                return torch.tensor(v, device=self.like.device)
            import numpy as np
            return np.asarray(v)
        return v

    def where(self, c, a, b):
        if isinstance(c, bool):
            return a if c else b
        return self.xp.where(c, a, b)

    def checked(self, lo, hi, both: bool = True):
        """``(lo, hi)``, noting the blocks where either is NaN (``both=False``: where ``lo`` is,
        which a least and greatest value over the same entries are together)."""
        for v in (lo, hi) if both else (lo,):
            if isinstance(v, float):
                if v != v:
                    self.unknown.append(self.arr(True))
            elif not isinstance(v, (bool, int)) and (v.dtype.is_floating_point if self.like is not None
                                                     else v.dtype.kind == "f"):
                self.unknown.append(v != v)
        return lo, hi

    def _range(self, role):
        count, step, n = self.grid[role]
        lo = _arange(self.xp, self.like, count) * step
        hi = _lo(lo + step, n) - 1
        shape = (count, 1) if role == "i" else (1, count)
        return lo.reshape(shape), hi.reshape(shape)

    def scalar(self, e: Ix) -> bool:
        return all(n.op != "gather" and not (n.op == "idx" and n.value in ("i", "j")) for n in e.walk())

    def value(self, e: Ix):
        """``(lo, hi)`` of numeric expression ``e`` over each block."""
        return self.checked(*self._value(e), both=e.op != "gather")

    def _value(self, e: Ix):
        op, a = e.op, e.args
        if self.scalar(e):
            v = e.evaluate(self.xp, self.env)
            return v, v
        if op == "idx":
            return self._range(e.value)
        if op == "gather":
            return self._gather(e)
        if op in ("add", "sub", "mul", "min", "max"):
            (al, ah), (bl, bh) = self.value(a[0]), self.value(a[1])
            if op == "add":
                return al + bl, ah + bh
            if op == "sub":
                return al - bh, ah - bl
            if op in ("min", "max"):
                f = _lo if op == "min" else _hi
                return f(al, bl), f(ah, bh)
            ends = [x * y for x in (al, ah) for y in (bl, bh)]
            lo = hi = ends[0]
            for v in ends[1:]:
                lo, hi = _lo(lo, v), _hi(hi, v)
            return lo, hi
        if op == "neg":
            lo, hi = self.value(a[0])
            return -hi, -lo
        if op == "abs":
            lo, hi = self.value(a[0])
            return (self.where(lo >= 0, lo, self.where(hi <= 0, -hi, 0 * lo)),
                    self.where(lo >= 0, hi, _hi(-lo, hi)))
        if op in ("floordiv", "mod") and self.scalar(a[1]):
            k = a[1].evaluate(self.xp, self.env)
            if isinstance(k, (int, float)) and k > 0:
                lo, hi = self.value(a[0])
                if op == "floordiv":   # monotone for a positive divisor
                    return lo // k, hi // k
                one = lo // k == hi // k   # within one period: monotone there
                return self.where(one, lo % k, 0 * lo), self.where(one, hi % k, 0 * hi + (k - 1))
        if op == "where":
            may, must = self.cond(a[0])
            (bl, bh), (cl, ch) = self.value(a[1]), self.value(a[2])
            never = _not(may)
            return (self.where(must, bl, self.where(never, cl, _lo(bl, cl))),
                    self.where(must, bh, self.where(never, ch, _hi(bh, ch))))
        raise _Unsupported(op)

    def _gather(self, e: Ix):
        """A gather whose indices are fixed but one, which is ``i`` or ``j``: the least and
        greatest values over each block's range of it (indices clamped into the tensor, as
        every gather reads them)."""
        arr = self.env[e.value.name]
        free = [k for k, a in enumerate(e.args) if not self.scalar(a)]
        if len(free) > 1 or (free and not (e.args[free[0]].op == "idx" and e.args[free[0]].value in ("i", "j"))):
            raise _Unsupported("gather")
        at = [None if k in free else min(max(int(a.evaluate(self.xp, self.env)), 0), arr.shape[k] - 1)
              for k, a in enumerate(e.args)]
        if not free:
            v = arr[tuple(at)]
            return v, v
        k = free[0]
        line = arr[tuple(slice(None) if m == k else v for m, v in enumerate(at))]
        count, step, n = self.grid[e.args[k].value]
        idx = _lo(_arange(self.xp, self.like, count * step), min(n, line.shape[0]) - 1)
        vals = line[idx].reshape(count, step)
        lo, hi = (vals.amin(1), vals.amax(1)) if self.like is not None else (vals.min(1), vals.max(1))
        shape = (count, 1) if e.args[k].value == "i" else (1, count)
        return lo.reshape(shape), hi.reshape(shape)

    def cond(self, e: Ix):
        """``(may, must)`` of condition ``e`` over each block."""
        op, a = e.op, e.args
        if self.scalar(e):
            v = e.evaluate(self.xp, self.env)
            return v, v
        if op in ("and", "or") and e.dtype == "bool":
            (am, au), (bm, bu) = self.cond(a[0]), self.cond(a[1])
            f = _both if op == "and" else _either
            return f(am, bm), f(au, bu)
        if op == "invert" and e.dtype == "bool":
            may, must = self.cond(a[0])
            return _not(must), _not(may)
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            if op in ("gt", "ge"):   # b < a, b <= a
                op, a = {"gt": "lt", "ge": "le"}[op], (a[1], a[0])
            (al, ah), (bl, bh) = self.value(a[0]), self.value(a[1])
            if op == "lt":
                return al < bh, ah < bl
            if op == "le":
                return al <= bh, ah <= bl
            meet = _both(al <= bh, bl <= ah)
            same = _both(_both(al == ah, bl == bh), al == bl)
            return (meet, same) if op == "eq" else (_not(same), _not(meet))
        raise _Unsupported(op)
