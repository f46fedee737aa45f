"""The generated kernel that fills a derived block table (``lowering/table_kernel.py``), against
the mask's NumPy meaning, in the simulator; and the auxiliary tensors a mask compares, read
exactly (``nc.aux``'s dtype rule)."""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # kernels run in the simulator without a GPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering.table_kernel import table_kernel  # noqa: E402
from napkin_cat.ops.block_table import _namespace, _table  # noqa: E402
from napkin_cat.ops.derived_tables import DerivedTable  # noqa: E402

from test_derived_tables import _masks  # noqa: E402

q, x, d, h, g, b = nc.axes("q x d h g b")


def _spec(expr, nr, nc_, rows, cols, dtype="f32", leads=()):
    return DerivedTable("t", expr, nr, nc_, rows, cols, leads, (("doc", 0),), (), (), dtype)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_the_table_kernel_is_the_masks_table(data):
    """Masks of gathers, arithmetic, comparisons, ``where``, ``min`` and logic, on ids in order,
    in no order, with ties, NaN and infinities, ragged blocks, each table dtype: the generated
    kernel's table is the NumPy meaning's, block by block."""
    nr, nc_ = data.draw(st.integers(1, 24), label="rows"), data.draw(st.integers(1, 24), label="cols")
    rows, cols = data.draw(st.integers(3, 9), label="row block"), data.draw(st.integers(3, 9), label="col block")
    n = max(nr, nc_) + data.draw(st.integers(0, 3), label="doc slack")
    doc = nc.aux("doc", nc.Axis("n", n))
    m = data.draw(_masks(doc), label="mask")
    rng = np.random.default_rng(data.draw(st.integers(0, 1000), label="seed"))
    kind = data.draw(st.sampled_from(("ordered", "ties", "floats", "special")), label="data")
    ids = {"ordered": np.cumsum(rng.random(n) < 0.3), "ties": rng.integers(0, 3, n),
           "floats": rng.standard_normal(n) * 4,
           "special": np.where(rng.random(n) < 0.2, rng.choice([np.nan, np.inf, -np.inf], n),
                               rng.integers(0, 4, n))}[kind].astype(np.float32)
    spec = _spec(m.expr, nr, nc_, rows, cols, data.draw(st.sampled_from(("f32", "f16", "bf16")), label="dtype"))
    env = {"doc": ids}
    xp, like = _namespace(env)
    with np.errstate(all="ignore"):
        want = _table(m.expr, nr, nc_, rows, cols, env, xp, like)
    got = table_kernel(spec, (ids,)).numpy([ids])
    np.testing.assert_array_equal(got, want, err_msg=f"{m.expr} on {ids}")


def test_bounds_decide_every_block_they_can_and_leave_the_rest_to_the_entries():
    """Documents of 16 tokens, blocks of 8: the bounds over each block (``ops/interval_expr.py``)
    decide every block but the diagonal's, which the causal bound keeps partial. Shown by a
    kernel whose entry pass is replaced by a marker (7): only the diagonal blocks reach it; a mask
    the bounds cannot follow (``exp2``) has no bound pass."""
    from napkin_cat.lowering import table_kernel as tk
    from napkin_cat.lowering.runtime import Launcher, compile_kernel
    doc = nc.aux("doc", nc.Axis("n", 64))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    spec = _spec(m.expr, 64, 64, 8, 8)
    src = tk.table_source(spec, {"doc": (64,)}, 8)
    marked = src.replace("    some = False\n", "    if tid == 0:\n        T[r * 8 + c] = float32(7.0)\n    return\n"
                         "    some = False\n", 1)
    assert marked != src and "decided by the bounds" in src
    out = np.zeros(64, np.float32)
    Launcher(compile_kernel(marked, "napkin_table"), (8, 8, 1), 8)(out, np.repeat(np.arange(4.0), 16).astype(np.float32))
    want = np.kron(np.eye(4), [[0, 0], [2, 0]]) + 7 * np.eye(8)
    np.testing.assert_array_equal(out.reshape(8, 8), want)
    soft = nc.mask_mod(lambda b_, h_, i, j: nc.ix.exp2(doc[i] - doc[j]) <= 1.5)
    assert "decided by the bounds" not in tk.table_source(_spec(soft.expr, 64, 64, 8, 8), {"doc": (64,)}, 8)


