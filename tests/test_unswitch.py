"""lowering/unswitch.py: a target's element loop written twice, for the chunks its masks keep
whole (the masks left out) and for the rest (each element tested, as before), under one test of
the chunk flags."""
import re

import numpy as np
from hypothesis import given, settings, strategies as st
import pytest

import napkin_cat as nc
from napkin_cat import library as L
from napkin_cat.lowering import emit_acc, emit_threads, unswitch
from napkin_cat.verify import kernelcheck

q, x, d = nc.axes("q x d")
MARK = "the masks keep the whole chunk: its elements without them"


def _outcome(dia, kernel, seed: int = 0):
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(tuple(ax.size for ax in arr.axes)) * 4 for arr in dia.dom]
    return kernelcheck.kernel_outcome(dia, kernel, inputs)


def _branches(src: str) -> tuple[str, str]:
    """The text of the first written-twice loop: the branch for whole chunks, then the other."""
    lines = src.splitlines()
    at = next(n for n, ln in enumerate(lines) if MARK in ln)
    indent = len(lines[at]) - len(lines[at].lstrip())
    other = next(n for n in range(at + 1, len(lines)) if lines[n] == " " * indent + "else:")
    end = next((n for n in range(other + 1, len(lines))
                if lines[n].strip() and len(lines[n]) - len(lines[n].lstrip()) <= indent), len(lines))
    return "\n".join(lines[at + 1:other]), "\n".join(lines[other + 1:end])


@pytest.mark.parametrize("n", [16, 15])   # whole tiles, and a ragged last tile and chunk
def test_causal_scores_are_written_for_whole_chunks_without_the_mask(n):
    dia = L.attention(q=q, x=x, d=d, causal=True).bind({q: n, x: n, d: 4})
    # rows in tiles of 8, keys in chunks of 4: chunks left of the tile's first row are kept whole
    kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16)
    whole, rest = _branches(kernel.source)
    # the mask's comparison of indices in the other branch only (a ragged chunk's padding is -inf in both)
    assert "<=" not in whole and "_full" not in whole and re.search(r"S_\w+ if .*<=.*else NEG_INF", rest)
    assert "x_full" not in rest     # known false in the other branch: not tested again in each element
    assert _outcome(dia, kernel).failure is None


def test_without_the_switch_each_element_tests_the_flag():
    dia = L.attention(q=q, x=x, d=d, causal=True).bind({q: 16, x: 16, d: 4})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unswitch, "UNSWITCH", False)
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16)
    assert MARK not in kernel.source and "(x_full or " in kernel.source
    assert _outcome(dia, kernel).failure is None


def test_a_loop_written_for_whole_chunks_in_every_chunk_is_caught():
    """Planted: the masks left out in every chunk, the flags never tested."""
    def untested(em, t, src, body, m=None):
        before = em.assumed_full
        em.assumed_full = before | frozenset(unswitch.chunk_flags(em, t.var, frozenset({t.source})))
        try:
            body()
        finally:
            em.assumed_full = before

    dia = L.attention(q=q, x=x, d=d, causal=True).bind({q: 16, x: 16, d: 4})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(emit_threads, "unswitched", untested)
        mp.setattr(emit_acc, "unswitched", untested)
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    assert MARK not in kernel.source and "NEG_INF if" not in kernel.source
    assert _outcome(dia, kernel).failure is not None


def test_a_data_mask_with_its_block_table_is_written_twice():
    doc = nc.aux("doc", nc.Axis("n", 16))
    dia = L.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i)).bind(
        {q: 16, x: 16, d: 4})
    kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    whole, rest = _branches(kernel.source)
    assert "doc_s" not in whole and "NEG_INF" not in whole
    assert "smem[doc_s + " in rest and "else NEG_INF" in rest
    rng = np.random.default_rng(1)
    ids = np.repeat([0, 1, 2], [5, 8, 3]).astype(np.float64)     # three documents, cut inside chunks
    inputs = [rng.standard_normal((16, 4)) * 4 for _ in range(3)] + [ids]
    assert kernelcheck.kernel_outcome(dia, kernel, inputs).failure is None


def _documents(n: int):
    doc = nc.aux("doc", nc.Axis("n", n))
    return L.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i)).bind(
        {q: n, x: n, d: 4})


def _document_inputs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
    ids = np.searchsorted(cuts, np.arange(n), side="right").astype(np.float64)   # four documents, cut anywhere
    return [rng.standard_normal((n, 4)) * 4 for _ in range(3)] + [ids]


