"""Gradients for the auxiliary tensors of attention variants (napkin_cat issue 11): the calculus of
index expressions, the ``index_map`` and ``scatter_aux`` kinds, ``nc.grad`` against torch
autograd of the torch semantics, ``torch.autograd.gradcheck`` of ``nc.torch_op``, and the aux
tensors' ``.grad`` through ``nc.torch_op``."""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import drawing  # noqa: E402
from napkin_cat.costmodel import box_work  # noqa: E402
from napkin_cat.ops.arrays import torch_namespace  # noqa: E402
from napkin_cat.ops.aux_grad import SCORE, derivative, gathers, index_map_box, scatter_aux_box  # noqa: E402
from napkin_cat.ops.index_expr import Aux, Ix  # noqa: E402

q, x, d, h = nc.axes("q x d h")
NH, NR = nc.Axis("nh", 2), nc.Axis("nr", 5)
R = 2   # relative positions clamped to [-R, R]


def _clamped(i, j):
    return nc.ix.minimum(nc.ix.maximum(i - j, -R), R) + R


def _variants():
    rb, sc, cap, doc = nc.aux("rb", NH, NR), nc.aux("sc", NH), nc.aux("cap", NH), nc.aux("doc", nc.Axis("n", 4))
    return {
        "relative_bias": dict(score_mod=lambda s, b, h_, i, j: s + rb[h_, _clamped(i, j)]),
        "head_scale": dict(score_mod=lambda s, b, h_, i, j: s * sc[h_], causal=True),
        "learned_softcap": dict(score_mod=lambda s, b, h_, i, j: cap[h_] * nc.ix.tanh(s / cap[h_])),
        "document": dict(mask=lambda b, h_, i, j: (doc[i] == doc[j]) & (j <= i)),
    }


def _inputs(dia, rng):
    out = []
    for a in dia.dom:
        shape = tuple(ax.size for ax in a.axes)
        if a.name == "doc":
            out.append(np.array([0.0, 0.0, 1.0, 1.0]))
        elif a.name == "cap":
            out.append(1.0 + rng.random(shape))
        else:
            out.append(rng.standard_normal(shape))
    return out


def _attention(name, n=4):
    return nc.library.attention(q=q, x=x, d=d, heads=h, **_variants()[name]).bind({q: n, x: n, d: 2, h: 2})


def _torch_grads(dia, ins, g):
    ts = [torch.tensor(v, requires_grad=True) for v in ins]
    (nc.to_torch(dia)(*ts) * torch.tensor(g)).sum().backward()
    return [np.zeros(t.shape) if t.grad is None else t.grad.numpy() for t in ts]   # None: no path


# --------------------------------------------------------------------------- the calculus

_S = SCORE
_A = Aux("a", (nc.Axis("n", 1),))[0]
EXPRESSIONS = {
    "mul": _S * _A, "div": _S / _A, "rdiv": _A / (_S * _S + 1.0), "sub": _A - _S * 2.0,
    "where": nc.ix.where(_S > 0, _S * _A, -_A), "exp2": nc.ix.exp2(_S * _A), "log2": nc.ix.log2(_S * _S + _A),
    "softcap": _A * nc.ix.tanh(_S / _A), "max": nc.ix.maximum(_S, _A), "min": nc.ix.minimum(_S * 2.0, _A),
    "abs": abs(_S - _A), "sigmoid": nc.ix.sigmoid(_S * _A), "exp": nc.ix.exp(_S) * _A, "mod": _S % _A,
    "relu": nc.ix.relu(_S - _A), "silu": nc.ix.silu(_S * _A), "gelu": nc.ix.gelu(_S + _A),
    "sqrt": nc.ix.sqrt(_S * _S + _A), "log": nc.ix.log(_A) * _S, "rsqrt": nc.ix.rsqrt(_A + 2.0) * _S,
}


