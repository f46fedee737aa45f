"""Probe: what the generated fp16 attention forward (``mma.sync`` and warpgroup MMAs) gains from
edits of its source, timed beside FlexAttention in one run:

- ``hoist``: the row operand's fragments read once before the stream loop (Q is loop-invariant):
  the generator's own rule, ``lowering/emit_mma.py::hoisted_fragments``, which the other edits'
  base kernels have off (``none``, ``late``) or on (``hoist-late``, ``pipe``);
- ``late``: the next chunk's copies issued after this chunk's wait, proxy fence and barrier;
- ``pipe``: FlashAttention-3's intra-warpgroup pipeline (the update of chunk c - 1 on the tensor
  cores while chunk c's softmax runs on the CUDA cores);
- ``producer``: warp specialisation, FlashAttention-3's split: a copying warpgroup (``cp.async``,
  40 registers by ``setmaxnreg``) beside the multiplying ones (232), so the multiplying warps
  never wait on their own copies at ``wgmma.fence`` / ``fence.proxy.async``.  The double-buffered
  shape only (``--blocks`` whose kernel prefetches two cp.async buffers); GPU only: the
  simulator's warp reductions and MMA twins need every thread of the block at each barrier.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/wgmma_pipeline.py [--d 64] [--blocks 128,64,128]
    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/wgmma_pipeline.py --once --only mma:none,wg:pipe  # for ncu
    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/wgmma_pipeline.py --blocks 256,64,256 --only wg:hoist,wg:producer
    NUMBA_ENABLE_CUDASIM=1 python kernels/probes/wgmma_pipeline.py --check   # the edits, simulated

The edits are text transforms of the generated source (this probe's measurement, not the
generator): they decide whether the generator should learn them.  Each kernel is checked against
float64 before it is timed.  Results: kernels/BENCHMARKS.md, "Third session of 2026-11-24" and
"Fourth session of 2026-11-24".
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import replace
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import emit_mma, planner, wgmma  # noqa: E402

PRELOAD = False
"""Form every step's A fragments before a contraction's first wgmma (``wgmma.PRELOAD_A``)."""
PREFETCH = "auto"
"""``nc.lower``'s ``prefetch`` for every kernel of the run (``--prefetch``)."""


def find_line(lines, pattern, start=0, stop=None):
    rx = re.compile(pattern)
    for i in range(start, len(lines) if stop is None else stop):
        if rx.search(lines[i]):
            return i
    raise ValueError(f"no line matches {pattern!r}")


def late_prefetch(src: str) -> str:
    """Issue the next chunk's copies after this chunk's wait, proxy fence and barrier (not before
    the wait), and drop the proxy fence before the loop's closing barrier: a proxy fence waits for
    every copy this thread has in flight, so a fence after the next chunk's copies were issued
    waits for them too and the double buffer overlaps nothing.  The closing barrier goes too: the
    next iteration's barrier now comes before its copies overwrite this chunk's buffers."""
    lines = src.splitlines()
    loop = find_line(lines, r"^    for x0 in range\(")
    i0 = find_line(lines, r"^        if x_next < N_x:", loop)
    j0 = find_line(lines, r"^            cp_async_commit\(\)", i0)
    fetch = lines[i0:j0 + 1]
    k = j0 + 1
    assert lines[k].strip().startswith("cp_async_wait1()") and lines[k + 1].strip() == "else:"
    assert lines[k + 2].strip() == "cp_async_wait_all()" and lines[k + 3].strip() == "fence_proxy_async()"
    assert lines[k + 4].strip() == "cuda.syncthreads()"
    top = ["        cp_async_wait_all()", "        fence_proxy_async()", "        cuda.syncthreads()", *fetch]
    out = lines[:i0] + top + lines[k + 5:]
    end = find_line(out, r"^        buf_x = U1 - buf_x", loop)
    assert out[end - 1].strip() == "cuda.syncthreads()" and out[end - 2].strip() == "fence_proxy_async()"
    del out[end - 2:end]          # the next iteration's barrier comes before its copies are issued
    return "\n".join(out) + "\n"


