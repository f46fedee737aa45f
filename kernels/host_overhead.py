"""Host time of one call of a generated kernel on torch CUDA tensors, against SDPA.

    NUMBA_ENABLE_CUDASIM=0 python kernels/host_overhead.py [--n 128] [--d 64] [--calls 2000]

Lowers attention at q = x = N, d = D (``lower``'s own self-check runs first), checks the result
of one call on torch CUDA tensors against the float64 NumPy oracle (``nc.evaluate``) and stops
if it differs, then times each way of calling it: ``--calls`` calls after ``--warmup`` calls,
``time.perf_counter`` around the loop, ``torch.cuda.synchronize`` only after it.  "host us" is
the loop's time per call (what the Python side costs while the GPU keeps up); "with sync us"
adds the wait for the queued work at the end, spread over the calls; "host us, bursts" times the
same calls in bursts of ``--burst`` with an untimed sync between them, so that a kernel slower
on the GPU than its launch on the host does not fill the launch queue and make the host wait.
After the timing the results of the fast path are checked against the oracle once more.

Rows: ``kernel(Q, K, V)`` (the packed launch after the first call), ``kernel(Q, K, V, out=O)``,
``kernel.prepare(...)()``, the general path (numba's launch, as every call was before the
packed launch: the fast path switched off on a copy of the kernel's state), and
``torch.nn.functional.scaled_dot_product_attention`` on the same data, shaped (1, 1, N, D).
Host timings move with the CPU's clock and load: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402

TOLERANCE = 2e-3   # fp32 with fast exp against float64, relative to the largest output


def check(label: str, got, want: np.ndarray) -> float:
    err = float(np.max(np.abs(got.detach().cpu().double().numpy() - want)) / max(np.max(np.abs(want)), 1e-30))
    if not err <= TOLERANCE:
        raise SystemExit(f"{label}: max relative error {err:.2e} against the float64 oracle "
                         f"exceeds {TOLERANCE:.0e}; not timing a wrong kernel")
    return err


def time_calls(fn, calls: int, warmup: int, burst: int, torch) -> tuple[float, float, float]:
    """us per call: host time over ``calls`` calls with one sync at the end, the same with that
    sync included, and host time in bursts of ``burst`` calls with an untimed sync between
    bursts (when the GPU takes longer per call than the host, the launch queue fills during a
    long loop and the first figure includes waiting for it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    bursts = 0.0
    for _ in range(max(calls // burst, 1)):
        b0 = time.perf_counter()
        for _ in range(burst):
            fn()
        bursts += time.perf_counter() - b0
        torch.cuda.synchronize()
    n_burst = max(calls // burst, 1) * burst
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6, bursts / n_burst * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128, help="q = x = N")
    ap.add_argument("--d", type=int, default=64, help="head dimension")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--burst", type=int, default=100, help="calls per burst in the third column")
    args = ap.parse_args(argv)

    import torch
    from napkin_cat.lowering import Kernel, _TorchFastPath, runtime

    if runtime.simulator_active() or not runtime.gpu_available() or not torch.cuda.is_available():
        print("host_overhead.py needs a GPU (NUMBA_ENABLE_CUDASIM=0 and torch with CUDA)")
        return 2
    q, x, d = nc.axes("q x d")
    sizes = {q: args.n, x: args.n, d: args.d}
    kernel = nc.lower(nc.library.attention(q=q, x=x, d=d).bind(sizes))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype(np.float32) for s in kernel.in_shapes]
    want = np.asarray(nc.evaluate(kernel.diagram, *(a.astype(np.float64) for a in xs)))
    Q, K, V = (torch.from_numpy(a).cuda() for a in xs)
    O = torch.empty(kernel.out_shapes[0], device="cuda")

    errors = {"first call (numba)": check("first call", kernel(Q, K, V), want)}
    errors["second call (packed)"] = check("second call", kernel(Q, K, V), want)
    if not (kernel._fast and kernel._fast.packed):
        print("note: the packed launch did not apply here; every row below is the general path")

    general = Kernel.__new__(Kernel)   # the same kernel and dispatcher, with a fast path that never applies
    general.__dict__.update(kernel.__dict__)
    general._fast = _TorchFastPath(None, kernel.in_shapes, kernel.out_shapes, Q.device, torch, kernel.dispatcher)
    errors["general path"] = check("general path", general(Q, K, V), want)

    q4, k4, v4 = (t.reshape(1, 1, *t.shape) for t in (Q, K, V))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    run = kernel.prepare(Q, K, V, out=O)
    rows = [
        ("kernel(Q, K, V)", lambda: kernel(Q, K, V)),
        ("kernel(Q, K, V, out=O)", lambda: kernel(Q, K, V, out=O)),
        ("kernel.prepare(Q, K, V, out=O)()", run),
        ("general path (numba launch)", lambda: general(Q, K, V)),
        (f"SDPA (1, 1, {args.n}, {args.d})", lambda: sdpa(q4, k4, v4)),
    ]
    results = [(label, *time_calls(fn, args.calls, args.warmup, args.burst, torch)) for label, fn in rows]

    errors["after timing (packed)"] = check("after timing", kernel(Q, K, V), want)
    run()
    errors["after timing (prepare)"] = check("prepare", O, want)

    print(f"attention q = x = {args.n}, d = {args.d}: {kernel.name}, grid {kernel.launch.grid}, "
          f"block {kernel.launch.block}, {kernel.launch.dynamic_smem_bytes} B dynamic shared memory")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.calls} calls after "
          f"{args.warmup} warm-up calls")
    print("max relative error vs float64 oracle: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    print()
    width = max(len(label) for label, *_ in results)
    print(f"{'call':<{width}}  {'host us':>8}  {'with sync us':>12}  {'host us, bursts of ' + str(args.burst):>22}")
    for label, host, synced, burst in results:
        print(f"{label:<{width}}  {host:8.1f}  {synced:12.1f}  {burst:22.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
