"""FlexAttention's mask examples, written as their authors write them for ``flex_attention``
(torch methods: ``.clamp``, ``.abs()``, shifts and bit masks), traced by ``nc.mask_mod`` unchanged.

Each function below runs two ways: on torch integer index grids, which is what FlexAttention
does with it (the independent reference here), and traced into an index expression, whose NumPy
meaning, tiled execution and (a few, small) generated kernels under the simulator must agree.
The masks: 2-D neighbourhood attention with its kernel clamped to the canvas (NATTEN), the same
on a canvas stored tile by tile, and in Morton (Z-curve) order, which decodes positions with
shifts and bit masks; sliding tile attention (STA) on a 2-D canvas; a causal sliding window with
attention-sink tokens; a dilated sliding window."""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.ops.index_expr import TraceError  # noqa: E402

q, x, d = nc.axes("q x d")
CW, CH, KW, KH = 6, 6, 3, 3          # canvas and kernel, as in the FlexAttention examples
TW, TH = 2, 2                        # tiles of the tiled canvas and of STA


def natten(b, h, qi, ki):
    qx, qy, kx, ky = qi // CW, qi % CW, ki // CW, ki % CW
    cx = qx.clamp(KW // 2, (CW - 1) - KW // 2)
    cy = qy.clamp(KH // 2, (CH - 1) - KH // 2)
    return ((cx - kx).abs() <= KW // 2) & ((cy - ky).abs() <= KH // 2)


def _tiled_xy(idx):
    t = idx // (TH * TW)
    ty, tx = t // (CW // TW), t % (CW // TW)
    off = idx % (TH * TW)
    return tx * TW + off % TW, ty * TH + off // TW


def tiled_natten(b, h, qi, ki):
    qx, qy = _tiled_xy(qi)
    kx, ky = _tiled_xy(ki)
    cx = qx.clamp(KW // 2, (CW - 1) - KW // 2)
    cy = qy.clamp(KH // 2, (CH - 1) - KH // 2)
    return ((cx - kx).abs() <= KW // 2) & ((cy - ky).abs() <= KH // 2)


def _deinterleave(c):
    c = c & 0x55555555
    c = (c | (c >> 1)) & 0x33333333
    c = (c | (c >> 2)) & 0x0F0F0F0F
    c = (c | (c >> 4)) & 0x00FF00FF
    return (c | (c >> 8)) & 0x0000FFFF


def morton_natten(b, h, qi, ki):
    qx, qy, kx, ky = _deinterleave(qi), _deinterleave(qi >> 1), _deinterleave(ki), _deinterleave(ki >> 1)
    cx = qx.clamp(KW // 2, (8 - 1) - KW // 2)    # an 8 x 8 canvas: Morton order needs a power of two
    cy = qy.clamp(KH // 2, (8 - 1) - KH // 2)
    return ((cx - kx).abs() <= KW // 2) & ((cy - ky).abs() <= KH // 2)


def sta(b, h, qi, ki):
    """Sliding tile attention on a CH x CW canvas of TH x TW tiles, a kernel of 2 x 2 tiles."""
    tiles_w, ker = CW // TW, 2
    qt, kt = qi // (TH * TW), ki // (TH * TW)
    qh, qw, kh, kw = qt // tiles_w, qt % tiles_w, kt // tiles_w, kt % tiles_w
    left, right = ker // 2, ker // 2 + (ker % 2 - 1)
    ch = qh.clamp(left, (CH // TH - 1) - right)
    cw = qw.clamp(left, (tiles_w - 1) - right)
    return (kh >= ch - left) & (kh <= ch + right) & (kw >= cw - left) & (kw <= cw + right)


def sink_window(b, h, qi, ki):
    return ((qi - ki <= 3) | (ki < 2)) & (qi >= ki)


def dilated_window(b, h, qi, ki):
    return ((qi - ki).abs() <= 6) & ((qi - ki) % 2 == 0)


MASKS = {"natten": (natten, 36), "tiled_natten": (tiled_natten, 36), "morton_natten": (morton_natten, 64),
         "sta": (sta, 36), "sink_window": (sink_window, 20), "dilated_window": (dilated_window, 20)}


def _torch_keep(fn, n):
    i = torch.arange(n).view(n, 1)
    j = torch.arange(n).view(1, n)
    zero = torch.zeros((), dtype=torch.int64)
    return fn(zero, zero, i, j).expand(n, n).numpy()


@pytest.mark.parametrize("name", sorted(MASKS))
def test_the_traced_mask_keeps_what_flexattention_would(name):
    fn, n = MASKS[name]
    m = nc.mask_mod(fn)
    keep = _torch_keep(fn, n)
    assert 0 < keep.sum() < n * n
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    got = np.broadcast_to(m(i, j), (n, n))
    np.testing.assert_array_equal(got, keep)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_attention_with_the_mask_matches_masked_softmax_tiled(name):
    fn, n = MASKS[name]
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((n, 4)) for _ in range(3))
    s = Q @ K.T / 2
    s = np.where(_torch_keep(fn, n), s, -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ V
    att = nc.library.attention(q=q, x=x, d=d, mask=nc.mask_mod(fn)).bind({q: n, x: n, d: 4})
    np.testing.assert_allclose(nc.evaluate(att, Q, K, V), want, atol=1e-12)
    np.testing.assert_allclose(nc.evaluate(att.stream("x", 5).tile("q", 7), Q, K, V), want, atol=1e-12)


@pytest.mark.parametrize("name", ["natten", "morton_natten", "sink_window"])
def test_the_masks_lower_and_pass_the_kernel_self_check(name):
    fn, n = MASKS[name]
    att = nc.library.attention(q=q, x=x, d=d, mask=nc.mask_mod(fn)).bind({q: n, x: n, d: 8})
    kernel = nc.lower(att.stream("x", 8).tile("q", 8))    # checked against the oracle before it returns
    assert kernel.verified


def test_shifts_are_products_and_floor_divisions_by_powers_of_two():
    i = nc.mask_mod(lambda b, h, i, j: (i >> 2) == (j << 1)).expr
    assert str(i) == "(i // 4) == (j * 2)"
    grid = np.arange(-9, 9)
    np.testing.assert_array_equal(nc.mask_mod(lambda b, h, i, j: (i >> 2) == j)(grid[:, None], grid[None, :]),
                                  (grid[:, None] >> 2) == grid[None, :])   # arithmetic shift: floor division


@pytest.mark.parametrize("fn, why", [
    (lambda b, h, i, j: (i >> j) > 0, "constant number of bits"),
    (lambda b, h, i, j: (2 << i) > j, "only by a constant"),
    (lambda b, h, i, j: i.clamp() > j, "needs a min or a max"),
])
def test_what_the_tracer_cannot_follow_is_refused_with_the_reason(fn, why):
    with pytest.raises(TraceError) as info:
        nc.mask_mod(fn)
    assert why in str(info.value)
