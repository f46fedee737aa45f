"""Three rules of the code generator, each checked against the oracle with the rule on and off:

- ``cp.async`` copies decode each thread's element once and then step by a constant
  (``emit_loads.STRIDED_COPIES``), where the copying threads are a multiple of the inner digits'
  span; elsewhere every step decodes its element as before;
- an online softmax (or normalisation) whose rows are spread over several lanes keeps each lane's
  part of the normaliser ``z`` through the stream and sums the lanes once after it
  (``emit_states.DEFER_ROW_SUMS``), before the output and a logsumexp read it;
- ``prefetch="auto"`` double-buffers a 16-bit kernel whose register estimate is too high for a
  second buffer where a copying warpgroup takes the copies (``producer.double_for_copies``).
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import emit_loads, emit_states, planner, producer  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

L = nc.library
q, x, d = nc.axes("q x d")
STEP = "# the same every step"
SUMMED = "each lane's part summed over the row's lanes"


def _check(dia, kernel, scale=1.0, seed=3):
    rng = np.random.default_rng(seed)
    ins = [(scale if arr.name == "Q" else 1.0) * rng.standard_normal(tuple(a.size for a in arr.axes))
           for arr in dia.dom]
    out = kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, ins)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("strided", [True, False])
def test_copies_step_by_a_constant_and_match_the_oracle(monkeypatch, strided):
    """The copying warpgroup's 128 threads over 16-wide rows of 8 x 8 core matrices (span 16):
    each thread's element is decoded once, the row block grows by 8 a step."""
    monkeypatch.setattr(planner, "WGMMA", True)
    monkeypatch.setattr(producer, "SWITCH", True)
    monkeypatch.setattr(emit_loads, "STRIDED_COPIES", strided)
    dia = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 32).tile(q, 128).place("O", "registers") \
        .bind({q: 140, x: 77, d: 16})
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    assert any(n.startswith("Copying warpgroup: threads 256..383") for n in kernel.notes), kernel.notes
    assert (STEP in body) == strided
    if strided:
        assert "ptid // U16 + u * U8" in body
    _check(dia, kernel)


def test_copies_whose_threads_do_not_divide_the_span_decode_every_step():
    """32 threads over rows of 48 elements in 8-wide groups (span 6): no constant step; at 64
    (span 8) the same kernel steps."""
    dia = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 32).bind({q: 40, x: 37, d: 64})
    assert STEP in nc.lower(dia, threads=32, prefetch="double", verify=False).source
    dia = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 32).bind({q: 40, x: 37, d: 48})
    kernel = nc.lower(dia, threads=32, prefetch="double", verify=False)
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    assert "cp_async16(" in body and STEP not in body
    _check(dia, kernel)


@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("causal,scale", [(False, 1.0), (True, 40.0)])
def test_row_sums_once_after_the_stream_match_the_oracle(monkeypatch, defer, causal, scale):
    """Rows over 8 lanes (fp32, register micro-tiles): with the parts kept per lane the stream has
    no sum over lanes, one follows it; huge logits move the row maxima between chunks."""
    monkeypatch.setattr(emit_states, "DEFER_ROW_SUMS", defer)
    dia = L.attention(q=q, x=x, d=d, causal=causal, logsumexp=True).stream(x, 8).tile(q, 16) \
        .place("O", "registers").bind({q: 37, x: 29, d: 8})
    kernel = nc.lower(dia, threads=64, verify=False)
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    assert ("psum = _group_sum(" in body) != defer
    assert body.count(SUMMED) == int(defer)
    if defer:    # summed before the logsumexp's lanes publish mu and z
        assert body.index(SUMMED) < body.index("lane 0 of each row publishes the row statistics")
    _check(dia, kernel, scale)


def test_a_normalisation_sums_its_rows_once_too():
    dia = L.normalized_attention(q=q, x=x, d=d).stream(x, 8).tile(q, 16).place("O", "registers") \
        .bind({q: 33, x: 21, d: 8})
    kernel = nc.lower(dia, threads=64, verify=False)
    assert SUMMED in kernel.source and "zsum = _group_sum(" not in kernel.source
    _check(dia, kernel)


def test_auto_double_buffers_where_a_copying_warpgroup_takes_the_copies(monkeypatch):
    """An online softmax on 256 computing threads whose register estimate leaves no room for a
    second buffer: "auto" plans it single-buffered, unless a copying warpgroup fills the buffers."""
    monkeypatch.setattr(planner, "WGMMA", True)
    monkeypatch.setattr(planner, "AUTO_PREFETCH_REGISTERS", 0)      # every estimate is too high
    dia = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 32).tile(q, 128).place("O", "registers") \
        .bind({q: 140, x: 77, d: 16})
    monkeypatch.setattr(producer, "SWITCH", False)
    assert planner.plan_kernel(dia, "k", 256, prefetch="auto").prefetch is False
    monkeypatch.setattr(producer, "SWITCH", True)
    plan = planner.plan_kernel(dia, "k", 256, prefetch="auto")
    assert plan.prefetch == "double" and producer.why_not(plan) is None
    kernel = nc.lower(dia, threads=256, prefetch="auto", verify=False)
    assert kernel.launch.block == (256 + producer.THREADS, 1, 1)
    _check(dia, kernel)
    fp32 = L.attention(q=q, x=x, d=d).stream(x, 32).tile(q, 128).bind({q: 140, x: 77, d: 16})
    assert planner.plan_kernel(fp32, "k", 256, prefetch="auto").prefetch is False   # no copies to take
