"""Relabelings (issue 3): the user story, every library family derived to streamed + tiled
forms that verify, refusals that name their reason, sub-streams, order, place, the printed
loop nest, and ``check_equivalent`` / ``derive`` themselves."""

from __future__ import annotations

import re

import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat.verify.check import EquivalenceReport
from napkin_cat.verify.derive import Derivation

q, x, d = nc.axes("q x d")
h, bt, g, e = nc.Axis("h"), nc.Axis("b"), nc.Axis("g"), nc.Axis("e")
L = nc.library
FAST = dict(examples=12, progress=False)


def _softmax_contraction() -> nc.Diagram:
    """``O = softmax_x(S) V`` on given scores: the softmax-contraction on its own."""
    b = nc.Builder()
    S, V = b.input("S", q, x), b.input("V", x, d)
    return b.diagram(b.contract(b.softmax(S, x), V, out=(q, d), name="O"), names=["O"])


def _scores_and_output() -> nc.Diagram:
    """Attention that also returns the probabilities ``P``: not streamable over x."""
    b = nc.Builder()
    Q, K, V = b.input("Q", q, d), b.input("K", x, d), b.input("V", x, d)
    P = b.softmax(b.contract(Q, K, out=(q, x), name="S"), x, name="P")
    return b.diagram(b.contract(P, V, out=(q, d), name="O"), P)


# name -> (diagram, derivation steps to a streamed + tiled form)
ATTN_STEPS = [("stream", x), ("tile", q)]
FAMILIES = {
    "attention": (L.attention(q=q, x=x, d=d), ATTN_STEPS),
    "causal": (L.attention(q=q, x=x, d=d, causal=True), ATTN_STEPS),
    "window": (L.attention(q=q, x=x, d=d, window_size=2), ATTN_STEPS),
    "gqa": (L.attention(q=q, x=x, d=d, groups=g, heads=h), ATTN_STEPS + [("tile", g), ("tile", h)]),
    "heads": (L.attention(q=q, x=x, d=d, heads=h), ATTN_STEPS + [("tile", h)]),
    "batch": (L.attention(q=q, x=x, d=d, heads=h, batch=bt), ATTN_STEPS + [("tile", bt)]),
    "bias_input": (L.attention(q=q, x=x, d=d, bias="input", heads=h), ATTN_STEPS),
    "alibi": (L.attention(q=q, x=x, d=d, bias=nc.alibi(0.5), causal=True), ATTN_STEPS),
    "value_dim": (L.attention(q=q, x=x, d=d, dv=e), ATTN_STEPS + [("tile", e)]),
    "l2_attention": (L.normalized_attention(q=q, x=x, d=d), ATTN_STEPS),
    "l1_attention": (L.normalized_attention(q=q, x=x, d=d, kind="l1"), ATTN_STEPS),
    "sigmoid_attention": (L.normalized_attention(q=q, x=x, d=d, kind="sigmoid_sum", heads=h), ATTN_STEPS),
    "softmax_contraction": (_softmax_contraction(), ATTN_STEPS),
    "matmul": (L.matmul(), [("tile", "a"), ("tile", "c"), ("stream", "b")]),
    "batched_matmul": (L.batched_matmul(), [("tile", "n", 2), ("tile", "a"), ("stream", "b", 3)]),
    "linear": (L.linear(), [("tile", "t"), ("tile", "o"), ("stream", "i")]),
    "mlp": (L.mlp(), [("tile", "t"), ("stream", "f")]),
}


