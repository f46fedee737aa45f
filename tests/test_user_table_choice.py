"""Two forms under the user's block tables, chosen at each launch (``lowering/tabled.py``,
``TableChoice`` with ``UserBlocks``): a mask that reads a table the user passes (``nc.blocked``,
an explicit block mask) lowers, on a GPU with warpgroup MMAs, to 128-row ``mma.sync`` blocks and
to four warpgroups of 64 rows (256-row tiles, where they lie inside the table's blocks), as a mask
whose table is derived does; each call counts the area
of the chunks each form visits under the user's tables (``relabel/chunk_area.py``, checked here
against the cost model's chunk-by-chunk count and against the mask's entries) and runs the
taller one where it visits less than ``TALLER`` times the other's."""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # kernels run in the simulator without a GPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import lowering as lw  # noqa: E402
from napkin_cat.core.errors import LoweringError, NapkinError, ShapeError  # noqa: E402
from napkin_cat.costmodel.skips import chunk_states, exact_counts, lead_slices, mean_counts  # noqa: E402
from napkin_cat.lowering import tabled, wgmma_plan  # noqa: E402
from napkin_cat.lowering.tabled import TableChoice, UserBlocks, user_blocks  # noqa: E402
from napkin_cat.relabel.chunk_area import visited_area  # noqa: E402
from napkin_cat.relabel.skipping import Skip  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d, h = nc.axes("q x d h")
N, H, BLK = 4096, 16, 256


@pytest.fixture
def gpu(monkeypatch):
    """Plan as for an H100 (the kernel sources only, nothing runs)."""
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)
    monkeypatch.setattr(wgmma_plan, "wgmma_capable", lambda: True)


def _windows(heads):
    wq = nc.aux("wq", nc.Axis("nh", heads))
    return nc.mask_mod(lambda b, hh, i, j: (j <= i) & (i - j <= wq[hh]))


