"""Box constructors: the typing rule of every kind, and weaving.

Every box acts on *named* axes, so every kind broadcasts over axes it does not mention: that
is what makes weaving one generic rule (:func:`weave_box`).  The kinds and their traits are in
:mod:`.kinds`; the elementwise functions in :mod:`.functions`; masks and biases in :mod:`.index`.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..core.diagram import Array, Axis, Box, Diagram, DType, Eqn, Ty
from ..core.errors import TypingError, UnknownKindError
from ..core.types import f32
from .functions import FUNCTIONS
from .index import AxisPower, IndexBias, Predicate, bound_to, real_number
from .index_expr import Ix
from .kinds import KINDS, REDUCTIONS


def _check_arrays(what: str, arrays) -> None:
    for a in arrays:
        if not isinstance(a, Array):
            raise TypingError(f"{what}: expected Array values, got {a!r}")


def _check_dtype(what: str, dtype) -> None:
    if not isinstance(dtype, DType):
        from ..core.diagram import DTYPES
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
    if FUNCTIONS[fn].arity != len(dom):
        raise TypingError(f"{fn} takes {FUNCTIONS[fn].arity} input(s), got {len(dom)}: {', '.join(map(str, dom))}")
    if FUNCTIONS[fn].constant and c is None:
        raise TypingError(f"{fn} needs a constant c")
    if c is not None:
        if not FUNCTIONS[fn].constant:
            raise TypingError(f"{fn} takes no constant c (only functions with a constant do), got c={c!r}")
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


def normalize_box(arr: Array, axis: Axis, a1: str, a2: str, b: str, name: str = "N", eps: float = 0.0) -> Box:
    ax = _find(arr, axis)
    for f in (a1, a2, b):
        if not isinstance(f, str) or f not in FUNCTIONS or FUNCTIONS[f].arity != 1 or FUNCTIONS[f].constant:
            raise TypingError(f"normalize: {f!r} is not a unary function without constant")
    eps = real_number("normalize eps", eps)
    return Box("normalize", Ty(arr), Ty(arr.named(name)),
               (("axis", ax.name), ("a1", a1), ("a2", a2), ("b", b), ("eps", float(eps))),
               f"norm[{ax.name}]({a1}/{b}(sum {a2}))")


def _aux_inputs(what: str, fn, aux) -> tuple:
    """The auxiliary arrays of an index expression's box: one per tensor it gathers from, in
    order of first appearance, each over that tensor's axes (the box's inputs after the first)."""
    aux = tuple(aux)
    _check_arrays(what, aux)
    want = fn.auxes
    if len(aux) != len(want):
        raise TypingError(f"{what}: {fn!r} gathers from {len(want)} auxiliary tensor(s) "
                          f"{[w.name for w in want]}, got {len(aux)} array(s)")
    for a, w in zip(aux, want):
        if a.axis_names != tuple(x.name for x in w.axes):
            raise TypingError(f"{what}: auxiliary input {a} does not match {w!r} (axes "
                              f"{' '.join(x.name for x in w.axes)})")
    return aux


def _expr_label(what: str, fn) -> str:
    if fn.kind != "expr":
        return f"{what} {fn.kind}"
    text = str(fn.expr)
    return f"{what} {text if len(text) <= 28 else text[:26] + '..'}"


def mask_box(arr: Array, row: Axis, col: Axis, pred: Predicate, name: str = "", aux: Sequence[Array] = ()) -> Box:
    if not isinstance(pred, Predicate):
        raise TypingError(f"mask needs a Predicate (nc.causal(), nc.window(n), nc.predicate(fn)), got {pred!r}")
    r, c = _find(arr, row), _find(arr, col)
    pred = bound_to(pred, r.name, c.name, "mask")
    aux = _aux_inputs("mask", pred, aux)
    return Box("mask", Ty(arr, *aux), Ty(arr.named(name or arr.name)),
               (("row", r.name), ("col", c.name), ("pred", pred)), _expr_label("mask", pred))


def index_bias_box(arr: Array, row: Axis, col: Axis, bias: IndexBias, name: str = "",
                   aux: Sequence[Array] = ()) -> Box:
    if not isinstance(bias, IndexBias):
        raise TypingError(f"index_bias needs an IndexBias (e.g. nc.alibi(0.5)), got {bias!r}")
    r, c = _find(arr, row), _find(arr, col)
    bias = bound_to(bias, r.name, c.name, "index_bias")
    aux = _aux_inputs("index_bias", bias, aux)
    return Box("index_bias", Ty(arr, *aux), Ty(arr.named(name or arr.name)),
               (("row", r.name), ("col", c.name), ("bias", bias)), _expr_label("bias", bias))


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


def rename_box(arr: Array, axis: Axis | str, new: Axis, name: str = "") -> Box:
    """The same values with ``axis`` called ``new`` (same size): self-attention's keys read the
    queries' token axis under a second name."""
    ax = _find(arr, axis)
    if not isinstance(new, Axis):
        raise TypingError(f"rename {ax.name} of {arr}: the new axis must be an Axis, got {new!r}")
    if new.size != ax.size:
        raise TypingError(f"rename {ax.describe()} to {new.describe()} in {arr}: sizes differ")
    if new.name != ax.name and arr.has(new):
        raise TypingError(f"rename {ax.name} to {new.name}: {arr} already has an axis {new.name}")
    axes_ = tuple(new if a.name == ax.name else a for a in arr.axes)
    return Box("reindex", Ty(arr), Ty(arr.with_axes(axes_).named(name or arr.name)),
               (("op", "rename"), ("axis", ax.name), ("new", new.name)), f"{ax.name}→{new.name}")


