"""Block tables derived when a kernel runs (``lowering/tabled.py``): a mask that reads data
(packed documents, a window of each head) lowers to a kernel that skips the chunks the data
masks whole, with the diagram's own inputs, as if the user had written ``nc.blocked`` with
``nc.block_table``; the table follows the data of each call."""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # kernels run in the simulator without a GPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering.tabled import TabledKernel, with_tables  # noqa: E402

q, x, d, h, g, b = nc.axes("q x d h g b")
SKIPPED = "the block table masks the whole chunk: skipped"


def _documents(n):
    doc = nc.aux("doc", nc.Axis("n", n))
    return nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))


def _qkv(rng, *shape):
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]


def test_a_mask_that_reads_data_gets_the_table_of_the_kernels_blocks():
    """Documents of 5, 3 and 4 tokens, tiles and chunks of 4: the kernel takes (Q, K, V, doc),
    derives the table of its own blocks (one entry per chunk), skips the chunks it masks and
    matches the oracle; the table is ``nc.block_table``'s."""
    n = 12
    m = _documents(n)
    att = nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4), threads=16)
    assert isinstance(kernel, TabledKernel) and kernel.verified
    assert [a.name for a in kernel.diagram.dom] == ["Q", "K", "V", "doc"]
    assert [a.name for a in kernel.inner.diagram.dom] == ["Q", "K", "V", "doc", "bt"]
    assert SKIPPED in kernel.source and "blocks of 4 x 4" in kernel.notes[-2]
    ids = np.repeat([0.0, 1.0, 2.0], [5, 3, 4]).astype(np.float32)
    (table,) = kernel.derive(*_qkv(np.random.default_rng(0), n, 4), ids)
    np.testing.assert_array_equal(table, nc.block_table(m, n, n, 4, 4, {"doc": ids}))
    np.testing.assert_array_equal(table, [[1, 0, 0], [1, 1, 0], [0, 0, 1]])
    rng = np.random.default_rng(1)
    for ids in (ids, np.arange(n, dtype=np.float32), np.zeros(n, np.float32)):   # each call its own table
        Q, K, V = _qkv(rng, n, 4)
        np.testing.assert_allclose(kernel(Q, K, V, ids), nc.evaluate(att, Q, K, V, ids), atol=1e-5)
    assert nc.check_equivalent(att, kernel, examples=3)


def test_tables_follow_ragged_blocks_and_the_kernels_own_choice():
    """Sizes that are not multiples of the blocks, blocks nc.lower chooses itself: the table has
    the kernel's blocks (rows by its tile, columns by its chunk)."""
    n = 19
    m = _documents(n)
    att = nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 3).tile("q", 5), threads=16)
    (t,) = kernel.tables
    assert (t.rows, t.cols) == (5, 3) and kernel.inner.diagram.dom[-1].axes[0].size == 4
    ids = np.cumsum(np.random.default_rng(2).random(n) < 0.25).astype(np.float32)
    Q, K, V = _qkv(np.random.default_rng(3), n, 4)
    np.testing.assert_allclose(kernel(Q, K, V, ids), nc.evaluate(att, Q, K, V, ids), atol=1e-5)
    chosen = nc.lower(att, threads=16)
    assert isinstance(chosen, TabledKernel)
    np.testing.assert_allclose(chosen(Q, K, V, ids), nc.evaluate(att, Q, K, V, ids), atol=1e-5)


def test_prepare_derives_the_table_once_for_the_arrays_it_binds():
    n = 8
    att = nc.library.attention(q=q, x=x, d=d, mask=_documents(n)).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4), threads=16, verify=False)
    Q, K, V = _qkv(np.random.default_rng(4), n, 4)
    ids = np.repeat([0.0, 1.0], 4).astype(np.float32)
    out = np.zeros((n, 4), np.float32)
    run = kernel.prepare(Q, K, V, ids, out=out)
    run()
    np.testing.assert_allclose(out, nc.evaluate(att, Q, K, V, ids), atol=1e-5)


