"""Attention variants as data (issue 11): index expressions, tracing, derived block sparsity,
the gallery against independent NumPy references (fast), and its kernels under the simulator
(slow tier)."""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # kernels run in the simulator without a GPU

import re

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core.errors import NapkinError, TypingError  # noqa: E402
from napkin_cat.costmodel.skips import SympyAlgebra  # noqa: E402
from napkin_cat.library.variant_gallery import GALLERY, build, reference_attention  # noqa: E402
from napkin_cat.ops.index import IntAlgebra  # noqa: E402
from napkin_cat.ops.index_expr import TraceError  # noqa: E402

Bn, H, G, N, D = 2, 2, 2, 10, 4
q, x, d, h, b, g = nc.axes("q x d h b g")
SIZES = {q: N, x: N, d: D, h: H, b: Bn, g: G}


def _problem(v, seed=0):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((Bn, H, G, N, D)).astype(np.float32)
    K, V = (rng.standard_normal((Bn, H, N, D)).astype(np.float32) for _ in range(2))
    dia = build(v, q, x, d, N, heads=h, batch=b, groups=g).bind(SIZES)
    A = v.aux(N, H * G, Bn, rng)
    extra = [A[a.name] for a in dia.dom[3:]]
    return dia, (Q, K, V, *extra), reference_attention(v, Q, K, V, A, 1 / np.sqrt(D))


@pytest.mark.parametrize("v", GALLERY, ids=lambda v: v.name)
def test_gallery_variant_matches_its_independent_numpy_reference(v):
    dia, args, ref = _problem(v)
    np.testing.assert_allclose(nc.evaluate(dia, *args), ref, atol=1e-12)
    tiled = dia.stream("x", 4).tile("q", 4)
    np.testing.assert_allclose(nc.evaluate(tiled, *args), ref, atol=1e-12)


@pytest.mark.parametrize("v", GALLERY, ids=lambda v: v.name)
def test_gallery_block_sparsity_is_derived_and_counted(v):
    dia, _, _ = _problem(v)
    tiled = dia.stream("x", 4).tile("q", 4)
    dense = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, groups=g).bind(SIZES).stream("x", 4).tile("q", 4)
    ratio = nc.cost(tiled).flops["tensor"] / nc.cost(dense).flops["tensor"]
    assert (ratio < 1) == v.block_sparse, ratio


def _brute(pred, n=24):
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return np.broadcast_to(pred(i, j), (n, n))