def _user_windows(n=N, heads=H, blk=BLK, width=64, dtype=nc.f16):
    """Windows of each head read from the user's table of ``blk x blk`` blocks (the gallery's)."""
    m = _windows(heads)
    bt = nc.aux("bt", nc.Axis("nh", heads), nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
    return m, nc.library.attention(q=q, x=x, d=d, heads=h, dtype=dtype, mask=nc.blocked(m, bt, blk, blk)).bind(
        {q: n, x: n, d: width, h: heads})


def _inputs(dia, tables: dict, seed=0):
    rng = np.random.default_rng(seed)
    return [tables[arr.name] if arr.name in tables else
            rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in dia.dom]


def _table(m, widths, n=N, blk=BLK):
    return nc.block_table(m, n, n, blk, blk, {"wq": widths}, heads=len(widths))


def _entry_area(m, widths, n, rows, cols):
    """The area of the (tile, chunk) pairs of ``rows x cols`` holding an entry the mask keeps, from
    the mask's entries (independent of any table)."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    total = 0
    for w in widths:
        keep = (j <= i) & (i - j <= w)
        for r0 in range(0, n, rows):
            for c0 in range(0, n, cols):
                if keep[r0:r0 + rows, c0:c0 + cols].any():
                    total += min(rows, n - r0) * min(cols, n - c0)
    return total / len(widths)


def test_a_users_table_of_256_row_blocks_lowers_to_two_forms_on_a_gpu(gpu):
    _, dia = _user_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    assert isinstance(k, TableChoice) and len(k.forms) == 2 and k.blocks is not None
    assert [(b.steps, b.s) for b in k.blocks] == [((128,), 64), ((256,), 64)]
    assert [f.launch.block[0] for f in k.forms] == [128, 512 + 128]   # four warpgroups and a copying one
    assert "wgmma" in k.forms[1].source and "wgmma" not in k.forms[0].source
    assert all(b.tables == (("bt", 3),) for b in k.blocks)
    assert "under the given block tables" in k.notes[0] and kernelcheck.is_kernel(k)


@pytest.mark.parametrize("why,make,options", [
    ("blocks given", _user_windows, {"tiles": {"q": 128, "x": 64}}),
    ("threads given", _user_windows, {"threads": 128}),
    ("d = 128: three warpgroups are not measured under such masks", lambda: _user_windows(width=128), {}),
    ("fp32", lambda: _user_windows(dtype=nc.f32), {}),
    ("8-row table blocks: each warp's 16 rows would read the table in each element", lambda: _user_windows(blk=8), {}),
])
def test_one_form_where_there_is_no_other(gpu, why, make, options):
    _, dia = make()
    k = nc.lower(dia, verify=False, prefetch="auto", **options)
    assert isinstance(k, lw.Kernel), why


def test_a_table_whose_blocks_the_warps_span_says_what_would_get_both_forms(gpu):
    _, dia = _user_windows(blk=8)
    k = nc.lower(dia, verify=False, prefetch="auto")
    assert isinstance(k, lw.Kernel) and k.launch.block[0] == 128
    assert any("16 rows a warp, span several blocks of bt (8 x 8 blocks)" in n and "multiples of 16 x 64" in n
               for n in k.notes)


def test_a_table_whose_blocks_the_tall_tiles_span_gets_both_forms_with_an_entry_per_warp(gpu):
    """The gallery's table of 128 x 128 blocks: the warpgroups' 256-row tiles span two table rows,
    each warp's 16 rows one: its partial chunks are written once per value of the warp's entry
    (``unswitch._warp_entries``), the chunk's flags from the tile's two entries read one by one."""
    _, dia = _user_windows(blk=128)
    k = nc.lower(dia, verify=False, prefetch="auto")
    assert isinstance(k, TableChoice) and [f.launch.block[0] for f in k.forms] == [128, 512 + 128]
    tall = k.forms[1].source
    assert "this warp's rows lie inside one block of bt" in tall and "over this warp's part of the chunk" in tall
    assert "the 2 entries of the table over the tile and chunk" in tall and "read in loops" not in tall
    assert "this warp's rows" not in k.forms[0].source     # 128-row tiles inside one block: an entry a chunk


def test_one_form_in_the_simulator():
    _, dia = _user_windows(n=64, heads=2, blk=8, width=16)
    assert isinstance(nc.lower(dia, verify=False), lw.Kernel)


@pytest.mark.parametrize("scale", [8, 32, 256])
def test_the_choice_follows_the_areas_the_forms_visit(gpu, scale):
    """Windows of (h + 1) x scale on 16 heads, the user's table of 256 x 256 blocks: each form's
    area is the table's at its blocks (a 128 x 64 or 256 x 64 chunk inside a table block keeps
    what the block keeps, less the chunks above the diagonal); the taller form where it visits
    less than TALLER times the other's."""
    m, dia = _user_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    widths = (np.arange(1, H + 1) * scale).astype(np.float32)
    ins = _inputs(dia, {"bt": _table(m, widths)})
    table = (np.asarray(_table(m, widths)) > 0)
    a, b = (visited_area(bl.skips, bl.N, list(bl.steps), bl.n, bl.s, {"bt": ins[3]}) for bl in k.blocks)
    # the entries' area at the table's granularity: chunks of 64 inside a 128-column block keep
    # whatever the block keeps, so a form's area is the table's, counted at the form's blocks
    for (rows, cols), got in zip(((128, 64), (256, 64)), (a, b)):
        want = np.mean([sum(rows * cols for t0 in range(N // rows) for c0 in range(N // cols)
                            if t[t0 * rows // BLK, c0 * cols // BLK] and c0 * cols < t0 * rows + rows)
                        for t in table])
        assert got == pytest.approx(want)
    form, tables = k.chosen(*ins)
    assert tables == () and (form is k.forms[1]) is (b < tabled.TALLER * a)


def _mask_of(kind, r, c, heads):
    bt = nc.aux("bt", *((nc.Axis("nh", heads),) if heads else ()), nc.Axis("rb", 64), nc.Axis("cb", 64))
    at = (lambda hh, i, j: bt[hh, i // r, j // c]) if heads else (lambda hh, i, j: bt[i // r, j // c])
    if kind == "explicit":
        return nc.mask_mod(lambda b, hh, i, j: at(hh, i, j) > 0)
    if kind == "blocked causal":
        return nc.mask_mod(lambda b, hh, i, j: ((at(hh, i, j) >= 2) | ((at(hh, i, j) >= 1) & ((i ^ j) & 1 == 0)))
                           & (j <= i))
    return nc.mask_mod(lambda b, hh, i, j: (at(hh, i, j) == 1) | (j >= i + 3))   # a band from below, or the table


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["explicit", "blocked causal", "either"]), r=st.integers(1, 5), c=st.integers(1, 5),
       N_=st.integers(1, 40), n=st.integers(1, 40), tiles=st.lists(st.integers(1, 12), min_size=1, max_size=2),
       s=st.integers(1, 9), heads=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2 ** 16))
def test_the_area_is_the_cost_models_chunk_by_chunk_count(kind, r, c, N_, n, tiles, s, heads, seed):
    """``visited_area`` (a row tile's chunks at once) against the cost model's count (one chunk
    at a time, ``costmodel/skips.py``) over random masks, tables (of each head or one), sizes,
    nested row tiles (ragged, not powers of two) and chunks."""
    m = _mask_of(kind, r, c, heads)
    rng = np.random.default_rng(seed)
    shape = ((heads,) if heads else ()) + (-(-N_ // r) + rng.integers(0, 2), -(-n // c) + rng.integers(0, 2))
    data = {"bt": rng.integers(0, 3, shape).astype(np.float32)}
    skips = (Skip("q", "x", m),)
    steps = sorted(tiles, reverse=True)
    steps = [steps[0]] + [t for t in steps[1:] if t < steps[0]]
    g = steps[-1]
    counts = [exact_counts(chunk_states(skips, N_, steps, n, s, dd), skips, g, s) for dd in lead_slices(data, skips)]
    assert visited_area(skips, N_, steps, n, s, data) == pytest.approx(float(mean_counts(counts)[0]) * g * s)


def test_the_area_of_an_explicit_block_mask_is_its_entries():
    """``bm[i // 4, j // 4] > 0``: a chunk is visited exactly where an entry is kept."""
    rng = np.random.default_rng(3)
    bm = (rng.random((5, 6)) < 0.3).astype(np.float32)
    m = _mask_of("explicit", 4, 4, 0)
    keep = np.repeat(np.repeat(bm > 0, 4, 0), 4, 1)[:19, :22]
    for rows, s in ((4, 4), (8, 4), (6, 5), (19, 22), (3, 7)):
        want = sum(min(rows, 19 - r0) * min(s, 22 - c0) for r0 in range(0, 19, rows) for c0 in range(0, 22, s)
                   if keep[r0:r0 + rows, c0:c0 + s].any())
        assert visited_area((Skip("q", "x", m),), 19, [rows], 22, s, {"bt": bm}) == want


def test_the_area_refuses_what_it_cannot_count():
    m = _mask_of("explicit", 4, 4, 0)
    with pytest.raises(LoweringError, match="no values for block table.*bt"):
        visited_area((Skip("q", "x", m),), 16, [4], 16, 4, {})
    with pytest.raises(LoweringError, match="transposed"):
        visited_area((Skip("x", "q", m, transposed=True),), 16, [4], 16, 4, {"bt": np.ones((4, 4))})


def _two_forms(dia):
    """A choice of two simulator kernels on other blocks (8 and 16 rows), as on a GPU."""
    forms = tuple(nc.lower(dia, tiles={"q": t, "x": 8}, threads=16, verify=False) for t in (8, 16))
    blocks = tuple(user_blocks(f) for f in forms)
    assert [b.steps for b in blocks] == [(8,), (16,)]
    return TableChoice(forms, blocks)


def test_each_form_runs_and_matches_the_oracle():
    n = 64
    m, dia = _user_windows(n=n, heads=2, blk=8, width=8, dtype=nc.f32)
    k = _two_forms(dia)
    picked = set()
    for w in ([60.0, 63.0], [1.0, 3.0]):   # wide windows: the taller blocks; narrow: the shorter
        widths = np.array(w, np.float32)
        ins = _inputs(dia, {"bt": _table(m, widths, n, 8), "wq": widths}, seed=len(picked))
        form, tables = k.chosen(*ins)
        picked.add(k.forms.index(form))
        assert tables == ()
        np.testing.assert_allclose(k(*ins), nc.evaluate(dia, *ins), atol=1e-5)
    assert picked == {0, 1}
    assert nc.check_equivalent(dia, k, examples=3)
    out = np.full((2, n, 8), np.nan, np.float32)
    k.prepare(*ins, out=out)()
    np.testing.assert_allclose(out, nc.evaluate(dia, *ins), atol=1e-5)


def test_lower_verifies_both_forms(monkeypatch):
    _, dia = _user_windows(n=48, heads=2, blk=8, width=8, dtype=nc.f32)
    choice = _two_forms(dia)
    monkeypatch.setattr(tabled, "lower_with_tables", lambda d, opts, lower_any, on_gpu: choice)
    k = nc.lower(dia, verify=2)
    assert k is choice and k.verified and all(f.verified for f in k.forms)
    assert [n[:7] for n in k.notes[-2:]] == ["Form 1:", "Form 2:"]


def test_torch_tensors_keep_their_choice_until_they_change(gpu, monkeypatch):
    torch = pytest.importorskip("torch")
    m, dia = _user_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    widths = (np.arange(1, H + 1) * 256).astype(np.float32)
    ins = [torch.from_numpy(v) for v in _inputs(dia, {"bt": np.asarray(_table(m, widths))})]
    counted = []
    real = UserBlocks.area
    monkeypatch.setattr(UserBlocks, "area", lambda self, arrays: counted.append(1) or real(self, arrays))
    first = k.chosen(*ins)[0]
    assert len(counted) == 2
    assert k.chosen(*ins)[0] is first and len(counted) == 2   # kept with the table's identity and version
    ins[3].copy_(torch.from_numpy(np.asarray(_table(m, widths / 8))))   # narrow windows: counted again
    k.chosen(*ins)
    assert len(counted) == 4


def test_a_choice_refuses_what_its_forms_cannot_read_and_keeps_nothing(gpu):
    m, dia = _user_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    ins = _inputs(dia, {"bt": _table(m, (np.arange(1, H + 1) * 256).astype(np.float32))})
    with pytest.raises(ShapeError, match=r"input bt\[.*expected shape \(16, 16, 16\), got \(15, 16, 16\)"):
        k.chosen(*ins[:3], ins[3][:15], *ins[4:])
    with pytest.raises(ShapeError, match=r"takes 5 arrays \(Q, K, V, bt, wq\), got 4"):
        k(*ins[:-1])
    assert issubclass(ShapeError, NapkinError) and not k._chosen


def test_one_form_with_a_note_where_the_warpgroups_do_not_lower(gpu, monkeypatch):
    """The taller form's lowering refused: the first form alone, the refusal in its notes."""
    _, dia = _user_windows()
    real = lw._lower_any

    def refuse_tall(d, opts):
        if opts.get("threads") == 512:
            raise LoweringError("four warpgroups refused here (test)")
        return real(d, opts)
    monkeypatch.setattr(lw, "_lower_any", refuse_tall)
    k = nc.lower(dia, verify=False, prefetch="auto")
    assert isinstance(k, lw.Kernel) and k.launch.block[0] == 128
    assert any("did not lower: four warpgroups refused here (test)" in n for n in k.notes)
