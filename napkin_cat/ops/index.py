"""Index functions: masks and biases computed from the global row index ``i`` and column index ``j``.

Each kind of index function is one :class:`IndexRule`, read by every interpretation:

``keep`` / ``value``  its meaning on broadcast index arrays (NumPy or torch, operators only);
``cuda``     its numba.cuda code: the conditions of a kept entry (a mask) or the bias
             expression, from the index expressions ``i`` and ``j`` and a writer ``u(n)`` of
             unsigned constants; None when it has no kernel code (a custom Python function);
``support``  for a mask, the columns that can survive in the rows ``[r0, r1)``: ``(lo, hi)``
             with ``lo <= j < hi`` for every kept ``(i, j)``, ``i`` in the rows (``hi`` may
             exceed the column count; the reader clips it).  Written once over an *algebra*
             ``al`` (plain ints, sympy expressions or generated code) whose values support
             ``+``, ``*``, ``//`` by non-negative ints and ``al.sat_sub(a, k) = max(a - k, 0)``.
             The tiled executor, the cost model and the kernel's chunk skipping all read it.
             None means every column may survive.

Adding a predicate is one rule in :data:`PREDICATES` and a constructor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..core.errors import TypingError


# --------------------------------------------------------------------------- argument checks

def int_arg(what: str, value, minimum: int | None = None) -> int:
    """An integer argument (a float such as 2.5 would be truncated silently: refused)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypingError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise TypingError(f"{what} must be >= {minimum}, got {value}")
    return value