def _versions(src: str) -> dict[tuple, list[str]]:
    """The mask lines (``... if ... else NEG_INF``) by the block-table values they are written under:
    the enclosing tests' comparisons, ``not ...`` in their ``else`` branches, outermost first."""
    lines = src.splitlines()
    indent = lambda ln: len(ln) - len(ln.lstrip())
    head = re.compile(r"# the block table.s (bt\[.*\] \S+ \S+) holds over the whole chunk")
    out: dict[tuple, list[str]] = {}
    for n, ln in enumerate(lines):
        if "else NEG_INF" not in ln or "< len_" in ln:   # a ragged chunk's padding: not the mask
            continue
        conds, level = [], indent(ln)
        for k in range(n - 1, -1, -1):
            up = lines[k]
            if not up.strip() or indent(up) >= level:
                continue
            level = indent(up)
            if up.strip() == "else:":
                match = next(lines[m] for m in range(k - 1, -1, -1) if indent(lines[m]) == level and lines[m].strip())
                found = head.search(match)
                if found:
                    conds.append("not " + found.group(1))
            elif head.search(up):
                conds.append(head.search(up).group(1))
        if conds:
            out.setdefault(tuple(reversed(conds)), []).append(ln.strip())
    return out


@pytest.mark.parametrize("n", [16, 14])
def test_a_data_masks_partial_chunks_are_written_once_for_each_table_value(n):
    """The derived table's 'whole' value (2) leaves the bounds alone, its 'partial' value (1) the
    data's comparison and the bounds; neither reads the table in its elements; its 'masked' value
    (0) gets no code."""
    dia = _documents(n)
    kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    versions = _versions(kernel.source)
    whole = versions[("bt[i // 8, j // 4] >= 2",)]
    partial = versions[("not bt[i // 8, j // 4] >= 2", "bt[i // 8, j // 4] >= 1")]
    assert whole and partial and all("bt_" not in ln for ln in whole + partial)
    assert all("doc_s" not in ln and "<=" in ln for ln in whole)
    assert any("doc_s" in ln and "<=" in ln for ln in partial)
    # an entry that masks the chunk: the loop skips it, so no code is written for it
    assert set(versions) == {("bt[i // 8, j // 4] >= 2",), ("not bt[i // 8, j // 4] >= 2", "bt[i // 8, j // 4] >= 1")}
    assert "pass  # the block table masks such a chunk whole: the loop skips it" in kernel.source
    for seed in range(3):
        assert kernelcheck.kernel_outcome(dia, kernel, _document_inputs(n, seed)).failure is None


@pytest.mark.parametrize("limit", [0, 1])   # none, or fewer than the mask's two comparisons: one version
def test_without_versions_each_element_compares_the_table_entry(limit):
    dia = _documents(16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unswitch, "ATOM_VERSIONS", limit)
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    assert not _versions(kernel.source) and re.search(r"bt_row\w* >= ", kernel.source)
    assert kernelcheck.kernel_outcome(dia, kernel, _document_inputs(16, 0)).failure is None


def test_versions_under_the_wrong_table_value_are_caught():
    """Planted: each version written for the opposite value of the comparisons it tests."""
    real = unswitch._assuming

    def flipped(em, facts):
        return real(em, tuple(f[1] if isinstance(f, tuple) else ("not", f) for f in facts))

    dia = _documents(16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unswitch, "_assuming", flipped)
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    assert any(kernelcheck.kernel_outcome(dia, kernel, _document_inputs(16, s)).failure is not None for s in range(3))


def test_versions_taken_for_skipped_chunks_are_caught():
    """Planted: every version taken for one the loop skips (no code for any table value)."""
    dia = _documents(16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unswitch, "_skipped", lambda em, masks, values: bool(values))
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    assert not _versions(kernel.source)
    assert any(kernelcheck.kernel_outcome(dia, kernel, _document_inputs(16, s)).failure is not None for s in range(3))


def test_fold_keeps_what_the_constants_leave():
    """``fold`` (ops/index_support.py, which the versions are written with); the nodes built
    directly, as ``&`` and ``|`` drop a boolean constant themselves."""
    from napkin_cat.ops.index_expr import Ix
    from napkin_cat.ops.index_support import fold
    i, j = Ix("idx", (), "i"), Ix("idx", (), "j")
    t, f = Ix("const", (), True), Ix("const", (), False)
    A, O = (lambda a, b: Ix("and", (a, b))), (lambda a, b: Ix("or", (a, b)))
    c = j <= i
    assert fold(A(O(t, A(c, c)), c)).same(c)
    assert fold(A(O(f, A(t, A(i == j, c))), c)).same((i == j) & c)
    assert fold(A(f, c)).same(f) and fold(O(t, c)).same(t)
    assert fold(~t).same(f)
    assert fold((i + j) & (i + j)).same((i + j) & (i + j))    # bitwise on ints: left alone
    assert (t & c).same(c) and (c | f).same(c) and (f & c).same(f) and (c | t).same(t)


