"""Loop nests across several memory levels: a tile at L2 stages inputs there once per group,
the SMEM groups inside reload from L2, and the cost splits transfers by the level they cross."""

import numpy as np
import pytest
import sympy as sp

import napkin_cat as nc
from napkin_cat.relabel.loopnest import Load, Store
from napkin_cat.relabel.symbols import size_symbol as S


def test_l2_tile_makes_hbm_traffic_compulsory_for_attention():
    q, x, d, h = nc.axes("q x d h")
    attn = nc.library.attention(q=q, x=x, d=d, heads=h)
    f = attn.tile(h, "g_h", level="L2").tile(h, 1).stream(x, "s_x").tile(q, "g_q")
    c = nc.cost(f)
    # each head's Q, K, V cross HBM once, O once: the re-reads by the query tiles hit L2
    assert sp.simplify(c.transfers["HBM"] - (2 * S("d") * S("h") * S("q") + 2 * S("d") * S("h") * S("x"))) == 0
    assert sp.simplify(c.transfers["L2"] - (2 * S("d") * S("h") * S("q") + 2 * S("d") * S("h") * S("q") * S("x") / S("g_q"))) == 0
    # a group of g_h heads keeps Q, K, V and the staged O in L2
    assert sp.simplify(c.memory["L2"] - S("g_h") * (2 * S("d") * S("q") + 2 * S("d") * S("x"))) == 0
    nodes = [n for n, _ in f.loop_nest().walk()]
    assert [n.level for n in nodes if isinstance(n, Load) and n.var == 1] == ["L2", "SMEM"]
    assert [(n.level, n.dst, n.flush) for n in nodes if isinstance(n, Store)] == [("SMEM", "L2", False),
                                                                                 ("L2", "HBM", True)]


def test_l2_tile_of_matmul_rows_reads_b_once_per_row_panel():
    a, b, c = nc.axes("a b c")
    mm = nc.library.matmul(a=a, b=b, c=c)
    f = mm.tile(a, "G", level="L2").tile(a, "g_a").tile(c, "g_c").stream(b, "s_b")
    t = nc.cost(f).transfers
    A, B, C, G = S("a"), S("b"), S("c"), S("G")
    assert sp.simplify(t["HBM"] - (A * B + B * C * A / G + A * C)) == 0
    assert sp.simplify(t["L2"] - (A * B * C / S("g_c") + A * B * C / S("g_a") + A * C)) == 0


@pytest.mark.slow
def test_multilevel_nest_executes_like_the_diagram():
    q, x, d, h = nc.axes("q x d h")
    attn = nc.library.attention(q=q, x=x, d=d, heads=h, causal=True)
    f = attn.tile(h, 2, level="L2").tile(h, 1).stream(x, 3).tile(q, 4)
    report = nc.check_equivalent(attn, f, examples=20, progress=False)
    assert report.examples == 20


def test_levels_above_smem_do_not_lower():
    q, x, d, h = nc.axes("q x d h")
    f = nc.library.attention(q=q, x=x, d=d, heads=h).tile(h, 2, level="L2").stream(x, 4).tile(q, 4)
    with pytest.raises(nc.LoweringError, match="level L2"):
        nc.lower(f.bind({q: 8, x: 8, d: 4, h: 4}))


def test_params_are_staged_through_l2_like_inputs():
    t, dm, f = nc.axes("t dm f")
    g = nc.Builder()
    X = g.input("X", t, dm)
    W1, W2 = g.param("W1", dm, f), g.param("W2", f, dm)
    mlp = g.diagram(g.contract(g.map("gelu", g.contract(X, W1, out=(t, f))), W2, out=(t, dm), name="Y"))
    staged = mlp.tile(t, "G", level="L2").tile(t, "g_t").stream(f, "s_f")
    c = nc.cost(staged)
    T, DM, F, G, g_t = S("t"), S("dm"), S("f"), S("G"), S("g_t")
    # the weights cross HBM once per L2 group of G rows, and L2 once per SMEM tile of g_t rows
    assert sp.simplify(c.transfers["HBM"] - (2 * T * DM + 2 * DM * F * T / G)) == 0
    assert sp.simplify(c.transfers["L2"] - (2 * T * DM + 2 * DM * F * T / g_t)) == 0
    # an L2 group holds its X rows, its staged Y rows and both weights whole
    assert sp.simplify(c.memory["L2"] - (2 * G * DM + 2 * DM * F)) == 0
    text = staged.loop_nest().pseudocode(memory=False)
    assert "load param W1[dm f] -> L2" in text and "load param W1[dm s_f] L2 -> SMEM" in text
    rng = np.random.default_rng(1)
    x, w1, w2 = rng.standard_normal((9, 4)), rng.standard_normal((4, 6)), rng.standard_normal((6, 4))
    want = nc.evaluate(mlp, x, params={"W1": w1, "W2": w2}, sizes={"f": 6})
    got = nc.evaluate(mlp.tile(t, 4, level="L2").tile(t, 2).stream(f, 4), x, params={"W1": w1, "W2": w2},
                      sizes={"f": 6})
    assert np.allclose(got, want)
