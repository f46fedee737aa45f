"""A copying warpgroup beside the warpgroups that multiply (lowering/producer.py): the stream loop's
cp.async copies issued by threads NTHREADS .. NTHREADS + 127, the computing threads left with the
tensor cores.

Checked in the simulator (whose tensor-core twins synchronise within a warp and whose shared
memory reductions meet at a barrier of the computing threads only, so the two sides run the
protocol as on the GPU): the forward (f16 / bf16, causal, ragged, huge logits) and the dQ kernel
against the oracle; the copying side passes exactly the block barriers the computing side does;
kernels it does not fit are emitted as before, with the reason in their notes; a planted wrong
schedule (each chunk's copy one chunk late) is caught.
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import copy  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner, producer, tma  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from test_frag_operands import _inputs  # noqa: E402
from test_wgmma import _parts  # noqa: E402

L = nc.library
q, x, d = nc.axes("q x d")


@pytest.fixture
def copying(monkeypatch):
    monkeypatch.setattr(planner, "WGMMA", True)
    monkeypatch.setattr(producer, "SWITCH", True)


def _forward(dtype, causal, sizes, rows=128):
    return L.attention(q=q, x=x, d=d, causal=causal, dtype=dtype).stream(x, 32).tile(q, rows) \
        .place("O", "registers").bind(sizes)


def _check(dia, kernel, scale=1.0, seed=1):
    rng = np.random.default_rng(seed)
    ins = [(scale if arr.name == "Q" else 1.0) * rng.standard_normal(tuple(a.size for a in arr.axes))
           for arr in dia.dom]
    return kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, ins)


def _body(kernel) -> list[str]:
    return kernel.source.split("@cuda.jit(fastmath")[-1].splitlines()


def _computing_loop(kernel, head: str) -> tuple[int, list[str]]:
    """Where the computing threads' code starts in :func:`_body` (their ``setmaxnreg_inc``), and
    the lines of their stream loop, the one opened by ``head``."""
    body = _body(kernel)
    split = next(i for i, ln in enumerate(body) if ln.startswith("    setmaxnreg_inc_"))
    loop = next(i for i in range(split, len(body)) if body[i].startswith(head))
    end = next(i for i in range(loop + 1, len(body)) if body[i].strip() and not body[i].startswith(" " * 8))
    return split, body[loop:end]


@pytest.mark.parametrize("stages", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype,causal,sizes,scale", [
    pytest.param(nc.f16, False, {q: 140, x: 77, d: 16}, 1.0, id="f16-ragged"),
    pytest.param(nc.bf16, True, {q: 128, x: 96, d: 32}, 12.0, id="bf16-causal-x12"),
    pytest.param(nc.f16, False, {q: 128, x: 32 * 7 + 5, d: 16}, 1.0, id="f16-eight-chunks"),
    pytest.param(nc.f16, True, {q: 40, x: 33, d: 16}, 1.0, id="f16-causal-second-chunk-ragged"),   # the fuzzer's find
])
def test_the_forward_with_a_copying_warpgroup_matches_the_oracle(copying, monkeypatch, stages, dtype, causal, sizes,
                                                                 scale):
    """Over two buffers (chunk c + 1 waited for before chunk c + 2 is issued) and three (two chunks
    in flight; :data:`.producer.STAGES`), with fewer chunks than buffers and several rounds of them."""
    monkeypatch.setattr(producer, "STAGES", stages)
    dia = _forward(dtype, causal, sizes)
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)
    assert kernel.launch.block == (256 + producer.THREADS, 1, 1)
    assert any(n.startswith("Copying warpgroup: threads 256..383") for n in kernel.notes), kernel.notes
    assert f"({stages} chunk buffers)" in kernel.source or stages == 2
    body = _body(kernel)
    mine = body[:next(i for i, ln in enumerate(body) if ln.startswith("    setmaxnreg_inc_"))]
    theirs = body[len(mine):]
    assert sum("cp_async16(" in ln for ln in mine) == 2 * stages   # K and V: chunk 0 (and 1), then in the loop
    assert not any("cp_async16(smem16, K_s" in ln or "cp_async16(smem16, V_s" in ln for ln in theirs)
    assert f"setmaxnreg_dec_{producer.REGS}()" in "\n".join(mine)
    out = _check(dia, kernel, scale)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.slow   # 4 minutes in the simulator (640 threads a block)
@pytest.mark.parametrize("causal", [False, True])
def test_four_warpgroups_over_three_buffers_reuse_their_landed_slots(copying, monkeypatch, causal):
    """Four computing warpgroups (64 rows each) over three buffers: the landed barriers by chunk
    parity (producer.landed_slots), six chunks so that each slot serves three of them; a slot
    arrived at again before its warpgroup waited would be a protocol error the simulator raises.
    Under a mask four warpgroups keep two buffers (producer.MASKED_GROUPS, measured), unless the
    limit is raised."""
    dia = _forward(nc.f16, causal, {q: 256, x: 32 * 5 + 5, d: 16}, rows=256)
    if causal:
        two = nc.lower(dia, threads=512, prefetch="double", verify=False)
        assert "(two chunk buffers)" in two.source and "land_x" not in two.source
        monkeypatch.setattr(producer, "MASKED_GROUPS", 4)
    kernel = nc.lower(dia, threads=512, prefetch="double", verify=False)
    assert "(3 chunk buffers)" in kernel.source and "land_x = U1 - land_x" in kernel.source
    out = _check(dia, kernel, 4.0)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("hand_over", ["named", "block"])
def test_both_sides_pass_the_same_block_barriers(copying, monkeypatch, hand_over):
    """Counted in the text over two buffers; over three, the copying warpgroup's barrier for chunk 0
    is written twice (in its loop, after the first chunk after it is issued, and after the loop where
    there is no other) and passed once, which the simulator runs check."""
    monkeypatch.setattr(producer, "HAND_OVER", hand_over)
    monkeypatch.setattr(producer, "STAGES", 2)
    kernel = nc.lower(_forward(nc.f16, False, {q: 128, x: 64, d: 16}), threads=256, prefetch="double",
                      verify=False)
    assert any(f"handed over by {hand_over} barriers" in n for n in kernel.notes), kernel.notes
    body = _body(kernel)
    split = next(i for i, ln in enumerate(body) if ln.startswith("    setmaxnreg_inc_"))
    pre, per, post = producer._barrier_counts(body[split:], hand_over == "named")
    mine = [ln for ln in body[:split] if ln.strip().startswith("cuda.syncthreads()")]
    loop = next(i for i, ln in enumerate(body[:split]) if ln.startswith("        for "))
    in_loop = [ln for ln in body[loop:split] if ln.startswith("            cuda.syncthreads()")]
    assert (len(mine) - len(in_loop), len(in_loop)) == (pre + post, per)
    assert per == (0 if hand_over == "named" else 1)


def _named_barriers(lines) -> dict:
    """``{(id expression, count): [sync or arrive, ...]}`` of the named barriers in ``lines``."""
    found = {}
    for ln in lines:
        m = re.search(r"(bar_named|bar_arrive)\((.+), (U\d+)\)", ln)
        if m and m.group(2) != "uint32(1)":
            found.setdefault((m.group(2), m.group(3)), []).append(m.group(1))
    return found


def test_the_named_hand_over_pairs_every_wait_with_arrivals(copying, monkeypatch):
    """Each computing warpgroup waits for its own chunk where the copying warpgroup arrives (one
    arrival per warpgroup, 128 + 128 threads), and the copying warpgroup waits for a buffer where
    every computing warpgroup arrives (256 + 128 threads); nothing else meets at a block barrier in
    the loop.  Two buffers (three: the next test)."""
    monkeypatch.setattr(producer, "STAGES", 2)
    kernel = nc.lower(_forward(nc.f16, True, {q: 128, x: 96, d: 16}), threads=256, prefetch="double",
                      verify=False)
    body = _body(kernel)
    split = next(i for i, ln in enumerate(body) if ln.startswith("    setmaxnreg_inc_"))
    copying_side, computing = _named_barriers(body[:split]), _named_barriers(body[split:])
    full, empty = producer.hand_over_ids(256)
    assert computing == {(f"U{full} + buf_x * U2 + tid // U128", "U256"): ["bar_named"],
                         (f"U{empty} + buf_x", "U384"): ["bar_arrive"]}
    assert copying_side == {(f"U{full} + (U1 - pbuf_x) * U2", "U256"): ["bar_arrive"],
                            (f"U{full + 1} + (U1 - pbuf_x) * U2", "U256"): ["bar_arrive"],
                            (f"U{empty} + (U1 - pbuf_x)", "U384"): ["bar_named"]}
    out = _check(_forward(nc.f16, True, {q: 128, x: 96, d: 16}), kernel, 8.0)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_three_buffers_pair_every_wait_with_arrivals(copying):
    """Over three buffers: each computing warpgroup waits at "landed" barrier ``2 + 2 s + w`` (slot
    ``s = c % 2``, producer.landed_slots) for the copying warpgroup's arrival there (chunk c + 1,
    handed over at chunk c), and arrives at "released" barrier ``6 + b`` (its buffer) after every
    chunk that another follows, where the copying warpgroup waits at chunk c + 1, before it hands
    over chunk c + 2 and issues chunk c + 3 into that buffer."""
    kernel = nc.lower(_forward(nc.f16, True, {q: 128, x: 96, d: 16}), threads=256, prefetch="double",
                      verify=False)
    body = _body(kernel)
    split = next(i for i, ln in enumerate(body) if ln.startswith("    setmaxnreg_inc_"))
    copying_side, computing = _named_barriers(body[:split]), _named_barriers(body[split:])
    full, empty = producer.hand_over_ids(256, 3)
    assert (full, empty) == (2, 6)
    assert computing == {(f"U{full} + land_x * U2 + tid // U128", "U256"): ["bar_named"],
                         (f"U{empty} + buf_x", "U384"): ["bar_arrive"]}
    assert copying_side == {(f"U{full} + ((pland_x + U1) % U2) * U2", "U256"): ["bar_arrive"],
                            (f"U{full + 1} + ((pland_x + U1) % U2) * U2", "U256"): ["bar_arrive"],
                            (f"U{empty} + ((pbuf_x + U2) % U3)", "U384"): ["bar_named"]}
    # released wherever another chunk follows, waited for at every chunk: hand-overs at most two ahead
    assert not re.search(r"if x_next\w* \+ U2 \* CHUNK_x < \w+:", "\n".join(body[split:]))
    out = _check(_forward(nc.f16, True, {q: 128, x: 96, d: 16}), kernel, 8.0)
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_stages_fall_back_to_two_where_the_named_barriers_run_out(copying, monkeypatch):
    """Four computing warpgroups over four buffers would need 2 + 3 * 4 + 4 = 18 named barriers (three
    landed slots, producer.landed_slots); over three, 2 + 2 * 4 + 3 = 13."""
    assert producer.hand_over_ids(384, 3) == (2, 8)
    assert producer.hand_over_ids(512, 3) == (2, 10)
    assert producer.hand_over_ids(384, 4) == (2, 11)
    with pytest.raises(producer.NotSpecialised, match="16 a block has"):
        producer.hand_over_ids(512, 4)
    four = _forward(nc.f16, False, {q: 256, x: 96, d: 16}, rows=256)
    three = nc.lower(four, threads=512, prefetch="double", verify=False)   # the default: three, by slot
    assert "(3 chunk buffers)" in three.source and "bar_named(U2 + land_x * U4 + tid // U128, U256)" in three.source
    monkeypatch.setattr(producer, "STAGES", 4)
    kernel = nc.lower(four, threads=512, prefetch="double", verify=False)
    assert "(two chunk buffers)" in kernel.source and "chunk buffers)" not in kernel.source.replace("(two chunk", "")
    monkeypatch.setattr(producer, "STAGES", 1)
    with pytest.raises(ValueError, match="producer.STAGES"):
        nc.lower(_forward(nc.f16, False, {q: 128, x: 96, d: 16}), threads=256, prefetch="double", verify=False)


def test_a_thread_arriving_twice_at_a_named_barrier_is_a_protocol_error():
    """The simulator's named barrier refuses what the GPU would take as an early completion."""
    from napkin_cat.lowering.tensorcore import _NamedBarrier
    bar = _NamedBarrier(3)
    bar.arrive(0, wait=False)
    with pytest.raises(RuntimeError, match="arrived twice"):
        bar.arrive(0, wait=False)
    bar.arrive(1, wait=False)
    bar.arrive(2, wait=False)          # completes: a new phase
    bar.arrive(0, wait=False)


