"""The 16-bit attention forward's default blocks on a GPU with warpgroup MMAs: four computing
warpgroups of 64 rows sharing each chunk at d <= 64 (two of 128 rows until 2026-11-30), three at
d = 128 (unmasked, with key chunks of 128), a copying warpgroup beside them, chunks handed over by
named barriers (``wgmma_plan.warpgroup_forward``, ``forward_chunk``, ``producer.SWITCH = "auto"``),
measured faster than ``mma.sync`` and than the blocks before (kernels/BENCHMARKS.md).  Where the copying warpgroup cannot join,
``nc.lower`` plans the kernel again without it, as before, and says why.

The plans are made as for an H100 (the kernel source only, ``_gpu_present`` patched); the kernel
itself runs in the simulator against the oracle in tests/test_producer.py.
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import lowering as lw  # noqa: E402
from napkin_cat.lowering import planner, producer, wgmma_plan  # noqa: E402
from napkin_cat.lowering.schedule import choose  # noqa: E402
from napkin_cat.lowering.wgmma_plan import warpgroup_forward  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d, h = nc.axes("q x d h")


def _attention(dtype=nc.f16, width=64, causal=False, n=4096, mask=None):
    return nc.library.attention(q=q, x=x, d=d, heads=h, causal=causal, dtype=dtype, mask=mask).bind(
        {q: n, x: n, d: width, h: 4})


@pytest.fixture
def gpu(monkeypatch):
    """Plan as for the GPU (an H100 without one): the schedule's GPU rules, no simulator sizes."""
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)


@pytest.mark.parametrize("dtype,width,causal,expect", [
    (nc.f16, 64, False, 512), (nc.bf16, 32, False, 512),   # four warpgroups of 64 rows: 0.381 against two's 0.407 ms
    (nc.f16, 64, True, 512),               # causal: 0.241 against mma.sync's 0.258 ms (two of 128 rows: 0.261)
    (nc.f16, 128, False, 384),             # three warpgroups of 64 rows: 0.837 against 0.955 ms
    (nc.f16, 128, True, 384),              # ... causal 0.464 against 0.528
    (nc.f16, 96, False, 0),                # not measured
    (nc.f32, 64, False, 0),                # fp32: CUDA cores or 3xTF32
])
def test_the_rule_follows_what_was_measured(dtype, width, causal, expect):
    d0 = _attention(dtype, width, causal).unrelabelled()
    assert warpgroup_forward(d0, False, "auto") == expect
    assert warpgroup_forward(d0, True, "auto") == 0              # the simulator keeps its small blocks
    assert warpgroup_forward(d0, False, True) == 0               # only the default "auto" chooses blocks
    sched = choose(_attention(dtype, width, causal), simulate=False)
    tile = {r.axis: r.size for r in sched.diagram.schedule if r.op == "tile"}
    rows = {512: 256, 384: 192}
    chunk = {r.axis: r.size for r in sched.diagram.schedule if r.op == "stream"}["x"]
    if expect:
        assert (sched.threads, tile["q"]) == (expect, rows[expect])
        wide = wgmma_plan.FORWARD_WIDE_CHUNK      # 64 over three buffers (128 over two: session of 2026-11-30)
        assert chunk == (wide if expect == 384 and not causal else 64)   # wgmma_plan.forward_chunk
    elif dtype != nc.f32:
        assert (sched.threads, tile["q"]) == (128, 128 if width <= 64 else 64)


def test_the_wide_forward_takes_masks_from_the_first_column_only():
    """d = 128: causal (and ALiBi's causal mask) 0.464 / 0.474 ms against 0.528 / 0.535 on
    three warpgroups; a sliding window 0.157 against 0.134, so it keeps the old blocks; a mask of
    unknown support likewise."""
    wide = lambda mask: warpgroup_forward(_attention(width=128, mask=mask).unrelabelled(), False, "auto")
    assert wide(nc.causal()) == 384
    assert wide(nc.window(256, 0)) == 0
    assert wide(nc.predicate(lambda i, j: j != i)) == 0


