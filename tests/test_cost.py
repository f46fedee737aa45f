"""The cost model on diagrams the paper does not name, against hand counts."""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import lru_cache

import pytest
import sympy as sp

import napkin_cat as nc
from napkin_cat.core import Box, Ty
from napkin_cat.costmodel import COST_RULES, box_work
from napkin_cat.core.hardware import A100_SXM4, H100, H200
from napkin_cat.core.hierarchy import hierarchy
from napkin_cat.ops.index import IntAlgebra
from napkin_cat.ops.kinds import SPECS
from napkin_cat.ops.semantics import NUMPY_RULES
from napkin_cat.relabel.symbols import size_symbol

q, x, d, h, G = (size_symbol(n) for n in ("q", "x", "d", "h", "G"))
a, b, c, e = (size_symbol(n) for n in "abce")
t, i, o = (size_symbol(n) for n in "tio")
g_q, s_x, g_h, t_G = (size_symbol(n) for n in ("g_q", "s_x", "g_h", "t_G"))
g_a, s_b, g_t, g_o, s_i = (size_symbol(n) for n in ("g_a", "s_b", "g_t", "g_o", "s_i"))
Q, X, D, H, GR = nc.axes("q x d h G")


@lru_cache(maxsize=None)
def flash():
    return nc.cost(nc.library.attention(q=Q, x=X, d=D).stream(X, "s_x").tile(Q, "g_q"))


@lru_cache(maxsize=None)
def matmul_cost():
    A, B, C = nc.axes("a b c")
    return nc.cost(nc.library.matmul(a=A, b=B, c=C).tile(A, "g_a").tile(C, "g_c").stream(B, "s_b"))


def chain():
    """D[a e] = (A[a b] B[b c]) C[c e], contracted in two steps."""
    A_, B_, C_, E_ = nc.axes("a b c e")
    g = nc.Builder()
    Am, Bm, Cm = g.input("A", A_, B_), g.input("B", B_, C_), g.input("C", C_, E_)
    AB = g.contract(Am, Bm, out=(A_, C_), name="AB")
    return g.diagram(g.contract(AB, Cm, out=(A_, E_), name="D")), (A_, B_, C_, E_)


# --------------------------------------------------------------------------- tables

def test_cost_rules_keys_match_numpy_rules():
    assert set(COST_RULES) == set(NUMPY_RULES)


def test_cost_rules_keys_match_kind_specs():
    assert list(COST_RULES) == list(SPECS)


def test_unknown_kind_is_named():
    box = Box("bogus", Ty(), Ty())
    with pytest.raises(nc.UnknownKindError, match="bogus"):
        box_work(box, lambda names: 1)


def test_cost_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        flash().transfers = {}


# --------------------------------------------------------------------------- hand counts

def test_linear_epilogue_tiled_and_streamed_hand_count():
    T, I, O = nc.axes("t i o")
    cost = nc.cost(nc.library.linear(t=T, i=I, o=O).tile(T, "g_t").tile(O, "g_o").stream(I, "s_i"))
    # X once per column tile of W, W once per row tile of X, bias per group, Y written once
    assert cost.transfers["HBM"] == t * i * o / g_o + t * i * o / g_t + t * o / g_t + t * o
    assert cost.memory["SMEM"] == g_t * g_o + g_t * s_i + s_i * g_o + g_o
    assert cost.flops["tensor"] == 2 * t * i * o
    assert cost.flops["fma"] == t * o          # the bias add
    assert cost.flops["exp"] == t * o          # gelu on the special-function unit
    # the same diagram with integer sizes
    T, I, O = nc.axes("t i o", t=256, i=512, o=1024)
    fixed = nc.cost(nc.library.linear(t=T, i=I, o=O).tile(T, 64).tile(O, 128).stream(I, 32))
    assert fixed.transfers["HBM"] == 1_048_576 + 2_097_152 + 4_096 + 262_144
    assert fixed.transfers["HBM"] == cost.transfers["HBM"].subs({t: 256, i: 512, o: 1024, g_t: 64, g_o: 128})


def test_unrelabelled_linear_materialises_every_box():
    T, I, O = nc.axes("t i o")
    cost = nc.cost(nc.library.linear(t=T, i=I, o=O))
    # contract reads X, W and writes Y; add reads Y, bias and writes; gelu reads and writes
    assert cost.transfers == {"HBM": t * i + i * o + t * o + (t * o + o + t * o) + 2 * t * o}


def test_naive_attention_materialises_scores_at_hbm():
    naive = nc.cost(nc.library.attention(q=Q, x=X, d=D))
    assert naive.transfers["HBM"] == 2 * q * d + 2 * x * d + 6 * q * x
    # the streamed and tiled form moves no q*x array
    assert flash().transfers["HBM"] == 2 * q * d + 2 * q * x * d / g_q
    assert not any(m.array in ("S", "P") for m in flash().moves if m.upper == "HBM")


