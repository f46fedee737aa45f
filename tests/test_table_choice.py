"""Two forms of a mask that reads data, chosen at each launch (``lowering/tabled.py``,
``TableChoice``): on a GPU with warpgroup MMAs a 16-bit forward at d <= 64 lowers to 128-row
``mma.sync`` blocks and to four warpgroups of 64 rows (256-row blocks); each call runs the taller
one where its tables keep less than ``TALLER`` times the area the others keep
(``kernels/probes/table_choice.py`` measured the two over windows of each head and packed
documents).  ``nc.lower`` verifies both forms, and a wrong form is caught by name."""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # kernels run in the simulator without a GPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import lowering as lw  # noqa: E402
from napkin_cat.core.errors import EquivalenceError  # noqa: E402
from napkin_cat.lowering import tabled, wgmma_plan  # noqa: E402
from napkin_cat.lowering.tabled import TableChoice, TabledKernel  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d, h = nc.axes("q x d h")
N, H = 4096, 16


@pytest.fixture
def gpu(monkeypatch):
    """Plan as for an H100 (the kernel sources only, nothing runs)."""
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)
    monkeypatch.setattr(wgmma_plan, "wgmma_capable", lambda: True)


def _head_windows(n=N, heads=H, width=64, dtype=nc.f16):
    wq = nc.aux("wq", nc.Axis("nh", heads))
    m = nc.mask_mod(lambda b, hh, i, j: (j <= i) & (i - j <= wq[hh]))
    return m, nc.library.attention(q=q, x=x, d=d, heads=h, dtype=dtype, mask=m).bind(
        {q: n, x: n, d: width, h: heads})


def _documents(n=N, heads=H, width=64):
    doc = nc.aux("doc", nc.Axis("n", n))
    m = nc.mask_mod(lambda b, hh, i, j: (doc[i] == doc[j]) & (j <= i))
    return m, nc.library.attention(q=q, x=x, d=d, heads=h, dtype=nc.f16, mask=m).bind(
        {q: n, x: n, d: width, h: heads})


def _inputs(dia, aux, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in dia.dom[:-1]] + [aux]


def test_a_mask_that_reads_data_lowers_to_two_forms_on_a_gpu(gpu):
    _, dia = _head_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    assert isinstance(k, TableChoice) and len(k.forms) == 2
    assert [(f.tables[0].rows, f.tables[0].cols) for f in k.forms] == [(128, 64), (256, 64)]
    assert [f.inner.launch.block[0] for f in k.forms] == [128, 512 + 128]   # four warpgroups and a copying one
    assert "wgmma" in k.forms[1].inner.source and "wgmma" not in k.forms[0].inner.source
    assert f"less than {tabled.TALLER} times" in k.notes[0]
    assert kernelcheck.is_kernel(k)   # nc.check_equivalent takes it


@pytest.mark.parametrize("why,make,options", [
    ("blocks given", _head_windows, {"tiles": {"q": 128, "x": 64}}),
    ("threads given", _head_windows, {"threads": 128}),
    ("d = 128: three warpgroups are not measured under such masks", lambda: _head_windows(width=128), {}),
    ("fp32", lambda: _head_windows(dtype=nc.f32), {}),
])
def test_one_form_where_there_is_no_other(gpu, why, make, options):
    _, dia = make()
    k = nc.lower(dia, verify=False, prefetch="auto", **options)
    assert isinstance(k, TabledKernel), why


def test_one_form_in_the_simulator():
    _, dia = _head_windows(n=64, heads=2, width=16)
    assert isinstance(nc.lower(dia, verify=False), TabledKernel)


def _kept(mask, data, rows, cols, heads=None):
    """The area the blocks of an independent ``nc.block_table`` keep."""
    t = nc.block_table(mask, N, N, rows, cols, data, heads=heads)
    return float((np.asarray(t) > 0).sum()) * rows * cols


@pytest.mark.parametrize("scale", [32, 64, 128, 256])
def test_the_choice_follows_the_kept_areas_of_windows_of_each_head(gpu, scale):
    """Windows of (h + 1) x scale: measured (H200, kernels/probes/table_choice.py) the taller blocks
    won at 128 and 256 (kept ratios 1.109 and 1.062) and lost at 32 (1.307)."""
    m, dia = _head_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    w = (np.arange(1, H + 1) * scale).astype(np.float32)
    form, tables = k.chosen(*_inputs(dia, w))
    a, b = (_kept(m, {"wq": w}, r, 64, heads=H) for r in (128, 256))
    assert (form is k.forms[1]) == (b < tabled.TALLER * a)
    assert form is k.forms[{32: 0, 64: 0, 128: 1, 256: 1}[scale]]
    np.testing.assert_array_equal(tables[0], nc.block_table(m, N, N, form.tables[0].rows, 64, {"wq": w}, heads=H))


