"""Tensor cores: fp16 / bf16 kernels from diagrams, checked through the simulated fragment path.

The simulator links no CUDA C++, so the primitives of :mod:`napkin_cat.lowering.tensorcore` have
simulated twins with the same arguments and results: ``mma`` exchanges the warp's fragments and
multiplies the tiles they hold, ``ldmatrix`` exchanges the lanes' row addresses.  A generated
kernel's fragment indexing is therefore checked here exactly as a GPU would read it; the tests
below show that the twins agree with the PTX ISA's fragment layouts and that a planted indexing
bug in a generated kernel is caught.  The GPU runs the same source (kernels/bench_tc.py).
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402  (the simulator's, swapped in while a kernel runs)

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import io, tensorcore  # noqa: E402
from napkin_cat.ops.arrays import bf16_bits, bf16_values, round_to_dtype  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d, e, h, g = nc.axes("q x d e h g")
a, b, c = nc.axes("a b c")
L = nc.library


def _launch(body, *arrays, threads=32):
    """Run ``body(out, *arrays)`` as a one-block simulated kernel."""
    kernel = cuda.jit(body)
    kernel[1, threads](*arrays)


# --------------------------------------------------------------------------- the primitives

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_simulated_mma_multiplies_the_tiles_the_fragments_hold(dtype):
    """Each lane packs its A and B fragment elements by the PTX layout; the mma's C fragments,
    put back by the same layout, are A @ B + C (float64 of the rounded inputs)."""
    rng = np.random.default_rng(0)
    A = round_to_dtype(rng.standard_normal((16, 16)), dtype)
    B = round_to_dtype(rng.standard_normal((16, 8)), dtype)
    C0 = rng.standard_normal((16, 8)).astype(np.float32)
    lay = tensorcore.fragment_layout()
    prims = tensorcore.primitives()
    pack, mma = prims[tensorcore.DTYPES[dtype].pack], prims[tensorcore.DTYPES[dtype].mma]
    afr, bfr, cfr = tensorcore.lane_fragments(A, B, C0)
    out = np.zeros((32, 4), np.float32)

    def body(out, afr, bfr, cfr):
        lane = cuda.threadIdx.x
        av = [pack(afr[lane, i, 0], afr[lane, i, 1]) for i in range(4)]
        bv = [pack(bfr[lane, i, 0], bfr[lane, i, 1]) for i in range(2)]
        res = mma(*av, *bv, *[cfr[lane, i] for i in range(4)])
        for i in range(4):
            out[lane, i] = res[i]

    _launch(body, out, afr, bfr, cfr)
    D = np.zeros((16, 8))
    for (r, n), (reg, lane) in np.ndenumerate(lay["C"]):
        D[r, n] = out[lane, reg]
    np.testing.assert_allclose(D, A.astype(np.float64) @ B + C0, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("trans", [False, True])
def test_simulated_ldmatrix_reads_rows_by_the_lanes_addresses(trans):
    """x4: lane l gives the address of row l % 8 of matrix l // 8; register m of lane l holds row
    l // 4, columns 2(l % 4), 2(l % 4) + 1 of matrix m (of its transpose with .trans)."""
    M = np.arange(4 * 8 * 11, dtype=np.int16).reshape(4 * 8, 11)   # rows of 11: any stride
    flat = M.reshape(-1).copy()
    out = np.zeros((32, 4), np.uint32)
    prims = tensorcore.primitives()
    ld = prims["ldsm_x4_t" if trans else "ldsm_x4"]

    def body(out, flat):
        lane = cuda.threadIdx.x
        res = ld(flat, lane * 11 + 1)   # matrix lane // 8, row lane % 8, starting at column 1
        for i in range(4):
            out[lane, i] = res[i]

    _launch(body, out, flat)
    for lane in range(32):
        for m in range(4):
            tile = M[8 * m:8 * m + 8, 1:9]
            tile = tile.T if trans else tile
            lo, hi = tile[lane // 4, 2 * (lane % 4)], tile[lane // 4, 2 * (lane % 4) + 1]
            assert out[lane, m] == (int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16), (lane, m)


def test_bf16_rounding_is_nearest_even_and_keeps_specials():
    vals = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, 3e38], np.float32)
    got = bf16_values(bf16_bits(vals))
    assert got.tolist()[:6] == [1.0, 1.0, 1 + 2 ** -6, -2.5, np.inf, -np.inf]
    assert np.isnan(bf16_values(bf16_bits(np.array([np.nan], np.float32))))[0]
    assert np.isfinite(got[6]) or got[6] == np.inf   # 3e38 rounds within range or to inf, never NaN


