"""Lowering to numba.cuda (napkin_cat.lower): generated kernels against the NumPy semantics.

Every diagram runs under numba's CUDA simulator on tiny, ragged shapes (tiles and chunks that
do not divide the axes), blocks of 16 threads.  The simulator is chosen when numba.cuda is
first imported in the process, so it is requested here before anything imports numba (as in
tests/test_cuda_runtime.py); ``NUMBA_ENABLE_CUDASIM=0 pytest tests/test_lower.py`` runs the
same checks on a GPU, the ``gpu``-marked ones (larger shapes, torch tensors) included.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import inspect  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.relabel.accumulators import ACC_RULES  # noqa: E402
from napkin_cat.core.errors import LoweringError  # noqa: E402
from napkin_cat.lowering import (codegen, emit, emit_acc, emit_kinds, emit_threads, plan as kplan,  # noqa: E402
                                 planner, runtime as rt, schedule)
from napkin_cat.ops.kinds import SPECS  # noqa: E402
from napkin_cat.ops.semantics import NUMPY_RULES  # noqa: E402

a, b, c, n = nc.axes("a b c n")
q, x, d, h, g, bb = nc.axes("q x d h g bb")
t, i, o, r, cc, f = nc.axes("t i o r cc f")
L = nc.library
SZ = {q: 5, x: 7, d: 4}
ATT = {"q": 4, "x": 3}

CASES = {
    "matmul": (lambda: L.matmul(a=a, b=b, c=c).bind({a: 5, b: 7, c: 6}), {"a": 4, "c": 4, "b": 3}),
    "batched_matmul": (lambda: L.batched_matmul(batch=n, a=a, b=b, c=c).bind({n: 2, a: 5, b: 7, c: 6}),
                       {"a": 4, "c": 4, "b": 3}),
    "linear_bias_gelu": (lambda: L.linear(t=t, i=i, o=o).bind({t: 5, i: 7, o: 6}), {"t": 4, "o": 4, "i": 3}),
    "linear_relu_no_bias": (lambda: L.linear(t=t, i=i, o=o, bias=False, activation="relu")
                            .bind({t: 5, i: 7, o: 6}), {"t": 4, "o": 4, "i": 3}),
    "attention": (lambda: L.attention(q=q, x=x, d=d).bind(SZ), ATT),
    "attention_causal": (lambda: L.attention(q=q, x=x, d=d, causal=True).bind(SZ), ATT),
    "attention_sliding_window": (lambda: L.attention(q=q, x=x, d=d, window_size=2).bind(SZ), ATT),
    "attention_gqa": (lambda: L.attention(q=q, x=x, d=d, groups=g, heads=h, causal=True)
                      .bind({**SZ, g: 2, h: 2}), ATT),
    "attention_bias_input": (lambda: L.attention(q=q, x=x, d=d, bias="input").bind(SZ), ATT),
    "attention_alibi": (lambda: L.attention(q=q, x=x, d=d, bias=nc.alibi(0.5), causal=True).bind(SZ), ATT),
    "attention_heads_batch": (lambda: L.attention(q=q, x=x, d=d, heads=h, batch=bb).bind({**SZ, h: 2, bb: 2}),
                              ATT),
    "l2_attention": (lambda: L.normalized_attention(q=q, x=x, d=d).bind(SZ), ATT),
    "softmax": (lambda: L.softmax(r=r, c=cc).bind({r: 5, cc: 7}), {"r": 2}),
    "layernorm": (lambda: L.layernorm(t=t, d=d).bind({t: 5, d: 7}), {"t": 2}),
    "rmsnorm": (lambda: L.rmsnorm(t=t, d=d).bind({t: 5, d: 7}), {"t": 2}),
    # diagrams nobody wrote a kernel for
    "mlp_fused_over_hidden": (lambda: L.mlp(t=t, d=d, h=f).bind({t: 5, d: 4, f: 7}), {"t": 4, "f": 3}),
    "attention_not_streamed": (lambda: L.attention(q=q, x=x, d=d).tile(q, 4).bind(SZ), None),
    # relabelled by hand with symbolic blocks, accumulator state in shared memory
    "flash_symbolic_blocks": (lambda: L.attention(q=q, x=x, d=d, causal=True).stream(x, "s_x")
                              .tile(q, "g_q").bind({q: 9, x: 12, d: 4, "g_q": 4, "s_x": 3}), None),
}


@pytest.fixture
def cuda_mode():
    if rt.simulator_active():
        return "simulator"
    if rt.gpu_available():
        return "gpu"
    pytest.skip("numba.cuda was first imported without NUMBA_ENABLE_CUDASIM=1 in this process "
                "and no GPU is visible")


def _inputs(dia, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(ax.size for ax in arr.axes)).astype(np.float32) for arr in dia.dom]


def _rel_err(out, ref) -> float:
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def _check(dia, tiles, threads=16, seed=0, **kw):
    kernel = nc.lower(dia, tiles=tiles, threads=threads, **kw)
    args = _inputs(dia, seed)
    out = kernel(*args)
    ref = nc.evaluate(dia.unrelabelled(), *args)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert not np.isnan(out).any()
    err = _rel_err(out, ref)
    assert err < 1e-4, f"rel. error {err:.2e}\n{kernel.source}"
    return kernel


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)   # the two largest: the slow tier
                                  if n in ("attention_heads_batch", "attention_gqa") else n for n in sorted(CASES)])
def test_lowered_kernel_matches_numpy_on_ragged_shapes(name, cuda_mode):
    build, tiles = CASES[name]
    _check(build(), tiles)


# normalising accumulators fed by a contraction whose rows fit one warp group: scores stay in
# registers (row statistics by lane reductions, weights through a warp-private staging area)
FUSED = {
    "attention": lambda: L.attention(q=q, x=x, d=d).bind(SZ),
    "causal": lambda: L.attention(q=q, x=x, d=d, causal=True).bind(SZ),
    "sliding_window": lambda: L.attention(q=q, x=x, d=d, window_size=2).bind(SZ),
    "gqa": lambda: L.attention(q=q, x=x, d=d, groups=g, heads=h, causal=True).bind({**SZ, g: 2, h: 2}),
    "alibi": lambda: L.attention(q=q, x=x, d=d, bias=nc.alibi(0.5), causal=True).bind(SZ),
    "bias_input": lambda: L.attention(q=q, x=x, d=d, bias="input").bind(SZ),
    "l2": lambda: L.normalized_attention(q=q, x=x, d=d).bind(SZ),
}


@pytest.mark.parametrize("prefetch", [False, "double"])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_scores_stay_in_registers_when_a_row_lives_in_one_warp(name, prefetch, cuda_mode):
    kernel = _check(FUSED[name](), {"q": 4, "x": 4}, prefetch=prefetch)   # ragged: 5 = 4 + 1, 7 = 4 + 3
    src = kernel.source
    assert "warp-private" in src and "cuda.syncwarp(FULL_MASK)" in src
    assert "_group_max(" in src or name == "l2"
    assert kernel.mappings["S"].split(" on ")[1] == kernel.mappings["O"].split(" on ")[1]


@pytest.mark.slow
def test_scores_in_registers_with_interleaved_micro_tile_rows(cuda_mode):
    # 8 x 8 micro-tiles: rows in groups of 4 spread over the tile, 2 lanes per row, three chunks
    kernel = _check(L.attention(q=q, x=x, d=d, causal=True).bind({q: 70, x: 37, d: 16}), {"q": 64, "x": 16},
                    prefetch="double")
    assert kernel.mappings["S"].startswith("register micro-tiles 8x8")


def test_double_buffered_stream_loop_has_one_barrier_per_chunk(cuda_mode):
    kernel = _check(L.matmul(a=a, b=b, c=c).bind({a: 5, b: 7, c: 6}), {"a": 4, "c": 4, "b": 3},
                    prefetch="double")
    loop = kernel.source.split("for b0 in range(")[1]
    assert loop.count("cuda.syncthreads()") == 1 and "two chunk buffers" in kernel.source


def test_causal_tiles_with_the_most_chunks_launch_first():
    kernel = nc.lower(L.attention(q=q, x=x, d=d, heads=h, batch=bb, causal=True).bind({**SZ, h: 3, bb: 2}),
                      tiles=ATT, threads=16)
    assert kernel.launch.grid == (12, 1, 1)            # one grid dimension, query tiles slowest
    assert "q0 = (U1 - " in kernel.source               # ... and in reverse


def test_default_schedules_lower_and_match(cuda_mode):
    for dia in (L.attention(q=q, x=x, d=d, causal=True).bind(SZ), L.layernorm(t=t, d=d).bind({t: 5, d: 7}),
                L.matmul(a=a, b=b, c=c).bind({a: 5, b: 7, c: 6})):
        kernel = _check(dia, None)
        assert kernel.schedule.how.startswith(("heuristic", "cost model"))   # the simulator: heuristic


def test_kernel_writes_into_out_and_accepts_cpu_torch(cuda_mode):
    torch = pytest.importorskip("torch")
    dia = L.attention(q=q, x=x, d=d).bind(SZ)
    kernel = nc.lower(dia, tiles=ATT, threads=16)
    args = _inputs(dia, 1)
    out = np.full((5, 4), np.nan, np.float32)
    assert kernel(*args, out=out) is out
    np.testing.assert_allclose(out, nc.evaluate(dia, *args), rtol=1e-4, atol=1e-5)
    res = kernel(*(torch.from_numpy(z) for z in args))
    np.testing.assert_allclose(np.asarray(res), out, rtol=1e-6)


def test_source_is_readable_and_names_the_plan():
    kernel = nc.lower(L.attention(q=q, x=x, d=d, causal=True).bind(SZ), tiles=ATT, threads=16)
    src = kernel.source
    compile(src, "<kernel>", "exec")
    assert "@cuda.jit" in src and "cuda.syncthreads()" in src
    assert "for x0 in range(" in src            # the streamed axis is a loop
    assert "blockIdx.x" in src                   # the tiled axis is the grid
    assert "cuda.local.array" in src             # register micro-tiles / accumulator states
    assert "shfl_xor_sync" in src                # warp shuffles on a GPU, a tree in the simulator
    assert "x_end = min(" in src                 # chunks above the diagonal are skipped
    assert kernel.launch.grid == (2, 1, 1) and kernel.launch.block == (16, 1, 1)


@pytest.mark.slow
def test_batch_and_head_axes_become_grid_dimensions():
    kernel = nc.lower(L.attention(q=q, x=x, d=d, heads=h, batch=bb).bind({**SZ, h: 3, bb: 2}),
                      tiles=ATT, threads=16)
    assert kernel.launch.grid == (2, 6, 1)
    assert set(kernel.schedule.batch_axes) == {"h", "bb"}
    assert "by = uint32(cuda.blockIdx.y)" in kernel.source


def test_codegen_rules_cover_every_box_kind_and_accumulator():
    assert set(codegen.CODEGEN_RULES) == set(NUMPY_RULES) == set(SPECS)
    assert set(codegen.ACC_CODEGEN) == set(ACC_RULES)
    assert set(emit_threads.CONTRACTION_ENGINES) == set(kplan.ENGINES)


def test_codegen_is_keyed_on_box_kinds_not_algorithm_names():
    # the generator, the planner and the schedule; examples may name diagrams
    from napkin_cat.lowering import emit_loads, emit_mma, io, tensorcore, threads
    for mod in (codegen, kplan, planner, emit, emit_kinds, emit_acc, emit_threads, schedule, emit_loads, emit_mma,
                io, tensorcore, threads):
        text = inspect.getsource(mod).lower()
        for word in ("attention", "matmul", "layernorm", "rmsnorm", "flash"):
            assert not re.search(rf"\b{word}\b", text), f"{mod.__name__} mentions {word}"


def test_kernel_plan_is_frozen_and_names_its_engines():
    import dataclasses
    dia = L.attention(q=q, x=x, d=d, causal=True).stream(x, 3).tile(q, 4).bind(SZ)
    p = planner.plan_kernel(dia, "k", 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.threads = 32
    with pytest.raises(TypeError):
        p.buffers[("extra",)] = None            # read-only views
    assert {a.engine for a in p.accs} == {"cuda_core"}
    assert p.skips["x"] and p.launch.heavy_last == {"q"}
    source = emit.render(p)[0]
    assert source == emit.render(p)[0]           # rendering leaves the plan as it was


def test_unbound_axes_are_refused_by_name():
    with pytest.raises(LoweringError, match=r"axes q, x have no size"):
        nc.lower(L.attention(q=q, x=x, d=d).bind({d: 4}))


def test_what_cannot_lower_says_why():
    custom = L.attention(q=q, x=x, d=d, mask=nc.predicate(lambda i, j: j != i)).bind(SZ)
    with pytest.raises(LoweringError, match="custom predicate"):
        nc.lower(custom, tiles=ATT, threads=16)
    builder = nc.Builder()
    X = builder.input("X", q, d)
    W = builder.param("W", d, x)
    with pytest.raises(LoweringError, match="parameter 'W'"):
        nc.lower(builder.diagram(builder.contract(X, W, out=(q, x))).bind(SZ), threads=16)
    with pytest.raises(LoweringError, match="unknown lowering target"):
        nc.lower(L.matmul(a=a, b=b, c=c).bind({a: 2, b: 2, c: 2}), target="triton")
    with pytest.raises(LoweringError, match="fp8_e4m3"):
        nc.lower(L.matmul(a=a, b=b, c=c, dtype=nc.fp8_e4m3).bind({a: 2, b: 2, c: 2}))


def test_oversized_tiles_are_refused_with_the_shared_memory_bill():
    dia = L.attention(q=q, x=x, d=d).bind({q: 4096, x: 4096, d: 256})
    with pytest.raises(LoweringError, match="bytes of shared memory"):
        nc.lower(dia, tiles={"q": 256, "x": 128}, threads=256)


def test_cost_model_picks_gpu_tiles_that_the_thread_mapping_covers():
    dia = L.attention(q=q, x=x, d=d).bind({q: 8192, x: 8192, d: 64})
    sched = schedule.choose(dia, simulate=False)
    tiles = {r.axis: r.size for r in sched.diagram.schedule if r.op in ("tile", "stream")}
    assert sched.threads == 256 and tiles["x"] == 64
    assert tiles["q"] & (tiles["q"] - 1) == 0 and 16 <= tiles["q"] <= 128
    assert "cost model" in sched.how


# ---- real GPU ------------------------------------------------------------------------------

@pytest.fixture
def gpu():
    if not rt.gpu_available():
        pytest.skip("needs a real CUDA GPU with the simulator off (NUMBA_ENABLE_CUDASIM=0)")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_attention_on_torch_tensors_zero_copy(gpu, causal):
    torch = pytest.importorskip("torch")
    B, H, N, D = 2, 3, 300, 64
    dia = L.attention(q=q, x=x, d=d, heads=h, batch=bb, causal=causal).bind({q: N, x: N + 50, d: D, h: H, bb: B})
    kernel = nc.lower(dia, tiles={"q": 64, "x": 64})
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q = torch.randn(B, H, N, D, device="cuda", generator=gen)
    K = torch.randn(B, H, N + 50, D, device="cuda", generator=gen)
    V = torch.randn(B, H, N + 50, D, device="cuda", generator=gen)
    O = kernel(Q, K, V)
    assert O.is_cuda and O.shape == (B, H, N, D)
    ref = nc.evaluate(dia.unrelabelled(), *(z.double().cpu().numpy() for z in (Q, K, V)))
    assert _rel_err(O.cpu().numpy(), ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["matmul", "linear_bias_gelu", "layernorm", "softmax", "l2_attention",
                                  "attention_gqa", "flash_symbolic_blocks"])
def test_gpu_kernels_match_numpy_at_moderate_sizes(gpu, name):
    sizes = {"matmul": {a: 300, b: 200, c: 260}, "linear_bias_gelu": {t: 300, i: 200, o: 260},
             "layernorm": {t: 33, d: 1000}, "softmax": {r: 33, cc: 1000},
             "l2_attention": {q: 200, x: 333, d: 64}, "attention_gqa": {q: 200, x: 333, d: 64, g: 2, h: 2},
             "flash_symbolic_blocks": {q: 200, x: 333, d: 64, "g_q": 64, "s_x": 64}}[name]
    dia = CASES[name][0]().unrelabelled() if name != "flash_symbolic_blocks" else \
        L.attention(q=q, x=x, d=d, causal=True).stream(x, "s_x").tile(q, "g_q")
    dia = dia.bind(sizes)
    kernel = nc.lower(dia)
    args = _inputs(dia, 3)
    err = _rel_err(kernel(*args), nc.evaluate(dia.unrelabelled(), *args))
    assert err < 1e-4