MASKS = {
    "causal+3": lambda b_, h_, i, j: j <= i + 3,
    "window": lambda b_, h_, i, j: (j <= i) & (i - j <= 5),
    "window0": lambda b_, h_, i, j: (j <= i) & (i - j <= 0),
    "abs": lambda b_, h_, i, j: abs(i - j) <= 2,
    "prefix": lambda b_, h_, i, j: (j <= i) | (j < 7),
    "blocks": lambda b_, h_, i, j: i // 5 == j // 5,
    "not": lambda b_, h_, i, j: ~(j > i),
    "strided": lambda b_, h_, i, j: (j <= 2 * i + 1) & (j >= i - 3),
    "anti": lambda b_, h_, i, j: j >= i,
    "mod": lambda b_, h_, i, j: (i + j) % 3 == 0,
    # linear in the block quotients i // b, j // b (one b): bounds on whole blocks of columns
    "block_causal": lambda b_, h_, i, j: i // 5 >= j // 5,
    "natten": lambda b_, h_, i, j: (abs(i // 4 - j // 4) <= 1) & (abs(i % 4 - j % 4) <= 1),
    "block_band": lambda b_, h_, i, j: (j // 3 <= i // 3) & (i // 3 - j // 3 <= 2),
    "two_block_sizes": lambda b_, h_, i, j: i // 4 == j // 3,
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_derived_support_contains_every_kept_column(name):
    pred = nc.mask_mod(MASKS[name])
    keep = _brute(pred)
    for r0 in range(0, 24, 3):
        for r1 in range(r0 + 1, min(r0 + 7, 24) + 1, 2):
            lo, hi = pred.support(r0, r1, IntAlgebra)
            cols = np.nonzero(keep[r0:r1].any(0))[0]
            if len(cols):
                assert lo <= cols.min() and (hi is None or cols.max() < hi), (r0, r1, lo, hi, cols)


def test_derived_support_is_tight_for_the_common_masks():
    assert nc.mask_mod(MASKS["window"]).support(8, 12, IntAlgebra) == (3, 12)
    assert nc.mask_mod(MASKS["blocks"]).support(6, 9, IntAlgebra) == (5, 10)
    assert nc.mask_mod(MASKS["prefix"]).support(2, 4, IntAlgebra) == (0, 7)
    assert nc.mask_mod(MASKS["window0"]).support(8, 12, IntAlgebra) == (8, 12)
    assert not nc.mask_mod(MASKS["mod"]).bounded() and not nc.mask_mod(MASKS["anti"]).bounded()
    # rows 8..11 are image rows 2 (8..11) of width 4: neighbour rows 1..3, columns 4..15
    assert nc.mask_mod(MASKS["natten"]).support(8, 12, IntAlgebra) == (4, 16)
    assert nc.mask_mod(MASKS["block_causal"]).support(6, 9, IntAlgebra) == (0, 10)
    assert nc.mask_mod(MASKS["block_band"]).support(9, 12, IntAlgebra) == (3, 12)
    assert nc.mask_mod(MASKS["two_block_sizes"]).support(6, 9, IntAlgebra)[1] is None   # one b only
    import sympy as sp
    r = sp.Symbol("r", nonnegative=True)
    assert nc.mask_mod(MASKS["window"]).support(r, r + 4, SympyAlgebra) == (sp.Max(r - 5, 0), r + 4)


@pytest.mark.parametrize("name", ["block_causal", "natten", "block_band", "blocks"])
def test_block_quotient_support_is_the_same_in_every_algebra(name):
    """The executor (ints), the cost model (sympy) and the kernel (code) read one bound."""
    import sympy as sp
    from napkin_cat.lowering.source import CodeAlgebra, Code, render_code
    pred = nc.mask_mod(MASKS[name])
    r0s, r1s = sp.symbols("r0 r1", integer=True, nonnegative=True)
    lo_s, hi_s = pred.support(r0s, r1s, SympyAlgebra)
    lo_c, hi_c = pred.support(Code(text="r0"), Code(text="r1"), CodeAlgebra)
    code = [render_code(c, str) for c in (lo_c, hi_c)]
    for r0 in range(0, 20):
        for r1 in range(r0 + 1, 21):
            want = pred.support(r0, r1, IntAlgebra)
            assert tuple(int(sp.sympify(v).subs({r0s: r0, r1s: r1})) for v in (lo_s, hi_s)) == want
            assert tuple(eval(c, {"r0": r0, "r1": r1, "max": max, "min": min}) for c in code) == want


def test_mask_mod_matches_the_builtin_predicates_in_cost():
    def cost(**kw):
        return nc.cost(nc.library.attention(q=q, x=x, d=d, **kw).bind({q: 64, x: 64, d: 8})
                       .stream("x", 8).tile("q", 16)).flops["tensor"]
    assert cost(mask=lambda b_, h_, i, j: (j <= i) & (i - j <= 9)) == cost(window_size=9)
    assert cost(mask=lambda b_, h_, i, j: i // 16 == j // 16) == cost(mask=nc.block_diagonal(16))
    assert cost(mask=lambda b_, h_, i, j: j <= i) == cost(causal=True)


def test_window_size_zero_keeps_only_the_diagonal():
    rng = np.random.default_rng(1)
    Q, K, V = (rng.standard_normal((5, 3)) for _ in range(3))
    out = nc.evaluate(nc.library.attention(q=q, x=x, d=d, window_size=0), Q, K, V)
    np.testing.assert_allclose(out, V)
    out = nc.evaluate(nc.library.attention(q=q, x=x, d=d, mask=nc.window(0)), Q, K, V)
    np.testing.assert_allclose(out, V)


def test_score_mod_lowers_to_known_boxes_and_keeps_gradients():
    sl = nc.aux("sl", nc.Axis("nh", 2))
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, causal=True,
                               score_mod=lambda s, b_, h_, i, j: nc.ix.tanh(s / 3.0) * 3.0 + sl[h_] * (j - i))
    kinds = [e.box.kind for e in dia.eqns]
    assert kinds.count("index_bias") == 1 and "tanh" in [e.box.param("fn", None) for e in dia.eqns]
    rng = np.random.default_rng(2)
    Q, K, V = (rng.standard_normal((2, 6, 3)) for _ in range(3))
    slv = np.array([0.5, -0.25])
    gd = nc.grad(dia.bind({q: 6, x: 6, d: 3, h: 2}))
    dQ = nc.evaluate(gd, Q, K, V, slv, np.ones((2, 6, 3)))[0]
    f = lambda Q_: nc.evaluate(dia, Q_, K, V, slv).sum()
    E = np.zeros_like(Q)
    E[1, 3, 2] = 1e-6
    assert abs(dQ[1, 3, 2] - (f(Q + E) - f(Q - E)) / 2e-6) < 1e-6


@pytest.mark.slow   # importing torch alone takes seconds
def test_index_expressions_have_torch_semantics():
    torch = pytest.importorskip("torch")
    doc = nc.aux("doc", nc.Axis("n", 6))
    dia = nc.library.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i),
                               score_mod=lambda s, b_, h_, i, j: s + (i - j) / 4).bind({q: 6, x: 6, d: 3})
    rng = np.random.default_rng(3)
    args = [rng.standard_normal((6, 3)) for _ in range(3)] + [np.array([0, 0, 1, 1, 1, 2.0])]
    fn = nc.to_torch(dia)
    out = fn(*(torch.tensor(a) for a in args))
    np.testing.assert_allclose(out.detach().numpy(), nc.evaluate(dia, *args), atol=1e-12)


@pytest.mark.parametrize("fn, why", [
    (lambda b_, h_, i, j: i > j and j > 0, "no truth value"),
    (lambda b_, h_, i, j: np.zeros(3)[i] > 0, "nc.aux"),
    (lambda b_, h_, i, j: i + j, "must return a condition"),
    (lambda b_, h_, i, j: 1 / 0, "ZeroDivisionError"),
    (lambda b_, h_, i, j: __import__("math").tanh(i) > 0, "nc.ix"),
    (lambda b_, h_, i, j: (i << j) > 0, "shifts take an integer expression and a constant"),
])
def test_tracing_refuses_what_it_cannot_follow_with_the_reason(fn, why):
    with pytest.raises(TraceError, match=why):
        nc.mask_mod(fn)


def test_refusals_name_what_is_wrong():
    with pytest.raises(TypingError, match="ignores the score"):
        nc.score_mod(lambda s, b_, h_, i, j: i - j)
    # the score times an index-dependent value is one index_map box (ops.aux_grad), not refused
    dia = nc.library.attention(q=q, x=x, d=d, score_mod=lambda s, b_, h_, i, j: s * (i - j))
    assert [e.box.kind for e in dia.eqns].count("index_map") == 1
    with pytest.raises(TypingError, match="no heads"):
        nc.library.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: h_ == 0)
    with pytest.raises(TypingError, match="axis of the attention"):
        tb = nc.aux("tb", x)
        nc.library.attention(q=q, x=x, d=d, bias=nc.bias_mod(lambda b_, h_, i, j: tb[j]))
    with pytest.raises(TypingError, match="softcap"):
        nc.library.attention(q=q, x=x, d=d, softcap=0)
    with pytest.raises(TypingError, match="has 1 axes"):
        nc.aux("t", nc.Axis("n", 4))[1, 2]
    with pytest.raises(TypingError, match="library.attention"):
        B = nc.Builder()
        S = B.input("S", q, x)
        B.mask(S, q, x, nc.mask_mod(lambda b_, h_, i, j: h_ == 0))
    assert issubclass(TraceError, NapkinError)


def test_a_custom_python_predicate_still_refuses_to_lower_with_the_reason():
    dia = nc.library.attention(q=q, x=x, d=d, mask=nc.predicate(lambda i, j: j <= i)).bind({q: 8, x: 8, d: 4})
    with pytest.raises(nc.LoweringError, match="custom predicate"):
        nc.lower(dia, tiles={"q": 4, "x": 4}, threads=16)


def test_generated_code_comes_from_the_expression():
    doc = nc.aux("doc", nc.Axis("n", 8))
    dia = nc.library.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i),
                               score_mod=lambda s, b_, h_, i, j: s + abs(i - j) * 0.5).bind({q: 8, x: 8, d: 4})
    src = nc.lower(dia, tiles={"q": 4, "x": 4}, threads=16).source
    # doc[i] read once per row, before the row's columns; doc[j] per score; neither clamped: the
    # tiles are whole (8 = 2 x 4), so no index leaves the tensor
    assert re.search(r"doc_row\d* = smem\[doc_s \+ uint32\(\(q0 \+ i_q\d+\)\)\]", src)
    assert "== smem[doc_s + uint32((x0 + " in src
    # index arithmetic that meets a float or is compared runs in float32, exact at these sizes,
    # the row's index converted once per row: no int64 arithmetic and conversion per score
    # (the element loops are written twice, for chunks the mask keeps whole and for the rest:
    # lowering/unswitch.py, the rest once more for each value of the table's entry, whole or partial,
    # none for a masked entry, whose chunks the loop skips; the row's index is converted once per
    # row in each)
    f_rows = re.findall(r"(f_row\d*) = float32\(uint32\(q0 \+ i_q\d+\)\)", src)
    assert len(f_rows) == 3 and "if x_full:" in src and "the loop skips it" in src
    for f_row in f_rows:
        assert re.search(rf"abs\(\({f_row} - float32\(uint32\(x0 \+ i_x\d+\)\)\)\) \* HALF", src)
    per_score = [ln for ln in src.splitlines() if "else NEG_INF" in ln]
    assert any(re.search(rf"\(float32\(uint32\(x0 \+ i_x\d+\)\) <= {f_row}\)", src) for f_row in f_rows)
    assert per_score and not any("int64(" in ln for ln in per_score)
    assert "x_end = min(" in src     # chunks past the causal part are skipped (derived)
    assert "bt_entry" in src         # and those the data masks, by the table derived per launch (lowering/tabled.py)
    # a ragged tile's padding rows index past the tensor: clamped into it, as NumPy reads them
    doc7 = nc.aux("doc", nc.Axis("n", 7))
    ragged = nc.library.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: (doc7[i] == doc7[j]) & (j <= i))
    src7 = nc.lower(ragged.bind({q: 7, x: 7, d: 4}), tiles={"q": 4, "x": 4}, threads=16).source
    assert "smem[doc_s + uint32(min(max(int64(q0 + " in src7