def test_a_table_of_each_sequence_and_of_each_query_head():
    """A mask reading the batch index (each sequence its documents) gets a table of each
    sequence; one reading the query head under grouped heads (a window of each) a table of each
    key/value head and group; a block holding one of each reads its slice and skips."""
    B, n = 2, 13
    doc = nc.aux("doc", nc.Axis("nb", B), nc.Axis("n", n))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[b_, i] == doc[b_, j]) & (j <= i))
    att = nc.library.attention(q=q, x=x, d=d, batch=b, mask=m).bind({q: n, x: n, d: 4, b: B})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4).tile("b", 1), threads=16)
    assert kernel.tables[0].leads == (B,) and SKIPPED in kernel.source
    ids = np.stack([np.repeat([0.0, 1.0], [3, 10]), np.repeat([0.0, 1.0, 2.0], [6, 4, 3])]).astype(np.float32)
    Q, K, V = _qkv(np.random.default_rng(5), B, n, 4)
    np.testing.assert_allclose(kernel(Q, K, V, ids), nc.evaluate(att, Q, K, V, ids), atol=1e-5)
    H, G = 2, 2
    w = nc.aux("w", nc.Axis("nh", H * G))
    win = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= w[h_]))
    gqa = nc.library.attention(q=q, x=x, d=d, heads=h, groups=g, mask=win).bind({q: n, x: n, d: 4, h: H, g: G})
    kernel = nc.lower(gqa.stream("x", 4).tile("q", 4).tile("h", 1).tile("g", 1), threads=16)
    assert kernel.tables[0].leads == (H, G) and SKIPPED in kernel.source
    widths = np.array([0.0, 3.0, 6.0, 12.0], np.float32)
    rng = np.random.default_rng(6)
    Q = rng.standard_normal((H, G, n, 4)).astype(np.float32)
    K, V = (rng.standard_normal((H, n, 4)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(kernel(Q, K, V, widths), nc.evaluate(gqa, Q, K, V, widths), atol=1e-5)
    (table,) = kernel.derive(Q, K, V, widths)
    assert table.shape == (H, G, 4, 4) and (table[0, 0] == 0).sum() > (table[1, 1] == 0).sum()


def test_masks_that_need_no_table_are_left_alone():
    """A mask without data, one reading its table already (``nc.blocked``), a bias that reads
    data: no table derived; a diagram's two masks that are the same mask share one."""
    n = 8
    causal = nc.library.attention(q=q, x=x, d=d, causal=True).bind({q: n, x: n, d: 4})
    assert with_tables(nc.lower(causal.stream("x", 4).tile("q", 4), verify=False).diagram)[1] == ()
    bias = nc.aux("tb", nc.Axis("n", n))
    biased = nc.library.attention(q=q, x=x, d=d, bias=nc.bias_mod(lambda b_, h_, i, j: bias[j])).bind({q: n, x: n, d: 4})
    assert not isinstance(nc.lower(biased.stream("x", 4).tile("q", 4), threads=16, verify=False), TabledKernel)
    m = _documents(n)
    bt = nc.aux("bt", nc.Axis("rb", 2), nc.Axis("cb", 2))
    own = nc.library.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, 4, 4)).bind({q: n, x: n, d: 4})
    assert not isinstance(nc.lower(own.stream("x", 4).tile("q", 4), threads=16, verify=False), TabledKernel)
    from napkin_cat.lowering.torch_op import backward_plan
    fl = nc.library.attention(q=q, x=x, d=d, mask=m).stream(x, 4).tile(q, 4)
    part = next(p for p in backward_plan(fl, form="one kernel").parts if any(e.box.kind == "mask" for e in p.eqns))
    part = part.bind({a: n for a, n in {q: n, x: n, d: 4}.items() if a.name in {ax.name for ax in part.axes}})
    part = nc.lower(part, threads=16, verify=False).diagram
    two, tables = with_tables(part)
    assert sum(e.box.kind == "mask" for e in part.eqns) == 2 and len(tables) == 1
    assert len(two.dom) == len(part.dom) + 1


