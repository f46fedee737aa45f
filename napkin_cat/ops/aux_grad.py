"""Gradients for the auxiliary tensors of attention variants: two box kinds and the calculus of
index expressions.

A score modification or a bias (:mod:`.index_expr`) reads *gathers* ``bias[h, i - j]`` from
auxiliary tensors.  Its derivative with respect to one gathered value is again an index
expression (:func:`derivative`: the chain rule over the tree; a value that only enters a
comparison or an integer index has none), and the gradient of the tensor is the cotangent times
that derivative *scattered back* along the gather's indices, clamped as the gather clamps them
(the adjoint of a gather, ``np.add.at``).  Two kinds carry this:

``index_map``    ``y = e(x, indices, gathers)`` elementwise: an index expression whose ``score``
                 leaf is the box's first input (a score modification that no simpler box
                 expresses: ``score * s[h]``, ``cap[h] * tanh(score / cap[h])``), and the
                 weights ``g * de/dv`` of the backward pass;
``scatter_aux``  ``out[clamp(idx(p))] += w[p]`` over every position ``p`` of its input: the
                 adjoint of one gather (its own adjoint is the gather, an ``index_map``).

>>> from napkin_cat.ops.index_expr import Aux, Ix
>>> from napkin_cat.core import Axis
>>> s, i, j = Ix("idx", (), "score"), Ix("idx", (), "i"), Ix("idx", (), "j")
>>> cap = Aux("cap", (Axis("n", 2),))[0]
>>> print(derivative(cap * ix.tanh(s / cap), cap))
tanh(score / cap[0]) + (cap[0] * ((-(score / (cap[0] * cap[0]))) * ((-square(tanh(score / cap[0]))) + 1.0)))
>>> derivative((i - j) * 2.0, s) is None
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.diagram import Array, Axis, Box, Ty
from ..core.errors import TypingError
from .functions import FUNCTIONS
from .index_expr import _clamp, Aux, Ix, ix, lift

SCORE = Ix("idx", (), "score")
ONE = Ix("const", (), 1.0)
_LN2 = math.log(2.0)


# --------------------------------------------------------------------------- the calculus

def _is_one(e) -> bool:
    return e is not None and e.op == "const" and not isinstance(e.value, bool) and e.value == 1


def _mul(a: Ix | None, b: Ix | None) -> Ix | None:
    if a is None or b is None:
        return None
    return b if _is_one(a) else a if _is_one(b) else a * b


def _add(a: Ix | None, b: Ix | None) -> Ix | None:
    return b if a is None else a if b is None else a + b


def _neg(a: Ix | None) -> Ix | None:
    return None if a is None else -a


def _or0(a: Ix | None) -> Ix:
    return Ix("const", (), 0.0) if a is None else a


def _where(c: Ix, a: Ix | None, b: Ix | None) -> Ix | None:
    if a is None and b is None:
        return None
    return ix.where(c, _or0(a), _or0(b))


class _IxTracer:
    """The tracer of :attr:`.functions.Function.derivative` on index expressions: ``t(name,
    *args, c=None)`` builds the node of that function, so each function's derivative is read
    from its one definition."""

    def __call__(self, fn: str, *a, c=None) -> Ix:
        if fn in _BUILD:
            return _BUILD[fn](*a, c)
        f = FUNCTIONS.get(fn)
        if f is None or f.arity != 1 or f.constant:
            raise TypingError(f"the derivative of an index expression needs the function {fn!r}, "
                              f"which is not in the index vocabulary (nc.ix)")
        return Ix("fn", (lift(a[0]),), fn)


_BUILD = {
    "add": lambda a, b, c: a + b, "sub": lambda a, b, c: a - b, "mul": lambda a, b, c: a * b,
    "div": lambda a, b, c: a / b, "neg": lambda a, c: -a, "scale": lambda a, c: a * float(c),
    "shift": lambda a, c: a + float(c), "maximum": lambda a, b, c: Ix("max", (a, b)),
    "equal": lambda a, b, c: ix.where(a == b, 1.0, 0.0), "identity": lambda a, c: a,
}


def derivative(e: Ix, wrt: Ix) -> Ix | None:
    """``de / d wrt`` as an index expression, ``wrt`` the ``score`` leaf or a gather node (every
    occurrence of it); None where it is zero everywhere.  Subgradients are torch's (``abs'(0) =
    0``, ties of ``min`` / ``max`` share equally); integer and boolean nodes are constant."""
    key = wrt.key()
    memo: dict = {}

    def d(n: Ix) -> Ix | None:
        k = n.key()
        if k == key:
            return ONE
        if n.dtype != "float" or n.op in ("idx", "size", "const", "gather"):
            return None   # conditions and integer indices are piecewise constant
        if k not in memo:
            memo[k] = _rule(n, d)
        return memo[k]

    return d(e)


def _rule(n: Ix, d) -> Ix | None:
    op, a = n.op, n.args
    if op == "add":
        return _add(d(a[0]), d(a[1]))
    if op == "sub":
        return _add(d(a[0]), _neg(d(a[1])))
    if op == "neg":
        return _neg(d(a[0]))
    if op == "mul":
        return _add(_mul(d(a[0]), a[1]), _mul(a[0], d(a[1])))
    if op == "truediv":     # (da - (a / b) db) / b, as torch's (g / b, -g a / b^2)
        da, db = d(a[0]), d(a[1])
        return _add(None if da is None else da / a[1], _mul(-(a[0] / (a[1] * a[1])), db))
    if op == "floordiv":
        return None
    if op == "mod":         # a - b floor(a / b)
        return _add(d(a[0]), _neg(_mul(a[0] // a[1], d(a[1]))))
    if op == "abs":
        da = d(a[0])
        return None if da is None else _where(a[0] > 0, da, _where(a[0] < 0, -da, None))
    if op in ("min", "max"):
        da, db = d(a[0]), d(a[1])
        if da is None and db is None:
            return None
        first = a[0] > a[1] if op == "max" else a[0] < a[1]
        second = a[0] < a[1] if op == "max" else a[0] > a[1]
        return _where(first, da, _where(second, db, _mul(_add(da, db), Ix("const", (), 0.5))))
    if op == "where":
        return _where(a[0], d(a[1]), d(a[2]))
    if op == "exp2":
        return _mul(n * _LN2, d(a[0]))
    if op == "log2":
        da = d(a[0])
        return None if da is None else da / (a[0] * _LN2)
    if op == "fn":
        da = d(a[0])
        f = FUNCTIONS[n.value]
        if da is None or f.derivative is None:
            if da is not None:
                raise TypingError(f"cannot differentiate {n}: {n.value!r} has no derivative in ops.functions")
            return None
        return f.derivative(_IxTracer(), da, n, a[0], c=None)[0]
    raise TypingError(f"cannot differentiate the index expression {n}: no rule for {op!r}")


def gathers(e: Ix) -> tuple[Ix, ...]:
    """The distinct gather nodes of ``e`` (one per tensor and index), in order of appearance."""
    out: dict = {}
    for n in e.walk():
        if n.op == "gather":
            out.setdefault(n.key(), n)
    return tuple(out.values())


# --------------------------------------------------------------------------- parameters

@dataclass(frozen=True, eq=False)
class IndexMap:
    """The expression of an ``index_map`` box, placed on its ``row`` / ``col`` axes (compared by
    structure: :meth:`Ix.same`)."""

    expr: Ix
    row: str
    col: str
    kind = "expr"

    @property
    def auxes(self) -> tuple[Aux, ...]:
        return self.expr.auxes()

    def index_axes(self) -> tuple[str, ...]:
        return tuple(n for n in self.expr.leaves("idx") if n != "score")

    def __eq__(self, other) -> bool:
        return isinstance(other, IndexMap) and (self.expr.key(), self.row, self.col) == \
            (other.expr.key(), other.row, other.col)

    def __hash__(self) -> int:
        return hash((self.expr.key(), self.row, self.col))

    def __repr__(self) -> str:
        return f"index_map({str(self.expr)!r})"


@dataclass(frozen=True, eq=False)
class GatherAt:
    """Where a ``scatter_aux`` box adds: the gather ``aux[index...]`` it is the adjoint of."""

    aux: Aux
    index: tuple

    def __eq__(self, other) -> bool:
        return isinstance(other, GatherAt) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self):
        return Ix("gather", self.index, self.aux).key()

    def __repr__(self) -> str:
        return f"scatter_at({self.aux.name}[{', '.join(map(str, self.index))}])"


# --------------------------------------------------------------------------- boxes

def _label(what: str, text: str) -> str:
    return f"{what} {text if len(text) <= 28 else text[:26] + '..'}"


def _check_aux(what: str, e: Ix, aux) -> tuple[Array, ...]:
    want = e.auxes()
    if len(aux) != len(want):
        raise TypingError(f"{what}: {e} gathers from {len(want)} auxiliary tensor(s) "
                          f"{[w.name for w in want]}, got {len(aux)} array(s)")
    for a, w in zip(aux, want):
        if not isinstance(a, Array) or a.axis_names != tuple(x.name for x in w.axes):
            raise TypingError(f"{what}: auxiliary input {a} does not match {w!r} (axes "
                              f"{' '.join(x.name for x in w.axes)})")
    return tuple(aux)


def _axis_name(arr: Array, axis) -> str:
    name = axis.name if isinstance(axis, Axis) else axis
    if name not in arr.axis_names:
        raise TypingError(f"{arr} has no axis {name!r}")
    return name


def index_map_box(arr: Array, row, col, expr: Ix, aux=(), name: str = "") -> Box:
    """``y = expr`` over ``arr`` (its ``score`` leaf the value of ``arr``), ``row`` / ``col`` the
    axes its ``i`` / ``j`` indices run along, ``aux`` the arrays its gathers read."""
    if not isinstance(expr, Ix) or expr.dtype == "bool":
        raise TypingError(f"index_map needs a value expression (an nc.ix expression), got {expr!r}")
    r, c = _axis_name(arr, row), _axis_name(arr, col)
    aux = _check_aux("index_map", expr, aux)
    return Box("index_map", Ty(arr, *aux), Ty(arr.named(name or arr.name)),
               (("row", r), ("col", c), ("fn", IndexMap(expr, r, c))), _label("map", str(expr)))


def scatter_aux_box(w: Array, target: Array, at: Ix, row, col, name: str = "") -> Box:
    """``out[clamp(index)] += w`` into an array typed ``target`` (the gathered tensor's axes,
    plus any woven axis ``w`` also has), ``at`` the gather node it is the adjoint of."""
    if not isinstance(at, Ix) or at.op != "gather":
        raise TypingError(f"scatter_aux needs a gather node (aux[index]), got {at!r}")
    aux = at.value
    names = [a.name for a in aux.axes]
    if [n for n in target.axis_names if n in names] != names:
        raise TypingError(f"scatter_aux into {target}: its axes must hold {aux!r}'s ({' '.join(names)}) in order")
    for n in target.axis_names:
        if n not in names and not w.has(n):
            raise TypingError(f"scatter_aux into {target}: axis {n} is neither {aux.name}'s nor one of {w}")
    for n in at.leaves("idx"):
        if not w.has(n):
            raise TypingError(f"scatter_aux {at}: its index reads axis {n}, which {w} does not have")
    r, c = _axis_name(w, row), _axis_name(w, col)
    return Box("scatter_aux", Ty(w), Ty(target.named(name or f"d{aux.name}")),
               (("row", r), ("col", c), ("at", GatherAt(aux, at.args))), _label("scatter", f"{aux.name}[..] +="))


# --------------------------------------------------------------------------- meaning (NumPy and torch)

def _env(xp, box: Box, x, names, ctx) -> dict:
    """Global indices of the axes ``names`` of the box's first input, shaped to broadcast."""
    arr, env = box.dom[0], {}
    for n in names:
        if n not in arr.axis_names:
            raise TypingError(f"{box.name}: its expression reads the index of axis {n}, which {arr} does not have")
        k = arr.axis_names.index(n)
        shape = [1] * len(x.shape)
        shape[k] = x.shape[k]
        env[n] = xp.indices_(x.shape[k], ctx.offsets.get(n, 0), None, x).reshape(shape)
    return env