def chunk_parts(body: list[str]) -> SimpleNamespace:
    """The pieces of the warpgroup forward's stream-loop ``body`` that the overlap edits reorder:
    the scores' contraction (``body[s0:s_commit + 1]``), its wait as ``wgmma.wait_group 1``
    (``s_wait``), the softmax with each row's rescale of the output kept in ``O_dl[i]`` instead of
    applied (``softmax``), and the update's packed probabilities (``packs``, their ``names``),
    accumulator tuples, products (reading ``V_s_prv``) and wait."""
    s0 = find_line(body, r"^\s+V_s_cur = ") + 1
    s_commit = find_line(body, r"^\s+wgmma_commit\(\)", s0)
    sm0 = find_line(body, r"^\s+# S = ", s_commit)
    sm1 = find_line(body, r"^\s+# update O: o \+= ", sm0)
    softmax = body[sm0:sm1]
    rs = find_line(softmax, r"O_o\[i, j\] \*= delta")
    assert softmax[rs - 1].strip().startswith("for j in range(")
    softmax = softmax[:rs - 1] + [softmax[rs - 1].split("for")[0] + "O_dl[i] = delta"] + softmax[rs + 1:]
    pv = body[sm1:find_line(body, r"^\s+fence_proxy_async\(\)", sm1)]
    packs = [ln for ln in pv if "pack_f16(" in ln]
    return SimpleNamespace(
        s0=s0, s_commit=s_commit, softmax=softmax, packs=packs, names=[ln.split("=")[0].strip() for ln in packs],
        s_wait=[ln.replace("wgmma_wait_n", "wgmma_wait1_n") for ln in body[s_commit + 1:sm0]],
        pv_tuples=[ln for ln in pv if re.match(r"^\s+O_o_wg\d* = \(", ln)],
        pv_mma=[ln.replace("V_s_cur", "V_s_prv") for ln in pv
                if re.match(r"^\s+(O_o_wg\d* = wgmma_f16_n|V_s_desc\d* = wgmma_desc16\()", ln)],
        pv_wait=[ln for ln in pv if "wgmma_wait_n" in ln or re.match(r"^\s+O_o\[\d, 0\], ", ln)])


def pipeline(src: str) -> str:
    """FlashAttention-3's intra-warpgroup overlap on the warpgroup kernel (Q's fragments already
    before the loop, as the generator puts them): chunk c's
    scores are issued, then chunk c - 1's update (its probabilities kept packed in registers, its
    V still in its buffer), then the softmax of chunk c runs while the update is on the tensor
    cores; K of chunk c + 1 is fetched at the top, V of chunk c + 1 once the update of c - 1 no
    longer reads its buffer."""
    lines = src.splitlines()
    loop = find_line(lines, r"^    for x0 in range\(")
    end = find_line(lines, r"^    # O\[", loop)          # the epilogue after the loop
    body = lines[loop + 1:end]
    ind = " " * 8
    kf = find_line(body, r"^\s+K_s_fill2 = ")
    vf = find_line(body, r"^\s+V_s_fill2 = ")
    cm = find_line(body, r"^\s+cp_async_commit\(\)", vf)
    k_lines, v_lines = body[kf:vf], body[vf:cm]
    parts = chunk_parts(body)
    s0, s_commit, softmax, s_wait = parts.s0, parts.s_commit, parts.softmax, parts.s_wait
    packs, names, pv_tuples, pv_mma, pv_wait = parts.packs, parts.names, parts.pv_tuples, parts.pv_mma, parts.pv_wait
    new = [
        "    O_dl = cuda.local.array(4, float32)  # probe: each row's rescale, applied once the update landed",
        *[f"    {n} = pack_f16(ZERO, ZERO)  # probe: chunk c - 1's probabilities, packed" for n in names],
        lines[loop],
        f"{ind}x_next = x0 + CHUNK_x",
        f"{ind}cp_async_wait_all()",
        f"{ind}fence_proxy_async()",
        f"{ind}cuda.syncthreads()",
        f"{ind}if x_next < N_x:",
        *k_lines,
        f"{ind}    cp_async_commit()",
        f"{ind}K_s_cur = K_s + buf_x * STRIDE_K_s",
        f"{ind}V_s_prv = V_s + ((U1 - buf_x) if x0 > U0 else buf_x) * STRIDE_V_s",
        *body[s0:s_commit + 1],
        *pv_tuples,
        f"{ind}wgmma_fence()",
        *pv_mma,
        f"{ind}wgmma_commit()",
        *s_wait,
        *softmax,
        *pv_wait,
        f"{ind}for i in range(U4):",
        f"{ind}    for j in range(U16):",
        f"{ind}        O_o[i, j] *= O_dl[i]",
        *packs,
        f"{ind}cuda.syncthreads()",
        f"{ind}if x_next < N_x:",
        *v_lines,
        f"{ind}    cp_async_commit()",
        f"{ind}buf_x = U1 - buf_x",
        "    cp_async_wait_all()",
        "    fence_proxy_async()",
        "    cuda.syncthreads()",
        "    V_s_prv = V_s + (U1 - buf_x) * STRIDE_V_s",
        *[ln[4:] for ln in pv_tuples],
        "    wgmma_fence()",
        *[ln[4:] for ln in pv_mma],
        "    wgmma_commit()",
        *[ln[4:] for ln in pv_wait],
    ]
    out = lines[:loop] + new + lines[end:]
    text = "\n".join(out) + "\n"
    head, sep, tail = text.partition("  # noqa: F401")    # the primitives' import line
    return head + ", wgmma_wait1_n64" + sep + tail


