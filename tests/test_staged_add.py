"""An output the blocks add into, staged in shared memory and added by one bulk reduction a chunk
(:mod:`napkin_cat.lowering.staged_add`): the one-kernel attention backward's dQ on warpgroups.
Checked against the oracle in the simulator, whose twins keep each reduction pending and read the
buffer only at its wait: a kernel without thread 0's wait before the next chunk's writes, or
without the wait after the loop, adds the wrong sums and is caught.  By default only rows of 512
bytes or more are staged (measured on the H200, ``kernels/BENCHMARKS.md``); elsewhere, and with
the switch off, dQ goes by atomics as before."""
from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import staged_add  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_issue_ahead import _backward, _body, _outcome, d, q, x  # noqa: E402
from test_split_reduction import _mutant  # noqa: E402
from test_wgmma import warpgroups  # noqa: E402,F401  (the fixture: planner.WGMMA on)

RAGGED = {q: 70, x: 140, d: 32}   # two query chunks, the last ragged; two key tiles


@pytest.fixture
def staged(monkeypatch):
    monkeypatch.setattr(staged_add, "STAGED_ADD", True)


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "causal"])
def test_dq_is_staged_and_added_by_one_bulk_reduction_a_chunk(warpgroups, staged, causal):
    part, bound, kernel = _backward(causal, RAGGED)
    body = _body(kernel)
    assert "red_add2(dQ" not in body and "cuda.atomic.add(dQ" not in body
    assert "dQ_add_s[64 x 32] (dQ's partial sums, added by one bulk reduction a chunk, rows padded by 4 words" \
        in kernel.source
    # the rows of this chunk (a ragged last one: its own) of 32 + 4 words (staged_add.row_pad: the
    # global array the copy engine adds into is padded alike, and the caller gets the view without
    # the padding), thread 0's wait before the barrier that precedes the writes, the reduction after
    # the barrier that follows them, all waited for at the end
    assert kernel.out_pads == (4, 0, 0) and re.search(r"stage_bytes = len_q\w* \* U144", body)
    wait, writes = body.index("bulk_wait_read()"), body.index("smem[dQ_add_s + ")
    barrier = re.compile(r"bar_named\(uint32\(1\), NTHREADS\)|cuda\.syncthreads\(\)").search(body, wait).start()
    assert wait < barrier < writes < body.index("bulk_add_f32(dQ, ") \
        < body.index("bulk_commit()") < body.index("bulk_wait_all()")
    # the copy engine reads the writes through the async proxy: the barrier after them is fenced,
    # also where the other barriers of the computing threads are not (wgmma.FENCE_SPECIALISED)
    lines = [ln.strip() for ln in body[:body.index("bulk_add_f32(dQ, ")].splitlines()]
    after = max(i for i, ln in enumerate(lines) if ln.startswith(("bar_named(uint32(1), NTHREADS)", "cuda.syncthreads()")))
    assert lines[after - 1] == "fence_proxy_async()", lines[after - 3:after + 1]
    out = _outcome(part, bound, kernel, causal, RAGGED)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["no-read-wait", "no-final-wait"])
def test_a_missing_wait_is_caught_by_the_simulators_pending_reductions(warpgroups, staged, plant):
    part, bound, kernel = _backward(False, RAGGED)
    name = {"no-read-wait": "bulk_wait_read", "no-final-wait": "bulk_wait_all"}[plant]
    mutant = _mutant(kernel, rf"{name}\(\)", "ZERO16")
    good, bad = _outcome(part, bound, kernel, False, RAGGED), _outcome(part, bound, mutant, False, RAGGED)
    # the planted kernel's sums are off by their size; at these logits (scale 12) the elementwise
    # rule's slack (the plain f16 implementation's largest error on dQ) still admits that, the
    # norm-wise condition does not: its rms error is 10x (no final wait) to 14x the plain one's
    assert good.failure is None and good.rel_error < 0.1
    assert bad.rel_error > 0.5 and bad.abs_error > 5 * good.abs_error
    assert bad.failure is not None and bad.failure["kind"] == "norm", bad.failure
    assert bad.failure["output_name"] == "dQ" and bad.failure["kernel_rms"] > 5 * bad.failure["plain_rms"]


def test_auto_stages_rows_of_512_bytes_and_more_under_a_mask_and_off_adds_by_atomics(warpgroups, monkeypatch):
    """The default stages dQ where its rows are 512 bytes or more and a mask skips chunks (causal
    at d = 128: measured faster on the H200; unmasked level or slower, and slower at d = 64:
    kernels/BENCHMARKS.md); off, dQ goes by atomics."""
    assert staged_add.STAGED_ADD == "auto" and staged_add.MIN_ROW_BYTES == 512
    wide = {q: 70, x: 140, d: 128}
    _, _, narrow = _backward(True, RAGGED)                        # rows of 32 words: 128 bytes
    _, _, unmasked = _backward(False, wide)
    _, _, staged = _backward(True, wide)
    for kernel in (narrow, unmasked):
        assert "red_add2(dQ" in kernel.source and "bulk_add_f32" not in kernel.source
    assert "bulk_add_f32(dQ" in staged.source and staged.out_pads == (4, 0, 0)
    monkeypatch.setattr(staged_add, "STAGED_ADD", False)
    _, _, off = _backward(True, wide)
    assert "red_add2(dQ" in off.source and "bulk_add_f32" not in off.source and off.out_pads == (0, 0, 0)


