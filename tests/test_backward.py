"""The FlashAttention-2 backward: residuals ``(O, L)`` from the forward, the backward built from
them (:func:`napkin_cat.ops.residuals.grad_with_residuals`), its relabelings and its kernels.

The references: NumPy for ``L = logsumexp`` of the scores; ``nc.grad`` (itself checked against
torch autograd in ``tests/test_grad.py``) and torch autograd for the backward, in float64, with
``O`` and ``L`` computed by the forward; ``check_equivalent`` for the relabelings; the NumPy
oracle for the generated kernels under the simulator, on residuals that the forward computed.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # kernels run in the simulator without a GPU

import numpy as np
import pytest
import sympy as sp
import torch

import napkin_cat as nc
from napkin_cat import Axis
from napkin_cat.core.errors import RelabelError, TypingError
from napkin_cat.ops.grad import grad
from napkin_cat.ops.residuals import grad_with_residuals, saved_softmaxes

q, x, d, e, h, b, g = (Axis(n) for n in "qxdehbg")
SIZES = {"q": 5, "x": 6, "d": 3, "e": 4, "h": 2, "b": 2, "g": 2}

VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": 2},
    "alibi": {"bias": nc.alibi(0.5), "causal": True},
    "bias_input": {"bias": "input"},
    "gqa": {"groups": g, "heads": h},
    "heads": {"heads": h},
    "batch_heads_causal": {"heads": h, "batch": b, "causal": True},
    "dv": {"dv": e},
    "scale_mask": {"scale": 0.7, "mask": nc.causal(2)},
    "fully_masked_rows": {"mask": nc.causal(-3)},   # rows 0..2 keep no key
}


def _data(dg, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(SIZES[a.name] for a in arr.axes)) for arr in dg.dom]


def _problem(kw, seed: int = 0):
    """Forward with residuals, plain forward, inputs, ``O``, ``L`` and a cotangent ``dO``."""
    fwd = nc.library.attention(q, x, d, logsumexp=True, **kw)
    plain = nc.library.attention(q, x, d, **kw)
    ins = _data(plain, seed)
    O, L = nc.evaluate(fwd, *ins)
    dO = np.random.default_rng(seed + 1).standard_normal(O.shape)
    return fwd, plain, ins, O, L, dO


# --------------------------------------------------------------------------- the forward's residuals

def _numpy_scores(kw, Q, K, B=None):
    """Scaled, biased, masked scores of one head, ``[q, x]``, in NumPy."""
    S = Q @ K.T * (kw.get("scale") or 1 / np.sqrt(Q.shape[-1]))
    if B is not None:
        S = S + B
    i, j = np.arange(S.shape[0])[:, None], np.arange(S.shape[1])[None, :]
    keep = np.ones(S.shape, bool)
    if kw.get("causal"):
        keep &= j <= i
    if kw.get("window_size") is not None:
        keep &= (i - kw["window_size"] <= j) & (j <= i)
    if "mask" in kw:
        keep &= j <= i + kw["mask"].args[0]
    return np.where(keep, S, -np.inf)


def _numpy_attention(S, V):
    m = np.max(S, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.exp(S - np.where(np.isfinite(m), m, 0.0))
        z = p.sum(-1, keepdims=True)
        lse = np.log(z[:, 0]) + np.where(np.isfinite(m[:, 0]), m[:, 0], 0.0)
    return np.where(z > 0, p / np.where(z > 0, z, 1.0), 0.0) @ V, np.where(z[:, 0] > 0, lse, -np.inf)


@pytest.mark.parametrize("name", ["plain", "causal", "window", "bias_input", "dv", "scale_mask",
                                  "fully_masked_rows"])
def test_forward_logsumexp_matches_numpy(name):
    kw = VARIANTS[name]
    fwd, plain, ins, O, L, _ = _problem(kw)
    assert [a.name for a in fwd.cod] == ["O", "L"] and fwd.cod[1].axis_names == ("q",)
    S = _numpy_scores(kw, ins[0], ins[1], ins[3] if kw.get("bias") == "input" else None)
    O_np, L_np = _numpy_attention(S, ins[2])
    np.testing.assert_allclose(L, L_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(O, O_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(O, nc.evaluate(plain, *ins))   # the option changes nothing else
    if name == "fully_masked_rows":   # docs/NAN_POLICY.md: L = -inf, O = 0
        np.testing.assert_array_equal(L[:3], -np.inf)
        np.testing.assert_array_equal(O[:3], 0.0)


@pytest.mark.parametrize("name", ["gqa", "batch_heads_causal"])
def test_forward_logsumexp_weaves_over_heads_groups_batch(name):
    kw = VARIANTS[name]
    fwd, plain, ins, O, L, _ = _problem(kw)
    Q, K, V = ins
    rows = L.shape[:-1]
    for idx in np.ndindex(*rows):   # every (batch, head, group): one head's NumPy attention
        kv = idx[:-1] if name == "gqa" else idx   # K, V are shared by the groups
        O_np, L_np = _numpy_attention(_numpy_scores(kw, Q[idx], K[kv]), V[kv])
        np.testing.assert_allclose(L[idx], L_np, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(O[idx], O_np, rtol=1e-12, atol=1e-12)


def test_forward_logsumexp_is_the_default_off_and_typed():
    assert str(nc.library.attention(q, x, d)) == "Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32"
    assert str(nc.library.attention(q, x, d, logsumexp=True)) == \
        "Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32, L[q] f32"
    with pytest.raises(TypingError, match="logsumexp must be True or False"):
        nc.library.attention(q, x, d, logsumexp=1)


def test_forward_with_logsumexp_is_flash_attention():
    # the logsumexp streams beside the online softmax: one pass over x, tiles of q
    fwd = nc.library.attention(q, x, d, logsumexp=True, causal=True)
    nc.check_equivalent(fwd, fwd.stream(x, "s_x").tile(q, "g_q"), examples=8, seed=0)


# --------------------------------------------------------------------------- the backward from residuals

def test_backward_contract_prints():
    fwd = nc.library.attention(q, x, d, logsumexp=True)
    assert str(grad_with_residuals(fwd)) == ("Q[q d] f32, K[x d] f32, V[x d] f32, O[q d] f32, L[q] f32, "
                                             "dO[q d] f32 -> dQ[q d] f32, dK[x d] f32, dV[x d] f32")
    (sv,) = saved_softmaxes(fwd)
    assert sv.axis == "x"
    bw = grad_with_residuals(fwd)
    # no normaliser left: P = exp(S - L), and D = sum dO O comes out of the diagram
    assert not any(bx.kind == "softmax" for bx in bw.boxes())
    assert "D" in bw.var_names()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_residual_backward_equals_grad(name):
    fwd, plain, ins, O, L, dO = _problem(VARIANTS[name])
    want = nc.evaluate(grad(plain), *ins, dO)
    got = nc.evaluate(grad_with_residuals(fwd), *ins, O, L, dO)
    for gv, w, arr in zip(got, want, plain.dom):
        assert np.all(np.isfinite(gv)), arr.name
        np.testing.assert_allclose(gv, w, rtol=1e-10, atol=1e-12, err_msg=f"d{arr.name} ({name})")


@pytest.mark.parametrize("name", ["causal", "gqa", "dv", "fully_masked_rows"])
def test_residual_backward_matches_torch_autograd(name):
    fwd, plain, ins, O, L, dO = _problem(VARIANTS[name], seed=3)
    ts = [torch.tensor(a, requires_grad=True) for a in ins]
    out = nc.to_torch(plain)(*ts)
    want = torch.autograd.grad(out, ts, torch.tensor(dO))
    got = nc.evaluate(grad_with_residuals(fwd), *ins, O, L, dO)
    for gv, w in zip(got, want):
        np.testing.assert_allclose(gv, np.nan_to_num(w.numpy()) if name == "fully_masked_rows" else w.numpy(),
                                   rtol=1e-10, atol=1e-12)


def test_residual_backward_with_a_cotangent_on_L_is_grad_of_the_two_output_forward():
    fwd, _, ins, O, L, dO = _problem(VARIANTS["alibi"])
    dL = np.random.default_rng(5).standard_normal(L.shape)
    want = nc.evaluate(grad(fwd), *ins, dO, dL)
    got = nc.evaluate(grad_with_residuals(fwd, cotangents=["O", "L"]), *ins, O, L, dO, dL)
    for gv, w in zip(got, want):
        np.testing.assert_allclose(gv, w, rtol=1e-10, atol=1e-12)


def test_without_a_saved_logsumexp_the_ordinary_rules_apply():
    plain = nc.library.attention(q, x, d)
    assert saved_softmaxes(plain) == ()
    ins = _data(plain, 2)
    O = nc.evaluate(plain, *ins)
    dO = np.ones(O.shape)
    for gv, w in zip(nc.evaluate(grad_with_residuals(plain), *ins, O, dO), nc.evaluate(grad(plain), *ins, dO)):
        np.testing.assert_allclose(gv, w, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypingError, match="cotangents \\['Z'\\] are not outputs"):
        grad_with_residuals(plain, cotangents=["Z"])


# --------------------------------------------------------------------------- FlashAttention-2 relabelings

def _fa2(kw):
    fwd = nc.library.attention(q, x, d, logsumexp=True, **kw)
    return grad_with_residuals(fwd, wrt=["K", "V"]), grad_with_residuals(fwd, wrt=["Q"])


@pytest.mark.parametrize("name", ["causal", "window", "gqa", "dv"])
def test_fa2_relabelings_are_equivalent(name):
    """dK, dV: key tiles (tile x), stream q; dQ: query tiles (tile q), stream x."""
    bkv, bq = _fa2(VARIANTS[name])
    nc.check_equivalent(bkv, bkv.tile(x, "g_x").stream(q, "s_q"), examples=5, seed=0)
    nc.check_equivalent(bq, bq.tile(q, "g_q").stream(x, "s_x"), examples=5, seed=0)


def test_whole_residual_backward_streams_x_but_tiles_neither():
    bw = grad_with_residuals(nc.library.attention(q, x, d, logsumexp=True))
    nc.check_equivalent(bw, bw.stream(x, "s_x"), examples=5, seed=0)   # refused for nc.grad
    with pytest.raises(RelabelError, match="cannot tile x: contract removes axis x"):
        bw.tile(x, "g_x")   # dQ = sum_x dS K: the split into two diagrams is what tiles
    with pytest.raises(RelabelError, match="cannot tile q: contract removes axis q"):
        bw.tile(q, "g_q")


def test_fa2_cost_is_flash_attention_shaped():
    bkv, bq = _fa2({})
    gx, sq, gq, sx = sp.symbols("g_x s_q g_q s_x", positive=True)
    Q_, X_, D_ = sp.symbols("q x d", positive=True)
    ckv = nc.cost(bkv.tile(x, "g_x").stream(q, "s_q"))
    cq = nc.cost(bq.tile(q, "g_q").stream(x, "s_x"))
    sub = {s.name: s for s in (gx, sq, gq, sx, Q_, X_, D_)}

    def same(expr, want):
        expr = expr.subs({s: sub[s.name] for s in expr.free_symbols})
        assert sp.simplify(expr - want) == 0, expr

    # K, V in, dK, dV out once; Q, O, dO, L once per key tile
    same(ckv.transfers["HBM"], 4 * D_ * X_ + (3 * D_ + 1) * Q_ * X_ / gx)
    # Q, O, dO, L in, dQ out once; K, V once per query tile
    same(cq.transfers["HBM"], 4 * D_ * Q_ + Q_ + 2 * D_ * Q_ * X_ / gq)
    same(ckv.memory["registers"], sq * (3 * gx + 1))
    recompute = nc.cost(grad(nc.library.attention(q, x, d)))
    same(recompute.transfers["HBM"], 5 * D_ * Q_ + 5 * D_ * X_ + 20 * Q_ * X_ + 2 * Q_)


# --------------------------------------------------------------------------- kernels

KSIZES = {"q": 16, "x": 16, "d": 8, "e": 4}


def _lowered(kw, which):
    from napkin_cat.verify.kernelcheck import kernel_outcome
    sizes = {k: v for k, v in KSIZES.items() if k != "e" or "dv" in kw}
    fwd = nc.library.attention(q, x, d, logsumexp=True, **kw).bind(sizes)
    if which == "kv":
        dg, tiles = grad_with_residuals(fwd, wrt=["K", "V"]).tile("x", "g_x").stream("q", "s_q"), {"g_x": 8, "s_q": 4}
    else:
        dg, tiles = grad_with_residuals(fwd, wrt=["Q"]).tile("q", "g_q").stream("x", "s_x"), {"g_q": 8, "s_x": 4}
    kernel = nc.lower(dg, tiles=tiles, threads=16, verify=False)
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in fwd.dom]
    O, L = nc.evaluate(fwd, *ins)
    dO = rng.standard_normal(O.shape)
    return dg, kernel, [*ins, O, L, dO], kernel_outcome


@pytest.mark.parametrize("which", ["kv", "q"])
@pytest.mark.parametrize("name", ["causal", "fully_masked_rows", "dv"])
def test_fa2_kernels_match_the_oracle_on_forward_residuals(name, which):
    dg, kernel, inputs, kernel_outcome = _lowered(VARIANTS[name], which)
    diff = kernel_outcome(dg.unrelabelled(), kernel, inputs)
    assert diff.failure is None, diff.failure


def test_fa2_kernel_self_check_on_unrelated_residuals():
    """lower()'s self-check draws L independently of the scores: on 'jumps' data exp(S - L)
    overflows, and the float64 oracle gives inf where fp32 (oracle and kernel alike) gives NaN;
    the kernel rule accepts a kernel that follows either oracle where both are non-finite."""
    fwd = nc.library.attention(q, x, d, logsumexp=True).bind({"q": 16, "x": 16, "d": 8})
    dg = grad_with_residuals(fwd, wrt=["Q"]).tile("q", "g_q").stream("x", "s_x")
    assert nc.lower(dg, tiles={"g_q": 8, "s_x": 4}, threads=16, verify=True).verified
