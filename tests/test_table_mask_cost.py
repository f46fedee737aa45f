"""The cost model counts a mask's arithmetic as the kernels write it (issue 11: "the cost model
counts the transfers and FLOPs actually done").  In a chunk that reads one entry of a block table,
the table's comparisons take that entry's value and are folded away
(``ops.index_support.with_atoms``, which ``lowering/unswitch.py`` writes the kernels' versions
with); each element counts them only where the table's values are not given or the chunk spans
entries."""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402

q, x, d = nc.axes("q x d")


def _documents(n: int, blk: int):
    """A causal document mask and the same mask reading a table of ``blk`` x ``blk`` blocks
    (``nc.blocked``: 2 keeps the block whole, 1 partly, 0 masks it; the bound stays beside)."""
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    return m, nc.blocked(m, bt, blk, blk)


def _mask_ops(t, data):
    """(condition operations, selects, the condition's rows) the cost model counts for ``t``."""
    c = nc.cost(t, data=data)
    cond = [o for o in c.ops if o.what.startswith("mask condition")]
    sel = [o for o in c.ops if o.what == "select"]
    total = lambda ops: sum(o.per_exec * o.execs for o in ops)
    return total(cond), total(sel), {o.what for o in cond if o.execs != 0}


def test_a_documents_table_is_counted_as_what_each_entry_leaves():
    n = 12
    ids = np.repeat([0.0, 1.0, 2.0], [5, 3, 4])
    m, blocked = _documents(n, 4)
    derived = nc.block_table(m, n, n, 4, 4, {"doc": ids})
    np.testing.assert_array_equal(derived, [[1, 0, 0], [1, 1, 0], [0, 0, 1]])
    t = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: 2}).stream("x", 4).tile("q", 4)
    # four partial entries of 16 elements: each compares the ids and the bound (3 operations);
    # without the table's values each element also compares the entry twice (13)
    assert _mask_ops(t, {"bt": derived}) == (3 * 4 * 16, 4 * 16, {"mask condition (3 fma per element)"})
    assert _mask_ops(t, None)[2] == {"mask condition (13 fma per element)"}
    # a user's table that keeps the diagonal blocks whole: the bound alone there
    user = np.array([[2, 0, 0], [1, 2, 0], [0, 0, 2]], dtype=np.float32)
    assert _mask_ops(t, {"bt": user}) == ((3 * 1 + 1 * 3) * 16, 4 * 16, {"mask condition (1 fma per element)",
                                                                        "mask condition (3 fma per element)"})
    # the first tile of 8 rows spans two table rows (no one entry: every comparison in each
    # element); the ragged last one, rows 8-11, lies in the third
    wide = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: 2}).stream("x", 4).tile("q", 8)
    assert _mask_ops(wide, {"bt": user})[2] == {"mask condition (13 fma per element)",
                                                "mask condition (1 fma per element)"}


@settings(max_examples=40, deadline=None)
@given(nb=st.integers(2, 4), blk=st.sampled_from([2, 4, 6]), short=st.integers(0, 5),
       halves=st.tuples(st.booleans(), st.booleans()), seed=st.integers(0, 2 ** 16))
def test_the_counted_mask_arithmetic_is_each_chunks_folded_mask(nb, blk, short, halves, seed):
    """Property over random tables (0, 1, 2), ragged sizes and tiles and chunks inside the table's
    blocks: the condition's operations and the selects are those of an enumeration of the chunks
    (an entry of 2 leaves the bound, 1 operation; of 1 the ids and the bound, 3; 0 is skipped,
    as is a chunk above the diagonal or one a 2 and the bound keep whole)."""
    n = nb * blk - min(short, blk - 1)      # ragged, at least one block
    t, s = (blk // 2 if h else blk for h in halves)
    table = np.random.default_rng(seed).integers(0, 3, (nb, nb)).astype(np.float32)
    _, blocked = _documents(n, blk)
    dia = nc.library.attention(q=q, x=x, d=d, mask=blocked).bind({q: n, x: n, d: 2}).stream("x", s).tile("q", t)
    cond = sel = 0
    for r0 in range(0, n, t):
        for c0 in range(0, n, s):
            r1, c1 = min(r0 + t, n), min(c0 + s, n)
            e = table[r0 // blk, c0 // blk]
            if e == 0 or c0 >= r1 or (e == 2 and c1 - 1 <= r0):
                continue
            cond += (r1 - r0) * (c1 - c0) * (1 if e == 2 else 3)
            sel += (r1 - r0) * (c1 - c0)
    got_cond, got_sel, _ = _mask_ops(dia, {"bt": table})
    assert (got_cond, got_sel) == (cond, sel)
