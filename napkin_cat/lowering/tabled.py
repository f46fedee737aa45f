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

Which blocks run fastest depends on the data: wide windows keep whole chunks and run faster on
taller tiles, short documents and narrow bands keep partial chunks and run faster on shorter ones.
On a GPU with warpgroup MMAs the 16-bit forward at d <= 64 is therefore lowered twice (128-row
``mma.sync`` blocks, and four warpgroups of 64 rows: :func:`.wgmma_plan.data_masks`), and a
:class:`TableChoice` runs, at each call, the form whose tables keep less area (:data:`TALLER`).

Cost: a table is O(rows x columns) work on the inputs' device (FlexAttention's
``create_block_mask``); on a GPU it is one launch of a generated kernel (:mod:`.table_kernel`).
Tables of torch tensors are kept by the tensors' identity and version (:func:`fill`): the layers
of a training step that share its document ids derive each table once.  :meth:`TabledKernel.prepare` derives them once for the arrays it binds.  A
user who makes one table for many calls passes it: ``nc.blocked(mask, bt, rows, cols)``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass

from ..core.diagram import Diagram
from ..core.errors import LoweringError, RelabelError, ShapeError, TypingError
from ..ops.derived_tables import DerivedTable, NotInputs, derivable, with_tables

CACHED = 16
"""Tables kept by the identity of the torch tensors they were derived from (:func:`fill`)."""
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


def fill(spec: DerivedTable, arrays):
    """``spec.values(arrays)``: the table of the mask on these arrays; for torch tensors the last :data:`CACHED` tables are kept by the tensors' identity and version
    (every in-place change through torch bumps it), so the layers of one training step
    sharing its document ids derive their table once."""
    data = [arrays[k] for _, k in spec.aux]
    key = _identity(data)
    if key is not None:
        hit = _TABLES.get((id(spec), key))
        if hit is not None and hit[0] is spec:
            _TABLES.move_to_end((id(spec), key))
            return hit[1]
    table = _derive(spec, data, arrays)
    if key is not None:   # the tensors kept too: no other tensor gets their memory while the entry lives
        _TABLES[(id(spec), key)] = (spec, table, tuple(data))
        while len(_TABLES) > CACHED:
            _TABLES.popitem(last=False)
    return table


EXACT = 2 ** 24
"""The largest magnitude up to which every integer is exact in f32, the dtype in which the values a
mask compares reach the kernel (:func:`napkin_cat.ops.boxes.exact_inputs`)."""


WIDE = ("int32", "int64", "uint32", "uint64", "float64")
"""Dtypes whose values may pass :data:`EXACT` (narrower ones, and f32 itself, cannot or are the
kernel's already)."""


def _check_exact(spec: DerivedTable, data) -> None:
    """Refuse compared values that f32 would merge: integers (wider than 16 bits) or float64
    arrays reaching past :data:`EXACT`, where ids ``2**24`` and ``2**24 + 1`` would compare equal
    in the kernel.  Read once per table made (a cached table's tensors are not read again)."""
    for (name, _), x in zip(spec.aux, data):
        n = x.numel() if callable(getattr(x, "numel", None)) else getattr(x, "size", 0)
        if str(x.dtype).split(".")[-1] not in WIDE or not n or not hasattr(x, "max"):
            continue   # (a numba device array has no reduction: not read back for this)
        top = max(float(x.max()), -float(x.min()))
        if top > EXACT:
            raise TypingError(f"input {name} ({x.dtype}): its values reach {top:.0f}, but the values a mask "
                              f"compares travel to the kernel in f32, exact for integers up to 2**24 = {EXACT}: "
                              f"renumber them (torch.unique(ids, return_inverse=True) keeps equal ids equal)")


def _derive(spec: DerivedTable, data, arrays):
    """The table: by its generated kernel (:mod:`.table_kernel`, one launch) for torch tensors on
    a GPU; else the mask's NumPy / torch meaning (:meth:`DerivedTable.values`).  The compared
    values are checked first (:func:`_check_exact`)."""
    _check_exact(spec, data)
    torch = sys.modules.get("torch")
    if (torch is not None and all(isinstance(x, torch.Tensor) and x.is_cuda for x in data)
            and GENERATED and "numba.cuda" in sys.modules):
        from .runtime import simulator_active
        if not simulator_active():
            from .table_kernel import make_table
            return make_table(spec, arrays)
    return spec.values(arrays)


