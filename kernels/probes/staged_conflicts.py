"""Probe: what do the bank conflicts of dQ's staging writes cost?  (``lowering/staged_add.py``,
measured slower than the atomics on the H200: kernels/BENCHMARKS.md, sixth session of 2026-11-29.)

Three forms of the one-kernel backward through ``nc.torch_op``, timed in turns: dQ by atomics (the
default), dQ staged (``STAGED_ADD`` on: every thread writes its fragment into a buffer laid out as
global memory is, rows of d fp32 words, so a fragment's eight rows share a bank), and the staged
kernel with its staging writes permuted so that the 32 lanes of each store fall in 32 banks
(column ``c`` of row ``r`` written at column ``(c + 8 (r % 4) + (r // 4) % 2) % d``).  The third
adds dQ's values at the wrong columns: **its dQ is wrong by construction and it is timed only to
price the conflicts**; the first two are checked against float64 first, as every timed kernel is.
If the third is faster than the atomics, accumulating dQ in the fragments' own order (as
FlashAttention-3 does, reordered after the kernel) is worth building; if not, the bulk reduction
itself is the cost.  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/staged_conflicts.py --case f16,4096,128,0
"""
from __future__ import annotations

import os
import re
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "kernels" / "probes"))

WRITE = re.compile(r"smem\[dQ_add_s \+ (\w+) \* N_d \+ (\w+)\] = ")


def permuted(source: str) -> str:
    """The staged kernel's writes into dQ's buffer at permuted columns (wrong sums, no conflicts)."""
    out, n = WRITE.subn(lambda m: f"smem[dQ_add_s + {m[1]} * N_d + ({m[2]} + {m[1]} % uint32(4) * uint32(8) + "
                                  f"{m[1]} // uint32(4) % uint32(2)) % N_d] = ", source)
    assert n == 1, f"{n} staging writes found (expected 1): the generator changed"
    return out


def main():
    import torch

    import napkin_cat as nc
    from bench import kernel_ms
    from bench_fwd_bwd import flash, rel
    from napkin_cat.lowering import staged_add
    from op_forms import case_args, case_tensors, flex_call, in_turns
    args = case_args(rounds=5).parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    fns = {}
    for name in ("atomics", "staged", "staged, writes permuted (dQ wrong: timing only)"):
        staged_add.STAGED_ADD = name != "atomics"
        op = nc.torch_op(flash(causal), verify=False)
        grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
        staged_add.STAGED_ADD = False
        kernels = [k for k in op._cache.values() if "bulk_add_f32(" in getattr(k, "source", "")]
        assert len(kernels) == (0 if name == "atomics" else 1), (name, len(kernels))
        if name.startswith("staged, writes permuted"):
            k = kernels[0]
            k.source, k._dispatcher, k._launchers, k._fast = permuted(k.source), None, {}, None
            grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
            print(f"{name}: dQ error against float64 {rel(grads[0], want[1]):.2e} (wrong by construction)", flush=True)
        else:
            err = max(rel(a, b) for a, b in zip(grads, want[1:]))
            print(f"{name}: error against float64 {err:.2e}", flush=True)
            assert err < 5e-3, (name, err)
        fns[name] = (lambda op=op: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO))
    del want
    fns["FlexAttention"] = flex_call(Q, K, V, dO, causal)
    times = in_turns(fns, args)
    print(f"\n{args.case} (B*H = {args.bh}), {args.rounds} rounds in turns, median ms of forward + backward; "
          f"CUDA ms of the three longest kernels:")
    for name, fn in fns.items():
        ks = sorted(kernel_ms(fn, 5).values(), reverse=True)[:3]
        print(f"| {name} | {statistics.median(times[name]):.3f} | spread {min(times[name]):.3f}-{max(times[name]):.3f} | "
              + " ".join(f"{v:.3f}" for v in ks) + " |")


if __name__ == "__main__":
    main()
