"""Bounds of a mask over a block, as index expressions: what a table kernel evaluates per block
before it evaluates any entry (:mod:`napkin_cat.lowering.table_kernel`).

:func:`block_bounds` rewrites a mask ``e`` over ``i``, ``j`` into three expressions over the
block's index ranges (``i_lo``, ``i_hi``, ``j_lo``, ``j_hi``) and the least and greatest value of
each gather over them (float leaves ``_g{k}_lo``, ``_g{k}_hi``): ``may`` (some entry of the block
can be kept), ``must`` (every entry is kept) and ``unknown`` (a bound is NaN: nothing is claimed).
These expressions are the one definition of the bounds: the host evaluates them over arrays of
every block at once (:func:`napkin_cat.ops.derived_tables.interval_table`, NumPy or torch), a table
kernel per block with the mask's own code (:meth:`Ix.to_code`) in its float32 arithmetic.  Each
rounded operation is monotone in each argument, so a block is called masked (kept) only where
every entry is.  Blocks neither rule decides are partial on the host and evaluated entry by entry
in the kernel.

An operation without a rule (``exp2``, a gather of an index expression, division by data) raises
:class:`NoBounds`: the kernel then evaluates every block's entries.
"""

from __future__ import annotations

from .index_expr import COMPARISONS, Ix


class NoBounds(Exception):
    """An operation :func:`block_bounds` has no rule for."""


def _leaf(name: str, floating: bool = False) -> Ix:
    return Ix("idx", (), ("float", name) if floating else name)


def _c(v) -> Ix:
    return Ix("const", (), v)


def _min(a: Ix, b: Ix) -> Ix:
    return Ix("min", (a, b))


def _max(a: Ix, b: Ix) -> Ix:
    return Ix("max", (a, b))


def _where(c: Ix, a: Ix, b: Ix) -> Ix:
    return Ix("where", (c, a, b))


def _not(c: Ix) -> Ix:
    return Ix("invert", (c,))


class _Bounds:
    def __init__(self):
        self.gathers: list[Ix] = []     # the gather nodes bounded, in order: leaf k is gathers[k]
        self.floats: list[Ix] = []      # float bounds, checked for NaN

    @staticmethod
    def scalar(e: Ix) -> bool:
        return all(n.op != "gather" and not (n.op == "idx" and n.value in ("i", "j")) for n in e.walk())

    def value(self, e: Ix) -> tuple[Ix, Ix]:
        lo, hi = self._value(e)
        if e.dtype == "float" and not self.scalar(e):
            self.floats += [lo, hi]
        return lo, hi

    def _value(self, e: Ix):
        op, a = e.op, e.args
        if self.scalar(e):
            return e, e
        if op == "idx":
            return _leaf(f"{e.value}_lo"), _leaf(f"{e.value}_hi")
        if op == "gather":
            free = [k for k in a if not self.scalar(k)]
            if not free:   # one entry for the whole block (a window of each head, w[h])
                return e, e
            if len(free) != 1 or not (free[0].op == "idx" and free[0].value in ("i", "j")):
                raise NoBounds("gather")
            for k, g in enumerate(self.gathers):
                if g.same(e):
                    break
            else:
                k = len(self.gathers)
                self.gathers.append(e)
            return _leaf(f"_g{k}_lo", True), _leaf(f"_g{k}_hi", True)
        if op in ("add", "sub", "mul", "min", "max"):
            (al, ah), (bl, bh) = self.value(a[0]), self.value(a[1])
            if op == "add":
                return al + bl, ah + bh
            if op == "sub":
                return al - bh, ah - bl
            if op in ("min", "max"):
                f = _min if op == "min" else _max
                return f(al, bl), f(ah, bh)
            ends = [x * y for x in (al, ah) for y in (bl, bh)]
            lo = hi = ends[0]
            for v in ends[1:]:
                lo, hi = _min(lo, v), _max(hi, v)
            return lo, hi
        if op == "neg":
            lo, hi = self.value(a[0])
            return -hi, -lo
        if op == "abs":
            lo, hi = self.value(a[0])
            return (_where(lo >= 0, lo, _where(hi <= 0, -hi, _c(0))), _where(lo >= 0, hi, _max(-lo, hi)))
        if op in ("floordiv", "mod") and (a[1].op == "size" or a[1].op == "const" and isinstance(
                a[1].value, (int, float)) and not isinstance(a[1].value, bool) and a[1].value > 0):   # k > 0
            k = a[1]
            lo, hi = self.value(a[0])
            if op == "floordiv":   # monotone for a positive divisor
                return lo // k, hi // k
            one = (lo // k) == (hi // k)   # within one period: monotone there
            return _where(one, lo % k, _c(0)), _where(one, hi % k, k - 1)
        if op == "where":
            may, must = self.cond(a[0])
            (bl, bh), (cl, ch) = self.value(a[1]), self.value(a[2])
            return (_where(must, bl, _where(_not(may), cl, _min(bl, cl))),
                    _where(must, bh, _where(_not(may), ch, _max(bh, ch))))
        raise NoBounds(op)

    def cond(self, e: Ix) -> tuple[Ix, Ix]:
        op, a = e.op, e.args
        if self.scalar(e):
            return e, e
        if op in ("and", "or") and e.dtype == "bool":
            (am, au), (bm, bu) = self.cond(a[0]), self.cond(a[1])
            return (am & bm, au & bu) if op == "and" else (am | bm, au | bu)
        if op == "invert" and e.dtype == "bool":
            may, must = self.cond(a[0])
            return _not(must), _not(may)
        if op in COMPARISONS:
            if op in ("gt", "ge"):   # b < a, b <= a
                op, a = {"gt": "lt", "ge": "le"}[op], (a[1], a[0])
            (al, ah), (bl, bh) = self.value(a[0]), self.value(a[1])
            if op == "lt":
                return al < bh, ah < bl
            if op == "le":
                return al <= bh, ah <= bl
            meet = (al <= bh) & (bl <= ah)
            same = (al == ah) & (bl == bh) & (al == bl)
            return (meet, same) if op == "eq" else (_not(same), _not(meet))
        raise NoBounds(op)


def block_bounds(e: Ix) -> tuple[Ix, Ix, Ix, tuple[Ix, ...]]:
    """``(may, must, unknown, gathers)`` of mask ``e`` over a block (module docstring): the
    ``k``-th gather's least and greatest values over the block are the leaves ``_g{k}_lo`` and
    ``_g{k}_hi``; raises :class:`NoBounds` where an operation has no rule."""
    b = _Bounds()
    may, must = b.cond(e)
    unknown = _c(False)
    for v in b.floats:
        unknown = unknown | (v != v)
    return may, must, unknown, tuple(b.gathers)


def bounds_or_none(e: Ix):
    """:func:`block_bounds` of ``e``, or None where an operation has no rule."""
    try:
        return block_bounds(e)
    except NoBounds:
        return None
