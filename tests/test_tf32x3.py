"""fp32 on tensor cores by 3xTF32 (``planner.TF32X3``): the primitives' simulated twins against the
PTX ISA's tf32 fragment layout, and fp32 kernels (forward and both backward parts) against the
float64 oracle through the simulated fragment path.

Each fp32 operand is split as ``x = big + small`` (``big = cvt.rna.tf32(x)``, ``small`` the
rounded rest) and a product taken as ``big big + big small + small big``: the error against
float64 is a few fp32 ulps of the result, far below a plain tf32 product's 2^-11 relative.  The
tests hold the kernels to 1e-5 of the largest |reference|: one tf32 product (the classic mistake
of dropping the small parts) misses it by far, as :func:`test_the_small_parts_matter` shows.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner, tensorcore  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d = nc.axes("q x d")
L = nc.library
TOL = 1e-5


def test_tf32_split_rounds_big_ties_away_from_zero_and_truncates_small():
    r = tensorcore.tf32_round
    assert r(np.float32(1 + 2 ** -10)) == np.float32(1 + 2 ** -10)
    assert r(np.float32(1 + 2 ** -11)) == np.float32(1 + 2 ** -10)      # a tie: away from zero
    assert r(np.float32(-(1 + 2 ** -11))) == np.float32(-(1 + 2 ** -10))
    assert r(np.float32(1 + 2 ** -12)) == np.float32(1.0)
    big, small = tensorcore._sim_pack_tf32x3(np.float32(np.pi), np.float32(-1e-3))
    parts = np.array([big, small], dtype=np.uint64).view(np.float32).reshape(2, 2)
    assert (parts.view(np.uint32) & 0x1FFF == 0).all()                    # both parts are tf32
    np.testing.assert_allclose(parts.sum(0, dtype=np.float64), [np.pi, -1e-3], rtol=2 ** -21)
    x = np.float32(1 + 2 ** -11 + 2 ** -20 + 2 ** -23)    # big rounds up; small's 11th bit is set
    big, small = tensorcore._sim_pack_tf32x3(x, x)
    b, s = (np.array([v], np.uint64).view(np.float32)[0] for v in (big, small))
    assert b == np.float32(1 + 2 ** -10) and s == tensorcore.tf32_trunc(x - b) != tensorcore.tf32_round(x - b)


def test_the_split_keeps_nan_and_inf_as_the_products_need_them():
    """``pack_tf32x3`` splits by bit operations without cvt.rna's NaN / inf guard: a NaN (the GPU's
    canonical 0x7fffffff, whose rounded bits wrap to -0.0) still gives a NaN small part, so every
    product it enters is NaN; an infinity gives itself and a NaN small part, as cvt.rna did."""
    def parts(v):
        big, small = tensorcore._sim_pack_tf32x3(np.float32(v), np.float32(1.5))
        return (np.array([big], np.uint64).view(np.float32)[0], np.array([small], np.uint64).view(np.float32)[0])
    for bits in (0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000):
        big, small = parts(np.uint32(bits).view(np.float32))
        assert np.isnan(small), hex(bits)
    big, small = parts(np.inf)
    assert big == np.inf and np.isnan(small)
    A = np.ones((16, 16), np.float32)
    A[3, 5] = np.uint32(0x7FFFFFFF).view(np.float32)
    D = _mma_through_lanes(A, np.ones((16, 8), np.float32), np.zeros((16, 8), np.float32))
    assert np.isnan(D[3]).all() and not np.isnan(np.delete(D, 3, axis=0)).any()


def test_lane_exchanges_belong_to_their_launch():
    """The twins' lanes publish their registers through an array of their own launch and block,
    found from the calling thread's launch: a thread of an aborted launch that runs on cannot
    write into a later launch's (the simulator's kernel context is one global)."""
    import threading
    from types import SimpleNamespace

    class Launch:
        pass

    got = {}

    def run(key, launch, bx):
        threading.current_thread()._manager = launch
        ctx = SimpleNamespace(blockIdx=SimpleNamespace(x=bx, y=0, z=0))
        got[key] = tensorcore._lane_exchange(ctx, "mma", (32, 32, 6), np.uint32)

    first, later = Launch(), Launch()
    for key, launch, bx in (("a", first, 0), ("a again", first, 0), ("other block", first, 1), ("b", later, 0)):
        t = threading.Thread(target=run, args=(key, launch, bx))
        t.start()
        t.join()
    assert got["a"] is got["a again"]
    assert got["a"] is not got["other block"] and got["a"] is not got["b"]
    assert not got["b"].any()


def _mma_through_lanes(A, B, C0, small: bool = True):
    """``A B + C0`` by the simulated ``mma_tf32x3``, each lane packing the elements the 16-bit
    fragment layout gives it (``small=False``: the small parts zeroed, one tf32 product)."""
    lay = tensorcore.fragment_layout()
    prims = tensorcore.primitives()
    pack, mma = prims["pack_tf32x3"], prims["mma_tf32x3"]
    afr, bfr, cfr = tensorcore.lane_fragments(A, B, C0)
    out = np.zeros((32, 4), np.float32)
    keep = np.uint64(0xFFFFFFFFFFFFFFFF if small else 0)

    def body(out, afr, bfr, cfr):
        lane = cuda.threadIdx.x
        regs = []
        for i in range(4):
            bg, sm = pack(afr[lane, i, 0], afr[lane, i, 1])
            regs += [bg, sm & keep]
        for i in range(2):
            bg, sm = pack(bfr[lane, i, 0], bfr[lane, i, 1])
            regs += [bg, sm & keep]
        res = mma(*regs, *[cfr[lane, i] for i in range(4)])
        for i in range(4):
            out[lane, i] = res[i]

    cuda.jit(body)[1, 32](out, afr, bfr, cfr)
    D = np.zeros((16, 8))
    for (r, n), (reg, lane) in np.ndenumerate(lay["C"]):
        D[r, n] = out[lane, reg]
    return D


def test_simulated_tf32x3_mma_multiplies_the_tiles_the_fragments_hold():
    """The lanes hold the 16-bit engine's elements; the twin assembles each m16n8k8 half's A and
    B by the tf32 layout from those registers (low word k' = t, high word k' = t + 4): a wrong
    pairing of registers and columns would multiply other elements, far off float64."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((16, 16)).astype(np.float32)
    B = rng.standard_normal((16, 8)).astype(np.float32)
    C0 = rng.standard_normal((16, 8)).astype(np.float32)
    want = A.astype(np.float64) @ B + C0
    got = _mma_through_lanes(A, B, C0)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_the_small_parts_matter():
    """One tf32 product (the small parts dropped) misses the tolerance the kernels are held to."""
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 16)).astype(np.float32)
    B = rng.standard_normal((16, 8)).astype(np.float32)
    C0 = np.zeros((16, 8), np.float32)
    want = A.astype(np.float64) @ B
    err = np.abs(_mma_through_lanes(A, B, C0, small=False) - want).max() / np.abs(want).max()
    assert err > 10 * TOL


