"""The backward from saved residuals: :func:`grad_with_residuals`.

:func:`napkin_cat.ops.grad.grad` recomputes the forward, so the backward of a softmax
recomputes ``P = softmax_x(S)``: a normaliser along ``x`` (``x`` can be neither tiled nor
streamed), and its rule ``dS = P (dP - sum_x dP P)`` sums along ``x`` again.  FlashAttention-2
saves two things from the forward instead, and both make the softmax's backward *elementwise*
along ``x``:

* the row logsumexp ``L = logsumexp_x(S)``: ``P = exp(S - L)``, no normaliser;
* the output ``O = sum_x P V`` of the contraction the softmax feeds:
  ``sum_x dP P = sum_x (dO V^T) P = sum_e dO O =: D``, one number per row, read off
  ``O`` and ``dO`` without any sum along ``x``.

So ``dS = P (dP - D)`` (plus ``P dL`` when ``L`` itself gets a cotangent), and the backward
is weaved over ``x`` except for the contractions ``dQ = sum_x dS K``: tile ``x`` and stream
``q`` for ``dK, dV``, tile ``q`` and stream ``x`` for ``dQ``.

The rule applies to any *softmax-contraction with a saved logsumexp*: a softmax along ``x``
(or a fused ``softmax_contract``) whose only consumer is a two-operand contraction over ``x``
with output ``O``, where the same scores' ``reduce logsumexp`` along ``x`` is an output ``L``
of the forward and ``O`` is an output too (``O`` keeps every row axis of the scores).  Every
other box takes its ordinary rule from :data:`napkin_cat.ops.grad.VJP_RULES`.

Policy (docs/NAN_POLICY.md): a fully masked row has ``L = -inf``; ``exp(S - L)`` would be
``exp(-inf + inf) = NaN`` there, so ``L`` is first raised to the dtype's lowest finite value
(``maximum(L, lowest)``, a no-op on every other row since ``L >= max_x S``): ``P = 0`` and
the gradient is 0, as :func:`~napkin_cat.ops.grad.grad` gives.

>>> import napkin_cat as nc
>>> from napkin_cat.ops.residuals import grad_with_residuals
>>> fwd = nc.library.attention(*nc.axes("q x d"), logsumexp=True)
>>> print(grad_with_residuals(fwd))
Q[q d] f32, K[x d] f32, V[x d] f32, O[q d] f32, L[q] f32, dO[q d] f32 -> dQ[q d] f32, dK[x d] f32, dV[x d] f32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.diagram import Diagram, Eqn
from ..core.types import Ty
from ..core.errors import TypingError
from .boxes import reduce_box
from .builder import Wire
from .grad import Tracer, _active, _wrt_indices, accumulate, cotangent_diagram, vjp

# the lowest finite value per dtype: maximum(L, lowest) turns only L = -inf into a finite number
LOWEST = {"f64": -1.7976931348623157e308, "f32": -3.4028234663852886e38, "f16": -65504.0,
          "bf16": -3.3895313892515355e38, "fp8_e4m3": -448.0, "fp8_e5m2": -57344.0}


@dataclass(frozen=True)
class SavedSoftmax:
    """A softmax-contraction whose logsumexp and output the forward saves: equations
    ``softmax`` (None when fused), ``contract`` and ``lse``; variables ``s`` (scores),
    ``v`` (the other operand), ``o`` (output), ``l`` (logsumexp), ``p`` (probabilities, or
    None when fused); ``axis`` the name of the normalised axis."""

    softmax: int | None
    contract: int
    lse: int
    s: int
    v: int
    o: int
    l: int
    p: int | None
    axis: str


def _softmax_contractions(d: Diagram):
    """Every softmax along an axis (or fused ``softmax_contract``) whose only consumer is a
    two-operand contraction over that axis with an output ``O`` of ``d`` keeping every row axis
    of the scores: ``(softmax, contract, s, v, o, p, axis)`` (``softmax``, ``p`` None when fused)."""
    uses: dict[int, list[int]] = {}
    for k, e in enumerate(d.eqns):
        for v in e.ins:
            uses.setdefault(v, []).append(k)
    types, outs = d.var_types(), set(d.outs)
    for k, e in enumerate(d.eqns):
        if e.box.kind == "softmax":
            (p,) = d.eqn_outputs(k)
            if p in outs or len(uses.get(p, [])) != 1:
                continue
            j = uses[p][0]
            c = d.eqns[j]
            if c.box.kind != "contract" or len(c.ins) != 2 or c.ins[0] == c.ins[1]:
                continue
            v = c.ins[1] if c.ins[0] == p else c.ins[0]
            soft, contract, s, axis = k, j, e.ins[0], e.box.param("axis")
        elif e.box.kind == "softmax_contract":
            (s, v), p, soft, contract, axis = e.ins, None, None, k, e.box.param("axis")
        else:
            continue
        (o,) = d.eqn_outputs(contract)
        rows = [n for n in types[s].axis_names if n != axis]
        if o not in outs or types[o].has(axis) or not types[v].has(axis) or \
                not all(types[o].has(n) for n in rows):
            continue
        yield soft, contract, s, v, o, p, axis


def _saved_lse(d: Diagram) -> dict:
    """``(scores variable, axis) -> equation`` of each ``reduce logsumexp`` that is an output."""
    outs = set(d.outs)
    return {(e.ins[0], e.box.param("axis")): k for k, e in enumerate(d.eqns)
            if e.box.kind == "reduce" and e.box.param("op") == "logsumexp" and d.eqn_outputs(k)[0] in outs}


def saved_softmaxes(d: Diagram) -> tuple[SavedSoftmax, ...]:
    """The softmax-contractions of ``d`` whose logsumexp and output are outputs of ``d``."""
    lse = _saved_lse(d)
    found = []
    for soft, contract, s, v, o, p, axis in _softmax_contractions(d):
        if (s, axis) in lse:
            m = lse[(s, axis)]
            found.append(SavedSoftmax(soft, contract, m, s, v, o, d.eqn_outputs(m)[0], p, axis))
    return tuple(found)


def with_logsumexp(d: Diagram) -> Diagram | None:
    """``d`` (unrelabelled) with the row logsumexp of every softmax-contraction's scores as an
    extra output, so that :func:`grad_with_residuals` reads ``P = exp(S - L)`` instead of
    recomputing the softmax; None when ``d`` has no softmax-contraction (nothing to save).

    The new outputs follow ``d``'s own, named ``L`` (one, when no wire of the signature is
    called so) or ``L_<output>``; a logsumexp ``d`` already outputs is kept, not added twice.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> print(with_logsumexp(nc.library.attention(q, x, d).stream(x, "s_x")))
    Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32, L[q] f32
    >>> with_logsumexp(nc.library.mlp()) is None
    True
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"with_logsumexp needs a Diagram, got {type(d).__name__}")
    d = d.unrelabelled() if d.schedule else d
    lse, types = _saved_lse(d), d.var_types()
    todo = [(s, o, axis) for _, _, s, _, o, _, axis in _softmax_contractions(d) if (s, axis) not in lse]
    if not todo:
        return d if saved_softmaxes(d) else None
    taken = {a.name for a in (*d.dom, *d.cod)}
    eqns, outs, cod = list(d.eqns), list(d.outs), list(d.cod)
    n = len(types)
    for s, o, axis in dict.fromkeys(todo):
        name = "L" if len(todo) == 1 and "L" not in taken else f"L_{types[o].name}"
        while name in taken:
            name += "_"
        taken.add(name)
        box = reduce_box("logsumexp", types[s], axis, name)
        eqns.append(Eqn(box, (s,)))
        outs.append(n)
        cod.append(box.cod[0])
        n += 1
    return Diagram(d.dom, Ty(*cod), tuple(eqns), tuple(outs))


