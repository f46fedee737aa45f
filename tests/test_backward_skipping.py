"""Chunk skipping in the FlashAttention-2 backward (napkin_cat/relabel/skipping.py): a sum over
the streamed axis of terms a causal mask zeroes skips the chunks the mask removes, in the
tiled executor, the cost model and the generated kernel alike.  dK / dV stream the queries
(the mask's rows) over a tile of keys: the transposed support starts the stream at the tile's
first key; dQ streams the keys over a tile of queries: the stream ends past the tile's last."""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core.errors import EquivalenceError  # noqa: E402
from napkin_cat.relabel import skipping  # noqa: E402
from napkin_cat.relabel.loopnest import final_form  # noqa: E402
from napkin_cat.verify.kernelcheck import kernel_outcome  # noqa: E402

q, x, d = nc.axes("q x d")


def _backward(which: str, causal: bool = True, **kw):
    fwd = nc.library.attention(q=q, x=x, d=d, causal=causal, logsumexp=True, **kw)
    if which == "kv":
        return fwd, nc.grad_with_residuals(fwd, wrt=["K", "V"]).tile(x, "g_x").stream(q, "s_q")
    return fwd, nc.grad_with_residuals(fwd, wrt=["Q"]).tile(q, "g_q").stream(x, "s_x")


def _skips(dg):
    ff = final_form(dg)
    return [s for lp in ff.loops for s in skipping.chunk_skips(ff, lp)]


def test_backward_sums_derive_the_causal_skip():
    (_, kv), (_, dq) = _backward("kv"), _backward("q")
    assert _skips(kv) == [skipping.Skip("x", "q", nc.causal(), transposed=True)]
    assert _skips(dq) == [skipping.Skip("q", "x", nc.causal())]
    assert _skips(_backward("kv", causal=False)[1]) == []


def test_the_blocks_with_the_most_chunks_are_launched_first():
    """Causal: the forward's later query tiles and the dK, dV kernel's earlier key tiles stream
    the most chunks, and each kernel's first blocks take them (a light-first order left the
    heaviest blocks for the last wave: the causal backward measured slower)."""
    from napkin_cat.lowering import emit, planner
    fwd = nc.library.attention(q=q, x=x, d=d, causal=True, logsumexp=True)
    kv = nc.grad_with_residuals(fwd, wrt=["K", "V"]).tile(x, 8).stream(q, 8)
    sizes = {q: 40, x: 40, d: 4}
    for dia, tiled, heavy_last in ((fwd.stream(x, 8).tile(q, 8), "q", {"q"}), (kv, "x", set())):
        plan = planner.plan_kernel(dia.bind(sizes), "k", 16)
        assert plan.launch.heavy_last == heavy_last
        decode = next(ln.strip() for ln in emit.render(plan)[0].splitlines() if ln.strip().startswith(f"{tiled}0 = "))
        assert decode.startswith(f"{tiled}0 = (U4 - ") == bool(heavy_last), decode   # 5 tiles: the last first


def test_row_support_transposes_causal_and_window():
    from napkin_cat.ops.index import IntAlgebra
    assert nc.causal().row_support(10, 16, IntAlgebra) == (10, None)
    assert nc.causal(2).row_support(10, 16, IntAlgebra) == (8, None)
    lo, hi = nc.window(3, 1).row_support(10, 16, IntAlgebra)     # i - 3 <= j <= i + 1
    assert (lo, hi) == (9, 19)
    # brute force: every kept (i, j) with j in the columns lies in [lo, hi)
    for pred in (nc.causal(), nc.causal(-2), nc.causal(3), nc.window(3, 1), nc.window(0, 2)):
        for c0, c1 in ((0, 4), (5, 11), (13, 20)):
            lo, hi = pred.row_support(c0, c1, IntAlgebra)
            i, j = np.meshgrid(np.arange(40), np.arange(c0, c1), indexing="ij")
            rows = i[np.asarray(pred(i, j))]
            assert rows.size == 0 or (rows.min() >= lo and (hi is None or rows.max() < hi))


def test_a_product_with_an_unmarked_box_stops_the_derivation(monkeypatch):
    """Strict: with ``mul`` no longer keeping a zero, nothing is skipped."""
    from dataclasses import replace

    from napkin_cat.ops import functions
    monkeypatch.setitem(functions.FUNCTIONS, "mul", replace(functions.FUNCTIONS["mul"], keeps_zero=()))
    _, kv = _backward("kv")
    assert _skips(kv) == []     # dK's summand goes through mul; dV's does not, both must skip


@pytest.mark.parametrize("which, tiles", [("kv", {"g_x": 6, "s_q": 5}), ("q", {"g_q": 6, "s_x": 5})])
def test_lowered_causal_backward_matches_the_oracle_ragged(which, tiles):
    fwd, dg = _backward(which)
    sizes = {"q": 13, "x": 13, "d": 4}
    dg = dg.bind(sizes)
    kernel = nc.lower(dg, tiles=tiles, threads=16, verify=False)
    src = kernel.source
    if which == "kv":
        assert "q_begin = " in src and "range(q_begin, N_q, CHUNK_q)" in src
    else:
        assert "x_end = min(" in src
    rng = np.random.default_rng(1)
    f = fwd.bind(sizes)
    ins = [rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in f.dom]
    O, L = nc.evaluate(f, *ins)
    dO = rng.standard_normal(O.shape)
    diff = kernel_outcome(dg.unrelabelled(), kernel, [*ins, O, L, dO])
    assert diff.failure is None, diff.failure


@pytest.mark.parametrize("which", ["kv", "q"])
def test_lowered_causal_backward_is_equivalent(which):
    fwd, dg = _backward(which)
    nc.check_equivalent(dg.unrelabelled(), dg, examples=4, seed=0, lowered=True, max_size=10)


def test_causal_backward_costs_about_half():
    S = {q: 2048, x: 2048, d: 64}
    for which, tiles in (("kv", {"g_x": 64, "s_q": 64}), ("q", {"g_q": 64, "s_x": 64})):
        c = nc.cost(_backward(which)[1].bind({**S, **tiles}))
        dense = nc.cost(_backward(which, causal=False)[1].bind({**S, **tiles}))
        ratio = c.flops["tensor"] / dense.flops["tensor"]
        assert 0.5 < ratio < 0.55, (which, ratio)          # (1 + g/N) / 2
        assert c.transfers["HBM"] < 0.6 * dense.transfers["HBM"]


def test_a_bound_one_chunk_late_is_caught(monkeypatch):
    """A planted bug: the transposed support starts one chunk late; the executor reads it as
    the kernel does, and the check against the oracle fails."""
    real = skipping.Skip.support

    def late(self, r0, r1, al):
        lo, hi = real(self, r0, r1, al)
        return (lo + 5 if self.transposed else lo), hi

    monkeypatch.setattr(skipping.Skip, "support", late)
    _, dg = _backward("kv")
    with pytest.raises(EquivalenceError):
        nc.check_equivalent(dg.unrelabelled(), dg.bind({"s_q": 5}), examples=20, seed=0)
