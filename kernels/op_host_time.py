"""Host time of one forward + backward through ``nc.torch_op`` (the Python call path), checked first.

    NUMBA_ENABLE_CUDASIM=0 python kernels/op_host_time.py [--n 256] [--bh 2] [--calls 200] [--profile 50]
        [--backward auto|one|two] [--dtype f16|bf16|f32] [--fp32 fma|3xtf32]

At a small size (N = 256, B*H = 2: microseconds of GPU work per kernel) the GPU keeps up with the
host, so the time per call is what the Python side costs: the forward's launch, autograd, the
backward plan lookup and its kernel launches (D = rowsum(dO O), then dK and dV, dQ: two kernels;
or one kernel adding dQ across key tiles into a zero-filled fp32 buffer), the allocations.
``--backward`` forces the form (``auto``: the cost model's choice, the one kernel at small N).  The op is the one ``kernels/bench_fwd_bwd.py`` times (fp16 unless
``--dtype``; fp32 multiplied as ``--fp32`` says; heads merged into ``h``);
O, dQ, dK and dV are compared with float64 autograd before timing.  Printed: host microseconds per
call (``time.perf_counter`` over ``--calls`` calls in bursts of 20 with an untimed sync between),
the same for SDPA, and with ``--profile`` the top functions of ``cProfile`` over that many calls
(by cumulative time, then by own time), so a slow call path names its function.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench_fwd_bwd import DTYPES, flash, reference, rel  # noqa: E402
from napkin_cat.lowering.plan import FP32_ENGINES  # noqa: E402

TOL = 4e-3


def host_us(fn, calls: int, burst: int = 20) -> float:
    """Microseconds of host time per call: bursts of ``burst`` calls, synced untimed between."""
    total = 0.0
    for _ in range(max(1, calls // burst)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(burst):
            fn()
        total += time.perf_counter() - t
    torch.cuda.synchronize()
    return total / (max(1, calls // burst) * burst) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--bh", type=int, default=2)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, help="cProfile over this many calls (0: none)")
    ap.add_argument("--backward", choices=("auto", "one", "two"), default="auto")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    ap.add_argument("--fp32", choices=FP32_ENGINES, default="fma", help="nc.torch_op(fp32=...) for --dtype f32")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V, dO = (torch.randn(args.bh, args.n, args.d, device="cuda", generator=g).to(DTYPES[args.dtype])
                   for _ in range(4))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    op = nc.torch_op(flash(args.causal), verify=False, fp32=args.fp32,
                     backward={"auto": None, "one": "one kernel", "two": "two kernels"}[args.backward])
    O = op(Q, K, V)
    grads = torch.autograd.grad(O, (Q, K, V), dO)
    want = reference(Q.detach(), K.detach(), V.detach(), dO, args.causal)
    err = max(rel(a, b) for a, b in zip((O, *grads), want))
    print(f"paths {op.last_path} / {op.last_backward_path}; max error / max |ref| {err:.2e}", flush=True)
    if not err < (TOL if args.dtype != "f32" else 1e-4):
        print("wrong result: not timed", file=sys.stderr)
        return 1

    def ours():
        torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)

    q4, k4, v4 = (t.detach().unsqueeze(0).requires_grad_() for t in (Q, K, V))

    def sdpa():
        torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=args.causal),
                            (q4, k4, v4), dO.unsqueeze(0))

    for fn in (ours, sdpa):
        host_us(fn, 20)
    rows = [("ours fwd+bwd", host_us(ours, args.calls)), ("ours fwd", host_us(lambda: op(Q, K, V), args.calls)),
            ("sdpa fwd+bwd", host_us(sdpa, args.calls))]
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            ours()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    print(f"N = {args.n}, d = {args.d}, B*H = {args.bh}, causal = {args.causal}, {args.dtype} (fp32={args.fp32}), backward "
          f"{op.last_backward_path}; {args.calls} calls")
    print(f"{'call':<14} {'host us':>9}")
    for name, us in rows:
        print(f"{name:<14} {us:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