def test_gqa_hand_count():
    gqa = nc.library.attention(q=Q, x=X, d=D, groups=GR, heads=H).stream(X, "s_x").tile(Q, "g_q")
    cost = nc.cost(gqa)
    # every query group of a head shares its K, V: loaded once per query tile
    assert cost.transfers["HBM"] == 2 * G * h * q * d + 2 * h * x * d * q / g_q
    assert cost.memory["SMEM"] == 2 * G * h * d * g_q + 2 * h * d * s_x
    split = nc.cost(gqa.tile(GR, "t_G"))
    assert split.transfers["HBM"] == 2 * G * h * q * d + 2 * h * x * d * q * G / (g_q * t_G)


def test_multihead_hand_count():
    mha = nc.cost(nc.library.attention(q=Q, x=X, d=D, heads=H).stream(X, "s_x").tile(Q, "g_q").tile(H, "g_h"))
    # K, V have the head axis: a head tile partitions them, so g_h does not cut the reloads
    assert mha.transfers["HBM"] == 2 * q * h * d + 2 * x * q * h * d / g_q
    assert mha.memory["SMEM"] == 2 * d * g_h * g_q + 2 * d * g_h * s_x
    # multi-query (K, V shared by the heads): the NAPKIN multi-head formula
    mqa = nc.cost(nc.library.attention(q=Q, x=X, d=D, groups=H).stream(X, "s_x").tile(Q, "g_q").tile(H, "g_h"))
    assert mqa.transfers["HBM"] == 2 * q * h * d + 2 * x * q * h * d / (g_q * g_h)
    # both have the bound 2hqd + 4hxqd^2/M
    for cost in (mha, mqa):
        assert cost.closed_form("SMEM").expr == 2 * h * q * d + 4 * h * x * q * d ** 2 / size_symbol("M_SMEM")


def test_three_matrix_chain_hand_count():
    dg, (A_, B_, C_, E_) = chain()
    cost = nc.cost(dg.tile(A_, "g_a").stream(B_, "s_b"))
    # A streamed once; B and the resident C reloaded per row tile of A; D written once
    assert cost.transfers["HBM"] == a * b + b * c * a / g_a + c * e * a / g_a + a * e
    assert cost.flops == {"tensor": 2 * a * b * c + 2 * a * c * e, "fma": 0, "exp": 0}
    # C (c*e), the AB state (g_a*c), then either the chunks of A and B or the D tile
    assert cost.memory["SMEM"] == sp.Max(c * e + c * g_a + e * g_a, c * e + c * g_a + c * s_b + g_a * s_b)
    at = cost.subs({"a": 256, "b": 128, "c": 64, "e": 32, "g_a": 32, "s_b": 16})
    assert at.transfers["HBM"] == 32768 + 65536 + 16384 + 8192
    assert at.memory["SMEM"] == 5632
    # the resident C is a lower-order memory term: the closed form keeps (c + e) g_a
    cf = cost.closed_form("SMEM")
    assert cf.betas == (0, 1)
    assert sp.simplify(cf.alphas[1] - a * c * (b + e) * (c + e)) == 0


def test_symbolic_and_integer_sizes_agree():
    q_, x_, d_ = nc.axes("q x d", q=256, x=512, d=64)
    fixed = nc.cost(nc.library.attention(q=q_, x=x_, d=d_).stream(x_, 32).tile(q_, 64))
    sym = flash().subs({"q": 256, "x": 512, "d": 64, "g_q": 64, "s_x": 32})
    assert fixed.transfers == sym.transfers
    assert fixed.memory == sym.memory
    assert fixed.flops == sym.flops
    assert fixed.transfers["HBM"] == 2 * 256 * 64 + 2 * 256 * 512 * 64 // 64


def test_online_softmax_flops():
    f = flash().flops
    assert f["tensor"] == 4 * q * x * d
    assert f["exp"] == q * x + q * x / s_x             # p = exp(s - mu) and one rescale per chunk
    assert flash().intensity.free_symbols <= {q, x, d, g_q, s_x}


def test_mixed_precision_bytes():
    mixed = {"K": nc.fp8_e4m3, "V": nc.f16}
    hbm = flash().bytes("HBM", mixed)
    assert sp.expand(hbm - (4 * q * d + 4 * q * d + (1 + 2) * x * d * q / g_q)) == 0
    assert flash().bytes("HBM", nc.f16) == 2 * flash().transfers["HBM"]
    assert flash().memory_bytes("SMEM", mixed) == 4 * d * g_q * 2 + (1 + 2) * d * s_x


# --------------------------------------------------------------------------- optimisation