# --------------------------------------------------------------------------- kernels

def _check(diagram, sizes, threads, examples=1, **opts):
    bound = diagram.bind(sizes)
    kernel = nc.lower(bound, threads=threads, verify=False, **opts)
    assert "mma_" in kernel.source, kernel.notes
    nc.check_equivalent(diagram.unrelabelled().bind(sizes), kernel, examples=examples)
    return kernel


def test_fp16_flash_attention_on_fragments_matches_the_oracle():
    """The FlashAttention-2 path: scores and output on fragments, the probabilities never leave
    the registers (their C fragments are the A fragments of P V), K and Q by cp.async and
    ldmatrix, V by ldmatrix.trans, O stored a column pair per word; ragged keys and queries."""
    flash = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 16).place("O", "registers")
    k = _check(flash, {q: 20, x: 23, d: 16}, threads=32)
    body = k.source.split("@cuda.jit(fastmath")[-1]
    for marker in ("weights stay in registers", "ldsm_x4(", "ldsm_x4_t(", "cp_async16(", "st_pair16(O"):
        assert marker in body, marker
    assert k.diagram.cod[0].dtype is nc.f16


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("variant", ["causal", "alibi_gqa", "dv_lse", "unfused"])
def test_attention_variants_on_tensor_cores(dtype, variant):
    dt = {"f16": nc.f16, "bf16": nc.bf16}[dtype]
    sizes = {q: 19, x: 21, d: 16}
    kw = {"causal": dict(causal=True), "alibi_gqa": dict(bias=nc.alibi(0.5), groups=g, heads=h),
          "dv_lse": dict(dv=e, logsumexp=True, causal=True), "unfused": dict()}[variant]
    if variant == "alibi_gqa":
        sizes.update({g: 2, h: 1})
    if variant == "dv_lse":
        sizes[e] = 32
    att = L.attention(q=q, x=x, d=d, dtype=dt, **kw).stream(x, 16).tile(q, 16)
    if variant != "unfused":
        att = att.place("O", "registers")
    _check(att, sizes, threads=32, prefetch="double" if variant == "causal" else False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_matmul_on_fragments_with_warps_along_both_axes(dtype):
    dt = {"f16": nc.f16, "bf16": nc.bf16}[dtype]
    mm = L.matmul(a=a, b=b, c=c, dtype=dt).stream(b, 16).tile(a, 16).tile(c, 16).place("C", "registers")
    k = _check(mm, {a: 18, b: 35, c: 16}, threads=64, prefetch="double")
    assert "2 warps" in " ".join(k.mappings.values()) or "1x2 warps" in k.source


def test_a_planted_fragment_indexing_bug_is_caught():
    """Swap two registers of an A fragment in a generated kernel: the simulated fragment path
    computes what the GPU would, so the kernel check fails."""
    flash = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 16).place("O", "registers")
    bound = flash.bind({q: 16, x: 16, d: 16})
    kernel = nc.lower(bound, threads=32, verify=False)
    src = kernel.source
    line = re.search(r"^\s*(\w+), (\w+), (\w+), (\w+) = ldsm_x4\(.*$", src, re.M)   # Q's first A fragment
    call = line.group(0)
    r0, r1, r2, r3 = line.groups()
    bad = src.replace(call, call.replace(f"{r0}, {r1}, {r2}, {r3} =", f"{r0}, {r2}, {r1}, {r3} ="), 1)
    assert bad != src
    broken = type(kernel)(kernel.diagram, bad, kernel.name, kernel.launch, kernel.schedule, _Gen(kernel))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((16, 16)) for _ in range(3)]
    assert kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, inputs).failure is None
    assert kernelcheck.kernel_outcome(bound.unrelabelled(), broken, inputs).failure is not None


class _Gen:
    """What Kernel() reads of a generator's result, from an existing kernel."""

    def __init__(self, kernel):
        self._k = kernel
        self.notes = kernel.notes

    def mappings(self):
        return self._k.mappings


# --------------------------------------------------------------------------- choices and refusals