def real_number(what: str, value) -> float:
    """A finite real number (not a bool, a string or NaN/inf)."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise TypingError(f"{what} must be a real number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypingError(f"{what} must be a real number, got {value!r}") from None
    if not math.isfinite(out):
        raise TypingError(f"{what} must be finite, got {value!r}")
    return out


# --------------------------------------------------------------------------- constants of sizes

@dataclass(frozen=True, slots=True)
class AxisPower:
    """A constant ``coeff * size(axis) ** power`` known once sizes are bound (1/sqrt(d))."""

    axis: object
    power: float = -0.5
    coeff: float = 1.0

    def value(self, sizes: dict) -> float:
        n = sizes.get(self.axis.name, self.axis.size)
        if isinstance(n, str):
            raise TypingError(f"constant depends on the size of axis {self.axis.name}, which is not bound")
        return self.coeff * float(n) ** self.power

    def bind(self, sizes):  # Box.bind reaches it through core's parameter binding
        return AxisPower(self.axis.bind(sizes), self.power, self.coeff)

    def __repr__(self) -> str:
        return f"AxisPower({self.axis!r}, {self.power!r}, {self.coeff!r})"


def constant_value(c, sizes: dict) -> float:
    return c.value(sizes) if isinstance(c, AxisPower) else float(c)


# --------------------------------------------------------------------------- the rules

@dataclass(frozen=True)
class IndexRule:
    name: str
    meaning: Callable                  # (i, j, *args) -> keep (mask) or bias value
    cuda: Callable | None = None       # (i, j, args, u) -> conditions (mask) / expression (bias)
    support: Callable | None = None    # (r0, r1, args, al) -> (lo, hi); masks only
    examples: tuple = ()               # argument tuples the sync tests (tests/test_kinds.py) try
    # comments on a kernel's chunk bounds: (past the support's end, before its start)
    skip_notes: tuple = ("later chunks are masked for every row of the tile", "earlier chunks are masked for every row")


def _causal_cuda(i, j, args, u):
    off = args[0]
    if off >= 0:
        return [f"{j} <= {i} + {u(off)}" if off else f"{j} <= {i}"]
    return [f"{j} + {u(-off)} <= {i}"]


def _causal_support(r0, r1, args, al):
    off = args[0]
    return 0, (r1 + off if off > 0 else r1 if off == 0 else al.sat_sub(r1, -off))


def _window_cuda(i, j, args, u):
    left, right = args
    return [f"{i} <= {j} + {u(left)}" if left else f"{i} <= {j}",
            f"{j} <= {i} + {u(right)}" if right else f"{j} <= {i}"]


def _window_support(r0, r1, args, al):
    left, right = args
    return (al.sat_sub(r0, left) if left else r0), (r1 + right if right else r1)


def _block_diagonal_support(r0, r1, args, al):
    b = args[0]
    return r0 // b * b, (r1 + (b - 1)) // b * b


PREDICATES: dict[str, IndexRule] = {r.name: r for r in (
    IndexRule("causal", lambda i, j, off: j <= i + off, _causal_cuda, _causal_support, ((0,), (2,), (-3,))),
    IndexRule("window", lambda i, j, left, right: (j >= i - left) & (j <= i + right), _window_cuda, _window_support,
              ((0, 0), (3, 0), (2, 1), (0, 4)),
              ("later chunks are outside every row's window", "earlier chunks are outside every window")),
    IndexRule("block_diagonal", lambda i, j, b: i // b == j // b,
              lambda i, j, args, u: [f"{i} // {u(args[0])} == {j} // {u(args[0])}"], _block_diagonal_support,
              ((1,), (3,), (4,))),
    # a mask written as an index expression (napkin_cat.ops.index_expr): every interpretation
    # reads the expression itself; its support is derived from it (None where it cannot be)
    IndexRule("expr", None, support=lambda r0, r1, args, al: _expr_support(args, r0, r1, al),
              skip_notes=("later chunks are masked for every row of the tile (derived from the mask)",
                          "earlier chunks are masked for every row (derived from the mask)")),
    IndexRule("custom", None),
)}

BIASES: dict[str, IndexRule] = {r.name: r for r in (
    IndexRule("alibi", lambda i, j, slope: slope * (j - i),
              lambda i, j, args, f: f"{f(args[0], 'SLOPE')} * (float32({j}) - float32({i}))",
              examples=((0.5,), (-1.25,))),
    IndexRule("expr", None),
    IndexRule("custom", None),
)}


def _expr_support(args, r0, r1, al):
    """An ``expr`` mask's args are ``(expression, row axis, column axis)``; the axes are None
    until the mask is placed on a box (:func:`bound_to`)."""
    from .index_support import support
    e, row, col = args
    return support(e, r0, r1, al, row or "i", col or "j")


def bound_to(fn, row: str, col: str, what: str):
    """An ``expr`` index function placed on a box's ``row`` / ``col`` axes: the roles ``i`` /
    ``j`` become those axes' indices (``b`` and ``h`` need an attention diagram, which knows its
    batch and head axes: :mod:`napkin_cat.library.variants`)."""
    if fn.kind != "expr" or fn.args[1] is not None:
        return fn
    from .index_expr import Ix
    e = fn.expr
    for role in ("b", "h"):
        if role in e.leaves("idx"):
            raise TypingError(f"{what} {fn!r} reads the index {role}; place it with nc.library.attention("
                              f"..., batch=..., heads=...), which binds b and h to axes")
    e = e.subst({"i": Ix("idx", (), row), "j": Ix("idx", (), col)})
    return type(fn)("expr", (e, row, col))


class _IndexFunction:
    """What a predicate and a bias share: a kind naming its rule in ``_RULES``, its arguments,
    and for ``custom`` a vectorised Python ``fn(i, j)`` (no kernel code, no support)."""

    __slots__ = ()
    _WHAT = ""

    @property
    def rule(self) -> IndexRule:
        try:
            return self._RULES[self.kind]
        except KeyError:
            raise TypingError(f"unknown {self._WHAT} kind {self.kind!r}; known: {sorted(self._RULES)}") from None

    def __call__(self, i, j):
        if self.kind == "custom":
            return self.fn(i, j)
        if self.kind == "expr":
            return self.expr.evaluate(_xp_of(i), {"i": i, "j": j})
        return self.rule.meaning(i, j, *self.args)

    @property
    def expr(self):
        """The index expression of an ``expr`` kind (None for the others)."""
        return self.args[0] if self.kind == "expr" else None

    @property
    def auxes(self) -> tuple:
        """The auxiliary tensors an ``expr`` kind gathers from (inputs of its box)."""
        return self.expr.auxes() if self.kind == "expr" else ()

    def index_axes(self) -> tuple[str, ...]:
        """The axes whose global indices an ``expr`` kind reads (its ``idx`` leaves)."""
        return tuple(n for n in self.expr.leaves("idx") if n != "score") if self.kind == "expr" else ()

    def values(self, xp, env: dict):
        """The meaning on the environment of :meth:`napkin_cat.ops.index_expr.Ix.evaluate`
        (``i`` and ``j`` are the box's row and column indices for the fixed kinds)."""
        if self.kind == "expr":
            return self.expr.evaluate(xp, env)
        return self(env["i"], env["j"])


@dataclass(frozen=True, slots=True)
class Predicate(_IndexFunction):
    """An index predicate ``pred(i, j)``: which entries of a (row, column) grid a mask keeps.

    Built by :func:`causal`, :func:`window`, :func:`block_diagonal` or :func:`predicate` (a
    custom vectorised ``fn(i, j)``, which has no kernel code and no support)."""

    _RULES = PREDICATES
    _WHAT = "predicate"
    kind: str
    args: tuple = ()
    fn: Callable | None = None

    def cuda(self, i: str, j: str, u: Callable) -> list[str] | None:
        """Conditions (joined by ``and``) under which entry ``(i, j)`` is kept, or None."""
        return None if self.rule.cuda is None else self.rule.cuda(i, j, self.args, u)

    def support(self, r0, r1, al):
        """``(lo, hi)``: the columns that may survive in rows ``[r0, r1)`` (None: all of them)."""
        return None if self.rule.support is None else self.rule.support(r0, r1, self.args, al)

    def row_support(self, c0, c1, al):
        """``(lo, hi)``: the rows that may keep an entry in the columns ``[c0, c1)`` (the
        support transposed, for a stream over the rows: :mod:`napkin_cat.relabel.skipping`),
        derived from :meth:`index_form` with the roles of ``i`` and ``j`` swapped; ``(0, None)``
        where nothing bounds them (a custom predicate).

        >>> causal(0).row_support(8, 12, IntAlgebra)    # j <= i: rows from the first column
        (8, None)
        >>> window(2, 1).row_support(8, 12, IntAlgebra)
        (7, 14)
        """
        from .index_support import support
        form = self.index_form()
        if form is None:
            return 0, None
        e, i, j = form
        return support(e, c0, c1, al, j, i)

    def skips_rows(self) -> bool:
        """A stream over the rows can skip chunks: :meth:`row_support` bounds them, or the mask
        reads a block table (skipped chunk by chunk when the kernel runs, as over the columns)."""
        far = 2 ** 31
        return (self.row_support(0, 1, IntAlgebra)[1] is not None or self.row_support(far, far + 1, IntAlgebra)[0] != 0
                or (self.rule.support is not None and bool(self.block_atoms())))

    def bounded(self) -> bool:
        """The support bounds the columns from above (a stream can skip chunks past it)."""
        if self.rule.support is None:
            return False
        return self.support(0, 1, IntAlgebra)[1] is not None

    def skips_chunks(self) -> bool:
        """A stream over the columns can skip chunks: the support bounds them from above or
        from below (``j >= i``: the first row tiles' early chunks), or the mask reads a block
        table (:mod:`.block_table`: skipped chunk by chunk when the kernel runs)."""
        if self.rule.support is None:
            return False
        far = 2 ** 31
        return (self.bounded() or self.support(far, far + 1, IntAlgebra)[0] != 0
                or bool(self.block_atoms()))

    def index_form(self):
        """``(expression, row name, column name)``: the predicate as an index expression
        (:mod:`.index_expr`; the fixed kinds written out), or None for a custom one."""
        from .index_expr import Ix
        i, j = Ix("idx", (), "i"), Ix("idx", (), "j")
        if self.kind == "expr":
            return self.args[0], self.args[1] or "i", self.args[2] or "j"
        if self.kind == "causal":
            return j <= i + self.args[0], "i", "j"
        if self.kind == "window":
            return (j >= i - self.args[0]) & (j <= i + self.args[1]), "i", "j"
        if self.kind == "block_diagonal":
            return i // self.args[0] == j // self.args[0], "i", "j"
        return None

    def block_atoms(self) -> tuple:
        """The comparisons ``table[i // r, j // c] (cmp) v`` of the mask (data-dependent block
        skipping: :class:`~.index_support.BlockAtom`)."""
        from .index_support import block_atoms
        form = self.index_form()
        return () if form is None else block_atoms(*form)

    def chunk_state(self, r0, r1, c0, c1, al, lg, atom):
        """``(full, empty)`` of the rows ``[r0, r1)`` x columns ``[c0, c1)``
        (:func:`~.index_support.chunk_state`); ``(False, False)`` for a custom predicate."""
        from .index_support import chunk_state
        form = self.index_form()
        if form is None:
            return False, False
        e, i, j = form
        return chunk_state(e, r0, r1, c0, c1, al, lg, atom, i, j)

    def __repr__(self) -> str:
        if self.kind == "expr":
            return f"mask_mod({str(self.expr)!r})"
        if self.kind == "custom":
            return f"Predicate('custom', {self.args!r}, {getattr(self.fn, '__name__', self.fn)})"
        return f"Predicate({self.kind!r}, {self.args!r})"


@dataclass(frozen=True, slots=True)
class IndexBias(_IndexFunction):
    """``bias(i, j)`` added to a score: :func:`alibi` or a custom vectorised ``fn(i, j)``."""

    _RULES = BIASES
    _WHAT = "index bias"
    kind: str
    args: tuple = ()
    fn: Callable | None = None

    def cuda(self, i: str, j: str, f: Callable) -> str | None:
        """The bias as numba.cuda code; ``f(value, name)`` writes a float32 constant."""
        return None if self.rule.cuda is None else self.rule.cuda(i, j, self.args, f)

    expr = Predicate.expr
    auxes = Predicate.auxes
    index_axes = Predicate.index_axes
    values = Predicate.values

    def __repr__(self) -> str:
        if self.kind == "expr":
            return f"bias_mod({str(self.expr)!r})"
        return f"IndexBias(kind={self.kind!r}, args={self.args!r}, fn={self.fn!r})"


class IntAlgebra:
    """:meth:`Predicate.support` on Python ints."""

    max = staticmethod(max)
    min = staticmethod(min)

    @staticmethod
    def sat_sub(a, k):
        return max(a - k, 0)


# --------------------------------------------------------------------------- constructors

def causal(offset: int = 0) -> Predicate:
    """Keep ``j <= i + offset``."""
    return Predicate("causal", (int_arg("causal offset", offset),))


def window(left: int, right: int = 0) -> Predicate:
    """Keep ``i - left <= j <= i + right``; ``window(0)`` is the diagonal (only ``j == i``)."""
    return Predicate("window", (int_arg("window left size", left, 0), int_arg("window right size", right, 0)))


def block_diagonal(block: int) -> Predicate:
    """Keep ``i // block == j // block``: independent blocks of ``block`` positions (packed sequences)."""
    return Predicate("block_diagonal", (int_arg("block_diagonal block size", block, 1),))


def predicate(fn: Callable, name: str = "custom") -> Predicate:
    if not callable(fn):
        raise TypingError(f"predicate needs a callable fn(i, j), got {fn!r}")
    if not isinstance(name, str):
        raise TypingError(f"predicate name must be a str, got {name!r}")
    return Predicate("custom", (name,), fn)


def _xp_of(x):
    from .arrays import NUMPY, torch_namespace
    return torch_namespace() if type(x).__module__.startswith("torch") else NUMPY


def mask_mod(fn) -> Predicate:
    """A mask traced from ``fn(b, h, i, j) -> condition`` (FlexAttention's ``mask_mod``): index
    arithmetic, comparisons joined by ``&`` ``|`` ``~``, ``nc.ix`` functions and gathers from
    :func:`aux` tensors.  It evaluates, costs, draws and lowers from that one trace; its block
    sparsity (which chunks a row tile can skip) is derived from it.

    >>> import napkin_cat as nc
    >>> nc.mask_mod(lambda b, h, i, j: (j <= i) & (i - j < 4))
    mask_mod('(j <= i) & ((i - j) < 4)')
    """
    from .index_expr import trace
    return Predicate("expr", (trace(fn, "mask"), None, None))


def bias_mod(fn) -> IndexBias:
    """A bias ``fn(b, h, i, j) -> value`` added to the score, traced like :func:`mask_mod`."""
    from .index_expr import lift, trace
    return IndexBias("expr", (trace(fn if callable(fn) else lift(fn), "bias"), None, None))


def alibi(slope: float) -> IndexBias:
    return IndexBias("alibi", (real_number("alibi slope", slope),))