def test_a_tabled_kernel_refuses_what_it_cannot_read():
    n = 8
    att = nc.library.attention(q=q, x=x, d=d, mask=_documents(n)).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4), threads=16, verify=False)
    Q, K, V = _qkv(np.random.default_rng(7), n, 4)
    with pytest.raises(nc.NapkinError, match=r"takes 4 arrays \(Q, K, V, doc\), got 3"):
        kernel(Q, K, V)
    with pytest.raises(nc.NapkinError, match=r"input doc\[n=8\] f32: expected shape \(8,\), got \(7,\)"):
        kernel(Q, K, V, np.zeros(7, np.float32))
    with pytest.raises(nc.NapkinError, match=r"input doc\[n=8\] f32: expected a numpy array.*got list"):
        kernel(Q, K, V, [0.0] * 8)
    ids = np.zeros(8, bool)
    with pytest.raises(nc.NapkinError, match=r"input doc\[n=8\] f32: expected a real .* got dtype bool"):
        kernel(Q, K, V, ids)
    assert not ids.any()   # nothing mutated


def test_ids_that_f32_would_merge_are_refused_with_their_size():
    """Ids travel to the kernel in f32, exact for integers up to 2**24: beyond, 2**24 and
    2**24 + 1 would be one document. Integer and float64 ids are read once per table made."""
    n = 8
    att = nc.library.attention(q=q, x=x, d=d, mask=_documents(n)).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4), threads=16, verify=False)
    Q, K, V = _qkv(np.random.default_rng(7), n, 4)
    big = np.repeat(np.array([2 ** 24, 2 ** 24 + 1], np.int64), 4)
    for ids in (big, big.astype(np.float64), -big):
        with pytest.raises(nc.NapkinError, match=r"input doc \((int64|float64)\): its values reach 16777217.*2\*\*24"):
            kernel(Q, K, V, ids)
        assert ids[-1] in (2 ** 24 + 1, -(2 ** 24 + 1))   # nothing mutated
    ok = np.repeat(np.array([2 ** 24 - 1, 2 ** 24], np.int64), 4)   # exact in f32: two documents
    np.testing.assert_allclose(kernel(Q, K, V, ok), nc.evaluate(att, Q, K, V, ok.astype(np.float64)), atol=1e-5)
    import torch
    op = nc.torch_op(att.stream("x", 4).tile("q", 4), verify=False)
    with pytest.raises(nc.NapkinError, match=r"its values reach 16777217"):
        op(*(torch.from_numpy(t) for t in (Q, K, V)), torch.from_numpy(big))


