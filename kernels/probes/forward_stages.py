"""Probe: would a third chunk buffer speed up the attention forward that ``nc.torch_op`` runs on
warpgroups with a copying warpgroup?  A measurement to decide whether to build it into the code
generator, not a feature: the generated forward's source is rewritten here, by text, from two
chunk buffers to three (the copying warpgroup fills chunk c + 2 while chunk c is computed, once
chunk c - 1's buffer is released), then checked against float64 and timed against the generated
two-buffer kernel and FlexAttention in turns.

Why (``kernels/logs/ncu_forward_source_h200_d128.txt``): at d = 128, 11.5% of the computing warps'
samples in the stream loop wait for their chunk to land.  With two buffers the copying warpgroup
refills a buffer only once all three computing warpgroups have released it, and its copies of the
next chunk must land within one chunk's work.

The rewrite knows the shape of the generated forward (two ``(two chunk buffers)`` inputs K and V
filled by the copying warpgroup, the named hand-over: "landed" barriers ``2 + b W + w``, "released"
``2 + 2W + b``) and asserts every pattern it replaces, so a change of the generator stops it
rather than measuring something else.  Barriers: landed ``2 + b W + w`` for ``b`` < 3, released
``2 + 3W + b``.  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/forward_stages.py --case f16,4096,128,0 --rounds 7
"""
from __future__ import annotations

import copy
import os
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "kernels" / "probes"))


def _sub(pattern: str, repl, text: str, count: int) -> str:
    out, n = re.subn(pattern, repl, text, flags=re.M)
    assert n == count, f"{pattern!r}: {n} matches, expected {count}"
    return out


def three_buffers(source: str, groups: int) -> tuple[str, int]:
    """``source`` (the generated forward) with three chunk buffers; the extra shared-memory bytes."""
    # shared offsets: each double-buffered input one more copy; everything after it moves up
    consts = dict((m[1], int(m[2])) for m in re.finditer(r"^(\w+) = uint32\((\d+)\)  # shared offset", source, re.M))
    doubled = re.findall(r"^(\w+) = uint32\(\d+\)  # shared offset of [^\n]*\(two chunk buffers\)", source, re.M)
    assert len(doubled) == 2, (f"{doubled}: not the forward over two buffers this rewrites (the generator's own three "
                               f"since the second session of 2026-11-30: give the form producer.STAGES=2)")
    strides = {b: int(re.search(rf"^STRIDE_{b} = uint32\((\d+)\)", source, re.M)[1]) for b in doubled}
    moved = {}
    for name, off in consts.items():
        moved[name] = off + sum(strides[b] for b in doubled if consts[b] < off)
    for name, off in moved.items():
        source = _sub(rf"^{name} = uint32\(\d+\)", f"{name} = uint32({off})", source, 1)
    full, empty, new_empty = 2, 2 + 2 * groups, 2 + 3 * groups
    assert new_empty + 3 <= 16
    w = "tid >= NTHREADS:"
    head, tail = source.split(w, 1)
    producer, consumer = tail.split("setmaxnreg_inc_", 1)
    # the copying warpgroup: chunk c + 2 into buffer (c + 2) % 3, after chunk c - 1's release
    other = "((pbuf_x + U2) % U3)"
    producer = _sub(r"x_next2 = x0 \+ CHUNK_x\n", "x_next2 = x0 + CHUNK_x + CHUNK_x\n", producer, 1)
    fill = re.search(r"\n( +)if x_next2 < N_x:\n(.*?)\n\1pbuf_x = U1 - pbuf_x", producer, re.S)
    assert fill, "the copying warpgroup's fill"
    ind = fill[1]
    body = fill[2].replace("(U1 - pbuf_x)", other)
    release = re.search(rf"\n{ind}if x0 > U0:\n{ind}    bar_named\(U{empty} \+ \(U1 - pbuf_x\), (\w+)\)[^\n]*", producer)
    assert release, "the copying warpgroup's wait for a released buffer"
    count = release[1]
    wait = (f"\n{ind}    if x0 > U0:\n{ind}        bar_named(uint32({new_empty}) + {other}, {count})"
            f"  # chunk c - 1's buffer released by every computing warpgroup")
    producer = producer.replace(release[0], "")
    producer = producer.replace(fill[0], f"\n{ind}if x_next2 < N_x:{wait}\n{body}\n{ind}pbuf_x = (pbuf_x + U1) % U3")
    # before the loop: chunk 1 into buffer 1, handed over as the loop hands over the others
    first = body.replace(other, "U1").replace("x_next2", "CHUNK_x")
    first = "\n".join(ln[4:] if ln.startswith(ind) else ln for ln in first.split("\n"))
    landed = re.search(r"\n( +)cuda\.syncthreads\(\)  # chunk 0 has landed", producer)
    assert landed
    producer = producer.replace(landed[0], landed[0] + f"\n{landed[1]}if CHUNK_x < N_x:\n"
                                + "\n".join(ln for ln in first.split("\n") if ln.strip()), 1)
    # the computing warpgroups: buffer c % 3; chunk c's buffer released where chunk c + 3 follows
    consumer = _sub(r"if x_next < N_x:\n(\s+)bar_arrive\(U%d \+ buf_x, (\w+)\)" % empty,
                    rf"if x_next + CHUNK_x + CHUNK_x < N_x:\n\1bar_arrive(uint32({new_empty}) + buf_x, \2)", consumer, 1)
    consumer = _sub(r"buf_x = U1 - buf_x", "buf_x = (buf_x + U1) % U3", consumer, 1)
    out = head + w + producer + "setmaxnreg_inc_" + consumer
    for u in ("U2", "U3"):
        assert re.search(rf"^{u} = uint32", out, re.M), u
    return out, 4 * sum(strides.values())