@pytest.mark.parametrize("cuts,taller", [(1, True), (3, False), (12, False)])
def test_the_choice_follows_the_kept_areas_of_documents(gpu, cuts, taller):
    """Two long documents: the taller blocks (measured 0.206 against 0.217 ms); 4 and 13: the
    others (0.132 against 0.138, 0.092 against 0.119)."""
    m, dia = _documents()
    k = nc.lower(dia, verify=False, prefetch="auto")
    at = np.sort(np.random.default_rng(cuts).permutation(N // 64 - 1)[:cuts] + 1) * 64
    ids = np.zeros(N, np.float32)
    ids[at] = 1
    ids = np.cumsum(ids).astype(np.float32)
    if cuts == 1:
        ids = (np.arange(N) >= N // 2).astype(np.float32)   # two halves
    form, _ = k.chosen(*_inputs(dia, ids))
    assert (form is k.forms[1]) is taller


def test_torch_tensors_keep_their_choice_until_they_change(gpu, monkeypatch):
    torch = pytest.importorskip("torch")
    _, dia = _head_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    w = torch.arange(1, H + 1, dtype=torch.float32) * 256
    ins = [torch.from_numpy(v) for v in _inputs(dia, w.numpy())[:-1]] + [w]
    counted = []
    real = TableChoice.kept
    monkeypatch.setattr(TableChoice, "kept", staticmethod(lambda f, t: counted.append(1) or real(f, t)))
    first = k.chosen(*ins)[0]
    assert first is k.forms[1] and len(counted) == 1           # both forms' counts in one read
    assert k.chosen(*ins)[0] is first and len(counted) == 1   # kept with the tensor's identity and version
    w.mul_(1 / 8)   # narrow windows now: the version moved, the choice is made again
    assert k.chosen(*ins)[0] is k.forms[0] and len(counted) == 2


def test_both_forms_kept_areas_come_back_in_one_read():
    """``TableChoice.kept`` stacks the forms' counts on the tables' device: one copy to the host."""
    torch = pytest.importorskip("torch")
    spec = type("Spec", (), {"rows": 128, "cols": 64})
    forms = [type("Form", (), {"tables": (spec,)}), type("Form", (), {"tables": (spec, spec)})]
    derived = [(torch.tensor([[0, 1], [2, 0]]),), (torch.tensor([[1, 1]]), torch.tensor([[0, 2]]))]
    reads = []
    real = torch.Tensor.cpu
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(1) or real(self, *a, **k))
        area = TableChoice.kept(forms, derived)
    assert area == [2 * 128 * 64, 3 * 128 * 64] and len(reads) == 1
    assert TableChoice.kept(forms, [tuple(t.numpy() for t in ts) for ts in derived]) == area


def _two_forms(dia, broken=False, lower=None):
    """A choice of two simulator kernels on other blocks (8 and 16 rows), as :func:`tabled.lower_with_tables`
    makes on a GPU; ``broken``: the second form's tables all zero (every chunk skipped);
    ``lower(tiles)``: how each form is lowered (else ``nc.lower``)."""
    lower = lower or (lambda tiles: nc.lower(dia, tiles=tiles, threads=16, verify=False))
    a, b = lower({"q": 8, "x": 8}), lower({"q": 16, "x": 8})
    assert isinstance(a, TabledKernel) and isinstance(b, TabledKernel)
    if broken:
        derive = b.derive
        b.derive = lambda *arrays: tuple(np.zeros_like(t) for t in derive(*arrays))
    return TableChoice((a, b))


def test_each_form_runs_and_matches_the_oracle():
    n = 64
    m, dia = _head_windows(n=n, heads=2, width=8, dtype=nc.f32)
    k = _two_forms(dia)
    picked = set()
    for w in ([60.0, 63.0], [1.0, 3.0]):   # wide windows: the taller blocks; narrow: the shorter
        ins = _inputs(dia, np.array(w, np.float32), seed=len(picked))
        form, _ = k.chosen(*ins)
        picked.add(k.forms.index(form))
        np.testing.assert_allclose(k(*ins), nc.evaluate(dia, *ins), atol=1e-5)
    assert picked == {0, 1}
    assert nc.check_equivalent(dia, k, examples=3)
    out = np.full((2, n, 8), np.nan, np.float32)
    run = k.prepare(*ins, out=out)   # the narrow windows' form, its tables derived once, here
    run()
    np.testing.assert_allclose(out, nc.evaluate(dia, *ins), atol=1e-5)


def test_lower_verifies_both_forms_and_names_a_wrong_one(monkeypatch):
    _, dia = _head_windows(n=48, heads=2, width=8, dtype=nc.f32)
    real = tabled.lower_with_tables

    def choice(broken):
        def lower_with_tables(d, opts, lower_any, on_gpu):
            return _two_forms(d, broken, lambda tiles: real(d, {**opts, "tiles": tiles, "threads": 16}, lower_any, on_gpu))
        return lower_with_tables

    monkeypatch.setattr(tabled, "lower_with_tables", choice(False))
    calls = []
    real_oracle = kernelcheck.oracle_outputs
    monkeypatch.setattr(kernelcheck, "oracle_outputs", lambda *a, **kw: calls.append(1) or real_oracle(*a, **kw))
    k = nc.lower(dia, verify=2)
    assert isinstance(k, TableChoice) and k.verified and all(f.verified for f in k.forms)
    assert [n[:7] for n in k.notes[-2:]] == ["Form 1:", "Form 2:"]
    assert len(calls) == 2     # the oracle once per run: the second form compares with the first's answers
    monkeypatch.setattr(tabled, "lower_with_tables", choice(True))
    with pytest.raises(EquivalenceError, match="differs from the NumPy oracle"):
        nc.lower(dia, verify=2)


def test_a_choice_refuses_what_its_forms_cannot_read_and_keeps_nothing(gpu):
    from napkin_cat.core.errors import NapkinError, ShapeError
    _, dia = _head_windows()
    k = nc.lower(dia, verify=False, prefetch="auto")
    ins = _inputs(dia, (np.arange(1, H + 1) * 256).astype(np.float32))
    with pytest.raises(ShapeError, match=r"input wq\[nh=16\].*expected shape \(16,\), got \(15,\)"):
        k.chosen(*ins[:-1], ins[-1][:15])
    with pytest.raises(ShapeError, match="takes 4 arrays"):
        k(*ins[:-1])
    assert issubclass(ShapeError, NapkinError) and not k._chosen