def test_torch_op_backward_reads_derived_tables():
    """Training through ``nc.torch_op``: forward and backward kernels each derive their table
    (the backward's key tiles by query chunks, one table for both of its masks); the gradients
    match the float64 oracle's."""
    import torch
    n = 12
    flash = nc.library.attention(q=q, x=x, d=d, mask=_documents(n)).stream(x, 4).tile(q, 4)
    op = nc.torch_op(flash)
    ids = torch.tensor(np.repeat([0.0, 1.0, 2.0], [5, 3, 4]), dtype=torch.float32)
    qkv = [torch.randn(n, 4, generator=torch.Generator().manual_seed(k), requires_grad=True) for k in range(3)]
    cot = torch.randn(n, 4, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad(op(*qkv, ids), qkv, cot)
    wide = [t.detach().double().requires_grad_() for t in qkv]
    want = torch.autograd.grad(nc.to_torch(op.diagram)(*wide, ids.double()), wide, cot.double())
    for name, a, w in zip("QKV", got, want):
        torch.testing.assert_close(a.double(), w, rtol=0, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    if not op.last_backward_path.startswith("simulator"):   # CPU tensors on a GPU machine: the executor
        return
    tabled = [k for key, k in op._cache.items() if isinstance(k, TabledKernel)]
    assert len(tabled) >= 2 and all(len(k.tables) == 1 for k in tabled), op.notes
    assert any(k.tables[0].rows != k.tables[0].cols or "stream(q" in k.diagram._sched_str() for k in tabled)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_derived_tables_on_tensor_cores_in_the_simulator(dtype):
    """A 16-bit document mask (tiles and chunks of 16, one warp, mma fragments simulated):
    the derived table is in the data's dtype, chunks are skipped, the result within rounding."""
    from napkin_cat.ops.arrays import round_to_dtype
    n, dd = 48, 16
    m = _documents(n)
    att = nc.library.attention(q=q, x=x, d=d, mask=m, dtype=getattr(nc, dtype)).bind({q: n, x: n, d: dd})
    kernel = nc.lower(att.stream("x", 16).tile("q", 16), threads=32, verify=1)
    assert isinstance(kernel, TabledKernel) and SKIPPED in kernel.source and "mma" in kernel.source
    ids = np.repeat([0.0, 1.0, 2.0], [20, 9, 19]).astype(np.float32)
    rng = np.random.default_rng(8)
    Q, K, V = (round_to_dtype(rng.standard_normal((n, dd)), dtype) for _ in range(3))
    ref = nc.evaluate(nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: dd}), Q, K, V, ids)
    import torch
    t = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    out = kernel(*(torch.tensor(a).to(t) for a in (Q, K, V, ids)))
    assert (out.double().numpy() - ref).__abs__().max() < 1e-2


def test_tables_of_torch_tensors_are_kept_by_identity_and_version():
    """The same tensor twice: one derivation; an in-place change (a new version) or another
    tensor: a new table, so no call reads a table of other data."""
    import torch
    from napkin_cat.lowering import tabled
    n = 8
    att = nc.library.attention(q=q, x=x, d=d, mask=_documents(n)).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4), threads=16, verify=False)
    Q, K, V = (torch.tensor(a) for a in _qkv(np.random.default_rng(9), n, 4))
    ids = torch.tensor(np.repeat([0.0, 1.0], 4), dtype=torch.float32)
    calls = []
    spec = kernel.tables[0]
    real = type(spec).values
    try:
        type(spec).values = lambda self, arrays: calls.append(1) or real(self, arrays)
        first = kernel.derive(Q, K, V, ids)[0]
        assert kernel.derive(Q, K, V, ids)[0] is first and len(calls) == 1
        ids[4:] = 0.0        # one document now: the table must change
        np.testing.assert_array_equal(kernel.derive(Q, K, V, ids)[0].numpy(), [[1, 0], [2, 1]])
        assert len(calls) == 2
        out = kernel(Q, K, V, ids)
        torch.testing.assert_close(out.double(), torch.tensor(nc.evaluate(att, Q.numpy(), K.numpy(), V.numpy(),
                                                                           ids.numpy())), atol=1e-5, rtol=0)
        kernel.derive(Q, K, V, ids.clone())
        assert len(calls) == 3
    finally:
        type(spec).values = real
    assert len(tabled._TABLES) <= tabled.CACHED


def test_a_kept_table_keeps_its_tensors_so_their_memory_is_not_reused():
    """A tensor freed and another allocated at its address (torch's allocator reuses memory)
    with version 0 again would name the same data: the kept entry holds the tensor, so that
    address cannot be handed out while the entry lives."""
    import torch
    from napkin_cat.lowering import tabled
    n = 8
    att = nc.library.attention(q=q, x=x, d=d, mask=_documents(n)).bind({q: n, x: n, d: 4})
    kernel = nc.lower(att.stream("x", 4).tile("q", 4), threads=16, verify=False)
    Q, K, V = (torch.tensor(a) for a in _qkv(np.random.default_rng(10), n, 4))
    kernel.derive(Q, K, V, torch.zeros(n))
    held = [v[2] for v in tabled._TABLES.values()]
    assert any(len(t) == 1 and t[0].shape == (n,) for t in held)
    (table,) = kernel.derive(Q, K, V, torch.arange(n, dtype=torch.float32))
    np.testing.assert_array_equal(table.numpy(), [[1, 0], [0, 1]])


