"""Score modifications and masks written with torch's functions, as FlexAttention's documentation
writes them (``torch.where(q_idx >= kv_idx, score, -float("inf"))``, ``torch.tanh``,
``torch.clamp``, ``torch.logical_and``...), traced unchanged (``ops/index_torch.py``).

Each function runs two ways: on torch tensors, which is what FlexAttention does with it (the
independent reference here), and traced into an index expression, whose NumPy meaning, tiled
execution and (two, small) generated kernels under the simulator must agree.  What a trace cannot
follow is refused with the reason."""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.ops.index_expr import TraceError  # noqa: E402
from torch.nn.attention.flex_attention import and_masks, or_masks  # noqa: E402

q, x, d = nc.axes("q x d")
N, D, SOFTCAP = 21, 4, 2.0


def causal_by_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def clamped_relative(score, b, h, q_idx, kv_idx):
    return score + 0.25 * torch.clamp(q_idx - kv_idx, min=-3, max=3)


def gated_distance(score, b, h, q_idx, kv_idx):
    return score * torch.sigmoid(torch.abs(q_idx - kv_idx) * 0.5) - torch.maximum(kv_idx - q_idx, torch.zeros_like(kv_idx))


def by_methods(score, b, h, q_idx, kv_idx):
    return score.tanh().where(q_idx >= kv_idx, -float("inf")) + (q_idx - kv_idx).remainder(3) * 0.5


def window_by_logic(b, h, q_idx, kv_idx):
    return torch.logical_and(torch.ge(q_idx, kv_idx), torch.le(q_idx - kv_idx, 5))


def strided_by_bits(b, h, q_idx, kv_idx):
    return torch.logical_or(torch.eq(torch.bitwise_and(kv_idx, 3), 0), torch.remainder(q_idx - kv_idx, 7) == 0) \
        & (kv_idx <= q_idx)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 6


def _sink(b, h, q_idx, kv_idx):
    return kv_idx < 2


composed_window = and_masks(_causal, _window)           # FlexAttention's helpers, unchanged
sink_window = or_masks(and_masks(_causal, _window), and_masks(_causal, _sink))

SCORE_MODS = {f.__name__: f for f in (causal_by_score, tanh_softcap, clamped_relative, gated_distance, by_methods)}
MASK_MODS = {"window_by_logic": window_by_logic, "strided_by_bits": strided_by_bits,
             "composed_window": composed_window, "sink_window": sink_window}


def _grids():
    i = torch.arange(N, dtype=torch.int64).view(N, 1)
    j = torch.arange(N, dtype=torch.int64).view(1, N)
    zero = torch.zeros((), dtype=torch.int64)
    return zero, i, j


def _reference(Q, K, V, score_mod=None, mask_mod=None):
    """Attention with the functions run on torch tensors, as FlexAttention runs them (float64)."""
    zero, i, j = _grids()
    s = torch.from_numpy(Q @ K.T / np.sqrt(D))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)     # integer indices times a float: float64, not float32
    try:
        if score_mod is not None:
            s = score_mod(s, zero, zero, i, j)
        if mask_mod is not None:
            s = torch.where(mask_mod(zero, zero, i, j), s, -float("inf"))
    finally:
        torch.set_default_dtype(default)
    s = s.numpy()
    p = np.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ V


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((N, D)) for _ in range(3))


@pytest.mark.parametrize("name", sorted(SCORE_MODS) + sorted(MASK_MODS))
def test_the_traced_function_means_what_torch_computes_with_it(name):
    kw = dict(score_mod=SCORE_MODS[name]) if name in SCORE_MODS else dict(mask=nc.mask_mod(MASK_MODS[name]))
    ref = _reference(*_inputs(), **({"score_mod": SCORE_MODS[name]} if name in SCORE_MODS
                                    else {"mask_mod": MASK_MODS[name]}))
    att = nc.library.attention(q=q, x=x, d=d, **kw).bind({q: N, x: N, d: D})
    np.testing.assert_allclose(nc.evaluate(att, *_inputs()), ref, atol=1e-12)
    np.testing.assert_allclose(nc.evaluate(att.stream("x", 5).tile("q", 6), *_inputs()), ref, atol=1e-12)


def test_the_torch_spellings_trace_to_the_vocabularys_trees():
    """One definition: torch's spelling and nc.ix's give the same expression."""
    by_torch = nc.score_mod(causal_by_score).expr
    by_ix = nc.score_mod(lambda s, b, h, i, j: nc.ix.where(i >= j, s, -float("inf"))).expr
    assert by_torch.same(by_ix)
    assert nc.score_mod(tanh_softcap).expr.same(
        nc.score_mod(lambda s, b, h, i, j: SOFTCAP * nc.ix.tanh(s / SOFTCAP)).expr)


def test_flexattentions_and_masks_and_or_masks_trace_to_the_plain_mask_and_skip_alike():
    """``and_masks`` starts from ``b.new_ones((), dtype=torch.bool)`` and ``or_masks`` from
    ``new_zeros``: constants that fold away, so the composed mask is the mask written with ``&`` and
    ``|`` (the same tree), and its chunks are skipped as that one's are."""
    plain = nc.mask_mod(lambda b, h, i, j: (i >= j) & (i - j <= 6))
    assert nc.mask_mod(composed_window).expr.same(plain.expr)
    assert str(nc.mask_mod(sink_window).expr) == "((i >= j) & ((i - j) <= 6)) | ((i >= j) & (j < 2))"
    cost = lambda m: nc.cost(nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: 64, x: 64, d: D})
                             .stream("x", 8).tile("q", 8)).flops["tensor"]
    dense = nc.cost(nc.library.attention(q=q, x=x, d=d).bind({q: 64, x: 64, d: D}).stream("x", 8).tile("q", 8))
    assert cost(nc.mask_mod(composed_window)) == cost(plain) < dense.flops["tensor"]
    with pytest.raises(TraceError, match="a traced value is a scalar"):
        nc.mask_mod(lambda b, h, i, j: b.new_ones((2,), dtype=torch.bool) & (i >= j))


@pytest.mark.parametrize("name", ["causal_by_score", "tanh_softcap"])
def test_the_torch_spelled_variants_lower_and_pass_the_kernel_self_check(name):
    att = nc.library.attention(q=q, x=x, d=d, score_mod=SCORE_MODS[name]).bind({q: N, x: N, d: 8})
    assert nc.lower(att.stream("x", 8).tile("q", 8)).verified     # checked against the oracle before it returns


ALIBI = torch.tensor([0.5, 0.25])


@pytest.mark.parametrize("fn, why", [
    (lambda s, b, h, i, j: s + ALIBI[h] * (j - i), "declare the tensor with nc.aux"),
    (lambda s, b, h, i, j: ALIBI.sum() * s, "must be declared with nc.aux"),
    (lambda s, b, h, i, j: torch.erf(s), "torch.erf is not in the index vocabulary"),
    (lambda s, b, h, i, j: torch.max(s, 1).values, "reduces it"),
    (lambda s, b, h, i, j: s + torch.div(i - j, 2, rounding_mode="trunc"), "rounds toward zero"),
    (lambda s, b, h, i, j: s + torch.fmod(i - j, 3), "dividend's sign"),
    (lambda s, b, h, i, j: torch.where(i >= j), "gives indices"),
    (lambda s, b, h, i, j: s.softmax(0), "has no method 'softmax'"),
])
def test_what_the_tracer_cannot_follow_in_torch_is_refused_with_the_reason(fn, why):
    with pytest.raises(TraceError) as info:
        nc.score_mod(fn)
    assert why in str(info.value), str(info.value)