def test_sizes_that_do_not_fit_raise():
    with pytest.raises(nc.CostError) as err:
        flash().optimize({Q: 8192, X: 8192, D: 100_000}, hw=H100, dtype=nc.f16)
    msg = str(err.value)
    for part in ("SMEM", "232448", "'d': 100000", "f16"):
        assert part in msg
    # streaming alone keeps all of Q resident
    streamed = nc.cost(nc.library.attention(q=Q, x=X, d=D).stream(X, "s_x"))
    with pytest.raises(nc.CostError, match="nothing fits SMEM"):
        streamed.optimize({Q: 8192, X: 8192, D: 128}, hw=H100, dtype=nc.f16)


def test_missing_sizes_raise():
    with pytest.raises(nc.CostError, match="sizes missing"):
        flash().optimize({Q: 8192}, memory=65536)


def _brute(cost, sizes, memory):
    syms = sorted(cost.blocks)
    bounds = []
    for n in syms:
        (op, axis), = cost.blocks[n]
        bounds.append(range(1, sizes[axis] + 1))
    sub = {size_symbol(k): v for k, v in sizes.items()}
    obj = sp.lambdify([size_symbol(n) for n in syms], cost.objective("SMEM").subs(sub))
    mem = sp.lambdify([size_symbol(n) for n in syms], cost.memory["SMEM"].subs(sub))
    return min(obj(*v) for v in itertools.product(*bounds) if mem(*v) <= memory)


@pytest.mark.parametrize("sizes,memory", [({"a": 24, "b": 16, "c": 40}, 200), ({"a": 30, "b": 7, "c": 9}, 57)])
def test_exact_search_matches_brute_force(sizes, memory):
    best = matmul_cost().optimize(sizes, memory=memory, usable=False)
    assert best.exhaustive
    assert float(best.objective) == pytest.approx(_brute(matmul_cost(), sizes, memory), rel=1e-12)
    assert best.memory["SMEM"] <= memory


def test_optimize_respects_require():
    A, B, C = nc.axes("a b c")
    dg = nc.library.matmul(a=A, b=B, c=C).require(A, 64).require(C, 32)
    cost = nc.cost(dg.tile(A, "g_a").tile(C, "g_c").stream(B, "s_b"))
    best = cost.optimize({A: 4096, B: 4096, C: 4096}, memory=65536, usable=False)
    assert best.tiles["g_a"] % 64 == 0 and best.tiles["g_c"] % 32 == 0
    # the best over multiples: brute force on the multiples with s_b = 1
    brute = min((4096 ** 3 * (sp.Rational(1, ga) + sp.Rational(1, gc)), ga, gc)
                for ga in range(64, 4097, 64) for gc in range(32, 4097, 32) if ga * gc + ga + gc <= 65536)
    assert (best.tiles["g_a"], best.tiles["g_c"]) == brute[1:]
    with pytest.raises(nc.CostError, match="multiple of 64"):
        cost.optimize({A: 4096, B: 4096, C: 4096}, memory=65536, fixed={"g_a": 100})


def test_optimize_divides_and_ragged_transfers():
    best = flash().optimize({Q: 8192, X: 8192, D: 128}, memory=65536, fixed={"s_x": 64}, divides=True)
    assert best.tiles["g_q"] == 128 and 8192 % best.tiles["g_q"] == 0
    assert best.transfers_ragged["HBM"] == best.transfers["HBM"]
    loose = flash().optimize({Q: 8192, X: 8192, D: 128}, memory=65536, fixed={"s_x": 64})
    # 8192 / 192 groups: the model counts 42.67 reloads of K and V, a kernel runs 43
    assert loose.transfers_ragged["HBM"] == 2 * 8192 * 128 + 43 * 2 * 8192 * 128
    assert loose.transfers_ragged["HBM"] > loose.transfers["HBM"]


