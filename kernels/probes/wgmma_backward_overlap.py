"""Probe: the warpgroup (wgmma) dK, dV kernel of the attention backward with its contractions'
waits moved, timed beside the generator's ``mma.sync`` and wgmma kernels in one run.

The generator gives each warpgroup contraction its own ``wgmma.wait_group 0`` right after its
commit, so per query chunk the tensor cores and the CUDA cores take turns four times:
``S^T = K Q^T``, then ``P``; ``dP^T = V dO^T``, then ``dS``; ``dV += P^T dO``; ``dK += dS^T Q``.
The edits (text transforms of the generated source: this probe's measurement, not the generator):

- ``issue2``: ``dP^T`` issued right after ``S^T`` (both read only loaded chunks and registers
  held across the loop), the wait for ``S^T`` a ``wait_group 1``: ``P``'s exponentials run while
  ``dP^T`` is on the tensor cores;
- ``issue2+dv``: and ``dV += P^T dO`` issued as soon as ``P`` is packed, before the wait for
  ``dP^T`` (now ``wait_group 1``), its own wait after ``dK``'s: ``dS`` is formed while ``dV``'s
  products run.

Each kernel's dK and dV are checked against float64 autograd on two heads before it is timed.
GPU only (the simulator runs every wgmma synchronously: the edits change nothing there).

    NUMBA_ENABLE_CUDASIM=0 python3 -u kernels/probes/wgmma_backward_overlap.py [--d 64,128] [--dump EDIT]
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import napkin_cat as nc  # noqa: E402
import napkin_cat.lowering as lw  # noqa: E402
from napkin_cat.lowering import planner  # noqa: E402
from napkin_cat.lowering.backward_forms import backward_plan  # noqa: E402
from probes.wgmma_pipeline import find_line  # noqa: E402

N, BH = 4096, 32
EDITS = ("issue2", "issue2+dv")


def _issue_block(lines, acc: str, start: int) -> tuple[int, int]:
    """Lines ``[first, last]`` of contraction ``acc``'s issue: its ``ldmatrix`` lane addresses,
    descriptor (and the accumulator tuple, for an update), fence, wgmmas, commit."""
    commit = next(i for i in range(start, len(lines)) if lines[i].strip() == "wgmma_commit()"
                  and f"{acc}_wg = wgmma" in lines[i - 1])
    desc = next(i for i in range(commit, start, -1) if "= wgmma_desc16(" in lines[i])
    first = next(i for i in range(desc, start, -1) if re.match(r"^\s*kq\d* = tx % ", lines[i])) + 1
    for i in range(first, commit):   # the unused lane columns of each step (kb = kq + ...) go
        if re.match(r"^\s*kb\d* = kq\d* \+ ", lines[i]):
            lines[i] = ""
    return first, commit


def edit(src: str, which: str) -> str:
    lines = src.splitlines()
    loop = find_line(lines, r"^    for q0 in range\(")
    s_first, s_commit = _issue_block(lines, "acc2", loop)
    p_first, p_commit = _issue_block(lines, "acc3", s_commit)
    # 1. dP^T's issue moved up beside S^T's; S^T's wait lets dP^T's group stay in flight
    dp = lines[p_first:p_commit + 1]
    del lines[p_first:p_commit + 1]
    lines[s_commit + 1:s_commit + 1] = dp
    s_wait = s_commit + 1 + len(dp)
    assert re.fullmatch(r"acc2_wg = wgmma_wait_n\d+\(acc2_wg\)", lines[s_wait].strip()), lines[s_wait]
    lines[s_wait] = lines[s_wait].replace("wgmma_wait_n", "wgmma_wait1_n")
    if which == "issue2+dv":
        # 2. dV's update issued before the wait for dP^T; its own wait after dK's
        head = find_line(lines, r"# update dV \(sum_contract\)", loop)
        v_first, v_commit = _issue_block(lines, "dV_o", head)
        v_wait = v_commit + 1
        assert re.fullmatch(r"dV_o_wg = wgmma_wait_n\d+\(dV_o_wg\)", lines[v_wait].strip()), lines[v_wait]
        v_wait_line = lines[v_wait]
        unpack = lines[v_wait + 1]
        assert unpack.strip().startswith("dV_o[0, 0], ")
        block = lines[head:v_commit + 1]
        del lines[head:v_wait + 2]
        p_wait = find_line(lines, r"acc3_wg = wgmma_wait_n\d+\(acc3_wg\)", loop)
        lines[p_wait] = lines[p_wait].replace("wgmma_wait_n", "wgmma_wait1_n")
        lines[p_wait:p_wait] = block
        k_wait = find_line(lines, r"dK_o_wg = wgmma_wait_n\d+\(dK_o_wg\)", loop)
        lines[k_wait + 2:k_wait + 2] = [v_wait_line, unpack]
    text = "\n".join(ln for ln in lines if ln) + "\n"
    head, sep, tail = text.partition("  # noqa: F401")   # the primitives' import line
    waits = sorted(set(re.findall(r"wgmma_wait1_n\d+", tail)) - set(re.findall(r"wgmma_wait1_n\d+", head)))
    return head + "".join(f", {w}" for w in waits) + sep + tail


def dkdv_part(d: int, causal: bool = False):
    q, x, dd, h = nc.axes("q x d h")
    att = nc.library.attention(q=q, x=x, d=dd, heads=h, causal=causal).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    plan = backward_plan(att, form="two kernels").bind({"q": N, "x": N, "d": d, "h": BH}).at(nc.f16)
    return plan.parts[1]


def lower(part, wg: bool):
    saved = planner.WGMMA
    planner.WGMMA = wg
    try:
        return nc.lower(part, prefetch="auto", verify=False)
    finally:
        planner.WGMMA = saved


def edited(kernel, which: str):
    k = copy.copy(kernel)
    k.source = edit(kernel.source, which)
    k._dispatcher, k._launchers, k._fast = None, {}, None
    return k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--dump", choices=EDITS, help="print the edited d = 64 kernel and stop")
    args = ap.parse_args()
    if args.dump:
        lw._gpu_present = lambda runtime: True
        planner_wg = lower(dkdv_part(64), True)
        print(edit(planner_wg.source, args.dump))
        return
    import math
    import torch
    from bench import checked_times
    from bench_fwd_bwd import reference
    rows = []
    for d in map(int, args.d.split(",")):
        part = dkdv_part(d)
        names = [a.name for a in part.dom]
        gen = torch.Generator(device="cuda").manual_seed(0)
        Q, K, V, dO = (torch.randn(BH, N, d, device="cuda", generator=gen).half() for _ in range(4))
        scale = 1 / math.sqrt(d)
        Ls, Ds = [], []
        for hh in range(BH):
            s = (Q[hh].float() @ K[hh].float().T) * scale
            Ls.append(torch.logsumexp(s, -1))
            Ds.append((torch.softmax(s, -1) @ V[hh].float() * dO[hh].float()).sum(-1))
            del s
        arrays = {"Q": Q, "K": K, "V": V, "dO": dO, "L": torch.stack(Ls), "D": torch.stack(Ds)}
        _, _, dK_ref, dV_ref = reference(Q[:2], K[:2], V[:2], dO[:2], False)
        ref = torch.cat([dK_ref, dV_ref])
        base = lower(part, True)
        kernels = [("mma.sync (the default)", lower(part, False)), ("wgmma (the generator's)", base)]
        kernels += [(f"wgmma, {e}", edited(base, e)) for e in EDITS]
        for name, k in kernels:
            dK, dV = (torch.full_like(Q[:, :, :d], float("nan")) for _ in range(2))
            run = k.prepare(*(arrays[n] for n in names), out=(dK, dV))
            err, ms, kms = checked_times(run, lambda: torch.cat([dK[:2], dV[:2]]), ref)
            info = k.compiled_info()
            rows.append((d, name, err, kms, info.get("registers"), info.get("local_bytes", info.get("spill"))))
            print(rows[-1], flush=True)
    print(f"| d | dK, dV kernel (f16, N = {N}, B*H = {BH}) | err | kernel ms | registers | local |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1e} | {r[3]:.3f} | {r[4]} | {r[5]} |")


if __name__ == "__main__":
    main()
