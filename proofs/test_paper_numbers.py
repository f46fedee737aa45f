"""Every number of ../shared/NAPKIN.md section 4, derived from diagrams.

Each proof builds a diagram with ``nc.library``, relabels it, costs it with ``nc.cost`` and
(where the paper optimises) runs ``Cost.optimize`` or ``Cost.closed_form``; no formula of the
paper is typed in.  Items 7-10 combine what the diagram gives (FLOPs per unit, bytes per
array, memory per group, the closed form) with hardware facts from ``nc.hardware.H100``; the
comments say which is which.  Run with ``-s`` to see what each proof prints.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import sympy as sp

import napkin_cat as nc
from napkin_cat.costmodel import concurrent_groups
from napkin_cat.core.hardware import H100, KB
from napkin_cat.relabel.symbols import size_symbol

Q, X, D = nc.axes("q x d")
A, B, C = nc.axes("a b c")
H = nc.Axis("h")
ATT = {Q: 8192, X: 8192, D: 128}
MM = {A: 4096, B: 4096, C: 4096}


@lru_cache(maxsize=None)
def flash():
    """Attention streamed over the keys, tiled over the queries (symbolic sizes)."""
    return nc.cost(nc.library.attention(q=Q, x=X, d=D).stream(X, "s_x").tile(Q, "g_q"))


@lru_cache(maxsize=None)
def tiled_matmul():
    return nc.cost(nc.library.matmul(a=A, b=B, c=C).tile(A, "g_a").tile(C, "g_c").stream(B, "s_b"))


def _f(x) -> Fraction:
    """An exact fraction of a decimal hardware figure (1.83e9 -> 1830000000)."""
    return Fraction(str(x))


def test_item1_group_partition():
    # a matmul-shaped op, both outputs axes tiled by 128, the contracted axis (64 values per
    # slice) loaded whole: H = (loads of both inputs per group) + (the output written once)
    a, b, c = nc.axes("a b c", a=1024, b=64, c=1024)
    cost = nc.cost(nc.library.matmul(a=a, b=b, c=c).tile(a, 128).tile(c, 128))
    assert cost.transfers["HBM"] == 2_097_152
    print("1. group partition a=b=1024, x=64, y=1, g=128: H =", cost.transfers["HBM"])


def test_item2_matmul_cost():
    cost = tiled_matmul().subs({**MM, "g_a": 128, "g_c": 128, "s_b": 32})
    assert cost.transfers["HBM"] == 1_090_519_040
    assert cost.memory["SMEM"] == 24_576
    print("2. matmul 4096^3, g=128, s_b=32: H =", cost.transfers["HBM"], " M =", cost.memory["SMEM"])


def test_item3_matmul_bound_and_integer_optimum():
    cost = tiled_matmul()
    alphas, betas = cost.closed_form("SMEM")
    assert betas == (0, sp.Rational(1, 2))
    best = cost.optimize(MM, memory=65_536, fixed={"s_b": 1}, usable=False)   # every integer, as the paper
    assert best.bound == 553_648_128
    assert best.tiles["g_a"] == best.tiles["g_c"] == 255
    assert best.objective >= best.bound
    print("3. matmul bound at M=65536:", best.bound, "; best integer tiles with s_b=1:", dict(best.tiles),
          f"H = {float(best.objective):,.0f}")


def test_item4_attention_cost_bound_and_tile():
    cost = flash()
    at = cost.subs({**ATT, "g_q": 128, "s_x": 64})
    assert at.transfers["HBM"] == 136_314_880
    assert at.memory["SMEM"] == 49_152
    best = cost.optimize(ATT, memory=65_536, fixed={"s_x": 64}, usable=False)
    assert best.bound == 69_206_016
    assert best.tiles["g_q"] == 192
    assert round(best.objective) == 91_575_637
    print("4. attention q=x=8192, d=128, g_q=128, s_x=64: H =", at.transfers["HBM"], " M =",
          at.memory["SMEM"], "; bound at M=65536:", best.bound, "; largest g_q with s_x=64:",
          best.tiles["g_q"])


def test_item5_multihead_bound():
    mh = nc.cost(nc.library.attention(q=Q, x=X, d=D, heads=H).stream(X, "s_x").tile(Q, "g_q").tile(H, "g_h"))
    best = mh.optimize({**ATT, H: 32}, memory=65_536, usable=False)
    assert best.bound == 2_214_592_512
    assert best.objective >= best.bound
    print("5. multi-head h=32, M=65536: bound", best.bound, "(closed form", mh.closed_form("SMEM"), ")")


def test_item6_quantization():
    # H*_bytes = sum_t alpha_t M_bytes^-beta_t q^(1+beta_t): the ratio of each term between
    # 4-byte and 2-byte values is 2^(1+beta_t)
    def ratios(cost):
        hb = cost.optimum_bytes("SMEM")
        q = size_symbol("nbytes")
        return {sp.simplify(t.subs(q, 4) / t.subs(q, 2)) for t in sp.Add.make_args(hb)}

    att, mm = ratios(flash()), ratios(tiled_matmul())
    assert att == {2, 4}
    assert mm == {2, 2 * sp.sqrt(2)}
    assert round(float(2 * sp.sqrt(2)), 3) == 2.828
    print("6. FP32 -> FP16: attention terms /", sorted(att), " matmul terms /", sorted(mm, key=float))


def test_item7_h100_compute_bound_threshold():
    # diagram: the closed form H*(M) of the tiled matmul and its tensor FLOPs 2abc;
    # hardware: FP16 dense rate and HBM bandwidth (2 bytes per value)
    cost = tiled_matmul()
    cf = cost.closed_form("SMEM")
    b = size_symbol("b")
    per_flop = cf.expr / cost.flops["tensor"]              # transfers per FLOP
    flop_rate = H100.sms * H100.tensor_per_clk["f16"] * _f(H100.tensor_clock_hz)
    values_rate = _f(H100.hbm_bandwidth) / nc.f16.bytes
    r = sp.Rational(values_rate) / sp.Rational(flop_rate)  # compute-bound iff per_flop <= r
    real = sp.Symbol("real", positive=True)           # thresholds need not be integers
    b_min = sp.solve(sp.Eq(sp.limit(per_flop, cf.M, sp.oo).subs(b, real), r), real)[0]
    M_min = sp.solve(sp.Eq(sp.limit(per_flop, b, sp.oo).subs(cf.M, real), r), real)[0]
    assert round(float(b_min), 2) == 295.35
    assert round(float(M_min) * nc.f16.bytes / 1024, 1) == 681.5
    print(f"7. H100 FP16 matmul compute-bound at HBM only for b >= {float(b_min):.2f} "
          f"and M >= {float(M_min) * 2 / 1024:.1f} KiB")


def _per_row_chunk(cost, **sizes):
    """Ops of the nodes inside the stream loop for one query row (g_q = 1) and one chunk."""
    sub = cost.subs(sizes)
    return [(o, int(o.per_exec)) for o in sub.ops if "x" in o.loops]


def test_item8_hopper_configuration():
    mixed = {"Q": nc.fp8_e4m3, "K": nc.fp8_e4m3, "V": nc.f16, "O": nc.f16}
    cost = flash()
    # diagram: per-warpgroup SMEM = Q tile (fp8) + O accumulator (fp16) = the terms that grow
    # with g_q; per-block SMEM = the K (fp8) and V (fp16) chunks, double-buffered (stages=2,
    # the paper's pipelining); hardware: 228 KB SMEM per SM
    occ = cost.occupancy(H100, {**ATT, "g_q": 128, "s_x": 64}, dtype=mixed, stages=2)
    assert occ.block * occ.stages == 48 * KB and occ.group == 48 * KB
    assert occ.ratio == Fraction(15, 4)
    # registers per warpgroup (74.75 KB) are the paper's Table 2: they depend on its register
    # sub-tiling (d' = 32, d'' = 8), which this two-level diagram does not carry
    regs = concurrent_groups(H100.registers_per_sm, 0, int(74.75 * KB))
    assert round(float(regs), 2) == 3.42
    assert min(occ.groups, math.floor(regs)) == 3

    # diagram: per query row and 64-key chunk, the ops and their precisions
    ops = _per_row_chunk(cost, d=128, g_q=1, s_x=64)
    prec = lambda o: max((mixed.get(n, dt) for n, dt in o.precision), key=lambda t: t.bytes)
    qk = [n for o, n in ops if o.unit == "tensor" and o.node == "contract"]
    pv = [n for o, n in ops if o.unit == "tensor" and o.node == "update O"]
    exps = sum(n for o, n in ops if o.unit == "exp")
    acc = [n for o, n in ops if "accumulate" in o.what]
    assert (qk, pv, exps, acc) == ([16384], [16384], 65, [256])
    (qk_op,) = [o for o, _ in ops if o.unit == "tensor" and o.node == "contract"]
    (pv_op,) = [o for o, _ in ops if o.unit == "tensor" and o.node == "update O"]
    assert prec(qk_op) == nc.fp8_e4m3 and prec(pv_op) == nc.f16
    # hardware: ops per clock per SM
    clk_qk = Fraction(qk[0], H100.tensor_per_clk[prec(qk_op).name])
    clk_exp = Fraction(exps, H100.sfu_per_clk)
    clk_pv = Fraction(pv[0], H100.tensor_per_clk[prec(pv_op).name])
    clk_acc = Fraction(acc[0], H100.vector_per_clk["f16"])
    assert (clk_qk, clk_exp, clk_pv, clk_acc) == (2, Fraction(65, 16), 4, Fraction(1, 2))
    assert round(float(clk_exp), 2) == 4.06
    tensor_clk = clk_qk + clk_pv                            # the tensor core is the bottleneck
    flops = qk[0] + pv[0]
    pflops = Fraction(flops) / tensor_clk * H100.sms * _f(H100.tensor_clock_hz) / 10**15
    assert round(float(pflops), 2) == 1.32
    # diagram: HBM bytes per group and chunk = the loads inside the stream loop (K fp8 + V fp16)
    chunk_bytes = sum(int(m.per_exec) * mixed.get(m.array, m.dtype).bytes
                      for m in cost.subs({**ATT, "g_q": 128, "s_x": 64}).moves
                      if m.kind == "load" and "x" in m.loops)
    assert chunk_bytes == 24 * KB
    # compute per chunk on one SM: g_q rows x 6 clk; transfers: every SM loads its chunk through
    # the shared HBM bandwidth
    transfer_s = Fraction(chunk_bytes * H100.sms) / _f(H100.hbm_bandwidth)
    g_even = transfer_s * _f(H100.tensor_clock_hz) / tensor_clk
    assert round(float(g_even), 2) == 295.35 and math.floor(g_even) == 295
    compute_us = 384 * tensor_clk / _f(H100.tensor_clock_hz) * 10**6
    assert round(float(compute_us), 2) == 1.26
    assert round(float(transfer_s * 10**6), 2) == 0.97
    print(f"8. Hopper: SMEM ({(occ.capacity) // KB} - {occ.block * occ.stages // KB})/{occ.group // KB} "
          f"= {float(occ.ratio)}, registers 256/74.75 = {float(regs):.2f} => 3 warpgroups/SM; "
          f"clk QK {clk_qk}, exp {float(clk_exp):.4f}, PV {clk_pv}, acc {clk_acc}; "
          f"{float(pflops):.3f} PFLOP/s; bandwidth break-even g_q = {float(g_even):.2f}; "
          f"g_q=384: compute {float(compute_us):.3f} us vs transfer {float(transfer_s) * 1e6:.3f} us")


def test_item9_flashattention_block_sizes():
    # diagram: the SMEM memory 2 d g_q + 2 d s_x; FlashAttention gives half of M to the K, V
    # chunks (coefficient of s_x) and caps the query block at d
    mem = flash().memory["SMEM"]
    s_x, g_q, d_ = size_symbol("s_x"), size_symbol("g_q"), size_symbol("d")
    M, d = 196_608, 64
    per_key = mem.coeff(s_x).subs(d_, d)
    B_c = math.ceil(sp.Rational(M, 2) / per_key)
    B_r = min(B_c, d)
    assert (B_c, B_r) == (768, 64)
    assert mem.subs({d_: d, s_x: B_c, g_q: B_r}) <= M
    print(f"9. FlashAttention M={M}, d={d}: B_c = {B_c}, B_r = {B_r}")


def test_item10_flashattention3_utilisation():
    # diagram: per row and chunk, tensor ops of QK and PV and the exps (leading order s_x = 64,
    # the per-chunk rescale exp is O(1/s_x) and left out as in the paper's 4-clock figure);
    # hypothesis: softmax costs 2/3 more than its exps (the ~66 % overhead)
    ops = _per_row_chunk(flash(), d=128, g_q=1, s_x=64)
    qk = next(n for o, n in ops if o.unit == "tensor" and o.node == "contract")
    pv = next(n for o, n in ops if o.unit == "tensor" and o.node == "update O")
    exps = next(n for o, n in ops if o.what == "exp(s - mu)")
    softmax = Fraction(exps, H100.sfu_per_clk) * Fraction(5, 3)
    fp16_tc = Fraction(qk, H100.tensor_per_clk["f16"]) + Fraction(pv, H100.tensor_per_clk["f16"])
    fp8_tc = Fraction(qk, H100.tensor_per_clk["fp8_e4m3"]) + Fraction(pv, H100.tensor_per_clk["fp8_e4m3"])
    # FP16: the softmax of one tile overlaps only the other tile's P.V GEMM
    fp16 = (Fraction(qk, H100.tensor_per_clk["f16"]) + max(Fraction(pv, H100.tensor_per_clk["f16"]), softmax)) / fp16_tc
    # FP8: the tensor core is fast enough that the softmax is the bottleneck
    fp8 = max(fp8_tc, softmax) / fp8_tc
    assert (fp16, fp8) == (Fraction(4, 3), Fraction(5, 3))
    assert (round(float(1 / fp16), 2), round(float(1 / fp8), 2)) == (0.75, 0.6)
    print(f"10. FA3: FP16 takes {fp16} of the ideal time ({float(1 / fp16):.0%}), FP8 {fp8} ({float(1 / fp8):.0%})")