@pytest.mark.slow
@pytest.mark.parametrize("v", GALLERY, ids=lambda v: v.name)
def test_gallery_kernel_matches_the_reference_in_the_simulator(v):
    dia, args, ref = _problem(v)
    kernel = nc.lower(dia.stream("x", 4).tile("q", 4), threads=16)
    out = kernel(*args)
    assert np.abs(out - ref).max() < 1e-5


# --------------------------------------------------------------------------- chunk states (issue 11, second pass)

def test_chunk_state_full_and_empty_are_sound():
    """A chunk called full keeps every entry, one called empty keeps none (brute force)."""
    from napkin_cat.ops.index_support import BoolLogic
    n = 24
    for name in sorted(MASKS):
        pred = nc.mask_mod(MASKS[name])
        keep = _brute(pred, n)
        fulls = 0
        for r0 in range(0, n, 3):
            for r1 in range(r0 + 1, min(r0 + 7, n) + 1, 2):
                for c0 in range(0, n, 2):
                    for c1 in range(c0 + 1, min(c0 + 6, n) + 1, 2):
                        full, empty = pred.chunk_state(r0, r1, c0, c1, IntAlgebra, BoolLogic, None)
                        blk = keep[r0:r1, c0:c1]
                        assert not (full and not blk.all()) and not (empty and blk.any()), (name, r0, r1, c0, c1)
                        fulls += bool(full)
        assert fulls > 0 or name in ("mod", "natten", "two_block_sizes"), name   # % and mixed blocks: never known full