def test_a_barrier_at_no_fixed_place_is_refused():
    lines = ["    x = 1", "    # stream x " + producer.MARK, "    for x0 in range(U0, N_x, CHUNK_x):",
             "        if x0 > U0:", "            cuda.syncthreads()", "        cuda.syncthreads()", "    cuda.syncthreads()"]
    with pytest.raises(producer.NotSpecialised, match="depth 3"):
        producer._barrier_counts(["    cuda.syncthreads()", *lines])
    assert producer._barrier_counts(["    cuda.syncthreads()", *lines[:3], *lines[5:]]) == (1, 1, 1)


def test_both_backward_kernels_take_one_and_a_stream_not_all_copied_says_why_not(copying):
    """The dK, dV kernel's fp32 ``L`` and ``D`` go by cp.async too (4 words per copy) when their
    length is a multiple of 4; at 142 queries they cannot, and the kernel says so."""
    (dkdv, dq) = _parts(nc.f16, True)
    for part, q_len, threads, expect in (
            (dkdv, 140, 256, "threads 256..383 copy"),
            (dkdv, 142, 256, "none (the stream loop's inputs are not all copied by cp.async)"),
            (dq, 140, 256, "threads 256..383 copy"),
            (dq, 140, 128, "none (128 computing threads: one warpgroup, measured slower")):
        sizes = {q: q_len, x: 45, d: 16}
        inputs = _inputs(sizes, True, 4.0)
        bound = part.bind(sizes)
        tiles = {k: v for k, v in {"g_x": 128, "s_q": 32, "g_q": 128, "s_x": 32}.items() if k in part._sched_str()}
        kernel = nc.lower(bound, tiles=tiles, threads=threads, prefetch="double", verify=False)
        assert any(expect in n for n in kernel.notes), kernel.notes
        assert kernel.launch.block[0] == threads + (producer.THREADS if "copy" in expect else 0)
        if "copy" in expect:     # a refused kernel is the plain one, checked elsewhere
            out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
            assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_without_the_switch_or_warpgroups_nothing_changes(monkeypatch):
    dia = _forward(nc.f16, False, {q: 128, x: 64, d: 16})
    monkeypatch.setattr(producer, "SWITCH", False)
    plain = nc.lower(dia, threads=256, prefetch="double", verify=False)
    assert plain.launch.block == (256, 1, 1) and "setmaxnreg" not in plain.source
    monkeypatch.setattr(producer, "SWITCH", True)
    monkeypatch.setattr(planner, "WGMMA", False)
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)     # mma.sync: no warpgroups
    assert _body(kernel) == _body(plain)
    assert any("Copying warpgroup: none (no contraction on warpgroup MMAs)" in n for n in kernel.notes)