def test_optimize_with_hardware_capacity_in_bytes():
    best = flash().optimize({Q: 8192, X: 8192, D: 128}, hw=H100, dtype=nc.f16, fixed={"s_x": 64}, usable=False)
    assert best.memory_bytes["SMEM"] <= H100.smem_per_block_optin
    assert best.tiles["g_q"] == (227 * 1024 // 2 - 2 * 128 * 64) // (2 * 128)
    assert best.unit == "bytes" and best.gap >= 1


def test_closed_form_exponents_and_bound_is_below_every_optimum():
    assert matmul_cost().closed_form("SMEM").betas == (0, sp.Rational(1, 2))
    assert flash().closed_form("SMEM").betas == (0, 1)
    for M in (4096, 20000, 65536):
        for cost, sizes in ((matmul_cost(), {"a": 1024, "b": 1024, "c": 1024}),
                            (flash(), {"q": 2048, "x": 2048, "d": 64})):
            best = cost.optimize(sizes, memory=M)
            assert best.bound <= best.objective
            assert best.gap == pytest.approx(float(best.objective) / float(best.bound))


# --------------------------------------------------------------------------- quantization

def _tiling(cost, sizes, dtype):
    best = cost.optimize(sizes, hw=H100, dtype=dtype, usable=False)   # the paper's optimum: every integer
    alphas, betas = cost.closed_form("SMEM")
    fixed = float(alphas[0].subs({size_symbol(k): v for k, v in sizes.items()}))
    return (float(best.objective) - fixed * dtype.bytes)


def test_quantization_factors():
    q_ = size_symbol("nbytes")
    att_terms = sp.Add.make_args(flash().optimum_bytes())
    assert sorted(sp.simplify(term.subs(q_, 4) / term.subs(q_, 2)) for term in att_terms) == [2, 4]
    mm_terms = sp.Add.make_args(matmul_cost().optimum_bytes())
    assert sorted((sp.simplify(term.subs(q_, 4) / term.subs(q_, 2)) for term in mm_terms), key=float) == \
        [2, 2 * sp.sqrt(2)]
    # the exact integer optimum follows: f32 -> f16 divides the tiling terms by ~4 and ~2^1.5
    att = {"q": 8192, "x": 8192, "d": 128}
    assert _tiling(flash(), att, nc.f32) / _tiling(flash(), att, nc.f16) == pytest.approx(4, rel=0.01)
    mm = {"a": 4096, "b": 4096, "c": 4096}
    assert _tiling(matmul_cost(), mm, nc.f32) / _tiling(matmul_cost(), mm, nc.f16) == \
        pytest.approx(2 ** 1.5, rel=0.01)


# --------------------------------------------------------------------------- hardware, time, levels

def test_hardware_profiles():
    assert H100.tensor_rate("f16") == pytest.approx(989.4e12, rel=1e-4)
    assert H100.tensor_rate("fp8_e4m3") == pytest.approx(1978.9e12, rel=1e-4)
    assert H100.vector_rate("f32") == pytest.approx(66.9e12, rel=1e-3)
    assert A100_SXM4.tensor_rate("f16") == pytest.approx(312e12, rel=1e-2)
    assert (H100.smem_per_sm, H100.smem_per_block_static, H100.smem_per_block_optin) == (228 * 1024, 48 * 1024, 227 * 1024)
    assert (A100_SXM4.smem_per_sm, A100_SXM4.smem_per_block_optin) == (164 * 1024, 163 * 1024)
    assert H200.hbm_bandwidth == 4.8e12 and A100_SXM4.hbm_bandwidth == 2.039e12
    assert nc.hardware.H100 is nc.hardware.H100_SXM5
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100.sms = 1


def test_roofline_time():
    sizes = {Q: 8192, X: 8192, D: 128}
    t100 = flash().time(H100, sizes, dtype=nc.f16)
    t200 = flash().time(H200, sizes, dtype=nc.f16)
    assert t200.seconds <= t100.seconds
    for tm in (t100, t200):
        assert tm.seconds == max([*tm.compute.values(), *tm.memory.values()])
        assert tm.flops == 4 * 8192 * 8192 * 128 + int(flash().flops["fma"].subs(
            {q: 8192, x: 8192, d: 128, s_x: tm.tiles["s_x"], g_q: tm.tiles["g_q"]})) + int(
            flash().flops["exp"].subs({q: 8192, x: 8192, s_x: tm.tiles["s_x"]}))
        assert tm.occupancy >= 1


def test_occupancy_split():
    occ = flash().occupancy(H100, {Q: 8192, X: 8192, D: 128, "g_q": 128, "s_x": 64}, dtype=nc.f16)
    assert (occ.group, occ.block) == (2 * 128 * 128 * 2, 2 * 64 * 128 * 2)
    assert occ.ratio == sp.Rational(228 * 1024 - occ.block, occ.group)


def test_multilevel_weighted_sum():
    sizes = {"q": 8192, "x": 8192, "d": 128}
    ml = flash().multilevel(sizes, H100, nc.f16, hierarchy(l2=True))
    assert set(ml.levels) == {"L2", "SMEM", "registers"}
    for lv, row in ml.levels.items():
        assert row["M"] == H100.capacity(lv) // 2
        assert row["seconds"] == pytest.approx(2 * float(row["H"]) / row["bandwidth"])
        assert row["H"] >= row["H_closed"]
    assert ml.seconds == pytest.approx(sum(r["seconds"] for r in ml.levels.values()))
    # a cluster of 1 changes nothing: (1/bw - 1/bw_1) H(M) + H(M)/bw_1 = H(M)/bw
    one = flash().multilevel(sizes, H100, nc.f16, hierarchy(l2=True, cluster=True), cluster=1)
    row = one.levels["SMEM"]
    assert row["seconds"] == pytest.approx(2 * float(row["H"]) / row["bandwidth"])


def test_cross_transfer_theorem():
    cost = flash()
    sizes = {"q": 8192, "x": 8192, "d": 128}
    Mc, slow, fast = 65536, sp.Rational(1, 2), sp.Rational(1, 3)
    alphas, betas = cost.closed_form()
    plain = slow * cost.closed_form().at(Mc, cost._subs(sizes))
    for N in (1, 2, 4):
        saving = plain - cost.cross_transfer(Mc, N, slow, fast, sizes=sizes)
        expect = (slow - fast) * sum(al.subs(cost._subs(sizes)) * sp.Integer(Mc) ** (-be) * (1 - sp.Integer(N) ** (-be))
                                     for al, be in zip(alphas, betas))
        assert sp.simplify(saving - expect) == 0
    # N = 2 moves half of the beta = 1 term to the cheaper cluster price
    half = (slow - fast) * alphas[1].subs(cost._subs(sizes)) / Mc / 2
    assert sp.simplify(plain - cost.cross_transfer(Mc, 2, slow, fast, sizes=sizes) - half) == 0


def test_cost_entry_points_reject_bad_input_by_name():
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q=q, x=x, d=d)
    with pytest.raises(nc.CostError, match="needs a Diagram, got str"):
        nc.cost("attention")
    with pytest.raises(nc.CostError, match=r"time needs every axis size: \['d', 'x'\]"):
        nc.cost(attn).time(hw=nc.hardware.H200, sizes={q: 10})