PRODUCER_THREADS = 128
"""The copying warpgroup that :func:`producer_warp` adds to the block."""
PRODUCER_REGS, CONSUMER_REGS = 40, 232
"""``setmaxnreg`` of the copying warpgroup and of the multiplying ones: 40 x 128 + 232 x 256 <= 65536
(with 24 the copying warpgroup's address arithmetic spills, ptxas -v)."""
SETMAXNREG_CU = """
extern "C" __device__ int nc_probe_regs_dec(int* ret) {{
  asm volatile("setmaxnreg.dec.sync.aligned.u32 {dec};\\n" ::: "memory");
  *ret = 0;
  return 0;
}}
extern "C" __device__ int nc_probe_regs_inc(int* ret) {{
  asm volatile("setmaxnreg.inc.sync.aligned.u32 {inc};\\n" ::: "memory");
  *ret = 0;
  return 0;
}}
"""


def _setmaxnreg_file() -> str:
    import tempfile
    path = Path(tempfile.gettempdir()) / f"nc_probe_setmaxnreg_{PRODUCER_REGS}_{CONSUMER_REGS}.cu"
    path.write_text(SETMAXNREG_CU.format(dec=PRODUCER_REGS, inc=CONSUMER_REGS))
    return str(path)


def producer_warp(src: str) -> str:
    """A copying warpgroup beside the multiplying ones (registers moved to them by ``setmaxnreg``).  ``wgmma.fence`` and
    ``fence.proxy.async`` wait for the executing thread's ``cp.async`` copies in flight (Nsight
    Compute: the stalls sit on FENCE.VIEW.ASYNC / WARPGROUP.ARRIVE), so while the warps that
    multiply also issue the next chunk's copies, those copies serialise with the multiplications.
    Here warp 4 fills chunk c + 1 (waits for its own copies, fences them for the async proxy)
    while warps 0-3 compute chunk c; one block barrier per chunk hands the buffers over: chunk
    c + 1's buffer was last read in chunk c - 1, before the previous barrier."""
    lines = src.splitlines()
    p = PRODUCER_THREADS
    T = int(re.search(r"^NTHREADS = uint32\((\d+)\)", src, re.M).group(1))
    lines = [re.sub(r'"launch_bounds": \((\d+), ', lambda m: f'"launch_bounds": ({int(m.group(1)) + p}, ', ln)
             for ln in lines]
    loop = find_line(lines, r"^    for x0 in range\(")
    first = find_line(lines, r"^    if U0 < N_x:")
    assert lines[loop - 1].strip() == "cp_async_commit()"
    i0 = find_line(lines, r"^        if x_next < N_x:", loop)
    j0 = find_line(lines, r"^            cp_async_commit\(\)", i0)

    def one_warp(ln):
        steps = re.search(r"for u in range\(U(\d+)\):", ln)
        if steps:
            return ln.replace(steps.group(0), f"for u in range({int(steps.group(1)) * T // p}):")
        return ln.replace("tid + u * NTHREADS", f"(tid - NTHREADS) + u * uint32({p})").replace("buf_x", "pbuf")
    fetch = [one_warp(ln) for ln in lines[i0 + 1:j0]]
    k = j0 + 1
    assert lines[k].strip().startswith("cp_async_wait1()") and lines[k + 3].strip() == "fence_proxy_async()"
    assert lines[k + 4].strip() == "cuda.syncthreads()"
    end = find_line(lines, r"^        buf_x = U1 - buf_x", loop)
    assert lines[end - 2].strip() == "fence_proxy_async()" and lines[end - 1].strip() == "cuda.syncthreads()"
    consumer = lines[:first] + lines[loop:i0] + lines[k + 5:end - 2] + lines[end - 1:]
    start = find_line(consumer, r"^    b0 = by_rest")
    producer = [
        "    if tid >= NTHREADS:  # probe: the copying warpgroup",
        "        probe_regs_dec()",
        "        pbuf = U1  # (U1 - pbuf): the buffer being filled; chunk c goes to buffer c % 2",
        "        x_next = U0",
        "        if U0 < N_x:",
        *fetch,
        "            cp_async_commit()",
        "            cp_async_wait_all()",
        "            fence_proxy_async()",
        "        cuda.syncthreads()  # the preamble's barrier: chunk 0 and Q have landed",
        "        for x0 in range(U0, N_x, CHUNK_x):",
        "            x_next = x0 + CHUNK_x",
        "            pbuf = U1 - pbuf",
        "            if x_next < N_x:",
        *["    " + ln for ln in fetch],
        "                cp_async_commit()",
        "                cp_async_wait_all()",
        "                fence_proxy_async()",
        "            cuda.syncthreads()  # chunk x_next ready; the chunk just computed released",
        "        return",
        "    probe_regs_inc()",
    ]
    out = consumer[:start + 1] + producer + consumer[start + 1:]
    text = "\n".join(out) + "\n"
    decl = (f"probe_regs_dec = cuda.declare_device('nc_probe_regs_dec', 'int32()', link={_setmaxnreg_file()!r})\n"
            f"probe_regs_inc = cuda.declare_device('nc_probe_regs_inc', 'int32()', link={_setmaxnreg_file()!r})\n")
    at = text.index("\nZERO16 = ")
    return text[:at + 1] + decl + text[at + 1:]


