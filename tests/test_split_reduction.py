"""Split reductions: ``tile(axis, size, partial="sum")`` tiles an axis the diagram sums over, each
block adding its partial sum into the output (split-K, FlashAttention-2's dQ).

Refusals (the plain tile keeps its text; the new form names what is not a sum), the tiled
executor against the oracle, the cost of the atomics, and kernels in the simulator: split-K
matmul and the one-kernel attention backward (plain, causal, GQA), with planted bugs (the
atomic made a plain store, the zero-fill left out) that the checks must catch."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import sympy as sp

import napkin_cat as nc
from napkin_cat.relabel.symbols import size_symbol

a, b, c = nc.axes("a b c")
q, x, d, h = nc.axes("q x d h")
MM = nc.library.matmul(a=a, b=b, c=c)
SPLIT_MM = MM.tile(b, 4, partial="sum").tile(a, 4)
MM_SIZES = {a: 6, b: 10, c: 3}           # ragged: 3 blocks of b (4, 4, 2), 2 of a (4, 2)
FWD = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True)
BWD = nc.grad_with_residuals(FWD, wrt=["Q", "K", "V"])
BWD_SIZES = {q: 4, x: 5, d: 2, h: 1}   # 2 key tiles (3, 2), 2 query chunks


def _one_kernel(fwd):
    return nc.grad_with_residuals(fwd, wrt=["Q", "K", "V"]).tile(x, 3, partial="sum").stream(q, 2)


# --------------------------------------------------------------------------- relabelling

def test_plain_tile_of_a_summed_axis_keeps_its_refusal():
    with pytest.raises(nc.RelabelError) as info:
        BWD.tile(x, 16)
    assert str(info.value) == ("cannot tile x: contract removes axis x (it reduces or contracts over it): the "
                               "groups would each hold a partial result; stream x instead")


@pytest.mark.parametrize("make, words", [
    (lambda: FWD.stream(x, 4).tile(x, 16, partial="sum"), ["softmax-contract", "online softmax", "stream x"]),
    (lambda: FWD.tile(x, 16, partial="sum"), ["softmax", "normalises along x"]),
    (lambda: _reduce("max").tile(b, 2, partial="sum"), ["max reduction, not a sum"]),
    (lambda: _reduce("mean").tile(b, 2, partial="sum"), ["mean", "divide by its own"]),
    (lambda: (MM >> nc.ops.op("relu", MM.cod[0])).tile(b, 2, partial="sum"), ["not an output"]),
    (lambda: MM.tile(a, 2, partial="sum"), ["nothing", "sums over a", "without partial="]),
    (lambda: MM.tile(b, 2, partial="max"), ["combined by addition only", "'max'"]),
    (lambda: MM.tile(b, "devices", partial="sum"), ["all-reduce", "within a device"]),
    (lambda: MM.tile(b, 2, "L2", partial="sum"), ["atomics", "SMEM"]),
    (lambda: MM.stream(b, 2).tile(b, 4, partial="sum"), ["already streamed"]),
])
def test_partial_tile_refused_with_the_reason(make, words):
    with pytest.raises(nc.RelabelError) as info:
        make()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def _reduce(op):
    g = nc.Builder()
    A = g.input("A", a, b)
    return g.diagram(g.reduce(op, A, b, name="R"))


def test_refusal_names_the_other_reader_of_a_summed_output():
    g = nc.Builder()
    A, B = g.input("A", a, b), g.input("B", b, c)
    C = g.contract(A, B, out=(a, c), name="C")
    two = g.diagram(C, g.map("relu", C, name="R"), names=["C", "R"])
    with pytest.raises(nc.RelabelError, match="relu.* also reads"):
        two.tile(b, 2, partial="sum")


def test_split_tile_prints_and_says_the_output_is_added_across_blocks():
    one = BWD.tile(x, "g_x", partial="sum").stream(q, "s_q").tile(h, 1)
    assert "tile(x, g_x, partial=sum), stream(q, s_q), tile(h, 1)" in str(one)
    text = one.loop_nest().pseudocode(memory=False)
    assert "for x in tiles of g_x  (grid, SMEM; partial sums of dQ added across the blocks)" in text
    assert "add dQ[1 s_q d] -> HBM  (atomic: partial sum over this block's x)" in text
    assert "store dK[1 g_x d] -> HBM" in text and "store dQ" not in text
    assert str(one.bind({x: 8, "g_x": 4}).schedule[0].extra) == "('sum',)"   # kept by bind


# --------------------------------------------------------------------------- executor

def test_executor_sums_the_partials_of_split_k():
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((6, 10)), rng.standard_normal((10, 3))
    got = nc.evaluate(SPLIT_MM, A, B)
    assert np.abs(got - A @ B).max() < 1e-12
    assert nc.check_equivalent(MM, MM.tile(b, "g_b", partial="sum").tile(a, "g_a"), examples=10).examples == 10


def test_executor_runs_the_one_kernel_backward():
    one = BWD.tile(x, "g_x", partial="sum").stream(q, "s_q").tile(h, 1)
    assert nc.check_equivalent(BWD, one, examples=8).examples == 8


# --------------------------------------------------------------------------- cost

def test_cost_counts_a_read_modify_write_per_block_and_the_zero_fill():
    split = nc.cost(MM.tile(b, "g_b", partial="sum").tile(a, "g_a"))
    plain = nc.cost(MM.stream(b, "s_b").tile(a, "g_a"))
    A_, B_, C_, g_b = (size_symbol(n) for n in ("a", "b", "c", "g_b"))
    rmw = [m for m in split.moves if m.kind.startswith("atomic")]
    assert {m.kind for m in rmw} == {"atomic read", "atomic write"}
    assert all(m.dtype == nc.f32 and m.upper == "HBM" for m in rmw)
    assert sp.simplify(sum(m.values for m in rmw) - 2 * A_ * B_ * C_ / g_b) == 0
    fill = [m for m in split.moves if m.kind == "zero-fill"]
    assert len(fill) == 1 and sp.simplify(fill[0].values - A_ * C_) == 0
    # the inputs move as in the streamed form; the output's one store becomes the atomics + fill
    assert sp.simplify(split.transfers["HBM"] - plain.transfers["HBM"] - 2 * A_ * B_ * C_ / g_b) == 0
    assert sp.simplify(split.flops["fma"] - A_ * B_ * C_ / g_b) == 0   # the adds


def test_cost_counts_atomics_in_fp32_for_a_16_bit_output():
    m16 = nc.library.matmul(a=a, b=b, c=c, dtype=nc.bf16).tile(b, "g_b", partial="sum")
    rmw = [m for m in nc.cost(m16).moves if m.kind.startswith("atomic") or m.kind == "zero-fill"]
    assert rmw and all(m.dtype == nc.f32 for m in rmw)


# --------------------------------------------------------------------------- kernels (simulator)

@pytest.fixture(scope="module")
def split_k():
    return nc.lower(SPLIT_MM.bind(MM_SIZES), threads=16)


def _mutant(kernel, pattern, replacement):
    source, n = re.subn(pattern, replacement, kernel.source)
    assert n >= 1, f"pattern {pattern!r} not in the generated source"
    mutant = copy.copy(kernel)
    mutant.source, mutant._dispatcher, mutant._launchers = source, None, {}
    return mutant


def test_split_k_kernel_adds_with_atomics_into_a_zero_filled_output(split_k):
    assert split_k.verified and split_k.zero_args == (2,)
    assert split_k.launch.grid == (6, 1, 1)
    assert "cuda.atomic.add(C, " in split_k.source and "add C[4 3] -> HBM" in split_k.source
    report = nc.check_equivalent(MM, split_k, examples=4)
    assert report.kernels == 4
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((6, 10)).astype(np.float32), rng.standard_normal((10, 3)).astype(np.float32)
    out = np.full((6, 3), 7.0, np.float32)        # the launcher zero-fills it first
    split_k(A, B, out=out)
    assert np.abs(out - A.astype(np.float64) @ B).max() < 1e-4
    run = split_k.prepare(A, B)
    run(), run()                                    # a second launch does not add onto the first
    assert np.abs(run.keep[-1] - A.astype(np.float64) @ B).max() < 1e-4


def test_check_equivalent_lowers_split_k_at_drawn_sizes():
    report = nc.check_equivalent(MM, MM.tile(b, "g_b", partial="sum").tile(a, "g_a"), lowered=True, examples=2)
    assert report.kernels == 2


def test_planted_bug_plain_store_instead_of_atomic_is_caught(split_k):
    bad = _mutant(split_k, r"cuda\.atomic\.add\((\w+), ([^\n]*), (\w+\[i, j\])\)", r"\1[\2] = \3")
    with pytest.raises(nc.EquivalenceError):
        nc.check_equivalent(MM, bad, examples=3)


def test_planted_bug_no_zero_fill_is_caught(split_k):
    bad = copy.copy(split_k)
    bad.zero_args, bad._launchers = (), {}
    rng = np.random.default_rng(2)
    A, B = rng.standard_normal((6, 10)).astype(np.float32), rng.standard_normal((10, 3)).astype(np.float32)
    out = np.full((6, 3), 7.0, np.float32)
    bad(A, B, out=out)
    assert np.abs(out - A.astype(np.float64) @ B).max() > 1.0


def test_16_bit_output_summed_across_blocks_is_refused():
    m16 = nc.library.matmul(a=a, b=b, c=c, dtype=nc.bf16).tile(b, 4, partial="sum").tile(a, 4)
    with pytest.raises(nc.LoweringError, match=r"output C\[a=6 c=3\] bf16: .*fp32 atomics"):
        nc.lower(m16.bind(MM_SIZES), threads=16)


def test_one_kernel_backward_lowers_and_matches_the_oracle():
    k = nc.lower(_one_kernel(FWD).bind(BWD_SIZES), threads=16)   # verified against the oracle
    assert k.verified and k.zero_args == (6,)      # dQ: the first output, after six inputs
    assert "cuda.atomic.add(dQ, " in k.source and "cuda.atomic.add(dK" not in k.source


def test_one_kernel_causal_backward_lowers():
    fwd = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True, causal=True)
    k = nc.lower(_one_kernel(fwd).bind(BWD_SIZES), threads=16)
    assert k.verified and "cuda.atomic.add(dQ, " in k.source


def test_one_kernel_gqa_backward_lowers():
    g = nc.Axis("g")
    fwd = nc.library.attention(q=q, x=x, d=d, heads=h, groups=g, logsumexp=True)
    k = nc.lower(_one_kernel(fwd).bind({**BWD_SIZES, g: 2}), threads=16)
    assert k.verified and "cuda.atomic.add(dQ, " in k.source


def test_tensor_core_fragments_add_two_adjacent_words_per_reduction():
    """Split-K on 3xTF32 fragments: each lane's column pair (2t, 2t + 1) goes to the output as
    one reduction (``red_add2``) where the output's columns are its last axis and their extent is
    even; an odd extent keeps one atomic per element.  Both verified against the oracle in the
    simulator; a planted swap of the pair's halves is caught."""
    split = MM.tile(b, 16, partial="sum").tile(a, 16).tile(c, 16)
    even = nc.lower(split.bind({a: 20, b: 40, c: 34}), threads=32, fp32="3xtf32")
    assert even.verified and "mma_tf32x3(" in even.source
    assert "red_add2(C, " in even.source and "cuda.atomic.add(C" not in even.source
    odd = nc.lower(split.bind({a: 20, b: 40, c: 33}), threads=32, fp32="3xtf32")
    assert odd.verified and "mma_tf32x3(" in odd.source
    assert "cuda.atomic.add(C, " in odd.source and "red_add2(C" not in odd.source
    bad = _mutant(even, r"red_add2\(C, (.*), (\w+)\[0\], (\w+)\[1\]\)", r"red_add2(C, \1, \3[1], \2[0])")
    with pytest.raises(nc.EquivalenceError):
        nc.check_equivalent(MM, bad, examples=2)