def _check(diagram, oracle, sizes, threads=32, examples=1, **opts):
    kernel = nc.lower(diagram.bind(sizes), threads=threads, verify=False, fp32="3xtf32", **opts)
    assert "mma_tf32x3(" in kernel.source and "mma_f16" not in kernel.source, kernel.notes
    rng = np.random.default_rng(0)
    bound = oracle.bind(sizes)
    for _ in range(examples):
        inputs = [rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in bound.dom]
        diff = kernelcheck.kernel_outcome(bound, kernel, inputs, rtol=TOL, atol=TOL)
        assert diff.failure is None, kernelcheck.describe_failure(diff.failure)
    return kernel


def test_fp32_flash_attention_on_tf32x3_fragments_matches_the_oracle():
    """The FlashAttention-2 forward in fp32: scores and output on 3xTF32 fragments, the
    probabilities packed from the registers that computed them; ragged keys and queries."""
    flash = L.attention(q=q, x=x, d=d, causal=True).stream(x, 16).tile(q, 16).place("O", "registers")
    k = _check(flash, flash.unrelabelled(), {q: 20, x: 23, d: 16})
    assert "pack_tf32x3(S_" in k.source   # P from the scores' registers
    # the scores sum on the tensor cores; O, a state of the stream, adds each step by an fp32 add
    assert re.search(r"S_regs\[0, 0\].* = mma_tf32x3\(", k.source)
    assert re.search(r"O_o\[0, 0\].* = mma_tf32x3s\(", k.source)
    assert any("3xTF32" in v for v in k.mappings.values()), k.mappings