def rule_index_map(box: Box, ins, ctx):
    xp, x, fn = ctx.xp, ins[0], box.param("fn")
    env = _env(xp, box, x, fn.index_axes(), ctx)
    env.update({("size", n): int(ctx.sizes[n]) for n in fn.expr.leaves("size")})
    env.update({a.name: v for a, v in zip(fn.auxes, ins[1:])})
    env["score"] = x
    with xp.quiet():
        y = xp.as_index_result(fn.expr.evaluate(xp, env), x, on=x)
    return (xp.broadcast_(y, tuple(x.shape)),)


def rule_scatter_aux(box: Box, ins, ctx):
    """``np.add.at`` (``index_add`` in torch: differentiable) at the clamped gather indices; an
    axis of the output that is not the tensor's (a woven one) keeps its position in ``w``'s block."""
    xp, w, at, dst = ctx.xp, ins[0], box.param("at"), box.cod[0]
    env = _env(xp, box, w, tuple(dict.fromkeys(n for k in at.index for n in k.leaves("idx"))), ctx)
    env.update({("size", n): int(ctx.sizes[n]) for k in at.index for n in k.leaves("size")})
    idx = dict(zip(_aux_names(at), at.index))
    src = box.dom[0].axis_names
    shape = [int(ctx.sizes.get(a.name, a.size)) if a.name in idx else int(w.shape[src.index(a.name)])
             for a in dst.axes]
    local = _env(xp, box, w, tuple(n for n in dst.axis_names if n not in idx), _Local)
    zero = xp.indices_(1, 0, None, w) * 0
    lin, stride = zero, 1
    for a, n in reversed(list(zip(dst.axis_names, shape))):
        k = _clamp(xp, idx[a].evaluate(xp, env), n) if a in idx else local[a]
        lin = lin + k * stride
        stride *= n
    lin = xp.broadcast_(lin + zero.reshape([1] * len(w.shape)), tuple(w.shape))
    if xp.name == "torch":
        out = xp.zeros(stride, dtype=w.dtype, device=w.device).index_add(0, lin.reshape(-1), w.reshape(-1))
    else:
        out = xp.zeros(stride, dtype=w.dtype)
        xp.add.at(out, lin.reshape(-1), w.reshape(-1))
    return (out.reshape(shape),)


class _Local:
    """No offsets: the positions inside the block at hand."""

    offsets: dict = {}


def _aux_names(at: GatherAt) -> tuple[str, ...]:
    return tuple(a.name for a in at.aux.axes)
