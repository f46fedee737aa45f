"""Probe: the warpgroup forward with a copying warpgroup, its computing warpgroups decoupled.

The generator's copying warpgroup (``lowering/producer.py``) meets the computing warpgroups at one
block barrier per chunk: the next chunk has landed, and the buffer of this one is free.  That
barrier also puts the two computing warpgroups of a 256-row block in step, so both run their
``wgmma`` at the same time and both their softmax at the same time; the tensor cores idle while
they exponentiate.  FlashAttention-3 lets them drift (and then schedules them in turn).

This probe edits the generated kernel's text (a measurement, not the generator) so that each
buffer's hand-over goes by named barriers instead (``bar.sync`` / ``bar.arrive`` with counts):

- ``FULL[b][w]`` (ids 2-5): the copying warpgroup *arrives* once buffer ``b`` holds its chunk;
  computing warpgroup ``w`` *waits* there (256 threads: 128 copying + the warpgroup's 128);
- ``EMPTY[b]`` (ids 6-7): both computing warpgroups *arrive* when they are done with buffer
  ``b``; the copying warpgroup *waits* there before refilling it (384 threads).

A warpgroup then waits only for its own data, never for the other warpgroup, which may run up to
one chunk ahead.  A second edit on top (``_pingpong``) makes the two warpgroups issue their
products in turn; a third (``_overlap``) runs each chunk's softmax while the previous chunk's
update is on the tensor cores, and a fourth hands K and V over apart on top of it.  Each kernel is checked against float64 on 128 random rows of 2 heads before it
is timed, beside the generator's kernel, ``mma.sync`` and FlexAttention in the same run.  GPU only
(the simulator has no ``bar.arrive``).

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/wgmma_decoupled.py [--blocks 256,64,256]
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner, producer, tma, wgmma  # noqa: E402
from probes.wgmma_pipeline import chunk_parts, find_line  # noqa: E402

ARRIVE_CU = r"""
extern "C" __device__ int nc_probe_bar_arrive(int* ret, unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
  *ret = 0;
  return 0;
}
"""


def _arrive_file() -> str:
    path = Path(tempfile.gettempdir()) / "nc_probe_bar_arrive.cu"
    path.write_text(ARRIVE_CU)
    return str(path)


def _replace_once(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise ValueError(f"expected one {old!r} in the generated kernel, found {src.count(old)}")
    return src.replace(old, new)


def _pingpong(src: str) -> str:
    """The two computing warpgroups issue their ``wgmma`` in turn (FlashAttention-3's ping-pong):
    warpgroup ``w`` waits at barrier ``8 + w`` before issuing a contraction and arrives at the
    other's after committing it, so one warpgroup's softmax runs while the other's products are on
    the tensor cores.  Warpgroup 1 hands the first turn to warpgroup 0 before the loop."""
    fence, commit = "        wgmma_fence()\n", "        wgmma_commit()\n"
    if src.count(fence) != 2 or src.count(commit) != 2:
        raise ValueError("the ping-pong edit expects two contractions in the stream loop")
    wg = "tid // uint32(128)"
    src = src.replace(fence, f"        bar_named(uint32(8) + {wg}, uint32(256))  # my turn\n" + fence)
    src = src.replace(commit, commit + f"        probe_bar_arrive(uint32(9) - {wg}, uint32(256))  # the other's turn\n")
    return _replace_once(src, "    for x0 in range(U0, N_x, CHUNK_x):\n        if x0 > U0:\n",
                         f"    if {wg} == uint32(1):\n"
                         "        probe_bar_arrive(uint32(8), uint32(256))  # warpgroup 0 goes first\n"
                         "    for x0 in range(U0, N_x, CHUNK_x):\n        if x0 > U0:\n")


def _overlap(src: str, total: int) -> str:
    """FlashAttention-3's intra-warpgroup overlap on the decoupled kernel: chunk c's scores are
    issued, then chunk c - 1's update (its probabilities kept packed in registers, its V still in
    its buffer); the softmax of chunk c runs while that update is on the tensor cores
    (``wgmma.wait_group 1``), and each row's rescale of the output waits for it.  Chunk c - 1's
    buffer is released once its update has landed, so the copying warpgroup refills it one
    softmax later than without the overlap."""
    lines = src.splitlines()
    loop = find_line(lines, r"^    for x0 in range\(")
    end = find_line(lines, r"^    # O\[", loop)
    body = lines[loop + 1:end]
    ind = " " * 8
    p = chunk_parts(body)
    rows, cols = map(int, re.search(r"O_o = cuda.local.array\(\((\d+), (\d+)\)", src).groups())
    new = [
        f"    O_dl = cuda.local.array({rows}, float32)  # probe: each row's rescale, applied once the update landed",
        *[f"    {n} = pack_f16(ZERO, ZERO)  # probe: chunk c - 1's probabilities, packed" for n in p.names],
        lines[loop],
        *body[:p.s0 - 2],                       # the wait for this chunk's buffer
        f"{ind}K_s_cur = K_s + buf_x * STRIDE_K_s",
        f"{ind}V_s_prv = V_s + ((U1 - buf_x) if x0 > U0 else buf_x) * STRIDE_V_s",
        *body[p.s0:p.s_commit + 1],
        *p.pv_tuples,
        f"{ind}wgmma_fence()",
        *p.pv_mma,
        f"{ind}wgmma_commit()",
        *p.s_wait,
        *p.softmax,
        *p.pv_wait,
        f"{ind}fence_proxy_async()",
        f"{ind}if x0 > U0 and x0 + CHUNK_x < N_x:",
        f"{ind}    probe_bar_arrive(uint32(6) + (U1 - buf_x), uint32({total}))  # chunk c - 1's buffer is free",
        f"{ind}for i in range({rows}):",
        f"{ind}    for j in range({cols}):",
        f"{ind}        O_o[i, j] *= O_dl[i]",
        *p.packs,
        f"{ind}buf_x = U1 - buf_x",
        "    V_s_prv = V_s + (U1 - buf_x) * STRIDE_V_s",
        *[ln[4:] for ln in p.pv_tuples],
        "    wgmma_fence()",
        *[ln[4:] for ln in p.pv_mma],
        "    wgmma_commit()",
        *[ln[4:] for ln in p.pv_wait],
    ]
    text = "\n".join(lines[:loop] + new + lines[end:]) + "\n"
    head, sep, tail = text.partition("  # noqa: F401")    # the primitives' import line
    return head + ", wgmma_wait1_n64" + sep + tail


def _split_hand_over(src: str, total: int) -> str:
    """On the overlapped kernel: K and V of a chunk handed over separately (ids 2-7 for K as
    before, 8-13 for V), so that the copying warpgroup refills a K buffer as soon as its scores
    have landed, and V (needed one chunk later in the overlap) once its update has."""
    src = _replace_once(src, f"                    bar_named(uint32(6) + (U1 - pbuf_x), uint32({total}))  # buffer released\n",
                        f"                    bar_named(uint32(6) + (U1 - pbuf_x), uint32({total}))  # K buffer released\n")
    at = src.index("                V_s_fill2 = ")
    src = (src[:at] + "                cp_async_commit()\n"
           "                cp_async_wait_all()\n"
           "                fence_proxy_async()\n"
           "                probe_bar_arrive(uint32(2) + (U1 - pbuf_x) * uint32(2), uint32(256))  # K landed, warpgroup 0\n"
           "                probe_bar_arrive(uint32(3) + (U1 - pbuf_x) * uint32(2), uint32(256))  # K landed, warpgroup 1\n"
           "                if x0 > U0:\n"
           f"                    bar_named(uint32(12) + (U1 - pbuf_x), uint32({total}))  # V buffer released\n"
           + src[at:])
    src = _replace_once(src, "                probe_bar_arrive(uint32(2) + (U1 - pbuf_x) * uint32(2), uint32(256))  # landed, warpgroup 0\n"
                             "                probe_bar_arrive(uint32(3) + (U1 - pbuf_x) * uint32(2), uint32(256))  # landed, warpgroup 1\n",
                        "                probe_bar_arrive(uint32(8) + (U1 - pbuf_x) * uint32(2), uint32(256))  # V landed, warpgroup 0\n"
                        "                probe_bar_arrive(uint32(9) + (U1 - pbuf_x) * uint32(2), uint32(256))  # V landed, warpgroup 1\n")
    wg = "tid // uint32(128)"
    src = _replace_once(src, f"probe_bar_arrive(uint32(6) + (U1 - buf_x), uint32({total}))  # chunk c - 1's buffer is free",
                        f"probe_bar_arrive(uint32(12) + (U1 - buf_x), uint32({total}))  # chunk c - 1's V buffer is free")
    # K of chunk c released once its scores landed
    src = _replace_once(src, "        # S = ",
                        "        fence_proxy_async()\n"
                        "        if x0 + uint32(2) * CHUNK_x < N_x:\n"
                        f"            probe_bar_arrive(uint32(6) + buf_x, uint32({total}))  # chunk c's K buffer is free\n"
                        "        # S = ")
    # V of chunk c - 1 waited for before its update (chunk 0's landed before the loop)
    lines = src.split("\n")
    loop = find_line(lines, r"^    for x0 in range\(")
    fences = [i for i in range(loop, len(lines)) if lines[i] in ("        wgmma_fence()", "    wgmma_fence()")]
    pv_fences = [i for i in fences if lines[i + 1].lstrip().startswith("V_s_desc")]
    assert len(pv_fences) == 2, pv_fences
    inside, after = pv_fences
    lines[after] = (f"    if N_x > CHUNK_x:\n        bar_named(uint32(8) + (U1 - buf_x) * uint32(2) + {wg}, uint32(256))\n"
                    + lines[after])
    lines[inside] = (f"        if x0 > CHUNK_x:\n            bar_named(uint32(8) + (U1 - buf_x) * uint32(2) + {wg}, uint32(256))\n"
                     + lines[inside])
    return "\n".join(lines)


def decouple(src: str, computing: int, pingpong: bool = False, overlap: bool = False, split: bool = False) -> str:
    """The text edit described above, on the generator's copying-warpgroup kernel (``pingpong``:
    and :func:`_pingpong`)."""
    groups = computing // 128
    if groups != 2:
        raise ValueError(f"the edit is written for two computing warpgroups, not {groups}")
    total = computing + producer.THREADS
    # the copying warpgroup: wait until the buffer it refills is released; announce each chunk per warpgroup
    src = _replace_once(src, "            if x_next < N_x:\n",
                        "            if x_next < N_x:\n"
                        "                if x0 > U0:\n"
                        f"                    bar_named(uint32(6) + (U1 - pbuf_x), uint32({total}))  # buffer released\n")
    src = _replace_once(
        src,
        "                fence_proxy_async()  # ... and are visible to the tensor cores\n"
        "            cuda.syncthreads()  # the next chunk has landed; the buffer of this one is free\n",
        "                fence_proxy_async()  # ... and are visible to the tensor cores\n"
        "                probe_bar_arrive(uint32(2) + (U1 - pbuf_x) * uint32(2), uint32(256))  # landed, warpgroup 0\n"
        "                probe_bar_arrive(uint32(3) + (U1 - pbuf_x) * uint32(2), uint32(256))  # landed, warpgroup 1\n")
    # the computing warpgroups: wait for their own chunk; release the buffer without waiting
    src = _replace_once(src, "    for x0 in range(U0, N_x, CHUNK_x):\n        K_s_cur = ",
                        "    for x0 in range(U0, N_x, CHUNK_x):\n"
                        "        if x0 > U0:\n"
                        "            bar_named(uint32(2) + buf_x * uint32(2) + tid // uint32(128), uint32(256))\n"
                        "        K_s_cur = ")
    src = _replace_once(src, "        fence_proxy_async()\n        cuda.syncthreads()\n        buf_x = U1 - buf_x\n",
                        "        fence_proxy_async()\n"
                        "        if x0 + uint32(2) * CHUNK_x < N_x:\n"
                        f"            probe_bar_arrive(uint32(6) + buf_x, uint32({total}))\n"
                        "        buf_x = U1 - buf_x\n")
    if pingpong:
        src = _pingpong(src)
    if overlap:
        src = _overlap(src, total)
    if split:
        src = _split_hand_over(src, total)
    decl = f"probe_bar_arrive = cuda.declare_device('nc_probe_bar_arrive', 'int32(uint32, uint32)', link={_arrive_file()!r})\n"
    at = src.index("\nZERO16 = ")
    return src[:at + 1] + decl + src[at + 1:]


def lower(dia, blocks: str, wg: bool):
    tq, tx, thr = map(int, blocks.split(","))
    saved = planner.WGMMA, producer.SWITCH, producer.HAND_OVER, wgmma.FENCE_SPECIALISED, tma.TMA
    # the edits start from block barriers, each fenced, and cp.async copies, as when this was measured
    planner.WGMMA, producer.SWITCH, producer.HAND_OVER, wgmma.FENCE_SPECIALISED, tma.TMA = wg, wg, "block", True, False
    try:
        return nc.lower(dia, prefetch="auto", verify=False, tiles={"q": tq, "x": tx}, threads=thr)
    finally:
        planner.WGMMA, producer.SWITCH, producer.HAND_OVER, wgmma.FENCE_SPECIALISED, tma.TMA = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--blocks", default="256,64,256")
    ap.add_argument("--dump", action="store_true", help="print the edited source and stop")
    ap.add_argument("--edit", type=int, default=0, help="with --dump: 0 decoupled, 1 and ping-pong, 2 and overlap, 3 overlap with K and V apart")
    args = ap.parse_args()
    N, B, H, D = 4096, 2, 16, args.d
    q, x, d, h, b = nc.axes("q x d h b")
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, dtype=nc.f16).bind({q: N, x: N, d: D, h: H, b: B})
    gen_kernel = lower(dia, args.blocks, True)
    edits = []
    for pp, ov, sp in ((False, False, False), (True, False, False), (False, True, False), (False, True, True)):
        edited = copy.copy(gen_kernel)
        edited.source = decouple(gen_kernel.source, int(args.blocks.split(",")[2]), pingpong=pp, overlap=ov, split=sp)
        edited._dispatcher, edited._launchers, edited._fast = None, {}, None
        edits.append(edited)
    if args.dump:
        print(edits[args.edit].source)
        return
    import torch
    from bench import checked_times, compiled_flex, reference_rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=gen).half() for _ in range(3))
    sel = torch.randperm(N, device="cuda", generator=gen)[:128].sort().values
    ref = reference_rows(Q, K, V, False, D ** -0.5, sel, 2)
    flops = 4 * B * H * N * N * D
    rows = []
    for name, k in (("mma.sync (the default)", nc.lower(dia, prefetch="auto", verify=False)),
                    (f"wgmma + copying warpgroup {args.blocks} (the generator's)", gen_kernel),
                    ("same, decoupled by named barriers (this edit)", edits[0]),
                    ("same, decoupled, and the warpgroups' products in turn (ping-pong)", edits[1]),
                    ("same, decoupled, and the softmax beside the previous chunk's update (overlap)", edits[2]),
                    ("overlap, K and V handed over separately", edits[3])):
        O = torch.full_like(Q, float("nan"))
        err, ms, kms = checked_times(k.prepare(Q, K, V, out=O), lambda: O[:, :2, sel], ref)
        rows.append((name, err, ms, kms, flops / kms / 1e9, k.compiled_info().get("registers")))
        print(rows[-1], flush=True)
    flex, fo = compiled_flex(), {}
    err, ms, kms = checked_times(lambda: fo.update(o=flex(Q, K, V)), lambda: fo["o"][:, :2, sel], ref)
    rows.append(("FlexAttention (compiled)", err, ms, kms, flops / kms / 1e9, None))
    print(f"| kernel (f16, N = {N}, d = {D}, B*H = {B * H}) | err | events ms | kernel ms | TFLOP/s | regs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1e} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.0f} | {r[5]} |")


if __name__ == "__main__":
    main()
