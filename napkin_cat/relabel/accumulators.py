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

Each rule here is a *definition*: its states (name, axes, role) and the proof in ``proofs/``
that shows ``B(f(x), y) = f(x ++ y)``.  Its meaning as NumPy ``init`` / ``update`` /
``finalise`` steps is in :mod:`napkin_cat.verify.accumulators` (run by the tiled executor), its
code in :mod:`napkin_cat.lowering`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.diagram import Box
from ..ops.kinds import NORMALISATIONS, spec

REDUCING_KINDS = ("contract", "reduce", "softmax_contract", "norm_contract")


@dataclass(frozen=True)
class AccRule:
    name: str
    kind: str
    states: Callable   # box, axis -> tuple[(state name, axis names, role)]
    proof: str         # the test in proofs/ showing B(f(x), y) = f(x ++ y)


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

    def reduces(self, axis: str) -> bool:
        """Whether the box sums ``axis`` away: an input carries it, the output does not (a
        contraction over the queries, updated inside a stream over the groups)."""
        return (any(axis in t.axis_names for t in self.box.dom)
                and axis not in self.box.cod[0].axis_names)

    def slice_updates(self, axis: str) -> bool:
        """Inside a stream loop over ``axis`` (not its own), each chunk updates a slice of a state
        that carries ``axis``; a loop over an axis no state carries adds to whole states."""
        return axis != self.axis and any(axis in axes_ for _, axes_, _ in self.states())



# --------------------------------------------------------------------------- helpers

def _out_names(box: Box) -> tuple[str, ...]:
    return box.cod[0].axis_names


def stat_names(box: Box, axis: str) -> tuple[str, ...]:
    """Axes of the row statistics of a normalised contraction: the scores' minus the streamed."""
    return tuple(n for n in box.dom[0].axis_names if n != axis)


def _red_axis(box: Box, axis: str) -> int:
    return box.dom[0].axis_names.index(axis)


ACC_RULES: dict[str, AccRule] = {r.name: r for r in (
    AccRule("sum_contract", "monoid", lambda box, axis: (("o", _out_names(box), "main"),),
            "proofs/test_accumulators.py::test_contraction_is_a_sum_monoid"),
    AccRule("reduce", "monoid", lambda box, axis: (("o", _out_names(box), "main"),),
            "proofs/test_accumulators.py::test_reductions_are_monoids"),
    AccRule("logsumexp", "state_machine",
            lambda box, axis: (("m", _out_names(box), "stat"), ("z", _out_names(box), "stat")),
            "proofs/test_accumulators.py::test_logsumexp_state_machine"),
    AccRule("online_softmax", "state_machine",
            lambda box, axis: (("mu", stat_names(box, axis), "stat"), ("z", stat_names(box, axis), "stat"),
                               ("o", _out_names(box), "main")),
            "proofs/test_accumulators.py::test_online_softmax_lemma"),
    AccRule("normalized", "state_machine",
            lambda box, axis: (("z", stat_names(box, axis), "stat"), ("o", _out_names(box), "main")),
            "proofs/test_accumulators.py::test_normalisation_family_lemma"),
)}


def is_softmax_family(box: Box) -> bool:
    return (box.param("a1"), box.param("a2"), box.param("b")) == NORMALISATIONS["softmax"]


def derive_accumulator(box: Box, eqn: int, axis: str) -> Accumulator | str:
    """The accumulator of ``box`` consuming ``axis``, or the reason there is none."""
    if box.kind == "contract":
        return Accumulator("sum_contract", eqn, box, axis)
    if box.kind == "reduce":
        op = box.param("op")
        return Accumulator("logsumexp" if op == "logsumexp" else "reduce", eqn, box, axis)
    if spec(box).fused:
        if box.param("axis") != axis:
            return f"{box.name} contracts {box.param('axis')}, not {axis}"
        stat = set(stat_names(box, axis))
        if not stat <= set(_out_names(box)):
            return (f"{box.name}: score axes {sorted(stat)} are not all kept by the output "
                    f"{list(_out_names(box))}; the row statistics would have nowhere to live")
        if box.kind == "softmax_contract" or is_softmax_family(box):
            return Accumulator("online_softmax", eqn, box, axis)
        return Accumulator("normalized", eqn, box, axis)
    if spec(box).shape == "normaliser":
        return (f"{box.name} normalises along {axis} and keeps it: each output needs the whole "
                f"row; it streams only when followed by a contraction over {axis} "
                f"(softmax-contraction), and the probabilities must not be an output")
    return f"box {box.name} (kind {box.kind}) removes axis {axis} and has no accumulator"