@pytest.mark.parametrize("regs", [40, 64])
def test_the_registers_moved_fit_what_the_launch_gave(monkeypatch, regs):
    """``setmaxnreg.inc`` waits until the block's pool holds what it asks for: asking more than the
    launch gave the block (its threads times the launch's registers, less the copying warpgroup's)
    hangs the kernel.  With 64 copying registers, sizing the request from the register file (65536)
    instead asked 224 x 256 + 64 x 128 = 65536 of a pool of 168 x 384 = 64512."""
    monkeypatch.setattr(producer, "REGS", regs)
    for threads, blocks in ((128, 2), (256, 1), (384, 1), (512, 1)):
        launch = producer.launch_registers(threads, blocks)
        mine, theirs = producer.REGS * producer.THREADS, producer.consumer_registers(threads, blocks) * threads
        assert mine + theirs <= launch * (threads + producer.THREADS) <= producer.REGISTER_FILE // blocks
        assert producer.REGS <= launch <= producer.consumer_registers(threads, blocks)
        assert producer.consumer_registers(threads, blocks) % 8 == 0


@pytest.mark.parametrize("hand_over", ["named", "block"])
def test_a_planted_late_copy_is_caught(copying, monkeypatch, hand_over):
    """Each chunk copied one chunk late (the copying side reads chunk c where it should read
    c + 1, its hand-over unchanged): the computing side reads chunk 0 twice and never the last
    one, which the check against the oracle sees."""
    monkeypatch.setattr(producer, "HAND_OVER", hand_over)
    monkeypatch.setattr(producer, "STAGES", 2)
    dia = _forward(nc.f16, False, {q: 128, x: 96, d: 16})
    kernel = copy.copy(nc.lower(dia, threads=256, prefetch="double", verify=False))
    (nxt,) = set(re.findall(r"\((x_next\d*) \+ i_", kernel.source))    # the copying side's next chunk
    late = kernel.source.replace(f"({nxt} + i_", "(x0 + i_")
    assert late.count("(x0 + i_") == 2 and f"({nxt} + i_" not in late
    kernel.source = late
    kernel._dispatcher, kernel._launchers, kernel._fast = None, {}, None
    assert _check(dia, kernel).failure is not None


