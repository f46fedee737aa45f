"""Block sparsity derived from a mask's definition: the columns a block of rows can keep.

:func:`support` reads an index expression (:mod:`.index_expr`) over the algebra of
:mod:`napkin_cat.ops.index` (ints for the tiled executor, sympy for the cost model, code for
the kernel's chunk bounds): comparisons linear in ``(i, j)`` (``j <= i + c``, ``i - j < w``,
``abs(i - j) <= w``, ``j < P``), blocks ``i // b == j // b``, joined by ``&`` (intersection),
``|`` (hull) and ``~`` (pushed onto the comparisons); the same comparisons of the block
quotients ``i // b`` and ``j // b`` (block-causal, NATTEN's ``abs(i // W - j // W) <= K``)
bound whole blocks of ``b`` columns.  Anything else (a gather, a head index,
a non-linear term) may keep every column: the bound stays open and nothing is skipped.
:func:`keeps_neg_inf` says whether a score modification keeps a masked score masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .index_expr import COMPARISONS, NEG_INF, Ix

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}


def linear(e: Ix) -> dict | None:
    """``e`` as ``{leaf: int coefficient, 1: constant}`` when it is an integer-linear
    combination of ``idx`` leaves; None otherwise."""
    if e.op == "idx" and e.value != "score":
        return {e.value: 1}
    if e.op == "const" and isinstance(e.value, int) and not isinstance(e.value, bool):
        return {1: e.value}
    if e.op in ("add", "sub"):
        a, b = linear(e.args[0]), linear(e.args[1])
        if a is None or b is None:
            return None
        s = 1 if e.op == "add" else -1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + s * v
        return out
    if e.op == "neg":
        a = linear(e.args[0])
        return None if a is None else {k: -v for k, v in a.items()}
    if e.op == "mul":
        a, b = linear(e.args[0]), linear(e.args[1])
        if a is None or b is None:
            return None
        for x, y in ((a, b), (b, a)):
            if set(y) <= {1}:
                return {k: v * y.get(1, 0) for k, v in x.items()}
    return None


def support(e: Ix, r0, r1, al, i: str = "i", j: str = "j"):
    """``(lo, hi)`` with ``lo <= j < hi`` for every ``(i, j)`` that ``e`` keeps with ``i`` in
    ``[r0, r1)``, over the algebra ``al``; ``hi`` None when nothing bounds it from above."""
    return _sup(e, r0, r1, al, i, j, False)


def _sup(e, r0, r1, al, i, j, neg):
    op = e.op
    if op == "const" and isinstance(e.value, bool):
        return (0, 0) if e.value == neg else (0, None)
    if op == "invert" and e.dtype == "bool":
        return _sup(e.args[0], r0, r1, al, i, j, not neg)
    if op in ("and", "or") and e.dtype == "bool":
        a = _sup(e.args[0], r0, r1, al, i, j, neg)
        b = _sup(e.args[1], r0, r1, al, i, j, neg)
        conj = (op == "and") != neg
        return _meet(a, b, al) if conj else _hull(a, b, al)
    if op in COMPARISONS:
        cmp = _NEGATE[op] if neg else op
        return _compare(cmp, e.args[0], e.args[1], r0, r1, al, i, j)
    return (0, None)


def _meet(a, b, al):
    lo = b[0] if a[0] == 0 else a[0] if b[0] == 0 else al.max(a[0], b[0])
    hi = b[1] if a[1] is None else a[1] if b[1] is None else al.min(a[1], b[1])
    return lo, hi


def _hull(a, b, al):
    if a == (0, 0):
        return b
    if b == (0, 0):
        return a
    lo = 0 if a[0] == 0 or b[0] == 0 else al.min(a[0], b[0])
    hi = None if a[1] is None or b[1] is None else al.max(a[1], b[1])
    return lo, hi


def _compare(cmp, x, y, r0, r1, al, i, j):
    # |u| <= w (w >= 0 a constant) is -w <= u <= w
    for p, q, c in ((x, y, cmp), (y, x, _FLIP[cmp])):
        if p.op == "abs" and c in ("le", "lt") and linear(q) is not None and set(linear(q)) <= {1}:
            u = p.args[0]
            return _meet(_compare(c, u, q, r0, r1, al, i, j), _compare(c, -u, q, r0, r1, al, i, j), al)
    # i // b == j // b (a block of b positions)
    if cmp == "eq" and x.op == "floordiv" and y.op == "floordiv":
        kx, ky = linear(x.args[1]), linear(y.args[1])
        if kx and ky and set(kx) == {1} == set(ky) and kx[1] == ky[1] and kx[1] > 0:
            bsz = kx[1]
            names = {(x.args[0].op, x.args[0].value), (y.args[0].op, y.args[0].value)}
            if names == {("idx", i), ("idx", j)}:
                return r0 // bsz * bsz, (r1 + (bsz - 1)) // bsz * bsz
    blocks = _quotients(x, y, i, j)
    if blocks is not None:    # linear in i // b and j // b: bounds on blocks of b columns
        xq, yq, bsz = blocks
        lo, hi = _compare(cmp, xq, yq, r0 // bsz, (r1 + (bsz - 1)) // bsz, al, _QI, _QJ)
        return lo * bsz, None if hi is None else hi * bsz
    norm = _normalize(cmp, x, y, i, j)
    if norm is None:
        return (0, None)
    cmp, k, m = norm
    lo = hi = None
    if cmp in ("le", "eq"):     # j <= k i + m: the largest over the rows, plus one
        hi = _affine(r1, k, m + 1 - k, al) if k else max(m + 1, 0)
    if cmp in ("ge", "eq"):     # j >= k i + m: the smallest over the rows
        lo = _affine(r0, k, m, al) if k else max(m, 0)
    return (0 if lo is None else lo), hi


_QI, _QJ = "i // b", "j // b"   # the block quotients' leaves (names no diagram axis has)


def _quotients(x, y, i: str, j: str):
    """``(x', y', b)``: ``x`` and ``y`` with every ``i // b`` and ``j // b`` (one constant ``b >
    0``) as the leaves :data:`_QI`, :data:`_QJ`, where ``i`` and ``j`` appear only so and ``j``
    does (block-causal ``i // b >= j // b``, neighbourhoods ``abs(i // W - j // W) <= K``);
    None otherwise.  A comparison linear in the quotients bounds blocks of ``b`` columns."""
    found: set[int] = set()

    def sub(e):
        if e.op == "floordiv" and e.args[0].op == "idx" and e.args[0].value in (i, j):
            k = e.args[1]
            if k.op != "const" or not isinstance(k.value, int) or isinstance(k.value, bool) or k.value <= 0:
                return None
            found.add(k.value)
            return Ix("idx", (), _QI if e.args[0].value == i else _QJ)
        if e.op == "idx" and e.value in (i, j):
            return None
        args = []
        for a in e.args:
            a2 = sub(a)
            if a2 is None:
                return None
            args.append(a2)
        return Ix(e.op, tuple(args), e.value)

    xq, yq = sub(x), sub(y)
    if xq is None or yq is None or len(found) != 1:
        return None
    if not any(n.op == "idx" and n.value == _QJ for t in (xq, yq) for n in t.walk()):
        return None
    return xq, yq, found.pop()


def _normalize(cmp, x, y, i, j):
    """``x (cmp) y`` as ``j (cmp) k i + m`` with ``k >= 0`` and ``cmp`` in ``le ge eq``; None
    when it is not of that form (not linear, ``j`` scaled, ``k < 0``, ``!=``)."""
    lx, ly = linear(x), linear(y)
    if lx is None or ly is None:
        return None
    d = dict(lx)
    for k, v in ly.items():
        d[k] = d.get(k, 0) - v          # d(i, j) = x - y  (cmp) 0
    if set(d) - {i, j, 1}:
        return None
    cj, ci, c = d.get(j, 0), d.get(i, 0), d.get(1, 0)
    if cj == 0:
        return None
    if cj < 0:
        cj, ci, c, cmp = -cj, -ci, -c, _FLIP[cmp]
    if cj != 1:
        return None
    # j (cmp) -ci * i - c  =  k i + m
    k, m = -ci, -c
    if k < 0:
        return None
    if cmp == "lt":
        cmp, m = "le", m - 1
    elif cmp == "gt":
        cmp, m = "ge", m + 1
    if cmp == "ne":
        return None
    return cmp, k, m


def _affine(r, k, m, al):
    """``max(k r + m, 0)`` over the algebra (``k >= 1``)."""
    base = r if k == 1 else r * k
    return base + m if m >= 0 else al.sat_sub(base, -m)


# --------------------------------------------------------------------------- chunk states

@dataclass(frozen=True)
class BlockAtom:
    """A comparison ``table[i // rows, j // cols] (cmp) c``: constant on each block of
    ``rows x cols`` entries, so a block table (:mod:`.block_table`, or an explicit block mask)
    says per block whether it holds; its value is data, known when the kernel runs.  A table of
    each batch or head (``table[b, i // rows, j // cols]``) has its leading indices in ``lead``:
    the index expressions that select its slice, over indices other than the rows' and
    columns' (``b``; or under grouped-query heads the query head ``h * G + g``); a kernel reads
    them where a block holds one index of each axis they read."""

    table: object       # the Aux gathered from
    rows: int
    cols: int
    cmp: str
    c: object
    lead: tuple = field(default=(), compare=False)   # of Ix (whose == builds a comparison)

    def holds(self, v) -> bool:
        return _PYCMP[self.cmp](v, self.c)


_PYCMP = {"lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
          "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b}


def _block_of(k: Ix, name: str):
    """``b`` when ``k`` is ``name // b`` (``1`` for ``name`` itself), else None."""
    if k.op == "idx" and k.value == name:
        return 1
    if k.op == "floordiv" and k.args[0].op == "idx" and k.args[0].value == name:
        lk = linear(k.args[1])
        if lk and set(lk) == {1} and lk[1] > 0:
            return lk[1]
    return None


_LEAD_OPS = frozenset({"idx", "size", "const", "add", "sub", "mul"})


def _lead_index(k: Ix, exclude: tuple) -> bool:
    """Whether ``k`` can select a block table's slice: integer arithmetic (+ - *) of indices
    other than ``exclude`` (the rows', the columns', the score), sizes and constants."""
    return (k.dtype == "int" and all(n.op in _LEAD_OPS for n in k.walk())
            and all(isinstance(n, str) and n not in exclude for n in k.leaves("idx")))


def block_atom(cmp: str, x: Ix, y: Ix, i: str = "i", j: str = "j") -> BlockAtom | None:
    """``x (cmp) y`` as a :class:`BlockAtom`, or None."""
    for g, c, op in ((x, y, cmp), (y, x, _FLIP[cmp])):
        if g.op == "gather" and len(g.args) >= 2 and c.op == "const" and not isinstance(c.value, bool):
            *lead, ri, ci = g.args
            if not all(_lead_index(k, (i, j, "score")) for k in lead):
                continue
            bq, bk = _block_of(ri, i), _block_of(ci, j)
            if bq and bk:
                return BlockAtom(g.value, bq, bk, op, c.value, tuple(lead))
    return None


def block_atoms(e: Ix, i: str = "i", j: str = "j") -> tuple[BlockAtom, ...]:
    """The block atoms of a mask (data-dependent block skipping applies when there are any)."""
    out = []
    for n in e.walk():
        if n.op in COMPARISONS:
            a = block_atom(n.op, n.args[0], n.args[1], i, j)
            if a is not None and a not in out:
                out.append(a)
    return tuple(out)


def with_atoms(e: Ix, value, i: str = "i", j: str = "j") -> Ix:
    """``e`` with each block-table comparison (:func:`block_atom`) whose value ``value(atom)``
    gives (True or False; None where it is not known) replaced by that value, and folded
    (:func:`fold`): what is left of a mask over rows and columns whose table entries are known.
    The kernels write a chunk's elements so (``lowering/unswitch.py``) and the cost model counts
    their operations so (``costmodel/skips.py``)."""
    def sub(n: Ix) -> Ix:
        if n.op in COMPARISONS:
            at = block_atom(n.op, n.args[0], n.args[1], i, j)
            v = None if at is None else value(at)
            if v is not None:
                return Ix("const", (), bool(v))
        if not n.args:
            return n
        return Ix(n.op, tuple(sub(a) for a in n.args), n.value)
    return fold(sub(e))


def fold(e: Ix) -> Ix:
    """``e`` with boolean constants folded: ``True | x`` is ``True``, ``False & x`` is ``False``,
    ``True & x`` is ``x``, ``~True`` is ``False``, ``where(True, x, y)`` is ``x``, and a
    conjunction or disjunction that names one operand twice keeps it once."""
    if not e.args:
        return e
    args = tuple(fold(a) for a in e.args)
    const = lambda a: a.op == "const" and isinstance(a.value, bool)
    if e.op == "invert" and const(args[0]):
        return Ix("const", (), not args[0].value)
    if e.op == "where" and const(args[0]):
        return args[1] if args[0].value else args[2]
    if e.op in ("and", "or") and all(a.dtype == "bool" for a in args):
        absorbing = e.op == "or"       # True absorbs a disjunction, False a conjunction
        terms: list[Ix] = []
        for a in args:
            for t in _terms(a, e.op):
                if const(t):
                    if t.value == absorbing:
                        return Ix("const", (), absorbing)
                    continue
                if not any(t.same(u) for u in terms):
                    terms.append(t)
        if not terms:
            return Ix("const", (), not absorbing)
        out = terms[0]
        for t in terms[1:]:
            out = Ix(e.op, (out, t))
        return out
    return Ix(e.op, args, e.value)


def _terms(e: Ix, op: str) -> list[Ix]:
    """The operands of a chain of ``op`` (``and`` / ``or``) rooted at ``e``."""
    if e.op == op and e.dtype == "bool":
        return [t for a in e.args for t in _terms(a, op)]
    return [e]


class BoolLogic:
    """:func:`chunk_state` on Python values: bounds over :class:`~.index.IntAlgebra`."""

    @staticmethod
    def le(a, b):
        return a <= b

    @staticmethod
    def and_(a, b):
        return a and b

    @staticmethod
    def or_(a, b):
        return a or b


def chunk_state(e: Ix, r0, r1, c0, c1, al, lg, atom, i: str = "i", j: str = "j"):
    """``(full, empty)`` for the rows ``[r0, r1)`` and columns ``[c0, c1)``: ``full`` when the
    mask ``e`` keeps every entry, ``empty`` when it keeps none, each True, False or (over a
    code logic ``lg``) a condition to test when the kernel runs.  Both False means partial (or
    not known).  A three-valued reading of ``e``: ``&`` / ``|`` combine the atoms' states
    (Kleene), ``~`` is pushed onto them; a comparison linear in ``(i, j)`` is full when the
    chunk lies inside the columns every row keeps (:func:`kept`) and empty when it misses the
    support; a :class:`BlockAtom` asks ``atom(block_atom) -> (full, empty)`` (the table's
    entries over the chunk); anything else is neither."""
    return _state(e, (r0, r1, c0, c1), al, lg, atom, i, j, False)


def _state(e, box, al, lg, atom, i, j, neg):
    op = e.op
    if op == "const" and isinstance(e.value, bool):
        keep = e.value != neg
        return keep, not keep
    if op == "invert" and e.dtype == "bool":
        return _state(e.args[0], box, al, lg, atom, i, j, not neg)
    if op in ("and", "or") and e.dtype == "bool":
        fa, ea = _state(e.args[0], box, al, lg, atom, i, j, neg)
        fb, eb = _state(e.args[1], box, al, lg, atom, i, j, neg)
        if (op == "and") != neg:
            return _and(lg, fa, fb), _or(lg, ea, eb)
        return _or(lg, fa, fb), _and(lg, ea, eb)
    if op in COMPARISONS:
        cmp = _NEGATE[op] if neg else op
        a = block_atom(cmp, e.args[0], e.args[1], i, j)
        if a is not None:
            return atom(a)
        r0, r1, c0, c1 = box
        klo, khi = _kept_compare(cmp, e.args[0], e.args[1], r0, r1, al, i, j)
        slo, shi = _compare(cmp, e.args[0], e.args[1], r0, r1, al, i, j)
        full = False if _zero(khi) else _and(
            lg, True if _zero(klo) else lg.le(klo, c0), True if khi is None else lg.le(c1, khi))
        empty = _or(lg, False if shi is None else True if _zero(shi) else lg.le(shi, c0),
                    False if _zero(slo) else lg.le(c1, slo))
        return full, empty
    return False, False


def _zero(v) -> bool:
    return isinstance(v, int) and v == 0


def _and(lg, a, b):
    if a is False or b is False:
        return False
    return b if a is True else a if b is True else lg.and_(a, b)


def _or(lg, a, b):
    if a is True or b is True:
        return True
    return b if a is False else a if b is False else lg.or_(a, b)


def kept(e: Ix, r0, r1, al, i: str = "i", j: str = "j"):
    """For a comparison ``e``: ``(lo, hi)``, the columns ``lo <= j < hi`` that every row in
    ``[r0, r1)`` keeps (``hi`` None: no end; ``(0, 0)``: none known)."""
    if e.op not in COMPARISONS:
        return 0, 0
    return _kept_compare(e.op, e.args[0], e.args[1], r0, r1, al, i, j)


def _kept_compare(cmp, x, y, r0, r1, al, i, j):
    for p, q, c in ((x, y, cmp), (y, x, _FLIP[cmp])):
        if p.op == "abs" and c in ("le", "lt") and linear(q) is not None and set(linear(q)) <= {1}:
            u = p.args[0]
            a = _kept_compare(c, u, q, r0, r1, al, i, j)
            b = _kept_compare(c, -u, q, r0, r1, al, i, j)
            if _zero(a[1]) or _zero(b[1]):
                return 0, 0
            return _meet(a, b, al)
    if cmp == "eq" and x.op == "floordiv" and y.op == "floordiv":
        kx, ky = linear(x.args[1]), linear(y.args[1])
        if kx and ky and set(kx) == {1} == set(ky) and kx[1] == ky[1] and kx[1] > 0:
            bsz = kx[1]
            names = {(x.args[0].op, x.args[0].value), (y.args[0].op, y.args[0].value)}
            if names == {("idx", i), ("idx", j)}:
                # every row in one block: that block; rows in two blocks: an empty range
                return al.sat_sub(r1, 1) // bsz * bsz, r0 // bsz * bsz + bsz
    blocks = _quotients(x, y, i, j)
    if blocks is not None:    # the blocks of b columns every block of b rows in [r0, r1) keeps
        xq, yq, bsz = blocks
        lo, hi = _kept_compare(cmp, xq, yq, r0 // bsz, (r1 + (bsz - 1)) // bsz, al, _QI, _QJ)
        return lo * bsz, None if hi is None else hi * bsz
    norm = _normalize(cmp, x, y, i, j)
    if norm is None:
        return 0, 0
    cmp, k, m = norm
    lo, hi = 0, None
    if cmp in ("le", "eq"):     # j <= k i + m for every row: up to the first row's bound
        hi = _affine(r0, k, m + 1, al) if k else max(m + 1, 0)
    if cmp in ("ge", "eq"):     # j >= k i + m for every row: from the last row's bound
        lo = _affine(r1, k, m - k, al) if k else max(m, 0)
    return lo, hi


def keeps_neg_inf(e: Ix) -> bool:
    """``e`` (a score modification) maps a score of ``-inf`` to ``-inf`` and is increasing in
    the score: a mask applied before it stays a mask (conservative: a sum with a score-free
    term, a positive scale, a where keeping ``-inf``)."""
    if e.op == "idx" and e.value == "score":
        return True
    if not e.uses_score():
        return False
    if e.op in ("add", "sub"):
        a, b = e.args
        if e.op == "add" and not a.uses_score():
            a, b = b, a
        return keeps_neg_inf(a) and not b.uses_score() and not _can_be_inf(b)
    if e.op in ("mul", "truediv"):
        a, b = e.args
        if e.op == "mul" and not a.uses_score():
            a, b = b, a
        return keeps_neg_inf(a) and b.op == "const" and float(b.value) > 0
    if e.op == "where":
        return all(keeps_neg_inf(x) or (x.op == "const" and x.value == NEG_INF) for x in e.args[1:])
    return False


def _can_be_inf(e: Ix) -> bool:
    return any(n.op == "gather" or (n.op == "const" and isinstance(n.value, float) and not math.isfinite(n.value))
               or n.op in ("fn", "exp2", "log2", "truediv") for n in e.walk())