def _sim(dia, args, ref, **kw):
    kernel = nc.lower(dia, threads=16, verify=False, **kw)
    out = kernel(*args)
    assert np.abs(out - ref).max() < 1e-5
    return kernel.source


def test_a_mask_bounded_below_skips_the_early_chunks():
    """``j >= i``: the start of the chunk loop moves with the tile, as the end does for causal;
    the cost model counts the same chunks."""
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((N, D)).astype(np.float32) for _ in range(3))
    dia = nc.library.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: j >= i).bind({q: N, x: N, d: D})
    ref = nc.evaluate(dia, Q, K, V)
    tiled = dia.stream("x", 4).tile("q", 4)
    dense = nc.library.attention(q=q, x=x, d=d).bind({q: N, x: N, d: D}).stream("x", 4).tile("q", 4)
    assert nc.cost(tiled).flops["tensor"] < nc.cost(dense).flops["tensor"]
    np.testing.assert_allclose(nc.evaluate(tiled, Q, K, V), ref, atol=1e-12)
    src = _sim(tiled, (Q, K, V), ref)
    assert "x_begin = " in src and "range(x_begin, N_x, CHUNK_x)" in src and "x_full = " in src


def test_full_chunks_skip_the_mask_arithmetic_in_the_cost():
    """The mask's operations are counted on the chunks it does not keep whole."""
    sizes = {q: 64, x: 64, d: 8}
    def flops(**kw):
        c = nc.cost(nc.library.attention(q=q, x=x, d=d, **kw).bind(sizes).stream("x", 8).tile("q", 8))
        return [o for o in c.ops if "mask" in o.what or "select" in o.what or "condition" in o.what]
    ops = flops(mask=lambda b_, h_, i, j: j <= i)
    # 8 row tiles x 8 chunks: 36 visited, 8 of them on the diagonal (partial)
    assert {o.execs for o in ops} == {8}, ops
    assert {o.execs for o in flops(causal=True)} == {8}


