"""``kernels/probes/forward_stages.py`` measured a third chunk buffer for the attention forward by
rewriting the generated source (kernels/BENCHMARKS.md, sixth session of 2026-11-29): each rewrite
still finds its places in today's generated forward, and the rewritten kernel matches the oracle
in the simulator (five chunks, so every buffer is filled and released more than once).  The same
for ``kernels/probes/forward_overlap.py`` (seventh session), which rewrites the three-buffer
forward further: chunk c's softmax beside chunk c - 1's update."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
import napkin_cat.lowering as lowering  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_wgmma import warpgroups  # noqa: E402,F401  (the fixture: planner.WGMMA on)

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("forward_stages", ROOT / "kernels/probes/forward_stages.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def _forward(monkeypatch):
    """The forward with its logsumexp as nc.torch_op plans it for a GPU: three computing warpgroups
    and a copying one, key chunks of 64, five of them; over two buffers (``producer.STAGES = 2``),
    the forward these probes rewrite (the generator's own three buffers: tests/test_producer.py)."""
    from napkin_cat.lowering import producer
    from napkin_cat.lowering.backward_forms import backward_plan
    monkeypatch.setattr(lowering, "_gpu_present", lambda runtime: True)
    monkeypatch.setattr(producer, "STAGES", 2)
    q, x, d = nc.axes("q x d")
    fl = nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
    fwd = backward_plan(fl, form="one kernel").at(nc.f16).forward.bind({q: 192, x: 320, d: 16})
    return fwd, nc.lower(fwd, tiles={"g_q": 192, "s_x": 64}, threads=384, verify=False, prefetch="auto")


def _three(kernel):
    probe = _probe()
    return probe.edited(kernel, *probe.three_buffers(kernel.source, 3))


def test_the_stages_probe_still_edits_what_the_generator_writes(warpgroups, monkeypatch):
    _, kernel = _forward(monkeypatch)
    assert "the copying warpgroup: copies every chunk" in kernel.source
    mutant = _three(kernel)
    compile(mutant.source, "three buffers", "exec")
    assert mutant.launch.dynamic_smem_bytes > kernel.launch.dynamic_smem_bytes
    released = set(re.findall(r"bar_named\(uint32\((\d+)\) \+", mutant.source))
    arrived = set(re.findall(r"bar_arrive\(uint32\((\d+)\) \+", mutant.source))
    assert released == arrived == {"11"}


@pytest.mark.slow
def test_three_buffers_match_the_oracle_in_the_simulator(warpgroups, monkeypatch):
    fwd, kernel = _forward(monkeypatch)
    oracle = fwd.unrelabelled()
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in oracle.dom]
    for k in (kernel, _three(kernel)):
        out = kernelcheck.kernel_outcome(oracle, k, inputs)
        assert out.failure is None and out.abs_error < 1e-3, kernelcheck.describe_failure(out.failure)


