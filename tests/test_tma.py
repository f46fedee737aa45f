"""TMA copies of a stream loop's chunks (``lowering/tma.py``): the swizzled layout as the index
function, the ``wgmma`` descriptor and the simulated tensor copy read it; the forwards that take
them on a GPU (planned as for one, ``_gpu_present`` patched), against the oracle in the simulator;
planted faults (a chunk never waited for, descriptors without their swizzle) caught there; and the
tensor maps the launch passes (``Kernel.tma``)."""
from __future__ import annotations

import copy
import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import lowering as lw  # noqa: E402
from napkin_cat.lowering import producer, tma  # noqa: E402
from napkin_cat.lowering.plan import Buffer  # noqa: E402
from napkin_cat.lowering.wgmma import descriptor, operand_bytes, step_units, strides  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_producer import TOKENS, _check, _forward, _table_attention, _table_inputs, copying  # noqa: E402,F401

L = nc.library
q, x, d, h = nc.axes("q x d h")


def _mutant(kernel, old: str, new: str, count: int):
    out = copy.copy(kernel)
    assert kernel.source.count(old) == count, (old, kernel.source.count(old))
    out.source = kernel.source.replace(old, new)
    out._dispatcher, out._launchers, out._fast = None, {}, None
    return out


# --------------------------------------------------------------------------- the layout