def _document(n, blocks):
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", -(-n // blocks)), nc.Axis("cb", -(-n // blocks)))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    return m, nc.blocked(m, bt, blocks, blocks)


def test_block_table_masks_equal_the_mask_and_skip_by_data():
    """A document mask with its block table: the same meaning; the cost counts the chunks the
    table skips when given its values (and says it cannot without them); the kernel reads the
    table per chunk, skips the masked chunks and the arithmetic of the kept ones."""
    n = 12
    ids = np.repeat([0.0, 1.0, 2.0], [5, 3, 4]).astype(np.float32)
    m, blocked = _document(n, 4)
    table = nc.block_table(m, n, n, 4, 4, {"doc": ids})
    np.testing.assert_array_equal(table, [[1, 0, 0], [1, 1, 0], [0, 0, 1]])
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((n, D)).astype(np.float32) for _ in range(3))
    plain = nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: D})
    dia = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: D})
    assert [a.name for a in dia.dom[3:]] == ["bt", "doc"]
    ref = nc.evaluate(plain, Q, K, V, ids)
    np.testing.assert_allclose(nc.evaluate(dia, Q, K, V, table, ids), ref, atol=1e-12)
    tiled = dia.stream("x", 4).tile("q", 4)
    blind, known = nc.cost(tiled), nc.cost(tiled, data={"bt": table})
    # 4 of 9 chunks visited; without the table's values the 6 of the mask's causal bound, which
    # blocked() keeps beside the table (ops.block_table.bounds)
    assert known.flops["tensor"] * 6 == blind.flops["tensor"] * 4
    assert blind.notes and "'bt'" in blind.notes[0] and not known.notes
    src = _sim(tiled, (Q, K, V, table, ids), ref)
    assert "x_empty = " in src and "if not x_empty:" in src and "x_full = (bt_full and " in src
    # tiles and chunks of 4 inside table blocks of 4: one entry per chunk, read once for both
    # comparisons (>= 2 keeps all, >= 1 keeps some), no loop over entries
    assert len(re.findall(r"bt_entry\d* = smem\[", src)) == 1 and "for i_rb" not in src
    # chunks of 2 (a table block is two chunks; tiles of 8 span two blocks): both entries read in turn
    halves = _sim(dia.stream("x", 2).tile("q", 8), (Q, K, V, table, ids), ref)
    assert "the 2 entries of the table over the tile and chunk" in halves and "for i_rb" not in halves
    # tiles of 6 over blocks of 4: one or two blocks, by the tile: the loop over entries
    sixes = _sim(dia.stream("x", 2).tile("q", 6), (Q, K, V, table, ids), ref)
    assert "for i_rb" in sixes and "bt_entry" not in sixes


