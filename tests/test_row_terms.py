"""A bias's terms constant along the softmax's axis are dropped before lowering (relabel/row_terms.py).

The rewrite must leave O (and its gradients) unchanged, leave alone every bias whose shift some
box or output could see, and reach the kernels ``nc.lower`` and ``nc.torch_op`` build.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import napkin_cat as nc
from napkin_cat.ops.index_expr import trace
from napkin_cat.relabel import row_terms
from napkin_cat.relabel.row_terms import along_terms, drop_row_terms

q, x, d, h, b = nc.axes("q x d h b")
SLOPE = nc.aux("slope", nc.Axis("nh", 3))

BIASES = {   # name -> (score_mod, whether it has a term constant along x)
    "relative": (lambda s, b, h, i, j: s + (i - j) * 0.01, True),
    "alibi of each head": (lambda s, b, h, i, j: s + SLOPE[h] * (j - i), True),
    "several terms": (lambda s, b, h, i, j: s + (i * 3 - 2 * j + i // 4) / 7.0 - (h - j) * 0.5, True),
    "two column terms in one box": (lambda s, b, h, i, j: s + ((i - j) * 0.25 + (j * 3 - i * 2) * 0.5) * 0.5, True),
    "negated first": (lambda s, b, h, i, j: s - (j * 0.25 + i), True),
    "distance": (lambda s, b, h, i, j: s + abs(i - j) * 0.01, False),
    "along x only": (lambda s, b, h, i, j: s + j * 0.5, False),
}


def _attention(score_mod, **kw):
    return nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, score_mod=score_mod, **kw)



def test_a_relative_bias_keeps_its_column_term():
    e = trace(lambda b, h, i, j: (i - j) * 0.01, "bias")
    kept = along_terms(e, "j")
    assert "i" not in kept.leaves("idx")
    i, j = np.meshgrid(np.arange(7), np.arange(5), indexing="ij")
    shift = e.evaluate(np, {"i": i, "j": j}) - kept.evaluate(np, {"i": i, "j": j})
    assert np.allclose(shift, shift[:, :1])          # what was dropped is constant along j


def test_biases_without_a_row_term_are_left_alone():
    for fn in (lambda b, h, i, j: abs(i - j) * 0.01, lambda b, h, i, j: j * 0.5, lambda b, h, i, j: i * 2.0):
        assert along_terms(trace(fn, "bias"), "j") is None


@pytest.mark.parametrize("name", sorted(BIASES))
@pytest.mark.parametrize("causal", [False, True])
def test_the_rewritten_attention_is_equivalent(name, causal):
    fn, dropped = BIASES[name]
    dia = _attention(fn, causal=causal)
    new, notes = drop_row_terms(dia)
    assert bool(notes) == dropped, notes
    if not dropped:
        assert new is dia
        return
    biases = [e.box.param("bias").expr for e in new.eqns if e.box.kind == "index_bias"]
    # the term of a row alone is gone from the bias box whose terms vary along x
    assert any("x" in e.leaves("idx") and "q" not in e.leaves("idx") for e in biases), biases
    sizes = {q: 9, x: 13, d: 4, h: 3, b: 1}
    nc.check_equivalent(dia.bind(sizes), new.bind(sizes), examples=25)


@pytest.mark.parametrize("c", [0.01, -1.5, 3.0])
@pytest.mark.parametrize("causal", [False, True])
def test_random_sizes_chunks_and_data(c, causal):
    """check_equivalent draws the sizes (ragged, several chunks of the streamed one) and the data
    (huge logits, jumps between chunks, masked rows)."""
    dia = _attention(lambda s, b, h, i, j: s + (i - j) * c, causal=causal).stream(x, "s_x")
    new, notes = drop_row_terms(dia)
    assert notes
    nc.check_equivalent(dia, new, examples=20, seed=1)


def test_a_logsumexp_output_sees_the_shift_so_nothing_is_dropped():
    dia = _attention(BIASES["relative"][0], logsumexp=True)
    new, notes = drop_row_terms(dia)
    assert new is dia and notes == ()


def test_a_softcap_after_the_bias_does_not_commute_with_a_shift():
    dia = _attention(BIASES["relative"][0], softcap=5.0)
    assert drop_row_terms(dia) == (dia, ())


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(row_terms, "SWITCH", False)
    dia = _attention(BIASES["relative"][0])
    assert drop_row_terms(dia) == (dia, ())


def test_the_diagram_given_is_not_changed():
    dia = _attention(BIASES["relative"][0])
    before = str(dia.eqns)
    drop_row_terms(dia)
    assert str(dia.eqns) == before


def test_a_lowered_16_bit_kernel_computes_the_column_term_only():
    dia = _attention(BIASES["relative"][0], causal=True, dtype=nc.f16).bind({q: 12, x: 20, d: 16, h: 2, b: 1})
    kernel = nc.lower(dia.stream("x", 8).tile("q", 4))
    assert any("dropped before the softmax" in n for n in kernel.notes)
    bias = next(e.box for e in kernel.diagram.eqns if e.box.kind == "index_bias")
    assert bias.param("bias").expr.leaves("idx") == ("x",)
    nc.check_equivalent(dia, kernel, examples=4)


def test_an_fp32_kernel_keeps_the_bias_as_written():
    """The kept term grows with the key index; fp32 kernels keep the precision of the bias as
    written (row_terms.SWITCH)."""
    dia = _attention(BIASES["alibi of each head"][0], causal=True).bind({q: 12, x: 20, d: 4, h: 3, b: 1})
    kernel = nc.lower(dia.stream("x", 8).tile("q", 4), verify=False)
    assert not any("dropped before the softmax" in n for n in kernel.notes)
    bias = next(e.box for e in kernel.diagram.eqns if e.box.kind == "index_bias")
    assert set(bias.param("bias").expr.leaves("idx")) >= {"q", "x"}


def test_torch_op_keeps_the_bias_as_written_by_default():
    dia = _attention(BIASES["relative"][0], causal=True)
    op = nc.torch_op(dia.stream(x, "s_x").tile(q, "g_q"))
    assert op.rewrites == () and op.diagram is not None


def test_torch_op_gradients_match_the_bias_as_written(monkeypatch):
    monkeypatch.setattr(row_terms, "TORCH_OP", True)
    dia = _attention(BIASES["relative"][0], causal=True)
    op = nc.torch_op(dia.stream(x, "s_x").tile(q, "g_q"))
    assert op.rewrites
    gen = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 2, 11, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dO = torch.randn(1, 2, 11, 4, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
    i = torch.arange(11)[:, None]
    j = torch.arange(11)[None, :]
    S = Q @ K.transpose(-1, -2) / 2.0 + (i - j) * 0.01
    S = S.masked_fill(j > i, float("-inf"))
    want = torch.autograd.grad(torch.softmax(S, -1) @ V, (Q, K, V), dO)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-10), (g - w).abs().max()
