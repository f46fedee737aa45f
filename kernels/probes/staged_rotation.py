"""Probe: do the unmasked d = 128 backward's blocks contend for the same dQ rows?

In the one-kernel backward every key tile's block streams the query chunks in the same order, so
the blocks running together (about four key tiles of each head on 132 SMs) add into the same dQ
chunk at the same time, by atomics or by staged bulk reductions (``lowering/staged_add.py``).
Staging dQ gained 10% causal, where the blocks start at different chunks, and nothing unmasked
(kernels/BENCHMARKS.md, third session of 2026-11-30).  Here the generated unmasked kernel's
source is rewritten so that key tile ``t`` streams the query chunks starting at chunk ``t`` (mod
the chunk count): every global address of a chunk (the copies of Q, L, dO, D and dQ's adds) is
rotated, the loop's control is not.  Exact where the queries are a whole number of chunks and no
mask reads the query index (unmasked, N = 4096): the sums are the same, added in another order.
Four forms, each checked against float64 before timing: atomics and staged, each as generated
and rotated.  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/staged_rotation.py --case f16,4096,128,0
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "kernels" / "probes"))

ROTATE = [
    (re.compile(r"(    x0 = bx_rest \* TILE_x\n)"), r"\1    ROT = bx_rest % (N_q // CHUNK_q) * CHUNK_q  # this key tile's first query chunk (probe)\n"),
    (re.compile(r"h0 \* N_q \+ \(U0 \+ i_q"), "h0 * N_q + (ROT + i_q"),                           # chunk 0's copies
    (re.compile(r"h0 \* N_q \+ \(q_next2 \+ i_q"), "h0 * N_q + ((q_next2 + ROT) % N_q + i_q"),    # chunk c + 1's
    (re.compile(r"\(h0 \* N_q \+ \(q0 \+ U0\)\)"), "(h0 * N_q + ((q0 + ROT) % N_q + U0))"),        # the staged add
    (re.compile(r"\(h0 \* N_q \+ \(q0 \+ i_q"), "(h0 * N_q + ((q0 + ROT) % N_q + i_q"),           # the atomics
]


def rotated(source: str) -> str:
    """The kernel with each key tile's query chunks streamed from its own first chunk."""
    if "causal" in source.split("@cuda.jit")[0] or "N_q = uint32(" not in source:
        raise SystemExit("the rotation is exact only for the unmasked backward")
    counts = []
    for pattern, repl in ROTATE:
        source, n = pattern.subn(repl, source)
        counts.append(n)
    assert counts[0] == 1 and sum(counts[1:3]) == 8 and sum(counts[3:]) >= 1, counts   # the generator changed
    return source


def main():
    import torch

    import napkin_cat as nc
    from bench_fwd_bwd import flash
    from napkin_cat.lowering import staged_add
    from op_forms import case_args, case_tensors
    from staged_conflicts import checked, report
    args = case_args(rounds=5).parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    assert not causal, "unmasked only"
    fns = {}
    for name, staged, rotate in (("atomics", False, False), ("atomics, rotated", False, True),
                                 ("staged", True, False), ("staged, rotated", True, True)):
        before, staged_add.STAGED_ADD = staged_add.STAGED_ADD, staged
        try:
            op = nc.torch_op(flash(causal), verify=False)
            grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
        finally:
            staged_add.STAGED_ADD = before
        if rotate:
            (k,) = [k for k in op._cache.values() if "dQ" in getattr(k, "source", "") and "def kernel" in k.source
                    and "for q0 in range(U0, N_q, CHUNK_q)" in k.source and "dK" in k.source]
            k.source, k._dispatcher, k._launchers, k._fast = rotated(k.source), None, {}, None
            grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
        checked(name, op, grads, want, fns, Q, K, V, dO)
    del want
    report(args, fns, causal, Q, K, V, dO)


if __name__ == "__main__":
    main()
