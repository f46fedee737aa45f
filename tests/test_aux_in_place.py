"""Auxiliary tensors read in place: an input read only by the gathers of index expressions (a
document id per token, a block mask, a bias table) either loads whole into each block's shared
memory or, when it is larger than ``loopnest.AUX_WHOLE_BYTES`` or placed there with
``place(name, "HBM")``, stays in global memory and each gather reads its entry there.

The final form says which (its pseudocode), the cost model counts what the gathers can read
per tile and chunk (``Ix.footprint``), the kernel follows the final form (no shared buffer, the
gathers and the block-table chunk test read global memory), and an input that is not a gather's
(``place(K, "HBM")``) is refused by ``nc.lower`` rather than silently loaded anyway.  The random
cases are the kernel fuzzer's ``aux_in_place`` family (slow tier)."""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core.errors import LoweringError  # noqa: E402
from napkin_cat.library.variant_gallery import GALLERY, build, reference_attention  # noqa: E402
from napkin_cat.ops.index_expr import Aux, Ix  # noqa: E402
from napkin_cat.relabel import loopnest  # noqa: E402

q, x, d = nc.axes("q x d")
VARIANTS = {v.name: v for v in GALLERY}


def flash(name: str, n: int, dim: int = 64, tile: int = 64, **kw):
    att = build(VARIANTS[name], q, x, d, n, **kw).bind({"q": n, "x": n, "d": dim})
    return att.stream("x", tile).tile("q", tile)


def _ix(name):
    return Ix("idx", (), name)


# --------------------------------------------------------------------------- footprints

def test_footprint_bounds_each_index_by_interval_arithmetic():
    i, j = _ix("q"), _ix("x")
    rb = Aux("rb", (nc.Axis("nr", 8191),))
    assert (rb[i - j + 4095] * 1.0).footprint({"q": 64, "x": 32}) == {"rb": 95}   # 64 + 32 - 1
    assert (rb[(i * 3) % 10] * 1.0).footprint({"q": 64}) == {"rb": 10}
    assert (rb[abs(i - 7)] * 1.0).footprint({"q": 5}) == {"rb": 5}
    # an index it cannot bound (xor) spans the whole axis; a leaf without a width too
    assert (rb[i ^ j] * 1.0).footprint({"q": 4, "x": 4}) == {"rb": 8191}
    assert (rb[i] * 1.0).footprint({}) == {"rb": 8191}
    # the gathers of one tensor add up, capped at its size
    doc = Aux("doc", (nc.Axis("n", 100),))
    assert (doc[i] == doc[j]).footprint({"q": 64, "x": 64}) == {"doc": 100}


def test_footprint_takes_symbolic_widths():
    import sympy as sp
    g = sp.Symbol("g_q", positive=True, integer=True)
    doc = Aux("doc", (nc.Axis("n", 4096),))
    (fp,) = (doc[_ix("q")] == doc[_ix("x")]).footprint({"q": g, "x": 64}).values()
    assert fp.subs(g, 64) == 128 and fp.subs(g, 8192) == 4096


# --------------------------------------------------------------------------- the final form

def test_a_block_mask_too_large_for_shared_memory_stays_in_hbm_and_lowers():
    """FlashAttention's block-sparse mask at 4 x 4 blocks and N = 4096 is 4 MiB: loaded whole it
    asked for 4.2 MB of shared memory per block and did not lower."""
    f = flash("block_mask", 4096)
    text = f.loop_nest().pseudocode(memory=False)
    assert "bm[1024 1024] stays in HBM: gathered in place" in text and "load bm" not in text
    kernel = nc.lower(f, verify=False)
    assert "bm_s" not in kernel.source and "bm[rb=1024 cb=1024] f32 stays in global memory" in kernel.source
    assert kernel.launch.dynamic_smem_bytes < 100_000


def test_the_default_keeps_small_tables_whole_in_shared_memory():
    n_whole = loopnest.AUX_WHOLE_BYTES // 4     # float32 document ids
    for n, in_place in ((n_whole, False), (n_whole + 64, True)):
        ff = flash("document", n).loop_nest()
        (v,) = [k for k, a in enumerate(ff.diagram.dom) if a.name == "doc"]
        assert ff.in_place(v) is in_place, n
        assert ("load doc" in ff.pseudocode(memory=False)) is not in_place