def test_shapes_that_do_not_fit_fragments_run_on_cuda_cores_and_say_why():
    att = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 16).place("O", "registers")
    kernel = nc.lower(att.bind({q: 16, x: 16, d: 12}), threads=32, verify=False)
    assert "mma_" not in kernel.source.split("@cuda.jit(fastmath")[-1]
    assert any("not tensor cores" in n and "d = 12 is not a multiple of 16" in n for n in kernel.notes)
    fp32 = nc.lower(L.attention(q=q, x=x, d=d).stream(x, 16).tile(q, 16).bind({q: 16, x: 16, d: 16}),
                    threads=32, verify=False)
    assert "mma_" not in fp32.source and "tensorcore" not in fp32.source


@pytest.mark.parametrize("tiles,threads,why", [
    ((128, 128), 128, "takes at least 32 16x8 tiles per warp on 4 warps (128 fp32 accumulators per thread), "
                      "more than the 16 a warp holds"),
    ((16, 24), 64, "no split of 2 warps over its extents 16x24 gives whole 16x8 tiles"),
])
def test_scores_too_large_for_a_warps_fragments_say_so(tiles, threads, why):
    """A forced tile whose scores fit no warp's fragments runs on CUDA cores (correct, and far
    slower: 4.86 ms against 0.23 at 128 x 128 on 4 warps on an H200, kernels/BENCHMARKS.md), and the
    note names the cause: the accumulators a warp would hold, or no whole split."""
    rows, cols = tiles
    att = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, cols).tile(q, rows).place("O", "registers")
    kernel = nc.lower(att.bind({q: 2 * rows, x: 2 * cols, d: 16}), threads=threads, verify=False)
    assert any("not tensor cores" in n and why in n for n in kernel.notes), kernel.notes


def test_one_sixteen_bit_dtype_per_kernel():
    from napkin_cat.ops.builder import Builder
    bld = Builder(nc.f16)
    A = bld.input("A", a, b)
    B = bld.input("B", b, c, dtype=nc.bf16)
    with pytest.raises(nc.LoweringError, match="mixes bf16 and f16"):
        nc.lower(bld.diagram(bld.contract(A, B, out=(a, c))).bind({a: 16, b: 16, c: 16}), verify=False)


def test_sixteen_bit_inputs_and_outputs_keep_their_dtype():
    mm = L.matmul(a=a, b=b, c=c, dtype=nc.bf16).stream(b, 16).tile(a, 16).tile(c, 8).place("C", "registers")
    kernel = nc.lower(mm.bind({a: 16, b: 16, c: 8}), threads=32, verify=False)
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    out = kernel(A, B)   # numpy in: bf16 values come back as float32 (numpy has no bfloat16)
    assert out.dtype == np.float32
    exact = round_to_dtype(A, "bf16").astype(np.float64) @ round_to_dtype(B, "bf16")
    np.testing.assert_allclose(out, exact, rtol=2e-2, atol=2e-2)
    assert np.array_equal(round_to_dtype(out, "bf16"), out)   # already bf16 values
    with pytest.raises(nc.ShapeError, match="numpy has no bfloat16"):
        kernel(A, B, out=np.empty((16, 8), np.float32))
    assert io.host_input(np.ones(3), "f16").dtype == np.int16


def cp_async_races(source: str) -> list[str]:
    """The barriers that other threads could pass while this thread's ``cp.async`` copies are
    still in flight: a ``cuda.syncthreads()`` reached after a ``cp_async16`` with no
    ``cp_async_wait_*`` between them, in the text of the kernel (the simulator copies at once,
    so only the text can show it).  Each is ``"line N"``."""
    races, outstanding = [], False
    for n, line in enumerate(source.splitlines(), 1):
        code = line.split("#")[0]
        if "cp_async16(" in code and "import" not in code:
            outstanding = True
        elif "cp_async_wait" in code and "import" not in code:
            outstanding = False
        elif "cuda.syncthreads()" in code and outstanding:
            races.append(f"line {n}")
    return races