def main():
    import torch

    import napkin_cat as nc
    from bench_fwd_bwd import flash
    from op_forms import case_args, case_tensors
    args = case_args(rounds=7).parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    ops = {}
    for name in ("two buffers", "three buffers"):
        op = nc.torch_op(flash(causal), verify=False)
        torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
        if name == "three buffers":
            key = forward_key(op)
            kern = op._cache[key]
            groups = kern.launch.block[0] // 128 - 1
            mutant = op._cache[key] = edited(kern, *three_buffers(kern.source, groups))
            print(f"three buffers: {mutant.launch.dynamic_smem_bytes} bytes of shared memory "
                  f"(two: {kern.launch.dynamic_smem_bytes})", flush=True)
        ops[name] = checked(name, op, Q, K, V, dO, want)
    del want
    time_forwards(ops, args, Q, K, V, dO, causal)


def edited(kernel, source: str, extra_smem: int = 0):
    """A copy of ``kernel`` running ``source`` (compiled afresh), with ``extra_smem`` more bytes of
    dynamic shared memory."""
    mutant = copy.copy(kernel)
    mutant.source, mutant._dispatcher, mutant._launchers, mutant._fast = source, None, {}, None
    mutant.launch = replace(kernel.launch, dynamic_smem_bytes=kernel.launch.dynamic_smem_bytes + extra_smem)
    return mutant


def forward_key(op):
    """The key of ``op``'s cache under which its forward with the logsumexp is kept."""
    return next(k for k in op._cache if k[0] == "kernel" and str(k[1]).startswith("residuals"))


def checked(name: str, op, Q, K, V, dO, want):
    """``op``, once its O, dQ, dK, dV are within 5e-3 of float64's ``want`` (printed)."""
    import torch

    from bench_fwd_bwd import rel
    O = op(Q, K, V)
    grads = torch.autograd.grad(O, (Q, K, V), dO)
    err = max(rel(a, b) for a, b in zip((O.detach(),) + grads, want))
    print(f"{name}: error against float64 {err:.2e}", flush=True)
    assert err < 5e-3, (name, err)
    return op


def time_forwards(ops: dict, args, Q, K, V, dO, causal: bool, kernels: int = 2):
    """The forwards of ``ops`` ({name: op}) and FlexAttention's timed in turns; a table of medians,
    with the ``kernels`` longest kernels of one call by CUPTI."""
    import torch

    from bench import kernel_ms
    from op_forms import flex_call, in_turns
    fns = {name: (lambda op=op: op(Q, K, V)) for name, op in ops.items()}
    fns["FlexAttention"] = flex_call(Q, K, V, dO, causal, backward=False)
    with torch.no_grad():
        times = in_turns(fns, args)
        print(f"\nforward only, {args.case} (B*H = {args.bh}), {args.rounds} rounds in turns, median ms:")
        flex_ms = statistics.median(times["FlexAttention"])
        for name, fn in fns.items():
            ms = statistics.median(times[name])
            longest = sorted(kernel_ms(fn, 5).items(), key=lambda kv: -kv[1])[:kernels]
            print(f"| {name} | {ms:.3f} | {flex_ms / ms:.2f}x Flex | spread {min(times[name]):.3f}-"
                  f"{max(times[name]):.3f} | " + " ".join(f"{v:.3f}" for _, v in longest) + " |")


if __name__ == "__main__":
    main()
