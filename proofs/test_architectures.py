"""Complexity of whole architectures read off their diagrams (Neural Circuit Diagrams, section on
complexity): FLOPs, memory and HBM transfers, symbolic in the sizes, from ``nc.cost`` alone (no
formula is written per architecture), compared with the complexities the papers state.

* a convolution costs O(outputs x kernel x in-channels) per out-channel: ``2 o ho wo (c/g) kh kw``;
* attention costs O(N^2 d): the block's quadratic term is ``4 h e t^2`` (two contractions);
* the materialising attention moves Theta(N d + N^2) through HBM: the t^2 terms of the block's
  transfers are the score and probability matrices, ``h t^2`` each, read and written;
* the MLP costs ``4 d f t``, the projections ``8 d h e t``.
"""

from __future__ import annotations

import pytest
import sympy as sp

import napkin_cat as nc

L = nc.library


def S(*names):
    return sp.symbols(names, positive=True, integer=True)


def _quadratic(expr, var):
    return sp.Poly(sp.expand(expr), var).coeff_monomial(var ** 2)


def test_conv_flops_are_outputs_times_kernel_times_channels():
    o, c, ho, wo = S("o", "c", "ho", "wo")
    kh, kw = nc.Axis("kh", "kh"), nc.Axis("kw", "kw")
    f = nc.cost(L.conv2d(kernel=(kh, kw), bias=False)).flops
    khs, kws = S("kh", "kw")
    assert sp.simplify(f["tensor"] - 2 * o * ho * wo * c * khs * kws) == 0
    assert f["fma"] == 0 and f["exp"] == 0     # the unfolding is free: a reindexing


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_conv_divides_the_work_by_the_groups(groups):
    ho, wo = S("ho", "wo")
    f = nc.cost(L.conv2d(8, 16, kernel=3, groups=groups, bias=False)).flops["tensor"]
    assert sp.simplify(f - 2 * 16 * ho * wo * (8 // groups) * 9) == 0


def test_transposed_conv_counts_every_window_it_reads():
    """In gather form a transposed convolution reads all kernel taps per output (the zero taps
    between strides included): ``2 o ho wo c kh``; a stride-s layer does s times more work than
    the scatter form, the price of expressing it as an unfolding."""
    c, o, lo = S("c", "o", "lo")
    f = nc.cost(L.conv1d(kernel=4, stride=2, transposed=True, bias=False)).flops["tensor"]
    assert sp.simplify(f - 2 * o * lo * c * 4) == 0


@pytest.mark.slow
def test_transformer_block_is_quadratic_in_tokens_with_the_attention_coefficient():
    t, d, h, e, f = S("t", "d", "h", "e", "f")
    c = nc.cost(L.transformer_block())
    tensor = sp.expand(c.flops["tensor"])
    assert sp.simplify(tensor - (4 * h * e * t ** 2 + 8 * d * h * e * t + 4 * d * f * t)) == 0
    assert sp.simplify(_quadratic(tensor, t) - 4 * h * e) == 0          # O(N^2 d), d = h e
    # the materialising algorithm moves the N^2 score and probability matrices through HBM
    moved = _quadratic(c.transfers["HBM"], t)
    assert moved != 0 and sp.simplify(moved / h).free_symbols == set()
    assert sp.simplify(_quadratic(c.flops["exp"], t) - h) == 0           # one exp per score


@pytest.mark.slow
def test_transformer_block_attention_part_matches_the_library_attention_cost():
    """The block's quadratic work is exactly the library attention's (weaved over heads)."""
    t, h, e = S("t", "h", "e")
    x = nc.Axis("x", "t")
    att = nc.cost(L.attention(q=nc.Axis("t"), x=x, d=nc.Axis("e"), heads=nc.Axis("h"))).flops["tensor"]
    blk = nc.cost(L.transformer_block()).flops["tensor"]
    assert sp.simplify(_quadratic(blk, t) - _quadratic(att, t)) == 0


def test_resnet_block_is_two_3x3_convolutions():
    c, h, w = S("c", "h", "w")
    f = nc.cost(L.resnet_block()).flops
    assert sp.simplify(f["tensor"] - 2 * (2 * c * h * w * c * 9)) == 0


@pytest.mark.slow
def test_vit_patch_embedding_and_attention_terms():
    c, d, gh, gw, t, heads, e, f, k = S("c", "d", "gh", "gw", "t", "heads", "e", "f", "k")
    flops = nc.cost(L.vit(patch=4)).flops["tensor"]
    want = 2 * d * c * 16 * gh * gw + 4 * heads * e * t ** 2 + 8 * d * heads * e * t + 4 * d * f * t + 2 * d * k
    assert sp.simplify(flops - want) == 0


@pytest.mark.slow
def test_unet_work_per_level():
    """Level l runs at (h/2^l)(w/2^l): the symbolic sizes of the levels carry each level's work."""
    c, k, h, w, h1, w1 = S("c", "k", "h", "w", "h1", "w1")
    flops = sp.expand(nc.cost(L.unet(widths=(8, 16))).flops["tensor"])
    conv = lambda ci, co, hh, ww, kk=9: 2 * ci * co * hh * ww * kk   # noqa: E731
    want = (conv(c, 8, h, w) + conv(8, 8, h, w)                        # encoder level 0
            + conv(8, 16, h1, w1) + conv(16, 16, h1, w1)               # bottleneck
            + conv(16, 8, h, w, 4)                                     # transposed 2x2, gathered
            + conv(16, 8, h, w) + conv(8, 8, h, w)                     # decoder level 0
            + conv(8, k, h, w, 1))
    assert sp.simplify(flops - want) == 0
