"""Probe: the backward's column values (``L``, ``D``) read before the contraction's wait.

In the one-kernel backward on warpgroups, each epilogue of ``S^T = K Q^T`` and ``dP^T = V dO^T``
first waits for its contraction (``wgmma_wait*``), then reads the column values it needs from
shared memory (``L_cols``, ``D_cols``: one per column of the thread, ``column_values.py``).  The
wait is an ``asm volatile`` with a memory clobber, so the compiler cannot lift the loads above it;
Nsight Compute put 4% of the d = 128 backward's computing-warp samples on their short scoreboard
(kernels/BENCHMARKS.md, "Fifth session of 2026-11-30").  This probe edits the generated backward's
text (a measurement, not the generator) to read them before the wait, and times it beside the
generated op and FlexAttention, every form checked against float64 first.  It lowers with
``column_values.BEFORE_WAIT = 0`` (the loads after the wait), the form it was written against; the
generator now reads them before the wait itself where the contraction has 8 steps or more.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/column_loads.py --case f16,4096,128,0
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

import torch  # noqa: E402

from bench_fwd_bwd import rel  # noqa: E402
from probes.forward_stages import edited  # noqa: E402
from probes.op_forms import build, case_args, case_tensors, flex_call, timed_table  # noqa: E402
from napkin_cat.lowering import column_values  # noqa: E402

column_values.BEFORE_WAIT = 0   # the generated form this probe edits: the loads after the wait

# a contraction's wait and its unpacking, then a column-values block (its array and its loop)
WAIT_THEN_COLUMNS = re.compile(
    r"(?P<wait>^(?P<ind> +)(?P<acc>\w+)_wg = wgmma_wait\w*\((?P=acc)_wg\)\n(?P=ind)(?P=acc)\[.*\n)"
    r"(?P<cols>(?P=ind)\w+_cols = cuda\.local\.array.*\n(?P=ind)for j in range\(\w+\):\n(?:(?P=ind)    .*\n)+)", re.M)


def columns_first(source: str) -> tuple[str, int]:
    """``source`` with each column-values block moved above the wait before it; how many moved."""
    return WAIT_THEN_COLUMNS.subn(lambda m: m["cols"] + m["wait"], source)


def main():
    args = case_args(rounds=11).parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    fns = {}
    for name in ("generated", "columns before the wait"):
        op, O, grads = build("", causal, Q, K, V, dO)
        if name != "generated":
            moved = 0
            for key, k in list(op._cache.items()):
                if hasattr(k, "source") and "wgmma_wait" in k.source:
                    src, n = columns_first(k.source)
                    if n:
                        op._cache[key], moved = edited(k, src), moved + n
            assert moved, "no column-values block after a wait"
            O = op(Q, K, V).detach()
            grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
            print(f"{name}: {moved} block(s) moved", flush=True)
        err = max(rel(a, b) for a, b in zip((O,) + tuple(grads), want))
        print(f"{name}: error against float64 {err:.2e}", flush=True)
        assert err < 5e-3, (name, err)
        fns[name] = lambda op=op: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
    del want
    fns["FlexAttention"] = flex_call(Q, K, V, dO, causal)
    timed_table(fns, args, f"\n{args.case} (B*H = {args.bh}), forward + backward, {args.rounds} rounds in turns, "
                           f"{args.steady} calls each, median ms; then the three longest kernels (CUPTI):")

if __name__ == "__main__":
    main()
