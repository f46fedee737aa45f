"""Whole networks at realistic sizes (issue 12), planned as for a GPU: ``nc.lower`` with the
GPU check patched to True generates every kernel's source (nothing is compiled or run), so
these tests read the plan: the kernels, their grids and shared memory.  The tile shapes those
plans pick are then run at small sizes under the simulator (ragged tiles) against NumPy."""

from __future__ import annotations

import time

import pytest

import napkin_cat as nc
import napkin_cat.lowering as Lw
from napkin_cat.lowering import schedule
from napkin_cat.lowering.multi import MultiKernel
from napkin_cat.relabel.cut import piece

L = nc.library
SMEM_LIMIT = 232448          # an H100's opt-in shared memory per block


@pytest.fixture
def gpu_plan(monkeypatch):
    """Plan for a GPU: block sizes from the cost model, not the simulator's tiny ones."""
    monkeypatch.setattr(Lw, "_gpu_present", lambda runtime: True)


def _kernels(k):
    return k.kernels if isinstance(k, MultiKernel) else (k,)


def _blocks(k) -> int:
    g = k.launch.grid
    return g[0] * g[1] * g[2]


def test_conv2d_56x56_batch8_lowers_within_shared_memory(gpu_plan):
    k = nc.lower(L.conv2d(64, 64, 56, 56, kernel=3, padding=1, batch=nc.Axis("b", 8)), verify=False)
    for kk in _kernels(k):
        assert kk.launch.dynamic_smem_bytes <= SMEM_LIMIT
        assert _blocks(kk) >= 64, (kk.name, kk.launch)


def test_conv_contraction_tiles_rows_and_output_channels(gpu_plan):
    """The implicit GEMM of a 3x3 convolution (rows b*ho*wo, columns o, a chunk of c*kh*kw)
    tiles output pixels *and* output channels, with tiles that fit shared memory."""
    d = L.conv2d(64, 64, 56, 56, kernel=3, padding=1, batch=nc.Axis("b", 8))
    gemm = piece(d, 2, 4).diagram          # after the gather: X[b c ho kh wo kw] . W[o c kh kw]
    assert schedule.analyse(gemm)[3] == ["ho", "wo", "o"]
    k = Lw._lower_one(gemm)
    tiles = {r.axis: r.size for r in k.diagram.schedule if r.op == "tile"}
    assert tiles["o"] >= 16 and tiles["ho"] * tiles["wo"] >= 16, tiles
    assert k.launch.dynamic_smem_bytes <= SMEM_LIMIT // 2
    assert _blocks(k) >= 132


def test_resnet_block_56x56_batch8_lowers(gpu_plan):
    start = time.process_time()        # CPU seconds: the machine may be shared
    k = nc.lower(L.resnet_block(64, 64, 56, 56, batch=nc.Axis("b", 8)), verify=False)
    assert time.process_time() - start < 9, "planning took 3 s when measured"
    assert len(_kernels(k)) > 1
    for kk in _kernels(k):
        assert kk.launch.dynamic_smem_bytes <= SMEM_LIMIT
        assert _blocks(kk) >= 64, (kk.name, kk.launch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_transformer_block_1024_tokens_fused_attention_full_grids(gpu_plan, dtype):
    """One FlashAttention kernel in the cut.  In fp16 the scores alone are a piece that does not
    lower (refused); the search once stopped growing pieces there and wrote S to HBM (16 MB)."""
    start = time.process_time()        # CPU seconds: the machine may be shared
    k = nc.lower(L.transformer_block(1024, 512, 8, 64, 2048, dtype=nc.DTYPES[dtype]), verify=False)
    took = time.process_time() - start
    ks = _kernels(k)
    flash = [kk for kk in ks if any(acc.rule == "online_softmax" for acc in kk.diagram.loop_nest().accumulators)]
    assert len(flash) == 1, [kk.diagram.short() for kk in ks]
    assert not any(e.box.kind == "softmax" for kk in ks if kk not in flash for e in kk.diagram.eqns)
    scores = [a for kk in ks for a in kk.diagram.dom if a.has("x") and a.has("t")]
    assert not scores, scores            # the scores never reach HBM
    for kk in ks:
        assert _blocks(kk) >= (100 if dtype == "f32" else 64), (kk.name, kk.launch)   # an H100 has 132 SMs
    assert took < 35, f"planning took {took:.0f} s, 13 s when measured (47 s before the search kept only sizes)"


def test_conv_tiles_of_the_plan_run_ragged_in_the_simulator():
    """The GPU plan's shape of blocks (a few output rows and columns, a tile of output channels,
    a chunk of input channels), ragged at every edge, against NumPy."""
    d = L.conv2d(3, 6, 6, 5, kernel=3, padding=1, batch=nc.Axis("b", 1))
    k = nc.lower(piece(d, 2, 4).diagram, tiles={"ho": 4, "wo": 2, "o": 4, "c": 2}, verify=1)
    assert k.verified
    tiles = {r.axis: r.size for r in k.diagram.schedule if r.op == "tile"}
    assert tiles == {"ho": 4, "wo": 2, "o": 4, "b": 1}


@pytest.mark.parametrize("how", [dict(stride=1, padding=1), dict(stride=2, padding=2, dilation=2),
                                 dict(stride=3, padding=0), dict(transposed=True, stride=2, padding=1)],
                         ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()))
def test_gather_bytes_counts_valid_windows_as_numpy(how):
    """The per-axis count of valid windows (no NumPy run at realistic sizes) is the NumPy count."""
    import numpy as np
    from napkin_cat.lowering.gather import _valid_unfolds, is_gather
    from napkin_cat.verify.executor import evaluate
    d = L.conv2d(2, 2, 7, 6, kernel=3, **how)
    n = next(j for j in range(len(d.eqns), 0, -1) if is_gather(piece(d, 0, j).diagram))
    g = piece(d, 0, n).diagram
    x = np.ones(tuple(a.size for a in g.dom[0].axes))
    assert _valid_unfolds(g) == np.count_nonzero(evaluate(g, x))


def test_fused_conv_tiles_of_output_channels_run_ragged_in_the_simulator():
    """One fused kernel (the input whole per channel chunk, windows read through the index
    maps) with output rows, columns and channels tiled raggedly, as planned at 56 x 56."""
    d = L.conv2d(2, 3, 5, 6, kernel=3, padding=1, batch=nc.Axis("b", 1))
    k = nc.lower(d, tiles={"ho": 4, "wo": 4, "o": 2, "c": 1}, verify=1)
    assert not isinstance(k, MultiKernel) and k.verified