def _overlap_probe():
    spec = importlib.util.spec_from_file_location("forward_overlap", ROOT / "kernels/probes/forward_overlap.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_the_overlap_probe_still_edits_what_the_generator_writes(warpgroups, monkeypatch):
    """``forward_overlap.py`` (kernels/BENCHMARKS.md, seventh session of 2026-11-29): S of chunk c
    issued before the update of chunk c - 1, S waited for alone, O rescaled after the update."""
    _, kernel = _forward(monkeypatch)
    mutant = _overlap_probe().rewritten(kernel, 3)
    compile(mutant.source, "overlap", "exec")
    loop = mutant.source.split("for x0 in range(CHUNK_x, N_x, CHUNK_x):", 1)[1].split("# the last chunk's update")[0]
    order = [loop.index(s) for s in ("wgmma_f16_n64_z(", "V_s_prev * U2", "wgmma_wait1_n64(S_regs_wg)",
                                     "O_delta[i] = delta", "O_o_wg = wgmma_wait_n16(O_o_wg)",
                                     "bar_arrive(uint32(11) + buf_prev", "O_o[i, j] *= O_delta[i]",
                                     "a00 = pack_f16(")]
    assert order == sorted(order)
    assert "O_o[i, j] *= delta" not in loop


@pytest.mark.slow
def test_the_overlap_matches_the_oracle_in_the_simulator(warpgroups, monkeypatch):
    """The simulator's warpgroup twins track each commit group (``tensorcore.InFlight``): an
    accumulator read before its group's wait raises there."""
    fwd, kernel = _forward(monkeypatch)
    oracle = fwd.unrelabelled()
    rng = np.random.default_rng(1)
    inputs = [6.0 * rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in oracle.dom]
    out = kernelcheck.kernel_outcome(oracle, _overlap_probe().rewritten(kernel, 3), inputs)
    assert out.failure is None and out.abs_error < 1e-2, kernelcheck.describe_failure(out.failure)


def test_the_turns_probe_hands_each_turn_on(warpgroups, monkeypatch):
    """The overlap in turns (FlashAttention-3's ping-pong over three warpgroups): each warpgroup
    waits for its turn before its two contractions and hands the turn on after them, outside any
    branch; warpgroup 0 waits for the last hand-over after the loop (every arrival is waited for);
    barrier 1 serves where 16 run short."""
    probe = _overlap_probe()
    assert probe.turn_ids(2) == [11, 12] and probe.turn_ids(3) == [1, 14, 15]
    _, kernel = _forward(monkeypatch)
    mutant = probe.rewritten(kernel, 3, turns=True)
    compile(mutant.source, "turns", "exec")
    loop = mutant.source.split("for x0 in range(CHUNK_x, N_x, CHUNK_x):", 1)[1].split("# the last chunk's update")[0]
    order = [loop.index(s) for s in ("bar_named(turn_me", "wgmma_f16_n64_z(", "V_s_prev * U2",
                                     "bar_arrive(turn_next", "wgmma_wait1_n64(S_regs_wg)")]
    assert order == sorted(order)
    assert "    bar_arrive(turn_next, uint32(256))" in loop and "if x0 + CHUNK_x < N_x or" not in loop
    assert "if wg_turn == U0:  # the last warpgroup's last hand-over, waited for\n" in mutant.source
    head = mutant.source.split("for x0 in range(CHUNK_x, N_x, CHUNK_x):", 1)[0]
    assert "if wg_turn == uint32(2):  # the first turn is warpgroup 0's\n" in head


@pytest.mark.slow
def test_the_overlap_in_turns_matches_the_oracle_in_the_simulator(warpgroups, monkeypatch):
    """Turns add only named barriers: a missing or extra arrival deadlocks or is refused by the
    simulator's barriers (a thread arriving twice in one phase)."""
    fwd, kernel = _forward(monkeypatch)
    oracle = fwd.unrelabelled()
    rng = np.random.default_rng(2)
    inputs = [6.0 * rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in oracle.dom]
    out = kernelcheck.kernel_outcome(oracle, _overlap_probe().rewritten(kernel, 3, turns=True), inputs)
    assert out.failure is None and out.abs_error < 1e-2, kernelcheck.describe_failure(out.failure)


@pytest.mark.slow
@pytest.mark.parametrize("through_wait", [False, True], ids=["issue", "issue-and-wait"])
def test_turns_around_the_scores_match_the_oracle_in_the_simulator(warpgroups, monkeypatch, through_wait):
    fwd, kernel = _forward(monkeypatch)
    probe = _overlap_probe()
    source = probe.score_turns(kernel.source, 3, through_wait)
    assert source.count("bar_named(turn_me, uint32(256))") == 1 and source.count("bar_arrive(turn_next") == 1
    oracle = fwd.unrelabelled()
    rng = np.random.default_rng(3)
    inputs = [6.0 * rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in oracle.dom]
    out = kernelcheck.kernel_outcome(oracle, _probe().edited(kernel, source), inputs)
    assert out.failure is None and out.abs_error < 1e-2, kernelcheck.describe_failure(out.failure)


def _copies_probe():
    spec = importlib.util.spec_from_file_location("forward_copies", ROOT / "kernels/probes/forward_copies.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_the_copies_probe_still_edits_what_the_generator_writes(warpgroups, monkeypatch):
    """``forward_copies.py`` (kernels/BENCHMARKS.md, second session of 2026-11-30): two chunks' copies in
    flight over three buffers, and no copies (this forward has no heads to reorder)."""
    _, kernel = _forward(monkeypatch)
    probe = _copies_probe()
    source, extra = probe.two_in_flight(kernel.source, 3)
    compile(source, "two in flight", "exec")
    assert extra > 0 and source.count("cp_async_wait1()") == 2
    assert "cp_async16" in probe.no_copy(kernel.source)


@pytest.mark.slow
def test_two_chunks_in_flight_match_the_oracle_in_the_simulator(warpgroups, monkeypatch):
    fwd, kernel = _forward(monkeypatch)
    probe = _copies_probe()
    oracle = fwd.unrelabelled()
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(tuple(a.size for a in arr.axes)).astype(np.float32) for arr in oracle.dom]
    out = kernelcheck.kernel_outcome(oracle, _probe().edited(kernel, *probe.two_in_flight(kernel.source, 3)), inputs)
    assert out.failure is None and out.abs_error < 1e-3, kernelcheck.describe_failure(out.failure)