def test_only_table_values_an_entry_can_take_are_written():
    from napkin_cat.ops.index_support import BlockAtom
    bt = nc.aux("bt", nc.Axis("r", 2), nc.Axis("c", 2))
    two, one = BlockAtom(bt, 8, 4, "ge", 2), BlockAtom(bt, 8, 4, "ge", 1)
    ok = lambda *vals: unswitch._reachable(tuple((a, "f", v) for a, v in vals))
    assert ok((two, True), (one, True)) and ok((two, False), (one, True)) and ok((two, False), (one, False))
    assert not ok((two, True), (one, False))
    eq = BlockAtom(bt, 8, 4, "eq", 1)
    assert ok((eq, True), (one, True)) and not ok((eq, True), (two, True))


def _bool_trees():
    """Random boolean index expressions: comparisons of i and j with constants and each other,
    the constants True and False, under & | ~ and where, repeated subterms likely."""
    from hypothesis import strategies as st
    from napkin_cat.ops.index_expr import Ix
    i, j = Ix("idx", (), "i"), Ix("idx", (), "j")
    atoms = st.sampled_from([j <= i, i - j <= 2, j >= 3, i == j, Ix("const", (), True), Ix("const", (), False)])

    def grow(kids):
        return st.one_of(st.tuples(kids, kids).map(lambda ab: Ix("and", ab)),
                         st.tuples(kids, kids).map(lambda ab: Ix("or", ab)),
                         kids.map(lambda a: ~a),
                         st.tuples(kids, kids, kids).map(lambda abc: Ix("where", abc)))
    return st.recursive(atoms, grow, max_leaves=12)


@settings(deadline=None)
@given(e=_bool_trees())
def test_fold_keeps_the_value_of_every_expression(e):
    """Property: ``fold`` changes no value, over a grid of (i, j); constants, flattened chains and
    repeated terms folded."""
    from napkin_cat.ops.index_support import fold
    i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    want = np.broadcast_to(e.evaluate(np, {"i": i, "j": j}), i.shape)
    got = np.broadcast_to(fold(e).evaluate(np, {"i": i, "j": j}), i.shape)
    assert np.array_equal(want, got), (str(e), str(fold(e)))


# ---- one table entry per warp (unswitch._warp_entries): a tile over several table blocks whose
# warps' rows (or columns) each lie inside one

def _user_documents(n: int, blk: int, table):
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", table.shape[0]), nc.Axis("cb", table.shape[1]))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    return L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, blk, blk), dtype=nc.f16).bind({q: n, x: n, d: 16})


def _user_inputs(dia, table, seed: int):
    rng = np.random.default_rng(seed)
    named = {"doc": np.cumsum(rng.random(dia.dom[0].axes[0].size) < 0.2).astype(np.float64), "bt": table}
    return [named.get(a.name, rng.standard_normal(tuple(ax.size for ax in a.axes)) * 4) for a in dia.dom]


WARP_FORMS = {"rows": ({"q": 32, "x": 16}, 64), "columns": ({"q": 16, "x": 32}, 64)}


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(WARP_FORMS)), st.integers(33, 56), st.data())
def test_each_warp_reads_its_own_entry_and_writes_its_part_once_per_value(form, n, data):
    """Tiles of 32 rows on two warps (or chunks of 32 columns) over a table of 16 x 16 blocks:
    each warp's 16 rows (columns) read one entry, and its part of a partial chunk is written once
    per value of it: kept whole (the bounds alone), partial (the data's comparison too) and masked
    (every score; the other warp's entry may keep the chunk, so the loop visits it)."""
    tiles, threads = WARP_FORMS[form]
    shape = (-(-n // 16),) * 2
    table = np.array(data.draw(st.lists(st.sampled_from((0.0, 1.0, 2.0)), min_size=shape[0] ** 2,
                                        max_size=shape[0] ** 2)), np.float32).reshape(shape)
    dia = _user_documents(n, 16, table)
    kernel = nc.lower(dia, tiles=tiles, threads=threads, verify=False)
    src = kernel.source
    assert "lie inside one block of bt: its entry" in src and "over this warp's part of the chunk" in src
    assert "if False else NEG_INF" in src     # the warp's entry masks its part: every score masked
    assert kernelcheck.kernel_outcome(dia, kernel, _user_inputs(dia, table, n)).failure is None


def test_every_warp_reading_the_first_warps_entry_is_caught():
    """Planted: the warp's offset left out of its entry's index, so every warp reads the first's."""
    from napkin_cat.lowering.unswitch import WarpEntry
    real = WarpEntry.indices

    def first_warps(self, em, m):
        out = real(self, em, m)
        return None if out is None else tuple(re.sub(r" \+ t[xy] // U\d+ \* U\d+", "", c) for c in out)
    table = np.array([[2, 0, 0], [0, 2, 0], [2, 2, 1]], np.float32)     # the warps of a tile differ
    dia = _user_documents(40, 16, table)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WarpEntry, "indices", first_warps)
        kernel = nc.lower(dia, tiles={"q": 32, "x": 16}, threads=64, verify=False)
    assert "lie inside one block of bt: its entry" in kernel.source
    assert any(kernelcheck.kernel_outcome(dia, kernel, _user_inputs(dia, table, s)).failure is not None
               for s in range(3))