def test_place_keeps_a_small_table_in_hbm_and_smem_loads_a_large_one_whole():
    small = flash("document", 64, tile=16).place("doc", "HBM")
    assert "doc[64] stays in HBM" in small.loop_nest().pseudocode(memory=False)
    big = flash("document", 8192).place("doc", "SMEM")
    assert "load doc[8192] -> SMEM" in big.loop_nest().pseudocode(memory=False)


def test_in_place_tables_are_not_counted_as_memory_the_kernel_holds():
    c = nc.cost(flash("block_mask", 4096))
    assert "HBM" not in c.memory or c.memory["HBM"] == 0


def test_place_of_an_input_that_is_not_gathered_is_refused_not_ignored():
    f = flash("document", 64, tile=16).place("K", "HBM")
    before = f.loop_nest().pseudocode(memory=False)
    with pytest.raises(LoweringError) as info:
        nc.lower(f, verify=False)
    msg = str(info.value)
    assert "place(K, 'HBM')" in msg and "auxiliary tensor" in msg and "K[x=64 d=64] f32" in msg
    assert f.loop_nest().pseudocode(memory=False) == before


# --------------------------------------------------------------------------- the cost model

def test_cost_counts_what_the_gathers_can_read_per_chunk_not_the_whole_table():
    n, t = 4096, 64
    c = nc.cost(flash("block_mask", n, tile=t))
    (bm,) = [m for m in c.moves if m.array == "bm"]
    assert (bm.upper, bm.kind) == ("HBM", "read")
    assert bm.per_exec == 17 * 17 and bm.execs == (n // t) ** 2     # 64 // 4 + 1 block rows and columns
    qkv = 2 * n * 64 + 2 * n * 64 * (n // t)     # Q, O once; K, V once per query tile
    assert c.transfers["HBM"] == qkv + 17 * 17 * (n // t) ** 2
    # a table in shared memory: one load per block, then per chunk what the mask reads of it
    c = nc.cost(flash("document", 4096))
    loads = {(m.kind, m.upper): (m.per_exec, m.execs) for m in c.moves if m.array == "doc"}
    assert loads[("load", "HBM")] == (4096, 64) and loads[("read", "SMEM")][0] == 128


# --------------------------------------------------------------------------- kernels (simulator)

@pytest.mark.parametrize("name", ["block_mask", "document", "gathered_biases"])
def test_in_place_kernels_match_the_gallery_reference(name):
    """The kernel with every auxiliary tensor in HBM against the variant's independent NumPy
    reference (ragged: 19 tokens in tiles of 8)."""
    v, n = VARIANTS[name], 19
    heads = {"gathered_biases": 4}.get(name)
    h, b = (nc.Axis("h", 4), nc.Axis("b", 2)) if heads else (None, None)
    att = build(v, q, x, d, n, heads=h, batch=b).bind({"q": n, "x": n, "d": 8})
    f = att.stream("x", 8).tile("q", 8)
    if heads:
        f = f.tile("h", 1).tile("b", 1)
    for a in att.dom[3:]:
        f = f.place(a.name, "HBM")
    kernel = nc.lower(f)     # its own self-check first
    assert kernel.source.count("stays in global memory") == len(att.dom) - 3
    rng = np.random.default_rng(0)
    shape = lambda arr: tuple(a.size for a in arr.axes)   # noqa: E731
    qkv = [rng.standard_normal(shape(a)).astype(np.float32) for a in att.dom[:3]]
    aux = v.aux(n, heads or 1, 2, rng)
    got = kernel(*qkv, *(aux[a.name] for a in att.dom[3:]))
    lead = (2, 4, 1) if heads else (1, 1, 1)       # reference_attention: Q[b kvh g q d]
    want = reference_attention(v, qkv[0].reshape(*lead, n, 8), qkv[1].reshape(*lead[:2], n, 8),
                               qkv[2].reshape(*lead[:2], n, 8), aux, 8 ** -0.5)
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, atol=2e-5, rtol=2e-5)


def test_torch_op_backward_reads_the_document_ids_in_place(monkeypatch):
    """Every part of the FlashAttention-2 backward gathers ``doc`` too: with the threshold at 0
    each kernel (forward, D, dK dV, dQ) reads it in global memory; gradients against torch
    autograd of the float64 oracle (ragged: 13 tokens in tiles of 4 and 8)."""
    import torch
    from napkin_cat.lowering.torch_op import torch_op
    monkeypatch.setattr(loopnest, "AUX_WHOLE_BYTES", 0)
    n = 13
    doc = nc.aux("doc", nc.Axis("n", n))
    att = nc.library.attention(q=q, x=x, d=d, mask=nc.mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)))
    op = torch_op(att.stream(x, "s_x").tile(q, "g_q"), simulate=True, backward="two kernels",
                  tiles={"g_x": 8, "s_q": 4, "g_q": 4, "s_x": 8})
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(n, 8, generator=g, requires_grad=True) for _ in range(3)]
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3], dtype=torch.float32)
    out = op(*qkv, ids)
    cot = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, qkv, cot)
    wide = [t.detach().double().requires_grad_() for t in qkv]
    want = torch.autograd.grad(nc.to_torch(op.diagram)(*wide, ids.double()), wide, cot.double())
    for name, a, b in zip("QKV", got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    assert op.last_backward_path == "simulator-fa2", op.notes
    kernels = [k for key, k in op._cache.items() if key[0] in ("backward kernel",)]
    gathering = [k for k in kernels if "doc" in k.source]
    assert len(gathering) == 2 and all("doc[n=13] f32 stays in global memory" in k.source for k in gathering)


# --------------------------------------------------------------------------- tables of each batch or head

def _batch_documents(B=2, n=37, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([np.cumsum(rng.random(n) < p) for p in np.linspace(0.1, 0.4, B)]).astype(np.float32)


def test_block_table_of_each_batch_is_each_sequences_own():
    B, n, blk = 3, 37, 8
    ids = _batch_documents(B, n)
    doc = nc.aux("doc", nc.Axis("nb", B), nc.Axis("n", n))
    m = nc.mask_mod(lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (j <= i))
    table = nc.block_table(m, n, n, blk, blk, {"doc": ids}, batch=B)
    assert table.shape == (B, 5, 5)
    one = nc.aux("one", nc.Axis("n", n))
    m1 = nc.mask_mod(lambda b, h, i, j: (one[i] == one[j]) & (j <= i))
    for k in range(B):
        np.testing.assert_array_equal(table[k], nc.block_table(m1, n, n, blk, blk, {"one": ids[k]}))
    import torch
    got = nc.block_table(m, n, n, blk, blk, {"doc": torch.tensor(ids)}, batch=B)
    np.testing.assert_array_equal(got.numpy(), table)
    # per head: a window of each head's own width
    wh = nc.aux("wh", nc.Axis("nh", 2))
    mh = nc.mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= wh[h]))
    th = nc.block_table(mh, n, n, blk, blk, {"wh": np.array([3.0, 20.0], np.float32)}, heads=2)
    assert th.shape == (2, 5, 5) and (th[0] == 0).sum() > (th[1] == 0).sum()