def _int_param(what: str, value, low: int | None = None, nonzero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
            or (nonzero and value == 0):
        need = f"an int >= {low}" if low is not None else ("a non-zero int" if nonzero else "an int")
        raise TypingError(f"{what} must be {need}, got {value!r}")
    return value


def unfold_box(arr: Array, axis: Axis | str, new: Axis, window: Axis | None = None, *, stride: int = 1,
               dilation: int = 1, offset: int = 0, divisor: int = 1, name: str = "") -> Box:
    """Sliding windows along ``axis``, zero outside: ``axis`` is replaced by ``new`` (and
    ``window`` after it) with ``out[.., y, k, ..] = x[.., (stride*y + dilation*k + offset) / divisor, ..]``
    where that index is an integer inside ``axis``, else ``0``.

    A convolution is an unfolding then a contraction; ``offset = -padding`` pads with zeros,
    ``divisor = stride`` with ``dilation < 0`` reads a transposed convolution's windows; without
    ``window`` it pads, shifts or zero-upsamples ``axis`` into ``new``."""
    ax = _find(arr, axis)
    for a in (new,) + (() if window is None else (window,)):
        if not isinstance(a, Axis):
            raise TypingError(f"unfold {ax.name} of {arr}: new axes must be Axis values, got {a!r}")
        if a.name != ax.name and arr.has(a):
            raise TypingError(f"unfold {ax.name} into {a.name}: {arr} already has an axis {a.name}")
    if window is not None and window.name == new.name:
        raise TypingError(f"unfold {ax.name}: the window axis and the new axis are both named {new.name}")
    what = f"unfold {ax.name} of {arr}"
    stride, divisor = _int_param(f"{what}: stride", stride, 1), _int_param(f"{what}: divisor", divisor, 1)
    dilation = _int_param(f"{what}: dilation", dilation, nonzero=window is not None)
    offset = _int_param(f"{what}: offset", offset)
    axes_ = []
    for a in arr.axes:
        axes_.extend(((new,) if window is None else (new, window)) if a.name == ax.name else (a,))
    params = (("op", "unfold"), ("axis", ax.name), ("new", new.name), ("stride", stride),
              ("dilation", dilation), ("offset", offset), ("divisor", divisor))
    params += (("window", window.name),) if window is not None else ()
    label = f"unfold {ax.name}" if window is not None else f"pad {ax.name}"
    return Box("reindex", Ty(arr), Ty(arr.with_axes(axes_).named(name or arr.name)), params, label)


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
        raise UnknownKindError(f"cannot weave box {box.name!r}: unknown kind {box.kind!r}")
    dom = Ty(*(a.with_axes((axis, *a.axes)) if h else a for a, h in zip(box.dom, has)))
    cod = Ty(*(a.with_axes((axis, *a.axes)) for a in box.cod))
    return Box(box.kind, dom, cod, box.params, box.name)




# --------------------------------------------------------------------------- retyping

def exact_inputs(d: Diagram) -> tuple[str, ...]:
    """The inputs of ``d`` whose values an index function compares (document ids in
    ``doc[i] == doc[j]``): they decide which entries are kept, so they travel in f32 (exact for
    integers up to 2**24) whatever the diagram's dtype (:func:`napkin_cat.aux`, :func:`retype`)."""
    names = {a.name for a in d.dom}
    out: dict[str, None] = {}
    for e in d.eqns:
        for _, p in e.box.params:
            expr = p if isinstance(p, Ix) else getattr(p, "expr", None)
            if isinstance(expr, Ix):
                out.update(dict.fromkeys(n for n in expr.compared_auxes() if n in names))
    return tuple(out)


def retype(d: Diagram, dtype: DType, fixed: dict | None = None) -> Diagram:
    """``d`` (unrelabelled) with every float wire in ``dtype``, except the inputs and outputs
    named in ``fixed`` (``{name: dtype}``), which get theirs, and the inputs an index function
    compares (:func:`exact_inputs`), which stay f32.  The boxes are the same kinds with
    the same parameters (a cast's target follows its output); ``d`` is not changed, and is
    returned itself when no wire changes.  What the lowering reads: a kernel's inputs and
    outputs travel in their wires' dtypes and it computes in fp32 between them.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> att = nc.library.attention(q, x, d, logsumexp=True).stream(x, 16)
    >>> print(retype(att, nc.bf16, fixed={"L": nc.f32}))
    Q[q d] bf16, K[x d] bf16, V[x d] bf16 -> O[q d] bf16, L[q] f32
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"retype needs a Diagram, got {type(d).__name__}")
    _check_dtype("retype", dtype)
    fixed = {**{n: f32 for n in exact_inputs(d)}, **(fixed or {})}
    for name, dt in fixed.items():
        _check_dtype(f"retype: fixed {name}", dt)
    d = d.unrelabelled() if d.schedule else d
    named = {v: a.name for v, a in zip(d.outs, d.cod)} | {v: a.name for v, a in enumerate(d.dom)}
    new = [fixed[named[v]] if named.get(v) in fixed else dtype if a.dtype.kind == "float" else a.dtype
           for v, a in enumerate(d.var_types())]
    if all(dt == a.dtype for dt, a in zip(new, d.var_types())):
        return d
    eqns, v = [], len(d.dom)
    for e in d.eqns:
        b, n = e.box, len(e.box.cod)
        dom = Ty(*(a.with_dtype(new[i]) for a, i in zip(b.dom, e.ins)))
        cod = Ty(*(a.with_dtype(new[v + j]) for j, a in enumerate(b.cod)))
        params = tuple((k, cod[0].dtype.name if k == "dtype" and b.kind == "cast" else p) for k, p in b.params)
        eqns.append(Eqn(Box(b.kind, dom, cod, params, b.name), e.ins))
        v += n
    return Diagram(Ty(*(a.with_dtype(new[i]) for i, a in enumerate(d.dom))),
                   Ty(*(a.with_dtype(new[o]) for a, o in zip(d.cod, d.outs))), tuple(eqns), d.outs)