def test_why_not_names_what_keeps_an_output_on_atomics():
    """Staged only where a chunk is one run of global memory (its axes after the first the block
    splits whole), of rows a multiple of 16 bytes, written once per chunk of a stream loop, in the
    shared memory left."""
    from types import SimpleNamespace as NS
    from napkin_cat.relabel.nodes import Compute, Loop
    body = Compute(0)
    ff = NS(diagram=NS(outs=(7,), eqn_outputs=lambda e: (7,)),
            walk=lambda: [(body, [Loop("h", 1, "grid", "SMEM"), Loop("q", 64, "stream", "SMEM")])])
    t, arr = NS(var=7, to_global=True), NS(axis_names=("h", "q", "d"), name="dQ")

    def ax(d_cap=128, d=128, q=64):
        return {"h": NS(cap=1, size=4), "q": NS(cap=q, size=4096), "d": NS(cap=d_cap, size=d)}
    assert staged_add.why_not(ff, ax(), t, arr, {}) is None
    assert "not contiguous: d split" in staged_add.why_not(ff, ax(d_cap=64), t, arr, {})
    assert "16 bytes" in staged_add.why_not(ff, ax(d_cap=6, d=6), t, arr, {})
    assert "rows of 256 bytes, under staged_add.MIN_ROW_BYTES" in staged_add.why_not(ff, ax(64, 64), t, arr, {})
    assert "no mask skips chunks" in staged_add.why_not(ff, ax(), t, arr, {}, skipping=False)
    big = {("x",): NS(size=57000)}   # words of shared memory already planned
    assert staged_add.why_not(ff, ax(), t, arr, big) == "shared memory"
    ff.walk = lambda: [(body, [Loop("h", 1, "grid", "SMEM")])]
    assert staged_add.why_not(ff, ax(), t, arr, {}) == "not written once per chunk of a stream loop"


def test_the_conflicts_probe_lowers_its_forms_rows_padded_and_not(warpgroups):
    """``kernels/probes/staged_conflicts.py`` times dQ by atomics, staged in rows of d words and
    staged in padded rows (kernels/BENCHMARKS.md): its forms lower as they say, and restore the
    switches after."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "staged_conflicts", Path(__file__).resolve().parents[1] / "kernels/probes/staged_conflicts.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    pads = {}
    for name in probe.FORMS:
        with probe.form(name):
            _, _, kernel = _backward(False, RAGGED)
        pads[name] = (kernel.out_pads[0], "bulk_add_f32(" in kernel.source)
    assert pads == {"atomics": (0, False), "staged, rows of d words": (0, True), "staged, rows padded": (4, True)}


@pytest.mark.slow
def test_padded_rows_stay_inside_the_call(warpgroups, staged):
    """A caller never sees the padding: the kernel returns dQ as the view without it, and an
    ``out=`` array (a call, a prepared launch) gets the same values, copied after the launch."""
    import numpy as np
    from test_issue_ahead import _inputs
    part, bound, kernel = _backward(False, RAGGED)
    ins = [_inputs(RAGGED, False, 12.0)[a.name] for a in part.dom]
    got = kernel(*ins)
    assert got[0].shape == (70, 32) and got[0].base.shape == (70, 36)
    out = tuple(np.full(g.shape, np.nan, g.dtype) for g in got)
    kernel(*ins, out=out)
    again = tuple(np.full(g.shape, np.nan, g.dtype) for g in got)
    kernel.prepare(*ins, out=again)()
    for g, a, b in zip(got, out, again):
        np.testing.assert_array_equal(a, g)
        np.testing.assert_array_equal(b, g)


def test_the_rotation_probe_still_finds_its_places(warpgroups):
    """``kernels/probes/staged_rotation.py`` rewrites the unmasked one-kernel backward (as
    ``nc.torch_op`` plans it, heads tiled by one) so that each key tile streams the query chunks
    from its own first chunk: its patterns are still in today's source, for atomics and staged."""
    import importlib.util
    from pathlib import Path

    from napkin_cat.lowering.backward_forms import backward_plan
    spec = importlib.util.spec_from_file_location(
        "staged_rotation", Path(__file__).resolve().parents[1] / "kernels/probes/staged_rotation.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    (h,) = nc.axes("h")
    fl = nc.library.attention(q=q, x=x, d=d, heads=h).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    part = backward_plan(fl, form="one kernel").at(nc.f16).parts[-1].bind({"q": 256, "x": 256, "d": 16, "h": 2})
    for on in (False, True):
        staged_add.STAGED_ADD = on
        try:
            kernel = nc.lower(part, tiles={"g_x": 128, "s_q": 64}, threads=256, prefetch="double", verify=False)
        finally:
            staged_add.STAGED_ADD = "auto"
        edited = probe.rotated(kernel.source)
        compile(edited, "rotated", "exec")
        assert ("(q0 + ROT) % N_q + U0" in edited) == on and "ROT = bx_rest %" in edited
