"""Probe: forms of ``nc.torch_op`` attention timed in turns, so that a slow drift of the GPU's
clock (seen between runs as 5-10% on one kernel) falls on every form alike.

Each form is a comma list of tunables (upper-case names of ``napkin_cat.lowering`` modules, as
``kernels/bench_fwd_bwd.py --tiles`` takes them: ``REGS=24``, ``DEFER_ROW_SUMS=0``), block symbols
(lower case, ``nc.torch_op``'s ``tiles``: ``s_x=128``, the forward's key chunk) and
``prefetch=double``; the tunables are set while the form's op plans and compiles its kernels (its
first call), which it keeps.  Every form's O, dQ, dK and dV are checked against float64 autograd
first; then ``--rounds`` rounds each time every form once (forward + backward, ``--steady``
back-to-back calls between two events), FlexAttention (compiled) among them; printed: the median
per form, and the CUDA time per kernel of one call (``torch.profiler``).

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/op_forms.py --case f16,4096,128,0 \\
        --form default= --form double24=prefetch=double,REGS=24
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench import kernel_ms, profile_once  # noqa: E402
from bench_fwd_bwd import DTYPES, PREFETCH, flash, flex_fn, reference, rel, switch_value  # noqa: E402
from napkin_cat.lowering import (column_values, emit, emit_acc, emit_loads, emit_mma, emit_states, issue_ahead, staged_add,  # noqa: E402
                                 paired_stores, planner, producer, tma, unswitch, wgmma, wgmma_plan)

MODULES = (planner, emit_mma, emit_acc, producer, emit, emit_loads, emit_states, column_values, paired_stores, wgmma, wgmma_plan,
           unswitch, issue_ahead, staged_add, tma)


def parse_form(spec: str):
    """``(prefetch, tunables, home, tiles)`` of a form ``"NAME=VALUE,...,prefetch=MODE"``: the op's
    prefetch, the tunables' values as written, the module of :data:`MODULES` each tunable lives in,
    and the block symbols given in lower case (``s_x=128``) as ``nc.torch_op``'s ``tiles``."""
    items = dict(item.split("=") for item in filter(None, spec.split(",")))
    prefetch = PREFETCH[items.pop("prefetch", "auto")]
    tiles = {k: int(v) for k, v in items.items() if k.islower()}
    tunables = {k: v for k, v in items.items() if k not in tiles}
    return prefetch, tunables, {k: next(m for m in MODULES if hasattr(m, k)) for k in tunables}, tiles


@contextlib.contextmanager
def tunables_of(spec: str):
    """The tunables of a form set while the block runs, restored after it."""
    _, items, home, _ = parse_form(spec)
    saved = {k: getattr(home[k], k) for k in items}
    try:
        for k, v in items.items():
            setattr(home[k], k, switch_value(saved[k], v))
        yield
    finally:
        for k, v in saved.items():
            setattr(home[k], k, v)


def build(spec: str, causal: bool, Q, K, V, dO):
    """The op of one form, planned and compiled under its tunables (first call)."""
    prefetch, _, _, tiles = parse_form(spec)
    with tunables_of(spec):
        op = nc.torch_op(flash(causal), verify=False, prefetch=prefetch, tiles=tiles or None)
        grads = torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
        torch.cuda.synchronize()
    return op, op(Q, K, V).detach(), grads


def steady(fn, calls: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def case_args(rounds: int = 15) -> argparse.ArgumentParser:
    """The arguments every probe of this kind takes: ``--case dtype,N,d,causal``, ``--rounds``,
    ``--steady`` (back-to-back calls per timing), ``--bh``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="f16,4096,128,0", help="dtype,N,d,causal")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steady", type=int, default=10)
    ap.add_argument("--bh", type=int, default=32)
    return ap


def case_tensors(args):
    """``(causal, Q, K, V, dO, want)`` of ``args.case``: random inputs (Q, K, V requiring grad),
    and the float64 (O, dQ, dK, dV) every form is checked against before it is timed."""
    torch._dynamo.config.cache_size_limit = 256   # FlexAttention stays compiled across shapes
    dt, N, D, c = args.case.split(",")
    N, D, causal = int(N), int(D), bool(int(c))
    g = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V, dO = (torch.randn(args.bh, N, D, device="cuda", generator=g).to(DTYPES[dt]) for _ in range(4))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    return causal, Q, K, V, dO, reference(Q.detach(), K.detach(), V.detach(), dO, causal)


def flex_call(Q, K, V, dO, causal: bool, backward: bool = True):
    """FlexAttention (compiled) on the same tensors: forward + backward, or the forward alone."""
    flex, make_mask = flex_fn()
    N = Q.shape[-2]
    q4, k4, v4 = (t.detach().unsqueeze(0).requires_grad_(backward) for t in (Q, K, V))
    bm = make_mask(lambda b, h, i, j: i >= j, None, None, N, N, device="cuda") if causal else None
    if not backward:
        return lambda: flex(q4, k4, v4, block_mask=bm)
    return lambda: torch.autograd.grad(flex(q4, k4, v4, block_mask=bm), (q4, k4, v4), dO.unsqueeze(0))


def in_turns(fns: dict, args) -> dict:
    """``{name: [ms, ...]}``: ``args.rounds`` rounds, each timing every one of ``fns`` once
    (``args.steady`` back-to-back calls), after one warm-up call of each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(steady(fn, args.steady))
    return times


def main():
    ap = case_args()
    ap.add_argument("--form", action="append", default=[], help="NAME=SPEC (SPEC may be empty: the default)")
    ap.add_argument("--ncu", action="store_true", help="no timing: one call of each form and of Flex between "
                    "cudaProfilerStart and Stop, for `ncu --profile-from-start off`")
    args = ap.parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    fns, errs = {}, {}
    for form in args.form or ["default="]:
        name, spec = form.split("=", 1)
        op, O, grads = build(spec, causal, Q, K, V, dO)
        errs[name] = max(rel(a, b) for a, b in zip((O,) + grads, want))
        print(f"{name} ({spec or 'defaults'}): error against float64 {errs[name]:.2e}; {op.last_backward_path}", flush=True)
        assert errs[name] < 5e-3, (name, errs[name])
        fns[name] = (lambda op=op: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO))
    del want
    fns["FlexAttention"] = flex_call(Q, K, V, dO, causal)
    if args.ncu:    # no timing: one call of each form and of Flex for `ncu --profile-from-start off`
        return profile_once(fns)
    timed_table(fns, args, f"\n{args.case} (B*H = {args.bh}), {args.rounds} rounds in turns, {args.steady} calls each, "
                           f"median ms:")


def timed_table(fns: dict, args, title: str) -> None:
    """``fns`` timed in turns (:func:`in_turns`), then ``title`` and a row per form: its median ms
    against FlexAttention's (``fns["FlexAttention"]``), the spread, its three longest kernels (CUPTI)."""
    times = in_turns(fns, args)
    flex_ms = statistics.median(times["FlexAttention"])
    print(title)
    for name, fn in fns.items():
        ms = statistics.median(times[name])
        kernels = sorted(kernel_ms(fn, 5).values(), reverse=True)[:3]
        print(f"| {name} | {ms:.3f} | {flex_ms / ms:.2f}x Flex | spread {min(times[name]):.3f}-{max(times[name]):.3f} | "
              + " ".join(f"{v:.3f}" for v in kernels) + " |")


if __name__ == "__main__":
    main()
