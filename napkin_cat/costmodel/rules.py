"""Cost rules: the work of one box, one rule per box kind.

A rule ``rule(box, vol, phase)`` returns the :class:`Work` of ``box`` at one ``phase``
(``apply`` for a box computed whole; ``init`` / ``update`` / ``finalise`` for a streamed
accumulator, whose ``update`` runs once per chunk), where ``vol(axis names)`` is the product of
those axes' extents at the node.  Units: ``tensor`` (contractions, ``2 * prod(all axes)``),
``fma`` (other elementwise work, reductions, accumulator merges) and ``exp`` (the
special-function unit); an elementwise function's unit is its entry in
:data:`napkin_cat.ops.functions.FUNCTIONS`.  :data:`COST_RULES` is keyed exactly like
:data:`napkin_cat.ops.kinds.SPECS` (``tests/test_cost.py`` keeps them equal).

>>> import napkin_cat as nc
>>> from napkin_cat.core import Box, Ty
>>> box_work(Box("bogus", Ty(), Ty()), lambda names: 1)
Traceback (most recent call last):
  ...
napkin_cat.core.errors.UnknownKindError: no cost rule for box kind 'bogus' (box bogus)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from ..core.diagram import Array, Box
from ..core.errors import UnknownKindError
from ..ops.functions import FUNCTIONS
from ..ops.index_support import with_atoms
from ..ops.kinds import axis_of

UNITS = ("tensor", "fma", "exp")


@dataclass(frozen=True, slots=True)
class Work:
    """``count`` operations on ``unit``; ``precision`` lists the arrays whose dtype sets the
    rate (the widest wins)."""

    unit: str
    count: sp.Expr
    what: str
    precision: tuple[Array, ...] = ()


def _fn_work(fn: str, count, what: str, prec) -> tuple[Work, ...]:
    unit = FUNCTIONS[fn].unit
    return () if unit == "free" else (Work(unit, count, what, tuple(prec)),)


def _axes_union(arrays) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for a in arrays:
        for n in a.axis_names:
            seen.setdefault(n, None)
    return tuple(seen)


def _stat_axes(box: Box) -> tuple[str, ...]:
    """The axes of a normaliser's row statistics: its input's, less the axis it runs along."""
    axis = axis_of(box)
    return tuple(n for n in box.dom[0].axis_names if n != axis)


def rule_contract(box, vol, phase):
    if phase in ("init", "finalise"):
        return ()
    union = _axes_union(box.dom)
    v = vol(union)
    summed = set(union) - set(box.cod[0].axis_names)
    n = len(box.dom)
    if not summed:      # an outer or Hadamard product: no reduction, no tensor-core work
        return (Work("fma", (n - 1) * v, "product", box.dom),) if n > 1 else ()
    if n == 1:
        return (Work("fma", v, "sum", box.dom),)
    # k multiply-adds per output element = 2k FLOPs; n operands: n-1 multiplies and an add
    return (Work("tensor", (2 if n == 2 else n) * v, f"contract {box.cod[0].name}", box.dom),)


def rule_map(box, vol, phase):
    return _fn_work(box.param("fn"), vol(box.cod[0].axis_names), box.param("fn"), box.cod)


def rule_reduce(box, vol, phase):
    op, x, o = box.param("op"), vol(box.dom[0].axis_names), vol(box.cod[0].axis_names)
    out = box.cod
    if op == "logsumexp":
        return {"apply": (Work("fma", 3 * x + o, "max, shift, sum, add max", out),
                          Work("exp", x, "exp", out), Work("exp", o, "log", out)),
                "init": (),
                "update": (Work("fma", 3 * x + 2 * o, "max, shift, sum, merge", out),
                           Work("exp", x + o, "exp and rescale", out)),
                "finalise": (Work("exp", o, "log", out), Work("fma", o, "add max", out))}[phase]
    merge = o if phase == "update" else 0
    tail = o if op == "mean" and phase in ("apply", "finalise") else 0
    if phase == "init":
        return ()
    if phase == "finalise":
        return (Work("fma", tail, "mean divide", out),) if tail else ()
    return (Work("fma", x + merge + tail, op, out),)


def rule_softmax(box, vol, phase):
    x = vol(box.dom[0].axis_names)
    return (Work("exp", x, "exp", box.cod), Work("fma", 4 * x, "max, subtract, sum, divide", box.cod))


def rule_normalize(box, vol, phase):
    x = vol(box.dom[0].axis_names)
    rows = vol(_stat_axes(box))
    return (_fn_work(box.param("a1"), x, "a1", box.cod) + _fn_work(box.param("a2"), x, "a2", box.cod)
            + (Work("fma", x, "sum", box.cod),) + _fn_work(box.param("b"), rows, "b", box.cod)
            + (Work("fma", x, "divide", box.cod),))


def _expr_work(expr, v, what: str, cod) -> tuple:
    """An index expression's operations per element, by unit (counted from its tree)."""
    return tuple(Work(unit, k * v, f"{what} ({k} {unit} per element)", cod)
                 for unit, k in sorted(expr.work().items()))


