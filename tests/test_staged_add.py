"""An output the blocks add into, staged in shared memory and added by one bulk reduction a chunk
(:mod:`napkin_cat.lowering.staged_add`): the one-kernel attention backward's dQ on warpgroups.
Checked against the oracle in the simulator, whose twins keep each reduction pending and read the
buffer only at its wait: a kernel without thread 0's wait before the next chunk's writes, or
without the wait after the loop, adds the wrong sums and is caught; with the switch off (the
default: measured slower on the H200, ``kernels/BENCHMARKS.md``) dQ goes by atomics as before."""
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
    assert "dQ_add_s[64 x 32] (dQ's partial sums" in kernel.source
    # the rows of this chunk (a ragged last one: its own), thread 0's wait before the barrier that
    # precedes the writes, the reduction after the barrier that follows them, all waited for at the end
    assert re.search(r"stage_bytes = len_q\w* \* U128", body)
    wait, writes = body.index("bulk_wait_read()"), body.index("smem[dQ_add_s + ")
    barrier = re.compile(r"bar_named\(uint32\(1\), NTHREADS\)|cuda\.syncthreads\(\)").search(body, wait).start()
    assert wait < barrier < writes < body.index("bulk_add_f32(dQ, ") \
        < body.index("bulk_commit()") < body.index("bulk_wait_all()")
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


def test_the_switch_off_adds_dq_by_atomics(warpgroups):
    assert staged_add.STAGED_ADD is False    # the default, as measured (kernels/BENCHMARKS.md)
    _, _, kernel = _backward(False, RAGGED)
    assert "red_add2(dQ" in kernel.source and "bulk_add_f32" not in kernel.source


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
    big = {("x",): NS(size=57000)}   # words of shared memory already planned
    assert staged_add.why_not(ff, ax(), t, arr, big) == "shared memory"
    ff.walk = lambda: [(body, [Loop("h", 1, "grid", "SMEM")])]
    assert staged_add.why_not(ff, ax(), t, arr, {}) == "not written once per chunk of a stream loop"


def test_the_conflicts_probe_still_finds_the_staging_write(warpgroups, staged):
    """``kernels/probes/staged_conflicts.py`` priced the staging writes' bank conflicts on the GPU
    (kernels/BENCHMARKS.md) by permuting that one write: it still finds it in today's source."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "staged_conflicts", Path(__file__).resolve().parents[1] / "kernels/probes/staged_conflicts.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    _, _, kernel = _backward(False, RAGGED)
    edited = probe.permuted(kernel.source)
    compile(edited, "permuted", "exec")
    assert "% uint32(4) * uint32(8)" in edited and edited.count("smem[dQ_add_s + ") == 1
