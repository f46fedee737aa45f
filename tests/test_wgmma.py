"""Warpgroup MMAs (lowering/wgmma.py): ``wgmma.mma_async.m64nNk16`` with B read by descriptor from a
core-matrix shared buffer, A from the ``mma.sync`` A-fragment registers.

Checked here: the core-matrix index is a bijection onto the buffer that keeps 8-element rows
contiguous and adds tile offsets linearly (``ldmatrix`` and ``cp.async`` address it like any
buffer); the planner moves exactly the contractions whose warps hold every column in whole
warpgroups, says why it leaves the others; kernels on warpgroups (forward, both backward kernels,
f16 / bf16, causal, ragged sizes, huge logits) against the oracle in the simulator, whose twin
reads the descriptor as the H100 did in ``kernels/probes/wgmma_probe.py``; a planted wrong
descriptor (the two byte offsets swapped) that the check catches; and the generated PTX
wrappers compile for sm_90a where NVRTC is installed.
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner, wgmma, wgmma_plan  # noqa: E402
from napkin_cat.lowering.plan import Frag  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_frag_operands import _inputs  # noqa: E402  (residuals from the forward, dO, D)

L = nc.library
q, x, d, h = nc.axes("q x d h")


@pytest.fixture
def warpgroups(monkeypatch):
    monkeypatch.setattr(planner, "WGMMA", True)


def _index(F: int):
    expr = wgmma.core_index("s", "f", F, str)
    return lambda s, f: eval(expr, {"s": s, "f": f})


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 5), st.integers(0, 5))
def test_core_index_is_a_bijection_with_contiguous_rows_and_linear_tiles(ps, pf, a, b):
    S, F = 8 * ps, 8 * pf
    idx = _index(F)
    seen = np.array([[idx(s, f) for f in range(F)] for s in range(S)])
    assert sorted(seen.ravel()) == list(range(S * F))
    assert (np.diff(seen.reshape(S, F // 8, 8), axis=-1) == 1).all()           # 16-byte rows
    s, f = min(S - 1, 8 * a + 3) % 8 + 8 * (a % ps), 8 * (b % pf) + 5
    base_s, base_f = s % 8, f % 8
    assert idx(s, f) == idx(base_s, base_f) + idx(s - base_s, f - base_f)     # lane part + tile part


def test_descriptor_strides_follow_the_measured_meaning():
    """K-major (the reduced axis fastest): LBO between blocks along k (128 B), SBO between panels
    of 8 rows; MN-major: the other way round (kernels/probes/wgmma_probe.py, H100)."""
    from napkin_cat.lowering.plan import Buffer
    kmaj = Buffer(("var", 1), "K_s", ("x", "d"), (64, 96), "K", bits=16, core=True)
    mnmaj = Buffer(("var", 2), "V_s", ("x", "d"), (64, 96), "V", bits=16, core=True)
    assert wgmma.strides(kmaj, "d") == (0, 128, 16 * 96, 128)
    assert wgmma.strides(mnmaj, "x") == (1, 16 * 96, 128, 16 * 96)
    assert kmaj.elems == 64 * 96 and kmaj.ld == 96


def test_mappings_the_warpgroups_refuse_say_why():
    ok = Frag("q", "x", 64, 64, 2, 16, 32, 4, Wm=4, Wn=1)
    assert wgmma_plan.mapping_ok(ok, 128) is None
    assert "warpgroups" in wgmma_plan.mapping_ok(Frag("q", "x", 64, 64, 2, 8, 16, 8, Wm=2, Wn=2), 128)
    assert "warpgroups" in wgmma_plan.mapping_ok(ok, 256)
    assert "at most 256" in wgmma_plan.mapping_ok(Frag("q", "x", 64, 512, 2, 128, 32, 4, Wm=4, Wn=1), 128)


def _forward(dtype, causal):
    return L.attention(q=q, x=x, d=d, causal=causal, dtype=dtype).stream(x, 32).tile(q, 64).place("O", "registers")


def test_the_forward_on_warpgroups_is_planned_and_matches_the_oracle(warpgroups):
    """Both contractions of FlashAttention's forward move: S = Q K^T reads K K-major, O += P V
    reads V MN-major; both buffers in core matrices; every barrier fenced for the async proxy;
    ragged sizes (the last chunk and tile zero-filled), huge logits."""
    sizes = {q: 70, x: 45, d: 16}
    dia = _forward(nc.f16, False).bind(sizes)
    kernel = nc.lower(dia, threads=128, verify=False)
    src = kernel.source
    assert src.count("wgmma.m64n32k16 per warpgroup and step") == 2
    assert "core matrices for wgmma" in next(ln for ln in src.splitlines() if ln.startswith("Shared memory:"))
    assert "(K-major core matrices)" in src and "(MN-major core matrices)" in src
    _assert_fenced_where_copies_land(src)
    rng = np.random.default_rng(1)
    ins = [(12.0 if arr.name == "Q" else 1.0) * rng.standard_normal(tuple(a.size for a in arr.axes))
           for arr in dia.dom]
    out = kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, ins)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def _assert_fenced_where_copies_land(src: str) -> None:
    """Every barrier that publishes copies (a ``cp.async`` wait just before it) is fenced for the
    async proxy; a barrier that only ends a chunk's reads is not (``wgmma.FENCE_BY_WRITES``)."""
    lines = [ln.strip() for ln in src.split("@cuda.jit(fastmath")[-1].splitlines()]
    bars = [i for i, ln in enumerate(lines) if ln == "cuda.syncthreads()"]
    landed = [i for i in bars if any(ln.startswith("cp_async_wait") for ln in lines[i - 4:i])]
    assert landed and all(lines[i - 1] == "fence_proxy_async()" for i in landed)
    assert any(lines[i - 1] != "fence_proxy_async()" for i in bars if i not in landed)


