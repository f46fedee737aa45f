"""How many entries of its auxiliary tensors an index expression can read over a tile or
chunk: interval arithmetic on the gathers' indices (:meth:`.index_expr.Ix.footprint`), which the
cost model counts as moved instead of the whole tensor (:mod:`napkin_cat.costmodel.model`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def footprint(e, widths: dict) -> dict[str, object]:
    """``{aux name: entries}``: how many entries of each auxiliary tensor the expression can
    read while each index leaf ``n`` runs over ``widths[n]`` consecutive values (ints or
    sympy expressions; a leaf not in ``widths`` may take any value).  Per gather, the
    product over the tensor's axes of the span of the index there (interval arithmetic:
    ``+ - *`` by constants, ``//`` and ``%`` by positive constants, ``abs``, ``min`` /
    ``max``), capped at the axis; an index it cannot bound spans the whole axis.  The
    gathers of one tensor add up, capped at its size: an upper bound on the entries a
    tile or chunk reads, which :mod:`napkin_cat.costmodel` counts as moved.

    >>> from .index_expr import Aux, Ix
    >>> doc = Aux("doc", (_Axis("n", 4096),))
    >>> i, j = Ix("idx", (), "q"), Ix("idx", (), "x")
    >>> (doc[i] == doc[j]).footprint({"q": 64, "x": 32})
    {'doc': 96}
    >>> bm = Aux("bm", (_Axis("r", 1024), _Axis("c", 1024)))
    >>> (bm[i // 4, j // 4] > 0).footprint({"q": 64, "x": 64})
    {'bm': 289}
    """
    out: dict[str, object] = {}
    for n in e.walk():
        if n.op != "gather":
            continue
        entries = 1
        for a, k in zip(n.value.axes, n.args):
            w = _span(k, widths)
            entries *= a.size if w is None else _least(w, a.size)
        whole = math.prod(a.size for a in n.value.axes)
        out[n.value.name] = _least(out.get(n.value.name, 0) + entries, whole)
    return out


@dataclass(frozen=True)
class _Axis:   # a stand-in for doctests: what footprint reads of an axis
    name: str
    size: int


def _least(a, b):
    """min of two spans (ints, or sympy expressions: then sympy's Min)."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    import sympy
    return sympy.Min(a, b)


def _span(k: Ix, widths: dict):
    """How many consecutive integers integer expression ``k`` can cover while each leaf ``n``
    covers ``widths[n]``; None where it cannot be bounded this way."""
    op, a = k.op, k.args
    if op == "idx":
        return widths.get(k.value)
    if op == "size" or op == "const" and isinstance(k.value, int):
        return 1
    if op in ("neg", "abs"):
        return _span(a[0], widths)
    if op in ("add", "sub", "min", "max"):
        x, y = _span(a[0], widths), _span(a[1], widths)
        if x is None or y is None:
            return None
        return x + y - 1 if op in ("add", "sub") else _most(x, y)
    const = a[1] if len(a) == 2 and a[1].op == "const" and isinstance(a[1].value, int) else None
    if op == "mul":
        c, e = (a[1], a[0]) if const is not None else (a[0], a[1])
        if c.op != "const" or not isinstance(c.value, int):
            return None
        x = _span(e, widths)
        return None if x is None else (x - 1) * abs(c.value) + 1
    if op in ("floordiv", "mod") and const is not None and const.value > 0:
        x = _span(a[0], widths)
        if x is None:
            return const.value if op == "mod" else None
        # [lo, lo + x - 1] // c covers at most ceil((x - 1) / c) + 1 values
        return -((1 - x) // const.value) + 1 if op == "floordiv" else _least(x, const.value)
    return None


def _most(a, b):
    """max of two spans (ints, or sympy expressions: then sympy's Max)."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    import sympy
    return sympy.Max(a, b)