def test_user_story_runs():
    attn = L.attention(q=q, x=x, d=d)
    flash = attn.stream(x, 16).tile(q, 32)
    report = nc.check_equivalent(attn, flash, progress=False)
    assert isinstance(report, EquivalenceReport) and report.examples > 0
    assert report.max_abs_error < 1e-9 and "equivalent on" in str(report)
    text = str(flash.loop_nest())
    assert "for q in tiles of 32" in text and "for x in chunks of 16" in text
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((40, 8)), rng.standard_normal((37, 8)), rng.standard_normal((37, 8))
    O2 = nc.evaluate(flash, Q, K, V)
    np.testing.assert_allclose(O2, nc.evaluate(attn, Q, K, V), rtol=1e-12, atol=1e-12)
    sym = attn.stream(x, "s_x").tile(q, "g_q")
    O3 = nc.evaluate(sym, Q, K, V, sizes={"s_x": 7, "g_q": 5})
    np.testing.assert_allclose(O3, O2, rtol=1e-12, atol=1e-12)
    steps = nc.derive(attn, [("stream", x), ("tile", q)], examples=10).steps
    assert [(s.name, s.verified) for s in steps] == [("stream", True), ("tile", True)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_derives_to_a_verified_streamed_and_tiled_form(name):
    dia, steps = FAMILIES[name]
    der = nc.derive(dia, steps, **FAST)
    assert all(s.verified for s in der.steps)
    ops = [r.op for r in der.final.schedule]
    assert "stream" in ops and "tile" in ops
    assert der.final.dom == dia.dom and der.final.cod == dia.cod
    # concrete blocks too: the final form with small integer blocks verifies
    blocks = {r.size: 3 for r in der.final.schedule if isinstance(r.size, str)}
    nc.check_equivalent(dia, der.final.bind(blocks), **FAST)


def test_flash_attention_and_matmul_derivations_replay():
    der = nc.derive(L.attention(q=q, x=x, d=d), [("stream", x), ("tile", q, "g_q", "SMEM")], **FAST)
    assert isinstance(der, Derivation)
    assert [s.spec for s in der.steps] == [("stream", "x", "s_x"), ("tile", "q", "g_q", "SMEM")]
    again = der.replay()
    assert again.final == der.final and all(s.verified for s in again.steps)
    text = str(der)
    assert "1. stream(x, s_x)" in text and "2. tile(q, g_q, SMEM)" in text and "verified on" in text
    mm = nc.derive(L.matmul(), [("tile", "a"), ("tile", "c"), ("stream", "b"), ("order", "b")], **FAST)
    assert [r.op for r in mm.final.schedule] == ["tile", "tile", "stream", "order"]
    unverified = der.replay(verify=False)
    assert not any(s.verified for s in unverified.steps) and unverified.final == der.final


def test_derive_fresh_symbols_for_a_sub_stream():
    der = nc.derive(L.attention(q=q, x=x, d=d), [("stream", x), ("stream", x)], **FAST)
    assert [r.size for r in der.final.schedule] == ["s_x", "s_x_2"]


def test_derive_refusal_raises_with_the_reason():
    with pytest.raises(nc.RelabelError, match=r"step 1 .*needs the whole row"):
        nc.derive(L.softmax(), [("stream", "c")], **FAST)
    with pytest.raises(nc.RelabelError, match="unknown rule 'frobnicate'"):
        nc.derive(L.softmax(), [("frobnicate", "c")], **FAST)


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("make, reason", [
    (lambda: L.attention(q=q, x=x, d=d).tile(x, 4), r"softmax\[x\] normalises along x"),
    (lambda: L.matmul().tile("b", 4), r"removes axis b .*stream b instead"),
    (lambda: L.softmax().stream("c", 4), "needs the whole row"),
    (lambda: _scores_and_output().stream(x, 4), "probabilities must not be an output"),
    (lambda: L.layernorm().stream("d", 4), "two passes over d"),
    (lambda: L.layernorm().tile("d", 4), "removes axis d"),
    (lambda: L.attention(q=q, x=x, d=d).require(x, 8).stream(x, 4), "not a multiple of 8"),
    (lambda: L.attention(q=q, x=x, d=d).stream(x, 12).require(x, 8), "not a multiple of 8"),
    (lambda: L.attention(q=nc.Axis("q", 10), x=x, d=d).tile("q", 16), "larger than axis q=10"),
    (lambda: L.attention(q=q, x=x, d=d).tile(q, 4, "L7"), "unknown memory level 'L7'"),
    (lambda: L.attention(q=q, x=x, d=d).tile(q, 4, "HBM"), "top level HBM"),
    (lambda: L.attention(q=q, x=x, d=d).stream("z", 4), "no axis 'z'"),
    (lambda: L.attention(q=q, x=x, d=d).place("Z", "SMEM"), "no wire named 'Z'"),
    (lambda: L.attention(q=q, x=x, d=d).order(q), "axis q is not streamed"),
    (lambda: L.attention(q=q, x=x, d=d).stream(x, 4).tile(x, 4), "softmax-contract"),
    (lambda: L.attention(q=q, x=x, d=d).stream(x, 0), "must be >= 1"),
    (lambda: L.attention(q=q, x=x, d=d).require(x, 0), "positive int"),
], ids=["tile-softmax-axis", "tile-reduced-axis", "stream-softmax-alone", "stream-probabilities-out",
        "stream-layernorm", "tile-layernorm", "require-then-block", "block-then-require",
        "block-too-large", "unknown-level", "top-level", "unknown-axis", "unknown-wire",
        "order-unstreamed", "tile-streamed", "zero-block", "zero-require"])
def test_refusals_name_their_reason(make, reason):
    with pytest.raises(nc.RelabelError, match=reason):
        make()


def test_require_combines_by_lcm_and_checks_symbolic_blocks_when_bound():
    attn = L.attention(q=q, x=x, d=d).require(x, 8).require(x, 12)
    assert [(r.op, r.size) for r in attn.schedule] == [("require", 24)]
    sym = attn.stream(x, "s_x")
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((3, 2)), rng.standard_normal((30, 2)), rng.standard_normal((30, 2))
    with pytest.raises(nc.RelabelError, match="not a multiple of 24"):
        nc.evaluate(sym, Q, K, V, sizes={"s_x": 12})
    report = nc.check_equivalent(L.attention(q=q, x=x, d=d), sym, max_size=48, **FAST)
    assert report.examples > 0   # drawn blocks respect the requirement: 24 or 48


# --------------------------------------------------------------------------- structure

def test_sub_streaming_nests_loops_and_verifies():
    attn = L.attention(q=q, x=x, d=d)
    sub = attn.stream(x, 8).stream(x, 3)
    text = sub.loop_nest().pseudocode(memory=False)
    assert re.search(r"for x in chunks of 8.*\n\s+for x in chunks of 3", text)
    nc.check_equivalent(attn, sub, **FAST)
    mm = L.matmul()
    nc.check_equivalent(mm, mm.tile("a", 2).stream("b", 5).stream("b", 2), **FAST)


def test_order_sets_the_loop_nesting():
    mm = L.matmul()
    first = mm.stream("b", 2).stream("c", 3)
    swapped = first.order("c", "b")
    loops = lambda dia: [(lp.axis, lp.kind) for lp in dia.loop_nest().loops]
    assert loops(first) == [("b", "stream"), ("c", "stream")]
    assert loops(swapped) == [("c", "stream"), ("b", "stream")]
    nc.check_equivalent(mm, swapped, **FAST)
    assert [r.op for r in swapped.order("b", "c").schedule].count("order") == 1


def test_place_colours_the_wire():
    flash = L.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q").place("O", "registers")
    text = flash.loop_nest().pseudocode(memory=False)
    assert "o[g_q d] @registers" in text
    nc.check_equivalent(L.attention(q=q, x=x, d=d), flash, **FAST)


def test_loop_nest_prints_the_pseudocode_diagram():
    flash = L.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
    assert flash.loop_nest().pseudocode(memory=False).splitlines() == [
        "for q in tiles of g_q  (grid, SMEM)",
        "  load Q[g_q d] -> SMEM",
        "  init O: mu[g_q] @registers, z[g_q] @registers, o[g_q d] @SMEM",
        "  for x in chunks of s_x  (stream, SMEM)",
        "    load K[s_x d] -> SMEM",
        "    load V[s_x d] -> SMEM",
        "    S[g_q s_x] = contract(Q, K)  @registers",
        "    S[g_q s_x] = scale(S)  @registers",
        "    update O (online_softmax) with S, V",
        "  finalise O[g_q d] = online_softmax(mu, z, o)  @SMEM",
        "  store O[g_q d] -> HBM",
    ]
    with_memory = str(flash.loop_nest())
    assert "| SMEM: " in with_memory and "registers: " in with_memory


def test_relabelling_leaves_the_original_untouched():
    attn = L.attention(q=q, x=x, d=d)
    snapshot = eval(repr(attn), vars(nc))
    flash = attn.stream(x, 16).tile(q, 32).place("O", "SMEM").require(q, 16)
    assert attn == snapshot and attn.schedule == () and hash(attn) == hash(snapshot)
    assert flash != attn and flash.unrelabelled() != attn   # the stream fused the softmax
    with pytest.raises(Exception):
        attn.schedule = flash.schedule   # frozen


# --------------------------------------------------------------------------- check_equivalent itself

def test_check_refuses_different_types_naming_both():
    with pytest.raises(nc.TypingError, match=r"(?s)a: \[Q\[q d\].*b: \[Q\[h q d\]"):
        nc.check_equivalent(L.attention(q=q, x=x, d=d), L.attention(q=q, x=x, d=d, heads=h))


def test_check_finds_and_shrinks_a_real_difference():
    plain, causal = L.attention(q=q, x=x, d=d), L.attention(q=q, x=x, d=d, causal=True)
    with pytest.raises(nc.EquivalenceError) as info:
        nc.check_equivalent(plain, causal, progress=False, seed=1)
    cx = info.value.counterexample
    # the smallest difference: one query row, two keys (a causal mask hides the second)
    assert cx["axis_sizes"] == {"q": 1, "d": 1, "x": 2}
    assert cx["coordinates"] == {"q": 0, "d": 0}
    ns: dict = {}
    exec(cx["code"].replace("print(", "_shown = ("), ns)
    assert ns["_shown"] == (cx["a_value"], cx["b_value"])


def test_check_report_budget_progress_and_fixed_sizes(capsys):
    attn = L.attention(q=q, x=x, d=d)
    flash = attn.stream(x, "s_x").tile(q, "g_q")
    # 2 s: on a loaded machine (CI's 2 cores) 0.5 s has ended before the first example
    r = nc.check_equivalent(attn, flash, examples=10_000, time_budget=2.0, progress=True)
    assert r.stopped_by_time and 0 < r.examples < 10_000 and r.seconds < 10
    assert "check_equivalent" in capsys.readouterr().err
    fixed = nc.check_equivalent(attn, flash, sizes={"d": 3, "q": 5}, **FAST)
    assert [s for s, _, _ in fixed.sizes_tried] == ["x"]
    one, two = (nc.check_equivalent(attn, flash, seed=7, **FAST) for _ in range(2))
    assert (one.sizes_tried, one.regimes_tried, one.max_abs_error) == \
        (two.sizes_tried, two.regimes_tried, two.max_abs_error)


def test_check_masked_regime_reaches_bias_inputs():
    attn = L.attention(q=q, x=x, d=d, bias="input")
    r = nc.check_equivalent(attn, attn.stream(x, 3).tile(q, "g_q"), examples=40, progress=False, seed=0)
    assert "masked" in dict(r.regimes_tried)
