"""Warpgroup MMAs with A read by descriptor too (``wgmma``'s SS form, :data:`napkin_cat.lowering.wgmma.SHARED_A`):
an input's 16-bit buffer over (rows, reduced axis), in the core-matrix layout, read by each warpgroup
from its own 64 rows, where its fragments are not held in registers (under a mask that bounds the
stream loop).  Checked against the oracle in the simulator, whose twin reads A's descriptor as it
reads B's (K-major) and refuses warps of one warpgroup that name different rows; a planted wrong
row base is caught; with the switch off A comes from registers as before."""
from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import wgmma  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_frag_operands import _inputs  # noqa: E402  (residuals from the forward, dO, D)
from test_wgmma import warpgroups  # noqa: E402,F401  (the fixture: planner.WGMMA on)

L = nc.library
q, x, d = nc.axes("q x d")


def _forward(causal: bool):
    """Two warpgroups of 64 query rows each (128-row tiles, 256 threads), keys in chunks of 32."""
    return L.attention(q=q, x=x, d=d, causal=causal, dtype=nc.f16).stream(x, 32).tile(q, 128).place("O", "registers")


def _check(dia, kernel, seed: int = 1, scale: float = 12.0):
    rng = np.random.default_rng(seed)
    ins = [(scale if arr.name == "Q" else 1.0) * rng.standard_normal(tuple(a.size for a in arr.axes))
           for arr in dia.dom]
    return kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, ins)


def test_a_masked_forward_reads_q_by_descriptor_in_each_warpgroup(warpgroups):
    """Causal: Q's fragments are read per chunk (not held), so S = Q K^T reads Q by descriptor,
    each warpgroup from its 64 rows (ragged last tile and chunk, huge logits)."""
    dia = _forward(True).bind({q: 150, x: 150, d: 16})
    kernel = nc.lower(dia, threads=256, verify=False)
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    assert re.search(r"Q_s_desc\d* = wgmma_desc16\(smem16, \w+( \* U2)? \+ \(tid // U128 \* U4 % U8 \* U16\)", body)
    assert re.search(r"S\w*_wg = wgmma_f16_n32_ss_z\(smem16, Q_s_desc\d*, K_s_desc\d*, U0\)", body)
    assert "ldsm_x4(smem16, Q_s" not in body
    out = _check(dia, kernel)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_the_one_kernel_backward_reads_k_and_v_by_descriptor_under_a_mask(warpgroups):
    """S^T = K Q^T and dP^T = V dO^T read K and V by descriptor (V now in core matrices too), the
    rest as before; two warpgroups, ragged sizes, several chunks and key tiles."""
    from napkin_cat.lowering.backward_forms import backward_plan
    fl = L.attention(q=q, x=x, d=d, causal=True).stream(x, "s_x").tile(q, "g_q")
    sizes = {q: 70, x: 140, d: 32}
    (part,) = backward_plan(fl, form="one kernel").at(nc.f16).parts[1:]
    bound = part.bind(sizes)
    kernel = nc.lower(bound, tiles={"g_x": 128, "s_q": 64}, threads=256, verify=False)
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    assert re.search(r"wgmma_f16_n64_ss_z\(smem16, K_s_desc\d*, Q_s_desc\d*, U0\)", body)
    assert re.search(r"wgmma_f16_n64_ss_z\(smem16, V_s_desc\d*, dO_s_desc\d*, U0\)", body)
    assert "V_s[" in kernel.source and "input V (16-bit) (core matrices for wgmma)" in kernel.source
    inputs = _inputs(sizes, True, 12.0)
    out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_a_planted_row_base_shared_by_the_warpgroups_is_caught(warpgroups, monkeypatch):
    """Every warpgroup reading A from row 0: the second one multiplies the first one's rows."""
    real = wgmma.core_index
    monkeypatch.setattr(wgmma, "core_index", lambda s, f, ld, u: real(u(0), f, ld, u))
    dia = _forward(True).bind({q: 128, x: 64, d: 16})
    kernel = nc.lower(dia, threads=256, verify=False)
    assert "_ss_z(smem16, Q_s_desc" in kernel.source
    assert _check(dia, kernel, scale=1.0).failure is not None


def test_without_the_switch_a_comes_from_registers(warpgroups, monkeypatch):
    monkeypatch.setattr(wgmma, "SHARED_A", False)
    dia = _forward(True).bind({q: 150, x: 150, d: 16})
    kernel = nc.lower(dia, threads=256, verify=False)
    assert "_ss(" not in kernel.source.split("@cuda.jit(fastmath")[-1] and "ldsm_x4(smem16, Q_s" in kernel.source
    assert _check(dia, kernel).failure is None
