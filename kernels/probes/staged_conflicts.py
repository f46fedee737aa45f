"""Probe: what do the bank conflicts of dQ's staging writes cost, and does padding the rows remove
them?  (``lowering/staged_add.py``; kernels/BENCHMARKS.md.)

Three forms of the one-kernel backward through ``nc.torch_op``, timed in turns with FlexAttention:
dQ by atomics, dQ staged in rows of d fp32 words (``PAD_ROWS`` off: a tensor-core fragment's eight
rows share four banks, 8-way conflicts on every staging write), dQ staged in rows padded by
:func:`~napkin_cat.lowering.staged_add.row_pad` words (2-way, the least a row stride gives for
single words; the global array the bulk reduction adds into is padded alike and the caller gets
the view without the padding).  Every form is checked against float64 before it is timed.  GPU
only.  (A fourth form measured on 2026-11-30, each column pair written as one 64-bit store, so
that a warp's stores take two wavefronts, the least 256 bytes take, ran as the padded rows did:
1.936 against 1.935 ms at d = 128, 1.095 both causal; not kept.)

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/staged_conflicts.py --case f16,4096,128,0

(Until 2026-11-30 the third form was the unpadded kernel with its staging writes permuted, its dQ
wrong by construction, timed only to price the conflicts: 1.877 ms against 1.974 by atomics at
d = 128 on the H200. The padded rows are that form made correct.)
"""
from __future__ import annotations

import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "kernels" / "probes"))

FORMS = {"atomics": (False, True), "staged, rows of d words": (True, False), "staged, rows padded": (True, True)}
"""Each form's (``STAGED_ADD``, ``PAD_ROWS``)."""
SWITCHES = ("STAGED_ADD", "PAD_ROWS")


@contextmanager
def form(name: str):
    """The lowering switches of form ``name`` while its kernels are lowered, then restored."""
    from napkin_cat.lowering import staged_add
    before = [getattr(staged_add, k) for k in SWITCHES]
    for k, v in zip(SWITCHES, FORMS[name]):
        setattr(staged_add, k, v)
    try:
        yield
    finally:
        for k, v in zip(SWITCHES, before):
            setattr(staged_add, k, v)


def checked(name: str, op, grads, want, fns: dict, Q, K, V, dO) -> None:
    """Form ``name``'s gradients against float64 (asserted), then its timed call in ``fns``."""
    import torch
    from bench_fwd_bwd import rel
    err = max(rel(a, b) for a, b in zip(grads, want[1:]))
    print(f"{name}: error against float64 {err:.2e}", flush=True)
    assert err < 5e-3, (name, err)
    fns[name] = (lambda op=op: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO))


def report(args, fns: dict, causal: bool, Q, K, V, dO) -> None:
    """FlexAttention beside the forms, every one timed in turns; a table row each."""
    from bench import kernel_ms
    from op_forms import flex_call, in_turns
    fns["FlexAttention"] = flex_call(Q, K, V, dO, causal)
    times = in_turns(fns, args)
    print(f"\n{args.case} (B*H = {args.bh}), {args.rounds} rounds in turns, median ms of forward + backward; "
          f"CUDA ms of the three longest kernels:")
    for name, fn in fns.items():
        ks = sorted(kernel_ms(fn, 5).values(), reverse=True)[:3]
        print(f"| {name} | {statistics.median(times[name]):.3f} | spread {min(times[name]):.3f}-{max(times[name]):.3f} | "
              + " ".join(f"{v:.3f}" for v in ks) + " |")


def main():
    import torch

    import napkin_cat as nc
    from bench_fwd_bwd import flash
    from op_forms import case_args, case_tensors
    args = case_args(rounds=5).parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    fns = {}
    for name, (staged, *_) in FORMS.items():
        with form(name):
            op = nc.torch_op(flash(causal), verify=False)
            grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
        kernels = [k for k in op._cache.values() if "bulk_add_f32(" in getattr(k, "source", "")]
        assert len(kernels) == int(staged), (name, len(kernels))
        checked(name, op, grads, want, fns, Q, K, V, dO)
    del want
    report(args, fns, causal, Q, K, V, dO)


if __name__ == "__main__":
    main()