def test_a_planted_stale_copy_over_three_buffers_is_caught(copying):
    """Over three buffers, the copying side copies chunk 0 where it should copy chunk c + 2 (its
    hand-overs unchanged): the check against the oracle sees it."""
    dia = _forward(nc.f16, False, {q: 128, x: 96, d: 16})
    kernel = copy.copy(nc.lower(dia, threads=256, prefetch="double", verify=False))
    assert "(3 chunk buffers)" in kernel.source
    (ahead,) = set(re.findall(r"\((x_ahead\d*) \+ i_", kernel.source))    # the copying side's chunk c + 2
    stale = kernel.source.replace(f"({ahead} + i_", "(U0 + i_")
    assert stale.count("(U0 + i_") == 4 and f"({ahead} + i_" not in stale
    kernel.source = stale
    kernel._dispatcher, kernel._launchers, kernel._fast = None, {}, None
    assert _check(dia, kernel).failure is not None


def test_the_decoupling_probe_still_edits_what_the_generator_writes():
    """``kernels/probes/wgmma_decoupled.py`` measures edits of this kernel's text on the GPU
    (kernels/BENCHMARKS.md); each edit finds its places in today's generated source (it refuses,
    naming the text, otherwise), and every named barrier it waits at has arrivals: the copying
    warpgroup's, the other warpgroup's, or both computing warpgroups'."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "wgmma_decoupled", Path(__file__).resolve().parents[1] / "kernels/probes/wgmma_decoupled.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    qq, xx, dd, hh = nc.axes("q x d h")
    dia = L.attention(q=qq, x=xx, d=dd, heads=hh, dtype=nc.f16).bind({qq: 512, xx: 256, dd: 64, hh: 2})
    src = probe.lower(dia, "256,64,256", True).source
    assert planner.WGMMA == "auto" and producer.SWITCH == "auto" and producer.HAND_OVER == "named" and tma.TMA == "auto"   # restored
    for flags in ({}, {"pingpong": True}, {"overlap": True}, {"overlap": True, "split": True}):
        edited = probe.decouple(src, 256, **flags)
        compile(edited, "edited", "exec")
        waits = set(re.findall(r"bar_named\(uint32\((\d+)\)", edited)) - {"1"}
        arrives = set(re.findall(r"probe_bar_arrive\(uint32\((\d+)\)", edited))
        assert waits and "cuda.syncthreads()  # the next chunk has landed" not in edited
        assert {int(w) // 2 * 2 for w in waits} <= {int(a) // 2 * 2 for a in arrives}, (flags, waits, arrives)
    with pytest.raises(ValueError, match="two computing warpgroups"):
        probe.decouple(src, 384)


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_one_kernel_backward_takes_a_copying_warpgroup_by_default(causal):
    """``producer.SWITCH = "auto"``: the one-kernel backward (dQ added across key tiles) gets the
    copying warpgroup, its chunks handed over by named barriers; the barrier that publishes dS
    among the computing threads, and the one that ends its chunk (dS is written again next
    chunk), meet the computing threads only.  Ragged sizes, several chunks and key tiles."""
    from napkin_cat.lowering.backward_forms import backward_plan
    from test_frag_operands import _inputs
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    sizes = {q: 140, x: 140, d: 32}
    (part,) = backward_plan(fl, form="one kernel").at(nc.f16).parts[1:]
    bound = part.bind(sizes)
    kernel = nc.lower(bound, tiles={"g_x": 128, "s_q": 64}, threads=256, prefetch="double", verify=False)
    assert any("chunks handed over by named barriers" in n for n in kernel.notes), kernel.notes
    _, in_loop = _computing_loop(kernel, "    for q0 in range(")
    assert not any(ln.strip() == "cuda.syncthreads()" for ln in in_loop)
    assert sum("bar_named(uint32(1), NTHREADS)" in ln for ln in in_loop) == 2
    inputs = _inputs(sizes, causal, 4.0)
    out = kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
    assert out.failure is None, kernelcheck.describe_failure(out.failure)


@pytest.mark.parametrize("fenced", [False, True])
def test_the_computing_threads_fence_only_what_the_tensor_cores_read_after_their_writes(monkeypatch, fenced):
    """Beside a copying warpgroup, the computing threads' barriers are fenced by writes
    (``wgmma.FENCE_SPECIALISED = False``): the one-kernel backward writes no buffer the tensor cores
    read by descriptor in its stream loop (dS is read by ``ldmatrix``), so its loop has no
    ``fence.proxy.async``, which would wait for dQ's ``red.global`` adds; the forward's release of a
    chunk follows the wait that completes its reads, unfenced.  The copying warpgroup fences every
    chunk it hands over.  ``FENCE_SPECIALISED = True`` restores a fence before each barrier and
    release of the computing threads."""
    from napkin_cat.lowering import wgmma
    from napkin_cat.lowering.backward_forms import backward_plan
    monkeypatch.setattr(wgmma, "FENCE_SPECIALISED", fenced)
    fl = L.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
    plan = backward_plan(fl, form="one kernel").at(nc.f16)
    sizes = {q: 140, x: 140, d: 32}
    backward = nc.lower(plan.parts[1].bind(sizes), tiles={"g_x": 128, "s_q": 64}, threads=256, prefetch="double",
                        verify=False)
    forward = nc.lower(plan.forward.bind(sizes), tiles={"g_q": 128, "s_x": 64}, threads=256, prefetch="double",
                       verify=False)
    for kernel, loop_head, waits in ((backward, "    for q0 in range(", 2), (forward, "    for x0 in range(", 1)):
        assert any("chunks handed over by named barriers" in n for n in kernel.notes), kernel.notes
        split, loop_lines = _computing_loop(kernel, loop_head)
        in_loop = [ln.strip() for ln in loop_lines]
        body = [ln.strip() for ln in _body(kernel)]
        syncs = [i for i, ln in enumerate(in_loop) if ln == "bar_named(uint32(1), NTHREADS)  # the computing threads"]
        releases = [i for i, ln in enumerate(in_loop) if "# this buffer is free: chunk c + " in ln]
        assert len(syncs) == (waits if kernel is backward else 0) and releases
        before = [in_loop[i - 1] for i in syncs] + [in_loop[i - 2] for i in releases if kernel is forward]
        assert all(ln.startswith("fence_proxy_async()") == fenced for ln in before), before
        if not fenced:
            assert not any(ln.startswith("fence_proxy_async()") for ln in in_loop)
        handed = [i for i, ln in enumerate(body[:split]) if "has landed for warpgroup 0" in ln]
        assert handed and all(body[i - 1].startswith("fence_proxy_async()") for i in handed)


def _table_attention(dtype, rows: int, cols: int, logsumexp: bool = False):
    """Attention under a document mask and a block table of the user's over ``rows x cols``
    blocks (``nc.blocked``: the table is part of the mask, so an entry of 0 masks its block)."""
    n = nc.Axis("n", TOKENS)
    doc = nc.aux("doc", n)
    bt = nc.aux("bt", nc.Axis("rb", -(-TOKENS // rows)), nc.Axis("cb", -(-TOKENS // cols)))
    m = nc.mask_mod(lambda b_, h_, i, j: doc[i] == doc[j])
    return L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, rows, cols), dtype=dtype, logsumexp=logsumexp)


TOKENS = 132
"""Two tiles of 128 (the second of 4 tokens) and five chunks of 32 (the last of 4)."""


def _table_inputs(dia, table, seed=3):
    """Inputs of ``dia`` by name: random Q, K, V (and dO), documents of ids 0 and 1 in runs of
    16, and ``table``."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(rng.integers(0, 2, 9), 16)[:TOKENS].astype(np.float32)
    return {arr.name: (ids if arr.name == "doc" else table if arr.name == "bt" else
                       rng.standard_normal(tuple(a.size for a in arr.axes))) for arr in dia.dom}