def _probabilities(t: Tracer, s: Wire, l: Wire, axis_name: str) -> Wire:
    """``P = exp(S - maximum(L, lowest))``: elementwise along the axis, 0 on a fully masked row."""
    ty, lt = t.ty(s), t.ty(l)
    if lt.dtype.name not in LOWEST:
        raise TypingError(f"grad_with_residuals: logsumexp {lt} must be a float array")
    floor = t.const(LOWEST[lt.dtype.name], *lt.axes, name="lowest")
    safe = t.map("maximum", l, floor, out=lt.axes, name=lt.name)
    return t.map("exp", t.map("sub", s, safe, out=ty.axes), name="P")


def _row_dot(t: Tracer, g: Wire, o: Wire, rows) -> Wire:
    """``D = sum dO O`` over the output's feature axes: ``sum_x dP P`` without reading ``x``."""
    return t.contract(g, o, out=rows, name="D")


def grad_with_residuals(d: Diagram, wrt=None, cotangents: Sequence[str] | None = None) -> Diagram:
    """The reverse-mode derivative of ``d`` from its saved outputs (FlashAttention-2's backward).

    Inputs: ``d``'s inputs, then ``d``'s outputs (the residuals, read instead of recomputed),
    then ``d<name>`` for each output named in ``cotangents`` (default: every output that is
    not a saved logsumexp).  Outputs: ``d<name>`` per input in ``wrt`` (names or indices;
    default every float input).  Each softmax-contraction with a saved logsumexp
    (:func:`saved_softmaxes`) is differentiated through ``P = exp(S - L)`` and
    ``D = sum dO O``; a diagram without one gets :func:`~napkin_cat.ops.grad.grad`'s rules
    (with its outputs read, not recomputed).  Equal to ``grad(d)`` on the cotangents given
    (the others zero), wherever ``O`` and ``L`` are ``d``'s own outputs.
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"grad_with_residuals needs a Diagram, got {type(d).__name__}")
    d = d.unrelabelled() if d.schedule else d
    wrt = _wrt_indices(d, wrt)
    saved = saved_softmaxes(d)
    lse_outs = {sv.l for sv in saved}
    names = [a.name for a in d.cod]
    if len(set(names) | {a.name for a in d.dom}) != len(names) + len(d.dom):
        raise TypingError(f"grad_with_residuals: the inputs and outputs of {d.short()} need distinct "
                          f"names (the outputs become inputs of the backward), got {[a.name for a in d.dom]} "
                          f"and {names}")
    if cotangents is None:
        seeded = [i for i, v in enumerate(d.outs) if v not in lse_outs]
    else:
        unknown = [c for c in cotangents if c not in names]
        if unknown:
            raise TypingError(f"grad_with_residuals: cotangents {unknown} are not outputs of {d.short()}; "
                              f"outputs are {names}")
        seeded = [names.index(c) for c in cotangents]
    t = Tracer()
    env: dict[int, Wire] = {i: t.input(a.name, *a.axes, dtype=a.dtype) for i, a in enumerate(d.dom)}
    kept = {v: t.input(a.name, *a.axes, dtype=a.dtype) for v, a in zip(d.outs, d.cod)}
    seeds = {d.outs[i]: t.input(f"d{d.cod[i].name}", *d.cod[i].axes, dtype=d.cod[i].dtype) for i in seeded}
    by_soft = {sv.softmax: sv for sv in saved if sv.softmax is not None}
    for k, e in enumerate(d.eqns):   # the forward, reading the residuals instead of recomputing
        outs = d.eqn_outputs(k)
        if k in by_soft:
            sv = by_soft[k]
            env[outs[0]] = _probabilities(t, env[sv.s], kept[sv.l], sv.axis)
        elif all(o in kept for o in outs):
            env.update({o: kept[o] for o in outs})
        else:
            got = t.box(e.box, *(env[v] for v in e.ins))
            env.update(zip(outs, got if isinstance(got, tuple) else (got,)))
    need = _active(d, wrt)
    types = d.var_types()
    cts: dict[int, list[Wire]] = {}
    for v, seed in seeds.items():
        if need[v]:
            cts.setdefault(v, []).append(seed)
    roles = {}
    for sv in saved:
        roles.update({sv.contract: ("contract", sv), sv.lse: ("lse", sv)})
        if sv.softmax is not None:
            roles[sv.softmax] = ("softmax", sv)
    for k in reversed(range(len(d.eqns))):
        e, outs = d.eqns[k], d.eqn_outputs(k)
        if not any(cts.get(o) for o in outs) or not any(need[v] for v in e.ins):
            continue
        gs = [t.total(cts.get(o, []), types[o]) for o in outs]
        role, sv = roles.get(k, (None, None))
        if role == "softmax":
            got = (_saved_softmax_ct(t, sv, env, cts, types),)
        elif role == "lse":   # d logsumexp(S) / dS = P
            got = (t.map("mul", _probs(t, sv, env, kept), gs[0], out=types[sv.s].axes),)
        elif role == "contract" and sv.softmax is None:   # fused: P is not a wire of d
            p = _probs(t, sv, env, kept)
            operands = (p, env[sv.v])
            dp, dv = _contract_cts(t, operands, gs[0])
            got = (_ds(t, sv, p, dp, env, cts, types), dv)
        else:
            got = vjp(t, e, env, outs, gs, types, need)
        accumulate(t, e, got, types, need, cts)
    return cotangent_diagram(t, d, wrt, cts)


def _probs(t: Tracer, sv: SavedSoftmax, env, kept) -> Wire:
    if sv.p is not None:
        return env[sv.p]
    key = ("fused P", sv.contract)
    if key not in env:
        env[key] = _probabilities(t, env[sv.s], kept[sv.l], sv.axis)
    return env[key]


def _contract_cts(t: Tracer, operands, g: Wire):
    """Cotangents of the two operands of ``O = contract(P, V)``: each is ``g`` contracted with
    the other, onto its own axes (an axis only one operand has was summed: broadcast back)."""
    res = []
    for i, w in enumerate(operands):
        arr = t.ty(w)
        other = operands[1 - i]
        seen = set(t.ty(g).axis_names) | set(t.ty(other).axis_names)
        out = tuple(a for a in arr.axes if a.name in seen)
        res.append(t.fit(t.contract(g, other, out=out, name=f"d{arr.name}"), arr))
    return res


def _ds(t: Tracer, sv: SavedSoftmax, p: Wire, dp: Wire, env, cts, types) -> Wire:
    """``dS = P (dP - D)``, ``D = sum dO O`` over the output's feature axes."""
    o_ty, s_ty = types[sv.o], types[sv.s]
    rows = tuple(a for a in o_ty.axes if s_ty.has(a.name) and a.name != sv.axis)
    dot = _row_dot(t, t.total(cts.get(sv.o, []), o_ty), env[sv.o], rows)
    return t.map("mul", p, t.map("sub", dp, dot, out=s_ty.axes), out=s_ty.axes, name="dS")


def _saved_softmax_ct(t: Tracer, sv: SavedSoftmax, env, cts, types) -> Wire:
    dp = t.total(cts.get(sv.p, []), types[sv.p])
    return _ds(t, sv, env[sv.p], dp, env, cts, types)


__all__ = ["grad_with_residuals", "saved_softmaxes", "SavedSoftmax", "with_logsumexp"]
