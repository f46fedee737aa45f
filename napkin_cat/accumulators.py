"""Accumulators: what makes a stream partition possible.

A polymorphic ``f`` (defined for every length of the streamed axis) is streamable when an
accumulator ``B`` satisfies ``B(f(x), y) = f(x ++ y)``; with an initial state and a
finaliser the input can arrive a chunk at a time while the state stays resident.

Accumulators are *derived* from box kinds (:func:`derive_accumulator`), never declared per
algorithm.  Kinds:

``monoid``        sum (contractions, ``reduce sum``/``mean``), max, min
``state_machine`` logsumexp ``(m, z)``, online softmax-contraction ``(mu, z, o)``,
                  the normalisation family ``(o, z)``
``map``           the streamed axis survives to the output: each chunk is written out

Each rule has a NumPy ``init`` / ``update`` / ``finalise`` (the meaning the tiled executor
runs) and names the proof in ``proofs/`` that shows ``B(f(x), y) = f(x ++ y)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .core import Box
from .ops import NORMALISATIONS
from .semantics import FUNCTION_IMPLS, _einsum, align

REDUCING_KINDS = ("contract", "reduce", "softmax_contract", "norm_contract")


@dataclass(frozen=True)
class AccRule:
    name: str
    kind: str
    states: Callable   # box, axis -> tuple[(state name, axis names, role)]
    init: Callable     # box, axis, shapes: dict[name, shape], ctx -> dict
    update: Callable   # box, axis, state, chunk inputs, ctx -> dict
    finalise: Callable  # box, axis, state, ctx -> tuple of outputs
    proof: str


@dataclass(frozen=True, slots=True)
class Accumulator:
    """The accumulator of equation ``eqn`` (box ``box``) streamed along ``axis``."""

    rule: str
    eqn: int
    box: Box
    axis: str

    @property
    def spec(self) -> AccRule:
        return ACC_RULES[self.rule]

    @property
    def kind(self) -> str:
        return self.spec.kind

    def states(self):
        return self.spec.states(self.box, self.axis)

    def init(self, shapes, ctx):
        return self.spec.init(self.box, self.axis, shapes, ctx)

    def update(self, state, ins, ctx):
        return self.spec.update(self.box, self.axis, state, ins, ctx)

    def finalise(self, state, ctx):
        return self.spec.finalise(self.box, self.axis, state, ctx)


# --------------------------------------------------------------------------- helpers

def _out_names(box: Box) -> tuple[str, ...]:
    return box.cod[0].axis_names


def _stat_names(box: Box, axis: str) -> tuple[str, ...]:
    """Axes of the row statistics of a normalised contraction: the scores' minus the streamed."""
    return tuple(n for n in box.dom[0].axis_names if n != axis)


def _red_axis(box: Box, axis: str) -> int:
    return box.dom[0].axis_names.index(axis)


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
    stat, out = _stat_names(box, axis), _out_names(box)
    o = align(delta, stat, out) * state["o"] + _einsum([p, v], box.dom, out)
    return {"mu": mu_new, "z": delta * state["z"] + np.sum(p, axis=k), "o": o}


def _ratio_finalise(box, axis, state, ctx, z):
    stat, out = _stat_names(box, axis), _out_names(box)
    zz = align(z, stat, out)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.where(zz != 0, state["o"] / np.where(zz != 0, zz, 1), 0.0),)


def _osc_finalise(box, axis, state, ctx):
    return _ratio_finalise(box, axis, state, ctx, state["z"])


# --------------------------------------------------------------------------- normalisation family

def _is_softmax_family(box: Box) -> bool:
    return (box.param("a1"), box.param("a2"), box.param("b")) == NORMALISATIONS["softmax"]


def _norm_update(box, axis, state, ins, ctx):
    s, v = ins
    k = _red_axis(box, axis)
    a1, a2 = FUNCTION_IMPLS[box.param("a1")], FUNCTION_IMPLS[box.param("a2")]
    return {"o": state["o"] + _einsum([a1(s), v], box.dom, _out_names(box)),
            "z": state["z"] + np.sum(a2(s), axis=k)}


def _norm_finalise(box, axis, state, ctx):
    return _ratio_finalise(box, axis, state, ctx, FUNCTION_IMPLS[box.param("b")](state["z"]) + box.param("eps"))


def _zeros(*names):
    return lambda box, axis, shapes, ctx: {n: np.zeros(shapes[n]) for n in names}


ACC_RULES: dict[str, AccRule] = {
    "sum_contract": AccRule(
        "sum_contract", "monoid",
        lambda box, axis: (("o", _out_names(box), "main"),),
        _zeros("o"), _sum_contract_update, lambda box, axis, st, ctx: (st["o"],),
        "proofs/test_accumulators.py::test_contraction_is_a_sum_monoid"),
    "reduce": AccRule(
        "reduce", "monoid",
        lambda box, axis: (("o", _out_names(box), "main"),),
        _reduce_init, _reduce_update, _reduce_finalise,
        "proofs/test_accumulators.py::test_reductions_are_monoids"),
    "logsumexp": AccRule(
        "logsumexp", "state_machine",
        lambda box, axis: (("m", _out_names(box), "stat"), ("z", _out_names(box), "stat")),
        lambda box, axis, shapes, ctx: {"m": np.full(shapes["m"], -np.inf), "z": np.zeros(shapes["z"])},
        _lse_update, _lse_finalise,
        "proofs/test_accumulators.py::test_logsumexp_state_machine"),
    "online_softmax": AccRule(
        "online_softmax", "state_machine",
        lambda box, axis: (("mu", _stat_names(box, axis), "stat"), ("z", _stat_names(box, axis), "stat"),
                           ("o", _out_names(box), "main")),
        _osc_init, _osc_update, _osc_finalise,
        "proofs/test_accumulators.py::test_online_softmax_lemma"),
    "normalized": AccRule(
        "normalized", "state_machine",
        lambda box, axis: (("z", _stat_names(box, axis), "stat"), ("o", _out_names(box), "main")),
        _zeros("z", "o"), _norm_update, _norm_finalise,
        "proofs/test_accumulators.py::test_normalisation_family_lemma"),
}


def derive_accumulator(box: Box, eqn: int, axis: str) -> Accumulator | str:
    """The accumulator of ``box`` consuming ``axis``, or the reason there is none."""
    if box.kind == "contract":
        return Accumulator("sum_contract", eqn, box, axis)
    if box.kind == "reduce":
        op = box.param("op")
        return Accumulator("logsumexp" if op == "logsumexp" else "reduce", eqn, box, axis)
    if box.kind in ("softmax_contract", "norm_contract"):
        if box.param("axis") != axis:
            return f"{box.name} contracts {box.param('axis')}, not {axis}"
        stat = set(_stat_names(box, axis))
        if not stat <= set(_out_names(box)):
            return (f"{box.name}: score axes {sorted(stat)} are not all kept by the output "
                    f"{list(_out_names(box))}; the row statistics would have nowhere to live")
        if box.kind == "softmax_contract" or _is_softmax_family(box):
            return Accumulator("online_softmax", eqn, box, axis)
        return Accumulator("normalized", eqn, box, axis)
    if box.kind in ("softmax", "normalize"):
        return (f"{box.name} normalises along {axis} and keeps it: each output needs the whole "
                f"row; it streams only when followed by a contraction over {axis} "
                f"(softmax-contraction), and the probabilities must not be an output")
    return f"box {box.name} (kind {box.kind}) removes axis {axis} and has no accumulator"