GENERATED = True
"""Make tables of CUDA tensors by the generated table kernel (False: by torch operations, for
measuring the two: ``kernels/probes/table_fill.py``)."""


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
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise ShapeError(f"input {arr}: expected a numpy array, a torch tensor or a CUDA device array, "
                                 f"got {type(x).__name__}")
            if str(x.dtype).split(".")[-1].startswith(("bool", "complex")):
                raise ShapeError(f"input {arr}: expected a real (float or integer) array, got dtype {x.dtype}")
            if tuple(x.shape) != shape:
                raise ShapeError(f"input {arr}: expected shape {shape}, got {tuple(x.shape)}")

    def derive(self, *arrays) -> tuple:
        """The block tables of these arrays (the extra inputs of ``.inner``)."""
        self._check_call(arrays)
        return tuple(fill(t, arrays) for t in self.tables)

    def __call__(self, *arrays, out=None, stream=None):
        return self.inner(*arrays, *self.derive(*arrays), out=out, stream=stream)

    def prepare(self, *arrays, out=None, stream=None):
        """A zero-argument callable that launches on these arrays; the tables are derived once,
        here, from the arrays as they are now."""
        return self.inner.prepare(*arrays, *self.derive(*arrays), out=out, stream=stream)


TALLER = 1.13
"""A mask that reads data (or the user's block tables) runs on four warpgroups of 64 rows (256-row
blocks) where their tables keep less than ``TALLER`` times the area the 128-row blocks' tables
keep, else on the 128-row ``mma.sync`` blocks (:class:`TableChoice`; measured:
``kernels/probes/table_choice.py``, with ``--user`` for the user's tables)."""


class TableChoice:
    """A mask that reads data lowered twice (:func:`lower_with_tables`): ``forms``, two kernels on
    different blocks, the one to launch chosen at each call from the block tables each would read:
    the taller blocks where they keep less than :data:`TALLER` times the area the others keep (a
    wide window), else the others (short documents, narrow bands: tall tiles would keep many partial
    chunks).  The forms are :class:`TabledKernel` (tables derived from the data, their kept blocks
    counted) or, where the user passes the tables (``nc.blocked``, an explicit block mask), plain
    kernels whose ``blocks`` (:class:`UserBlocks`) count the area of the chunks each visits under
    the user's tables.  The choice reads the counts (or the user's tables) back to the host once;
    for torch tensors it is kept with their identity and version.  ``nc.lower`` verifies both forms."""

    def __init__(self, forms: tuple, blocks: tuple | None = None):
        self.forms, self.blocks = forms, blocks
        first = forms[0]
        self.diagram, self.name = first.diagram, first.name
        self.in_shapes, self.out_shapes, self.in_io, self.out_io = first.in_shapes, first.out_shapes, first.in_io, first.out_io
        self.options = first.options
        if blocks is None:
            said = "their block tables; blocks of " + " and ".join(f"{t.rows} x {t.cols}" for t in (f.tables[0] for f in forms))
        else:
            said = ("the chunks each visits under the given block tables (relabel/chunk_area.py); blocks of "
                    + " and ".join(f"{b.steps[-1]} x {b.s}" for b in blocks))
        self.notes: tuple[str, ...] = (
            f"Two forms, chosen at each launch from {said} (lowering/tabled.py, TableChoice); the second "
            f"where its tables keep less than {TALLER} times the first's area.",)
        self.verified = False
        self._chosen: OrderedDict = OrderedDict()

    def __repr__(self) -> str:
        return f"TableChoice({', '.join(repr(f) for f in self.forms)})"

    @staticmethod
    def kept(forms, derived) -> list[float]:
        """The area (entries) that each form's blocks its tables keep, whole or in part, cover:
        one read back to the host for all of them (a stack of the counts on the tables' device)."""
        counts = [(t > 0).sum() for tables in derived for t in tables]
        if counts and hasattr(counts[0], "cpu"):
            import torch
            counts = torch.stack(counts).cpu().tolist()
        counts, out = iter(float(c) for c in counts), []
        for form, tables in zip(forms, derived):
            out.append(sum(next(counts) * spec.rows * spec.cols for spec, _ in zip(form.tables, tables)))
        return out

    def _read(self, arrays) -> list:
        """The arrays the choice reads: the derived tables' data, or the user's tables."""
        if self.blocks is not None:
            return [arrays[k] for _, k in self.blocks[0].tables]
        return [arrays[k] for t in self.forms[0].tables for _, k in t.aux]

    def chosen(self, *arrays) -> tuple:
        """The form these arrays run on, and its derived tables (none for the user's)."""
        first = self.forms[0]
        if self.blocks is None:
            first._check_call(arrays)
        else:
            first._check_call(arrays, None)
        key = _identity(self._read(arrays))
        if key is not None and key in self._chosen:
            self._chosen.move_to_end(key)
            form = self.forms[self._chosen[key]]
            return form, (form.derive(*arrays) if self.blocks is None else ())
        if self.blocks is None:
            derived = [f.derive(*arrays) for f in self.forms]
            area = self.kept(self.forms, derived)
        else:
            derived = [()] * len(self.forms)
            area = [b.area(arrays) for b in self.blocks]
        pick = 1 if area[1] < TALLER * area[0] else 0
        if key is not None:
            self._chosen[key] = pick
            while len(self._chosen) > CACHED:
                self._chosen.popitem(last=False)
        return self.forms[pick], derived[pick]

    def _launch(self, form):
        return form.inner if self.blocks is None else form

    def __call__(self, *arrays, out=None, stream=None):
        form, tables = self.chosen(*arrays)
        return self._launch(form)(*arrays, *tables, out=out, stream=stream)

    def prepare(self, *arrays, out=None, stream=None):
        """As :meth:`TabledKernel.prepare`, on the form chosen for these arrays."""
        form, tables = self.chosen(*arrays)
        return self._launch(form).prepare(*arrays, *tables, out=out, stream=stream)


