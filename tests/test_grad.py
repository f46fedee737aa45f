"""Reverse-mode differentiation (:func:`napkin_cat.ops.grad.grad`) against torch autograd.

The reference is torch's gradient of the oracle (``nc.to_torch``), in float64: every library
diagram, every elementwise function (by name, so a function without a derivative fails by
name), every box kind's rule, random small diagrams, fully masked rows (zero gradient, no
NaN), and relabelings of the grad diagram checked with ``check_equivalent``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import napkin_cat as nc
from napkin_cat import Array, Axis, Builder, ops
from napkin_cat.core.errors import RelabelError, TypingError
from napkin_cat.ops.functions import FUNCTIONS
from napkin_cat.ops.grad import VJP_RULES, grad
from napkin_cat.ops.kinds import NORMALISATIONS, SPECS

SIZES = {"q": 5, "x": 6, "d": 3, "e": 4, "h": 2, "b": 2, "g": 2, "a": 4, "c": 5, "n": 2, "t": 4,
         "i": 3, "o": 5, "f": 6, "r": 3, "k": 4}


def _inputs(d, seed: int, positive: bool = False, sizes=None):
    rng = np.random.default_rng(seed)
    sizes = {**SIZES, **(sizes or {})}
    out = []
    for arr in d.dom:
        shape = tuple(ax.size if not ax.symbolic else sizes[ax.name] for ax in arr.axes)
        x = rng.standard_normal(shape)
        out.append(np.abs(x) + 0.5 if positive else x)
    return out


def torch_grads(d, ins, cots, wrt=None):
    """torch autograd of the oracle: the cotangent of every input in ``wrt`` (default: all)."""
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in ins]
    out = nc.to_torch(d)(*ts)
    out = out if isinstance(out, tuple) else (out,)
    wrt = range(len(ins)) if wrt is None else wrt
    pairs = [(o, torch.tensor(c)) for o, c in zip(out, cots) if o.requires_grad]   # ``equal`` is constant
    got = torch.autograd.grad([o for o, _ in pairs], [ts[i] for i in wrt], [c for _, c in pairs],
                              allow_unused=True) if pairs else [None] * len(wrt)
    return [np.zeros(ins[i].shape) if g is None else g.numpy() for i, g in zip(wrt, got)]


def check_grad(d, seed: int = 0, positive: bool = False, sizes=None, wrt=None, tol: float = 1e-9):
    ins = _inputs(d, seed, positive, sizes)
    cots = [np.random.default_rng(seed + 1).standard_normal(np.shape(o))
            for o in _as_tuple(nc.evaluate(d, *ins))]
    gd = grad(d, wrt)
    assert [a.name for a in gd.dom] == [a.name for a in d.dom] + [f"d{a.name}" for a in d.cod]
    got = _as_tuple(nc.evaluate(gd, *ins, *cots))
    idx = [i for i, a in enumerate(d.dom) if a.dtype.kind == "float"] if wrt is None else \
        [[a.name for a in d.dom].index(w) for w in wrt]
    want = torch_grads(d, ins, cots, idx)
    assert [a.name for a in gd.cod] == [f"d{d.dom[i].name}" for i in idx]
    for i, g, w in zip(idx, got, want):
        scale = max(1.0, float(np.max(np.abs(w))) if w.size else 1.0)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, err_msg=f"d{d.dom[i].name} of {d}")
    return gd


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


# --------------------------------------------------------------------------- tables in sync

@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_kind_has_a_vjp_rule(kind):
    assert kind in VJP_RULES, f"box kind {kind!r} has no vector-Jacobian rule in ops.grad.VJP_RULES"


def test_no_vjp_rule_for_a_kind_without_a_spec():
    assert set(VJP_RULES) <= set(SPECS), set(VJP_RULES) - set(SPECS)


# --------------------------------------------------------------------------- library diagrams

q, x, d, e, h, b, g = (Axis(n) for n in "qxdehbg")

LIBRARY = {
    "attention": lambda: nc.library.attention(q, x, d),
    "attention_causal": lambda: nc.library.attention(q, x, d, causal=True),
    "attention_window": lambda: nc.library.attention(q, x, d, window_size=2),
    "attention_alibi": lambda: nc.library.attention(q, x, d, bias=nc.alibi(0.5), causal=True),
    "attention_bias_input": lambda: nc.library.attention(q, x, d, bias="input"),
    "attention_gqa": lambda: nc.library.attention(q, x, d, groups=g, heads=h),
    "attention_heads": lambda: nc.library.attention(q, x, d, heads=h),
    "attention_batch_heads_causal": lambda: nc.library.attention(q, x, d, heads=h, batch=b, causal=True),
    "attention_dv": lambda: nc.library.attention(q, x, d, dv=e),
    "attention_scale": lambda: nc.library.attention(q, x, d, scale=0.7, mask=nc.causal(2)),
    "matmul": lambda: nc.library.matmul(),
    "batched_matmul": lambda: nc.library.batched_matmul(),
    "linear": lambda: nc.library.linear(),
    "linear_relu_nobias": lambda: nc.library.linear(bias=False, activation="relu"),
    "linear_silu": lambda: nc.library.linear(activation="silu"),
    "mlp": lambda: nc.library.mlp(),
    "softmax": lambda: nc.library.softmax(),
    "layernorm": lambda: nc.library.layernorm(),
    "rmsnorm": lambda: nc.library.rmsnorm(),
    **{f"normalized_attention_{k}": (lambda k=k: nc.library.normalized_attention(q, x, d, kind=k))
       for k in NORMALISATIONS},
    "normalized_attention_heads": lambda: nc.library.normalized_attention(q, x, d, heads=h),
}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_grad_matches_torch_autograd(name):
    check_grad(LIBRARY[name](), seed=3)


def test_attention_grad_prints_and_reads_its_contract():
    gd = grad(nc.library.attention(q, x, d))
    assert str(gd) == "Q[q d] f32, K[x d] f32, V[x d] f32, dO[q d] f32 -> dQ[q d] f32, dK[x d] f32, dV[x d] f32"
    # the forward is recomputed inside, the output contraction O = P V is not (nothing reads it)
    assert sum(bx.kind == "softmax" for bx in gd.boxes()) == 1
    assert sum(bx.kind == "contract" for bx in gd.boxes()) == 5


def test_grad_wrt_a_subset_and_by_index():
    att = nc.library.attention(q, x, d)
    gd = check_grad(att, wrt=["K", "V"])
    assert [a.name for a in gd.cod] == ["dK", "dV"]
    assert grad(att, wrt=[0]).cod == grad(att, wrt=["Q"]).cod


@pytest.mark.parametrize("name", ["attention_causal", "layernorm", "mlp"])
def test_backward_passes_torch_gradcheck(name):
    """The grad diagram as the backward of a torch Function: finite differences agree."""
    dg = LIBRARY[name]()
    fwd, bwd = nc.to_torch(dg), nc.to_torch(grad(dg))

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            ctx.save_for_backward(*ts)
            return fwd(*ts)

        @staticmethod
        def backward(ctx, gout):
            return _as_tuple(bwd(*ctx.saved_tensors, gout))

    ins = [torch.tensor(a, requires_grad=True) for a in _inputs(dg, 7, sizes={"q": 3, "x": 4, "t": 3})]
    assert torch.autograd.gradcheck(F.apply, ins, eps=1e-6, atol=1e-6)


def test_grad_of_grad_matches_torch_double_backward():
    # second order: exercises the derivatives of the derivative helpers (gelu_grad, ...)
    check_grad(grad(nc.library.linear()), seed=5)
    check_grad(grad(nc.library.layernorm()), seed=6)


# --------------------------------------------------------------------------- elementwise functions

r, k = Axis("r"), Axis("k")


def _function_data(fn: str, shape, rng):
    """Points away from 0 and kinks; positive where the function needs it (log, sqrt...)."""
    xs = rng.uniform(0.3, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    with np.errstate(all="ignore"):
        f = FUNCTIONS[fn]
        args = [xs] * f.arity
        finite = np.all(np.isfinite(f(ops.arrays.NUMPY, *args, c=0.75 if f.constant else None)))
    return xs if finite else np.abs(xs)


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_function_has_a_derivative(fn):
    assert FUNCTIONS[fn].derivative is not None, f"function {fn!r} has no derivative in ops.functions"


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_function_grad_matches_torch_autograd(fn):
    f = FUNCTIONS[fn]
    c = 0.75 if f.constant else None
    rng = np.random.default_rng(11)
    if f.arity == 1:
        dg = ops.op(fn, Array((r, k)), c=c)
        ins = [_function_data(fn, (3, 4), rng)]
    else:   # the second argument broadcast over r: its cotangent is summed over r
        dg = ops.op(fn, Array((r, k), name="A"), Array((k,), name="B"))
        ins = [_function_data(fn, (3, 4), rng), _function_data(fn, (4,), rng)]
    cots = [rng.standard_normal((3, 4))]
    got = _as_tuple(nc.evaluate(grad(dg), *ins, *cots))
    for gv, w in zip(got, torch_grads(dg, ins, cots)):
        np.testing.assert_allclose(gv, w, rtol=1e-10, atol=1e-10, err_msg=fn)


@pytest.mark.parametrize("fn, points", [
    ("relu", [-1.0, 0.0, 2.0]), ("abs", [-1.0, 0.0, 2.0]), ("sign", [-1.0, 0.0, 2.0]),
])
def test_subgradients_are_torchs(fn, points):
    dg = ops.op(fn, Array((k,)))
    xs, cot = np.array(points), np.array([1.5, -2.0, 0.5])
    np.testing.assert_allclose(nc.evaluate(grad(dg), xs, cot), torch_grads(dg, [xs], [cot])[0], atol=0)


def test_maximum_ties_share_the_cotangent():
    dg = ops.op("maximum", Array((k,), name="A"), Array((k,), name="B"))
    a, bb, cot = np.array([1.0, 2.0, 3.0]), np.array([1.0, 5.0, 0.0]), np.array([2.0, 4.0, 8.0])
    da, db = nc.evaluate(grad(dg), a, bb, cot)
    np.testing.assert_array_equal(da, [1.0, 0.0, 8.0])
    np.testing.assert_array_equal(db, [1.0, 4.0, 0.0])
    for gv, w in zip((da, db), torch_grads(dg, [a, bb], [cot])):
        np.testing.assert_array_equal(gv, w)


# --------------------------------------------------------------------------- rules, kind by kind

def _one(build, *arrays):
    gb = Builder(nc.f32)
    ws = [gb.input(a.name, *a.axes) for a in arrays]
    return gb.diagram(_as_tuple(build(gb, *ws))[0])


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "logsumexp"])
def test_reduce_grad_matches_torch(op):
    dg = _one(lambda gb, X: gb.reduce(op, X, k), Array((r, k), name="X"))
    check_grad(dg, seed=2)
    # ties (integer data): max / min share the cotangent among the extreme positions, as torch.amax
    ins = [np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, -1.0]])]
    cots = [np.array([1.0, 3.0, -2.0])]
    np.testing.assert_allclose(nc.evaluate(grad(dg), *ins, *cots), torch_grads(dg, ins, cots)[0],
                               rtol=1e-12, atol=1e-12)


def test_contract_with_three_operands_broadcast_and_summed_axes():
    a_, c_ = Axis("a"), Axis("c")
    dg = ops.contract("a b, b c, c -> a", Array((a_, Axis("b")), name="A"), Array((Axis("b"), c_), name="B"),
                      Array((c_,), name="C"))
    check_grad(dg, sizes={"b": 3})
    # an axis only one operand has, summed away: its cotangent is broadcast back
    check_grad(ops.contract("a b -> a", Array((a_, Axis("b")), name="A")), sizes={"b": 3})
    # the same wire twice: the cotangents of both uses add up
    check_grad(_one(lambda gb, X: gb.contract(X, X, out=(r,)), Array((r, k), name="X")))


def test_reindex_adjoints():
    # transpose back, merge a split, split a merge, zero-pad a slice
    gb = Builder(nc.f32)
    X = gb.input("X", r, k)
    n1, n2 = Axis("n1", 2), Axis("n2", 2)
    T = gb.transpose(X, k, r)
    S = gb.box(ops.split_box(gb.ty(X), k, n1, n2), X)
    M = gb.box(ops.merge_box(gb.ty(S), n1, n2, Axis("m", 4)), S)
    L = gb.box(ops.slice_box(gb.ty(X), k, 1, 3, Axis("s", 2)), X)
    parts = [gb.map("exp", T), gb.map("tanh", M), gb.map("square", L)]
    check_grad(gb.diagram(*parts), sizes={"k": 4})
    # a diagonal back on the diagonal of zeros
    gb = Builder(nc.f32)
    i, j = Axis("i", 3), Axis("j", 3)
    A = gb.input("A", i, k, j)
    check_grad(gb.diagram(gb.map("exp", gb.box(ops.diagonal_box(gb.ty(A), i, j), A))))


def test_mask_and_index_bias_grads():
    dg = _one(lambda gb, S: gb.index_bias(gb.mask(S, q, x, nc.window(1, 1)), q, x, nc.alibi(-0.5)),
              Array((q, x), name="S"))
    dg = dg >> nc.library.softmax(q, x)
    check_grad(dg)


def test_fused_softmax_contract_and_norm_contract():
    S, V = Array((q, x), name="S"), Array((x, d), name="V")
    check_grad(ops.softmax_contract_box(S, V, x, (q, d)).diagram())
    for kind, (a1, a2, bb) in NORMALISATIONS.items():
        check_grad(ops.norm_contract_box(S, V, x, (q, d), a1, a2, bb, 1e-3).diagram(), positive=kind == "l1")
        check_grad(_one(lambda gb, X: gb.normalize(X, x, a1, a2, bb, eps=0.25), S))


def test_cast_to_int_is_refused_by_name_float_casts_pass():
    dg = _one(lambda gb, X: gb.cast(gb.cast(X, nc.i8), nc.f32), Array((r,), name="X"))
    with pytest.raises(TypingError, match="box cast f32: its input X\\[r\\] i8 is an integer wire"):
        grad(dg)
    with pytest.raises(TypingError, match="box cast i8: a cast of X\\[r\\] f32 to i8 rounds to integers"):
        grad(_one(lambda gb, X: gb.cast(X, nc.i8), Array((r,), name="X")))
    check_grad(_one(lambda gb, X: gb.map("exp", gb.cast(X, nc.f16)), Array((r,), name="X")))


def test_unused_input_gets_zero_cotangent_and_params_consts_are_constants():
    gb = Builder(nc.f32)
    X, Y = gb.input("X", r), gb.input("Y", k)
    W = gb.param("W", r)
    out = gb.map("mul", gb.map("add", X, gb.const(2.0, r)), W)
    dg = gb.diagram(out)
    xs, ys, w, cot = np.arange(3.0), np.ones(4), np.array([1.0, -2.0, 3.0]), np.array([1.0, 1.0, 2.0])
    dx, dy = nc.evaluate(grad(dg), xs, ys, cot, params={"W": w})
    np.testing.assert_array_equal(dx, w * cot)
    np.testing.assert_array_equal(dy, np.zeros(4))


def test_wrt_refuses_unknown_and_integer_inputs():
    att = nc.library.attention(q, x, d)
    with pytest.raises(TypingError, match="not an input"):
        grad(att, wrt=["Z"])
    gb = Builder(nc.f32)
    I = gb.input("I", r, dtype=nc.i8)
    with pytest.raises(TypingError, match="not a float"):
        grad(gb.diagram(gb.cast(I, nc.f32)), wrt=["I"])
    assert len(grad(gb.diagram(gb.cast(I, nc.f32))).cod) == 0


# --------------------------------------------------------------------------- NaN policy

def test_fully_masked_rows_have_zero_gradient_not_nan():
    att = nc.library.attention(q, x, d, mask=nc.causal(-3))   # rows 0..2 keep no key
    ins = _inputs(att, 4)
    cots = [np.random.default_rng(9).standard_normal((5, 3))]
    dq, dk, dv = nc.evaluate(grad(att), *ins, *cots)
    for gv in (dq, dk, dv):
        assert np.all(np.isfinite(gv))
    np.testing.assert_array_equal(dq[:3], 0.0)
    check_grad(att, seed=4)


@pytest.mark.parametrize("op", ["max", "min", "logsumexp", "sum"])
def test_fully_masked_reductions_have_torchs_gradient(op):
    dg = _one(lambda gb, X: gb.reduce(op, gb.mask(X, r, k, nc.causal(-1)), k), Array((r, k), name="X"))
    xs, cot = np.random.default_rng(1).standard_normal((3, 4)), np.array([1.0, -2.0, 0.5])
    got = nc.evaluate(grad(dg), xs, cot)
    np.testing.assert_array_equal(got[0], 0.0)   # row 0 keeps nothing
    np.testing.assert_allclose(got, torch_grads(dg, [xs], [cot])[0], rtol=1e-12, atol=1e-12)


def test_maximum_of_equal_infinities_is_a_tie():
    dg = ops.op("maximum", Array((k,), name="A"), Array((k,), name="B"))
    a, bb = np.array([np.inf, -np.inf, 1.0]), np.array([np.inf, -np.inf, -np.inf])
    da, db = nc.evaluate(grad(dg), a, bb, np.ones(3))
    np.testing.assert_array_equal(da, [0.5, 0.5, 1.0])
    np.testing.assert_array_equal(db, [0.5, 0.5, 0.0])


# --------------------------------------------------------------------------- random diagrams

NAMES = ("a", "c", "k")
SMOOTH = ("neg", "square", "gelu", "silu", "sigmoid", "tanh", "identity", "scale", "shift", "relu", "abs")


@st.composite
def random_diagrams(draw):
    axes_ = {n: Axis(n, draw(st.integers(1, 3))) for n in NAMES}
    gb = Builder(nc.f32)
    n_in = draw(st.integers(1, 3))
    wires = [gb.input(f"X{i}", *(axes_[n] for n in draw(st.permutations(NAMES))[: draw(st.integers(1, 3))]))
             for i in range(n_in)]
    for _ in range(draw(st.integers(1, 5))):
        w = draw(st.sampled_from(wires))
        names = gb.ty(w).axis_names
        kind = draw(st.sampled_from(["unary", "binary", "contract"] + (["reduce", "softmax"] if names else [])))
        if kind == "unary":
            fn = draw(st.sampled_from(SMOOTH))
            wires.append(gb.map(fn, w, c=0.5 if FUNCTIONS[fn].constant else None))
        elif kind == "binary":
            wires.append(gb.map(draw(st.sampled_from(("add", "sub", "mul", "maximum"))), w, draw(st.sampled_from(wires))))
        elif kind == "contract":
            u = draw(st.sampled_from(wires))
            union = list(dict.fromkeys(gb.ty(w).axis_names + gb.ty(u).axis_names))
            out = draw(st.permutations(union))[: draw(st.integers(0, len(union)))]
            wires.append(gb.contract(w, u, out=tuple(axes_[n] for n in out)))
        elif kind == "reduce":
            wires.append(gb.reduce(draw(st.sampled_from(ops.REDUCTIONS)), w, axes_[draw(st.sampled_from(names))]))
        else:
            wires.append(gb.softmax(w, axes_[draw(st.sampled_from(names))]))
    outs = [wires[-1]] + draw(st.lists(st.sampled_from(wires), max_size=1))
    return gb.diagram(*outs)


@settings(max_examples=60 if os.environ.get("NAPKIN_TEST_TIER") == "full" else 20, deadline=None)  # conftest.py
@given(random_diagrams(), st.integers(0, 2 ** 16))
def test_random_diagram_grads_match_torch_autograd(dg, seed):
    check_grad(dg, seed=seed, tol=1e-8)


# --------------------------------------------------------------------------- relabelling the backward

def test_grad_attention_relabels_streaming_q():
    # dK, dV sum over q and the softmax statistics run along x: streaming q is the accepted
    # relabeling of the whole backward (each q chunk adds its share to dK, dV; dQ is per row)
    gd = grad(nc.library.attention(q, x, d, causal=True))
    nc.check_equivalent(gd, gd.stream(q, "s_q"))


def test_grad_multihead_attention_tiles_heads_and_streams_q():
    gd = grad(nc.library.attention(q, x, d, heads=h))
    nc.check_equivalent(gd, gd.tile(h, "g_h").stream(q, "s_q"))


def test_grad_attention_wrt_q_tiles_q():
    gd = grad(nc.library.attention(q, x, d), wrt=["Q"])
    nc.check_equivalent(gd, gd.tile(q, "g_q"))


@pytest.mark.parametrize("relabel, reason", [
    (lambda gd: gd.stream(x, "s_x").tile(q, "g_q"), "softmax\\[x\\] normalises along x and keeps it"),
    (lambda gd: gd.tile(q, "g_q"), "contract removes axis q"),
    (lambda gd: gd.tile(x, "g_x"), "softmax\\[x\\] normalises along x"),
])
def test_grad_attention_refusals_name_their_reason(relabel, reason):
    """Without saved residuals the backward recomputes P = softmax(S) along x, and dK, dV
    sum over q: the FlashAttention-2 backward (tile x, stream q) needs the logsumexp saved."""
    gd = grad(nc.library.attention(q, x, d))
    with pytest.raises(RelabelError, match=reason):
        relabel(gd)