# --------------------------------------------------------------------------- chunks a mask skips

def _masked(pred, rows, cols, g, s):
    """Attention (d = 8) with mask ``pred`` over q (``rows``, tiles of ``g``) and x (``cols``,
    chunks of ``s``); ``rows = cols = None`` keeps q, x and d symbolic."""
    if rows is None:
        return nc.library.attention(q=Q, x=X, d=D, mask=pred).stream(X, s).tile(Q, g)
    q_, x_, d_ = nc.axes("q x d", q=rows, x=cols, d=8)
    return nc.library.attention(q=q_, x=x_, d=d_, mask=pred).stream(x_, s).tile(q_, g)


def _visited(pred, N, X, g, s):
    """Per row tile: its rows and the widths of the chunks it visits, iterating row tiles and
    chunks as the tiled executor does, on plain ints (independent of the cost model's code)."""
    out = []
    for r0 in range(0, N, g):
        r1 = min(r0 + g, N)
        lo, hi = pred.support(r0, r1, IntAlgebra)
        widths = [min(c + s, X) - c for c in range(0, X, s) if not (c + s <= lo or c >= hi)]
        out.append((r1 - r0, widths))
    return out


def _kv_values(cost):
    """Values of K and V loaded into SMEM: (model's continuous count, whole-tile count)."""
    kv = [m for m in cost.moves if m.array in ("K", "V") and m.kind == "load"]
    return sum(m.per_exec * m.execs for m in kv), sum(m.per_exec * m.ragged_execs for m in kv)


SKIP_CASES = [  # (predicate, N rows, X columns, row tile g, chunk s): aligned and ragged
    (nc.causal(), 64, 64, 16, 8),
    (nc.causal(), 64, 64, 8, 16),
    (nc.causal(), 100, 100, 24, 16),
    (nc.causal(3), 50, 90, 16, 7),
    (nc.causal(-7), 90, 50, 32, 10),
    (nc.window(13), 100, 77, 32, 10),
    (nc.window(0, 5), 70, 70, 8, 8),
]


@pytest.mark.parametrize("pred,N,X,g,s", SKIP_CASES)
def test_skipped_chunks_are_counted_exactly_at_bound_sizes(pred, N, X, g, s):
    cost = nc.cost(_masked(pred, N, X, g, s))
    tiles = _visited(pred, N, X, g, s)
    cols = [sum(w) for _, w in tiles]
    cont, whole = _kv_values(cost)
    # a K / V chunk is loaded whole by every tile that visits it (a short tile too) ...
    assert whole == 2 * 8 * sum(cols)
    # ... and the model's continuous count weighs a tile by its share of g rows, as elsewhere
    assert cont == 2 * 8 * sum(sp.Rational(r, g) * c for (r, _), c in zip(tiles, cols))
    # Q K^T and P V: 2 * rows * visited columns * d each, over the visited chunks only
    assert cost.flops["tensor"] == sum(4 * r * c * 8 for (r, _), c in zip(tiles, cols))
    dense = nc.cost(_masked(nc.predicate(lambda i, j: j >= 0), N, X, g, s))
    assert cost.flops["tensor"] <= dense.flops["tensor"] == 4 * N * X * 8