@dataclass(frozen=True)
class UserBlocks:
    """What one form of a diagram whose masks read the user's block tables visits: its stream
    loop's skips (:func:`~napkin_cat.relabel.skipping.chunk_skips`), the rows ``N`` tiled by
    ``steps``, the columns ``n`` in chunks of ``s``; ``tables``: each table's name and position
    among the diagram's inputs."""

    skips: tuple
    N: int
    steps: tuple[int, ...]
    n: int
    s: int
    tables: tuple[tuple[str, int], ...]

    @property
    def atoms(self) -> set:
        """The block-table comparisons its masks read."""
        return {a for sk in self.skips for a in sk.pred.block_atoms()}

    def area(self, arrays) -> float:
        """The entries of the chunks this form visits under the tables in ``arrays``."""
        from ..relabel.chunk_area import visited_area
        return visited_area(self.skips, self.N, list(self.steps), self.n, self.s,
                            {name: arrays[k] for name, k in self.tables})


def user_blocks(sched) -> UserBlocks | None:
    """:class:`UserBlocks` of a schedule's (or a kernel's) one stream loop whose masks read block
    tables that are the diagram's inputs, or None (no such loop, several, a stream over the
    mask's rows, or sizes that are not ints)."""
    from ..relabel.loopnest import Loop, final_form
    from ..relabel.skipping import chunk_skips
    sched = getattr(sched, "schedule", sched)
    if sched is None:
        return None
    ff = sched.final_form or final_form(sched.diagram)
    found = []
    for node, loops in ff.walk():
        if isinstance(node, Loop) and node.kind == "stream":
            skips = chunk_skips(ff, node)
            if any(sk.pred.block_atoms() for sk in skips):
                found.append((node, loops, skips))
    if len(found) != 1:
        return None
    loop, outer, skips = found[0]
    if any(sk.transposed or sk.row != skips[0].row for sk in skips):
        return None
    positions = {a.name: k for k, a in enumerate(sched.diagram.dom)}
    names = dict.fromkeys(a.table.name for sk in skips for a in sk.pred.block_atoms())
    steps = tuple(lp.step for lp in outer if lp.axis == skips[0].row)
    sizes = (ff.diagram.axis(skips[0].row).size, ff.extent(loop.axis, outer), loop.step, *steps)
    if any(n not in positions for n in names) or not steps or not all(getattr(v, "is_Integer", isinstance(v, int)) for v in sizes):
        return None
    N, n, s = (int(v) for v in sizes[:3])
    return UserBlocks(tuple(skips), N, tuple(int(v) for v in steps), n, s, tuple((m, positions[m]) for m in names))


WARP_ROWS = 16
"""The rows of each warp of the four warpgroups' fragments (``wgmma.m64``: 16 rows a warp)."""


def _one_entry(blocks: UserBlocks) -> bool:
    """Whether each warp's :data:`WARP_ROWS` rows of the warpgroups' tiles and each chunk lie
    inside one block of every table the form reads (the kernel then reads one entry a warp and
    writes its part of a partial chunk once per value, ``unswitch._warp_entries``; else each
    element of a partial chunk tests the whole mask)."""
    return all(a.rows % WARP_ROWS == 0 and a.cols % blocks.s == 0 for a in blocks.atoms)


def _spanned(tall: UserBlocks) -> str:
    """The note of a user's table whose blocks the warpgroups' warps span."""
    said = ", ".join(sorted({f"{a.table.name} ({a.rows} x {a.cols} blocks)" for a in tall.atoms}))
    return (f"One form: the four warpgroups' {tall.steps[-1]} x {tall.s} tiles, {WARP_ROWS} rows a warp, span "
            f"several blocks of {said} in each warp, so their partial chunks would test the whole mask in each "
            f"element (measured 2x slower on an H200: lowering/tabled.py, _user_choice); a table whose blocks are "
            f"multiples of {WARP_ROWS} x {tall.s} gets both forms, chosen at each call.")


