"""Executable proofs of the fusion theorem's cases that :func:`napkin_cat.relabel.stream`
relies on (``RULES["stream"].proof``), and of the softmax-contraction rewrite
(``RULES["fuse_softmax_contract"]``).

For each case: the symbolic identity (sympy, small symbolic chunks), then the claim about the
IR (``stream_plan`` accepts or refuses, with the reason), then the tiled executor against the
NumPy semantics with :func:`napkin_cat.check_equivalent`.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import napkin_cat as nc
from napkin_cat.relabel import RULES, StreamPlan, fuse_norm_contract, fuse_softmax_contract, stream_plan

X = sp.symbols("x1 x2", real=True)
Y = sp.symbols("y1 y2 y3", real=True)
CHECK = dict(examples=15, progress=False)


def _nonzero(expr) -> bool:
    """A numeric witness that ``expr`` is not identically 0: its value at one rational point.

    (That sympy fails to simplify an expression to 0 proves nothing; a nonzero value does.)"""
    symbols = sorted(expr.free_symbols, key=str)
    point = {sym: sp.Rational(k + 2, 7) * (-1) ** k for k, sym in enumerate(symbols)}
    return abs(float(expr.subs(point).evalf())) > 1e-9


def test_precomposition_weaved_over_the_streamed_axis_keeps_streamability():
    # f = sum_c, g = exp weaved over c: g(x ++ y) = g(x) ++ g(y), so B(f(g(x)), g(y)) = f(g(x ++ y))
    # (sympy adds flatten, so the identity itself is immediate: the content is that the same
    # check fails for a g that is not weaved over the axis, which normalises each chunk)
    g = lambda chunk: [sp.exp(t) for t in chunk]
    f = lambda chunk: sp.Add(*chunk)
    assert sp.simplify(f(g(X)) + f(g(Y)) - f(g(X + Y))) == 0
    not_weaved = lambda chunk: [sp.exp(t) / sp.Add(*map(sp.exp, chunk)) for t in chunk]
    assert _nonzero(f(not_weaved(X)) + f(not_weaved(Y)) - f(not_weaved(X + Y)))
    print("proved: sum o exp: B(f(g(x)), g(y)) = f(g(x ++ y)) because exp is weaved over the axis; "
          "a chunk-normalising g breaks it")

    r, c = nc.axes("r c")
    b = nc.Builder()
    d = b.diagram(b.reduce("sum", b.map("exp", b.input("X", r, c)), c, name="Z"))
    plan = stream_plan(d, "c")
    assert isinstance(plan, StreamPlan) and plan.region == (0,) and plan.accumulators[0].rule == "reduce"
    nc.check_equivalent(d, d.stream(c, "s_c"), **CHECK)
    attn = nc.library.attention()
    plan = stream_plan(fuse_softmax_contract(attn, "x"), "x")
    assert [attn.eqns[k].box.kind for k in plan.region] == ["contract", "map"]
    nc.check_equivalent(attn, attn.stream("x", "s_x"), **CHECK)
    print("checked: exp before sum over c, and Q.K^T (weaved over x) before the online softmax, "
          "stream; the executor matches NumPy")


def test_weaving_keeps_streamability():
    # weaving = the same accumulator per index of the new axis: proved per index by the lemma
    n = nc.Axis("n")
    for base, axis, woven in [(nc.library.matmul(), "b", nc.library.batched_matmul(batch=n)),
                              (nc.library.attention(), "x",
                               nc.library.attention(heads=nc.Axis("h"), batch=nc.Axis("bb")))]:
        assert isinstance(stream_plan(fuse_softmax_contract(base, axis), axis), StreamPlan)
        plan = stream_plan(fuse_softmax_contract(woven, axis), axis)
        assert isinstance(plan, StreamPlan)
        nc.check_equivalent(woven, woven.stream(axis, "s"), **CHECK)
    print("checked: matmul weaved over a batch and attention weaved over heads and batch stream "
          "like the unweaved ones; the executor matches NumPy")


def test_postcomposition_keeps_streamability():
    # h after the accumulator sees only the finalised state: h(finalise(B(state(x), y))) =
    # h(f(x ++ y)), here for the online softmax-contraction (running max shift, rescale factors
    # exp(m_old - m_new)) of one row streamed in chunks x = (x1, x2) and y = (y1, y2, y3).  The
    # shifts are free symbols: the identity holds for any shifts, so for the running max too
    # (with Max itself sympy would flatten Max(Max(x), y) and compare an expression with itself).
    h = sp.tanh
    V = sp.Matrix(5, 1, sp.symbols("v1:6", real=True))
    scores = X + Y
    streamed = _row_softmax_contract_online(scores, V, [2], sp.symbols("m1 m2", real=True))[0, 0]
    weights = [sp.exp(t) for t in scores]
    whole = sp.Add(*(w * V[j, 0] for j, w in enumerate(weights))) / sp.Add(*weights)
    assert sp.simplify(h(streamed) - h(whole)) == 0
    # h inside the loop (on each chunk's finalised value, then combined) is not the same
    per_chunk = [_row_softmax_contract_online(c, V[k:k + len(c), :], [], [0])[0, 0]
                 for k, c in ((0, X), (2, Y))]
    zx, zy = sp.Add(*weights[:2]), sp.Add(*weights[2:])
    assert _nonzero((zx * h(per_chunk[0]) + zy * h(per_chunk[1])) / (zx + zy) - h(whole))
    print("proved: tanh after the online softmax-contraction (with its rescale factors) = tanh of "
          "the whole; tanh applied per chunk is not")

    q, x, dd = nc.axes("q x d")
    b = nc.Builder()
    Q, K, V = b.input("Q", q, dd), b.input("K", x, dd), b.input("V", x, dd)
    P = b.softmax(b.contract(Q, K, out=(q, x), name="S"), x)
    O = b.map("tanh", b.contract(P, V, out=(q, dd), name="O"))
    d = b.diagram(O, names=["O"])
    plan = stream_plan(fuse_softmax_contract(d, "x"), "x")
    assert isinstance(plan, StreamPlan) and plan.outside, plan
    nc.check_equivalent(d, d.stream(x, "s_x").tile(q, "g_q"), **CHECK)
    print("checked: tanh after attention stays outside the x loop (after finalise); matches NumPy")


def test_removing_the_streamed_axis_before_the_accumulator_breaks_streamability():
    # layernorm: mean over d, then X - mean needs every chunk of d again: two passes
    ln = nc.library.layernorm()
    why = stream_plan(ln, "d")
    assert isinstance(why, str) and "two passes" in why
    with pytest.raises(nc.RelabelError, match="two passes"):
        ln.stream("d", 4)
    # softmax keeps the axis and needs the whole row; fused only when contracted right after
    with pytest.raises(nc.RelabelError, match="needs the whole row"):
        nc.library.softmax().stream("c", 4)
    print(f"checked: removing d before using it again is refused: {why}")


def _row_softmax_contract_online(s_row, V, cuts, shifts):
    """Online softmax-contraction of one row, in chunks, with free shifts (symbolic)."""
    mu, z, o = -sp.oo, sp.Integer(0), sp.zeros(1, V.shape[1])
    bounds = [0, *cuts, len(s_row)]
    for (lo, hi), m in zip(zip(bounds, bounds[1:]), shifts):
        delta = sp.exp(mu - m)
        p = [sp.exp(s_row[j] - m) for j in range(lo, hi)]
        z = delta * z + sum(p, sp.Integer(0))
        o = delta * o + sum((p[j - lo] * V[j, :] for j in range(lo, hi)), sp.zeros(1, V.shape[1]))
        mu = m
    return o / z


def test_softmax_contraction_rewrite_equals_the_original():
    # 2 x 3 scores, 3 x 2 values: softmax then contraction vs the fused box, streamed 2 + 1
    S = sp.Matrix(2, 3, sp.symbols("s1:7", real=True))
    V = sp.Matrix(3, 2, sp.symbols("v1:7", real=True))
    P = sp.Matrix(2, 3, lambda i, j: sp.exp(S[i, j]) / sum(sp.exp(S[i, k]) for k in range(3)))
    original = P * V
    shifts = sp.symbols("m1 m2", real=True)
    for i in range(2):
        fused = _row_softmax_contract_online([S[i, j] for j in range(3)], V, [2], shifts)
        assert all(sp.simplify(fused[0, c] - original[i, c]) == 0 for c in range(2))
    print("proved: on 2x3 scores, contract_x(softmax_x(S), V) = the softmax-contraction state "
          "machine streamed in chunks 2 + 1, for any shifts")

    for d in (nc.library.attention(), nc.library.attention(causal=True, heads=nc.Axis("h"))):
        fused = RULES["fuse_softmax_contract"].apply(d, axis="x")
        kinds = [e.box.kind for e in fused.eqns]
        assert "softmax" not in kinds and kinds.count("softmax_contract") == 1
        assert fused.dom == d.dom and fused.cod == d.cod
        rng = np.random.default_rng(0)
        sizes = {"q": 3, "x": 5, "d": 2, "h": 2}
        args = [rng.standard_normal(tuple(sizes[n] for n in a.axis_names)) for a in d.dom]
        np.testing.assert_allclose(nc.evaluate(fused, *args), nc.evaluate(d, *args), rtol=1e-14, atol=1e-14)
        nc.check_equivalent(d, fused, **CHECK)
    print("checked: fuse_softmax_contract removes the softmax, keeps the type, and evaluates "
          "equal to the original (NumPy, and check_equivalent)")


def test_normalisation_contraction_rewrite_equals_the_original():
    S = sp.Matrix(1, 3, sp.symbols("s1:4", real=True))
    V = sp.Matrix(3, 1, sp.symbols("v1:4", real=True))
    z = sum(S[0, j] ** 2 for j in range(3))
    original = sum(S[0, j] / sp.sqrt(z) * V[j, 0] for j in range(3))
    o = (S[0, 0] * V[0, 0] + S[0, 1] * V[1, 0]) + S[0, 2] * V[2, 0]        # chunks 2 + 1
    zz = (S[0, 0] ** 2 + S[0, 1] ** 2) + S[0, 2] ** 2
    assert sp.simplify(o / sp.sqrt(zz) - original) == 0
    print("proved: l2 normalisation then contraction = the (o, z) state machine in chunks 2 + 1")
    d = nc.library.normalized_attention(kind="l2")
    fused = fuse_norm_contract(d, "x")
    assert [e.box.kind for e in fused.eqns].count("norm_contract") == 1
    nc.check_equivalent(d, fused, **CHECK)
    nc.check_equivalent(d, d.stream("x", "s_x"), **CHECK)
    print("checked: fuse_norm_contract evaluates equal to the original and streams")
