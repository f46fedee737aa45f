"""Later warpgroup MMAs issued before an earlier one's epilogue (:mod:`napkin_cat.lowering.issue_ahead`):
in the one-kernel attention backward ``dP = dO V^T`` is issued before ``P = exp(S - L)`` is computed,
and the updates of dV and dK before dQ's atomic adds; each contraction waits with the depth of the
groups committed after it.  Checked against the oracle in the simulator, whose twins track the groups
(``tensorcore.InFlight``): a planted wait that leaves its group pending, or accumulators unpacked
before their wait, are caught; a contraction that reads an earlier one's result is not issued early;
with the switch off the source waits for each contraction before the next."""
from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import issue_ahead  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_frag_operands import _inputs  # noqa: E402  (residuals from the forward, dO, D)
from test_wgmma import warpgroups  # noqa: E402,F401  (the fixture: planner.WGMMA on)

L = nc.library
q, x, d = nc.axes("q x d")
SIZES = {q: 70, x: 140, d: 32}


def _backward(causal: bool, sizes: dict = SIZES):
    """The one-kernel backward's (dQ, dK, dV) part on two warpgroups and its kernel; by default at
    ragged sizes, several chunks and key tiles."""
    from napkin_cat.lowering.backward_forms import backward_plan
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    (part,) = backward_plan(fl, form="one kernel").at(nc.f16).parts[1:]
    bound = part.bind(sizes)
    return part, bound, nc.lower(bound, tiles={"g_x": 128, "s_q": 64}, threads=256, verify=False)


def _outcome(part, bound, kernel, causal: bool, sizes: dict = SIZES):
    inputs = _inputs(sizes, causal, 12.0)
    return kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])


def _body(kernel) -> str:
    return kernel.source.split("@cuda.jit(fastmath")[-1]


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_the_backward_issues_dp_before_p_and_the_updates_before_dqs_adds(warpgroups, causal):
    part, bound, kernel = _backward(causal)
    body = _body(kernel)
    dp_issue = re.search(r"= wgmma_f16_n64(_ss)?_z\(smem16, (V_s_desc\d*, )?dO_s_desc", body).start()
    s_wait = re.search(r"acc\d+_wg = wgmma_wait1_n64\(acc\d+_wg\)", body).start()
    assert dp_issue < s_wait < re.search(r"math\.exp2?\(", body).start() < re.search(r"wgmma_wait_n64\(", body).start()
    dq_wait = re.search(r"wgmma_wait2_n\d+\(", body).start()
    dq_adds = re.search(r"red_add2\(|smem\[dQ_add_s", body).start()   # by atomics or staged (.staged_add)
    assert body.index("dK_o_wg = wgmma_f16") < dq_wait < dq_adds < body.index("dV_o_wg = wgmma_wait1_")
    # dQ = dS K reads dS, which the epilogue of dP writes: it is issued after it, not ahead
    assert re.search(r"smem(16|32)\[\(?dS_s \* U2", body).start() < body.index("ldsm_x4_t(smem16, dS_s_lane")
    out = _outcome(part, bound, kernel, causal)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("plant", ["depth", "early-unpack"])
def test_a_planted_wait_is_caught_by_the_simulators_groups(warpgroups, monkeypatch, plant):
    """``depth``: the first contraction of a run waits as if one more group were newer, so its own
    is still pending; ``early-unpack``: accumulators read before their wait."""
    real = issue_ahead.write_waits

    def planted(waits, depth, src):
        if plant == "depth":
            return real(waits, depth + 1 if depth == 1 else depth, src)
        for t, n, elems in waits:
            src(f"{', '.join(elems)} = {t}")
        return real(waits, depth, src)
    monkeypatch.setattr(issue_ahead, "write_waits", planted)
    one_chunk = {q: 64, x: 128, d: 16}
    part, bound, kernel = _backward(False, one_chunk)
    out = _outcome(part, bound, kernel, False, one_chunk)
    assert out.failure is not None
    said = kernelcheck.describe_failure(out.failure)
    assert ("group still pending" if plant == "depth" else "read before a wgmma_wait") in said, said


def test_without_the_switch_each_contraction_is_waited_for_before_the_next(warpgroups, monkeypatch):
    monkeypatch.setattr(issue_ahead, "ISSUE_AHEAD", False)
    part, bound, kernel = _backward(True, {q: 64, x: 128, d: 16})
    body = _body(kernel)
    assert not re.search(r"wgmma_wait[1-9]_n\d+\(", body)
    assert re.search(r"math\.exp2?\(", body).start() < re.search(r"= wgmma_f16_n64(_ss)?_z\(smem16, (V_s_desc\d*, )?dO_s_desc", body).start()


def test_a_split_source_writes_the_issue_ahead_and_the_rest_in_place():
    """The code of a contraction issued ahead goes to the run's slot until its commit, the rest to its
    own place, at one depth; switching inside a block, or twice, is refused."""
    from napkin_cat.core.errors import LoweringError
    from napkin_cat.lowering.source import Source
    main = Source(2)
    ahead = main.slot()
    main("elements_of_the_first()")
    split = issue_ahead.SplitSource(ahead, main)
    split("wgmma_commit()")
    split.switch()
    split("its_own_epilogue()")
    assert [ln.strip() for ln in main.lines] == ["wgmma_commit()", "elements_of_the_first()", "its_own_epilogue()"]
    assert all(ln.startswith(" " * 8) for ln in main.lines)
    with pytest.raises(LoweringError, match="switched twice"):
        split.switch()
    inner = issue_ahead.SplitSource(Source(1).slot(), Source(1))
    with inner.block("if flags:"), pytest.raises(LoweringError, match="inside a block"):
        inner.switch()