@pytest.mark.parametrize("pred,N,X,g,s", SKIP_CASES + [(nc.causal(), 8192, 8192, 128, 64),
                                                     (nc.causal(), 8000, 8000, 96, 40),
                                                     (nc.window(256), 8192, 8192, 128, 64),
                                                     (nc.window(300), 5000, 6000, 64, 128)])
def test_skipped_chunks_symbolic_form_within_its_error_bound(pred, N, X, g, s):
    """The symbolic form (sizes as symbols, then substituted) against the exact count.  Its
    error, in K columns summed over the tiles, is at most s per chunk-aligned bound (lo and hi)
    per tile (the padding p = (s - Min(g, s))/2 is an average), g/8 per kink of a clipped bound,
    and one tile of columns when g does not divide N (the partial last tile)."""
    sym = nc.cost(_masked(pred, None, None, "g_q", "s_x"))
    sub = {q: N, x: X, d: 8, g_q: g, s_x: s}
    approx = _kv_values(sym)[0].subs(sub) / 16
    exact = _kv_values(nc.cost(_masked(pred, N, X, g, s)))[0] / 16
    tiles = math.ceil(N / g)
    assert abs(approx - exact) <= 2 * s * tiles + g / 4 + (X if N % g else 0)
    if N >= 5000 and all(a % min(g, s) == 0 for a in pred.args):
        # long sequences, offsets on multiples of Min(g, s) (where p is the exact average): 1 %
        assert abs(approx / exact - 1) < 0.01


def test_causal_attention_costs_half_of_dense():
    causal = nc.cost(nc.library.attention(q=Q, x=X, d=D, causal=True).stream(X, "s_x").tile(Q, "g_q"))
    N = 1 << 16
    sub = {q: N, x: N, d: 128, g_q: 128, s_x: 64}
    kv = lambda c: c.transfers["HBM"] - 2 * q * d     # K and V: Q read once, O written once
    assert float((kv(causal) / kv(flash())).subs(sub)) == pytest.approx(0.5, abs=0.002)
    for unit in ("tensor", "exp"):
        assert float((causal.flops[unit] / flash().flops[unit]).subs(sub)) == pytest.approx(0.5, abs=0.002)
    # bound sizes, s dividing g: tile t visits (t + 1) g / s chunks of the dense n / s
    q_, x_, d_ = nc.axes("q x d", q=4096, x=4096, d=64)
    bound = lambda causal: nc.cost(nc.library.attention(q=q_, x=x_, d=d_, causal=causal).stream(x_, 64).tile(q_, 128))
    T = 4096 // 128
    assert bound(True).flops["tensor"] / bound(False).flops["tensor"] == sp.Rational(T + 1, 2 * T)


def test_window_attention_scales_with_the_window_not_the_length():
    win = {w: nc.cost(nc.library.attention(q=Q, x=X, d=D, window_size=w).stream(X, "s_x").tile(Q, "g_q"))
           for w in (256, 512, 1024)}
    N = 1 << 16
    sub = {q: N, d: 64, g_q: 128, s_x: 64}
    # keys beyond the last query row are never visited: the cost does not grow with x
    for c in win.values():
        at = [c.transfers["HBM"].subs({**sub, x: n}) for n in (N + 128, 2 * N, 1 << 24)]
        assert at[0] == at[1] == at[2]
        assert c.flops["tensor"].subs({**sub, x: 2 * N}) == c.flops["tensor"].subs({**sub, x: 1 << 24})
    # ... and grows with w: every query tile visits w more columns of K and V (but the first
    # w / g tiles, whose window the sequence start cuts)
    kv = {w: c.transfers["HBM"].subs({**sub, x: N}) for w, c in win.items()}
    per_column = 2 * 64 * N // 128
    assert kv[512] - kv[256] == pytest.approx(256 * per_column, rel=0.01)
    assert kv[1024] - kv[512] == pytest.approx(512 * per_column, rel=0.02)
    assert float(kv[256] / flash().transfers["HBM"].subs({**sub, x: N})) < 0.01


def test_diagrams_without_skipped_chunks_cost_as_before():
    dense = flash()
    assert dense.transfers["HBM"] == 2 * q * d + 2 * q * x * d / g_q
    # a mask without a support, or a causal mask without a tile of its rows, bounds no chunk
    custom = nc.cost(nc.library.attention(q=Q, x=X, d=D, mask=nc.predicate(lambda i, j: j <= i))
                     .stream(X, "s_x").tile(Q, "g_q"))
    untiled = nc.cost(nc.library.attention(q=Q, x=X, d=D, causal=True).stream(X, "s_x"))
    streamed = nc.cost(nc.library.attention(q=Q, x=X, d=D).stream(X, "s_x"))
    assert custom.transfers == dense.transfers
    assert custom.flops["tensor"] == dense.flops["tensor"]
    assert untiled.transfers == streamed.transfers
    assert untiled.flops["tensor"] == streamed.flops["tensor"]