EDITS = {"none": (False, lambda s: s), "hoist": (True, lambda s: s), "late": (False, late_prefetch),
         "hoist-late": (True, late_prefetch), "pipe": (True, pipeline),
         "producer": (True, producer_warp)}
"""edit -> (the generator's own hoisting of Q's fragments on, a text edit of the source)."""
ENGINES = ((False, ("none", "hoist")), (True, ("none", "hoist", "late", "hoist-late", "pipe", "producer")))


def variant(N, D, BH, blocks, wg: bool, name: str):
    """The kernel of edit ``name``: lowered (hoisting as the edit says), then its source edited."""
    hoist, edit = EDITS[name]
    k = copy.copy(lower(N, D, BH, blocks, wg, hoist))
    k.source = edit(k.source)
    k._dispatcher, k._launchers, k._fast = None, {}, None    # nothing compiled for the original
    if edit is producer_warp:   # the block gains the copying warp
        k.launch = replace(k.launch, block=(k.launch.block[0] + PRODUCER_THREADS, 1, 1))
    return k


def lower(N, D, BH, blocks, wg: bool, hoist: bool):
    q, x, d, h, b = nc.axes("q x d h b")
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=False, dtype=nc.f16).bind(
        {q: N, x: N, d: D, h: BH, b: 1})
    tq, tx, thr = map(int, blocks.split(","))
    saved = planner.WGMMA, emit_mma.HOIST_REGISTERS, wgmma.PRELOAD_A
    planner.WGMMA = wg
    emit_mma.HOIST_REGISTERS = saved[1] if hoist else 0
    wgmma.PRELOAD_A = PRELOAD
    try:
        return nc.lower(dia, prefetch=PREFETCH, verify=False, tiles={"q": tq, "x": tx}, threads=thr)
    finally:
        planner.WGMMA, emit_mma.HOIST_REGISTERS, wgmma.PRELOAD_A = saved