@pytest.mark.slow
@pytest.mark.parametrize("form, part", [("two kernels", -2), ("two kernels", -1), ("one kernel", -1)],
                         ids=["dK dV", "dQ", "one kernel"])
def test_fp32_backward_parts_on_tf32x3_fragments_match_the_oracle(form, part):
    """The backward kernels of ``nc.torch_op`` in fp32: FlashAttention-2's two (dK, dV on key tiles
    streaming the queries, dQ the other way; P and dS in registers), and the one kernel that adds
    dQ across the key tiles by fp32 atomics (the form the cost model picks for fp32), ragged sizes."""
    import torch

    from napkin_cat.lowering.torch_op import torch_op
    attn = L.attention(q=q, x=x, d=d, causal=True).stream(x, "s_x").tile(q, "g_q")
    sizes = (("d", 16), ("q", 37), ("x", 21))
    rel = torch_op(attn, backward=form).backward_plan((0, 1, 2), sizes, torch.float32).parts[part]
    tiles = {"g_q": 16, "s_x": 16} if form == "two kernels" and part == -1 else {"g_x": 16, "s_q": 16}
    k = _check(rel, rel.unrelabelled(), {}, tiles=tiles)
    adds = "cuda.atomic.add(dQ" in k.source or "red_add2(dQ" in k.source   # paired where d is even
    assert adds is (form == "one kernel")


def test_3xtf32_kernels_import_the_fp32_copies_and_reductions_they_call():
    """A 3xTF32 kernel imports ``tensorcore.FP32_COPIES`` (no 16-bit primitive): each is one of the
    shared primitives, and what the kernel calls of them is imported."""
    assert set(tensorcore.FP32_COPIES) <= set(tensorcore.SHARED_PRIMITIVES)
    assert "cp_async16" not in tensorcore.FP32_COPIES
    flash = L.attention(q=q, x=x, d=d).stream(x, 16).tile(q, 16).place("O", "registers")
    k = nc.lower(flash.bind({q: 32, x: 48, d: 16}), threads=32, verify=False, prefetch="double", fp32="3xtf32")
    imported = re.search(r"from napkin_cat.lowering.tensorcore import ([^#]+)#", k.source).group(1)
    names = {n.strip() for n in imported.split(",")}
    assert set(tensorcore.FP32_COPIES) <= names
    called = set(re.findall(r"\b(cp_async\w*|red_add2)\(", k.source))
    assert called and called <= names


def test_auto_prefetch_double_buffers_3xtf32_kernels_only():
    """``prefetch="auto"``: fp32 on tensor cores stages the next chunk (measured faster on an H100,
    planner.auto_prefetch); fp32 on CUDA cores does not; the result still matches the oracle."""
    flash = L.attention(q=q, x=x, d=d, causal=True).stream(x, 16).tile(q, 16).place("O", "registers")
    sizes = {q: 37, x: 40, d: 16}
    fma = nc.lower(flash.bind(sizes), threads=32, verify=False, prefetch="auto")
    assert "two chunk buffers" not in fma.source
    k = _check(flash, flash.unrelabelled(), sizes, prefetch="auto")
    assert "two chunk buffers" in k.source and "double-buffered" in k.source