def test_the_cost_model_counts_what_a_derived_table_skips_given_the_data():
    """``nc.cost(d, data={"doc": ids})`` counts the chunks the table a kernel derives masks (the
    same count as the user's own table); without the ids it counts the mask's data-free bound
    and says why."""
    n = 12
    m = _documents(n)
    att = nc.library.attention(q=q, x=x, d=d, mask=m).bind({q: n, x: n, d: 4}).stream("x", 4).tile("q", 4)
    ids = np.repeat([0.0, 1.0, 2.0], [5, 3, 4]).astype(np.float32)
    blind, known = nc.cost(att), nc.cost(att, data={"doc": ids})
    assert known.flops["tensor"] * 6 == blind.flops["tensor"] * 4   # 4 of the 6 chunks
    assert [t.split(":")[0] for t in known.notes] == ["the block table of mask (doc[q] == doc[x]) & (x <= q) "
                                                      "is derived at a launch on new doc"]
    assert "a mask reads 'doc'" in blind.notes[0] and "data={'doc': values}" in blind.notes[0]
    bt = nc.aux("bt", nc.Axis("rb", 3), nc.Axis("cb", 3))
    own = nc.library.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, 4, 4)).bind({q: n, x: n, d: 4})
    table = nc.block_table(m, n, n, 4, 4, {"doc": ids})
    assert nc.cost(own.stream("x", 4).tile("q", 4), data={"bt": table}).flops["tensor"] == known.flops["tensor"]
    symbolic = nc.library.attention(q=q, x=x, d=d, mask=m).stream(x, "s").tile(q, "t")
    assert nc.cost(symbolic, data={"doc": ids}).flops["tensor"] is not None   # symbolic blocks: no table, no error


# --------------------------------------------------------------------------- tables from bounds over blocks

from hypothesis import given, settings, strategies as st  # noqa: E402


def _atoms(doc, k):
    from napkin_cat.ops.index_expr import ix
    return [lambda i, j: doc[i] == doc[j], lambda i, j: doc[i] != doc[j], lambda i, j: j <= i + k,
            lambda i, j: i - j <= k, lambda i, j: abs(i - j) < k, lambda i, j: i // 3 == j // (k % 4 + 1),
            lambda i, j: i % (k % 5 + 1) < 2, lambda i, j: doc[i] < doc[j] + k / 2,
            lambda i, j: ix.where(doc[j] > k, i, j) >= k, lambda i, j: ix.minimum(i, j * 2) > k,
            lambda i, j: doc[i] * doc[j] >= k - 3, lambda i, j: -doc[j] <= doc[i] - k]


