"""Planted bugs in an accumulator and in the tiled executor are caught by ``check_equivalent``
in its default budget, with shrunk counterexamples no larger than twice the block."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat.verify import executor as loopnest  # the tiled executor (chunk_starts)
from napkin_cat.verify import accumulators
from napkin_cat.verify.accumulators import ACC_STEPS

q, x, d = nc.axes("q x d")
ATTN = nc.library.attention(q=q, x=x, d=d)
CAUSAL = nc.library.attention(q=q, x=x, d=d, causal=True)

# (original, relabelled, block per partitioned axis: concrete, or the symbol to read)
CASES = {
    "concrete": (ATTN, ATTN.stream(x, 16).tile(q, 32), {"x": 16, "q": 32}),
    "symbolic": (ATTN, ATTN.stream(x, "s_x").tile(q, "g_q"), {"x": "s_x", "q": "g_q"}),
    "causal": (CAUSAL, CAUSAL.stream(x, 8), {"x": 8}),
}


def _no_rescale_update(box, axis, state, ins, ctx):
    """online softmax with the rescale ``delta = exp(mu - mu')`` dropped."""
    s, v = ins
    k = accumulators._red_axis(box, axis)
    mu_new = np.maximum(state["mu"], np.max(s, axis=k))
    safe = np.where(np.isfinite(mu_new), mu_new, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - np.expand_dims(safe, k))
    o = state["o"] + accumulators._einsum([p, v], box.dom, accumulators._out_names(box))
    return {"mu": mu_new, "z": state["z"] + np.sum(p, axis=k), "o": o}


def _rescale_only_outside_moderate_jumps(box, axis, state, ins, ctx):
    """online softmax that skips the rescale when the running max jumps by 20 to 1e4 (the
    jumps real scores make between chunks; near 1 or near 1e8 it is right)."""
    s, v = ins
    k = accumulators._red_axis(box, axis)
    mu_new = np.maximum(state["mu"], np.max(s, axis=k))
    safe = np.where(np.isfinite(mu_new), mu_new, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        jump = mu_new - state["mu"]
        delta = np.where((jump > 20) & (jump < 1e4), 1.0, np.exp(state["mu"] - safe))
        p = np.exp(s - np.expand_dims(safe, k))
    o = np.expand_dims(delta, -1) * state["o"] + accumulators._einsum([p, v], box.dom, accumulators._out_names(box))
    return {"mu": mu_new, "z": delta * state["z"] + np.sum(p, axis=k), "o": o}


def _zero_max_init(box, axis, shapes, ctx):
    """online softmax starting from ``mu = 0`` instead of ``-inf``."""
    return {"mu": np.zeros(shapes["mu"]), "z": np.zeros(shapes["z"]), "o": np.zeros(shapes["o"])}


def _drop_partial_chunks(start, stop, step):
    """every ragged chunk is skipped (also a lone one shorter than the block)."""
    return range(start, stop - (stop - start) % step, step)


def _drop_from_fourth_chunk_on(start, stop, step):
    """chunks from the fourth on are skipped."""
    return range(start, min(stop, start + 3 * step), step)


def _drop_tail_after_full_chunks(start, stop, step):
    """the ragged chunk is skipped only after at least one full chunk."""
    n = stop - start
    return range(start, stop - n % step, step) if n > step else range(start, stop, step)


def _catch(a, b):
    with pytest.raises(nc.EquivalenceError) as info:
        nc.check_equivalent(a, b, progress=False)   # the default budget
    return info.value


def _assert_small(err, blocks):
    cx = err.counterexample
    sizes = cx["axis_sizes"]
    for axis, block in blocks.items():
        b = cx["blocks"][block] if isinstance(block, str) else block
        assert sizes[axis] <= 2 * b, (axis, sizes, cx["blocks"])
    return cx


def _reproduces(err):
    """The printed code, run, shows the same two values."""
    cx = err.counterexample
    ns: dict = {}
    exec(cx["code"].replace("print(", "_shown = ("), ns)
    a_val, b_val = ns["_shown"]
    np.testing.assert_equal([a_val, b_val], [cx["a_value"], cx["b_value"]])


@pytest.mark.parametrize("case", sorted(CASES))
def test_missing_rescale_is_caught(case, monkeypatch):
    a, b, blocks = CASES[case]
    monkeypatch.setitem(ACC_STEPS, "online_softmax",
                        dataclasses.replace(ACC_STEPS["online_softmax"], update=_no_rescale_update))
    err = _catch(a, b)
    cx = _assert_small(err, blocks)
    block_x = cx["blocks"].get("s_x", blocks["x"]) if case == "symbolic" else blocks["x"]
    assert cx["axis_sizes"]["x"] > block_x, "needs a second chunk to show"
    _reproduces(err)
    print(err)


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_initial_max_is_caught(case, monkeypatch):
    a, b, blocks = CASES[case]
    monkeypatch.setitem(ACC_STEPS, "online_softmax",
                        dataclasses.replace(ACC_STEPS["online_softmax"], init=_zero_max_init))
    err = _catch(a, b)
    cx = _assert_small(err, blocks)
    assert cx["regime"] in ("huge", "huge_one_sign"), "only scores far below zero show it"
    _reproduces(err)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bug", [_drop_partial_chunks, _drop_tail_after_full_chunks])
def test_dropped_ragged_tail_is_caught(case, bug, monkeypatch):
    a, b, blocks = CASES[case]
    monkeypatch.setattr(loopnest, "chunk_starts", bug)
    err = _catch(a, b)
    cx = _assert_small(err, blocks)
    if bug is _drop_tail_after_full_chunks:   # some axis must have a full chunk and a ragged one
        concrete = {ax: cx["blocks"][blk] if isinstance(blk, str) else blk for ax, blk in blocks.items()}
        assert any(blk < cx["axis_sizes"][ax] < 2 * blk for ax, blk in concrete.items()), cx
    _reproduces(err)


def test_counterexample_message_shows_the_shrunk_example(monkeypatch):
    a, b, _ = CASES["concrete"]
    monkeypatch.setitem(ACC_STEPS, "online_softmax",
                        dataclasses.replace(ACC_STEPS["online_softmax"], update=_no_rescale_update))
    text = str(_catch(a, b))
    assert "shrunk through" in text and "first difference: output O at (q=0, d=0)" in text
    assert "rng = np.random.default_rng(" in text and "nc.evaluate(b, Q, K, V, sizes=sizes)" in text


@pytest.mark.slow
@pytest.mark.parametrize("case", ["concrete", "causal"])
def test_rescale_skipped_on_moderate_jumps_is_caught(case, monkeypatch):
    """The running max must jump by 20-1e4 between chunks: the ``jumps`` regime makes such jumps
    on purpose (huge one-sign scores, over several chunks, sometimes do too)."""
    a, b, blocks = CASES[case]
    monkeypatch.setitem(ACC_STEPS, "online_softmax",
                        dataclasses.replace(ACC_STEPS["online_softmax"], update=_rescale_only_outside_moderate_jumps))
    err = _catch(a, b)
    assert err.counterexample["regime"] in ("jumps", "huge_one_sign", "huge")
    _reproduces(err)
    # and with only the normal and jumps regimes, jumps alone finds it
    from napkin_cat.verify import check
    build = check._Problem.build
    monkeypatch.setattr(check._Problem, "build", staticmethod(
        lambda *args, **kw: dataclasses.replace(build(*args, **kw), regimes=("normal", "jumps"))))
    assert _catch(a, b).counterexample["regime"] == "jumps"


@pytest.mark.parametrize("case", sorted(CASES))
def test_bug_from_the_fourth_chunk_on_is_caught(case, monkeypatch):
    """Sizes are drawn up to six blocks, so four or more chunks occur in the default budget."""
    a, b, blocks = CASES[case]
    monkeypatch.setattr(loopnest, "chunk_starts", _drop_from_fourth_chunk_on)
    err = _catch(a, b)
    cx = err.counterexample
    concrete = {ax: cx["blocks"][blk] if isinstance(blk, str) else blk for ax, blk in blocks.items()}
    assert any(cx["axis_sizes"][ax] > 3 * blk for ax, blk in concrete.items()), cx
    _reproduces(err)


def test_a_support_too_narrow_is_caught(monkeypatch):
    """A predicate's support drives chunk skipping in the executor, the cost model and the
    kernels; one that leaves out a kept column (causal: ``hi = r1 - 1`` instead of ``r1``) skips
    a chunk that matters, and the executor's check against the oracle finds it."""
    from napkin_cat.ops import index

    def narrow(r0, r1, args, al):
        return 0, al.sat_sub(r1, 1)

    monkeypatch.setitem(index.PREDICATES, "causal", dataclasses.replace(index.PREDICATES["causal"], support=narrow))
    q, x, d = nc.axes("q x d")
    att = nc.library.attention(q=q, x=x, d=d, causal=True)
    with pytest.raises(nc.EquivalenceError):
        nc.check_equivalent(att, att.stream(x, "s_x").tile(q, "g_q"), examples=40)
