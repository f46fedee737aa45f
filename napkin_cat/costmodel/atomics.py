"""The cost of outputs summed across blocks (``tile(axis, size, partial="sum")``).

An output that the blocks of a split axis add into (an :class:`~napkin_cat.relabel.split.AddStore`)
costs, per block and per execution, a read-modify-write of its partial at the level it is added
into: fp32 atomics, so the values read and written are counted as fp32 whatever the output's
dtype, one ``fma`` per value added; and once per launch the zero-fill of the whole output
(the launcher's, before the kernel runs).  :func:`napkin_cat.cost` adds these records beside
the store of every other output, so that a one-kernel form with atomics compares with a
two-kernel one on the same terms.

>>> import napkin_cat as nc
>>> a, b, c = nc.axes("a b c")
>>> split = nc.cost(nc.library.matmul(a=a, b=b, c=c).tile(b, "g_b", partial="sum").tile(a, "g_a"))
>>> split.transfers["HBM"] - nc.cost(nc.library.matmul(a=a, b=b, c=c).tile(a, "g_a")).transfers["HBM"]
2*a*b*c/g_b
"""

from __future__ import annotations

import sympy as sp

from ..core.diagram import f32
from ..relabel.split import AddStore
from .records import Move, Op
from ..relabel.symbols import size_expr


def add_store_records(ff, node: AddStore, buffer, execs, loops) -> tuple[list[Move], list[Op]]:
    """The read-modify-write of one :class:`AddStore` (``buffer``: its partial at ``node.level``;
    ``execs``: (executions, executions rounding ragged repeats up))."""
    name = ff.diagram.var_types()[node.var].name
    n, r = execs
    axes_ = tuple(lp.axis for lp in loops)
    moves = [Move("atomic read", name, f32, node.dst, node.level, buffer.size, n, r, axes_),
             Move("atomic write", name, f32, node.dst, node.level, buffer.size, n, r, axes_)]
    ops = [Op("fma", buffer.size, n, f"atomic add into {name}", f"add {name}", ((name, f32),), axes_)]
    return moves, ops


def zero_fill_moves(ff) -> list[Move]:
    """One write of every output summed across blocks, at the top level, before the launch."""
    dd = ff.diagram
    types = dd.var_types()
    top = ff.hierarchy.top
    seen, out = set(), []
    for n, _ in ff.walk():
        if isinstance(n, AddStore) and n.var not in seen:
            seen.add(n.var)
            arr = types[n.var]
            size = sp.Mul(*(size_expr(dd.axis(a).size) for a in arr.axis_names))
            out.append(Move("zero-fill", arr.name, f32, top, n.level, size, sp.Integer(1), sp.Integer(1), ()))
    return out