@st.composite
def _masks(draw, doc):
    k = draw(st.integers(-3, 9), label="k")
    atoms = _atoms(doc, k)
    f = atoms[draw(st.integers(0, len(atoms) - 1), label="atom")]
    for _ in range(draw(st.integers(0, 2), label="joins")):
        g_ = atoms[draw(st.integers(0, len(atoms) - 1), label="atom")]
        how = draw(st.sampled_from(("and", "or", "not-and")), label="join")
        f = ((lambda f, g_: lambda i, j: f(i, j) & g_(i, j)) if how == "and" else
             (lambda f, g_: lambda i, j: f(i, j) | g_(i, j)) if how == "or" else
             (lambda f, g_: lambda i, j: ~f(i, j) & g_(i, j)))(f, g_)
    return nc.mask_mod(lambda b_, h_, i, j: f(i, j))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_tables_from_bounds_never_contradict_the_entries(data):
    """A block the bounds call masked (kept) has every entry masked (kept), for masks built from
    gathers, arithmetic, comparisons, ``where``, ``min`` and logic, on data in order, in no order,
    with ties, NaN and infinities, ragged blocks; in order (document ids) a document mask's table
    is the exact one."""
    from napkin_cat.ops.block_table import _namespace, _table
    from napkin_cat.ops.derived_tables import interval_table
    nr, nc_ = data.draw(st.integers(1, 40), label="rows"), data.draw(st.integers(1, 40), label="cols")
    rows, cols = data.draw(st.integers(1, 12), label="row block"), data.draw(st.integers(1, 12), label="col block")
    size = max(nr, nc_) + data.draw(st.integers(-3, 3), label="doc length")
    doc = nc.aux("doc", nc.Axis("n", max(size, 1)))
    m = data.draw(_masks(doc), label="mask")
    rng = np.random.default_rng(data.draw(st.integers(0, 1000), label="seed"))
    kind = data.draw(st.sampled_from(("ordered", "ties", "floats", "special")), label="data")
    n = max(size, 1)
    ids = {"ordered": np.cumsum(rng.random(n) < 0.3), "ties": rng.integers(0, 3, n),
           "floats": rng.standard_normal(n) * 4,
           "special": np.where(rng.random(n) < 0.2, rng.choice([np.nan, np.inf, -np.inf], n), rng.integers(0, 4, n))}[kind]
    ids = ids.astype(np.float32)
    env = {"doc": ids}
    xp, like = _namespace(env)
    with np.errstate(all="ignore"):   # inf * 0 in the entries themselves
        exact = _table(m.expr, nr, nc_, rows, cols, env, xp, like)
    bounded = interval_table(m.expr, nr, nc_, rows, cols, env, xp, like)
    assert bounded is not None, m
    assert bounded.shape == exact.shape
    assert np.all(exact[bounded == 0] == 0), (m, bounded, exact)
    assert np.all(exact[bounded == 2] == 2), (m, bounded, exact)


def test_tables_from_bounds_of_documents_and_windows_are_exact_and_fall_back_where_they_cannot_bound():
    import torch
    from napkin_cat.ops.block_table import _namespace, _table
    from napkin_cat.ops.derived_tables import interval_table
    n = 300
    m = _documents(n)
    ids = np.cumsum(np.random.default_rng(3).random(n) < 0.02).astype(np.float32)
    for arr in (ids, torch.tensor(ids)):
        xp, like = _namespace({"doc": arr})
        got = interval_table(m.expr, n, n, 32, 24, {"doc": arr}, xp, like)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_table(m.expr, n, n, 32, 24, {"doc": arr}, xp, like)))
    w = nc.aux("w", nc.Axis("nh", 4))   # a window of each head: one entry per block, bounded exactly
    win = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= w[h_]))
    widths = np.array([0.0, 20.0, 45.0, 300.0], np.float32)
    for head in range(4):
        env = {"w": widths, "h": head}
        got = interval_table(win.expr, n, n, 32, 24, env, *_namespace({"w": widths}))
        assert got is not None
        np.testing.assert_array_equal(got, _table(win.expr, n, n, 32, 24, env, *_namespace({"w": widths})))
    doc = nc.aux("doc", nc.Axis("n", n))
    xp, like = _namespace({"doc": ids})
    bits = nc.mask_mod(lambda b_, h_, i, j: (i ^ j) < 8)   # no bounds for xor: the entries decide
    assert interval_table(bits.expr, n, n, 32, 32, {}, xp, like) is None
    atts = nc.library.attention(q=q, x=x, d=d, mask=bits).bind({q: n, x: n, d: 4})
    k = nc.lower(atts.stream("x", 32).tile("q", 32), threads=16, verify=False)
    assert not isinstance(k, TabledKernel)   # no data: a support of its own (or none), no table
    assert doc is not None


