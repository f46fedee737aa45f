"""Values of a micro-tile's column alone, computed once per column: an emitter pass.

A micro-tile's element loops run ``for i`` (rows) then ``for j`` (columns).  A value without the
column axis is already computed once per row (:class:`~.source.RowHoist`).  A value without the
row axis (the attention backward's ``L`` and ``D`` in the dK, dV kernel, where keys are the
fragments' rows and queries their columns; ``max(L, lowest)``) was computed once per element;
here it is computed once per column of the thread, before the row loop, into a register array
indexed by the unrolled column loop's ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import LoweringError
from .plan import Micro
from .source import Source

COLUMN_VALUES = True
"""Compute values of a micro-tile's column alone once per column (False: once per element, as
until the fourth session of 2026-11-25).  Measured on an H100: kernels/BENCHMARKS.md, "Fourth
session of 2026-11-25"."""


@dataclass
class ColumnHoist:
    """Where a micro-tile's element loops put values of its column alone (``env["_colhoist"]``):
    a slot before the row loop, filled on first use with one loop over the thread's columns."""
    pre: Source
    row: str
    col: str
    count: str               # the thread's columns, a uint32 constant (the element loop's trip count)
    size: int                # the same, a literal (a register array's length)
    cols: object             # j (an expression) -> the local column index expression
    memo: dict = field(default_factory=dict)      # var -> its array entry at ``j``
    inner: dict = field(default_factory=dict)     # var -> its value inside the column loop
    decl: Source | None = None
    body: Source | None = None
    index: str | None = None

    def open(self, names) -> None:
        """The column loop, written into :attr:`pre` on first use."""
        if self.body is not None:
            return
        self.decl = self.pre.slot()
        with self.pre.block(f"for j in range({self.count}):"):
            self.index = names.fresh("i_col")
            self.pre(f"{self.index} = {self.cols('j')}")
            self.body = self.pre.slot()


BEFORE_WAIT = 8
"""Compute them before the wait for the warpgroup contraction whose epilogue reads them where it
has at least this many steps of 16 (:func:`.issue_ahead.columns_before_wait`), not after it: the
wait is an ``asm volatile`` with a memory clobber, which the compiler moves no load across.  On an
H200 (kernels/BENCHMARKS.md, "Sixth session of 2026-11-30"), the one-kernel backward at d = 128
(8 steps) 1.867 ms against 1.885 (a text edit, 1.854 against 1.906), at d = 64 (4 steps) 0.995
against 0.967 (0.985 against 1.002).  0: after the wait, as until then."""


def column_hoist(em, m: Micro, src: Source) -> ColumnHoist | None:
    """The place for values of a column alone, before a micro-tile's row loop, or before the
    wait of the warpgroup contraction just issued on ``m`` (:data:`BEFORE_WAIT`); None with one
    row or column per thread, or under :data:`COLUMN_VALUES` off."""
    pending, em.columns_slot = em.columns_slot, None
    if not COLUMN_VALUES or m.RY < 2 or m.RX < 2:
        return None
    pre = pending[1] if pending is not None and pending[0] is m else src.slot()
    return ColumnHoist(pre, m.row, m.col, em.consts.u(m.RX), m.RX, lambda j: em.micro_cols(m, j))


def column_value(em, v: int, env: dict, col: ColumnHoist, define: int | None) -> str | None:
    """Variable ``v``, a float of the micro-tile's column alone, as its entry in a register array
    computed once per column before the row loop; None where ``v`` has the row axis, or reads
    something only an element can (a register tile, an index of the element): then the emitter
    computes it per element as before (:meth:`.emit.Emitter.value`)."""
    arr = em.types[v]
    if v == define or col.row in arr.axis_names or col.col not in arr.axis_names \
            or arr.dtype.name not in ("f32", "f16", "bf16"):
        return None
    if v in col.memo:
        return col.memo[v]
    col.open(em.names)
    env2 = {a: e for a, e in env.items() if not a.startswith("_") and a != col.row}
    env2[col.col] = col.index
    tmp, inner = Source(col.body.depth), dict(col.inner)
    try:
        expr = em.value(v, env2, tmp, inner, None, define)
    except (KeyError, LoweringError):
        return None
    name = em.names.fresh(f"{arr.name}_cols")
    col.decl(f"{name} = cuda.local.array({col.size}, float32)  # {arr.name} per column of this thread")
    col.body._items.extend(tmp._items)
    col.body(f"{name}[j] = {expr}")
    col.inner.update(inner)
    col.memo[v] = f"{name}[j]"
    return col.memo[v]