def test_tables_of_each_sequence_from_the_kernel():
    """A mask reading the batch index: one table per sequence, the grid's third axis."""
    B, n = 3, 11
    doc = nc.aux("doc", nc.Axis("nb", B), nc.Axis("n", n))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[b_, i] == doc[b_, j]) & (j <= i))
    att = nc.library.attention(q=q, x=x, d=d, batch=b, mask=m).bind({q: n, x: n, d: 4, b: B})
    kernel = nc.lower(att.stream("x", 3).tile("q", 4).tile("b", 1), threads=16, verify=False)
    (spec,) = kernel.tables
    assert spec.leads == (B,)
    ids = np.stack([np.repeat([0, 1], [3, 8]), np.repeat([0, 1, 2], [6, 4, 1]), np.zeros(n)]).astype(np.float32)
    Q, K, V = (np.zeros((B, n, 4), np.float32) for _ in range(3))
    got = table_kernel(spec, (Q, K, V, ids)).numpy([ids])
    np.testing.assert_array_equal(got, spec.values((Q, K, V, ids)))
    assert got.shape == (B, 3, 4) and (got[2] == 2).sum() > (got[0] == 2).sum()


def test_the_table_kernel_source_reads_the_masks_own_code():
    """One definition: the mask's code is :meth:`Ix.to_code`'s, the gathers clamped as the
    kernels read them, the reductions ``syncthreads_or`` / ``syncthreads_and``; the blocks the
    mask's data-free bound masks are not evaluated."""
    doc = nc.aux("doc", nc.Axis("n", 8))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    k = table_kernel(_spec(m.expr, 8, 8, 4, 4, "bf16"), (np.zeros(8, np.float32),))
    assert "A_doc[min(max(i, 0), 7)]" in k.source and "(j <= i)" in k.source
    assert "syncthreads_or" in k.source and "int16(16256)" in k.source   # bf16's 1.0
    # the blocks above the diagonal are masked whatever the ids: written at once (a static table)
    assert "if S[r * 2 + c] == 0.0:" in k.source and k.static.tolist() == [[1.0, 0.0], [2.0, 1.0]]


# ---------------------------------------------------------------- the compared auxiliary tensors

@pytest.mark.parametrize("dtype", [nc.f16, nc.bf16])
def test_ids_a_mask_compares_are_read_exactly_in_16_bit_attention(dtype):
    """Document ids 257, 258, ... are one value in bf16 (and 2049, 2050 in f16): a 16-bit copy of
    the ids attended across documents (error 2.8 in bf16 before the rule).  The ids are an f32
    input of the diagram and the kernel; the table a 16-bit one."""
    n = 24
    doc = nc.aux("doc", nc.Axis("n", n))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    att = nc.library.attention(q=q, x=x, d=d, mask=m, dtype=dtype).bind({q: n, x: n, d: 16})
    assert [a.dtype.name for a in att.dom] == [dtype.name] * 3 + ["f32"]
    kernel = nc.lower(att.stream("x", 8).tile("q", 16), verify=False)
    assert kernel.inner.in_io[-2:] == ("f32", dtype.name)
    rng = np.random.default_rng(3)
    Q, K, V = (rng.standard_normal((n, 16)).astype(np.float32) for _ in range(3))
    ids = (np.arange(n) // 3 + (2049 if dtype == nc.f16 else 257)).astype(np.float32)
    want = nc.evaluate(att, Q, K, V, ids)
    np.testing.assert_allclose(np.asarray(kernel(Q, K, V, ids), np.float32), want, atol=3e-2)


def test_values_added_to_scores_keep_the_attentions_dtype_and_a_given_dtype_is_kept():
    """A bias table (``rel[...]`` added to the scores) is not compared: it stays 16-bit, as the
    scores; a dtype given to ``nc.aux`` is the input's; anything else is refused."""
    rel = nc.aux("rel", nc.Axis("r", 31))
    bias = nc.score_mod(lambda s, b_, h_, i, j: s + rel[i - j + 15])
    att = nc.library.attention(q=q, x=x, d=d, score_mod=bias, dtype=nc.f16)
    assert att.dom[-1].dtype == nc.f16
    w = nc.aux("w", nc.Axis("nh", 4), dtype=nc.f16)
    win = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= w[h_]))
    att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=win, dtype=nc.bf16)
    assert att.dom[-1].dtype == nc.f16
    with pytest.raises(nc.NapkinError, match=r"aux doc: dtype must be one of nc.f32.*got 'int32'"):
        nc.aux("doc", nc.Axis("n", 4), dtype="int32")


