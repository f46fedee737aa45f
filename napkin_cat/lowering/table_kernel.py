"""Block tables made on the GPU by a generated kernel, from the mask's own definition.

A :class:`~napkin_cat.ops.derived_tables.DerivedTable` filled by torch operations costs about 15
launches over the N x N entries: 0.3-0.7 ms at N = 4096 on an H200, several times the attention
kernel that reads it (``kernels/BENCHMARKS.md``).  Here the same table is one launch, a block of
threads per table entry (and per value of the mask's lead indices), in three passes:

1. a block that the mask's data-free bound (``j <= i``) masks, whatever the data, is written at
   once (:func:`static_table`, made on the host when the kernel is compiled);
2. the mask's bounds over the block (:mod:`napkin_cat.ops.interval_expr`: each gather's least and
   greatest value over the block's rows or columns, then ``may`` / ``must`` of the mask) decide
   the block where they can: O(rows + columns) reads instead of rows x columns entries; for
   document ids in order, every block but the partial ones;
3. the rest evaluate the mask at every entry of the block, with the numba.cuda code
   :meth:`~napkin_cat.ops.index_expr.Ix.to_code` writes for it (the code the attention kernels
   evaluate it with), and reduce *some entry kept* and *every entry kept* with
   ``syncthreads_or`` / ``syncthreads_and``.  Entries past the ends of a ragged block count for
   neither, as in the NumPy meaning (:func:`~napkin_cat.ops.block_table.block_table`).

Passes 1 and 2 only ever decide a block the entries would decide the same way, so the table is
the entries' table (``tests/test_table_kernel.py``).

Gathered values are read as float32, as the kernels that read the table read them (the mask's
auxiliary tensors are f32 inputs where compared: :func:`napkin_cat.aux`); 16-bit tensors are
widened first.  The table is written in the dtype of the kernel's table input (16-bit tables as
their bit patterns), so the attention kernel reads it without a conversion.

:func:`make_table` is what :mod:`.tabled` calls for torch tensors on a GPU.  The first table a
compiled kernel makes is checked against the torch evaluation of the same mask on the same data
(:meth:`DerivedTable.values`); a difference is a :class:`LoweringError` naming both, never a
wrong table.  Under the simulator the kernel runs on NumPy arrays (``tests/test_table_kernel.py``
checks it against the NumPy meaning on random masks).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from ..core.errors import LoweringError
from ..ops.derived_tables import DerivedTable
from ..ops.index_expr import Ix
from ..ops.interval_expr import bounds_or_none
from .emit_kinds import fn_expr
from .source import Constants, Names, Source

GPU_THREADS = 256
"""Threads per table entry on a GPU (a 128 x 64 block: 32 entries each)."""
SIM_THREADS = 8
"""... under the simulator (each thread is a Python thread there)."""

_BITS = {"f32": (0.0, 1.0, 2.0), "f16": (0, 0x3C00, 0x4000), "bf16": (0, 0x3F80, 0x4000)}
"""The table's three values (masked, partial, kept) as the kernel writes them: float32, or the
bit patterns of the 16-bit floats 0, 1 and 2."""


def static_table(spec: DerivedTable):
    """The blocks the mask's data-free bounds (``j <= i``: :func:`~napkin_cat.ops.block_table.bounds`)
    mask whole, whatever the data: a float32 ``(row blocks, column blocks)`` table, 0 there, from
    bounds over blocks (never 0 where an entry holds); None when the mask has no such bound."""
    import numpy as np

    from ..ops.block_table import bounds
    from ..ops.derived_tables import interval_table
    from ..ops.arrays import NUMPY
    own = [c for c in bounds(spec.expr) if set(c.leaves("idx")) <= {"i", "j"}]
    if not own:
        return None
    both = own[0]
    for c in own[1:]:
        both = both & c
    env = {("size", n): v for n, v in spec.sizes}
    table = interval_table(both, spec.n_rows, spec.n_cols, spec.rows, spec.cols, env, NUMPY, None)
    return None if table is None or not (table == 0).any() else np.ascontiguousarray(table, np.float32)


def _emit_bounds(body, spec: DerivedTable, threads: int, bounded, code, masked: str, kept: str):
    """The bounds pass: each gather's least and greatest value over the block's range of its free
    index (the threads stride over it, then halve to one in shared memory; a NaN read leaves the
    block to its entries), then ``may`` / ``must`` of the mask; a block they decide is written and
    left, every thread alike."""
    may, must, unknown, gathers = bounded
    body(f"i_lo = r * {spec.rows}")
    body(f"i_hi = min(i_lo + {spec.rows}, {spec.n_rows}) - 1")
    body(f"j_lo = c * {spec.cols}")
    body(f"j_hi = min(j_lo + {spec.cols}, {spec.n_cols}) - 1")
    body("nan = False")
    for k, g in enumerate(gathers):
        free = next(a.value for a in g.args if a.op == "idx" and a.value in ("i", "j"))
        body(f"_g{k}_lo = float32(math.inf)")
        body(f"_g{k}_hi = float32(-math.inf)")
        body(f"t = {free}_lo + tid")
        with body.block(f"while t <= {free}_hi:"):
            body(f"v = {code(g.subst({free: Ix('idx', (), 't')}))}")
            with body.block("if v != v:"):
                body("nan = True")
            with body.block("else:"):
                body(f"_g{k}_lo = min(_g{k}_lo, v)")
                body(f"_g{k}_hi = max(_g{k}_hi, v)")
            body(f"t += {threads}")
        body(f"lo_s{k} = cuda.shared.array({threads}, float32)")   # one array per line: the simulator keys them by line
        body(f"hi_s{k} = cuda.shared.array({threads}, float32)")
        body(f"lo_s{k}[tid] = _g{k}_lo")
        body(f"hi_s{k}[tid] = _g{k}_hi")
        body("cuda.syncthreads()")
        body(f"half = {threads // 2}")
        with body.block("while half > 0:"):
            with body.block("if tid < half:"):
                body(f"lo_s{k}[tid] = min(lo_s{k}[tid], lo_s{k}[tid + half])")
                body(f"hi_s{k}[tid] = max(hi_s{k}[tid], hi_s{k}[tid + half])")
            body("cuda.syncthreads()")
            body("half //= 2")
        body(f"_g{k}_lo = lo_s{k}[0]")
        body(f"_g{k}_hi = hi_s{k}[0]")
    body("nan = cuda.syncthreads_or(int32(nan)) != 0")
    with body.block("if not nan:"):
        body(f"unsure = bool({code(unknown)})")
        body(f"may = bool({code(may)})")
        body(f"must = bool({code(must)})")
        with body.block("if not unsure and (must or not may):   # decided by the bounds, as every thread finds"):
            with body.block("if tid == 0:"):
                body(f"T[at] = {kept} if must else {masked}")
            body("return")


def table_source(spec: DerivedTable, shapes: dict[str, tuple[int, ...]], threads: int,
                 name: str = "napkin_table", static: bool = False) -> str:
    """numba.cuda source of the kernel that fills ``spec``'s table: ``name(T, *aux)`` with the
    table flat (float32, or int16 bit patterns for a 16-bit table) and the auxiliary arrays flat,
    in C order of ``shapes``; launched on the grid ``(column blocks, row blocks, lead values)``.
    ``static``: a last argument ``S``, :func:`static_table`; its blocks at 0 are written masked
    at once, their entries not evaluated.  Where the mask has bounds (:func:`.bounds_or_none`)
    they decide each block first where they can; the entries are evaluated where they cannot."""
    if threads & (threads - 1):
        raise LoweringError(f"block table {spec.name}: the table kernel halves over its threads; {threads} is "
                            f"not a power of two")
    if spec.dtype not in _BITS:
        raise LoweringError(f"block table {spec.name}: no table kernel writes dtype {spec.dtype}")
    names = Names(reserved=("T", "S", "at", "c", "r", "k", "i", "j", "t", "v", "tid", "some", "every", "e", "lead",
                           "i_lo", "i_hi", "j_lo", "j_hi", "nan", "half", "may", "must", "unsure", *(f"_l{k}" for k in range(len(spec.leads)))))
    consts = Constants(names)
    aux_vars = {a: names.fresh(f"A_{a}") for a, _ in spec.aux}
    sizes = dict(spec.sizes)

    def leaf(n: Ix) -> str:
        if n.op == "idx":
            return n.value[1] if isinstance(n.value, tuple) else str(n.value)   # a bound's float leaf: its variable
        if n.op == "size":
            return str(sizes[n.value])
        shape = shapes[n.value.name]
        flat, stride = [], 1
        for k, extent in reversed(list(zip(n.args, shape))):
            code = k.to_code(leaf, fconst, fn_code)
            flat.append(f"min(max({code}, 0), {extent - 1})" + (f" * {stride}" if stride != 1 else ""))
            stride *= extent
        return f"float32({aux_vars[n.value.name]}[{' + '.join(reversed(flat))}])"

    fconst = lambda v: consts.f(v)
    fn_code = lambda fn, x: fn_expr(consts, fn, [x])
    keep = spec.expr.to_code(leaf, fconst, fn_code)
    bounded = bounds_or_none(spec.expr)
    R, C = -(-spec.n_rows // spec.rows), -(-spec.n_cols // spec.cols)
    masked, partial, kept = _BITS[spec.dtype]
    value = (lambda v: f"float32({v!r})") if spec.dtype == "f32" else (lambda v: f"int16({v})")

    body = Source(1)
    body("tid = int64(cuda.threadIdx.x)")
    body("c = int64(cuda.blockIdx.x)")
    body("r = int64(cuda.blockIdx.y)")
    body("lead = int64(cuda.blockIdx.z)")
    body(f"at = (lead * {R} + r) * {C} + c   # this block's table entry")
    for k in reversed(range(len(spec.leads))):   # the lead indices, the last fastest
        body(f"_l{k} = lead % {spec.leads[k]}")
        body(f"lead = lead // {spec.leads[k]}")
    if static:   # masked whatever the data: every thread of the block leaves before the barriers
        with body.block(f"if S[r * {C} + c] == 0.0:"):
            with body.block("if tid == 0:"):
                body(f"T[at] = {value(masked)}")
            body("return")
    if bounded:
        _emit_bounds(body, spec, threads, bounded, lambda x: x.to_code(leaf, fconst, fn_code), value(masked),
                     value(kept))
    body("some = False")
    body("every = True")
    body("e = tid")
    with body.block(f"while e < {spec.rows * spec.cols}:"):
        body(f"i = r * {spec.rows} + e // {spec.cols}")
        body(f"j = c * {spec.cols} + e % {spec.cols}")
        with body.block(f"if i < {spec.n_rows} and j < {spec.n_cols}:"):
            body(f"k = bool({keep})")
            body("some = some or k")
            body("every = every and k")
        body(f"e += {threads}")
    body("some = cuda.syncthreads_or(int32(some)) != 0")
    body("every = cuda.syncthreads_and(int32(every)) != 0")
    with body.block("if tid == 0:"):
        body(f"T[at] = ({value(kept)} if every else {value(partial)}) if some else {value(masked)}")
    head = [f'"""{name}: the block table {spec.name} of the mask {spec.expr} over blocks of '
            f'{spec.rows} x {spec.cols} (generated by napkin_cat.lowering.table_kernel; do not edit)."""',
            "", "import math", "", "from numba import cuda, float32, int16, int32, int64  # noqa: F401", "",
            *consts.header(), "", "", "@cuda.jit",
            f"def {name}(T, {', '.join(aux_vars[a] for a, _ in spec.aux)}{', S' if static else ''}):"]
    return "\n".join(head) + "\n" + body.text() + "\n"