def test_tf32x3_chunks_narrow_past_a_head_dimension_of_64():
    """The schedule's 3xTF32 chunks (measured on an H100, kernels/BENCHMARKS.md): 32 at d = 64, 16
    at d = 128 (the one-kernel backward 24.9 -> 20.9 ms, the forward 8.8 -> 8.6 ms); 16-bit kernels
    keep theirs (the unmasked warpgroup forward at d = 128: ``wgmma_plan.forward_chunk``)."""
    from napkin_cat.lowering.planner import tf32x3
    from napkin_cat.lowering.schedule import choose

    def chunk(dim, dtype=nc.f32):
        flash = L.attention(q=q, x=x, d=d, dtype=dtype).stream(x, "s_x").tile(q, "g_q")
        with tf32x3(dtype == nc.f32):
            sched = choose(flash.bind({q: 4096, x: 4096, d: dim}), None, None, simulate=False)
        return next(r.size for r in sched.diagram.schedule if r.op == "stream")
    assert (chunk(64), chunk(128)) == (32, 16)
    from napkin_cat.lowering.wgmma_plan import FORWARD_WIDE_CHUNK
    assert chunk(128, nc.f16) == FORWARD_WIDE_CHUNK and chunk(64, nc.f16) == 64


def test_fp32_kernels_stay_on_cuda_cores_unless_asked():
    flash = L.attention(q=q, x=x, d=d).stream(x, 16).tile(q, 16).place("O", "registers")
    k = nc.lower(flash.bind({q: 16, x: 16, d: 16}), threads=32, verify=False)
    assert "mma_" not in k.source and k.options["fp32"] == "fma"
    assert planner.TF32X3 is False    # the option is set for one lowering only


def test_the_fp32_option_is_checked():
    flash = L.attention(q=q, x=x, d=d).stream(x, 16).tile(q, 16)
    with pytest.raises(nc.LoweringError, match=r"fp32 must be one of \('fma', '3xtf32'\).*got 'tf32'"):
        nc.lower(flash.bind({q: 16, x: 16, d: 16}), fp32="tf32")
    half = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 16)
    with pytest.raises(nc.LoweringError, match=r"fp32='3xtf32' chooses how fp32 kernels multiply.*f16 kernel"):
        nc.lower(half.bind({q: 16, x: 16, d: 16}), fp32="3xtf32")
    with pytest.raises(nc.TypingError, match=r"torch_op: fp32 must be one of"):
        nc.torch_op(flash, fp32=True)


@pytest.mark.slow
def test_torch_op_fp32_on_tf32x3_matches_fp64_autograd():
    """``nc.torch_op(..., fp32="3xtf32")`` on float32 tensors: the forward and both backward kernels
    on 3xTF32 fragments (the simulator), gradients against torch autograd of the float64 oracle."""
    import torch
    flash = L.attention(q=q, x=x, d=d, causal=True).stream(x, "s_x").tile(q, "g_q")
    op = nc.torch_op(flash, threads=32, simulate=True, verify=False, backward="two kernels", fp32="3xtf32",
                     tiles={"s_x": 16, "g_q": 16, "g_x": 16, "s_q": 16})
    sizes = {"q": 37, "x": 21, "d": 16}
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(*(sizes[a.name] for a in arr.axes), generator=g).requires_grad_() for arr in op.diagram.dom]
    out = op(*ts)
    cot = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, ts, cot)
    wide = [t.detach().double().requires_grad_() for t in ts]
    want_out = nc.to_torch(op.diagram)(*wide)
    want = torch.autograd.grad(want_out, wide, cot.double())
    for name, a, b in [("O", out, want_out), *zip(("dQ", "dK", "dV"), got, want)]:
        err = (a.double() - b.detach()).abs().max().item() / b.abs().max().item()
        assert err <= TOL, f"{name}: {err:.2e}"
    kernels = [k for key, k in op._cache.items() if key[0] in ("kernel", "backward kernel")]
    streamed = [k for k in kernels if [a.name for a in k.diagram.cod] != ["D"]]
    assert len(streamed) == 3 and all("mma_tf32x3" in k.source for k in streamed)