def rule_mask(box, vol, phase):
    return mask_work(box, vol)


def mask_work(box, vol, known: tuple = ()) -> tuple:
    """The mask's work; ``known``: ``(block-table comparison, value)`` pairs that hold over the
    elements counted, which are then counted with those comparisons folded away, as the kernels
    write them (:func:`~napkin_cat.ops.index_support.with_atoms`; ``costmodel/skips.py``)."""
    v = vol(box.cod[0].axis_names)
    pred = box.param("pred")
    if pred.kind == "expr":
        e, i, j = pred.index_form()
        expr = with_atoms(e, dict(known).get, i, j) if known else e
        return _expr_work(expr, v, "mask condition", box.cod) + (Work("fma", v, "select", box.cod),)
    return (Work("fma", v, "mask", box.cod),)


def rule_index_bias(box, vol, phase):
    v = vol(box.cod[0].axis_names)
    bias = box.param("bias")
    if bias.kind == "expr":
        return _expr_work(bias.expr, v, "bias", box.cod) + (Work("fma", v, "add", box.cod),)
    return (Work("fma", 2 * v, "bias and add", box.cod),)


def rule_index_map(box, vol, phase):
    return _expr_work(box.param("fn").expr, vol(box.cod[0].axis_names), "index map", box.cod)


def rule_scatter_aux(box, vol, phase):
    """Per element of its input: the gather's index arithmetic, then one add into the tensor."""
    v = vol(box.dom[0].axis_names)
    ops = sum(sum(k.work().values()) for k in box.param("at").index)
    return (Work("fma", (ops + 1) * v, "scatter-add (index and add)", box.cod),)


def rule_free(box, vol, phase):
    return ()


def rule_cast(box, vol, phase):
    return (Work("fma", vol(box.cod[0].axis_names), "convert", box.cod),)


def rule_softmax_contract(box, vol, phase):
    """Online softmax-contraction (state mu, z, o).  Per chunk: ``mu' = max(mu, max s)``,
    ``delta = exp(mu - mu')``, ``p = exp(s - mu')``, ``z' = delta z + sum p``,
    ``o' = delta o + p.V``; the tensor work is P.V at the values' precision."""
    s, o, st = vol(box.dom[0].axis_names), vol(box.cod[0].axis_names), vol(_stat_axes(box))
    pv = Work("tensor", 2 * vol(_axes_union(box.dom)), "P.V", box.dom[1:])
    if phase == "init":
        return ()
    if phase == "finalise":
        return (Work("fma", o, "o / z", box.cod),)
    if phase == "apply":
        return (pv, Work("exp", s, "exp(s - mu)", box.cod),
                Work("fma", 3 * s, "row max, s - mu, row sum", box.cod), Work("fma", o, "o / z", box.cod))
    return (pv, Work("exp", s, "exp(s - mu)", box.cod), Work("exp", st, "delta = exp(mu - mu')", box.cod),
            Work("fma", 3 * s, "row max, s - mu, row sum", box.cod),
            Work("fma", 3 * st, "mu, z merge", box.cod),
            Work("fma", 2 * o, "rescale and accumulate o", box.cod))


def rule_norm_contract(box, vol, phase):
    """Normalised contraction ``sum_j a1(s_j) v_j / b(sum_j a2(s_j))`` with state (o, z)."""
    s, o, st = vol(box.dom[0].axis_names), vol(box.cod[0].axis_names), vol(_stat_axes(box))
    av = Work("tensor", 2 * vol(_axes_union(box.dom)), "a1(S).V", box.dom[1:])
    body = (_fn_work(box.param("a1"), s, "a1", box.cod) + _fn_work(box.param("a2"), s, "a2", box.cod)
            + (av, Work("fma", s, "sum a2", box.cod)))
    tail = _fn_work(box.param("b"), st, "b", box.cod) + (Work("fma", o, "o / b(z)", box.cod),)
    if phase == "init":
        return ()
    if phase == "finalise":
        return tail
    if phase == "apply":
        return body + tail
    return body + (Work("fma", st + o, "merge z, accumulate o", box.cod),)


# One rule per box kind, keyed exactly like ops.kinds.SPECS.
COST_RULES: dict[str, Callable] = {
    "contract": rule_contract, "map": rule_map, "reduce": rule_reduce, "softmax": rule_softmax,
    "normalize": rule_normalize, "mask": rule_mask, "index_bias": rule_index_bias,
    "reindex": rule_free, "param": rule_free, "const": rule_free, "cast": rule_cast,
    "softmax_contract": rule_softmax_contract, "norm_contract": rule_norm_contract,
    "index_map": rule_index_map, "scatter_aux": rule_scatter_aux,
}


def box_work(box: Box, vol: Callable, phase: str = "apply") -> tuple[Work, ...]:
    """The work of ``box`` at ``phase`` (zero counts dropped); an unknown kind is refused by name."""
    try:
        rule = COST_RULES[box.kind]
    except KeyError:
        raise UnknownKindError(f"no cost rule for box kind {box.kind!r} (box {box.name})") from None
    return tuple(w for w in rule(box, vol, phase) if w.count != 0)