class TableKernel:
    """The compiled kernel of one table, for auxiliary arrays of given shapes and dtypes."""

    def __init__(self, spec: DerivedTable, shapes: dict, threads: int):
        from .runtime import compile_kernel
        self.spec, self.shapes, self.threads = spec, shapes, threads
        self.static = static_table(spec)
        self.source = table_source(spec, shapes, threads, static=self.static is not None)
        self._static_on: dict = {}   # device index -> the static table there (a torch tensor)
        self.dispatcher = compile_kernel(self.source, "napkin_table")
        R, C = -(-spec.n_rows // spec.rows), -(-spec.n_cols // spec.cols)
        self.grid, self.shape = (C, R, math.prod(spec.leads)), (*spec.leads, R, C)
        self.checked = False
        self._launchers: dict = {}
        self._packed: dict = {}   # device index -> (PackedLaunch, the arguments' dtypes and sizes)

    def _launcher(self, key, stream):
        lc = self._launchers.get(key)
        if lc is None:
            from .runtime import Launcher
            lc = self._launchers[key] = Launcher(self.dispatcher, self.grid, self.threads, stream)
        return lc

    def torch(self, values: list):
        """The table of torch CUDA tensors ``values`` (the spec's auxiliary arrays, in order), on
        torch's current stream, in the table input's torch dtype."""
        import torch

        from .io import torch_dtype
        from .runtime import as_device_array, stream_from_torch
        flat = [(v if v.dtype not in (torch.float16, torch.bfloat16) else v.float()).contiguous().reshape(-1)
                for v in values]
        device = values[0].device
        out = torch.empty(self.shape, dtype=torch_dtype(self.spec.dtype, torch), device=device)
        view = (out if self.spec.dtype == "f32" else out.view(torch.int16)).reshape(-1)
        handle = int(torch.cuda.current_stream(device).cuda_stream)
        if self.static is not None:
            if device.index not in self._static_on:
                self._static_on[device.index] = torch.from_numpy(self.static).reshape(-1).to(device)
            flat.append(self._static_on[device.index])
        layout = tuple((v.dtype, v.numel()) for v in flat)
        packed = self._packed.get(device.index)
        # after the first launch: the packed driver launch (runtime.PackedLaunch), the addresses only
        if packed is not None and packed[1] == layout and packed[0]([view.data_ptr(), *(v.data_ptr() for v in flat)], handle):
            return out
        lc = self._launcher(handle, stream_from_torch() if handle else 0)
        args = (as_device_array(view), *map(as_device_array, flat))
        lc(*args)
        pack = lc.pack(args)
        if pack is not None:
            self._packed[device.index] = (pack, layout)
        return out

    def numpy(self, values: list):
        """The table of NumPy arrays ``values`` (the simulator's path; on a GPU, copied there
        and back), float32."""
        import numpy as np
        flat = [np.ascontiguousarray(np.asarray(v, dtype=np.float32 if v.dtype == np.float16 else v.dtype)).reshape(-1)
                for v in values]
        out = np.empty(math.prod(self.shape), np.int16 if self.spec.dtype != "f32" else np.float32)
        self._launcher(0, 0)(out, *flat, *(() if self.static is None else (self.static.reshape(-1),)))
        if self.spec.dtype == "f32":
            return out.reshape(self.shape)
        return np.select([out == _BITS[self.spec.dtype][2], out == _BITS[self.spec.dtype][1]],
                         [2.0, 1.0], 0.0).astype(np.float32).reshape(self.shape)


_COMPILED: OrderedDict = OrderedDict()
COMPILED = 64
"""Table kernels kept (by table spec and the auxiliary arrays' shapes and dtypes); the source
cache of :func:`~.runtime.compile_kernel` keeps their code beyond it."""


def table_kernel(spec: DerivedTable, arrays, threads: int | None = None) -> TableKernel:
    """The compiled kernel of ``spec`` for these arrays' shapes and dtypes (compiled once)."""
    from .runtime import simulator_active
    values = [arrays[k] for _, k in spec.aux]
    shapes = {a: tuple(v.shape) for (a, _), v in zip(spec.aux, values)}
    threads = threads or (SIM_THREADS if simulator_active() else GPU_THREADS)
    key = (id(spec), tuple(shapes.items()), tuple(str(v.dtype) for v in values), threads)
    found = _COMPILED.get(key)
    if found is None or found.spec is not spec:
        found = _COMPILED[key] = TableKernel(spec, shapes, threads)
        while len(_COMPILED) > COMPILED:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(key)
    return found


def make_table(spec: DerivedTable, arrays):
    """``spec``'s table of torch CUDA tensors by its generated kernel; the first table of each
    compiled kernel is checked against :meth:`DerivedTable.values` on the same data."""
    k = table_kernel(spec, arrays)
    table = k.torch([arrays[p] for _, p in spec.aux])
    if not k.checked:
        import torch
        want = spec.values(arrays)
        if not torch.equal(table.float(), want.float()):
            bad = (table.float() != want.float()).nonzero()[:3].tolist()
            raise LoweringError(f"block table {spec.name}: the generated table kernel disagrees with the mask's torch "
                                f"meaning ({spec.expr}) at blocks {bad}; source:\n{k.source}")
        k.checked = True
    return table