def lower_with_tables(d: Diagram, opts: dict, lower_any, on_gpu):
    """``lower_any(d, opts)``, or where ``d`` has masks that read data: their tables derived
    (module docstring), the kernel that reads them wrapped in a :class:`TabledKernel`;
    ``on_gpu()``: whether kernels run on a GPU (the schedule's choice depends on it)."""
    from .schedule import choose
    if not derivable(d):
        return _user_choice(d, opts, lower_any, on_gpu) if reads_tables(d) else lower_any(d, opts)
    simulate = not on_gpu()
    try:   # one kernel's blocks; where there is none (a split into kernels), no table
        sched = choose(d, opts.get("tiles"), opts.get("threads"), simulate=simulate, hw=opts.get("hw"))
        kernel = _tabled(sched, opts, lower_any)
    except (LoweringError, RelabelError, NotInputs):
        return lower_any(d, opts)
    if kernel is None:
        return lower_any(d, opts)
    if simulate or opts.get("tiles") is not None or opts.get("threads") is not None:
        return kernel   # blocks the user chose, or the simulator's
    try:
        taller = _warpgroups(d, opts)
        if taller.threads == sched.threads:
            return kernel
        other = _tabled(taller, opts, lower_any)
    except (LoweringError, RelabelError, NotInputs) as e:
        kernel.notes += (f"One form: the warpgroups' blocks did not lower: {e}",)
        return kernel
    return TableChoice((kernel, other)) if other is not None else kernel


def _warpgroups(d: Diagram, opts: dict):
    """``nc.lower``'s schedule of ``d`` on a GPU with the warpgroups' blocks for masks that read
    data or tables (:func:`~.wgmma_plan.data_masks`): the taller form, where it is another."""
    from .schedule import choose
    from .wgmma_plan import data_masks
    with data_masks():
        return choose(d, None, None, simulate=False, hw=opts.get("hw"))


def _tabled(sched, opts: dict, lower_any) -> TabledKernel | None:
    """The kernel of schedule ``sched`` reading derived tables, or None where it has none."""
    d2, tables = with_tables(sched.diagram)
    if not tables:
        return None
    inner = lower_any(d2, {**opts, "tiles": None, "threads": sched.threads})
    kernel = TabledKernel(sched.diagram, inner, tables)
    kernel.options = {**inner.options, "threads": opts.get("threads")}
    return kernel


def reads_tables(d: Diagram) -> bool:
    """Whether a mask of ``d`` reads a block table that is one of its inputs (``nc.blocked``, an
    explicit block mask)."""
    names = {a.name for a in d.dom}
    return any(e.box.kind == "mask" and any(a.table.name in names for a in e.box.param("pred").block_atoms())
               for e in d.eqns)


def _user_choice(d: Diagram, opts: dict, lower_any, on_gpu):
    """``lower_any(d, opts)``, or on a GPU with warpgroup MMAs, where the blocks are ``nc.lower``'s
    own and the warpgroups' form is another: both forms in a :class:`TableChoice` that runs, at each
    call, the one visiting less under the user's tables (:class:`UserBlocks`).  Not where each warp's
    16 rows of the warpgroups' tiles (:data:`WARP_ROWS`) and 64 columns span several blocks of a
    table (:func:`_one_entry`): the kernel then reads no single entry per chunk or per warp and its
    partial chunks test the whole mask in each element.  Measured on the H200 that way (before the
    entries of each warp, ``unswitch._warp_entries``), under a table of 128 x 128 blocks (windows of
    each head, N = 4096, d = 64, f16): 0.409 ms against 0.208 for the 128-row blocks, its computing
    threads spilling 88 bytes; with an entry per warp 0.187 ms, no spills (kernels/BENCHMARKS.md,
    "Session of 2026-12-02")."""
    from .schedule import choose
    if not on_gpu() or opts.get("tiles") is not None or opts.get("threads") is not None:
        return lower_any(d, opts)
    try:
        sched = choose(d, None, None, simulate=False, hw=opts.get("hw"))
        taller = _warpgroups(d, opts)
    except (LoweringError, RelabelError):
        return lower_any(d, opts)
    blocks = tuple(user_blocks(s) for s in (sched, taller))
    if taller.threads == sched.threads or any(b is None for b in blocks) or blocks[0].tables != blocks[1].tables:
        return lower_any(d, opts)
    if not _one_entry(blocks[1]):
        kernel = lower_any(d, opts)
        kernel.notes += (_spanned(blocks[1]),)
        return kernel
    first = lower_any(sched.diagram, {**opts, "tiles": None, "threads": sched.threads})
    first.options = {**first.options, "threads": None}
    try:
        other = lower_any(taller.diagram, {**opts, "tiles": None, "threads": taller.threads})
    except (LoweringError, RelabelError) as e:
        first.notes += (f"One form: the warpgroups' blocks did not lower: {e}",)
        return first
    other.options = {**other.options, "threads": None}
    return TableChoice((first, other), blocks)