def test_skipped_chunks_have_no_closed_form_but_optimize():
    causal = nc.cost(nc.library.attention(q=Q, x=X, d=D, causal=True).stream(X, "s_x").tile(Q, "g_q"))
    with pytest.raises(nc.CostError, match="no closed form"):
        causal.closed_form("SMEM")
    best = causal.optimize({Q: 8192, X: 8192, D: 128}, memory=65536, fixed={"s_x": 64})
    dense = flash().optimize({Q: 8192, X: 8192, D: 128}, memory=65536, fixed={"s_x": 64})
    assert best.bound is None and best.memory["SMEM"] <= 65536
    assert best.objective < dense.objective


# --------------------------------------------------------------------------- parameters are costed

DM, F = nc.axes("dm f")
dm, f = size_symbol("dm"), size_symbol("f")
g_t, s_f, g_c = size_symbol("g_t"), size_symbol("s_f"), size_symbol("g_c")


def mlp(weights_as_params: bool = True):
    """Y[t dm] = gelu(X W1) W2, the weights declared with Builder.param (or as inputs)."""
    T = nc.Axis("t")
    g = nc.Builder()
    X = g.input("X", T, DM)
    if weights_as_params:
        W1, W2 = g.param("W1", DM, F), g.param("W2", F, DM)
    else:
        W1, W2 = g.input("W1", DM, F), g.input("W2", F, DM)
    H_ = g.contract(X, W1, out=(T, F), name="H")
    return g.diagram(g.contract(g.map("gelu", H_, name="A"), W2, out=(T, DM), name="Y")), T


def test_params_are_in_the_signature():
    dg, _ = mlp()
    assert str(dg) == "X[t dm] f32; params W1[dm f] f32, W2[f dm] f32 -> Y[t dm] f32"
    assert dg.short() == "[X[t dm] f32; params W1[dm f] f32, W2[f dm] f32 -> Y[t dm] f32]"
    assert [a.name for a in dg.params] == ["W1", "W2"] and len(dg.dom) == 1
    assert "params" not in str(nc.library.matmul())


def test_mlp_cost_includes_the_weights():
    dg, T = mlp()
    # unrelabelled, every box reads its operands from HBM and writes its result back:
    # H = X W1 reads X (t dm) and W1 (dm f), writes H (t f); gelu reads H, writes A (2 t f);
    # Y = A W2 reads A (t f) and W2 (f dm), writes Y (t dm)
    plain = nc.cost(dg)
    assert plain.transfers["HBM"] == 2 * t * dm + 2 * dm * f + 4 * t * f
    # tiled over t, streamed over f: X read and Y written once; W1 and W2 are shared by the
    # t / g_t row tiles, so each tile re-reads them (dm f values each), a chunk of s_f at a time
    fused = dg.tile(T, "g_t").stream(F, "s_f")
    c = nc.cost(fused)
    assert c.transfers["HBM"] == 2 * t * dm + 2 * dm * f * t / g_t
    assert c.memory["SMEM"] == 2 * dm * g_t + 2 * dm * s_f       # X tile, Y state, a chunk of W1 and of W2
    text = fused.loop_nest().pseudocode(memory=False)
    assert "load param W1[dm s_f] -> SMEM" in text and "load param W2[s_f dm] -> SMEM" in text
    # a parameter costs what an input costs
    inputs, _ = mlp(weights_as_params=False)
    assert nc.cost(inputs.tile(T, "g_t").stream(F, "s_f")).transfers == c.transfers
    assert nc.cost(inputs).transfers == plain.transfers
    # at any size the weights cross HBM at least once: dm f + f dm
    at = c.subs({"t": 4096, "dm": 1024, "f": 4096, "g_t": 4096, "s_f": 64})
    assert at.transfers["HBM"] == 2 * 4096 * 1024 + 2 * 1024 * 4096


def test_params_of_a_tiled_matmul_are_reread_per_tile():
    A_, B_, C_ = nc.axes("a b c")
    g = nc.Builder()
    X = g.input("X", A_, B_)
    dg = g.diagram(g.contract(X, g.param("W", B_, C_), out=(A_, C_), name="Y"))
    tiled = nc.cost(dg.tile(A_, "g_a").tile(C_, "g_c").stream(B_, "s_b"))
    # as for C = A B: X once per column tile of W, W once per row tile of X
    assert tiled.transfers["HBM"] == a * b * c / g_c + a * b * c / g_a + a * c
    assert tiled.transfers == matmul_cost().transfers
    rows = nc.cost(dg.tile(A_, "g_a"))
    assert rows.transfers["HBM"] == a * b + b * c * a / g_a + a * c
    # the relabelled loop nest still computes the diagram with the parameter passed by name
    import numpy as np
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 7)), rng.standard_normal((7, 6))
    sizes = {"c": 6}
    out = nc.evaluate(dg.tile(A_, 2).tile(C_, 4).stream(B_, 3), x, params={"W": w}, sizes=sizes)
    assert np.allclose(out, x @ w)


