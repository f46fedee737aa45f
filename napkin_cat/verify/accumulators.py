"""NumPy meaning of the accumulators of :mod:`napkin_cat.relabel.accumulators`.

One :class:`Steps` per accumulator rule: ``init(box, axis, shapes, ctx)`` -> state,
``update(box, axis, state, chunk inputs, ctx)`` -> state, ``finalise(box, axis, state, ctx)``
-> outputs.  The tiled executor (:mod:`.executor`) runs them chunk by chunk, and
``proofs/test_accumulators.py`` shows each equals its box on any split of the streamed axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.diagram import Box
from ..ops.functions import FUNCTIONS
from ..ops.arrays import NUMPY
from ..ops.semantics import align as _align, einsum as _einsum_xp
from ..relabel.accumulators import ACC_RULES, Accumulator, stat_names


@dataclass(frozen=True)
class Steps:
    init: Callable      # box, axis, shapes: dict[name, shape], ctx -> dict
    update: Callable    # box, axis, state, chunk inputs, ctx -> dict
    finalise: Callable  # box, axis, state, ctx -> tuple of outputs


def _out_names(box: Box) -> tuple[str, ...]:
    return box.cod[0].axis_names


def _red_axis(box: Box, axis: str) -> int:
    return box.dom[0].axis_names.index(axis)


def _einsum(ins, dom, out_names):
    return _einsum_xp(NUMPY, ins, dom, out_names)


def align(x, src, dst):
    return _align(NUMPY, x, src, dst)


def _fn(name: str):
    return lambda x: FUNCTIONS[name](NUMPY, x)


# --------------------------------------------------------------------------- monoids

def _sum_contract_update(box, axis, state, ins, ctx):
    return {"o": state["o"] + _einsum(list(ins), box.dom, _out_names(box))}


def _reduce_update(box, axis, state, ins, ctx):
    op = box.param("op")
    x = ins[0]
    k = _red_axis(box, axis)
    if op in ("sum", "mean"):
        return {"o": state["o"] + np.sum(x, axis=k)}
    if op == "max":
        return {"o": np.maximum(state["o"], np.max(x, axis=k))}
    if op == "min":
        return {"o": np.minimum(state["o"], np.min(x, axis=k))}
    raise AssertionError(op)


def _reduce_init(box, axis, shapes, ctx):
    fill = {"sum": 0.0, "mean": 0.0, "max": -np.inf, "min": np.inf}[box.param("op")]
    return {"o": np.full(shapes["o"], fill)}


def _reduce_finalise(box, axis, state, ctx):
    if box.param("op") == "mean":
        return (state["o"] / ctx.sizes[axis],)
    return (state["o"],)


# --------------------------------------------------------------------------- logsumexp

def _lse_update(box, axis, state, ins, ctx):
    x = ins[0]
    k = _red_axis(box, axis)
    m_new = np.maximum(state["m"], np.max(x, axis=k))
    safe = np.where(np.isfinite(m_new), m_new, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.exp(state["m"] - safe)
        p = np.exp(x - np.expand_dims(safe, k))
    return {"m": m_new, "z": delta * state["z"] + np.sum(p, axis=k)}


def _lse_finalise(box, axis, state, ctx):
    safe = np.where(np.isfinite(state["m"]), state["m"], 0.0)
    with np.errstate(divide="ignore"):
        return (safe + np.log(state["z"]),)


# --------------------------------------------------------------------------- online softmax-contraction

def _osc_init(box, axis, shapes, ctx):
    return {"mu": np.full(shapes["mu"], -np.inf), "z": np.zeros(shapes["z"]), "o": np.zeros(shapes["o"])}


def _osc_update(box, axis, state, ins, ctx):
    """``mu' = max(mu, max_j s_j)``, ``delta = exp(mu - mu')``, ``p_j = exp(s_j - mu')``,
    ``z' = delta z + sum p``, ``o' = delta o + sum p v``.  A row with no score above -inf so
    far keeps ``mu = -inf``; it is shifted by 0 instead, so that ``p = 0`` rather than NaN.  A
    NaN or +inf score is not shifted away: it makes ``z`` NaN for good (docs/NAN_POLICY.md)."""
    s, v = ins
    k = _red_axis(box, axis)
    mu_new = np.maximum(state["mu"], np.max(s, axis=k))
    safe = np.where(mu_new == -np.inf, 0.0, mu_new)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.exp(state["mu"] - safe)
        p = np.exp(s - np.expand_dims(safe, k))
    stat, out = stat_names(box, axis), _out_names(box)
    o = align(delta, stat, out) * state["o"] + _einsum([p, v], box.dom, out)
    return {"mu": mu_new, "z": delta * state["z"] + np.sum(p, axis=k), "o": o}


def _ratio_finalise(box, axis, state, ctx, z):
    stat, out = stat_names(box, axis), _out_names(box)
    zz = align(z, stat, out)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.where(zz != 0, state["o"] / np.where(zz != 0, zz, 1), 0.0),)


def _osc_finalise(box, axis, state, ctx):
    return _ratio_finalise(box, axis, state, ctx, state["z"])


# --------------------------------------------------------------------------- normalisation family

def _norm_update(box, axis, state, ins, ctx):
    s, v = ins
    k = _red_axis(box, axis)
    a1, a2 = _fn(box.param("a1")), _fn(box.param("a2"))
    return {"o": state["o"] + _einsum([a1(s), v], box.dom, _out_names(box)),
            "z": state["z"] + np.sum(a2(s), axis=k)}


def _norm_finalise(box, axis, state, ctx):
    return _ratio_finalise(box, axis, state, ctx, _fn(box.param("b"))(state["z"]) + box.param("eps"))


def _zeros(*names):
    return lambda box, axis, shapes, ctx: {n: np.zeros(shapes[n]) for n in names}


ACC_STEPS: dict[str, Steps] = {
    "sum_contract": Steps(_zeros("o"), _sum_contract_update, lambda box, axis, st, ctx: (st["o"],)),
    "reduce": Steps(_reduce_init, _reduce_update, _reduce_finalise),
    "logsumexp": Steps(lambda box, axis, shapes, ctx: {"m": np.full(shapes["m"], -np.inf), "z": np.zeros(shapes["z"])},
                       _lse_update, _lse_finalise),
    "online_softmax": Steps(_osc_init, _osc_update, _osc_finalise),
    "normalized": Steps(_zeros("z", "o"), _norm_update, _norm_finalise),
}


def init(acc: Accumulator, shapes, ctx) -> dict:
    return ACC_STEPS[acc.rule].init(acc.box, acc.axis, shapes, ctx)


def update(acc: Accumulator, state, ins, ctx) -> dict:
    return ACC_STEPS[acc.rule].update(acc.box, acc.axis, state, ins, ctx)


def finalise(acc: Accumulator, state, ctx) -> tuple:
    return ACC_STEPS[acc.rule].finalise(acc.box, acc.axis, state, ctx)
assert set(ACC_STEPS) == set(ACC_RULES), "every accumulator rule needs NumPy steps"
