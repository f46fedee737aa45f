"""Values of a micro-tile's column alone, computed once per column (:func:`napkin_cat.lowering.column_values.column_value`).

In the backward's dK, dV kernel the keys are the fragments' rows and the queries their columns,
so ``L`` (with ``max(L, lowest)``) and ``D`` are values of a column: the generator reads each
once per column of the thread, before the row loop, into a register array, instead of once per
element.  Checked under the simulator against the oracle (ragged sizes, several chunks, huge
logits, both 16-bit types), against the kernel with the switch off, and that a value
of the row or of the element stays where it was.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import column_values  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_frag_operands import _inputs, _parts, q, x, d  # noqa: E402
from test_kernel_fuzz import column_arrays  # noqa: E402
from test_wgmma import warpgroups  # noqa: E402,F401  (the fixture: planner.WGMMA on)

BLOCKS = {"g_x": 16, "s_q": 16, "g_q": 16, "s_x": 16}


def _dkdv(dtype, sizes, switch=True):
    part = _parts(dtype)[0].bind(sizes)
    old = column_values.COLUMN_VALUES
    column_values.COLUMN_VALUES = switch
    try:
        tiles = {k: v for k, v in BLOCKS.items() if k in part._sched_str()}
        return part, nc.lower(part, tiles=tiles, threads=32, verify=False)
    finally:
        column_values.COLUMN_VALUES = old


@pytest.mark.parametrize("dtype", [nc.f16, nc.bf16])
def test_l_and_d_are_read_once_per_column_and_the_kernel_matches(dtype):
    sizes = {q: 37, x: 23, d: 16}
    part, kernel = _dkdv(dtype, sizes)
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    hoisted = re.findall(r"^\s*(\w+)_cols = cuda\.local\.array\((\d+), float32\)  # (\w+) per column", body, re.M)
    assert {name for name, _, _ in hoisted} == {"L", "D"}, hoisted
    # in the element loops L and D are read from the column arrays, never from their shared buffers
    elements = [ln for ln in body.splitlines() if re.search(r" = .*smem\[(L|D)_s", ln)]
    assert elements and all(re.match(r"^\s*(L_\d+ = |D_cols\[j\] = )", ln) for ln in elements), elements
    assert "L_cols[j]" in body and "D_cols[j]" in body
    inputs = _inputs(sizes, False, 12.0)                   # huge logits: P underflows on most entries
    args = [inputs[a.name] for a in part.dom]
    assert kernelcheck.kernel_outcome(part.unrelabelled(), kernel, args).failure is None
    _, off = _dkdv(dtype, sizes, switch=False)
    assert "per column of this thread" not in off.source
    ins32 = kernelcheck.as_kernel_inputs(args, part.dom)
    for a, b in zip(kernelcheck.run_kernel(kernel, ins32), kernelcheck.run_kernel(off, ins32)):
        np.testing.assert_array_equal(a, b)                   # the same arithmetic, read once


def test_values_of_the_row_or_the_element_are_not_hoisted_to_the_columns():
    """In the dQ kernel the queries are the rows: ``L`` and ``D`` are values of a row there,
    read once per row as before, and nothing is a value of a column alone."""
    part = _parts(nc.f16)[1].bind({q: 37, x: 23, d: 16})
    tiles = {k: v for k, v in BLOCKS.items() if k in part._sched_str()}
    src = nc.lower(part, tiles=tiles, threads=32, verify=False).source
    assert "per column of this thread" not in src


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_column_values_are_read_before_the_wait_of_the_contraction_they_serve(warpgroups, causal, monkeypatch):
    """column_values.BEFORE_WAIT: the one-kernel backward on warpgroups reads L and D per column
    before the wait for S and dP (the loads overlap it), never across a barrier; matches the oracle
    (ragged sizes, several chunks); off, or above the contraction's steps, they follow the wait."""
    from test_issue_ahead import _backward, _body, _outcome
    monkeypatch.setattr(column_values, "BEFORE_WAIT", 2)   # 32 wide: two steps of 16
    part, bound, kernel = _backward(causal)
    body = _body(kernel)
    arrays = list(column_arrays(body))
    before = [n for n, start, read in arrays if "= wgmma_wait" in body[start:read]]
    assert {n.split("_")[0] for n in before} == {"L", "D"}, arrays
    for name, start, read in arrays:
        assert not re.search(r"bar_named\(|syncthreads\(", body[start:read]), f"{name} read across a barrier"
    if causal:
        out = _outcome(part, bound, kernel, causal)
        assert out.failure is None, kernelcheck.describe_failure(out.failure)
    for off in (0, 3):
        monkeypatch.setattr(column_values, "BEFORE_WAIT", off)
        body = _body(_backward(causal)[2])
        assert not [n for n, start, read in column_arrays(body) if "= wgmma_wait" in body[start:read]]