def test_every_barrier_is_fenced_with_fences_by_writes_off(warpgroups, monkeypatch):
    """``wgmma.FENCE_BY_WRITES = False`` fences every barrier of a warpgroup kernel, as before."""
    monkeypatch.setattr(wgmma, "FENCE_BY_WRITES", False)
    src = nc.lower(_forward(nc.f16, False).bind({q: 70, x: 45, d: 16}), threads=128, verify=False).source
    body = src.split("@cuda.jit(fastmath")[-1]
    assert body.count("cuda.syncthreads()") == body.count("fence_proxy_async()")


def test_without_the_switch_nothing_moves():
    kernel = nc.lower(_forward(nc.f16, False).bind({q: 64, x: 32, d: 16}), threads=128, verify=False)
    assert "wgmma" not in kernel.source and "core matrices" not in kernel.source


def test_two_warps_stay_on_mma_sync(warpgroups):
    kernel = nc.lower(_forward(nc.bf16, True).bind({q: 64, x: 32, d: 16}), threads=64, verify=False)
    assert "wgmma" not in kernel.source and "mma_bf16(" in kernel.source
    # each contraction that stays says why, in the kernel's notes
    why = [n for n in kernel.notes if n.startswith("Warpgroup MMA: the contraction over")]
    assert len(why) == 2 and all("stays on mma.sync" in n and "whole warpgroups" in n for n in why), kernel.notes


def _parts(dtype, causal):
    from napkin_cat.lowering.torch_op import backward_plan
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    return backward_plan(fl).at(dtype).parts[1:]    # (dK, dV), dQ