@pytest.mark.parametrize("kw, why", [({}, "pass batch="), ({"batch": 0}, "pass batch="),
                                     ({"batch": 2, "heads": 2}, "heads=2 would be ignored")])
def test_block_table_refuses_a_missing_or_ignored_count(kw, why):
    doc = nc.aux("doc", nc.Axis("nb", 2), nc.Axis("n", 8))
    m = nc.mask_mod(lambda b, h, i, j: doc[b, i] == doc[b, j])
    with pytest.raises(nc.NapkinError) as info:
        nc.block_table(m, 8, 8, 4, 4, {"doc": np.zeros((2, 8), np.float32)}, **kw)
    assert why in str(info.value)


def test_blocked_wants_a_table_axis_for_each_index_the_mask_reads():
    doc = nc.aux("doc", nc.Axis("nb", 2), nc.Axis("n", 8))
    m = nc.mask_mod(lambda b, h, i, j: doc[b, i] == doc[b, j])
    flat = nc.aux("bt", nc.Axis("rb", 2), nc.Axis("cb", 2))
    with pytest.raises(nc.NapkinError) as info:
        nc.blocked(m, flat, 4, 4)
    assert "needs 3 axes (batch, row blocks, column blocks)" in str(info.value)


@pytest.mark.parametrize("batch_tile, in_place", [(1, False), (1, True), (2, False)])
def test_kernels_skip_by_each_batchs_table(batch_tile, in_place):
    """A block holding one sequence reads that sequence's table (its chunks masked there are
    skipped); one holding two cannot, and evaluates the mask; both match the oracle."""
    B, n, blk = 2, 37, 8
    ids = _batch_documents(B, n)
    b = nc.Axis("b")
    doc = nc.aux("doc", nc.Axis("nb", B), nc.Axis("n", n))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[b_, i] == doc[b_, j]) & (j <= i))
    bt = nc.aux("bt", nc.Axis("tb", B), nc.Axis("rb", 5), nc.Axis("cb", 5))
    att = nc.library.attention(q=q, x=x, d=d, batch=b, mask=nc.blocked(m, bt, blk, blk))
    bound = att.bind({"q": n, "x": n, "d": 8, "b": B})
    f = bound.stream("x", 8).tile("q", 8).tile("b", batch_tile)
    if in_place:
        f = f.place("bt", "HBM").place("doc", "HBM")
    table = nc.block_table(m, n, n, blk, blk, {"doc": ids}, batch=B)
    kernel = nc.lower(f, verify=False)
    skips = "the block table masks the whole chunk: skipped" in kernel.source
    assert skips is (batch_tile == 1), kernel.source
    rng = np.random.default_rng(1)
    Q, K, V = (rng.standard_normal((B, n, 8)).astype(np.float32) for _ in range(3))
    from napkin_cat.verify import kernelcheck
    assert kernelcheck.kernel_outcome(bound, kernel, [Q, K, V, table, ids]).failure is None
    # the cost model with the tables' values counts the chunks every sequence masks as skipped
    assert nc.cost(f, data={"bt": table}).flops["tensor"] < nc.cost(f).flops["tensor"]


