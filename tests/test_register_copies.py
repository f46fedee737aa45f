"""Values a later epilogue reads on the same threads stay in registers (lowering/register_copies.py),
and values of a row alone are computed once per row (lowering/emit.py, ``RowHoist``).

The FlashAttention-2 backward recomputes ``P = exp(S - L)`` and forms ``dS = P * (dP - D)`` in
the epilogue of ``S = Q K^T``.  ``dP = dO V^T`` and (in the dK, dV kernel) ``P`` come from earlier
phases on the same tensor-core fragments, so each thread already holds the elements it needs:
they are read from registers, not through a shared buffer and a block barrier.  ``L`` and ``D``
have no key axis, so the epilogue reads them once per fragment row.  Both kernels still match
the oracle on adversarial data (huge logits, ragged sizes) in the simulator.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat.lowering import planner
from napkin_cat.verify import kernelcheck

L = nc.library
q, x, d = nc.axes("q x d")
SIZES = {q: 37, x: 29, d: 16}


def _parts(dtype, causal=False):
    from napkin_cat.lowering.torch_op import backward_plan
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    return backward_plan(fl).at(dtype).parts[1:]   # after D = rowsum(dO O)


def _inputs(causal, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    fwd = L.attention(q=q, x=x, d=d, causal=causal, logsumexp=True).bind(SIZES)
    ins = [scale * rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in fwd.dom]
    outs = nc.evaluate(fwd, *ins)
    return [*ins, *outs, rng.standard_normal(outs[0].shape)]


def _lower(part, tiles):
    kernel = nc.lower(part.bind(SIZES), threads=64, tiles=tiles, verify=False)
    return kernel, kernel.source.split("@cuda.jit(fastmath")[-1]


def _check(part, kernel, causal, scale):
    names = [a.name for a in part.dom]
    named = dict(zip(("Q", "K", "V", "O", "L", "dO"), _inputs(causal, scale)))
    named["D"] = (named["dO"] * named["O"]).sum(-1)
    out = kernelcheck.kernel_outcome(part.bind(SIZES).unrelabelled(), kernel, [named[n] for n in names])
    assert out.failure is None, out.failure


@pytest.mark.parametrize("causal", [False, True])
def test_dq_reads_dp_from_registers_with_no_shared_buffer_or_barrier_for_it(causal):
    part = _parts(nc.f16, causal)[1]
    assert [a.name for a in part.cod] == ["dQ"]
    kernel, body = _lower(part, {"g_q": 32, "s_x": 16})
    assert "dP_s" not in kernel.source                       # no shared buffer
    assert re.search(r"dP_r = cuda\.local\.array\(\(\d+, \d+\), float32\)  # dP kept for dS", body)
    assert re.search(r"dP_r\[i, j\] = acc\d*\[i, j\]", body)
    assert re.search(r"\(dP_r\[i, j\]\) - ", body)            # read in dS's epilogue
    # P = exp(S / sqrt(d) - L) as one ex2 of a fused multiply-add (emit_kinds.scaled_exponent);
    # not yet through a mask between the scale and the difference (causal)
    folded = re.search(r"math\.exp2\(acc\d*\[i, j\] \* C_PRESCALE_LOG2E - L_\d+ \* LOG2E\)", body)
    assert bool(folded) is not causal and ("math.exp(" in body) is causal
    for scale in (1.0, 30.0):                                 # huge logits too
        _check(part, kernel, causal, scale)
    old = planner.REGISTER_COPIES
    planner.REGISTER_COPIES = False
    try:
        k2, body2 = _lower(part, {"g_q": 32, "s_x": 16})
    finally:
        planner.REGISTER_COPIES = old
    assert "dP_s" in k2.source and "dP_r" not in body2
    assert body2.count("cuda.syncthreads()") > body.count("cuda.syncthreads()")


def test_dkdv_keeps_p_buffer_for_the_tensor_cores_and_reads_its_fp32_copy_in_ds(monkeypatch):
    """Without :mod:`napkin_cat.lowering.frag_operands` (which keeps P in registers for dV too:
    tests/test_frag_operands.py), P is also dV's tensor-core operand on another mapping, read
    transposed through ldmatrix, so its 16-bit buffer stays; dS reads the fp32 value from the
    copy instead of the buffer."""
    monkeypatch.setattr(planner, "FRAG_OPERANDS", False)
    part = _parts(nc.bf16)[0]
    assert [a.name for a in part.cod] == ["dK", "dV"]
    kernel, body = _lower(part, {"g_x": 32, "s_q": 16})
    assert "P_s" in kernel.source and re.search(r"P_r = cuda\.local\.array.*# P kept for dS", body)
    epilogue = body[body.index("# dS["):]
    assert "P_r[i, j]" in epilogue and "P_s * U2" not in epilogue.split("# update dV")[0]
    _check(part, kernel, False, 30.0)


def test_a_row_value_is_read_once_per_fragment_row_before_the_column_loop(monkeypatch):
    """``L`` and ``D`` (no key axis) are read into registers in the row loop of the epilogue,
    not once per element inside the column loop: in both parts while their scores' rows are
    queries (with :mod:`napkin_cat.lowering.frag_operands` the dK, dV kernel's rows are keys, and
    ``L``, ``D`` are column values there)."""
    monkeypatch.setattr(planner, "FRAG_OPERANDS", False)
    for part, tiles in zip(_parts(nc.f16), ({"g_x": 32, "s_q": 16}, {"g_q": 32, "s_x": 16})):
        _, body = _lower(part, tiles)
        lines = body.splitlines()
        row_read = re.compile(r"^\s*\w+ = .*smem\[(L_s|D_s) \+ ")
        reads = [i for i, ln in enumerate(lines) if row_read.search(ln)]
        assert len(reads) >= 2, part.cod
        for i in reads:
            indent = len(lines[i]) - len(lines[i].lstrip())
            following = next(ln for ln in lines[i + 1:] if not row_read.search(ln))
            assert following.strip().startswith("for j in range") and following.startswith(" " * indent), \
                (lines[i], following)


def test_no_copy_between_different_mappings_or_without_a_later_reader():
    """The forward keeps its fused scores path (no copies), and a plain matmul has none."""
    flash = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 16).place("O", "registers")
    k = nc.lower(flash.bind({q: 32, x: 32, d: 16}), threads=32, verify=False)
    assert "kept for" not in k.source and "_r = cuda.local.array" not in k.source
    mm = L.matmul(q, d, x, dtype=nc.f16).tile(q, 16)
    k2 = nc.lower(mm.bind({q: 32, x: 16, d: 16}), threads=32, verify=False)
    assert "kept for" not in k2.source
