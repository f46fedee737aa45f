"""Executable proofs that every accumulator satisfies ``B(f(x), y) = f(x ++ y)``.

Each test proves the law with sympy on symbolic chunk contents (a chunk ``x`` of 2 symbols and
a chunk ``y`` of 3), prints what it proved, and then runs the *implementation* in
:data:`napkin_cat.verify.accumulators.ACC_STEPS` (``init`` / ``update`` / ``finalise``) on random
NumPy chunks against the NumPy semantics of the same box, so the proof is tied to the code.

State machines carry a running shift (``mu``, ``m``): the algebra below keeps that shift a
free symbol and proves the invariants for *every* shift, so the identities hold in particular
for the running maximum the code uses (the maximum only keeps ``exp`` from overflowing).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import sympy as sp

import napkin_cat as nc
from napkin_cat.relabel.accumulators import ACC_RULES, derive_accumulator
from napkin_cat.relabel import fuse_norm_contract, fuse_softmax_contract
from napkin_cat.ops.semantics import Ctx, apply_box
from napkin_cat.verify import accumulators as steps

X = sp.symbols("x1 x2", real=True)          # chunk x
Y = sp.symbols("y1 y2 y3", real=True)       # chunk y
XY = X + Y                                   # x ++ y


def zero(expr) -> bool:
    return sp.simplify(sp.expand(sp.powsimp(sp.expand(expr), force=True))) == 0


def run_chunks(box, eqn, axis, ins, in_axes, sizes, cuts):
    """Run the accumulator of ``box`` over ``ins`` cut along ``axis`` at ``cuts``."""
    acc = derive_accumulator(box, eqn, axis)
    assert not isinstance(acc, str), acc
    ctx = Ctx(dict(sizes))
    shapes = {name: tuple(sizes[a] for a in axes_) for name, axes_, _ in acc.states()}
    state = steps.init(acc, shapes, ctx)
    bounds = [0, *cuts, sizes[axis]]
    for lo, hi in zip(bounds, bounds[1:]):
        chunk = []
        for x, names in zip(ins, in_axes):
            sl = tuple(slice(lo, hi) if n == axis else slice(None) for n in names)
            chunk.append(x[sl])
        state = steps.update(acc, state, chunk, ctx)
    return steps.finalise(acc, state, ctx)[0], apply_box(box, list(ins), ctx)[0]


# --------------------------------------------------------------------------- monoids

def test_contraction_is_a_sum_monoid():
    a = sp.symbols("a1:6", real=True)
    b = sp.symbols("b1:6", real=True)
    f = lambda idx: sum((a[i] * b[i] for i in idx), sp.Integer(0))   # contraction of a chunk
    B = lambda state, idx: state + f(idx)                              # the accumulator
    x, y = range(0, 2), range(2, 5)
    assert zero(B(f(x), y) - f(range(5)))
    assert zero(B(sp.Integer(0), x) - f(x))                            # 0 is the unit
    print("proved: sum_j a_j b_j over x++y = (sum over x) + (sum over y); initial state 0 is the unit")

    mm = nc.library.matmul()
    box = mm.eqns[0].box
    rng = np.random.default_rng(0)
    A, Bm = rng.standard_normal((3, 7)), rng.standard_normal((7, 4))
    got, want = run_chunks(box, 0, "b", [A, Bm], [("a", "b"), ("b", "c")], {"a": 3, "b": 7, "c": 4}, [2, 5])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    print("checked: ACC_RULES['sum_contract'] on chunks 2+3+2 of b equals the matmul box")


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_reductions_are_monoids(op):
    combine = {"sum": lambda *t: sp.Add(*t), "max": sp.Max, "min": sp.Min, "mean": lambda *t: sp.Add(*t)}[op]
    unit = {"sum": sp.Integer(0), "max": -sp.oo, "min": sp.oo, "mean": sp.Integer(0)}[op]
    f = lambda chunk: combine(*chunk)
    B = lambda state, chunk: combine(state, *chunk)
    assert sp.simplify(B(f(X), Y) - f(XY)) == 0
    assert sp.simplify(B(unit, X) - f(X)) == 0
    if op == "mean":  # mean = sum, then finalise divides by the full length
        assert sp.simplify(B(f(X), Y) / len(XY) - sp.Add(*XY) / 5) == 0
    print(f"proved: {op}: B(f(x), y) = f(x ++ y) on chunks of 2 and 3 symbols; unit {unit}")

    r, c = nc.axes("r c")
    X_ = nc.Array((r, c), nc.f32, "X")
    box = nc.ops.reduce_box(op, X_, c)
    rng = np.random.default_rng(1)
    data = rng.standard_normal((4, 9))
    got, want = run_chunks(box, 0, "c", [data], [("r", "c")], {"r": 4, "c": 9}, [2, 5])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    print(f"checked: ACC_RULES['reduce'] ({op}) on chunks 2+3+4 of c equals the reduce box")


# --------------------------------------------------------------------------- logsumexp

def test_logsumexp_state_machine():
    m, m2 = sp.symbols("m m2", real=True)    # any running shifts (the code uses the max)
    z_of = lambda chunk, shift: sum((sp.exp(t - shift) for t in chunk), sp.Integer(0))
    # invariant after a chunk: z = sum exp(t - m); update to a new shift m2
    z = z_of(X, m)
    z_new = sp.exp(m - m2) * z + z_of(Y, m2)
    assert zero(z_new - z_of(XY, m2))
    # finalise m2 + log z equals logsumexp of the concatenation, for every shift
    # (z > 0, so taking logs of exp(m') z = sum exp(t) gives m' + log z = logsumexp)
    assert zero(sp.exp(m2) * z_new - sum(sp.exp(t) for t in XY))
    # the initial state (-oo, 0) is a unit
    assert zero((sp.exp(-sp.oo - m) * 0 + z_of(X, m)) - z_of(X, m))
    print("proved: logsumexp state (m, z): z' = exp(m - m') z + sum_y exp(y - m') keeps "
          "z = sum exp(t - m') over x++y for every shift; m' + log z' = log sum exp(x++y)")

    r, c = nc.axes("r c")
    box = nc.ops.reduce_box("logsumexp", nc.Array((r, c), nc.f32, "X"), c)
    rng = np.random.default_rng(2)
    data = rng.standard_normal((4, 9)) * 50
    data[0, :4] = -np.inf                      # a row whose first chunks are masked
    got, want = run_chunks(box, 0, "c", [data], [("r", "c")], {"r": 4, "c": 9}, [2, 5])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    print("checked: ACC_RULES['logsumexp'] on chunks 2+3+4 (one row masked at first) equals the box")


# --------------------------------------------------------------------------- online softmax

def _online_softmax(chunks, v, shifts, rescale=True):
    """The state machine of accumulators._osc_update, symbolically, with given shifts."""
    mu, z, o = -sp.oo, sp.Integer(0), sp.Integer(0)
    for chunk, new in zip(chunks, shifts):
        delta = sp.exp(mu - new) if rescale else sp.Integer(1)   # exp(-oo - m) = 0 at first
        p = [sp.exp(s - new) for s in chunk]
        z = delta * z + sum(p, sp.Integer(0))
        o = delta * o + sum((pj * v[s] for pj, s in zip(p, chunk)), sp.Integer(0))
        mu = new
    return mu, z, o


def test_online_softmax_lemma():
    v = {s: sp.Symbol(f"v_{s}", real=True) for s in XY}
    m1, m2 = sp.symbols("mu1 mu2", real=True)
    _, z, o = _online_softmax([X, Y], v, [m1, m2])
    full_z = sum(sp.exp(s) for s in XY)
    full_o = sum(sp.exp(s) * v[s] for s in XY)
    # invariants after two chunks, for any shifts mu1, mu2
    assert zero(z - sp.exp(-m2) * full_z)
    assert zero(o - sp.exp(-m2) * full_o)
    # the finalised state is the softmax-contraction of the concatenation
    assert sp.simplify(o / z - full_o / full_z) == 0
    # B(f(x), y) = f(x ++ y): continuing the state of x with y = running on x ++ y in one chunk
    _, z1, o1 = _online_softmax([XY], v, [m2])
    assert zero(z - z1) and zero(o - o1)
    # the proof has teeth: without the rescale delta the identity fails
    _, zb, ob = _online_softmax([X, Y], v, [m1, m2], rescale=False)
    assert not zero(zb - sp.exp(-m2) * full_z)
    print("proved: online softmax (mu, z, o): after chunks x (2) and y (3), for all shifts mu1, mu2, "
          "z = e^-mu2 sum e^s, o = e^-mu2 sum e^s v, so o/z = softmax(x++y) . v; the state after "
          "x then y equals the state after x++y")

    # the actual rule, on the box produced by the rewrite, against the box's NumPy meaning
    d = fuse_softmax_contract(nc.library.attention(), "x")
    k = next(i for i, e in enumerate(d.eqns) if e.box.kind == "softmax_contract")
    box = d.eqns[k].box
    assert ACC_RULES["online_softmax"].proof.endswith("test_online_softmax_lemma")
    rng = np.random.default_rng(3)
    S, V = rng.standard_normal((4, 9)) * 30, rng.standard_normal((9, 3))
    S[1] = -np.inf                              # a fully masked row gives zeros
    S[2, :5] = -np.inf                          # masked in the first two chunks only
    got, want = run_chunks(box, k, "x", [S, V], [("q", "x"), ("x", "d")], {"q": 4, "x": 9, "d": 3}, [2, 5])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.all(got[1] == 0)
    print("checked: ACC_RULES['online_softmax'] on chunks 2+3+4 (masked rows included) equals "
          "the softmax_contract box")


# --------------------------------------------------------------------------- normalisation family

def test_normalisation_family_lemma():
    a1, a2, bf = sp.Function("a1"), sp.Function("a2"), sp.Function("b")
    eps = sp.Symbol("eps", real=True)
    v = {s: sp.Symbol(f"v_{s}", real=True) for s in XY}
    f_o = lambda chunk: sum((a1(s) * v[s] for s in chunk), sp.Integer(0))
    f_z = lambda chunk: sum((a2(s) for s in chunk), sp.Integer(0))
    o, z = f_o(X) + f_o(Y), f_z(X) + f_z(Y)   # B((o, z), y) = (o + sum a1 v, z + sum a2)
    assert zero(o - f_o(XY)) and zero(z - f_z(XY))
    N = {s: a1(s) / (bf(f_z(XY)) + eps) for s in XY}   # the normalisation of x ++ y
    assert sp.simplify(o / (bf(z) + eps) - sum(N[s] * v[s] for s in XY)) == 0
    print("proved: for all functions a1, a2, b: state (o, z) with o += sum a1(s) v, z += sum a2(s) "
          "finalised o / (b(z) + eps) equals N(x++y) . v with N_i = a1(s_i) / (b(sum a2) + eps)")

    for kind in ("l2", "l1", "sigmoid_sum"):
        d = fuse_norm_contract(nc.library.normalized_attention(kind=kind), "x")
        k = next(i for i, e in enumerate(d.eqns) if e.box.kind == "norm_contract")
        box = d.eqns[k].box
        acc = derive_accumulator(box, k, "x")
        assert acc.rule == "normalized"
        rng = np.random.default_rng(4)
        S, V = rng.standard_normal((4, 9)), rng.standard_normal((9, 3))
        got, want = run_chunks(box, k, "x", [S, V], [("q", "x"), ("x", "d")], {"q": 4, "x": 9, "d": 3}, [2, 5])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        print(f"checked: ACC_RULES['normalized'] ({kind}) on chunks 2+3+4 equals the norm_contract box")


def test_every_accumulator_names_an_existing_proof():
    me = sys.modules[__name__]
    for name, rule in ACC_RULES.items():
        path, test = rule.proof.split("::")
        assert path == "proofs/test_accumulators.py", name
        assert callable(getattr(me, test, None)), f"{name}: proof {rule.proof} does not exist"
    print(f"checked: the {len(ACC_RULES)} accumulators each name a proof in this file")