@pytest.mark.parametrize("grouped", [False, True])
def test_a_table_of_each_head_is_counted_head_by_head(grouped):
    """A causal window of each query head's own width, read from a table of each query head
    (``bt[h, ...]``; under GQA ``bt[h * G + g, ...]``): the cost counts each head's chunks and
    adds them up, not the chunks every head masks (the widest window's: an upper bound)."""
    n, blk, H, G = 32, 4, 4, 2
    widths = np.array([0, 4, 12, 32], dtype=np.float32)
    wq = nc.aux("wq", nc.Axis("nh", H))
    m = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= wq[h_]))
    table = nc.block_table(m, n, n, blk, blk, {"wq": widths}, heads=H)
    bt = nc.aux("bt", nc.Axis("nh", H), nc.Axis("rb", n // blk), nc.Axis("cb", n // blk))
    heads = dict(heads=h, groups=g) if grouped else dict(heads=h)
    sizes = {q: n, x: n, d: D, h: H // G, g: G} if grouped else {q: n, x: n, d: D, h: H}

    def flops(mask, data=None):
        dia = nc.library.attention(q=q, x=x, d=d, mask=mask, **heads).bind(sizes)
        return nc.cost(dia.stream("x", blk).tile("q", blk), data=data).flops["tensor"]

    per_head = []
    for k in range(H):   # one head alone, its window a constant: the count the table must give
        w = int(widths[k])
        per_head.append(flops(nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= w))) / H)
    assert flops(nc.blocked(m, bt, blk, blk), {"bt": table}) == sum(per_head)
    assert sum(per_head) < flops(nc.causal())


def test_a_blocked_mask_keeps_its_own_bounds_beside_the_table():
    """``blocked`` keeps the conjuncts of the mask that bound the columns without data (a
    document mask's ``j <= i``): the loop over chunks stops at the diagonal, as causal attention's
    does, instead of reading the table's masked entries up to the last column (the per-head
    windows on an H200 spent 26% more per kept entry than causal before; kernels/BENCHMARKS.md).
    Conjuncts that gather (``doc[i] == doc[j]``) are left to the table."""
    from napkin_cat.ops.block_table import bounds
    n = 12
    m, blocked = _document(n, 4)
    assert [str(c) for c in bounds(m.expr)] == ["j <= i"]
    ids = nc.aux("ids", nc.Axis("n", n))
    assert bounds(nc.mask_mod(lambda b_, h_, i, j: ids[i] == ids[j]).expr) == ()
    dia = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: D})
    src = nc.lower(dia.stream("x", 4).tile("q", 4), verify=False).source
    assert "x_end = min(N_x, q0 + TILE_q)" in src and "range(U0, x_end, CHUNK_x)" in src


def test_block_table_refuses_what_it_cannot_tabulate():
    with pytest.raises(TypingError, match="reads the index h"):
        nc.block_table(lambda b_, h_, i, j: h_ == 0, 8, 8, 4, 4)
    doc = nc.aux("doc", nc.Axis("n", 8))
    with pytest.raises(TypingError, match="pass their values"):
        nc.block_table(lambda b_, h_, i, j: doc[i] == doc[j], 8, 8, 4, 4)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [True, "double"])
def test_block_table_kernel_with_prefetch_matches(prefetch):
    n = 13
    ids = np.repeat([0.0, 1.0, 2.0], [6, 2, 5]).astype(np.float32)
    m, blocked = _document(n, 4)
    table = nc.block_table(m, n, n, 4, 4, {"doc": ids})
    rng = np.random.default_rng(6)
    Q, K, V = (rng.standard_normal((n, D)).astype(np.float32) for _ in range(3))
    ref = nc.evaluate(nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: D}), Q, K, V, ids)
    dia = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: D}).stream("x", 4).tile("q", 4)
    src = _sim(dia, (Q, K, V, table, ids), ref, prefetch=prefetch)
    # a loop that fetches a chunk ahead visits the kept chunks only and fetches the next kept one
    assert "if not x_empty:" in src and re.search(r"while x0 < ", src) and "x_kept2 = uint64(x0 + " in src


