"""FlashAttention's backward in one kernel (dQ added across key tiles with atomics) against two
kernels (dK, dV with keys tiled; dQ with queries tiled), derived from the diagrams.

Both forms come from ``nc.grad_with_residuals`` of the same forward; the one-kernel form tiles
the keys with ``partial="sum"``, so dQ (a sum over the keys) is added into HBM by every key tile.
What the cost model says, symbolically and at N = 4096, d = 64, H = 16 (``kernels/backward_forms.py``
prints the table):

* tensor FLOPs per ``d h q x``: 10 against 14 (the two-kernel form computes S = QK^T and
  dP = dO V^T twice); both recompute ``D = rowsum(dO * O)`` once per key tile;
* HBM traffic: the atomics (read and write of dQ's partial, fp32, once per key tile) replace
  the dQ kernel's re-reads of K and V per query tile; with equal tiles the one-kernel form
  moves ``12 d h q + 4 h q`` bytes fewer (the dQ kernel's loads of Q, O, dO, L and its store
  of dQ, less the zero-fill of dQ);
* the roofline on an H100 is compute-bound for both, so the one-kernel form is predicted faster.
Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

from functools import lru_cache

import sympy as sp

import napkin_cat as nc
from napkin_cat.relabel.symbols import size_symbol

q, x, d, h = nc.axes("q x d h")
Q_, X_, D_, H_ = (size_symbol(n) for n in "qxdh")
G = sp.Symbol("g", positive=True)
SIZES = {q: 4096, x: 4096, d: 64, h: 16}
BLOCKS = 64


@lru_cache(maxsize=None)
def forms():
    """(one kernel, dK dV kernel, dQ kernel), relabelled with symbolic blocks."""
    fwd = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True)
    one = nc.grad_with_residuals(fwd, wrt=["Q", "K", "V"]).tile(x, "g_x", partial="sum").stream(q, "s_q").tile(h, 1)
    kv = nc.grad_with_residuals(fwd, wrt=["K", "V"]).tile(x, "g_x").stream(q, "s_q").tile(h, 1)
    dq = nc.grad_with_residuals(fwd, wrt=["Q"]).tile(q, "g_q").stream(x, "s_x").tile(h, 1)
    return one, kv, dq


@lru_cache(maxsize=None)
def costs():
    return tuple(nc.cost(f) for f in forms())


def _same_tiles(e):
    """Every tile and chunk symbol set to one ``g``: the forms compared block for block."""
    return sp.expand(sp.sympify(e).subs({size_symbol(n): G for n in ("g_x", "s_q", "g_q", "s_x")}))


def test_tensor_flops_10_against_14_per_dqx():
    one, kv, dq = costs()
    vol = D_ * H_ * Q_ * X_
    g_x = size_symbol("g_x")
    # besides the products per (q, x) pair: D = rowsum(dO * O), once per key tile in a key-tiled
    # kernel (2 d h q x / g_x) and once in the dQ kernel (2 d h q)
    assert sp.simplify(one.flops["tensor"] - (10 * vol + 2 * vol / g_x)) == 0
    assert sp.simplify(kv.flops["tensor"] + dq.flops["tensor"] - (14 * vol + 2 * vol / g_x + 2 * D_ * H_ * Q_)) == 0
    per = lambda e: sp.limit(sp.limit(sp.expand(e / vol), g_x, sp.oo), X_, sp.oo)   # the leading term
    assert (per(one.flops["tensor"]), per(kv.flops["tensor"] + dq.flops["tensor"])) == (10, 14)
    print("tensor FLOPs per d h q x: one kernel 10, two kernels 14")


def test_atomics_are_a_read_and_a_write_of_dq_per_key_tile_plus_the_zero_fill():
    one = costs()[0]
    rmw = sum((m.values for m in one.moves if m.kind in ("atomic read", "atomic write")), sp.Integer(0))
    fill = sum((m.values for m in one.moves if m.kind == "zero-fill"), sp.Integer(0))
    assert sp.simplify(rmw - 2 * D_ * H_ * Q_ * X_ / size_symbol("g_x")) == 0
    assert sp.simplify(fill - D_ * H_ * Q_) == 0
    assert all(m.dtype == nc.f32 and m.upper == "HBM" for m in one.moves if m.kind.startswith("atomic"))
    # and the adds themselves: one fma per value added
    adds = sum((o.total for o in one.ops if o.what.startswith("atomic add")), sp.Integer(0))
    assert sp.simplify(adds - D_ * H_ * Q_ * X_ / size_symbol("g_x")) == 0


def test_hbm_bytes_one_kernel_saves_the_dq_kernels_row_traffic():
    one, kv, dq = costs()
    diff = _same_tiles(one.bytes("HBM")) - _same_tiles(kv.bytes("HBM") + dq.bytes("HBM"))
    assert sp.simplify(diff - (-12 * D_ * H_ * Q_ - 4 * H_ * Q_)) == 0
    print("HBM bytes, one kernel minus two kernels (equal tiles):", sp.factor(diff))


def test_at_4096_one_kernel_is_predicted_faster_on_h100():
    one, kv, dq = costs()
    t_one = one.time(nc.hardware.H100, {**SIZES, "g_x": BLOCKS, "s_q": BLOCKS})
    t_kv = kv.time(nc.hardware.H100, {**SIZES, "g_x": BLOCKS, "s_q": BLOCKS})
    t_dq = dq.time(nc.hardware.H100, {**SIZES, "g_q": BLOCKS, "s_x": BLOCKS})
    assert t_one.bound_by.startswith("compute") and t_kv.bound_by.startswith("compute")
    assert t_one.seconds < t_kv.seconds + t_dq.seconds
    # compute-bound: the ratio of the times is the ratio of the tensor FLOPs (10 + 2/64 over 14 + 2/64 + ...)
    assert abs(t_one.seconds / (t_kv.seconds + t_dq.seconds) - t_one.flops / (t_kv.flops + t_dq.flops)) < 0.02
    print(f"H100 roofline at N=4096: one kernel {t_one.seconds * 1e6:.0f} us, two kernels "
          f"{(t_kv.seconds + t_dq.seconds) * 1e6:.0f} us")
