"""Block tables derived when a kernel runs: block sparsity from a mask that reads data.

A mask that gathers from an auxiliary tensor (``doc[i] == doc[j]``: packed documents) has no
support a kernel can derive from its definition: which chunks it masks depends on the values.
Written alone it lowers, but every chunk up to its data-free bounds (``j <= i``) is visited and
masked entry by entry.  :func:`lower_with_tables` therefore lowers such a diagram *as if* the
user had written :func:`~napkin_cat.ops.block_table.blocked` with a table of the kernel's own
blocks (its row tile by its column chunk, so each chunk reads one entry), and wraps the kernel
in a :class:`TabledKernel` that takes the diagram's own inputs and fills the table from them
before each launch: the mask's own NumPy / torch meaning over the blocks
(:func:`~napkin_cat.ops.block_table.block_table`'s evaluation), on the inputs' device.  The
mathematics is unchanged (the blocked mask equals the mask wherever the table is the mask's),
and the kernel ``nc.lower`` verifies is the wrapped one, on the diagram's own inputs.

A mask that reads an index other than its rows' and columns' (``doc[b, i] == doc[b, j]``, a
window of each head ``w[h]``) gets a table of each value of those indices (the lead axes, in the
diagram's axis order), read by a block that holds one of each.

Cost: a table is O(rows x columns) work on the inputs' device (FlexAttention's
``create_block_mask``).  Tables of torch tensors are kept by the tensors' identity and version
(:meth:`DerivedTable.fill`): the layers of a training step that share its document ids derive
each table once.  :meth:`TabledKernel.prepare` derives them once for the arrays it binds.  A
user who makes one table for many calls passes it: ``nc.blocked(mask, bt, rows, cols)``.
"""

from __future__ import annotations

import itertools
import sys
from collections import OrderedDict
from dataclasses import dataclass

from ..core.diagram import Diagram, Eqn
from ..core.errors import ShapeError
from ..core.types import Array, Axis
from ..ops.block_table import _namespace, _table, bounds
from ..ops.boxes import mask_box
from ..ops.index import Predicate
from ..ops.index_expr import Aux, Ix


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

    def fill(self, arrays):
        """The table (0 masked, 1 partial, 2 kept per block) of the mask on these arrays, in the
        kind and dtype of the first array it reads (numpy, or torch on its device); for torch
        tensors the last :data:`CACHED` tables are kept by the tensors' identity and version
        (every in-place change through torch bumps it), so the layers of one training step
        sharing its document ids derive their table once."""
        data = [arrays[k] for _, k in self.aux]
        key = _identity(data)
        if key is not None:
            hit = _TABLES.get((id(self), key))
            if hit is not None and hit[0] is self:
                _TABLES.move_to_end((id(self), key))
                return hit[1]
        table = self._fill(arrays)
        if key is not None:   # the tensors kept too: no other tensor gets their memory while the entry lives
            _TABLES[(id(self), key)] = (self, table, tuple(data))
            while len(_TABLES) > CACHED:
                _TABLES.popitem(last=False)
        return table

    def _fill(self, arrays):
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


CACHED = 16
"""Tables kept by the identity of the torch tensors they were derived from (:meth:`DerivedTable.fill`)."""
_TABLES: OrderedDict = OrderedDict()


def _identity(xs) -> tuple | None:
    """What names the data of torch tensors ``xs`` now: storage, version (bumped by every
    in-place change), shape, strides, dtype, device, and the stream the table would be made on;
    None for other arrays (their tables are derived at each call)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    key = []
    for x in xs:
        if not isinstance(x, torch.Tensor):
            return None
        key.append((x.data_ptr(), x._version, x.shape, x.stride(), x.dtype, x.device))
    if xs[0].is_cuda:
        key.append(torch.cuda.current_stream(xs[0].device.index).cuda_stream)
    return tuple(key)


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
        raise _NotInputs(missing)
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


class _NotInputs(Exception):
    def __init__(self, names):
        super().__init__(names)
        self.names = names


class TabledKernel:
    """A kernel for a diagram whose masks read data, with their block tables derived at each
    launch (module docstring).  Called like :class:`~napkin_cat.lowering.Kernel`, on the
    diagram's own inputs; ``.inner``: the kernel that reads the tables (its source, launch and
    notes); ``.tables``: how each is filled."""

    def __init__(self, public: Diagram, inner, tables: tuple[DerivedTable, ...]):
        self.diagram, self.inner, self.tables = public, inner, tables
        self.in_shapes = tuple(tuple(a.size for a in arr.axes) for arr in public.dom)
        self.out_shapes = inner.out_shapes
        self.in_io = tuple(arr.dtype.name for arr in public.dom)
        self.out_io = inner.out_io
        said = "; ".join(f"{t.name} over blocks of {t.rows} x {t.cols}"
                         + (f", one per value of {len(t.leads)} lead ind{'ex' if len(t.leads) == 1 else 'ices'}"
                            if t.leads else "") for t in tables)
        self.notes: tuple[str, ...] = (*inner.notes, f"Block tables derived from the inputs at each launch "
                                       f"(lowering/tabled.py): {said}; chunks they mask whole are skipped.")
        self.verified = False

    def __getattr__(self, name):
        if name in ("inner", "tables", "diagram"):   # not yet set (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"TabledKernel({self.inner!r}, tables {', '.join(t.name for t in self.tables)})"

    def _check_call(self, arrays) -> None:
        if len(arrays) != len(self.in_shapes):
            names = ", ".join(a.name for a in self.diagram.dom)
            raise ShapeError(f"kernel {self.inner.name} takes {len(self.in_shapes)} arrays ({names}), "
                             f"got {len(arrays)}")
        for arr, x, shape in zip(self.diagram.dom, arrays, self.in_shapes):
            if tuple(getattr(x, "shape", ())) != shape:
                raise ShapeError(f"input {arr}: expected shape {shape}, got {tuple(getattr(x, 'shape', ()))}")

    def derive(self, *arrays) -> tuple:
        """The block tables of these arrays (the extra inputs of ``.inner``)."""
        self._check_call(arrays)
        return tuple(t.fill(arrays) for t in self.tables)

    def __call__(self, *arrays, out=None, stream=None):
        return self.inner(*arrays, *self.derive(*arrays), out=out, stream=stream)

    def prepare(self, *arrays, out=None, stream=None):
        """A zero-argument callable that launches on these arrays; the tables are derived once,
        here, from the arrays as they are now."""
        return self.inner.prepare(*arrays, *self.derive(*arrays), out=out, stream=stream)


def lower_with_tables(d: Diagram, opts: dict, lower_any, on_gpu):
    """``lower_any(d, opts)``, or where ``d`` has masks that read data: their tables derived
    (module docstring), the kernel that reads them wrapped in a :class:`TabledKernel`;
    ``on_gpu()``: whether kernels run on a GPU (the schedule's choice depends on it)."""
    if not derivable(d):
        return lower_any(d, opts)
    from .schedule import choose
    sched = choose(d, opts.get("tiles"), opts.get("threads"), simulate=not on_gpu(), hw=opts.get("hw"))
    try:
        d2, tables = with_tables(sched.diagram)
    except _NotInputs:
        return lower_any(d, opts)
    if not tables:
        return lower_any(d, opts)
    inner = lower_any(d2, {**opts, "tiles": None, "threads": sched.threads})
    kernel = TabledKernel(sched.diagram, inner, tables)
    kernel.options = {**inner.options, "threads": opts.get("threads")}
    return kernel
