"""The backward of ring attention, derived: why it is additive over key blocks, what it moves,
and when it is bandwidth-bound.

With each query row's *global* ``O`` and ``L`` saved by the forward, FlashAttention-2's backward
of the block of keys ``j`` (``P_j = exp(S_j - L)``, ``D = rowsum(dO * O)``, ``dS_j = P_j (dP_j - D)``)
gives exactly block ``j``'s columns of the whole backward, so ``dQ = sum_j dQ_j`` and ``dK_j``,
``dV_j`` are the block's own (checked against the oracle below, on uneven blocks and a causal
mask).  That is what lets :mod:`napkin_cat.lowering.distributed_backward` rotate the key blocks
again, each with the accumulator of its gradients.

Per step a device computes ``10 (q/P)(x/P) d`` FLOPs (recompute ``S``; ``dV``, ``dP``, ``dQ``,
``dK``: five products, against the forward's two), while a key block and a gradient
accumulator of the same size cross the link: ``4 (x/P) d`` values.  The backward step is
bandwidth-bound when ``q/P < 4 R b / (10 B) = 0.8`` times the forward's crossover
``R b / (2 B)`` (``proofs/test_ring_cost.py``).
"""

from __future__ import annotations

import numpy as np

import napkin_cat as nc
from napkin_cat.core.hierarchy import DEVICES
from napkin_cat.costmodel import backward_device_time
from napkin_cat.costmodel.backward_links import backward_diagram

q, x, d = nc.axes("q x d")


def test_block_backward_with_global_residuals_is_additive():
    rng = np.random.default_rng(11)
    for causal in (False, True):
        fwd = nc.library.attention(q=q, x=x, d=d, causal=causal, logsumexp=True)
        bwd = backward_diagram(fwd.unrelabelled())
        Q, K, V, dO = (rng.standard_normal((9, 4)) for _ in range(4))
        O, L = nc.evaluate(fwd, Q, K, V)
        dQ, dK, dV = nc.evaluate(bwd, Q, K, V, O, L, dO)
        got_q = np.zeros_like(dQ)
        for lo, hi in ((0, 2), (2, 7), (7, 9)):      # uneven key blocks
            mask = nc.causal(-lo) if causal else None    # the block's keys start at lo: j + lo <= i
            blk = nc.library.attention(q=q, x=x, d=d, mask=mask, logsumexp=True) if causal else fwd
            bq, bk, bv = nc.evaluate(backward_diagram(blk.unrelabelled()), Q, K[lo:hi], V[lo:hi], O, L, dO)
            got_q += bq
            assert np.abs(bk - dK[lo:hi]).max() < 1e-12 and np.abs(bv - dV[lo:hi]).max() < 1e-12
        assert np.abs(got_q - dQ).max() < 1e-12


def test_backward_step_work_and_link_bytes():
    hw = nc.hardware.H200
    ring = nc.library.attention(q=q, x=x, d=d).tile(q, DEVICES).stream(x, DEVICES)
    rate, b, bw = hw.rate("tensor", "f32"), 4, hw.link_bandwidth
    for world, rows in ((2, 4096), (4, 4096), (2, 128)):
        sizes = {q: world * rows, x: 1 << 16, d: 64, DEVICES: world}
        f, t = nc.cost(ring).devices(hw, sizes), backward_device_time(ring, hw, sizes)
        flops = 10 * rows * ((1 << 16) // world) * 64 / rate
        assert abs(t.compute_step - flops) / flops < 0.05                   # exp and elementwise ride along
        block = 2 * ((1 << 16) // world) * 64 * b                            # a K and a V block, bytes
        assert abs(t.link_bytes_per_device - (2 * world - 1) * block) < 1e-6    # blocks P-1 times, accumulators P
        assert abs(t.link_step - 2 * (block / bw + hw.link_latency)) < 1e-12
        assert t.bandwidth_bound == (t.link_step > t.compute_step)
    crossover = 4 * rate * b / (10 * bw)
    assert abs(crossover / (rate * b / (2 * bw)) - 0.8) < 1e-12