# --------------------------------------------------------------------------- usable tiles

def test_optimize_returns_usable_tiles_for_attention_at_h100_sizes():
    best = flash().optimize({Q: 8192, X: 8192, D: 128}, hw=H100, dtype=nc.f16)
    assert best.usable and all(v % 16 == 0 for v in best.tiles.values())
    assert best.tiles == {"s_x": 16, "g_q": 128}
    # o[g_q d] over 256 threads is a micro-tile of 64 accumulators per thread: g_q = 144 is not
    assert best.registers["micro per thread"] == 128 * 128 // 256 == best.register_capacity["micro per thread"]
    assert all(best.registers[k] <= best.register_capacity[k] for k in best.registers)
    # the unconstrained optimum (every integer, no register check) and the gap to it
    free = best.unconstrained
    assert free.tiles == {"s_x": 1, "g_q": 453} and not free.usable
    assert best.usable_gap == pytest.approx(float(best.objective) / float(free.objective))
    assert best.usable_gap > 3                # the usable tiles move 3.4 times more into SMEM
    assert free.objective <= best.objective
    assert flash().optimize({Q: 8192, X: 8192, D: 128}, hw=H100, dtype=nc.f16, usable=False).tiles == free.tiles


def test_optimize_returns_usable_tiles_for_matmul_at_h100_sizes():
    sizes = {"a": 4096, "b": 4096, "c": 4096}
    best = matmul_cost().optimize(sizes, hw=H100, dtype=nc.f16)
    assert best.tiles == {"g_a": 128, "g_c": 128, "s_b": 16}
    free = best.unconstrained
    assert any(v % 16 for v in free.tiles.values())          # no kernel runs those
    assert best.usable_gap == pytest.approx(float(best.objective) / float(free.objective))
    assert best.usable_gap > 1 and best.gap >= best.usable_gap * 0.99
    # a require() on top of the granule: multiples of lcm(16, 48) = 48
    A_, B_, C_ = nc.axes("a b c")
    req = nc.cost(nc.library.matmul(a=A_, b=B_, c=C_).require(A_, 48)
                  .tile(A_, "g_a").tile(C_, "g_c").stream(B_, "s_b"))
    assert req.optimize(sizes, hw=H100, dtype=nc.f16).tiles["g_a"] % 48 == 0


def test_registers_refuse_an_impossible_micro_tile():
    sizes = {"a": 4096, "b": 4096, "c": 4096}
    # a 256 x 256 accumulator over 256 threads: 256 values per thread, a 16 x 16 micro-tile
    with pytest.raises(nc.CostError, match="nothing fits the registers") as err:
        matmul_cost().optimize(sizes, hw=H100, dtype=nc.f16, fixed={"g_a": 256, "g_c": 256})
    assert "'micro per thread': 256" in str(err.value) and "usable=False" in str(err.value)
    # over 1024 threads it is 8 x 8 per thread, which fits
    ok = matmul_cost().optimize(sizes, hw=H100, dtype=nc.f16, fixed={"g_a": 256, "g_c": 256}, threads=1024)
    assert ok.registers["micro per thread"] == 64
    # usable=False searches every size and checks no registers
    assert matmul_cost().optimize(sizes, hw=H100, dtype=nc.f16, fixed={"g_a": 256, "g_c": 256},
                                  usable=False).registers is None


def test_cost_and_optimum_html_show_the_levels():
    page = flash()._repr_html_()
    for part in ("<td>HBM</td>", "<td>SMEM</td>", "<td>registers</td>", "capacity", "transfers", "memory",
                 "<td>tensor</td>", "<td>exp</td>", "232,448"):
        assert part in page
    best = flash().optimize({Q: 8192, X: 8192, D: 128}, hw=H100, dtype=nc.f16)
    page = best._repr_html_()
    for part in ("<td>g_q</td><td>128</td><td>453</td>", "<td>SMEM</td>", "<td>registers</td>",
                 "unconstrained", "usable / unconstrained", "micro per thread"):
        assert part in page
    assert "unconstrained optimum s_x=1, g_q=453" in str(best) and repr(best).startswith("<optimum at SMEM")
    assert str(flash()).startswith("transfers (values):") and repr(flash()).startswith("<Cost of Q[q d]")
