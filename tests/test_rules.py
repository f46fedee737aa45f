"""Every registered rule preserves types and NumPy semantics (one generic property test), and
random sequences of relabelings on the library diagrams stay equivalent (a stateful test)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import napkin_cat as nc
from napkin_cat.relabel import RULES

q, x, d = nc.axes("q x d")
L = nc.library
LIBRARY = {
    "attention": L.attention(q=q, x=x, d=d),
    "causal_window": L.attention(q=q, x=x, d=d, causal=True, window_size=2),
    "gqa": L.attention(q=q, x=x, d=d, groups=nc.Axis("g"), heads=nc.Axis("h")),
    "bias_alibi": L.attention(q=q, x=x, d=d, bias=nc.alibi(0.25), batch=nc.Axis("b")),
    "bias_input": L.attention(q=q, x=x, d=d, bias="input"),
    "l2_attention": L.normalized_attention(q=q, x=x, d=d),
    "matmul": L.matmul(),
    "batched_matmul": L.batched_matmul(),
    "linear": L.linear(),
    "mlp": L.mlp(),
    "softmax": L.softmax(),
    "layernorm": L.layernorm(),
    "rmsnorm": L.rmsnorm(),
}
SMALL = dict(examples=6, progress=False)


def _axes(dia):
    return [a.name for a in dia.axes]


def _streamed(dia):
    """The diagram streamed over each axis that streams (to give ``order`` something to order)."""
    out = []
    for a in _axes(dia):
        try:
            out.append((dia.stream(a, 2), a))
        except nc.RelabelError:
            pass
    return out


# rule name -> dia -> [(diagram the rule starts from, keyword arguments)]; a new rule without an
# entry fails test_every_rule_has_arguments by name
ARGUMENTS = {
    "tile": lambda dia: [(dia, {"axis": a, "size": s}) for a in _axes(dia) for s in (f"g_{a}", 3)],
    "stream": lambda dia: [(dia, {"axis": a, "size": s}) for a in _axes(dia) for s in (f"s_{a}", 3)],
    "place": lambda dia: [(dia, {"array": n, "level": lv}) for n in sorted(set(dia.var_names()))[:3]
                          for lv in ("SMEM", "registers")],
    "require": lambda dia: [(dia, {"axis": a, "multiple_of": 2}) for a in _axes(dia)],
    "order": lambda dia: [(s, {"axes": (a,)}) for s, a in _streamed(dia)],
    "fuse_softmax_contract": lambda dia: [(dia, {"axis": a}) for a in _axes(dia)],
    "fuse_norm_contract": lambda dia: [(dia, {"axis": a}) for a in _axes(dia)],
}


def test_every_rule_has_arguments():
    assert set(ARGUMENTS) == set(RULES), f"rules without arguments here: {set(RULES) - set(ARGUMENTS)}"
    for r in RULES.values():
        assert r.name and r.kind in ("relabel", "rewrite") and r.side_conditions and r.proof


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_preserves_types_and_semantics(name):
    r = RULES[name]
    applied = 0
    for label, dia in LIBRARY.items():
        for start, kw in ARGUMENTS[name](dia):
            if r.check(start, **kw) is not None:
                continue
            new = r.apply(start, **kw)
            assert (new.dom, new.cod) == (start.dom, start.cod), (name, label, kw)
            nc.check_equivalent(start, new, **SMALL)
            applied += 1
    assert applied, f"rule {name} applied to no library diagram"
    print(f"{name}: types and semantics preserved in {applied} applications")


def test_rule_check_explains_refusals():
    assert "needs the whole row" in RULES["stream"].check(LIBRARY["softmax"], axis="c", size=4)
    assert RULES["tile"].check(LIBRARY["matmul"], axis="a", size=4) is None
    assert "no softmax over b" in RULES["fuse_softmax_contract"].check(LIBRARY["matmul"], axis="b")


# --------------------------------------------------------------------------- stateful

class Relabelling(RuleBasedStateMachine):
    """Random tile / stream / place / require sequences; refusals are skipped; every accepted
    step is checked against the original diagram."""

    @initialize(name=st.sampled_from(sorted(LIBRARY)))
    def start(self, name):
        self.original = LIBRARY[name]
        self.current = self.original
        self.steps = []

    def _try(self, what, fn):
        try:
            new = fn()
            new.loop_nest()   # some nestings are refused only once the whole schedule is known
        except nc.RelabelError:
            return   # refused: the sequence goes on without it
        self.steps.append(what)
        assert (new.dom, new.cod) == (self.original.dom, self.original.cod)
        nc.check_equivalent(self.original, new, examples=4, time_budget=5, progress=False)
        self.current = new

    @rule(data=st.data(), op=st.sampled_from(["tile", "stream"]),
          size=st.one_of(st.integers(1, 5), st.sampled_from(["blk", "blk2"])))
    def partition(self, data, op, size):
        axis = data.draw(st.sampled_from(_axes(self.current)), label="axis")
        size = f"{size}_{axis}" if isinstance(size, str) else size
        self._try((op, axis, size), lambda: getattr(self.current, op)(axis, size))

    @rule(data=st.data(), level=st.sampled_from(["SMEM", "registers", "L2"]))
    def place(self, data, level):
        wire = data.draw(st.sampled_from(sorted(set(self.current.var_names()))), label="wire")
        self._try(("place", wire, level), lambda: self.current.place(wire, level))

    @rule(data=st.data(), k=st.sampled_from([1, 2, 4]))
    def require(self, data, k):
        axis = data.draw(st.sampled_from(_axes(self.current)), label="axis")
        self._try(("require", axis, k), lambda: self.current.require(axis, k))

    @invariant()
    def original_untouched(self):
        if hasattr(self, "original"):
            assert self.original.schedule == ()


Relabelling.TestCase.settings = settings(
    max_examples=30 if os.environ.get("NAPKIN_TEST_TIER") == "full" else 10, stateful_step_count=5, deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),   # no slow "explain"
    suppress_health_check=[HealthCheck.nested_given, HealthCheck.too_slow, HealthCheck.filter_too_much])
TestRelabelling = Relabelling.TestCase