@pytest.mark.slow
def test_grouped_heads_backward_reads_a_table_of_each_head_and_group():
    """A causal window of each query head under GQA, written with its widths only: the forward
    and both backward kernels of ``nc.torch_op`` (the key-tile one streaming the groups one at a
    time) derive a table of each key/value head and group; gradients match float64."""
    import torch
    H, G, n = 2, 2, 12
    w = nc.aux("w", nc.Axis("nh", H * G))
    win = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= w[h_]))
    flash = nc.library.attention(q=q, x=x, d=d, heads=h, groups=g, mask=win).stream(x, 4).tile(q, 4).tile(h, 1)
    op = nc.torch_op(flash)
    widths = torch.tensor([0.0, 3.0, 5.0, 11.0])
    gen = torch.Generator().manual_seed(0)
    Q = torch.randn(H, G, n, 4, generator=gen, requires_grad=True)
    K, V = (torch.randn(H, n, 4, generator=gen, requires_grad=True) for _ in range(2))
    cot = torch.randn(H, G, n, 4, generator=gen)
    got = torch.autograd.grad(op(Q, K, V, widths), (Q, K, V), cot)
    wide = [t.detach().double().requires_grad_() for t in (Q, K, V)]
    want = torch.autograd.grad(nc.to_torch(op.diagram)(*wide, widths.double()), wide, cot.double())
    for name, a, b_ in zip("QKV", got, want):
        torch.testing.assert_close(a.double(), b_, rtol=0, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    if not op.last_backward_path.startswith("simulator"):   # CPU tensors on a GPU machine: the executor
        return
    tabled = [k for k in op._cache.values() if isinstance(k, TabledKernel)]
    assert len(tabled) == 3 and all(k.tables[0].leads == (H, G) for k in tabled)
    assert any("stream(g, 1)" in k.diagram._sched_str() for k in tabled)


def test_ids_and_tables_go_whole_into_blocks_that_have_the_shared_memory_to_spare(monkeypatch):
    """Planned for a GPU (nothing compiled) at N = 16384, as measured (kernels/BENCHMARKS.md): the
    document ids (64 KiB) and the block table exceed ``AUX_WHOLE_BYTES``; the one-kernel backward
    runs one block per SM by its registers, so both are loaded whole into it; the forward's
    128-thread blocks (two per SM) would lose one, so that form reads them in place; a placement of the user's is kept, and
    ``aux_whole.SWITCH = False`` leaves the size alone to decide."""
    import torch

    from napkin_cat import lowering
    from napkin_cat.lowering import aux_whole
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    n = 16384
    flash = nc.library.attention(q=q, x=x, d=d, heads=h, mask=_documents(n)).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    op = nc.torch_op(flash, verify=False)
    sizes = (("h", 2), ("q", n), ("x", n), ("d", 64))
    plan = op.backward_plan((0, 1, 2), sizes, torch.float16, torch.device("cpu"))
    part = next(p for p in plan.parts if "dK" in {a.name for a in p.cod})

    def shared(kernel):
        return next(ln for ln in kernel.source.splitlines() if ln.startswith("Shared memory:"))
    back = nc.lower(part, verify=False, prefetch="auto")
    assert "doc_s[16384]" in shared(back) and "bt_s[" in shared(back), shared(back)
    assert any(m.startswith("Loaded whole into each block") and "doc (65536 B)" in m for m in back.notes), back.notes
    # the forward's two forms (lowering/tabled.py, TableChoice): the 128-row one reads them in place; four
    # warpgroups, one block per SM by its shared memory anyway, load them whole
    short, tall = nc.lower(op.typed(torch.float16).bind(dict(sizes)), verify=False, prefetch="auto").forms
    assert "doc_s" not in shared(short) and not any("Loaded whole" in m for m in short.notes)
    assert "doc_s[16384]" in shared(tall) and any("doc (65536 B)" in m for m in tall.notes)
    mine = nc.lower(part.place("doc", "HBM"), verify=False, prefetch="auto")
    assert "doc_s" not in shared(mine) and "bt_s[" in shared(mine)
    monkeypatch.setattr(aux_whole, "SWITCH", False)
    assert "doc_s" not in shared(nc.lower(part, verify=False, prefetch="auto"))
