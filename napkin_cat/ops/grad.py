"""Reverse-mode differentiation of diagrams: :func:`grad`, and one vector-Jacobian rule per box kind.

``grad(d)`` is a diagram ``(inputs of d, one cotangent per output) -> (one cotangent per
input)``, built from the same boxes as ``d``: the backward pass is an ordinary diagram, so it
evaluates, relabels, costs and lowers like any other.  It recomputes the forward equations it
needs inside (no residuals are saved yet).

Each kind of :data:`napkin_cat.ops.kinds.SPECS` has one rule in :data:`VJP_RULES`, written as
``rule(t, box, ins, outs, cts) -> one cotangent per input`` (None: zero, or no path): ``t`` is
the :class:`Tracer` (a :class:`~napkin_cat.ops.builder.Builder` that is also callable on
elementwise functions), ``ins`` / ``outs`` the box's input and output wires (the forward values,
already traced), ``cts`` the cotangents of its outputs.  An elementwise function is
differentiated by its one definition (``Function.derivative`` in :mod:`.functions`).

The auxiliary tensors an index expression gathers from (a learned bias table, a per-head
scale) get the expression's derivative scattered back along the gathers
(:mod:`.aux_grad`: ``index_map`` and ``scatter_aux`` boxes); a mask's get none.

Policy (docs/NAN_POLICY.md): a fully masked softmax row has output 0 and gradient 0, never NaN;
a masked score gets cotangent 0 (the cotangent is multiplied by ``exp(mask(0))``).

>>> import numpy as np, napkin_cat as nc
>>> from napkin_cat.ops.grad import grad
>>> a, b, c = nc.axes("a b c")
>>> print(grad(nc.library.matmul(a, b, c)))
A[a b] f32, B[b c] f32, dC[a c] f32 -> dA[a b] f32, dB[b c] f32
>>> A, B, G = np.ones((2, 3)), np.ones((3, 4)), np.ones((2, 4))
>>> [x.shape for x in nc.evaluate(grad(nc.library.matmul(a, b, c)), A, B, G)]
[(2, 3), (3, 4)]
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..core.diagram import Array, Axis, Diagram, Eqn
from ..core.errors import TypingError, UnknownKindError
from .aux_grad import SCORE, derivative, gathers, index_map_box, scatter_aux_box
from .boxes import const_box, contract_box, diagonal_box, merge_box, normalize_box, rename_box, split_box, unfold_box
from .builder import Builder, Wire
from .functions import FUNCTIONS
from .index import AxisPower, causal, window
from .index_expr import Aux, Ix
from .kinds import NORMALISATIONS


class Tracer(Builder):
    """The :class:`Builder` the rules write into, plus ``t(fn, *wires, c=None)`` (an
    elementwise function over the union of its arguments' axes) and the adjoint of broadcasting
    (:meth:`fit`)."""

    def __call__(self, fn: str, *wires: Wire, c=None) -> Wire:
        return self.map(fn, *wires, c=c)

    def zeros(self, arr: Array) -> Wire:
        return self.box(const_box(Array(arr.axes, arr.dtype, f"0_{arr.name}"), 0.0))

    def fit(self, w: Wire, arr: Array) -> Wire:
        """``w`` as a cotangent of type ``arr``: axes ``arr`` lacks are summed out (the adjoint
        of broadcasting), axes ``w`` lacks are broadcast, the order and the dtype are ``arr``'s."""
        ty = self.ty(w)
        if any(not arr.has(a) for a in ty.axes):
            w = self.contract(w, out=tuple(a for a in arr.axes if ty.has(a)), name=f"d{arr.name}")
            ty = self.ty(w)
        if len(ty.axes) < len(arr.axes):
            w = self.map("add", self.zeros(arr), w, out=arr.axes, name=f"d{arr.name}")
        elif ty.axis_names != arr.axis_names:
            w = self.transpose(w, *arr.axes)
        if self.ty(w).dtype != arr.dtype:
            w = self.cast(w, arr.dtype)
        return w

    def total(self, wires: Sequence[Wire], arr: Array) -> Wire:
        """The sum of the cotangents of one wire used several times (0 when none)."""
        if not wires:
            return self.zeros(arr)
        out = wires[0]
        for w in wires[1:]:
            out = self.map("add", out, w, out=arr.axes, name=f"d{arr.name}")
        return out


def _axis(arr: Array, name: str) -> Axis:
    return arr.axes[arr.axis_names.index(name)]


# --------------------------------------------------------------------------- rules

def vjp_contract(t: Tracer, box, ins, outs, cts):
    """Operand ``i``'s cotangent: the output cotangent contracted with every other operand,
    onto the axes of operand ``i`` (an axis only operand ``i`` has was summed: broadcast back)."""
    res = []
    for i, arr in enumerate(box.dom):
        operands = [cts[0], *ins[:i], *ins[i + 1:]]
        seen = {n for w in operands for n in t.ty(w).axis_names}
        out = tuple(a for a in arr.axes if a.name in seen)
        res.append(t.fit(t.contract(*operands, out=out, name=f"d{arr.name}"), arr))
    return tuple(res)


def vjp_map(t: Tracer, box, ins, outs, cts):
    """The function's ``derivative`` (:mod:`.functions`), then each cotangent fitted to its argument."""
    f = FUNCTIONS[box.param("fn")]
    if f.derivative is None:
        raise TypingError(f"cannot differentiate box {box.name}: function {f.name!r} has no derivative "
                          f"in ops.functions")
    got = f.derivative(t, cts[0], outs[0], *ins, c=box.param("c", None))
    return tuple(None if w is None else t.fit(w, arr) for w, arr in zip(got, box.dom))


def _arg_extreme_weights(t: Tracer, x: Wire, m: Wire, axis: Axis) -> Wire:
    """``(x == m) / count(x == m)`` along ``axis``: torch's amax / amin rule, ties share equally."""
    hit = t("equal", x, m)
    return t("div", hit, t.reduce("sum", hit, axis))


def vjp_reduce(t: Tracer, box, ins, outs, cts):
    """sum: broadcast back; mean: and divide by the size; max / min: to the extreme positions,
    ties sharing it; logsumexp: times the softmax of the input."""
    x, arr, g, op = ins[0], box.dom[0], cts[0], box.param("op")
    axis = _axis(arr, box.param("axis"))
    if op == "sum":
        return (t.fit(g, arr),)
    if op == "mean":
        inv = AxisPower(axis, -1.0) if axis.symbolic else 1.0 / axis.size
        return (t.fit(t("scale", g, c=inv), arr),)
    if op in ("max", "min"):
        return (t.map("mul", _arg_extreme_weights(t, x, outs[0], axis), g, out=arr.axes),)
    if op == "logsumexp":   # a fully masked row: softmax 0, gradient 0
        return (t.map("mul", t.softmax(x, axis), g, out=arr.axes),)
    raise UnknownKindError(f"no vector-Jacobian rule for reduction {op!r} (box {box.name})")


def _softmax_ct(t: Tracer, p: Wire, g: Wire, axis: Axis) -> Wire:
    """``dS = P * (dP - sum_j dP_j P_j)``: zero on a fully masked row (P = 0)."""
    arr = t.ty(p)
    dot = t.reduce("sum", t.map("mul", g, p, out=arr.axes), axis, name="dP_P")
    return t.map("mul", p, t.map("sub", g, dot, out=arr.axes), out=arr.axes, name="dS")


def vjp_softmax(t: Tracer, box, ins, outs, cts):
    return (_softmax_ct(t, outs[0], cts[0], _axis(box.dom[0], box.param("axis"))),)


def vjp_normalize(t: Tracer, box, ins, outs, cts):
    """``N_i = a1(x_i) / D``, ``D = b(Z) + eps``, ``Z = sum_j a2(x_j)``:
    ``dx = a1'(x) g / D + a2'(x) b'(Z) dD`` with ``dD = -sum_i g_i N_i / D``, each factor from
    its function's derivative.  The softmax triple means max-shifted softmax: its rule."""
    x, arr, g, n = ins[0], box.dom[0], cts[0], outs[0]
    axis = _axis(arr, box.param("axis"))
    a1, a2, b, eps = (box.param(k) for k in ("a1", "a2", "b", "eps"))
    if (a1, a2, b) == NORMALISATIONS["softmax"]:
        return (_softmax_ct(t, n, g, axis),)
    y1, y2 = t(a1, x), t(a2, x)
    z = t.reduce("sum", y2, axis, name="Z")
    bz = t(b, z)
    den = t("shift", bz, c=eps) if eps else bz
    d_den = t("neg", t("div", t.reduce("sum", t.map("mul", g, n, out=arr.axes), axis), den))
    dz = _derivative(t, b, d_den, bz, z)
    dx1 = _derivative(t, a1, t.map("div", g, den, out=arr.axes), y1, x)
    dx2 = None if dz is None else _derivative(t, a2, t.fit(dz, arr), y2, x)
    parts = [t.fit(w, arr) for w in (dx1, dx2) if w is not None]
    return (t.total(parts, arr),) if parts else (None,)


def _derivative(t: Tracer, fn: str, g: Wire, y: Wire, x: Wire) -> Wire | None:
    return FUNCTIONS[fn].derivative(t, g, y, x, c=None)[0]


def _keep(t: Tracer, rows: Axis, cols: Axis, preds, dtype) -> Wire:
    """``exp(mask(0))`` over ``(rows, cols)``: 1 where every predicate keeps the entry, else 0."""
    w = t.zeros(Array((rows, cols), dtype, "keep"))
    for r, c, pred in preds:
        w = t.mask(w, r, c, pred)
    return t("exp", w)


def vjp_mask(t: Tracer, box, ins, outs, cts):
    """Masked entries get cotangent 0: ``g * exp(mask(0))``; an index expression's auxiliary
    tensors get none (the mask is piecewise constant in them)."""
    arr = box.dom[0]
    row, col = _axis(arr, box.param("row")), _axis(arr, box.param("col"))
    pred = box.param("pred")
    if pred.kind == "expr":   # it may read every axis of the scores and its auxiliary inputs
        w = t.zeros(Array(arr.axes, arr.dtype, "keep"))
        keep = t("exp", t.mask(w, row, col, pred, *ins[1:]))
        return (t.map("mul", cts[0], keep, out=arr.axes),) + (None,) * (len(ins) - 1)
    keep = _keep(t, row, col, [(row, col, pred)], arr.dtype)
    return (t.map("mul", cts[0], keep, out=arr.axes),)


def vjp_index_bias(t: Tracer, box, ins, outs, cts):
    """The score's cotangent passes; each auxiliary tensor gets :func:`aux_cotangents`."""
    bias = box.param("bias")
    if bias.kind != "expr" or len(ins) == 1:
        return (cts[0],) + (None,) * (len(ins) - 1)
    return (cts[0], *aux_cotangents(t, box, bias.expr, cts[0], None, ins[1:]))


def vjp_index_map(t: Tracer, box, ins, outs, cts):
    """``dx = g * de/dscore`` and :func:`aux_cotangents`, both from the expression's derivative."""
    e = box.param("fn").expr
    dx = _weighted(t, box, e, derivative(e, SCORE), cts[0], ins[0], ins[1:])
    return (None if dx is None else t.fit(dx, box.dom[0]), *aux_cotangents(t, box, e, cts[0], ins[0], ins[1:]))


def aux_cotangents(t: Tracer, box, e, g: Wire, score: Wire | None, aux: Sequence[Wire]) -> tuple:
    """One cotangent per auxiliary tensor of ``e`` (None: no gradient reaches it): for each
    distinct gather ``A[idx]``, ``g * de/dA[idx]`` scattered back into ``A`` at ``idx``
    (``scatter_aux``), summed over the gathers of ``A``."""
    names = [a.name for a in e.auxes()]
    parts: dict[str, list] = {n: [] for n in names}
    for node in gathers(e):
        w = _weighted(t, box, e, derivative(e, node), g, score, aux)
        if w is not None:
            arr = t.ty(aux[names.index(node.value.name)])
            parts[node.value.name].append(
                t.box(scatter_aux_box(t.ty(w), arr, node, box.param("row"), box.param("col")), w))
    return tuple(t.total(parts[n], t.ty(a)) if parts[n] else None for n, a in zip(names, aux))


def _weighted(t: Tracer, box, e, w, g: Wire, score: Wire | None, aux: Sequence[Wire]) -> Wire | None:
    """``g * w`` over ``g``'s axes (``w`` a derivative of ``e``, whose auxiliary tensors are the
    wires ``aux``): ``g`` itself for ``w = 1``; one ``index_map`` reading ``g`` as its score when
    ``w`` does not read the score, else ``g`` times ``w`` mapped over the score."""
    if w is None:
        return None
    if w.op == "const" and w.value == 1.0:
        return g
    names = [a.name for a in e.auxes()]
    mine = [aux[names.index(a.name)] for a in w.auxes()]
    row, col = box.param("row"), box.param("col")
    if not w.uses_score():
        return t.box(index_map_box(t.ty(g), row, col, SCORE * w, [t.ty(a) for a in mine]), g, *mine)
    m = t.box(index_map_box(t.ty(score), row, col, w, [t.ty(a) for a in mine]), score, *mine)
    return t.map("mul", g, m, out=t.ty(g).axes)


def vjp_scatter_aux(t: Tracer, box, ins, outs, cts):
    """The adjoint of a scatter-add is the gather: ``dw = dA[clamp(idx)]`` over ``w``'s axes
    (an ``index_map`` that reads no score)."""
    at, src, dst = box.param("at"), box.dom[0], box.cod[0]
    own = {a.name for a in at.aux.axes}
    if any(n not in own for n in dst.axis_names):
        raise TypingError(f"cannot differentiate box {box.name}: its output {dst} has axes besides "
                          f"{at.aux!r}'s (it was woven); the gather back is not built for them")
    back = Ix("gather", at.index, Aux(f"d{at.aux.name}", at.aux.axes))
    ct = t.fit(cts[0], dst)
    return (t.box(index_map_box(src, box.param("row"), box.param("col"), back, [t.ty(ct)]), ins[0], ct),)


def vjp_reindex(t: Tracer, box, ins, outs, cts):
    """Adjoints: transpose back, merge a split, split a merge, pad a slice with zeros
    (contraction with the 0/1 matrix ``axis == new + start``), put a diagonal back on the
    diagonal of zeros (times the identity ``exp(mask_window(0)(0))``)."""
    src, dst, g, op = box.dom[0], box.cod[0], cts[0], box.param("op")
    if op == "transpose":
        return (t.transpose(g, *src.axes),)
    if op == "split":
        outer, inner = _axis(dst, box.param("outer")), _axis(dst, box.param("inner"))
        return (t.box(merge_box(t.ty(g), outer, inner, _axis(src, box.param("axis"))), g),)
    if op == "merge":
        merged = _axis(dst, box.param("axis"))
        outer, inner = _axis(src, box.param("outer")), _axis(src, box.param("inner"))
        return (t.box(split_box(t.ty(g), merged, outer, inner), g),)
    if op == "slice":
        axis, new, start = _axis(src, box.param("axis")), _axis(dst, box.param("new")), box.param("start")
        # keep axis <= new + start, then new <= axis - start: axis == new + start
        pick = _keep(t, new, axis, [(new, axis, causal(start)), (axis, new, causal(-start))], src.dtype)
        return (t.contract(g, pick, out=src.axes, name=f"d{src.name}"),)
    if op == "diagonal":
        keep, drop = _axis(src, box.param("keep")), _axis(src, box.param("drop"))
        eye = _keep(t, keep, drop, [(keep, drop, window(0))], src.dtype)
        return (t.map("mul", g, eye, out=src.axes, name=f"d{src.name}"),)
    if op == "rename":
        return (t.box(rename_box(t.ty(g), _axis(dst, box.param("new")), _axis(src, box.param("axis"))), g),)
    if op == "unfold":
        return (_unfold_adjoint(t, box, g),)
    raise UnknownKindError(f"no vector-Jacobian rule for reindex op {op!r} (box {box.name})")


def _unfold_adjoint(t: Tracer, box, g):
    """``dx[i] = sum_k g[y, k]`` over ``stride*y + dilation*k + offset == divisor*i``: unfold ``g``
    along ``y`` back onto ``i`` (``y = (divisor*i - dilation*k' - offset) / stride``), keep the
    diagonal ``k' == k`` and sum ``k``."""
    src, dst, p = box.dom[0], box.cod[0], box.param
    axis, new = _axis(src, p("axis")), _axis(dst, p("new"))
    how = dict(stride=p("divisor"), offset=-p("offset"), divisor=p("stride"))
    if p("window", None) is None:
        return t.box(unfold_box(t.ty(g), new, axis, dilation=0, **how), g)
    k = _axis(dst, p("window"))
    k2 = Axis(f"{k.name}_", k.size)
    back = t.box(unfold_box(t.ty(g), new, axis, k2, dilation=-p("dilation"), **how), g)
    diag = t.box(diagonal_box(t.ty(back), k, k2), back)
    return t.reduce("sum", diag, k, name=f"d{src.name}")


def vjp_source(t: Tracer, box, ins, outs, cts):
    """``param`` and ``const`` have no inputs: nothing to send back (a parameter is a constant
    of the inputs; pass it as an input to get its gradient)."""
    return ()


def vjp_cast(t: Tracer, box, ins, outs, cts):
    """Float to float: cast the cotangent back.  A cast to an integer dtype is not
    differentiable: refused when a gradient must flow through it."""
    src, dst = box.dom[0], box.cod[0]
    if dst.dtype.kind != "float":
        raise TypingError(f"cannot differentiate box {box.name}: a cast of {src} to {dst.dtype.name} "
                          f"rounds to integers (zero gradient almost everywhere, none at the steps); "
                          f"the gradient asked for flows through it")
    return (t.fit(cts[0], src),)


def vjp_softmax_contract(t: Tracer, box, ins, outs, cts):
    """Through the definition: ``P = softmax(S)``, ``O = contract(P, V)``."""
    s, v = ins
    p = t.softmax(s, _axis(box.dom[0], box.param("axis")))
    dp, dv = vjp_contract(t, contract_box([t.ty(p), t.ty(v)], box.cod[0].axes, dtype=box.cod[0].dtype),
                          [p, v], outs, cts)
    return (_softmax_ct(t, p, dp, _axis(box.dom[0], box.param("axis"))), dv)


def vjp_norm_contract(t: Tracer, box, ins, outs, cts):
    """Through the definition: ``P = normalize(S)``, ``O = contract(P, V)``."""
    s, v = ins
    axis = _axis(box.dom[0], box.param("axis"))
    a1, a2, b, eps = (box.param(k) for k in ("a1", "a2", "b", "eps"))
    norm = normalize_box(box.dom[0], axis, a1, a2, b, eps=eps)
    p = t.box(norm, s)
    dp, dv = vjp_contract(t, contract_box([t.ty(p), t.ty(v)], box.cod[0].axes, dtype=box.cod[0].dtype),
                          [p, v], outs, cts)
    return (vjp_normalize(t, norm, [s], [p], [dp])[0], dv)


VJP_RULES: dict[str, Callable] = {
    "contract": vjp_contract, "map": vjp_map, "reduce": vjp_reduce, "softmax": vjp_softmax,
    "normalize": vjp_normalize, "mask": vjp_mask, "index_bias": vjp_index_bias,
    "reindex": vjp_reindex, "param": vjp_source, "const": vjp_source, "cast": vjp_cast,
    "softmax_contract": vjp_softmax_contract, "norm_contract": vjp_norm_contract,
    "index_map": vjp_index_map, "scatter_aux": vjp_scatter_aux,
}


# --------------------------------------------------------------------------- grad

def _wrt_indices(d: Diagram, wrt) -> tuple[int, ...]:
    if wrt is None:
        return tuple(i for i, a in enumerate(d.dom) if a.dtype.kind == "float")
    if isinstance(wrt, (str, int)):
        wrt = (wrt,)
    names = [a.name for a in d.dom]
    out = []
    for w in wrt:
        if isinstance(w, str) and w in names:
            i = names.index(w)
        elif isinstance(w, int) and not isinstance(w, bool) and 0 <= w < len(names):
            i = w
        else:
            raise TypingError(f"grad: wrt names {w!r}, which is not an input of {d.short()}; "
                              f"inputs are {names} (names or indices)")
        if d.dom[i].dtype.kind != "float":
            raise TypingError(f"grad: input {d.dom[i]} is not a float array: it has no gradient")
        out.append(i)
    return tuple(out)


def _active(d: Diagram, wrt: Sequence[int]) -> list[bool]:
    """Variables that depend on an input in ``wrt``: only they need a cotangent."""
    need = [i in wrt for i in range(len(d.dom))] + [False] * (len(d.var_types()) - len(d.dom))
    for k, e in enumerate(d.eqns):
        if any(need[v] for v in e.ins):
            for o in d.eqn_outputs(k):
                need[o] = True
    return need


def grad(d: Diagram, wrt=None) -> Diagram:
    """The reverse-mode derivative of ``d``: inputs ``d``'s inputs then ``d<name>`` per output
    of ``d``, outputs ``d<name>`` per input in ``wrt`` (names or indices; default every float
    input).  Cotangents of a wire used several times add up; an input that reaches no output
    gets a zero cotangent.  A relabelled ``d`` is differentiated as its function.

    >>> import napkin_cat as nc
    >>> print(grad(nc.library.attention(*nc.axes("q x d"))))
    Q[q d] f32, K[x d] f32, V[x d] f32, dO[q d] f32 -> dQ[q d] f32, dK[x d] f32, dV[x d] f32
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"grad needs a Diagram, got {type(d).__name__}")
    d = d.unrelabelled() if d.schedule else d
    wrt = _wrt_indices(d, wrt)
    t = Tracer()
    env: list = [t.input(a.name, *a.axes, dtype=a.dtype) for a in d.dom]
    seeds = [t.input(f"d{a.name}", *a.axes, dtype=a.dtype) for a in d.cod]
    for e in d.eqns:   # the forward equations; those the backward does not read are pruned
        out = t.box(e.box, *(env[v] for v in e.ins))
        env.extend(out if isinstance(out, tuple) else (out,))
    need = _active(d, wrt)
    types = d.var_types()
    cts: dict[int, list[Wire]] = {}
    for v, seed in zip(d.outs, seeds):
        if need[v]:
            cts.setdefault(v, []).append(seed)
    for k in reversed(range(len(d.eqns))):
        e, outs = d.eqns[k], d.eqn_outputs(k)
        if not any(cts.get(o) for o in outs) or not any(need[v] for v in e.ins):
            continue
        got = vjp(t, e, env, outs, [t.total(cts.get(o, []), types[o]) for o in outs], types, need)
        accumulate(t, e, got, types, need, cts)
    return cotangent_diagram(t, d, wrt, cts)


def vjp(t: Tracer, e, env, outs, gs, types, need) -> tuple:
    """The cotangents of equation ``e``'s inputs by its kind's rule (:data:`VJP_RULES`), given
    its outputs' cotangents ``gs``; no gradient flows through an integer wire."""
    for v in e.ins:
        if need[v] and types[v].dtype.kind != "float":
            raise TypingError(f"cannot differentiate box {e.box.name}: its input {types[v]} is an integer "
                              f"wire computed from a differentiated input (a cast to an integer dtype "
                              f"upstream); no gradient flows through integers")
    rule = VJP_RULES.get(e.box.kind)
    if rule is None:
        raise UnknownKindError(f"no vector-Jacobian rule for box kind {e.box.kind!r} (box {e.box.name}); "
                               f"known kinds: {sorted(VJP_RULES)}")
    return rule(t, e.box, [env[v] for v in e.ins], [env[o] for o in outs], gs)


def accumulate(t: Tracer, e, got, types, need, cts: dict) -> None:
    """Add the cotangents ``got`` of ``e``'s inputs to ``cts`` (summed later by ``t.total``)."""
    for v, w in zip(e.ins, got):
        if w is not None and need[v]:
            assert t.ty(w) == types[v], f"{e.box.name}: cotangent {t.ty(w)} for wire {types[v]}"
            cts.setdefault(v, []).append(w)


def cotangent_diagram(t: Tracer, d: Diagram, wrt, cts: dict) -> Diagram:
    """The traced backward: one output ``d<name>`` per input in ``wrt``, unread equations pruned."""
    results = [t.total(cts.get(i, []), d.dom[i]) for i in wrt]
    return prune(t.diagram(*results, names=[f"d{d.dom[i].name}" for i in wrt]))


def prune(d: Diagram) -> Diagram:
    """``d`` without the equations no output reads (the forward values the backward skips)."""
    live = set(d.outs)
    keep = []
    for k in reversed(range(len(d.eqns))):
        if live & set(d.eqn_outputs(k)):
            keep.append(k)
            live.update(d.eqns[k].ins)
    keep.reverse()
    new = list(range(len(d.dom))) + [-1] * (len(d.var_types()) - len(d.dom))
    eqns, n = [], len(d.dom)
    for k in keep:
        e = d.eqns[k]
        eqns.append(Eqn(e.box, tuple(new[v] for v in e.ins)))
        for o in d.eqn_outputs(k):
            new[o] = n
            n += 1
    return Diagram(d.dom, d.cod, tuple(eqns), tuple(new[v] for v in d.outs))
