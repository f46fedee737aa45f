"""Loop nests across several memory levels: a tile at L2 stages inputs there once per group,
the SMEM groups inside reload from L2, and the cost splits transfers by the level they cross."""

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