@pytest.mark.parametrize("name", sorted(EXPRESSIONS))
def test_derivative_of_an_expression_is_torch_autograd(name):
    """Each rule of the chain rule against torch autograd of the expression's own torch meaning,
    at points that include ties (min / max / abs at equality, where torch splits or zeroes)."""
    e = EXPRESSIONS[name]
    s = torch.tensor([-1.5, -0.2, 0.0, 0.5, 0.7, 1.25, 3.0], dtype=torch.float64, requires_grad=True)
    a = torch.tensor([0.7 if name != "min" else 1.0], dtype=torch.float64, requires_grad=True)
    xp = torch_namespace()
    e.evaluate(xp, {"score": s, "a": a}).sum().backward()
    env = {"score": s.detach(), "a": a.detach()}
    ds, da = (torch.broadcast_to(torch.as_tensor(derivative(e, v).evaluate(xp, env), dtype=torch.float64), s.shape)
              for v in (SCORE, gathers(e)[0]))
    np.testing.assert_allclose(ds.numpy(), s.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(da.sum().item(), a.grad.item(), rtol=1e-12, atol=1e-12)


def test_values_that_only_compare_or_index_have_no_derivative():
    doc = Aux("doc", (nc.Axis("n", 4),))
    i, j = Ix("idx", (), "i"), Ix("idx", (), "j")
    e = nc.ix.where(doc[i] == doc[j], SCORE, -1e9)
    assert [derivative(e, g) for g in gathers(e)] == [None, None]
    assert derivative((i - j) * 0.5, SCORE) is None
    assert str(derivative(SCORE * 3.0 + doc[i], SCORE)) == "3.0"


# --------------------------------------------------------------------------- nc.grad of attention variants

@pytest.mark.parametrize("name", sorted(_variants()))
def test_grad_of_an_attention_variant_matches_torch_autograd(name):
    dia = _attention(name)
    rng = np.random.default_rng(11)
    ins = _inputs(dia, rng)
    g = rng.standard_normal(tuple(ax.size for ax in dia.cod[0].axes))
    got = nc.evaluate(nc.grad(dia), *ins, g)
    want = _torch_grads(dia, ins, g)
    for arr, a, b in zip(dia.dom, got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=arr.name)
    aux = [i for i, a in enumerate(dia.dom) if a.name not in ("Q", "K", "V")]
    for i in aux:
        if name == "document":
            assert not np.any(got[i]), "a mask is piecewise constant in its tensor: zero gradient"
        else:
            assert np.abs(got[i]).max() > 1e-3, f"{dia.dom[i].name} gets a gradient"


def test_the_relative_bias_gradient_is_the_scatter_of_the_score_cotangent():
    """drb[h, r] = sum of dS over (q, x) with clamp(q - x) + R == r, written directly."""
    dia = _attention("relative_bias", n=5)
    rng = np.random.default_rng(3)
    ins = _inputs(dia, rng)
    g = rng.standard_normal((2, 5, 2))
    drb = nc.evaluate(nc.grad(dia, wrt=["rb"]), *ins, g)
    Q, K, V, rb = ins
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    r = np.clip(i - j, -R, R) + R
    S = np.einsum("hqd,hxd->hqx", Q, K) / np.sqrt(2) + rb[:, r]
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    dP = np.einsum("hqd,hxd->hqx", g, V)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))
    want = np.zeros_like(rb)
    for k in range(5):
        np.add.at(want, (slice(None), r[k]), dS[:, k])
    np.testing.assert_allclose(drb, want, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- nc.torch_op

@pytest.mark.parametrize("name", ["relative_bias", "head_scale", "learned_softcap"])
def test_torch_op_passes_gradcheck_with_aux_tensors(name):
    dia = _attention(name, n=3)
    op = nc.torch_op(dia.stream("x", 2).tile("q", 2))
    ins = [torch.tensor(v, requires_grad=True) for v in _inputs(dia, np.random.default_rng(5))]
    assert torch.autograd.gradcheck(op, tuple(ins), eps=1e-6, atol=1e-7)
    assert op.last_backward_path == "executor-fa2"


def test_torch_op_gives_aux_tensors_their_grad_on_cpu():
    dia = _attention("relative_bias")
    op = nc.torch_op(dia.stream("x", 2).tile("q", 2))
    rng = np.random.default_rng(7)
    ins = _inputs(dia, rng)
    ts = [torch.tensor(v, requires_grad=True) for v in ins]
    ts[3].requires_grad_(True)
    op(*ts).sum().backward()
    want = _torch_grads(dia, ins, np.ones((2, 4, 2)))
    np.testing.assert_allclose(ts[3].grad.numpy(), want[3], rtol=1e-10, atol=1e-12)
    assert op.last_saves == ("Q", "K", "V", "rb", "O", "L")
    plan = op.backward_plan((0, 1, 2, 3))
    assert [[a.name for a in p.cod] for p in plan.parts] == [["D"], ["dK", "dV"], ["dQ"], ["drb"]]
    assert all(p.schedule for p in plan.parts[:3]) and not plan.parts[3].schedule


@pytest.mark.slow   # the simulator runs the two lowered FlashAttention-2 parts (about 10 s)
def test_torch_op_on_the_simulator_runs_the_aux_part_through_torch_semantics():
    dia = _attention("head_scale", n=8)
    op = nc.torch_op(dia.stream("x", 4).tile("q", 4), simulate=True, backward="two kernels")
    ins = _inputs(dia, np.random.default_rng(8))
    ts = [torch.tensor(v, dtype=torch.float32, requires_grad=True) for v in ins]
    op(*ts).sum().backward()
    want = _torch_grads(dia, ins, np.ones((2, 8, 2)))
    for t, w in zip(ts, want):
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-4, atol=1e-5)
    assert op.last_backward_path == "simulator-fa2"
    assert any("dsc" in n and "torch semantics" in n for n in op.notes)


