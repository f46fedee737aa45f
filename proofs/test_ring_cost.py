"""Ring attention's cost, derived from the diagram: link traffic, and when the ring is
bandwidth-bound (a step's block takes longer to cross the link than to compute).

Per device and ring step, with ``P`` devices, queries ``q``, keys ``x``, head size ``d``:
compute ``4 (q/P)(x/P) d`` FLOPs, link ``2 (x/P) d`` values (a block of K and one of V).  The
step is bandwidth-bound when ``2 (x/P) d b / B > 4 (q/P)(x/P) d / R`` (``b`` bytes per value,
``B`` link bytes/s, ``R`` FLOP/s), i.e. when ``q/P < R b / (2 B)``: the queries a device holds,
not the keys, decide it.  The folding of partials is the online-softmax lemma on states
``(O, L)`` (``proofs/test_accumulators.py``); here it is checked against the oracle.
"""

from __future__ import annotations

import numpy as np
import sympy as sp
import torch

import napkin_cat as nc
from napkin_cat.core.hierarchy import DEVICES
from napkin_cat.lowering.distributed import fold_online_softmax
from napkin_cat.relabel.symbols import size_symbol

q, x, d = nc.axes("q x d")
RING = nc.library.attention(q=q, x=x, d=d).tile(q, DEVICES).stream(x, DEVICES)
P, Q_, X_, D_ = (size_symbol(n) for n in (DEVICES, "q", "x", "d"))


def test_ring_moves_every_missing_block_once():
    c = nc.cost(RING.stream(x, "s_x").tile(q, "g_q"))
    assert sp.simplify(c.transfers["NVLink"] - 2 * X_ * D_ * (P - 1)) == 0
    # inside a device nothing changes: HBM traffic is the single-GPU FlashAttention's, summed
    one = nc.cost(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"))
    assert sp.simplify(c.transfers["HBM"] - one.transfers["HBM"]) == 0
    assert sp.simplify(c.flops["tensor"] - one.flops["tensor"]) == 0


def test_bandwidth_bound_below_the_crossover():
    hw = nc.hardware.H200
    rate, b, bw = hw.rate("tensor", "f32"), 4, hw.link_bandwidth
    crossover = rate * b / (2 * bw)                       # rows per device, latency left out
    assert 290 < crossover < 300                          # fp32 CUDA cores over NVLink 4
    c = nc.cost(RING)
    for rows in (64, 256, 384, 4096):
        sizes = {q: 2 * rows, x: 1 << 16, d: 64, DEVICES: 2}
        t = c.devices(hw, sizes)
        flops = 4 * rows * (1 << 15) * 64 / rate
        link = 2 * (1 << 15) * 64 * b / bw
        assert abs(t.compute_step - flops) / flops < 0.05   # the exp and fma work ride along
        assert abs(t.link_step - link - hw.link_latency) < 1e-12
        assert t.bandwidth_bound == (rows < 300)       # the crossover, moved up ~13 % by the latency


def test_fold_of_partials_is_attention_over_the_union():
    rng = np.random.default_rng(3)
    Q, K, V = rng.standard_normal((5, 3)), rng.standard_normal((8, 3)), rng.standard_normal((8, 3))
    with_l = nc.library.attention(q=q, x=x, d=d, logsumexp=True)
    state = None
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        o, lse = nc.evaluate(with_l, Q, K[lo:hi], V[lo:hi])
        state = fold_online_softmax(state, (torch.from_numpy(o), torch.from_numpy(lse)), ("q", "d"), ("q",))
    want_o, want_l = nc.evaluate(with_l, Q, K, V)
    assert np.abs(state[0].numpy() - want_o).max() < 1e-12
    assert np.abs(state[1].numpy() - want_l).max() < 1e-12


def _brute_kept(rows_of, world: int, n: int, tile: int) -> list[int]:
    """Per device, the (query tile, key tile) pairs with a kept entry of the causal mask
    ``j <= i``, counted from the mask itself: device ``r`` holds the query rows ``rows_of(r)``
    and meets every device's key rows (the same layout) once around the ring."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = j <= i
    out = []
    for r in range(world):
        mine = rows_of(r)
        keys = np.concatenate([rows_of(s) for s in range(world)])
        out.append(sum(bool(keep[np.ix_(mine[a:a + tile], keys[b:b + tile])].any())
                       for a in range(0, len(mine), tile) for b in range(0, len(keys), tile)))
    return out


def test_zigzag_balances_causal_work_over_the_devices():
    """The cost model's kept tiles per device equal a count from the mask, and zig-zag's
    busiest device keeps fewer tiles than contiguous sharding's (the mean, where contiguous
    gives its last device ``(2W - 1) / W`` times it, as the tile count grows)."""
    hw, W, n, tile = nc.hardware.H200, 4, 4096, 256
    causal = nc.library.attention(q=q, x=x, d=d, causal=True)
    sizes = {q: n, x: n, d: 64, DEVICES: W, "s_x": tile, "g_q": tile}
    c = n // (2 * W)
    layouts = {"contiguous": lambda r: np.arange(r * n // W, (r + 1) * n // W),
               "zigzag": lambda r: np.concatenate([np.arange(r * c, (r + 1) * c),
                                                   np.arange((2 * W - 1 - r) * c, (2 * W - r) * c)])}
    got = {}
    for order, rows_of in layouts.items():
        ring = causal.tile(q, DEVICES, order=order).stream(x, DEVICES, order=order).stream(x, "s_x").tile(q, "g_q")
        got[order] = nc.cost(ring).devices(hw, sizes)
        assert list(got[order].tiles) == _brute_kept(rows_of, W, n, tile), order
    contiguous, zigzag = got["contiguous"], got["zigzag"]
    assert sum(zigzag.tiles) == sum(contiguous.tiles)                 # the same work, spread differently
    assert max(zigzag.tiles) < max(contiguous.tiles)
    assert max(zigzag.tiles) == min(zigzag.tiles) and zigzag.imbalance == 1.0
    k = n // tile                                                      # tiles per axis
    assert max(contiguous.tiles) == sum(range(k - k // W + 1, k + 1))  # the last device: rows k - k/W .. k
    assert zigzag.compute_step < contiguous.compute_step and zigzag.seconds < contiguous.seconds