@pytest.mark.slow
def test_block_table_kernel_with_cp_async_prefetch_fetches_only_kept_chunks():
    """16-bit inputs double-buffered with cp.async (the GPU's default, ``prefetch="auto"``)
    under a block table: the copies in flight are of the next chunk the table keeps, not of the
    next chunk (which it may skip: before, every chunk was copied, kept or not); the kernel
    matches the float64 oracle in f16, documents of ragged lengths crossing table blocks."""
    from napkin_cat.ops.arrays import round_to_dtype
    n, dd, blocks = 64, 16, 16
    ids = np.repeat([0.0, 1.0, 2.0, 3.0], [20, 9, 23, 12]).astype(np.float32)
    m, blocked = _document(n, blocks)
    table = nc.block_table(m, n, n, blocks, blocks, {"doc": ids})
    assert (table == 0).sum() >= 4       # chunks masked whole, between and after kept ones
    rng = np.random.default_rng(12)
    Q, K, V = (round_to_dtype(rng.standard_normal((n, dd)), "f16") for _ in range(3))
    ref = nc.evaluate(nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: dd}), Q, K, V, ids)
    dia = nc.library.attention(q=q, x=x, d=d, mask=blocked, dtype=nc.f16).bind({q: n, x: n, d: dd})
    kernel = nc.lower(dia.stream("x", 16).tile("q", 16).place("O", "registers"), threads=32, verify=False,
                      prefetch="double")
    src = kernel.source
    assert "cp_async_wait1()" in src and re.search(r"while x0 < ", src)
    fetch_next = src[src.index("while x0 < "):]
    assert re.search(r"cp_async16\(smem16, K_s_fill\d* \* U2 .*\(x_kept\d* \+ i_x\)", fetch_next)
    out = np.asarray(kernel(Q.astype(np.float16), K.astype(np.float16), V.astype(np.float16),
                            table.astype(np.float16), ids.astype(np.float16)), np.float64)
    assert np.abs(out - ref).max() < 2e-3


TC_VARIANTS = ("causal", "sliding_window", "prefix_lm", "document", "relative_bias", "softcap", "block_mask")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name", TC_VARIANTS)
def test_gallery_variant_on_tensor_cores_in_the_simulator(name, dtype):
    """16-bit gallery variants lower with the mma engine (tiles and chunks of 16, d = 16, one
    warp) and match the reference within the dtype's rounding."""
    from napkin_cat.ops.arrays import round_to_dtype
    v = next(v for v in GALLERY if v.name == name)
    dt = {"f16": nc.f16, "bf16": nc.bf16}[dtype]
    n, dd = 20, 16
    rng = np.random.default_rng(7)
    Q, K, V = (round_to_dtype(rng.standard_normal((n, dd)), dtype) for _ in range(3))
    A = v.aux(n, 1, 1, rng)
    dia = build(v, q, x, d, n, dtype=dt).bind({q: n, x: n, d: dd})
    extra = [round_to_dtype(np.asarray(A[a.name], np.float64), dtype) for a in dia.dom[3:]]
    ref = reference_attention(v, Q[None, None, None], K[None, None], V[None, None],
                              {a.name: e for a, e in zip(dia.dom[3:], extra)}, 1 / np.sqrt(dd))[0, 0, 0]
    kernel = nc.lower(dia.stream("x", 16).tile("q", 16).place("O", "registers"), threads=32, verify=False)
    assert "mma_" in kernel.source
    args = [a.astype(np.float16) if dtype == "f16" else a.astype(np.float32) for a in (Q, K, V, *extra)]
    out = np.asarray(kernel(*args), np.float64)
    assert np.abs(out - ref).max() < (2e-3 if dtype == "f16" else 2e-2)