@pytest.mark.parametrize("name,mask,rows", [
    ("window 256", nc.window(256, 0), 64),          # 320 of 384 columns per row: 0.069 against 0.079 ms
    ("block-diagonal 64", nc.block_diagonal(64), 64),   # 64 of 128: 0.043 against 0.050
    ("NATTEN 7 x 7", nc.mask_mod(lambda b, h, i, j: (abs(i // 64 - j // 64) <= 3) & (abs(i % 64 - j % 64) <= 3)),
     64),                                           # 448 of 512: 0.120 against 0.140
    ("window 4096", nc.window(4096, 0), 128),       # 4160 of 4224: the taller tiles' cost per entry wins
    ("causal", nc.causal(), 256),                   # keeps the first column: no band; four warpgroups
    ("block-causal 256", nc.mask_mod(lambda b, h, i, j: i // 256 >= j // 256), 256),   # 0.236 against 0.253 ms
    ("custom", nc.predicate(lambda i, j: j != i), 128),   # no support
])
def test_a_band_mask_halves_the_row_tiles_of_the_16_bit_forward(name, mask, rows):
    """relabel.skipping.shorter_rows_pay, measured on an H200 (kernels/BENCHMARKS.md, "Session of
    2026-11-28 (H200), second"): at d = 64 on 4 warps, tiles of 64 rows cost 5-8% more per entry
    than 128, so they are taken where a band keeps at most 90% of the taller tiles' entries.  Masks
    that keep the first column take the four warpgroups of 64 rows (256 a block, 512 threads) since
    the session of 2026-11-30."""
    from napkin_cat.relabel.skipping import band_span, shorter_rows_pay
    dia = _attention(mask=mask)
    sched = choose(dia, simulate=False)
    tile = {r.axis: r.size for r in sched.diagram.schedule if r.op == "tile"}
    assert (sched.threads, tile["q"]) == (512 if rows == 256 else 128, rows), name
    assert shorter_rows_pay(dia.unrelabelled(), "q", 128) == (rows == 64)
    assert shorter_rows_pay(dia.unrelabelled(), "x", 128) is False     # no mask has x as its rows
    if rows == 64 and name.startswith("window"):
        assert band_span(dia.unrelabelled(), "q", 64) == 256 + 64


def test_the_rule_needs_the_copying_warpgroup_and_an_online_softmax(monkeypatch):
    d0 = _attention().unrelabelled()
    monkeypatch.setattr(producer, "SWITCH", False)
    assert not warpgroup_forward(d0, False, "auto")
    monkeypatch.setattr(producer, "SWITCH", "auto")
    assert warpgroup_forward(d0, False, "auto")
    s, v = nc.axes("s v")
    mm = nc.library.matmul(q, s, v, dtype=nc.f16).bind({q: 256, s: 64, v: 64})
    assert not warpgroup_forward(mm.unrelabelled(), False, "auto")


def test_the_default_forward_is_four_warpgroups_and_a_copying_one(gpu):
    kernel = lw._lower_one(_attention(), prefetch="auto")
    assert kernel.launch.block == (512 + producer.THREADS, 1, 1)
    assert kernel.launch.grid[0] == 4096 // 256
    assert any("chunks handed over by named barriers" in n for n in kernel.notes), kernel.notes
    assert "wgmma_f16_n64" in kernel.source and "bar_arrive(" in kernel.source
    assert "read once before the stream" in kernel.source   # Q's 16 registers fit the 112 each has


def test_the_wide_forward_is_three_warpgroups_and_a_copying_one(gpu):
    kernel = lw._lower_one(_attention(width=128, causal=True), prefetch="auto")
    assert kernel.launch.block == (384 + producer.THREADS, 1, 1)
    assert kernel.launch.grid[0] == 4 * -(-4096 // 192)          # the last of 22 row tiles ragged
    assert any("chunks handed over by named barriers" in n for n in kernel.notes), kernel.notes
    assert "wgmma_f16_n128" in kernel.source and "bar_arrive(U4 +" in kernel.source   # warpgroup 2's


@pytest.mark.parametrize("chunk,held", [(128, False), (64, True)])
def test_fragments_are_held_only_in_the_registers_the_computing_threads_get(gpu, chunk, held):
    """``emit_mma.hoisted_fragments`` beside a copying warpgroup: the computing threads have what
    ``setmaxnreg`` gives them (160 at d = 128 on three warpgroups), not 255.  With key chunks of 128
    the scores take 64 registers; Q's 32 held besides them spilled (1.104 ms against 0.781 by
    descriptor, an H200), so Q is read by descriptor there and held with chunks of 64."""
    kernel = lw._lower_one(_attention(width=128), prefetch="auto", tiles={"x": chunk})
    assert f"CHUNK_x = uint32({chunk})" in kernel.source
    assert kernel.launch.block == (384 + producer.THREADS, 1, 1)
    assert ("read once before the stream" in kernel.source) == held
    assert "setmaxnreg_inc_160()" in kernel.source


def test_without_the_copying_warpgroup_it_is_planned_again_as_before(gpu):
    """``prefetch=False``: no double buffer for the copying warpgroup to fill.  The kernel is the
    one planned with ``producer.SWITCH = False`` (128 rows, ``mma.sync``), and says why."""
    kernel = lw._lower_one(_attention(), prefetch=False)
    saved = producer.SWITCH
    producer.SWITCH = False
    try:
        before = lw._lower_one(_attention(), prefetch=False)
    finally:
        producer.SWITCH = saved
    assert kernel.launch == before.launch and kernel.launch.block == (128, 1, 1)
    assert kernel.source == before.source and "wgmma" not in kernel.source
    assert any(n.startswith("Copying warpgroup: none (prefetch is False") for n in kernel.notes), kernel.notes


def test_forced_switches_keep_their_meaning(gpu, monkeypatch):
    monkeypatch.setattr(planner, "WGMMA", False)
    kernel = lw._lower_one(_attention(), prefetch="auto")
    assert kernel.launch.block == (128, 1, 1) and "wgmma" not in kernel.source
    monkeypatch.setattr(planner, "WGMMA", True)
    monkeypatch.setattr(producer, "SWITCH", False)
    kernel = lw._lower_one(_attention(), prefetch="auto", threads=256, tiles={"q": 256})
    assert kernel.launch.block == (256, 1, 1) and "wgmma_f16_n64" in kernel.source


@pytest.mark.parametrize("rows,threads,chunk,sizes,seed", [
    pytest.param(256, 256, 64, {q: 256, x: 140, d: 16}, 3, id="two-warpgroups"),
    pytest.param(256, 512, 64, {q: 256, x: 140, d: 16}, 7, id="four-warpgroups", marks=pytest.mark.slow),
    pytest.param(192, 384, 64, {q: 200, x: 140, d: 32}, 5, id="three-warpgroups-ragged-rows"),
    pytest.param(192, 384, 128, {q: 200, x: 300, d: 32}, 11, id="three-warpgroups-chunks-of-128",
                 marks=pytest.mark.slow),
])
def test_the_auto_forward_matches_the_oracle_in_the_simulator(rows, threads, chunk, sizes, seed):
    """What the GPU gets at 4096 rows, at the simulator's size: 512 computing threads of 256 rows
    (d <= 64; 256 before) or 384 of 192 (d = 128, key chunks of 128 unmasked), the copying
    warpgroup by ``"auto"`` (not forced), ragged keys (and rows), causal, huge logits."""
    dia = nc.library.attention(q=q, x=x, d=d, causal=True, dtype=nc.f16).stream(x, chunk).tile(q, rows) \
        .bind(sizes)
    kernel = nc.lower(dia, threads=threads, prefetch="double", verify=False)
    assert kernel.launch.block == (threads + producer.THREADS, 1, 1), kernel.notes
    rng = np.random.default_rng(seed)
    ins = [(10.0 if arr.name == "Q" else 1.0) * rng.standard_normal(tuple(a.size for a in arr.axes))
           for arr in dia.dom]
    out = kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, ins)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_a_block_tables_axes_are_not_a_head_width():
    """A document mask with the user's table of 128 x 128 blocks at N = 16384 (a table of 128 x 128
    entries) and d = 64: the head width is 64, so the forward keeps the d = 64 blocks (taken for
    d = 128, it ran 1.53 ms against 0.47 on an H200); at d = 128 the same table changes nothing."""
    from napkin_cat.lowering.wgmma_plan import computed_axes
    n = 16384
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", n // 128), nc.Axis("cb", n // 128))
    mask = nc.blocked(nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i)), bt, 128, 128)
    for width, expect in ((64, 0), (128, 384)):
        d0 = _attention(width=width, n=n, mask=mask).unrelabelled()
        assert sorted(a.name for a in computed_axes(d0, 256)) == ["d", "h"]
        assert warpgroup_forward(d0, False, "auto") == expect
    sched = choose(_attention(n=n, mask=mask), simulate=False)
    assert sched.threads == 128, sched.how