@pytest.mark.parametrize("group_tile", [1, 2])
def test_grouped_heads_read_the_table_of_their_query_head(group_tile):
    """Under grouped-query heads a mask's head index is the query head ``h * G + g``: a table of
    each query head (``block_table(..., heads=H * G)``) is read at that index where a block holds
    one key/value head and one group (its masked chunks skipped); a block holding two groups
    evaluates the mask.  Both match the oracle, with each head's own window."""
    H, G, n, blk = 2, 2, 37, 8
    h, g = nc.axes("h g")
    widths = np.array([3.0, 20.0, 9.0, 40.0], np.float32)      # one per query head
    wh = nc.aux("wh", nc.Axis("nh", H * G))
    m = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= wh[h_]))
    bt = nc.aux("bt", nc.Axis("th", H * G), nc.Axis("rb", 5), nc.Axis("cb", 5))
    att = nc.library.attention(q=q, x=x, d=d, heads=h, groups=g, mask=nc.blocked(m, bt, blk, blk))
    bound = att.bind({"q": n, "x": n, "d": 8, "h": H, "g": G})
    f = bound.stream("x", 8).tile("q", 8).tile("h", 1).tile("g", group_tile)
    table = nc.block_table(m, n, n, blk, blk, {"wh": widths}, heads=H * G)
    assert (table == 0).sum() > 0
    kernel = nc.lower(f, verify=False)
    skips = "the block table masks the whole chunk: skipped" in kernel.source
    assert skips is (group_tile == 1), kernel.source
    rng = np.random.default_rng(2)
    Q = rng.standard_normal((H, G, n, 8)).astype(np.float32)
    K, V = (rng.standard_normal((H, n, 8)).astype(np.float32) for _ in range(2))
    ins = {"Q": Q, "K": K, "V": V, "bt": table, "wh": widths}
    from napkin_cat.verify import kernelcheck
    assert kernelcheck.kernel_outcome(bound, kernel, [ins[a.name] for a in bound.dom]).failure is None
