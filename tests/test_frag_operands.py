"""A tensor-core update's row operand read from the registers that computed it
(lowering/frag_operands.py).

FlashAttention-2's backward updates ``dV += P^T dO`` and ``dK += dS^T Q`` (the dK, dV kernel) and
``dQ += dS K`` (the dQ kernel) with ``P`` and ``dS`` computed in the same loop body on tensor
cores.  Planned on the same warps along the update's rows, with every warp holding the whole
reduced chunk, the C fragments of ``P`` and ``dS`` are the updates' A fragments: no shared
buffer, no ``ldmatrix`` of them, no block barrier around them.  The dK, dV kernel then computes
the scores transposed (rows: keys), as FlashAttention-2 does.  Checked here: the structure as
planned for a GPU, the kernels against the oracle in the simulator (f16 and bf16, causal, ragged
sizes, several blocks and thread counts, huge logits), the same numbers as the buffered kernels,
and a planted wrong register read that the check catches.
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
import napkin_cat.lowering as lowering  # noqa: E402
from napkin_cat.lowering import planner  # noqa: E402
from napkin_cat.lowering.emit import Emitter  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

L = nc.library
q, x, d, h = nc.axes("q x d h")


def _parts(dtype, causal=False, heads=False):
    from napkin_cat.lowering.torch_op import backward_plan
    fl = L.attention(q=q, x=x, d=d, causal=causal, **({"heads": h} if heads else {}))
    fl = fl.stream(x, "s_x").tile(q, "g_q")
    if heads:
        fl = fl.tile(h, 1)
    return backward_plan(fl).at(dtype).parts[1:]    # after D = rowsum(dO O): (dK, dV), dQ


def _inputs(sizes, causal, scale, seed=0):
    rng = np.random.default_rng(seed)
    fwd = L.attention(q=q, x=x, d=d, causal=causal, logsumexp=True).bind(sizes)
    ins = [scale * rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in fwd.dom]
    O, Lse = nc.evaluate(fwd, *ins)
    dO = rng.standard_normal(O.shape)
    return dict(zip(("Q", "K", "V", "O", "L", "dO", "D"), (*ins, O, Lse, dO, (dO * O).sum(-1))))


def _body(src: str) -> str:
    return src.split("@cuda.jit(fastmath")[-1]


def _shared_line(src: str) -> str:
    return next(ln for ln in src.splitlines() if ln.startswith("Shared memory:"))


def test_backward_parts_for_a_gpu_read_p_and_ds_from_registers(monkeypatch):
    """Planned as for a GPU (nothing compiled) at N = 4096, d = 64, 32 heads: neither kernel has
    a P or dS buffer; the dK, dV kernel's phases all run on 8 x 1 warps with keys as rows, and
    its stream loop has one block barrier (after the chunk's loads) where it had three."""
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    sizes = {q: 4096, x: 4096, d: 64, h: 32}
    bodies = {}
    for frag in (True, False):
        monkeypatch.setattr(planner, "FRAG_OPERANDS", frag)
        for part in _parts(nc.f16, heads=True):
            bodies[frag, part.cod[0].name] = lowering._lower_one(part.bind(sizes)).source
    dkdv, dq = bodies[True, "dK"], bodies[True, "dQ"]
    for src in (dkdv, dq):
        assert "P_s" not in _shared_line(src) and "dS_s" not in _shared_line(src), _shared_line(src)
        assert "ldsm_x4_t(smem16, dS_s" not in src and "smem16[dS_s" not in src
    warps = r"8x1 warps(?: in 2 warpgroup\(s\))?, each (?:warp )?16x64"   # mma.sync or (planner.WGMMA) wgmma
    for what in ("S", "dP"):
        assert re.search(rf"{what} = contract on tensor-core fragments over \(x, q\): {warps}", dkdv)
    for what in ("dV", "dK"):
        assert re.search(rf"{what} \(sum_contract\) on tensor-core fragments over \(x, d\): {warps}", dkdv)
    body = _body(dkdv)
    assert re.search(r"P_r = cuda\.local\.array\(\(2, 16\), float32\)  # P kept for dS, dV's update", body)
    assert re.search(r"dS_r = cuda\.local\.array.*# dS kept for dK's update", body)
    assert "pack_f16(P_r[0, 0], P_r[0, 1])" in body and "pack_f16(dS_r[0, 0], dS_r[0, 1])" in body
    assert "pack_f16(dS_r[0, 0], dS_r[0, 1])" in _body(dq)
    loop = body[body.index("    for q0 in range("):]
    assert loop.count("cuda.syncthreads()") == 2                       # the loads', and the loop end's
    assert body.count("cuda.syncthreads()") == 3          # and once before it: K's, V's fragments (.emit_mma)
    unfused = _body(bodies[False, "dK"])
    assert unfused[unfused.index("    for q0 in range("):].count("cuda.syncthreads()") == 4
    # the dQ kernel's query rows still read L and D once per fragment row
    assert re.search(r"^\s*D_\d+ = smem\[D_s \+ ", _body(dq), re.M)


def _case(dtype, sizes, causal, threads, blocks, scale, slow=False):
    ident = f"{dtype.name}-{'causal' if causal else 'full'}-t{threads}-x{scale:g}"
    return pytest.param(dtype, sizes, causal, threads, blocks, scale, id=ident,
                        marks=[pytest.mark.slow] if slow else [])


CASES = [  # dtype, sizes, causal, threads, blocks, logit scale (the slow tier: 4 warps, more chunks)
    _case(nc.f16, {q: 20, x: 23, d: 16}, False, 32, {"g_x": 16, "s_q": 16, "g_q": 16, "s_x": 16}, 1.0),
    _case(nc.f16, {q: 20, x: 23, d: 16}, True, 32, {"g_x": 16, "s_q": 16, "g_q": 16, "s_x": 16}, 12.0),
    _case(nc.bf16, {q: 37, x: 29, d: 16}, True, 64, {"g_x": 32, "s_q": 16, "g_q": 32, "s_x": 16}, 1.0),
    _case(nc.f16, {q: 70, x: 45, d: 32}, True, 128, {"g_x": 64, "s_q": 32, "g_q": 64, "s_x": 16}, 1.0, slow=True),
    _case(nc.f16, {q: 33, x: 40, d: 16}, False, 64, {"g_x": 32, "s_q": 32, "g_q": 32, "s_x": 32}, 12.0, slow=True),
]


@pytest.mark.parametrize("dtype,sizes,causal,threads,blocks,scale", CASES)
def test_kernels_reading_registers_match_the_oracle(dtype, sizes, causal, threads, blocks, scale):
    """Ragged sizes (the last chunk's entries past the extent are zero in the copy), several
    chunks, causal skipping, 1 to 4 warps, huge logits; and the same numbers as the kernels that
    go through shared buffers (the same fp32 values rounded once to 16 bits, summed in the same
    order)."""
    inputs = _inputs(sizes, causal, scale)
    for part in _parts(dtype, causal):
        bound = part.bind(sizes)
        tiles = {k: v for k, v in blocks.items() if k in part._sched_str()}
        kernel = nc.lower(bound, tiles=tiles, threads=threads, verify=False)
        assert "tensor-core A operand" in kernel.source
        args = [inputs[a.name] for a in part.dom]
        out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, args)
        assert out.failure is None, out.failure
        old = planner.FRAG_OPERANDS
        planner.FRAG_OPERANDS = False
        try:
            buffered = nc.lower(bound, tiles=tiles, threads=threads, verify=False)
        finally:
            planner.FRAG_OPERANDS = old
        assert "tensor-core A operand" not in buffered.source
        ins32 = kernelcheck.as_kernel_inputs(args, bound.dom)
        for a, b in zip(kernelcheck.run_kernel(kernel, ins32), kernelcheck.run_kernel(buffered, ins32)):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * np.abs(b).max())


def test_a_planted_wrong_register_read_is_caught(monkeypatch):
    """The dV update reading dS's registers instead of P's (a wrong name for the A fragments):
    the check against the oracle fails."""
    sizes = {q: 20, x: 23, d: 16}
    part = _parts(nc.f16)[0]
    assert [a.name for a in part.cod] == ["dK", "dV"]
    bound = part.bind(sizes)
    tiles = {"g_x": 16, "s_q": 16}
    real = Emitter.contraction_operands

    def swapped(self, ins, acc=None):
        ops = real(self, ins, acc)
        others = sorted(self.reg_copy.values())
        return [o if o.frag is None or len(others) < 2 else
                type(o)(o.axes, o.read, o.padded, next(n for n in others if n != o.frag), o.buffer) for o in ops]

    monkeypatch.setattr(Emitter, "contraction_operands", swapped)
    kernel = nc.lower(bound, tiles=tiles, threads=32, verify=False)
    inputs = _inputs(sizes, False, 1.0)
    out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
    assert out.failure is not None