def test_fragment_epilogue_with_many_gathers_is_written_row_by_row():
    """On tensor cores a mask reading four auxiliary entries per score (the document mask with
    its block table, written by the user or derived per launch: ``lowering/tabled.py``) has its
    fragment epilogue written out row by row, so the compiler keeps the fragment in registers
    (``emit_acc.UNROLL_GATHERS``, measured with ptxas); a bias reading two keeps the loops.  All
    match the float64 oracle in f16."""
    from napkin_cat.lowering.emit_acc import UNROLL_GATHERS
    from napkin_cat.ops.arrays import round_to_dtype
    n, dd, blocks = 32, 16, 16
    ids = np.repeat([0.0, 1.0, 2.0], [9, 15, 8]).astype(np.float32)
    m, blocked = _document(n, blocks)
    table = nc.block_table(m, n, n, blocks, blocks, {"doc": ids})
    tb = nc.aux("tb", nc.Axis("n", n))
    two = nc.bias_mod(lambda b_, h_, i, j: tb[i] * tb[j])
    rng = np.random.default_rng(11)
    Q, K, V = (round_to_dtype(rng.standard_normal((n, dd)), "f16") for _ in range(3))
    for kw, extra, rows in ((dict(mask=blocked), (table, ids), True), (dict(mask=m), (ids,), True),
                            (dict(bias=two), (ids / 4,), False)):
        ref = nc.evaluate(nc.library.attention(q=q, x=x, d=d, **kw).bind({q: n, x: n, d: dd}), Q, K, V, *extra)
        dia = nc.library.attention(q=q, x=x, d=d, dtype=nc.f16, **kw).bind({q: n, x: n, d: dd})
        kernel = nc.lower(dia.stream("x", 16).tile("q", 16).place("O", "registers"), threads=32, verify=False)
        assert "mma_" in kernel.source
        assert ("written out row by row" in kernel.source) == rows, UNROLL_GATHERS
        assert ("S_regs[0, j] = " in kernel.source) == rows
        args = [a.astype(np.float16) for a in (Q, K, V)] + [np.asarray(a, np.float16) for a in extra]
        out = np.asarray(kernel(*args), np.float64)
        assert np.abs(out - ref).max() < 2e-3, (rows, np.abs(out - ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True, "double"])
def test_backward_skips_the_query_chunks_a_block_table_masks(prefetch):
    """The backward's dK, dV kernel streams the queries inside key tiles: the mask's rows are
    the streamed axis (transposed).  A block table skips those chunks too (``q_empty``), and a
    chunk it keeps whole skips the mask's arithmetic (``q_full``); the causal mask gets the same
    ``q_full`` flags.  Gradients through ``nc.torch_op`` (the simulator) match float64 autograd."""
    import torch
    from napkin_cat.lowering.torch_op import backward_plan
    n, dd, blk = 32, 8, 8
    ids = np.repeat([0.0, 1.0, 2.0], [11, 5, 16]).astype(np.float32)
    m, blocked = _document(n, blk)
    table = nc.block_table(m, n, n, blk, blk, {"doc": ids})
    att = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: dd})
    flash = att.stream("x", 8).tile("q", 8)
    dkdv = backward_plan(flash).parts[1]
    assert {a.name for a in dkdv.cod} == {"dK", "dV"}
    src = nc.lower(dkdv, tiles={"g_x": 8, "s_q": 8}, threads=16, verify=False, prefetch=prefetch).source
    assert re.search(r"q_empty\d* = .*# the block table masks the whole chunk: skipped", src)
    # kept whole where the table says so and the mask's own causal bound (ops.block_table.bounds)
    # keeps the chunk: the bound also starts the stream at the key tile (q_begin), as causal's does
    assert re.search(r"q_full\d* = \(bt_full\d* and ", src) and "q_begin = " in src
    assert bool(re.search(r"while q0 < ", src)) == bool(prefetch)     # fetching ahead: the kept chunks only
    causal = nc.library.attention(q=q, x=x, d=d, causal=True).bind({q: n, x: n, d: dd}).stream("x", 8).tile("q", 8)
    csrc = nc.lower(backward_plan(causal).parts[1], tiles={"g_x": 8, "s_q": 8}, threads=16, verify=False).source
    assert "q_full = x0 + TILE_x <= q0 + U1" in csrc and "q_begin = " in csrc
    rng = np.random.default_rng(13)
    Q, K, V = (torch.tensor(rng.standard_normal((n, dd)), dtype=torch.float32, requires_grad=True) for _ in range(3))
    op = nc.torch_op(flash, threads=16, prefetch=prefetch)
    O = op(Q, K, V, torch.tensor(table), torch.tensor(ids))
    dO = torch.tensor(rng.standard_normal((n, dd)), dtype=torch.float32)
    got = torch.autograd.grad(O, (Q, K, V), dO)
    assert op.last_backward_path.startswith("simulator")
    Qr, Kr, Vr = (t.detach().double().requires_grad_() for t in (Q, K, V))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    doc = torch.tensor(ids)
    S = (Qr @ Kr.T / np.sqrt(dd)).masked_fill(~((doc[i] == doc[j]) & (j <= i)), float("-inf"))
    want = torch.autograd.grad(torch.softmax(S, -1) @ Vr, (Qr, Kr, Vr), dO.double())
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 1e-5
