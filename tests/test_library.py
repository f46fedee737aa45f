"""Every library diagram against an independent NumPy computation, and the torch semantics.

The references below are written directly with NumPy (einsum strings, explicit masks,
``math.erf``): nothing in them goes through napkin_cat, so a wrong rule cannot agree with
itself.  The torch semantics (:mod:`napkin_cat.ops.torch_semantics`) is then checked against the
NumPy semantics rule by rule and diagram by diagram, and for differentiability.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import napkin_cat as nc
from napkin_cat import Array, Axis, Ty, f32, ops
from napkin_cat.ops.torch_semantics import TORCH_RULES
from napkin_cat.ops.semantics import NUMPY_RULES

SIZES = dict(q=4, x=6, d=3, e=2, h=2, g=2, b=2, t=3, i=4, o=5, f=6, r=3, c=5, a=2, n=2)
TOL = 1e-12


@pytest.fixture
def rng():
    return np.random.default_rng(20241203)


def ax(name: str) -> Axis:
    return Axis(name, SIZES[name])


def inputs_for(d: nc.Diagram, rng) -> list[np.ndarray]:
    return [rng.standard_normal([int(a.size) for a in arr.axes]) for arr in d.dom]


def close(actual, expected, tol=TOL):
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- independent references

def ref_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def ref_softmax(s, axis=-1):
    """Softmax with fully masked (all -inf) rows set to zero."""
    m = np.max(s, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m)
    z = e.sum(axis=axis, keepdims=True)
    return np.divide(e, z, out=np.zeros_like(e), where=z > 0)


def ref_attention(Q, K, V, scale=None, keep=None, bias=None):
    """Q[... q d], K[... x d], V[... x e]; ``keep[q x]`` and ``bias[q x]`` broadcast."""
    scale = 1 / math.sqrt(Q.shape[-1]) if scale is None else scale
    S = np.einsum("...qd,...xd->...qx", Q, K) * scale
    if bias is not None:
        S = S + bias
    if keep is not None:
        S = np.where(keep, S, -np.inf)
    return np.einsum("...qx,...xe->...qe", ref_softmax(S), V)


def qx_grid():
    return np.arange(SIZES["q"])[:, None], np.arange(SIZES["x"])[None, :]


# --------------------------------------------------------------------------- library vs references

def test_matmul_matches_numpy(rng):
    d = nc.library.matmul(ax("a"), ax("i"), ax("c"))
    A, B = inputs_for(d, rng)
    close(nc.evaluate(d, A, B), A @ B)


def test_batched_matmul_matches_numpy(rng):
    d = nc.library.batched_matmul(ax("n"), ax("a"), ax("i"), ax("c"))
    assert [a.axis_names for a in d.dom] == [("n", "a", "i"), ("n", "i", "c")]
    A, B = inputs_for(d, rng)
    close(nc.evaluate(d, A, B), np.matmul(A, B))


@pytest.mark.parametrize("bias, activation", [(True, "gelu"), (False, None), (True, "relu")])
def test_linear_matches_numpy(rng, bias, activation):
    d = nc.library.linear(ax("t"), ax("i"), ax("o"), bias=bias, activation=activation)
    xs = inputs_for(d, rng)
    X, W = xs[:2]
    Y = X @ W + (xs[2] if bias else 0)
    Y = {"gelu": ref_gelu, "relu": lambda y: np.maximum(y, 0), None: lambda y: y}[activation](Y)
    close(nc.evaluate(d, *xs), Y)


def test_mlp_matches_numpy(rng):
    d = nc.library.mlp(ax("t"), ax("d"), ax("f"))
    X, W1, b1, W2, b2 = inputs_for(d, rng)
    close(nc.evaluate(d, X, W1, b1, W2, b2), ref_gelu(X @ W1 + b1) @ W2 + b2)


def test_softmax_matches_numpy(rng):
    d = nc.library.softmax(ax("r"), ax("c"))
    (X,) = inputs_for(d, rng)
    e = np.exp(X - X.max(axis=1, keepdims=True))
    close(nc.evaluate(d, X), e / e.sum(axis=1, keepdims=True))


def test_layernorm_matches_numpy(rng):
    eps = 1e-3
    d = nc.library.layernorm(ax("t"), ax("d"), eps=eps)
    X, gamma, beta = inputs_for(d, rng)
    mu, var = X.mean(axis=1, keepdims=True), X.var(axis=1, keepdims=True)
    close(nc.evaluate(d, X, gamma, beta), (X - mu) / np.sqrt(var + eps) * gamma + beta)


def test_rmsnorm_matches_numpy(rng):
    eps = 1e-4
    d = nc.library.rmsnorm(ax("t"), ax("d"), eps=eps)
    X, gamma = inputs_for(d, rng)
    close(nc.evaluate(d, X, gamma), X / np.sqrt((X ** 2).mean(axis=1, keepdims=True) + eps) * gamma)


def test_attention_matches_numpy(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"))
    Q, K, V = inputs_for(d, rng)
    close(nc.evaluate(d, Q, K, V), ref_attention(Q, K, V))


def test_attention_value_dim_differs_from_key_dim(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), dv=ax("e"))
    assert str(d) == "Q[q=4 d=3] f32, K[x=6 d=3] f32, V[x=6 e=2] f32 -> O[q=4 e=2] f32"
    Q, K, V = inputs_for(d, rng)
    close(nc.evaluate(d, Q, K, V), ref_attention(Q, K, V))


def test_attention_causal_matches_numpy(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), causal=True)
    Q, K, V = inputs_for(d, rng)
    i, j = qx_grid()
    close(nc.evaluate(d, Q, K, V), ref_attention(Q, K, V, keep=j <= i))


def test_attention_sliding_window_matches_numpy(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), window_size=3)
    Q, K, V = inputs_for(d, rng)
    i, j = qx_grid()
    # window(3): each query sees itself and the 3 keys before it
    close(nc.evaluate(d, Q, K, V), ref_attention(Q, K, V, keep=(j <= i) & (j >= i - 3)))


def test_attention_gqa_shares_keys_within_a_group(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), groups=ax("g"), heads=ax("h"))
    # Q is weaved over g (inside), then everything over h: the head axis comes first
    assert str(d) == "Q[h=2 g=2 q=4 d=3] f32, K[h=2 x=6 d=3] f32, V[h=2 x=6 d=3] f32 -> O[h=2 g=2 q=4 d=3] f32"
    Q, K, V = inputs_for(d, rng)
    expected = np.stack([np.stack([ref_attention(Q[h, g], K[h], V[h]) for g in range(SIZES["g"])])
                         for h in range(SIZES["h"])])
    close(nc.evaluate(d, Q, K, V), expected)


def test_attention_batch_heads_and_input_bias_match_numpy(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), heads=ax("h"), batch=ax("b"), bias="input")
    # the bias input B[q x] is shared by every head and batch element
    assert str(d) == ("Q[b=2 h=2 q=4 d=3] f32, K[b=2 h=2 x=6 d=3] f32, V[b=2 h=2 x=6 d=3] f32, "
                      "B[q=4 x=6] f32 -> O[b=2 h=2 q=4 d=3] f32")
    Q, K, V, B = inputs_for(d, rng)
    close(nc.evaluate(d, Q, K, V, B), ref_attention(Q, K, V, bias=B))


def test_attention_alibi_bias_matches_numpy(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), bias=nc.alibi(0.5), causal=True)
    Q, K, V = inputs_for(d, rng)
    i, j = qx_grid()
    close(nc.evaluate(d, Q, K, V), ref_attention(Q, K, V, bias=0.5 * (j - i), keep=j <= i))


def test_attention_custom_scale_matches_numpy(rng):
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), scale=0.37)
    Q, K, V = inputs_for(d, rng)
    close(nc.evaluate(d, Q, K, V), ref_attention(Q, K, V, scale=0.37))


@pytest.mark.parametrize("heads", [None, "h"])
def test_normalized_attention_l2_matches_numpy(rng, heads):
    eps = 1e-6
    d = nc.library.normalized_attention(ax("q"), ax("x"), ax("d"), kind="l2", eps=eps,
                                        heads=ax(heads) if heads else None)
    Q, K, V = inputs_for(d, rng)
    S = np.einsum("...qd,...xd->...qx", Q, K) / math.sqrt(SIZES["d"])
    P = S / (np.sqrt((S ** 2).sum(axis=-1, keepdims=True)) + eps)
    close(nc.evaluate(d, Q, K, V), np.einsum("...qx,...xd->...qd", P, V))


def test_fully_masked_rows_give_zeros(rng):
    never = nc.predicate(lambda i, j: j > 1000, "never")
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), mask=never)
    Q, K, V = inputs_for(d, rng)
    out = nc.evaluate(d, Q, K, V)
    assert np.array_equal(out, np.zeros_like(out))
    torch_out = nc.to_torch(d)(*map(torch.from_numpy, (Q, K, V)))
    assert torch.equal(torch_out, torch.zeros_like(torch_out))


def test_partly_masked_rows_zero_only_the_empty_rows(rng):
    # with as many keys as queries, "j > i" leaves the last query with no key at all
    d = nc.library.attention(ax("q"), Axis("x", SIZES["q"]), ax("d"), mask=nc.predicate(lambda i, j: j > i))
    Q, K, V = inputs_for(d, rng)
    out = nc.evaluate(d, Q, K, V)
    i, j = np.arange(SIZES["q"])[:, None], np.arange(SIZES["q"])[None, :]
    close(out, ref_attention(Q, K, V, keep=j > i))
    assert np.array_equal(out[-1], np.zeros_like(out[-1])) and np.all(np.abs(out[:-1]).sum(axis=1) > 0)


# --------------------------------------------------------------------------- torch: diagram by diagram

def library(name: str, mk=ax) -> nc.Diagram:
    """Library diagram ``name`` with axes from ``mk`` (integer sizes by default)."""
    q, x, d = mk("q"), mk("x"), mk("d")
    L = nc.library
    build = {
        "matmul": lambda: L.matmul(mk("a"), mk("i"), mk("c")),
        "batched_matmul": lambda: L.batched_matmul(mk("n"), mk("a"), mk("i"), mk("c")),
        "linear": lambda: L.linear(mk("t"), mk("i"), mk("o")),
        "mlp": lambda: L.mlp(mk("t"), d, mk("f")),
        "softmax": lambda: L.softmax(mk("r"), mk("c")),
        "layernorm": lambda: L.layernorm(mk("t"), d),
        "rmsnorm": lambda: L.rmsnorm(mk("t"), d),
        "attention": lambda: L.attention(q, x, d),
        "causal_window": lambda: L.attention(q, x, d, causal=True, window_size=3),
        "gqa_batch_bias": lambda: L.attention(q, x, d, groups=mk("g"), heads=mk("h"), batch=mk("b"),
                                              bias="input"),
        "alibi_scale": lambda: L.attention(q, x, d, bias=nc.alibi(0.3), scale=0.7, dv=mk("e")),
        "multihead": lambda: L.multihead_attention(q, x, d, mk("h")),
        **{f"normalized_{k}": (lambda k=k: L.normalized_attention(q, x, d, kind=k, heads=mk("h")))
           for k in ops.NORMALISATIONS},
    }
    return build[name]()


LIBRARY = ("matmul", "batched_matmul", "linear", "mlp", "softmax", "layernorm", "rmsnorm", "attention",
           "causal_window", "gqa_batch_bias", "alibi_scale", "multihead",
           *(f"normalized_{k}" for k in ops.NORMALISATIONS))


def test_torch_rules_cover_every_kind():
    assert set(TORCH_RULES) == set(NUMPY_RULES) == set(ops.KINDS)


@pytest.mark.parametrize("name", LIBRARY)
def test_to_torch_matches_evaluate_on_library(rng, name):
    d = library(name)
    xs = inputs_for(d, rng)
    out = nc.to_torch(d)(*map(torch.from_numpy, xs))
    assert out.dtype == torch.float64
    close(out.numpy(), nc.evaluate(d, *xs), 1e-10)


@pytest.mark.parametrize("name", LIBRARY)
def test_to_torch_reads_symbolic_sizes_from_tensors(rng, name):
    xs = inputs_for(library(name), rng)
    symbolic = library(name, mk=Axis)  # Axis("q") has the symbolic size "q"
    out = nc.to_torch(symbolic)(*map(torch.from_numpy, xs))
    close(out.numpy(), nc.evaluate(symbolic, *xs), 1e-10)


def test_to_torch_computes_in_the_inputs_precision(rng):
    d = library("attention")
    xs = inputs_for(d, rng)
    out = nc.to_torch(d)(*(torch.from_numpy(x).float() for x in xs))
    assert out.dtype == torch.float32
    close(out.numpy(), nc.evaluate(d, *xs), 1e-5)


def test_to_torch_attention_passes_gradcheck():
    q, x, d = Axis("q", 3), Axis("x", 4), Axis("d", 2)
    f = nc.to_torch(nc.library.attention(q, x, d, causal=True, bias=nc.alibi(0.5)))
    gen = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
                 for shape in ((3, 2), (4, 2), (4, 2)))
    assert torch.autograd.gradcheck(f, args)


def test_to_torch_normalized_attention_passes_gradcheck():
    q, x, d = Axis("q", 3), Axis("x", 4), Axis("d", 2)
    f = nc.to_torch(nc.library.normalized_attention(q, x, d, kind="l2"))
    gen = torch.Generator().manual_seed(1)
    args = tuple(torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
                 for shape in ((3, 2), (4, 2), (4, 2)))
    assert torch.autograd.gradcheck(f, args)


def test_to_torch_fully_masked_rows_have_finite_gradients(rng):
    # the safe softmax must not produce NaN in the backward pass either (0 * inf)
    d = nc.library.attention(ax("q"), ax("x"), ax("d"), mask=nc.predicate(lambda i, j: j > 1000))
    Q, K, V = (torch.from_numpy(x).requires_grad_() for x in inputs_for(d, rng))
    nc.to_torch(d)(Q, K, V).sum().backward()
    for t in (Q, K, V):
        assert torch.isfinite(t.grad).all() and not t.grad.any()


# --------------------------------------------------------------------------- torch: rule by rule

A = Array((Axis("r", 3), Axis("c", 4)), f32, "A")
B = Array((Axis("c", 4), Axis("r", 3)), f32, "B")
POSITIVE = {"log", "sqrt", "rsqrt", "recip", "div"}  # functions that need x > 0 (or y != 0)


def agree(d: nc.Diagram, xs: list[np.ndarray], tol=1e-12, **kw):
    """to_torch(d) and evaluate(d) agree on float64 inputs (NaN where NumPy has NaN)."""
    want = nc.evaluate(d, *xs, **kw)
    got = nc.to_torch(d)(*map(torch.from_numpy, xs), **kw)
    want, got = (w if isinstance(w, tuple) else (w,) for w in (want, got))
    for g, w in zip(got, want):
        g = g.detach().numpy()
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("fn", sorted(ops.FUNCTIONS))
def test_torch_map_matches_numpy(rng, fn):
    c = 0.75 if fn in ("scale", "shift") else None
    dom = [A, B][: ops.FUNCTIONS[fn].arity]
    xs = [rng.standard_normal((3, 4)), rng.standard_normal((4, 3))][: len(dom)]
    if fn in POSITIVE:
        xs = [np.abs(x) + 0.1 for x in xs]
    agree(ops.map_box(fn, dom, c=c).diagram(), xs)


def test_torch_map_reads_size_dependent_constants(rng):
    d = ops.map_box("scale", [A], c=ops.AxisPower(Axis("c", 4), -0.5, 3.0)).diagram()
    agree(d, [rng.standard_normal((3, 4))])


@pytest.mark.parametrize("op", ops.REDUCTIONS)
@pytest.mark.parametrize("axis", ["r", "c"])
def test_torch_reduce_matches_numpy(rng, op, axis):
    x = rng.standard_normal((3, 4))
    x[0] = -np.inf  # a fully masked row: logsumexp gives -inf, max gives -inf
    agree(ops.reduce_box(op, A, Axis(axis, {"r": 3, "c": 4}[axis])).diagram(), [x])


@pytest.mark.parametrize("kind", sorted(ops.NORMALISATIONS))
def test_torch_normalize_and_norm_contract_match_numpy(rng, kind):
    a1, a2, b = ops.NORMALISATIONS[kind]
    c = Axis("c", 4)
    agree(ops.normalize_box(A, c, a1, a2, b, eps=1e-3).diagram(), [rng.standard_normal((3, 4))])
    V = Array((c, Axis("e", 2)), f32, "V")
    box = ops.norm_contract_box(A, V, c, (Axis("e", 2), Axis("r", 3)), a1, a2, b, 1e-3)
    agree(box.diagram(), [rng.standard_normal((3, 4)), rng.standard_normal((4, 2))])


def test_torch_softmax_and_softmax_contract_match_numpy(rng):
    c = Axis("c", 4)
    x = rng.standard_normal((3, 4))
    x[1] = -np.inf
    agree(ops.softmax_box(A, c).diagram(), [x])
    V = Array((c, Axis("e", 2)), f32, "V")
    box = ops.softmax_contract_box(A, V, c, (Axis("r", 3), Axis("e", 2)))
    agree(box.diagram(), [x, rng.standard_normal((4, 2))])


@pytest.mark.parametrize("pred", [nc.causal(), nc.causal(1), nc.window(1, 1),
                                  nc.predicate(lambda i, j: (i + j) % 2 == 0, "even"),
                                  nc.predicate(lambda i, j: np.abs(i - j) < 2, "numpy-band")],
                         ids=["causal", "causal+1", "window", "custom", "custom-numpy"])
# np.abs on a torch index tensor works but NumPy 2 warns about torch's __array_wrap__
@pytest.mark.filterwarnings("ignore:__array_wrap__:DeprecationWarning")
def test_torch_mask_matches_numpy(rng, pred):
    d = ops.mask_box(A, Axis("r", 3), Axis("c", 4), pred).diagram()
    agree(d, [rng.standard_normal((3, 4))])
    # the same mask on the transposed layout: indices follow the axis names, not positions
    agree(ops.mask_box(B, Axis("r", 3), Axis("c", 4), pred).diagram(), [rng.standard_normal((4, 3))])


@pytest.mark.parametrize("bias", [nc.alibi(0.3), ops.IndexBias("custom", (), lambda i, j: 0.1 * i * j)],
                         ids=["alibi", "custom"])
def test_torch_index_bias_matches_numpy(rng, bias):
    agree(ops.index_bias_box(B, Axis("r", 3), Axis("c", 4), bias).diagram(), [rng.standard_normal((4, 3))])


def test_torch_reindex_matches_numpy(rng):
    r, c, k, m = Axis("r", 3), Axis("c", 4), Axis("k", 2), Axis("m", 2)
    x = rng.standard_normal((3, 4))
    agree(ops.transpose_box(A, ("c", "r")).diagram(), [x])
    agree(ops.split_box(A, c, k, m).diagram(), [x])
    split = ops.split_box(A, c, k, m).diagram()
    agree(split >> ops.merge_box(split.cod[0], k, m, c).diagram(), [x])
    agree(ops.slice_box(A, c, 1, 3, Axis("s", 2)).diagram(), [x])
    sq = Array((Axis("u", 3), r, Axis("v", 3)), f32, "Sq")
    agree(ops.diagonal_box(sq, Axis("u", 3), Axis("v", 3)).diagram(), [rng.standard_normal((3, 3, 3))])


def test_torch_split_reads_symbolic_inner_size(rng):
    c, k, m = Axis("c"), Axis("k"), Axis("m")
    arr = Array((Axis("r"), c), f32, "A")
    agree(ops.split_box(arr, c, k, m).diagram(), [rng.standard_normal((3, 4))], sizes={"m": 2})


def test_torch_param_const_and_cast_match_numpy(rng):
    g = nc.Builder(f32)
    X = g.input("X", Axis("r", 3), Axis("c", 4))
    W = g.param("W", Axis("c", 4))
    Y = g.map("add", g.map("mul", X, W, out=(Axis("r", 3), Axis("c", 4))), g.const(-1.5, Axis("r", 3)))
    d = g.diagram(g.cast(g.cast(Y, nc.f16), nc.i8), g.cast(Y, nc.f64))
    x, w = rng.standard_normal((3, 4)) * 4, rng.standard_normal(4)
    agree(d, [x], params={"W": w})
    # gradients reach a parameter passed as a tensor
    wt = torch.from_numpy(w).requires_grad_()
    _, y = nc.to_torch(d)(torch.from_numpy(x), params={"W": wt})
    y.sum().backward()
    close(wt.grad.numpy(), x.sum(axis=0))


def test_torch_outputs_do_not_alias_inputs(rng):
    d = nc.Diagram.id(Ty(A))
    x = torch.from_numpy(rng.standard_normal((3, 4)))
    y = nc.to_torch(d)(x)
    y.add_(1.0)  # writing into the output must leave the caller's tensor alone
    assert not torch.equal(x, y)


def test_evaluate_accepts_torch_tensors_including_bf16():
    a, b, c = nc.axes("a b c")
    mm = nc.library.matmul(a=a, b=b, c=c)
    A = torch.randn(3, 4, dtype=torch.float64).to(torch.bfloat16)
    B = torch.randn(4, 5, dtype=torch.float64)
    expected = A.double().numpy() @ B.numpy()  # bf16 values widen exactly
    assert np.abs(nc.evaluate(mm, A, B) - expected).max() < 1e-12