BACKWARD = [
    pytest.param(nc.f16, {q: 70, x: 45, d: 16}, False, 1.0, id="f16-full"),
    pytest.param(nc.bf16, {q: 37, x: 66, d: 16}, True, 12.0, id="bf16-causal-x12", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype,sizes,causal,scale", BACKWARD)
def test_backward_kernels_on_warpgroups_match_the_oracle(warpgroups, dtype, sizes, causal, scale):
    """The dK, dV kernel (S^T = K Q^T and dP^T = V dO^T K-major; dV += P^T dO and dK += dS^T Q
    MN-major, their A fragments the registers of P and dS) and the dQ kernel."""
    inputs = _inputs(sizes, causal, scale)
    for part in _parts(dtype, causal):
        bound = part.bind(sizes)
        tiles = {k: v for k, v in {"g_x": 64, "s_q": 32, "g_q": 64, "s_x": 32}.items() if k in part._sched_str()}
        kernel = nc.lower(bound, tiles=tiles, threads=128, verify=False)
        assert f"wgmma_{dtype.name}_n" in kernel.source, kernel.source[:3000]
        out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
        assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("dtype,causal,scale", [pytest.param(nc.f16, False, 1.0, id="f16-full"),
                                                 pytest.param(nc.bf16, True, 12.0, id="bf16-causal-x12",
                                                              marks=pytest.mark.slow)])
def test_the_one_kernel_backward_splits_dqs_columns_between_warpgroups(warpgroups, dtype, causal, scale):
    """The one-kernel backward on 8 warps: keys are the rows of S^T, dP^T, dK and dV (2 x 1
    warpgroups), but dQ = dS K has one 64-row chunk of queries, so its 8 warps are reshaped into
    2 warpgroups of 4 warps one above another, each multiplying one half of dQ's columns
    (``wgmma.m64n16k16`` at d = 32, K read MN-major from its slice of the core-matrix buffer); ragged sizes,
    several chunks and key tiles (dQ added across them by atomics)."""
    from napkin_cat.lowering.backward_forms import backward_plan
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    sizes = {q: 70, x: 140, d: 32}
    (part,) = backward_plan(fl, form="one kernel").at(dtype).parts[1:]
    bound = part.bind(sizes)
    kernel = nc.lower(bound, tiles={"g_x": 128, "s_q": 64}, threads=256, verify=False)
    assert "4x2 warps in 2 warpgroup(s) splitting the columns, each warp 16x16" in kernel.source
    # (under a mask the scores read K as A by descriptor too, tests/test_wgmma_shared_a.py: dQ's is another)
    assert re.search(r"K_s_desc\d* = wgmma_desc16\(smem16, K_s \* U2 \+ \(tx // U4 \* U16\)", kernel.source)
    assert "mma_f16(" not in kernel.source.split("@cuda.jit(fastmath")[-1]    # every contraction on warpgroups
    inputs = _inputs(sizes, causal, scale)
    out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_warpgroup_shapes_of_a_mapping():
    """Warps reshaped into warpgroups: 64 rows on 8 warps split the columns in two; a mapping
    already in warpgroups, or rows that no warpgroup slab divides, are left alone."""
    two_by_four = Frag("q", "d", 64, 64, 4, 4, 16, 16, Wm=2, Wn=4)
    alt = wgmma_plan.warpgroup_frag(two_by_four, 256)
    assert (alt.Wm, alt.Wn, alt.MT, alt.NT, alt.TY, alt.TX) == (4, 2, 1, 4, 32, 8)
    assert wgmma_plan.mapping_ok(alt, 256) is None
    assert wgmma_plan.warpgroup_frag(Frag("x", "q", 128, 64, 2, 16, 64, 4, Wm=8, Wn=1), 256) is None
    assert wgmma_plan.warpgroup_frag(Frag("q", "d", 32, 64, 2, 8, 16, 8, Wm=2, Wn=2), 128) is None


def test_a_planted_wrong_descriptor_is_caught(warpgroups, monkeypatch):
    """LBO and SBO swapped (the assignment the H100 measured wrong): B is read scrambled and the
    check against the oracle fails."""
    real = wgmma.strides

    def swapped(b, kax):
        trans, lbo, sbo, step = real(b, kax)
        return trans, sbo, lbo, step

    monkeypatch.setattr(wgmma, "strides", swapped)
    sizes = {q: 64, x: 32, d: 16}
    dia = _forward(nc.f16, False).bind(sizes)
    kernel = nc.lower(dia, threads=128, verify=False)
    rng = np.random.default_rng(0)
    oracle = dia.unrelabelled()
    ins = [rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in oracle.dom]
    assert kernelcheck.kernel_outcome(oracle, kernel, ins).failure is not None


def test_descriptors_are_built_once_and_fresh_accumulators_start_at_scale_d_0(warpgroups):
    """Each contraction builds B's descriptor once and adds each step's constant (16-byte units:
    128 elements K-major = 256 B = 16; MN-major 16 rows of 32 = 1024 B = 64); the scores, set to zero
    just before, start with scale-d 0 (``_z``, no zeros moved into the accumulators); the output's
    update, which adds to the rescaled O, never does."""
    src = nc.lower(_forward(nc.f16, False).bind({q: 64, x: 32, d: 32}), threads=128, verify=False).source
    body = src.split("@cuda.jit(fastmath")[-1]
    assert body.count("wgmma_desc16(smem16,") == 2
    assert re.search(r"S\w*_wg = wgmma_f16_n32_z\(smem16, K_s_desc, U0, ", body), body
    assert re.search(r"S\w*_wg = wgmma_f16_n32\(smem16, K_s_desc \+ U16, U0, ", body)
    assert re.search(r"O\w*_wg = wgmma_f16_n32\(smem16, V_s_desc \+ U64, U1, ", body)
    assert not re.search(r"O\w*_wg = wgmma_f16_n32_z\(", body)
    assert not re.search(r"S\w*_wg = \(", body)        # no tuple of zeros handed to the tensor cores


def test_the_simulated_descriptor_is_the_gpus_bit_layout():
    from napkin_cat.lowering.tensorcore import sim_desc16
    desc = int(sim_desc16(np.zeros(8, np.int16), 4160, 128, 1024))
    assert desc == (8320 >> 4) | (8 << 16) | (64 << 32)
    assert wgmma.desc_fields(desc + 16) == (8320 + 256, 128, 1024)


@pytest.mark.parametrize("plant", ["step", "fresh"])
def test_a_planted_wrong_step_or_scale_d_is_caught(warpgroups, monkeypatch, plant):
    """A descriptor advanced by the wrong constant reads the wrong rows of B; scale-d 0 on an
    accumulator that holds the rescaled output drops every earlier chunk: the check catches both."""
    if plant == "step":
        real = wgmma.strides
        monkeypatch.setattr(wgmma, "strides", lambda b, kax: (*real(b, kax)[:3], 2 * real(b, kax)[3]))
    else:
        real_emit = wgmma.emit_wgmma
        from napkin_cat.lowering import emit_mma
        monkeypatch.setattr(emit_mma, "emit_wgmma", lambda *a, **kw: real_emit(*a, **{**kw, "fresh": True}))
    dia = _forward(nc.f16, False).bind({q: 64, x: 64, d: 32})
    kernel = nc.lower(dia, threads=128, verify=False)
    rng = np.random.default_rng(2)
    oracle = dia.unrelabelled()
    ins = [rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in oracle.dom]
    assert kernelcheck.kernel_outcome(oracle, kernel, ins).failure is not None


def test_the_generated_ptx_compiles_for_sm_90a():
    """NVRTC (where installed: the GPU machine, or a CUDA wheel) accepts the wrappers of every width
    the generator may ask for."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    src = "".join(wgmma.cu_source(n) for n in (8, 64, 256))
    try:
        err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"wgmma.cu", 0, [], [])
        (res,) = nvrtc.nvrtcCompileProgram(prog, 2, [b"-arch=compute_90a", b"-rdc=true"])
    except (RuntimeError, OSError) as exc:   # the bindings without the NVRTC library
        pytest.skip(f"NVRTC not loadable: {exc}")
    assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS


def test_warpgroups_under_a_mask_bounded_loop_read_their_fragments_per_chunk(warpgroups):
    """Held in registers across a stream loop whose bounds a mask sets, the warpgroup forward was
    wrong on an H100 past the first chunk (kernels/probes/wgmma_verify.py; the simulator could not
    tell): such fragments are read per chunk; without a mask they stay held."""
    held = "Registers: the tensor-core fragments"
    for causal, expect in ((True, False), (False, True)):
        kernel = nc.lower(_forward(nc.f16, causal).bind({q: 128, x: 96, d: 16}), threads=128, verify=False)
        assert any(n.startswith(held) for n in kernel.notes) is expect, kernel.notes
