"""Index expressions: attention variants as data.

A score modification or a mask is a small expression over the batch / head / query / key
indices, the score, constants and *gathers* from auxiliary tensors indexed by those indices
(``bias[b]``, ``head_bias[h]``, ``doc[i] == doc[j]``).  One frozen tree, :class:`Ix`, is read
by every interpretation:

``evaluate``   its meaning over an array namespace (NumPy oracle, torch);
``to_code``    numba.cuda code (signed int64 index arithmetic, float32 values);
``work``       its operations by cost unit (``fma`` / ``exp``);
``support``    for a mask, the columns a row block can keep (:mod:`.index_support`);
``str``        the pseudocode shown in docs and drawings.

A plain Python function is traced once into that form (:func:`trace`): its arguments are
:class:`Ix` leaves, Python operators build the tree, and anything a trace cannot follow
(``if`` on an index, ``and`` / ``or``, ``math.tanh``, indexing a NumPy array) is refused with
the reason and the fix.

>>> b, h, i, j = (Ix("idx", (), n) for n in "bhij")
>>> m = (j <= i) & (i - j <= 3)
>>> print(m)
(j <= i) & ((i - j) <= 3)
>>> m.evaluate(NUMPY_LIKE, {"i": 5, "j": 1})
False
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..core.errors import TraceError, TypingError
from .functions import FUNCTIONS

ROLES = ("score", "b", "h", "i", "j")
_BIN = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
        "and": "&", "or": "|", "xor": "^", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
        "ne": "!="}
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
"""The comparison operators (``bool`` results)."""


def _refuse(what: str):
    raise TraceError(what)


@dataclass(frozen=True, slots=True)
class Aux:
    """An auxiliary input tensor of an attention variant: ``nc.aux("doc", n)``; indexing it with
    index expressions (``doc[i]``) is a gather, and the tensor becomes an input of the diagram
    (and of the kernel) named ``name`` over ``axes``."""

    name: str
    axes: tuple
    dtype: object = None   # a core.types.DType, or None: the diagram's, f32 where compared (library.variants)

    def __getitem__(self, idx) -> "Ix":
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != len(self.axes):
            raise TraceError(f"aux {self.name} has {len(self.axes)} axes "
                             f"({' '.join(a.name for a in self.axes)}), indexed with {len(idx)}")
        ix = tuple(lift(k) for k in idx)
        for k in ix:
            if k.dtype != "int":
                raise TraceError(f"aux {self.name} indexed with {k} ({k.dtype}); gathers take integer "
                                 f"index expressions (b, h, i, j, constants, // % + - *)")
        return Ix("gather", ix, self)

    def __repr__(self) -> str:
        return f"aux({self.name!r}, {', '.join(a.name for a in self.axes)})"


@dataclass(frozen=True, slots=True, eq=False)
class Ix:
    """One node: ``op`` (``idx``, ``size``, ``const``, ``gather``, ``fn``, ``where``, ``neg``,
    ``invert``, ``abs``, ``min``, ``max``, ``exp2``, ``log2`` or a binary operator), its operand
    nodes ``args`` and a payload (the leaf's name, the constant, the :class:`Aux`, the
    function's name).  Structural equality is :meth:`same` (``==`` builds a comparison)."""

    op: str
    args: tuple = ()
    value: object = None

    # ------------------------------------------------------------------ typing
    @property
    def dtype(self) -> str:
        """``int``, ``float`` or ``bool``."""
        op = self.op
        if op in ("idx", "size"):
            # ("float", subtree): a lowering's exact float32 image of an int subtree
            return "float" if self.value == "score" or isinstance(self.value, tuple) and self.value[0] == "float" else "int"
        if op == "const":
            return "bool" if isinstance(self.value, bool) else "int" if isinstance(self.value, int) else "float"
        if op in ("gather", "fn", "exp2", "log2", "truediv"):
            return "float"
        if op in COMPARISONS:
            return "bool"
        if op == "where":
            return _join(self.args[1].dtype, self.args[2].dtype)
        if op in ("neg", "invert", "abs"):
            return self.args[0].dtype
        return _join(*(a.dtype for a in self.args))

    # ------------------------------------------------------------------ structure
    def same(self, other) -> bool:
        return isinstance(other, Ix) and self.key() == other.key()

    def key(self):
        v = self.value
        if isinstance(v, Aux):
            v = ("aux", v.name, tuple(a.name for a in v.axes))
        elif isinstance(v, float) and math.isnan(v):
            v = "nan"
        return (self.op, type(v).__name__, v, tuple(a.key() for a in self.args))

    def __hash__(self):
        return hash(self.key())

    def walk(self):
        yield self
        for a in self.args:
            yield from a.walk()

    def leaves(self, op: str) -> tuple:
        return tuple(dict.fromkeys(n.value for n in self.walk() if n.op == op))

    def auxes(self) -> tuple[Aux, ...]:
        """The auxiliary tensors gathered from, in order of first appearance."""
        out = {}
        for n in self.walk():
            if n.op == "gather":
                out.setdefault(n.value.name, n.value)
        return tuple(out.values())

    def compared_auxes(self) -> tuple[str, ...]:
        """The auxiliary tensors whose gathered values meet a comparison (``doc[i] == doc[j]``):
        their values decide which entries are kept, so they must be read exactly."""
        out = {}
        for n in self.walk():
            if n.op in COMPARISONS:
                out.update(dict.fromkeys(a.name for a in n.auxes()))
        return tuple(out)

    def uses_score(self) -> bool:
        return "score" in self.leaves("idx")

    def subst(self, table: dict) -> "Ix":
        """Replace ``idx`` leaves named in ``table`` by expressions."""
        if self.op == "idx" and self.value in table:
            return table[self.value]
        if not self.args:
            return self
        return Ix(self.op, tuple(a.subst(table) for a in self.args), self.value)

    # ------------------------------------------------------------------ refusals (what a trace cannot follow)
    def __bool__(self):
        _refuse(f"{self} has no truth value while tracing: Python `if`, `and`, `or`, `not`, "
                f"chained comparisons and builtin min/max branch on it; write `&`, `|`, `~`, "
                f"nc.ix.where(cond, a, b), nc.ix.minimum / maximum")

    def __float__(self):
        _refuse(f"{self} is traced, not a number: math.* functions take numbers; use nc.ix.<fn> "
                f"(nc.ix.tanh, nc.ix.exp, nc.ix.exp2, nc.ix.log2...)")

    __int__ = __float__

    def __index__(self):
        _refuse(f"{self} indexes an array that is not an auxiliary tensor: declare the tensor with "
                f"nc.aux(name, *axes) and index that (its values become an input of the diagram)")

    def __array__(self, *a, **k):
        _refuse(f"{self} cannot become a NumPy array while tracing: index an nc.aux tensor instead "
                f"of a captured array, and use nc.ix functions instead of NumPy's")

    def __iter__(self):
        _refuse(f"{self} is a traced scalar: it cannot be iterated")

    # ------------------------------------------------------------------ operators
    def _bin(self, op, other, swap=False):
        other = lift(other)
        a, b = (other, self) if swap else (self, other)
        if op in ("and", "or", "xor"):
            if {a.dtype, b.dtype} - {"bool"} and {a.dtype, b.dtype} - {"int"}:
                raise TraceError(f"{_BIN[op]} needs two conditions or two integers, got {a} ({a.dtype}) "
                                 f"and {b} ({b.dtype})")
            for c, e in ((a, b), (b, a)):   # True & x is x, True | x is True (masks composed from a constant)
                if op != "xor" and c.op == "const" and c.dtype == e.dtype == "bool":
                    return e if c.value == (op == "and") else c
        return Ix(op, (a, b))

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("truediv", o)
    def __rtruediv__(self, o): return self._bin("truediv", o, True)
    def __floordiv__(self, o): return self._bin("floordiv", o)
    def __rfloordiv__(self, o): return self._bin("floordiv", o, True)
    def __mod__(self, o): return self._bin("mod", o)
    def __rmod__(self, o): return self._bin("mod", o, True)
    def __and__(self, o): return self._bin("and", o)
    def __rand__(self, o): return self._bin("and", o, True)
    def __or__(self, o): return self._bin("or", o)
    def __ror__(self, o): return self._bin("or", o, True)
    def __xor__(self, o): return self._bin("xor", o)
    def __rxor__(self, o): return self._bin("xor", o, True)
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __eq__(self, o): return self._bin("eq", o)  # noqa: D105 (a comparison node, as in numpy)
    def __ne__(self, o): return self._bin("ne", o)
    def __neg__(self): return Ix("neg", (self,))
    def __pos__(self): return self
    def __abs__(self): return Ix("abs", (self,))

    def __invert__(self):
        if self.dtype == "float":
            raise TraceError(f"~ needs a condition or an integer, got {self} (float)")
        return Ix("invert", (self,))

    def __pow__(self, o):
        _refuse(f"{self} ** {o}: powers are not in the index vocabulary; use nc.ix.exp2 / "
                f"nc.ix.square or a product")

    __rpow__ = __pow__

    # torch's spellings, as FlexAttention's mask_mod / score_mod examples write them
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.where``, ``torch.tanh``, ``torch.clamp``... on a traced expression (torch hands
        it calls as to a tensor-like object): :mod:`.index_torch`."""
        from .index_torch import torch_call
        return torch_call(func, args, kwargs or {}, lift, ix)

    def abs(self) -> "Ix":
        return Ix("abs", (self,))

    def __getattr__(self, name: str):
        """torch.Tensor's methods of the vocabulary (``score.tanh()``, ``x.remainder(4)``,
        ``b.new_ones((), dtype=torch.bool)``): :func:`.index_torch.tensor_method`."""
        from .index_torch import tensor_method
        return tensor_method(self, name, lift, ix)

    def clamp(self, min=None, max=None) -> "Ix":   # noqa: A002 (torch.Tensor.clamp's names)
        """``min(max(self, min), max)``; either bound may be omitted (not both), as in torch."""
        if min is None and max is None:
            _refuse(f"{self}.clamp() needs a min or a max")
        out = self if min is None else Ix("max", (self, lift(min)))
        return out if max is None else Ix("min", (out, lift(max)))

    def _shift(self, o, left: bool, swap: bool = False):
        """``x << k`` is ``x * 2**k``, ``x >> k`` is ``x // 2**k`` (an arithmetic shift is floor
        division, negative ``x`` included) for a constant ``k >= 0``: no new operation."""
        if swap:
            _refuse(f"{o} {'<<' if left else '>>'} {self}: shifts by an index expression are not in the "
                    f"index vocabulary (only by a constant)")
        k = lift(o)
        if self.dtype != "int" or k.op != "const" or not isinstance(k.value, int) or isinstance(k.value, bool) \
                or k.value < 0:
            _refuse(f"{self} {'<<' if left else '>>'} {o}: shifts take an integer expression and a "
                    f"constant number of bits >= 0")
        return self._bin("mul" if left else "floordiv", 1 << k.value)

    def __lshift__(self, o): return self._shift(o, True)
    def __rshift__(self, o): return self._shift(o, False)
    def __rlshift__(self, o): return self._shift(o, True, swap=True)
    def __rrshift__(self, o): return self._shift(o, False, swap=True)

    # ------------------------------------------------------------------ text
    def __str__(self) -> str:
        op, a = self.op, self.args
        if op in ("idx", "size"):
            return str(self.value) if op == "idx" else f"size({self.value})"
        if op == "const":
            return repr(self.value)
        if op == "gather":
            return f"{self.value.name}[{', '.join(map(str, a))}]"
        if op in _BIN:
            return f"{_wrap(a[0])} {_BIN[op]} {_wrap(a[1])}"
        if op == "neg":
            return f"-{_wrap(a[0])}"
        if op == "invert":
            return f"~{_wrap(a[0])}"
        if op == "fn":
            return f"{self.value}({a[0]})"
        if op == "where":
            return f"where({a[0]}, {a[1]}, {a[2]})"
        return f"{op}({', '.join(map(str, a))})"

    def __repr__(self) -> str:
        return f"Ix<{self}>"

    # ------------------------------------------------------------------ meaning
    def evaluate(self, xp, env: dict):
        """The value over the array namespace ``xp``; ``env`` maps index names (``score``
        included) to arrays, ``('size', name)`` to ints and aux names to arrays."""
        op, a = self.op, self.args
        if op == "idx":
            return env[self.value]
        if op == "size":
            return env[("size", self.value)]
        if op == "const":
            return self.value
        if op == "gather":   # indices are clamped into the tensor (as the kernels read it)
            arr = env[self.value.name]
            return arr[tuple(_clamp(xp, k.evaluate(xp, env), n) for k, n in zip(a, arr.shape))]
        vals = [k.evaluate(xp, env) for k in a]
        if op in _PY:
            return _PY[op](*vals)
        if op == "where":
            return xp.where(vals[0], vals[1], vals[2])
        if op in ("min", "max"):
            return (xp.minimum if op == "min" else xp.maximum)(_arr(xp, vals[0]), _arr(xp, vals[1]))
        if op == "abs":
            return abs(vals[0])
        if op == "invert":
            return ~vals[0] if self.dtype == "int" or hasattr(vals[0], "shape") else (not vals[0])
        if op == "exp2":
            return xp.exp2(_arr(xp, vals[0], float_=True))
        if op == "log2":
            with xp.quiet():
                return xp.log2(_arr(xp, vals[0], float_=True))
        if op == "fn":
            with xp.quiet():
                return FUNCTIONS[self.value](xp, _arr(xp, vals[0], float_=True))
        raise TypingError(f"index expression: unknown operation {op!r}")

    def to_code(self, leaf: Callable, fconst: Callable, fn_code: Callable) -> str:
        """numba.cuda code: ``leaf(node)`` writes an ``idx`` / ``size`` / ``gather`` leaf
        (ints as int64, the score and gathers as float32), ``fconst(v)`` a float32 constant,
        ``fn_code(name, x)`` an elementwise function."""
        op, a = self.op, self.args
        if op in ("idx", "size", "gather"):
            return leaf(self)
        if op == "const":
            v = self.value
            if isinstance(v, bool):
                return "True" if v else "False"
            if isinstance(v, int):
                return f"({v})" if v < 0 else str(v)
            return fconst(float(v))
        dt = self.dtype
        parts = [k.to_code(leaf, fconst, fn_code) for k in a]
        if dt == "float" or op in COMPARISONS:
            # operands meet as float32 unless both are ints
            if op not in ("where",) and any(k.dtype == "float" for k in a):
                parts = [f"float32({p})" if k.dtype != "float" else p for p, k in zip(parts, a)]
        if op in _BIN:
            if op == "truediv":
                parts = [f"float32({p})" if k.dtype != "float" else p for p, k in zip(parts, a)]
            # booleans too combine with & and |: both sides are evaluated (a gather's index is
            # clamped, so always safe) and a mask costs selects per score, not branches
            return f"({parts[0]} {_BIN[op]} {parts[1]})"
        if op == "neg":
            return f"(-{parts[0]})"
        if op == "invert":
            return f"(not {parts[0]})" if dt == "bool" else f"(~{parts[0]})"
        if op == "abs":
            return f"abs({parts[0]})"
        if op in ("min", "max"):
            return f"{op}({parts[0]}, {parts[1]})"
        if op == "where":
            x, y = parts[1], parts[2]
            if dt == "float":
                x = x if a[1].dtype == "float" else f"float32({x})"
                y = y if a[2].dtype == "float" else f"float32({y})"
            return f"({x} if {parts[0]} else {y})"
        if op == "exp2":
            return f"math.pow({fconst(2.0)}, {_f32(parts[0], a[0])})"
        if op == "log2":
            return f"math.log2({_f32(parts[0], a[0])})"
        if op == "fn":
            return fn_code(self.value, _f32(parts[0], a[0]))
        raise TypingError(f"index expression: unknown operation {op!r}")

    def footprint(self, widths: dict) -> dict[str, object]:
        """``{aux name: entries}`` the gathers can read while each index leaf ``n`` runs over
        ``widths[n]`` consecutive values (:func:`.index_footprint.footprint`)."""
        from .index_footprint import footprint
        return footprint(self, widths)

    def work(self) -> dict[str, int]:
        """Operations per element by cost unit (a gather is a load, not counted here)."""
        out: dict[str, int] = {}
        for n in self.walk():
            if n.op in ("idx", "size", "const", "gather"):
                continue
            unit = FUNCTIONS[n.value].unit if n.op == "fn" else "exp" if n.op in ("exp2", "log2") else "fma"
            if unit != "free":
                out[unit] = out.get(unit, 0) + 1
        return out


def _clamp(xp, idx, n: int):
    if hasattr(idx, "shape"):
        return xp.clip(idx, 0, n - 1)
    return min(max(int(idx), 0), n - 1)


def _f32(code: str, node: Ix) -> str:
    return code if node.dtype == "float" else f"float32({code})"


def _arr(xp, v, float_=False):
    if hasattr(v, "shape"):
        if float_ and getattr(v.dtype, "is_floating_point", None) is False:
            return v.double()
        if float_ and getattr(v.dtype, "kind", "f") in "iub":
            return v.astype(float)
        return v
    return xp.asarray(float(v) if float_ else v)


_PY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "truediv": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
       "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
       "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
       "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
       "neg": lambda a: -a}


def _join(*dts) -> str:
    if "float" in dts:
        return "float"
    if "int" in dts:
        return "int"
    return "bool"


def _wrap(n: Ix) -> str:
    s = str(n)
    return f"({s})" if n.op in _BIN or n.op in ("neg", "invert") else s


def lift(v) -> Ix:
    """A Python number (or an :class:`Ix`) as an expression node."""
    if isinstance(v, Ix):
        return v
    if isinstance(v, bool) or isinstance(v, int):
        return Ix("const", (), bool(v) if isinstance(v, bool) else int(v))
    if isinstance(v, float):
        return Ix("const", (), v)
    if hasattr(v, "__index__") and not hasattr(v, "shape"):
        return Ix("const", (), int(v))
    if isinstance(v, Aux):
        raise TraceError(f"{v} is used without indices: gather from it with {v.name}[i], {v.name}[h]...")
    raise TraceError(f"{v!r} ({type(v).__name__}) is not an index expression, a number or an aux "
                     f"gather; captured arrays must be declared with nc.aux(name, *axes)")


# --------------------------------------------------------------------------- the vocabulary (nc.ix)

class _Vocabulary:
    """``nc.ix``: the functions an index expression can apply (the elementwise vocabulary of
    :data:`napkin_cat.ops.functions.FUNCTIONS` plus ``where``, ``minimum``, ``maximum``,
    ``exp2``, ``log2``); on plain numbers they compute the number."""

    @staticmethod
    def where(cond, a, b) -> Ix:
        cond = lift(cond)
        if cond.dtype != "bool":
            raise TraceError(f"where needs a condition first, got {cond} ({cond.dtype})")
        return Ix("where", (cond, lift(a), lift(b)))

    @staticmethod
    def minimum(a, b) -> Ix:
        return Ix("min", (lift(a), lift(b)))

    @staticmethod
    def maximum(a, b) -> Ix:
        return Ix("max", (lift(a), lift(b)))

    @staticmethod
    def exp2(a) -> Ix:
        return Ix("exp2", (lift(a),))

    @staticmethod
    def log2(a) -> Ix:
        return Ix("log2", (lift(a),))

    def __getattr__(self, name):
        f = FUNCTIONS.get(name)
        if f is None or f.arity != 1 or f.constant:
            raise AttributeError(f"nc.ix has no function {name!r}; unary functions: "
                                 f"{sorted(n for n, g in FUNCTIONS.items() if g.arity == 1 and not g.constant)}"
                                 f", plus where, minimum, maximum, exp2, log2")
        return lambda a: Ix("fn", (lift(a),), name)

    def __dir__(self):
        return ["where", "minimum", "maximum", "exp2", "log2",
                *sorted(n for n, g in FUNCTIONS.items() if g.arity == 1 and not g.constant)]


ix = _Vocabulary()
NEG_INF = float("-inf")


# --------------------------------------------------------------------------- tracing

def leaves(names=ROLES) -> dict[str, Ix]:
    return {n: Ix("idx", (), n) for n in names}


def trace(fn: Callable, kind: str) -> Ix:
    """Trace ``fn`` once: ``kind="mask"`` calls ``fn(b, h, i, j)`` and wants a condition;
    ``kind="bias"`` calls it and wants a value of the indices; ``kind="score"`` calls
    ``fn(score, b, h, i, j)`` and wants a value."""
    if isinstance(fn, Ix):
        out = fn
    else:
        if not callable(fn):
            raise TypingError(f"{kind}_mod needs a callable, got {fn!r}")
        lv = leaves()
        args = [lv[n] for n in (ROLES if kind == "score" else ROLES[1:])]
        what = "fn(score, b, h, i, j)" if kind == "score" else "fn(b, h, i, j)"
        try:
            out = fn(*args)
        except TraceError:
            raise
        except TypingError:
            raise
        except Exception as e:  # noqa: BLE001 (any failure of the user's code is a refusal, with its reason)
            raise TraceError(f"cannot trace {getattr(fn, '__name__', fn)} as {what}: "
                             f"{type(e).__name__}: {e}") from None
        out = lift(out)
    if kind == "mask":
        if out.dtype != "bool":
            raise TraceError(f"a mask must return a condition (comparisons joined by & | ~), got {out} "
                             f"({out.dtype})")
        if out.uses_score():
            raise TraceError(f"a mask reads indices only, not the score: {out}")
    elif kind == "bias":
        if out.dtype == "bool":
            raise TraceError(f"a bias must be a value, got the condition {out}; a mask is nc.mask_mod")
        if out.uses_score():
            raise TraceError(f"a bias reads indices only; a function of the score is nc.score_mod: {out}")
    elif out.dtype == "bool":
        raise TraceError(f"a score_mod must return a value, got the condition {out}; a mask is "
                         f"nc.mask_mod(fn) (or nc.ix.where(cond, score, -inf))")
    return out


class _NumpyLike:
    """A tiny namespace for doctests on Python scalars."""

    @staticmethod
    def where(c, a, b):
        return a if c else b


NUMPY_LIKE = _NumpyLike()