@pytest.mark.parametrize("hand_over,stages", [("named", 3), pytest.param("named", 4, marks=pytest.mark.slow),
                                               pytest.param("block", 3, marks=pytest.mark.slow)])
def test_chunks_a_block_table_masks_are_skipped_by_both_sides_of_the_copying_warpgroup(hand_over, stages):
    """The one-kernel backward (key tiles of 128, query chunks of 32) and the forward (query
    tiles of 128, key chunks of 32) with a table whose entries mask the first chunk of a tile,
    one in the middle, the last, and every chunk of the backward's second tile: the copying
    warpgroup copies the kept chunks only, in the order the computing warpgroups take them (both
    scan the table), and the results match the oracle."""
    from napkin_cat.lowering.backward_forms import backward_plan
    sizes = {q: TOKENS, x: TOKENS, d: 16}
    # the backward's table: query blocks of 32 (rows) by key blocks of 128; tile 1 keeps nothing
    back = _table_attention(nc.f16, 32, 128).stream(x, "s_x").tile(q, "g_q")
    part = next(p for p in backward_plan(back, form="one kernel").at(nc.f16).parts
                if "dK" in {a.name for a in p.cod}).bind(sizes)
    fwd = _table_attention(nc.f16, 32, 128, logsumexp=True).bind(sizes)
    named = _table_inputs(fwd, np.array([[0, 0], [1, 0], [0, 0], [2, 0], [0, 0]], np.float32))
    O, Lse = nc.evaluate(fwd, *[named[a.name] for a in fwd.dom])
    named |= {"O": O, "L": Lse, "dO": np.random.default_rng(4).standard_normal(O.shape)}
    named["D"] = (named["dO"] * O).sum(-1)
    # the forward's: query blocks of 128 by key blocks of 32, tile 0 keeping chunks 1 and 3
    ahead = _table_attention(nc.bf16, 128, 32).stream(x, 32).tile(q, 128).place("O", "registers").bind(sizes)
    ahead_in = _table_inputs(ahead, np.array([[0, 2, 0, 1, 0], [1, 1, 1, 1, 1]], np.float32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(producer, "HAND_OVER", hand_over)
        mp.setattr(producer, "STAGES", stages)   # 4: three landed slots, three hand-overs ahead
        mp.setattr(planner, "WGMMA", True)
        mp.setattr(producer, "SWITCH", True)
        for dia, tiles, ins in ((part, {"g_x": 128, "s_q": 32}, named), (ahead, None, ahead_in)):
            kernel = nc.lower(dia, tiles=tiles, threads=256, prefetch="double", verify=False)
            assert any(f"handed over by {hand_over} barriers" in n for n in kernel.notes), kernel.notes
            body = _body(kernel)
            split = next(i for i, ln in enumerate(body) if ln.startswith("    setmaxnreg_inc_"))
            assert any("_kept" in ln for ln in body[:split]), "the copying side scans the table"
            # the forward over three buffers with the named hand-over (producer._staged_copies)
            assert any("issued_x" in ln for ln in body[:split]) == (dia is ahead and hand_over == "named")
            out = kernelcheck.kernel_outcome(dia.unrelabelled(), kernel, [ins[a.name] for a in dia.dom])
            assert out.failure is None, kernelcheck.describe_failure(out.failure)


def test_a_release_never_arrived_at_is_reported_as_a_deadlock_in_seconds(copying, monkeypatch):
    """Planted: the computing warpgroups never release a buffer (their ``bar_arrive`` at "released"
    dropped).  The copying warpgroup then waits at that barrier for ever, the others at the next
    "landed" one: the simulator reports the deadlock and what each thread waits at
    (lowering/sim_waits.py), where it waited out a 300 s timeout before."""
    from napkin_cat.lowering import sim_waits
    import time
    monkeypatch.setattr(sim_waits, "STALL_S", 1.0)
    dia = _forward(nc.f16, True, {q: 128, x: 96, d: 16})
    kernel = nc.lower(dia, threads=256, prefetch="double", verify=False)
    _, empty = producer.hand_over_ids(256, 3)
    released = re.compile(rf"bar_arrive\(U{empty} \+ buf_x, U384\)(?=  # this buffer is free)")
    assert len(released.findall(kernel.source)) == 1
    mutant = copy.copy(kernel)
    mutant.source, mutant._dispatcher, mutant._launchers, mutant._fast = released.sub("pass", kernel.source), None, {}, None
    start = time.monotonic()
    out = _check(dia, mutant, 8.0)
    assert out.failure is not None and time.monotonic() - start < 120
    message = kernelcheck.describe_failure(out.failure)
    assert "deadlock in block" in message and f"at named barrier {empty}" in message, message