@pytest.mark.parametrize("rows,cols", [(8, 64), (32, 64), (64, 128), (40, 192)])
def test_the_index_function_the_descriptors_and_the_copy_read_one_layout(rows, cols):
    """A matrix stored through ``swizzled_index`` is what a swizzle-mode descriptor names, step by
    step, read K-major (the reduced axis along the rows: ``S = Q K^T``'s K) and MN-major (along the
    columns: ``O += P V``'s V); and what the simulated tensor copy writes, panel by panel."""
    b = Buffer(("var", 1), "K_s", ("x", "d"), (rows, cols), "", bits=16, core=True, swizzle=True)
    M = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols) + 1
    smem = np.zeros(b.elems, dtype=np.int64)
    s, f = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    idx = eval(tma.swizzled_index("s", "f", b, str), {"s": s, "f": f})   # the emitted expression, on arrays
    assert sorted(idx.ravel().tolist()) == sorted(set(idx.ravel().tolist())) and idx.max() < b.elems
    smem[idx] = M
    swz = 1 << 62
    trans, lbo, sbo, _ = strides(b, "d")    # K-major: 16 of d a step, every row
    assert trans == 0
    for ks in range(cols // 16):
        got = smem[operand_bytes(descriptor(16 * step_units(b, "d", ks), lbo, sbo) | swz, rows - rows % 8, 0) // 2]
        np.testing.assert_array_equal(got, M[:rows - rows % 8, 16 * ks:16 * ks + 16].T)
    trans, lbo, sbo, _ = strides(b, "x")    # MN-major: 16 of x a step, every column
    assert trans == 1
    for ks in range(rows // 16):
        got = smem[operand_bytes(descriptor(16 * step_units(b, "x", ks), lbo, sbo) | swz, cols, 1) // 2]
        np.testing.assert_array_equal(got, M[16 * ks:16 * ks + 16, :])


def test_the_simulated_tensor_copy_writes_the_index_functions_layout():
    """``tma_load``'s twin, called outside a kernel (its mbarrier stubbed), lands a box of a
    ragged 3-axis array where :func:`tma.swizzled_index` puts it, zeros past the array's end."""
    rows, cols, n = 16, 128, 21
    arr = np.arange(2 * n * cols, dtype=np.int16).reshape(2, n, cols)
    t = tma.TmaInput(1, arr.shape, (1, rows, 64))
    landed = []

    class Bar:
        def issue(self, land):
            landed.append(land)

    fn = tma.sim_primitive("tma_load3", lambda: None, lambda *a: [Bar()])
    b = Buffer(("var", 1), "K_s", ("x", "d"), (rows, cols), "", bits=16, core=True, swizzle=True)
    smem16 = np.zeros(b.elems, dtype=np.int16)
    for p in range(2):
        fn(smem16, p * rows * 64, arr.reshape(-1), tma.sim_map(t), 64 * p, 16, 1, None, 0)
    assert [land() for land in landed] == [2 * rows * 64] * 2
    s, f = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    want = np.where(16 + s < n, arr[1, np.minimum(16 + s, n - 1), f], 0)
    np.testing.assert_array_equal(smem16[eval(tma.swizzled_index("s", "f", b, str), {"s": s, "f": f})], want)


# --------------------------------------------------------------------------- the kernels

@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype,causal,sizes,scale", [
    pytest.param(nc.f16, False, {q: 128, x: 32 * 5 + 5, d: 64}, 1.0, id="f16-ragged-six-chunks"),
    pytest.param(nc.bf16, True, {q: 128, x: 96, d: 128}, 12.0, id="bf16-causal-two-panels-x12"),
])
def test_the_forward_copied_by_tma_matches_the_oracle(copying, monkeypatch, stages, dtype, causal, sizes, scale):
    """Chunks of K and V by tensor copies over three buffers, or two (64 columns a copy, a ragged
    last chunk zero-filled), read by swizzle-mode descriptors: the oracle's values."""
    monkeypatch.setattr(producer, "STAGES", stages)
    dia = _forward(dtype, causal, sizes)
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)
    assert [(t.index, t.box) for t in kernel.tma] == [(1, (32, 64)), (2, (32, 64))]
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    mine = body[:body.index("setmaxnreg_inc_")]
    panels = sizes[d] // 64
    assert mine.count("tma_load2(") == 2 * stages * panels and "cp_async16(" not in mine   # chunks 0 (, 1), c + S - 1
    assert mine.count("mbar_wait(") == 2 and "fence_proxy_async" not in mine
    assert body.count("| uint64(4611686018427387904)") == 2                          # K's and V's descriptors
    assert "(128-byte swizzled panels, copied by TMA)" in kernel.source
    assert kernel.source.count("K_tmap") >= 2 and re.search(r"def kernel_\w+\(Q, K, V, O, K_tmap, V_tmap\)",
                                                            kernel.source)
    out = _check(dia, kernel, scale)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("stages", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_chunks_a_block_table_skips_are_copied_by_tma(copying, monkeypatch, stages):
    """A document mask with the user's block table over query blocks of 128 by key chunks of 32
    (``producer._staged_copies`` over three buffers, ``_double_copies`` over two): only the chunks
    the table keeps are copied, each waited for at its buffer's mbarrier in the order both sides
    scan the table (tile 0 keeps chunks 1 and 3, its first and last masked; tile 1 every chunk, the
    last ragged), and the results match the oracle.  (The kernel fuzzer's ``copying_tma`` family
    draws random tables too.)"""
    monkeypatch.setattr(producer, "STAGES", stages)
    sizes = {q: TOKENS, x: TOKENS, d: 64}
    dia = _table_attention(nc.f16, 128, 32).stream(x, 32).tile(q, 128).place("O", "registers").bind(sizes)
    named = _table_inputs(dia, np.array([[0, 2, 0, 1, 0], [1, 1, 1, 1, 1]], np.float32))
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)
    assert [(t.index, t.box) for t in kernel.tma] == [(1, (32, 64)), (2, (32, 64))]
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    mine = body[:body.index("setmaxnreg_inc_")]
    assert "_kept" in mine and "cp_async16(" not in mine and "fence_proxy_async" not in mine
    assert ("issued_x" in mine) == (stages == 3)     # three buffers: the staged loop's own count
    assert mine.count("mbar_wait(") == 2             # the chunk before the newest, and the last
    out = kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, [named[a.name] for a in dia.dom])
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("fault", ["no wait in the loop", "descriptors unswizzled"])
def test_planted_faults_are_caught(copying, fault):
    """The chunks after the first handed over without waiting for their copies (the simulated
    copies land only at a wait for their phase), or the descriptors read as core matrices: the
    check against the oracle fails."""
    dia = _forward(nc.f16, False, {q: 128, x: 96, d: 64})
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)
    if fault == "no wait in the loop":
        hit = re.search(r"^( +)mbar_wait\(smem, mbar_s \+ \(\(\(pbuf_x.*$", kernel.source, re.M)
        bad = _mutant(kernel, hit.group(0), hit.group(1) + "pass", 1)
    else:
        bad = _mutant(kernel, " | uint64(4611686018427387904)", "", 2)
    assert _check(dia, bad).failure is not None