def _gpu() -> bool:
    from napkin_cat.lowering.runtime import simulator_active
    import torch
    return not simulator_active() and torch.cuda.is_available()


def test_tables_of_cuda_tensors_come_from_the_kernel_checked_at_its_first_table():
    """On a GPU (skipped elsewhere): a TabledKernel on CUDA tensors makes its table by the
    generated kernel, checked once against the torch meaning; the attention matches the oracle."""
    import torch
    if not _gpu():
        pytest.skip("needs a GPU (the simulator's path is the NumPy one)")
    from napkin_cat.lowering import table_kernel as tk
    n = 300
    doc = nc.aux("doc", nc.Axis("n", n))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=m, dtype=nc.bf16).bind({q: n, x: n, d: 64, h: 2})
    kernel = nc.lower(att)
    ids = torch.tensor(np.sort(np.random.default_rng(1).integers(0, 40, n)) + 300, device="cuda")
    Q, K, V = (torch.randn(2, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (table,) = kernel.derive(Q, K, V, ids)
    compiled = tk.table_kernel(kernel.tables[0], (Q, K, V, ids))
    assert compiled.checked and table.dtype == torch.bfloat16
    assert torch.equal(table.float(), kernel.tables[0].values((Q, K, V, ids)).float())
    want = nc.evaluate(att, *(t.float().cpu().numpy() for t in (Q, K, V, ids)))
    got = kernel(Q, K, V, ids).float().cpu().numpy()
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    again = kernel(Q, K, V, ids.clone())   # the packed launch, the int64 ids converted there; a new table
    assert kernel.inner._fast is not None and np.array_equal(again.float().cpu().numpy(), got)


def test_torch_op_takes_integer_ids_and_keeps_them_exact_in_bf16():
    """``nc.torch_op`` of a document mask: the ids may be an integer tensor beside bf16 Q, K, V
    (every other input still has the op's one dtype); forward and backward kernels (simulator)
    read them as f32, so ids 257, 258, ... stay apart; gradients match float64."""
    import torch
    sim = not _gpu()
    where = "cpu" if sim else "cuda"   # the simulator here, the kernels on a GPU
    n = 24
    dd = nc.aux("doc", nc.Axis("n", n))
    mask = nc.mask_mod(lambda b_, h_, i, j: (dd[i] == dd[j]) & (j <= i))
    att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=mask)
    op = nc.torch_op(att.stream(x, 8).tile(q, 16).tile(h, 1), simulate=True if sim else None)
    ids = (torch.arange(n) // 3 + 257).to(where)
    gen = torch.Generator().manual_seed(0)
    Q, K, V, dO = (torch.randn(2, n, 16, generator=gen).to(where, torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    grads = torch.autograd.grad(op(*leaves, ids), leaves, dO)
    path = "simulator" if sim else "gpu"
    assert (op.last_path, op.last_backward_path[:len(path)]) == (path, path)
    ref = [t.double().requires_grad_() for t in (Q, K, V)]
    want = torch.autograd.grad(op(*ref, ids.double()), ref, dO.double())
    for got, w in zip(grads, want):
        assert (got.double() - w).abs().max() <= 3e-2 * w.abs().max()
    with pytest.raises(nc.NapkinError, match=r"input K\[h x d\] f32 is torch.float32 but Q.* is torch.bfloat16"):
        op(leaves[0], leaves[1].float(), leaves[2], ids)


def test_the_cost_says_what_deriving_a_table_costs():
    """``nc.cost`` counts what a derived table skips; making the table (the mask at every entry,
    for each head it reads) is said in its notes, not hidden in the counts."""
    n = 64
    w = nc.aux("w", nc.Axis("nh", 4))
    m = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= w[h_]))
    att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=m).bind({q: n, x: n, d: 16, h: 4})
    notes = nc.cost(att.stream("x", 16).tile("q", 16).tile("h", 1), data={"w": np.arange(4.0)}).notes
    (said,) = [t for t in notes if "is derived at a launch" in t]
    assert "the mask at up to 64 x 64 x h=4 entries (4 fma and 1 gather each; the blocks its bounds decide" in said
    assert "kept for data" in said
