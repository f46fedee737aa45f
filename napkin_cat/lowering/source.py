"""A small writer for generated Python source: indented lines, blocks, and named constants.

Every integer the kernels compute indices with is *unsigned* (``uint32`` constants, unsigned
thread and block indices): numba then emits no negative-index wraparound on array accesses,
and NVVM can prove the alignment of neighbouring shared-memory loads and fuse them into
128-bit loads.  A bare Python literal in index arithmetic would be an ``int64`` and turn the
arithmetic signed (or, mixed with ``uint64``, into float64), so the writer hands out named
constants instead: ``N_q = uint32(64)``.  Float constants are ``float32`` for the same reason
(a Python float makes float32 arithmetic float64).

:class:`Code` values are index arithmetic that renders as code: the chunk-skipping bounds are
:meth:`napkin_cat.ops.index.Predicate.support` evaluated over :class:`CodeAlgebra`.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass


class Source:
    """Indented lines of Python, with slots: places earlier in the text that later code can
    still write to (:meth:`slot`)."""

    def __init__(self, indent: int = 0):
        self._items: list = []         # lines, and the slots (Source) between them
        self.depth = indent

    def __call__(self, line: str = "") -> None:
        self._items.append(("    " * self.depth + line) if line else "")

    def comment(self, text: str) -> None:
        for part in text.splitlines():
            self(f"# {part}")

    def slot(self) -> "Source":
        """A place here, at this depth, for lines written later (a value hoisted out of a loop
        the writer has since entered)."""
        s = Source(self.depth)
        self._items.append(s)
        return s

    def mark(self) -> int:
        """A place in the text, for :meth:`since` (slots filled later before it do not move it)."""
        return len(self._items)

    def since(self, mark: int) -> list[str]:
        """The lines written after ``mark``."""
        return [ln for item in self._items[mark:] for ln in (item.lines if isinstance(item, Source) else (item,))]

    @property
    def lines(self) -> list[str]:
        out = []
        for item in self._items:
            out.extend(item.lines if isinstance(item, Source) else (item,))
        return out

    @contextmanager
    def block(self, header: str):
        self(header)
        self.depth += 1
        mark = len(self._items)
        try:
            yield
        finally:
            if not any(not isinstance(i, Source) or i._items for i in self._items[mark:]):
                self("pass")
            self.depth -= 1

    @contextmanager
    def maybe(self, condition: str | None):
        """``if condition:`` around the body, or nothing when ``condition`` is None."""
        if condition:
            with self.block(f"if {condition}:"):
                yield
        else:
            yield

    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass(frozen=True)
class RowHoist:
    """Where a micro-tile's element loop puts values of its row alone (``env["_hoist"]``): a
    slot in the row loop, before the column loop, and the values already written there.  A
    value without the column axis (a row's logsumexp, its D = rowsum(dO * O), a constant) is
    then computed once per row, not once per element (:meth:`.emit.Emitter.value`; made by the micro-tile loops of :mod:`.emit_threads`)."""
    src: Source
    memo: dict
    col: str


class Names:
    """Unique identifiers for generated variables, readable and stable."""

    def __init__(self, reserved=()):
        self.used: set[str] = set(reserved)

    def fresh(self, base: str) -> str:
        base = re.sub(r"\W", "_", base)
        if not base or base[0].isdigit():
            base = "v_" + base
        name, k = base, 1
        while name in self.used:
            k += 1
            name = f"{base}{k}"
        self.used.add(name)
        return name


class Constants:
    """Named module-level constants, in order of first use."""

    def __init__(self, names: Names):
        self.names = names
        self.ints: dict[str, int] = {}
        self.floats: dict[str, float] = {}
        self.comments: dict[str, str] = {}
        self._by_value: dict[tuple, str] = {}

    def u(self, value: int, name: str | None = None, comment: str = "") -> str:
        """An unsigned integer constant, ``U<value>`` unless named; a name is reused when it
        already holds ``value``."""
        value = int(value)
        if value < 0 or value >= 2 ** 32:
            raise ValueError(f"unsigned constant out of range: {value}")
        if name is None or name == f"U{value}":
            key = ("u", value)
            if key not in self._by_value:
                self._by_value[key] = self._add(self.ints, f"U{value}", value, comment)
            return self._by_value[key]
        if self.ints.get(name) == value:
            return name
        return self._add(self.ints, name, value, comment)

    def f(self, value: float, name: str | None = None, comment: str = "") -> str:
        """A float32 constant; one name per value (0, 1, 1/2 and +-inf have fixed names)."""
        value = float(value)
        key = ("f", repr(value))
        if key in self._by_value:
            return self._by_value[key]
        name = FIXED_FLOATS.get(repr(value)) or name or "F_" + _float_tag(value)
        self._by_value[key] = self._add(self.floats, name, value, comment)
        return self._by_value[key]

    def reserved(self, name: str, value: int, comment: str = "") -> str:
        """Register an unsigned constant under a name already reserved in :attr:`names`."""
        self.ints[name] = int(value)
        if comment:
            self.comments[name] = comment
        return name

    def _add(self, table, name, value, comment):
        name = name if name not in self.names.used else self.names.fresh(name)
        self.names.used.add(name)
        table[name] = value
        if comment:
            self.comments[name] = comment
        return name

    def header(self) -> list[str]:
        lines = []
        for name, v in self.ints.items():
            c = self.comments.get(name)
            lines.append(f"{name} = uint32({v})" + (f"  # {c}" if c else ""))
        for name, v in self.floats.items():
            c = self.comments.get(name)
            lines.append(f"{name} = float32({_float_literal(v)})" + (f"  # {c}" if c else ""))
        return lines


FIXED_FLOATS = {"0.0": "ZERO", "1.0": "ONE", "0.5": "HALF", "-inf": "NEG_INF", "inf": "INF"}


def _float_tag(v: float) -> str:
    if math.isinf(v):
        return "NEG_INF" if v < 0 else "INF"
    s = repr(v).replace("-", "m").replace(".", "_").replace("+", "")
    return s


def _float_literal(v: float) -> str:
    if math.isinf(v):
        return "-math.inf" if v < 0 else "math.inf"
    if math.isnan(v):
        return "math.nan"
    return repr(v)


def paren(expr: str) -> str:
    """``expr`` parenthesised unless it is a name, a call or already parenthesised."""
    depth = 0
    for ch in expr:
        depth += ch in "(["
        depth -= ch in ")]"
        if depth == 0 and ch in "+-*/% ":
            return f"({expr})"
    return expr


@dataclass(frozen=True)
class Code:
    """A value of :meth:`napkin_cat.ops.index.Predicate.support`'s algebra that renders as code:
    ``a + k``, ``a * k``, ``a // k`` and :meth:`CodeAlgebra.sat_sub` by non-negative ints.

    >>> render_code(CodeAlgebra.sat_sub(Code("q0 + len_q"), 2) + 0, lambda n: f"U{n}")
    'max(q0 + len_q, U2) - U2'
    >>> render_code(Code("q0") * 4 // 3, lambda n: f"U{n}")
    '(q0 * U4) // U3'
    """

    text: str | None = None
    op: str | None = None
    args: tuple = ()

    def __add__(self, k: int):
        return self if k == 0 else Code(op="+", args=(self, k))

    def __mul__(self, k: int):
        return Code(op="*", args=(self, k))

    def __floordiv__(self, k: int):
        return Code(op="//", args=(self, k))


class CodeAlgebra:
    @staticmethod
    def sat_sub(a, k: int):
        return a if k == 0 else Code(op="sat_sub", args=(a, k))

    @staticmethod
    def max(a, b):
        return max(a, b) if not isinstance(a, Code) and not isinstance(b, Code) else Code(op="max", args=(a, b))

    @staticmethod
    def min(a, b):
        return min(a, b) if not isinstance(a, Code) and not isinstance(b, Code) else Code(op="min", args=(a, b))


def render_code(c, u) -> str:
    """``c`` as code; ``u(n)`` writes an unsigned constant (registered as it is rendered)."""
    if not isinstance(c, Code):
        return u(c)
    if c.text is not None:
        return c.text
    a, k = c.args
    a = render_code(a, u)
    if c.op in ("max", "min"):   # a bound joined from two masks' (an index expression's & and |)
        return f"{c.op}({a}, {render_code(k, u)})"
    if c.op == "sat_sub":
        return f"max({a}, {u(k)}) - {u(k)}"
    if c.op == "+":
        return f"{a} + {u(k)}"
    return f"{paren(a)} {c.op} {u(k)}"
