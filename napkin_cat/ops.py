"""The vocabulary: box kinds, their typing rules, and a builder for diagrams.

Every box acts on *named* axes, so every kind broadcasts over axes it does not mention: that
is what makes weaving one generic rule (:func:`weave_box`).  Kinds:

``contract``  einsum over named axes: output axes are the cod's, the rest are summed
``map``       an elementwise function (table :data:`FUNCTIONS`), unary or binary, by name
``reduce``    sum / max / min / mean / logsumexp over one axis
``softmax``   softmax over one axis (rows that are all ``-inf`` give zeros)
``normalize`` ``a1(x_i) / b(sum_j a2(x_j))`` over one axis (the streamable family)
``mask``      ``where(pred(i, j), x, -inf)`` from global indices of two axes
``index_bias`` ``x + bias(i, j)`` computed from global indices (ALiBi-like)
``reindex``   transpose, split, merge, slice, diagonal
``param``     a named parameter (no inputs; value passed at evaluation)
``const``     an array filled with a constant
``cast``      change of dtype
``softmax_contract`` / ``norm_contract``  fused accumulators produced by rewrite rules

The NumPy meaning of each kind is in :mod:`napkin_cat.semantics`, its cost in
:mod:`napkin_cat.cost`, its lowering in :mod:`napkin_cat.lower`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .core import Array, Axis, Box, Diagram, DType, Eqn, Ty, f32
from .errors import TypingError

KINDS = ("contract", "map", "reduce", "softmax", "normalize", "mask", "index_bias", "reindex",
         "param", "const", "cast", "softmax_contract", "norm_contract")

# name -> arity; the NumPy / torch implementations live in semantics.FUNCTION_IMPLS
UNARY = ("exp", "log", "neg", "abs", "square", "sqrt", "rsqrt", "relu", "gelu", "silu",
         "sigmoid", "tanh", "scale", "shift", "recip", "identity", "sign")
BINARY = ("add", "sub", "mul", "div", "maximum")
FUNCTIONS = {**{n: 1 for n in UNARY}, **{n: 2 for n in BINARY}}
REDUCTIONS = ("sum", "max", "min", "mean", "logsumexp")


# --------------------------------------------------------------------------- parameter values

@dataclass(frozen=True, slots=True)
class AxisPower:
    """A constant ``coeff * size(axis) ** power`` known once sizes are bound (1/sqrt(d))."""

    axis: Axis
    power: float = -0.5
    coeff: float = 1.0

    def value(self, sizes: dict) -> float:
        n = sizes.get(self.axis.name, self.axis.size)
        if isinstance(n, str):
            raise TypingError(f"constant depends on the size of axis {self.axis.name}, which is not bound")
        return self.coeff * float(n) ** self.power

    def bind(self, sizes):  # Box.bind reaches it through core._bind_param
        return AxisPower(self.axis.bind(sizes), self.power, self.coeff)

    def __repr__(self) -> str:
        return f"AxisPower({self.axis!r}, {self.power!r}, {self.coeff!r})"


def constant_value(c, sizes: dict) -> float:
    return c.value(sizes) if isinstance(c, AxisPower) else float(c)


@dataclass(frozen=True, slots=True)
class Predicate:
    """An index predicate ``pred(i, j)`` on global row index ``i`` and column index ``j``.

    ``causal``: ``j <= i + offset``; ``window``: ``i - left <= j <= i + right``;
    ``custom``: ``fn(i, j)`` on broadcast index arrays (``fn`` must be vectorised)."""

    kind: str
    args: tuple = ()
    fn: Callable | None = None

    def __call__(self, i, j):
        if self.kind == "causal":
            return j <= i + self.args[0]
        if self.kind == "window":
            left, right = self.args
            return (j >= i - left) & (j <= i + right)
        if self.kind == "custom":
            return self.fn(i, j)
        raise TypingError(f"unknown predicate kind {self.kind!r}")

    def __repr__(self) -> str:
        if self.kind == "custom":
            return f"Predicate('custom', {self.args!r}, {getattr(self.fn, '__name__', self.fn)})"
        return f"Predicate({self.kind!r}, {self.args!r})"


def _int_arg(what: str, value, minimum: int | None = None) -> int:
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


def causal(offset: int = 0) -> Predicate:
    return Predicate("causal", (_int_arg("causal offset", offset),))


def window(left: int, right: int = 0) -> Predicate:
    """Keep ``i - left <= j <= i + right``; ``window(0)`` is the diagonal (only ``j == i``)."""
    return Predicate("window", (_int_arg("window left size", left, 0), _int_arg("window right size", right, 0)))


def predicate(fn: Callable, name: str = "custom") -> Predicate:
    if not callable(fn):
        raise TypingError(f"predicate needs a callable fn(i, j), got {fn!r}")
    if not isinstance(name, str):
        raise TypingError(f"predicate name must be a str, got {name!r}")
    return Predicate("custom", (name,), fn)


@dataclass(frozen=True, slots=True)
class IndexBias:
    """``bias(i, j)``: ``alibi``: ``slope * (j - i)``; ``custom``: ``fn(i, j)``."""

    kind: str
    args: tuple = ()
    fn: Callable | None = None

    def __call__(self, i, j):
        if self.kind == "alibi":
            return self.args[0] * (j - i)
        if self.kind == "custom":
            return self.fn(i, j)
        raise TypingError(f"unknown index bias kind {self.kind!r}")


def alibi(slope: float) -> IndexBias:
    return IndexBias("alibi", (real_number("alibi slope", slope),))


def _check_arrays(what: str, arrays) -> None:
    for a in arrays:
        if not isinstance(a, Array):
            raise TypingError(f"{what}: expected Array values, got {a!r}")


def _check_dtype(what: str, dtype) -> None:
    if not isinstance(dtype, DType):
        from .core import DTYPES
        raise TypingError(f"{what}: dtype must be a napkin_cat DType (e.g. nc.f16), got {dtype!r}; "
                          f"known: {sorted(DTYPES)}")


# --------------------------------------------------------------------------- typing helpers

def _union_axes(arrays: Sequence[Array]) -> tuple[Axis, ...]:
    seen: dict[str, Axis] = {}
    for a in arrays:
        for ax in a.axes:
            if ax.name in seen and seen[ax.name] != ax:
                raise TypingError(f"axis {ax.name} has size {seen[ax.name].size} in one input and "
                                  f"{ax.size} in another: {', '.join(map(str, arrays))}")
            seen.setdefault(ax.name, ax)
    return tuple(seen.values())


def _find(arr: Array, axis: Axis | str) -> Axis:
    if not isinstance(axis, (Axis, str)):
        raise TypingError(f"{arr}: expected an Axis or an axis name, got {axis!r}")
    name = axis if isinstance(axis, str) else axis.name
    for ax in arr.axes:
        if ax.name == name:
            if isinstance(axis, Axis) and ax != axis:
                raise TypingError(f"{arr} has axis {ax.describe()}, asked for {axis.describe()}")
            return ax
    raise TypingError(f"{arr} has no axis {name!r}")


def _drop(arr: Array, axis: Axis, name: str, dtype: DType | None = None) -> Array:
    return Array(tuple(a for a in arr.axes if a.name != axis.name), dtype or arr.dtype, name)


# --------------------------------------------------------------------------- box constructors

def contract_box(dom: Sequence[Array], out_axes: Sequence[Axis], name: str = "C",
                 dtype: DType | None = None) -> Box:
    union = _union_axes(dom)
    names = {a.name for a in union}
    for ax in out_axes:
        if ax.name not in names or ax not in union:
            raise TypingError(f"contract: output axis {ax.describe()} is on no input "
                              f"({', '.join(map(str, dom))})")
    cod = Array(tuple(out_axes), dtype or dom[0].dtype, name)
    return Box("contract", Ty(*dom), Ty(cod), (), "contract")


def map_box(fn: str, dom: Sequence[Array], name: str = "", c=None, out_axes=None) -> Box:
    _check_arrays(f"map {fn!r}", dom)
    if not isinstance(fn, str) or fn not in FUNCTIONS:
        raise TypingError(f"unknown elementwise function {fn!r}; known: {sorted(FUNCTIONS)}")
    if FUNCTIONS[fn] != len(dom):
        raise TypingError(f"{fn} takes {FUNCTIONS[fn]} input(s), got {len(dom)}: {', '.join(map(str, dom))}")
    if fn in ("scale", "shift") and c is None:
        raise TypingError(f"{fn} needs a constant c")
    if c is not None:
        if fn not in ("scale", "shift"):
            raise TypingError(f"{fn} takes no constant c (only scale and shift do), got c={c!r}")
        if not isinstance(c, AxisPower):
            real_number(f"{fn} constant c", c)  # validated; the value is stored as given
    union = _union_axes(dom)
    if out_axes is not None:
        if {a.name for a in out_axes} != {a.name for a in union}:
            raise TypingError(f"{fn}: output axes {[a.name for a in out_axes]} must be a permutation "
                              f"of {[a.name for a in union]}")
        union = tuple(out_axes)
    cod = Array(union, dom[0].dtype, name or dom[0].name)
    params = (("fn", fn),) + ((("c", c),) if c is not None else ())
    return Box("map", Ty(*dom), Ty(cod), params, fn)


def reduce_box(op: str, arr: Array, axis: Axis, name: str = "") -> Box:
    _check_arrays(f"reduce {op!r}", (arr,))
    if not isinstance(op, str) or op not in REDUCTIONS:
        raise TypingError(f"unknown reduction {op!r}; known: {list(REDUCTIONS)}")
    ax = _find(arr, axis)
    return Box("reduce", Ty(arr), Ty(_drop(arr, ax, name or f"{op}_{ax.name}")),
               (("op", op), ("axis", ax.name)), f"{op}[{ax.name}]")


def softmax_box(arr: Array, axis: Axis, name: str = "P") -> Box:
    ax = _find(arr, axis)
    return Box("softmax", Ty(arr), Ty(arr.named(name)), (("axis", ax.name),), f"softmax[{ax.name}]")


# the normalisation family N(x)_i = a1(x_i) / b(sum_j a2(x_j)); names from FUNCTIONS
NORMALISATIONS = {
    "softmax": ("exp", "exp", "identity"),   # evaluated with max-subtraction
    "l2": ("identity", "square", "sqrt"),
    "l1": ("identity", "abs", "identity"),
    "sigmoid_sum": ("sigmoid", "sigmoid", "identity"),
}


def normalize_box(arr: Array, axis: Axis, a1: str, a2: str, b: str, name: str = "N", eps: float = 0.0) -> Box:
    ax = _find(arr, axis)
    for f in (a1, a2, b):
        if not isinstance(f, str) or FUNCTIONS.get(f) != 1 or f in ("scale", "shift"):
            raise TypingError(f"normalize: {f!r} is not a unary function without constant")
    eps = real_number("normalize eps", eps)
    return Box("normalize", Ty(arr), Ty(arr.named(name)),
               (("axis", ax.name), ("a1", a1), ("a2", a2), ("b", b), ("eps", float(eps))),
               f"norm[{ax.name}]({a1}/{b}(sum {a2}))")


def mask_box(arr: Array, row: Axis, col: Axis, pred: Predicate, name: str = "") -> Box:
    if not isinstance(pred, Predicate):
        raise TypingError(f"mask needs a Predicate (nc.causal(), nc.window(n), nc.predicate(fn)), got {pred!r}")
    r, c = _find(arr, row), _find(arr, col)
    return Box("mask", Ty(arr), Ty(arr.named(name or arr.name)),
               (("row", r.name), ("col", c.name), ("pred", pred)), f"mask {pred.kind}")


def index_bias_box(arr: Array, row: Axis, col: Axis, bias: IndexBias, name: str = "") -> Box:
    if not isinstance(bias, IndexBias):
        raise TypingError(f"index_bias needs an IndexBias (e.g. nc.alibi(0.5)), got {bias!r}")
    r, c = _find(arr, row), _find(arr, col)
    return Box("index_bias", Ty(arr), Ty(arr.named(name or arr.name)),
               (("row", r.name), ("col", c.name), ("bias", bias)), f"bias {bias.kind}")


def transpose_box(arr: Array, order: Sequence[Axis | str], name: str = "") -> Box:
    new = tuple(_find(arr, a) for a in order)
    if len(new) != len(arr.axes):
        raise TypingError(f"transpose of {arr}: order {[getattr(a, 'name', a) for a in order]} "
                          f"must name every axis")
    return Box("reindex", Ty(arr), Ty(arr.with_axes(new).named(name or arr.name)),
               (("op", "transpose"),), "transpose")


def split_box(arr: Array, axis: Axis, outer: Axis, inner: Axis, name: str = "") -> Box:
    ax = _find(arr, axis)
    if not (ax.symbolic or outer.symbolic or inner.symbolic) and ax.size != outer.size * inner.size:
        raise TypingError(f"split {ax.describe()} into {outer.describe()} x {inner.describe()}: sizes do not multiply")
    new = []
    for a in arr.axes:
        new.extend((outer, inner) if a.name == ax.name else (a,))
    return Box("reindex", Ty(arr), Ty(arr.with_axes(new).named(name or arr.name)),
               (("op", "split"), ("axis", ax.name), ("outer", outer.name), ("inner", inner.name)),
               f"split {ax.name}")


def merge_box(arr: Array, outer: Axis, inner: Axis, merged: Axis, name: str = "") -> Box:
    o, i = _find(arr, outer), _find(arr, inner)
    names = arr.axis_names
    if names.index(i.name) != names.index(o.name) + 1:
        raise TypingError(f"merge needs {o.name} immediately before {i.name} in {arr}")
    if not (o.symbolic or i.symbolic or merged.symbolic) and merged.size != o.size * i.size:
        raise TypingError(f"merge {o.describe()} x {i.describe()} into {merged.describe()}: sizes do not multiply")
    new = []
    for a in arr.axes:
        if a.name == o.name:
            new.append(merged)
        elif a.name != i.name:
            new.append(a)
    return Box("reindex", Ty(arr), Ty(arr.with_axes(new).named(name or arr.name)),
               (("op", "merge"), ("outer", o.name), ("inner", i.name), ("axis", merged.name)), "merge")


def slice_box(arr: Array, axis: Axis, start: int, stop: int, new: Axis, name: str = "") -> Box:
    ax = _find(arr, axis)
    if not new.symbolic and new.size != stop - start:
        raise TypingError(f"slice {ax.name}[{start}:{stop}] has {stop - start} entries, new axis says {new.size}")
    if not ax.symbolic and not (0 <= start < stop <= ax.size):
        raise TypingError(f"slice {ax.name}[{start}:{stop}] out of range for size {ax.size}")
    axes_ = tuple(new if a.name == ax.name else a for a in arr.axes)
    return Box("reindex", Ty(arr), Ty(arr.with_axes(axes_).named(name or arr.name)),
               (("op", "slice"), ("axis", ax.name), ("start", int(start)), ("stop", int(stop)),
                ("new", new.name)), f"slice {ax.name}")


def diagonal_box(arr: Array, a: Axis, b: Axis, name: str = "") -> Box:
    x, y = _find(arr, a), _find(arr, b)
    if x.size != y.size:
        raise TypingError(f"diagonal of {x.describe()} and {y.describe()}: sizes differ")
    return Box("reindex", Ty(arr), Ty(_drop(arr, y, name or arr.name)),
               (("op", "diagonal"), ("keep", x.name), ("drop", y.name)), "diagonal")


def param_box(arr: Array) -> Box:
    return Box("param", Ty(), Ty(arr), (("pname", arr.name),), arr.name)


def const_box(arr: Array, value: float) -> Box:
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise TypingError(f"const {arr.name}: value must be a real number, got {value!r}")
    try:
        value = float(value)  # +-inf is a legitimate constant (the initial running max)
    except (TypeError, ValueError):
        raise TypingError(f"const {arr.name}: value must be a real number, got {value!r}") from None
    if math.isnan(value):
        raise TypingError(f"const {arr.name}: value must not be NaN")
    return Box("const", Ty(), Ty(arr), (("value", value),), f"const {value:g}")


def cast_box(arr: Array, dtype: DType) -> Box:
    _check_dtype(f"cast of {arr}", dtype)
    return Box("cast", Ty(arr), Ty(arr.with_dtype(dtype)), (("dtype", dtype.name),), f"cast {dtype.name}")


def softmax_contract_box(scores: Array, values: Array, axis: Axis, out_axes: Sequence[Axis],
                         name: str = "O") -> Box:
    ax = _find(scores, axis)
    _find(values, ax)
    union = _union_axes((scores, values))
    if ax.name in [a.name for a in out_axes] or not set(a.name for a in out_axes) <= {a.name for a in union}:
        raise TypingError("softmax_contract: output axes must come from the inputs and omit the contracted axis")
    cod = Array(tuple(out_axes), values.dtype, name)
    return Box("softmax_contract", Ty(scores, values), Ty(cod), (("axis", ax.name),),
               f"softmax-contract[{ax.name}]")


def norm_contract_box(scores: Array, values: Array, axis: Axis, out_axes: Sequence[Axis],
                      a1: str, a2: str, b: str, eps: float, name: str = "O") -> Box:
    ax = _find(scores, axis)
    _find(values, ax)
    cod = Array(tuple(out_axes), values.dtype, name)
    return Box("norm_contract", Ty(scores, values), Ty(cod),
               (("axis", ax.name), ("a1", a1), ("a2", a2), ("b", b), ("eps", float(eps))),
               f"norm-contract[{ax.name}]")


# --------------------------------------------------------------------------- weaving

def weave_box(box: Box, axis: Axis, has: Sequence[bool]) -> Box:
    """Re-type ``box`` for inputs that gained ``axis`` (``has[i]``): every output gets it first.

    Valid for every kind because every kind is defined on named axes and broadcasts over the
    axes it does not mention."""
    if box.kind not in KINDS:
        from .errors import UnknownKindError
        raise UnknownKindError(f"cannot weave box {box.name!r}: unknown kind {box.kind!r}")
    dom = Ty(*(a.with_axes((axis, *a.axes)) if h else a for a, h in zip(box.dom, has)))
    cod = Ty(*(a.with_axes((axis, *a.axes)) for a in box.cod))
    return Box(box.kind, dom, cod, box.params, box.name)


# --------------------------------------------------------------------------- builder

class Builder:
    """Build a diagram by tracing: ``Q = b.input("Q", q, d)``, ``S = b.contract(Q, K, out=(q, x))``.

    Each call appends one equation and returns a :class:`Wire` handle; :meth:`diagram`
    closes the trace with the chosen outputs."""

    def __init__(self, dtype: DType = f32):
        _check_dtype("Builder", dtype)
        self.dtype = dtype
        self._inputs: list[Array] = []
        self._eqns: list[Eqn] = []
        self._types: list[Array] = []

    # wires
    def input(self, name: str, *axes_: Axis, dtype: DType | None = None) -> "Wire":
        if self._eqns:
            raise TypingError("declare every input before the first operation")
        if dtype is not None:
            _check_dtype(f"input {name}", dtype)
        arr = Array(tuple(axes_), dtype or self.dtype, name)
        self._inputs.append(arr)
        self._types.append(arr)
        return Wire(self, len(self._types) - 1)

    def _apply(self, box: Box, *wires: "Wire") -> tuple["Wire", ...]:
        self._wires(box.name, wires)
        ins = tuple(w.var for w in wires)
        for w, a in zip(wires, box.dom):
            if self._types[w.var] != a:
                raise TypingError(f"{box.name}: wire {self._types[w.var]} does not match {a}")
        self._eqns.append(Eqn(box, ins))
        start = len(self._types)
        self._types.extend(box.cod)
        return tuple(Wire(self, v) for v in range(start, len(self._types)))

    def box(self, box: Box, *wires: "Wire"):
        outs = self._apply(box, *wires)
        return outs[0] if len(outs) == 1 else outs

    def _wires(self, what: str, wires) -> None:
        for w in wires:
            if not isinstance(w, Wire) or w.builder is not self:
                raise TypingError(f"{what}: expected a wire of this Builder (from b.input or an operation), got {w!r}")

    def ty(self, w: "Wire") -> Array:
        self._wires("Builder", (w,))
        return self._types[w.var]

    # operations
    def contract(self, *wires: "Wire", out: Sequence[Axis], name: str = "C") -> "Wire":
        return self.box(contract_box([self.ty(w) for w in wires], out, name), *wires)

    def map(self, fn: str, *wires: "Wire", c=None, name: str = "", out=None) -> "Wire":
        return self.box(map_box(fn, [self.ty(w) for w in wires], name, c, out), *wires)

    def reduce(self, op: str, w: "Wire", axis: Axis, name: str = "") -> "Wire":
        return self.box(reduce_box(op, self.ty(w), axis, name), w)

    def softmax(self, w: "Wire", axis: Axis, name: str = "P") -> "Wire":
        return self.box(softmax_box(self.ty(w), axis, name), w)

    def normalize(self, w: "Wire", axis: Axis, a1: str, a2: str, b: str, name: str = "N", eps: float = 0.0) -> "Wire":
        return self.box(normalize_box(self.ty(w), axis, a1, a2, b, name, eps), w)

    def mask(self, w: "Wire", row: Axis, col: Axis, pred: Predicate) -> "Wire":
        return self.box(mask_box(self.ty(w), row, col, pred), w)

    def index_bias(self, w: "Wire", row: Axis, col: Axis, bias: IndexBias) -> "Wire":
        return self.box(index_bias_box(self.ty(w), row, col, bias), w)

    def param(self, name: str, *axes_: Axis, dtype: DType | None = None) -> "Wire":
        if dtype is not None:
            _check_dtype(f"param {name}", dtype)
        return self.box(param_box(Array(tuple(axes_), dtype or self.dtype, name)))

    def const(self, value: float, *axes_: Axis, name: str = "c") -> "Wire":
        return self.box(const_box(Array(tuple(axes_), self.dtype, name), value))

    def transpose(self, w: "Wire", *order: Axis) -> "Wire":
        return self.box(transpose_box(self.ty(w), order), w)

    def cast(self, w: "Wire", dtype: DType) -> "Wire":
        return self.box(cast_box(self.ty(w), dtype), w)

    def diagram(self, *outs: "Wire", names: Sequence[str] | None = None) -> Diagram:
        self._wires("diagram", outs)
        if names is not None and (isinstance(names, str) or len(names) != len(outs)):
            raise TypingError(f"diagram: names={names!r} must give one name per output ({len(outs)})")
        cod = [self._types[w.var] for w in outs]
        if names:
            cod = [a.named(n) for a, n in zip(cod, names)]
            # renaming the producing equation's output keeps var types and cod consistent
            eqns = list(self._eqns)
            for w, n in zip(outs, names):
                eqns = _rename_var(eqns, len(self._inputs), w.var, n)
            return Diagram(Ty(*self._inputs), Ty(*cod), tuple(eqns), tuple(w.var for w in outs))
        return Diagram(Ty(*self._inputs), Ty(*cod), tuple(self._eqns), tuple(w.var for w in outs))


def _rename_var(eqns: list[Eqn], n_inputs: int, var: int, name: str) -> list[Eqn]:
    if var < n_inputs:
        return eqns
    v = n_inputs
    out = []
    for e in eqns:
        cod = list(e.box.cod)
        for k in range(len(cod)):
            if v + k == var:
                cod[k] = cod[k].named(name)
        v += len(cod)
        out.append(Eqn(Box(e.box.kind, e.box.dom, Ty(*cod), e.box.params, e.box.name), e.ins))
    return out


@dataclass(frozen=True)
class Wire:
    builder: Builder
    var: int

    @property
    def ty(self) -> Array:
        return self.builder._types[self.var]

    def __add__(self, other):
        return self.builder.map("add", self, other)

    def __sub__(self, other):
        return self.builder.map("sub", self, other)

    def __mul__(self, other):
        if isinstance(other, Wire):
            return self.builder.map("mul", self, other)
        return self.builder.map("scale", self, c=other)

    def __truediv__(self, other):
        return self.builder.map("div", self, other)


# --------------------------------------------------------------------------- one-box diagrams

def op(fn: str, *arrays: Array, c=None) -> Diagram:
    """A one-box elementwise diagram: ``op("exp", Array((q, x)))``."""
    return map_box(fn, arrays, c=c).diagram()


def contract(spec: str, *arrays: Array) -> Diagram:
    """``contract("q d, x d -> q x", Q, K)``: the names in ``spec`` must match the arrays'."""
    if not isinstance(spec, str) or spec.count("->") != 1:
        raise TypingError(f"contract spec must be a string 'in, in -> out', got {spec!r}")
    _check_arrays(f"contract {spec!r}", arrays)
    lhs, rhs = spec.split("->")
    ins = [s.split() for s in lhs.split(",")]
    if len(ins) != len(arrays):
        raise TypingError(f"contract {spec!r}: {len(ins)} operands in the spec, {len(arrays)} arrays given")
    for names, arr in zip(ins, arrays):
        if tuple(names) != arr.axis_names:
            raise TypingError(f"contract {spec!r}: operand {arr} does not read {' '.join(names)}")
    union = {a.name: a for arr in arrays for a in arr.axes}
    out = []
    for n in rhs.split():
        if n not in union:
            raise TypingError(f"contract {spec!r}: output axis {n} is on no operand")
        out.append(union[n])
    return contract_box(arrays, out).diagram()