def test_where_tma_applies(copying, monkeypatch):
    """Not at d = 16 (a panel is 64 columns), not without a copying warpgroup, not with the switch
    off: those kernels are the ``cp.async`` ones, no map arguments (core matrices, or swizzled
    panels the computing threads fill)."""
    def lowered(width, threads=256):
        return nc.lower(_forward(nc.f16, False, {q: 128, x: 96, d: width}), threads=threads, prefetch="double",
                        verify=False)
    assert lowered(64).tma
    assert not lowered(16).tma and "tma_load" not in lowered(16).source
    alone = lowered(64, threads=128)     # one computing warpgroup: no copying one (producer.MIN_THREADS)
    assert alone.launch.block == (128, 1, 1) and not alone.tma and "K_tmap" not in alone.source
    assert _check(_forward(nc.f16, False, {q: 128, x: 96, d: 64}), alone).failure is None
    monkeypatch.setattr(tma, "TMA", False)
    off = lowered(64)
    assert not off.tma and "(core matrices for wgmma)" in off.source and "mbar_" not in off.source
    monkeypatch.setattr(tma, "TMA", "sometimes")
    with pytest.raises(ValueError, match="tma.TMA must be"):
        lowered(64)


def test_the_gpu_plans_copy_by_tma_with_maps_per_address(monkeypatch):
    """``nc.lower``'s own blocks on a GPU (planned as for an H100): the d = 64 and d = 128
    forwards, causal on four warpgroups too (three buffers, which ``cp.async`` kept at two:
    ``producer.MASKED_GROUPS``); their swizzled buffers on 1024-byte boundaries; the launch's
    simulated maps, made per input from its shape."""
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)
    for width, causal, threads in ((64, False, 512), (64, True, 512), (128, False, 384), (128, True, 384)):
        dia = L.attention(q=q, x=x, d=d, heads=h, causal=causal, dtype=nc.f16).bind({q: 4096, x: 4096, d: width, h: 4})
        kernel = nc.lower(dia, verify=False, prefetch="auto")
        assert kernel.launch.block == (threads + producer.THREADS, 1, 1) and "(3 chunk buffers)" in kernel.source
        assert [(t.shape, t.box) for t in kernel.tma] == [((4, 4096, width), (1, 64, 64))] * 2, (width, causal)
        for name in ("K_s", "V_s"):
            assert int(re.search(rf"^{name} = uint32\((\d+)\)", kernel.source, re.M).group(1)) % 256 == 0
        maps = tma.map_args(kernel, [None] * 4, sim=True)
        assert [m.tolist() for m in maps] == [[3, width, 4096, 4, 1, width, 4096 * width, 64, 64, 1, 1]] * 2   # swizzled


def test_the_probe_still_rewrites_the_cp_async_forward(monkeypatch):
    """``kernels/probes/tma_copies.py`` (the measurement this module was built on) rewrites the
    forward the generator writes with ``TMA = False``: its text patterns are still found, and what
    it writes parses."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "tma_copies", Path(__file__).resolve().parents[1] / "kernels" / "probes" / "tma_copies.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)
    monkeypatch.setattr(tma, "TMA", False)
    dia = L.attention(q=q, x=x, d=d, heads=h, dtype=nc.f16).bind({q: 4096, x: 4096, d: 128, h: 4})
    kernel = nc.lower(dia, verify=False, prefetch="auto")
    src, extra = probe.tma_source(kernel.source, kernel.launch.dynamic_smem_bytes, 1 << 40, 1 << 41)
    compile(src, "<probe>", "exec")
    assert src.count("tma3(") == 3 * 2 * 2 and src.count("| SW128") == 2 and extra == 24