def check_sim():
    """The edits keep the mathematics: each variant against float64 in the simulator."""
    import numpy as np
    N, D = 256, 64
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((1, 1, N, D)).astype(np.float16) for _ in range(3))
    s = Q[0, 0].astype(np.float64) @ K[0, 0].astype(np.float64).T / 8.0
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ V[0, 0].astype(np.float64)
    for wg, names in ENGINES:
        for name in names:
            if EDITS[name][1] is producer_warp:
                print(f"wgmma={wg} {name}: not simulated (the simulator's reductions need the whole block)")
                continue
            out = np.asarray(variant(N, D, 1, "128,64,128", wg, name)(Q, K, V), dtype=np.float64)[0, 0]
            print(f"wgmma={wg} {name}: max error {np.abs(out - ref).max():.2e}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--blocks", default="128,64,128")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--once", action="store_true", help="launch each kernel once (for ncu), no timing")
    ap.add_argument("--dump", default="")
    ap.add_argument("--only", default="", help="comma list of engine:edit (mma:none, wg:pipe, ...)")
    ap.add_argument("--preload", default="0", help="comma list of 0/1: wgmma.PRELOAD_A off / on (the wgmma kernels)")
    ap.add_argument("--prefetch", default="auto", choices=("auto", "none", "regs", "double"))
    args = ap.parse_args()
    global PRELOAD, PREFETCH
    PREFETCH = {"auto": "auto", "none": False, "regs": True, "double": "double"}[args.prefetch]
    if args.check:
        return check_sim()
    if args.dump:
        wg, name = args.dump.split(":")
        print(variant(4096, args.d, 32, args.blocks, wg == "wg", name).source)
        return
    import torch
    from bench import cuda_time, device_ms, reference_rows, rel_err
    N, B, H, D = 4096, 2, 16, args.d
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=gen).half() for _ in range(3))
    sel = torch.randperm(N, device="cuda", generator=gen)[:128].sort().values
    ref = reference_rows(Q, K, V, False, D ** -0.5, sel, 2)
    rows = []
    runs = [(wg, name, pre) for wg, names in ENGINES for name in names
            for pre in (map(bool, map(int, args.preload.split(","))) if wg else (False,))
            if not args.only or f"{'wg' if wg else 'mma'}:{name}" in args.only.split(",")]
    for wg, name, PRELOAD in runs:
        k = variant(N, D, H * B, args.blocks, wg, name)
        name = f"{name}{' +preload' if PRELOAD else ''}"
        O = torch.full_like(Q, float("nan")).view(1, B * H, N, D)
        run = k.prepare(Q.view(1, B * H, N, D), K.view(1, B * H, N, D), V.view(1, B * H, N, D), out=O)
        run()
        torch.cuda.synchronize()
        err = rel_err(O.view(B, H, N, D)[:, :2, sel], ref)
        if args.once:          # one launch each, for a profiler
            rows.append((("wgmma" if wg else "mma.sync"), name, err, 0, 0, 0, None))
            continue
        ms = cuda_time(run) if err < 1e-2 else float("nan")
        kms = device_ms(run) if err < 1e-2 else float("nan")
        info = k.compiled_info()
        tf = 4 * B * H * N * N * D / kms / 1e9 if kms == kms else 0
        rows.append((("wgmma" if wg else "mma.sync"), name, err, ms, kms, tf, info.get("registers")))
        print(rows[-1], flush=True)
    from bench import compiled_flex
    flex = compiled_flex()
    Qf, Kf, Vf = (t.view(1, B * H, N, D) for t in (Q, K, V))
    fo = flex(Qf, Kf, Vf)
    if args.once:
        return
    err = rel_err(fo.view(B, H, N, D)[:, :2, sel], ref)
    kms = device_ms(lambda: flex(Qf, Kf, Vf))
    rows.append(("FlexAttention", "compiled", err, cuda_time(lambda: flex(Qf, Kf, Vf)), kms,
                 4 * B * H * N * N * D / kms / 1e9, None))
    import subprocess
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip())
    print(f"| engine | edit | rel err | events ms | kernel ms | TFLOP/s | regs |  (f16, N={N}, d={D}, B*H={B * H}, blocks {args.blocks})")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1e} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.0f} | {r[6]} |")


if __name__ == "__main__":
    main()