@pytest.mark.parametrize("prefetch", [False, "double"])
def test_cp_async_copies_are_waited_for_before_every_barrier(prefetch, monkeypatch):
    """The kernels ``nc.torch_op`` builds for a GPU (fp16 FlashAttention forward with its
    logsumexp, both backward parts): the copies of one step's inputs are in flight together and
    waited for once, before the barrier that publishes them; none is left out."""
    import torch

    import napkin_cat.lowering as lw
    from napkin_cat.lowering.torch_op import torch_op
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)          # plan as for a GPU
    q, x, d, h = nc.axes("q x d h")
    attn = nc.library.attention(q=q, x=x, d=d, heads=h).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    plan = torch_op(attn, backward="two kernels").backward_plan(
        (0, 1, 2), (("d", 64), ("h", 4), ("q", 512), ("x", 512)), torch.float16)
    for dia in (plan.forward, *plan.parts[1:]):     # (parts[0]: D = rowsum(dO O), no stream)
        src = nc.lower(dia, verify=False, prefetch=prefetch).source
        copies = src.count("cp_async16(") + len(re.findall(r"tma_load\d\(smem16", src))   # or TMA's (lowering/tma.py)
        assert copies >= 2 and not cp_async_races(src), (dia.short(), cp_async_races(src))
        if not prefetch:      # Q, dO of a chunk (or K, V): one wait for all of them
            loop = src[src.index("# stream "):]
            first = loop[: loop.index("cuda.syncthreads()")]
            assert first.count("cp_async16(") >= 2 and first.count("cp_async_wait_all()") == 1, dia.short()
    planted = "cp_async16(smem16, 0, X, 0, True)\ncuda.syncthreads()\n"
    assert cp_async_races(planted) == ["line 2"]


# --------------------------------------------------------------------------- code shape

def _body(kernel) -> str:
    return kernel.source.split("@cuda.jit(fastmath")[-1]


def test_fragment_loads_add_a_constant_to_a_lane_address_pinned_once_per_operand():
    """Every ldmatrix address is its operand's lane part (row and column of this lane, the warp's
    offset), pinned once per product by ``pin``, plus a tile part made of constants: the compiler
    forms each address beside its load instead of hoisting every one out of the stream loop into
    a register of its own (kernels/BENCHMARKS.md: 255 registers and spills before, 222 after)."""
    flash = L.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 16).tile(q, 32).place("O", "registers")
    body = _body(nc.lower(flash.bind({q: 64, x: 48, d: 32}), threads=64, verify=False))
    pins = re.findall(r"^\s*(\w+) = pin\(", body, re.M)
    # S = Q K^T reads Q and K from shared memory; O += P V reads V (P stays in registers)
    assert sorted(p.rstrip("0123456789") for p in pins) == ["K_s_lane", "Q_s_lane", "V_s_lane"], pins
    loads = re.findall(r"ldsm_x[24](?:_t)?\(smem16, ([^)]*(?:\([^)]*\))?[^)]*)\)", body)
    assert len(loads) >= 6 and any(" + " not in a for a in loads)
    for address in loads:
        lane, _, tile = address.partition(" + ")
        assert lane in pins, address
        assert not re.search(r"\b(lm\d*|tid|tx|ty)\b", tile), address   # constants only


def test_softmax_folds_a_positive_score_scale_into_its_exponent():
    """``exp(c s - m) = exp2(s (c log2 e) - m log2 e)`` for c > 0: the fused scores stay unscaled
    in registers and each weight costs one multiply-add and one ``ex2``; a negative scale (the
    maximum does not commute with it) is applied as written; a soft-cap's outer factor folds
    too.  All match the oracle on huge logits (|s| ~ 10^3) with ragged chunks."""
    for kw, folded in ((dict(), True), (dict(scale=-0.3), False), (dict(softcap=20.0), True)):
        flash = (L.attention(q=q, x=x, d=d, dtype=nc.f16, **kw).stream(x, 16).tile(q, 16)
                 .place("O", "registers"))
        bound = flash.bind({q: 20, x: 37, d: 16})
        kernel = nc.lower(bound, threads=32, verify=False)
        body = _body(kernel)
        assert ("C_PRESCALE_LOG2E" in body) is folded and "math.exp2(" in body
        if "softcap" not in kw:   # soft-cap: tanh(s / c) * c, the outer c folded, 1/sqrt(d) kept
            assert ("* C_SCALE" in body) is not folded
        rng = np.random.default_rng(1)
        Q, K, V = (rng.standard_normal((n, 16)) for n in (20, 37, 37))
        inputs = [30 * Q, 30 * K, V]
        assert kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, inputs).failure is None