# --------------------------------------------------------------------------- the scatter box

def _scatter(index, n=3, woven=False):
    a = nc.Axis("n", n)
    at = Aux("t", (a,))[Ix("idx", (), "q") - Ix("idx", (), "x") + index]
    w = nc.Array(((h,) if woven else ()) + (q, x), nc.f32, "w")
    target = nc.Array(((h,) if woven else ()) + (a,), nc.f32, "t")
    return scatter_aux_box(w, target, at, q, x).diagram()


@pytest.mark.parametrize("woven", [False, True])
def test_scatter_adds_at_the_clamped_gather_indices_in_numpy_and_torch(woven):
    dia = _scatter(1, woven=woven).bind({q: 4, x: 5, **({h: 2} if woven else {})})
    w = np.random.default_rng(1).standard_normal((2, 4, 5) if woven else (4, 5))
    want = np.zeros((2, 3) if woven else (3,))
    for i in range(4):
        for j in range(5):
            k = min(max(i - j + 1, 0), 2)   # clamped as the gather clamps it
            if woven:
                want[:, k] += w[:, i, j]
            else:
                want[k] += w[i, j]
    np.testing.assert_allclose(nc.evaluate(dia, w), want, rtol=1e-12)
    wt = torch.tensor(w, requires_grad=True)
    out = nc.to_torch(dia)(wt)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12)
    out.sum().backward()
    assert torch.all(wt.grad == 1)


def test_the_vjp_of_a_scatter_is_the_gather():
    dia = _scatter(1).bind({q: 4, x: 5})
    w = np.random.default_rng(2).standard_normal((4, 5))
    ct = np.array([1.0, -2.0, 0.5])
    got = nc.evaluate(nc.grad(dia), w, ct)
    i, j = np.arange(4)[:, None], np.arange(5)[None, :]
    np.testing.assert_allclose(got, ct[np.clip(i - j + 1, 0, 2)])
    with pytest.raises(nc.TypingError, match="woven"):
        nc.grad(_scatter(1, woven=True))


def test_a_scatter_refuses_to_lower_by_name():
    g = nc.grad(_attention("relative_bias"), wrt=["rb"])
    with pytest.raises(nc.LoweringError, match="scatter-add into aux rb"):
        nc.lower(g, threads=16)


def test_a_scatter_is_costed_and_drawn():
    dia = _scatter(1).bind({q: 4, x: 5})
    (box,) = [e.box for e in dia.eqns]
    (work,) = box_work(box, lambda names: int(np.prod([{"q": 4, "x": 5, "n": 3}[n] for n in names])))
    assert work.unit == "fma" and work.count == 3 * 20   # q - x, + 1, then the add
    svg = drawing.to_svg(nc.grad(_attention("learned_softcap"), wrt=["cap"]))
    assert "scatter" in svg and "map" in svg


def test_bad_boxes_are_refused_naming_the_problem():
    w = nc.Array((q, x), nc.f32, "w")
    at = Aux("t", (nc.Axis("n", 3),))[Ix("idx", (), "h")]
    with pytest.raises(nc.TypingError, match="reads axis h"):
        scatter_aux_box(w, nc.Array((nc.Axis("n", 3),), nc.f32), at, q, x)
    with pytest.raises(nc.TypingError, match="value expression"):
        index_map_box(w, q, x, SCORE > 0)
    with pytest.raises(nc.TypingError, match="gathers from 1"):
        index_map_box(w, q, x, SCORE * at)


def test_index_map_boxes_compare_by_structure():
    a, b = (_attention("head_scale") for _ in range(2))
    assert [e.box for e in a.eqns] == [e.box for e in b.eqns]


@pytest.mark.slow   # two kernels under the simulator (about 10 s)
@pytest.mark.parametrize("name", ["head_scale", "learned_softcap"])
def test_an_index_map_lowers_and_matches_numpy(name):
    dia = _attention(name, n=8)
    kernel = nc.lower(dia.stream("x", 4).tile("q", 4), threads=16)
    ins = [v.astype(np.float32) for v in _inputs(dia, np.random.default_rng(4))]
    assert kernel.verified
    np.testing.assert_allclose(kernel(*ins), nc.evaluate(dia, *ins), atol=1e-5)
