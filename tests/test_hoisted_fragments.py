"""Row-operand fragments held in registers across a stream loop (:func:`napkin_cat.lowering.emit_mma.hoisted_fragments`).

FlashAttention keeps Q in registers while K and V stream: the generator reads the tensor-core A
fragments of an input that the stream loop never rewrites once, in the loop's preamble, within a
register budget.  Checked here under the simulator against the oracle: the fragments move out of
the loop, the kernel still computes attention (several chunks, a ragged last one, both 16-bit
types), and each limit that should keep them in the loop does.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import emit_mma  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d = nc.axes("q x d")
L = nc.library


def _flash(dtype, nq=32, nx=40, nd=16):
    fl = L.attention(q=q, x=x, d=d, dtype=dtype).stream(x, 16).tile(q, 16).place("O", "registers")
    return fl.bind({q: nq, x: nx, d: nd})


def _loop_and_before(src: str) -> tuple[str, str]:
    body = src.split("@cuda.jit(fastmath")[-1]
    at = re.search(r"^    for x0 in range\(", body, re.M).start()
    return body[:at], body[at:]


@pytest.mark.parametrize("dtype", [nc.f16, nc.bf16])
def test_q_fragments_are_read_once_before_the_stream_and_the_kernel_matches(dtype):
    bound = _flash(dtype)
    kernel = nc.lower(bound, threads=32, verify=False)
    before, loop = _loop_and_before(kernel.source)
    assert any(n.startswith("Registers: the tensor-core fragments of Q_s (4 per thread)") for n in kernel.notes), \
        kernel.notes
    assert re.search(r"^    Q_s_a00_0, Q_s_a00_1, Q_s_a00_2, Q_s_a00_3 = ldsm_x4\(smem16, Q_s_lane", before, re.M)
    assert "ldsm_x4(smem16, Q_s" not in loop                     # no Q fragment read per chunk
    assert "Q_s_a00_0" in loop                                    # the multiplications read the registers
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in bound.dom]
    inputs[0][3] *= 40.0                                          # a row of huge logits
    assert kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, inputs).failure is None


def test_the_fragments_wait_for_their_copy_and_a_barrier():
    """Q is copied by cp.async before the loop: the preamble waits for every copy and then
    synchronises the block before any lane reads another lane's rows of Q."""
    before, _ = _loop_and_before(nc.lower(_flash(nc.f16), threads=32, verify=False).source)
    pre = before[before.index("# fragments that stay in registers"):]
    order = [pre.index("cp_async_wait_all()"), pre.index("cuda.syncthreads()"), pre.index("ldsm_x4(")]
    assert order == sorted(order), pre


@pytest.mark.parametrize("limit", ["budget", "ceiling"])
def test_fragments_that_do_not_fit_stay_in_the_loop(monkeypatch, limit):
    if limit == "budget":
        monkeypatch.setattr(emit_mma, "HOIST_REGISTERS", 3)          # fewer than one fragment's 4
    else:
        monkeypatch.setattr(emit_mma, "HOIST_CEILING", 1)            # below any plan's estimate
    bound = _flash(nc.f16)
    kernel = nc.lower(bound, threads=32, verify=False)
    before, loop = _loop_and_before(kernel.source)
    assert not any(n.startswith("Registers: the tensor-core") for n in kernel.notes)
    assert "ldsm_x4(smem16, Q_s" in loop and "ldsm_x4(" not in before
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in bound.dom]
    assert kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, inputs).failure is None


def test_an_input_the_loop_loads_is_never_hoisted():
    """K and V stream: their fragments (the column operands here) change every chunk; only Q moves."""
    kernel = nc.lower(_flash(nc.f16), threads=32, verify=False)
    _, loop = _loop_and_before(kernel.source)
    assert re.search(r"ldsm_x[24](_t)?\(smem16, K_s", loop) and re.search(r"ldsm_x[24](_t)?\(smem16, V_s", loop)
    notes = [n for n in kernel.notes if n.startswith("Registers: the tensor-core")]
    assert len(notes) == 1 and "Q_s" in notes[0]


@pytest.mark.parametrize("causal", [False, True])
def test_warpgroup_fragments_stay_in_the_loop_of_a_kernel_with_a_mask(monkeypatch, causal):
    """Hoisted ``wgmma`` A fragments were measured wrong on the GPU in every kernel with a mask
    (the simulator cannot tell; :func:`~napkin_cat.lowering.emit_mma.hoisted_fragments`): on an
    H200 grouped-query heads' causal dK, dV kernel, whose query loop no mask bounds (the groups
    stream around it), gave dK 0.57 off at N = 4096.  Planned as for the GPU, the unmasked kernel
    still holds K and V in registers across the query chunks; the causal one reads them per chunk."""
    import torch

    from napkin_cat import lowering as lw
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)
    h, g = nc.axes("h g")
    att = L.attention(q=q, x=x, d=d, heads=h, groups=g, causal=causal)
    op = nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1), verify=False, backward="two kernels")
    sizes = (("d", 64), ("g", 4), ("h", 2), ("q", 4096), ("x", 4096))
    keys = op.backward_plan((0, 1, 2), sizes, torch.float16).parts[1]
    assert keys._sched_str() == "tile(x, g_x), stream(g, 1), stream(q, s_q), tile(h, 1)"
    kernel = nc.lower(keys, tiles=op._tiles(keys), verify=False, prefetch="auto")
    assert "wgmma_f16" in kernel.source
    hoisted = [n for n in kernel.notes if n.startswith("Registers: the tensor-core fragments")]
    assert (hoisted == []) == causal, kernel.notes
