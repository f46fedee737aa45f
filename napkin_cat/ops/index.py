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
    IndexRule("custom", None),
)}

BIASES: dict[str, IndexRule] = {r.name: r for r in (
    IndexRule("alibi", lambda i, j, slope: slope * (j - i),
              lambda i, j, args, f: f"{f(args[0], 'SLOPE')} * (float32({j}) - float32({i}))",
              examples=((0.5,), (-1.25,))),
    IndexRule("custom", None),
)}


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
        return self.rule.meaning(i, j, *self.args)


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

    def __repr__(self) -> str:
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


def alibi(slope: float) -> IndexBias:
    return IndexBias("alibi", (real_number("alibi slope", slope),))
