"""Probe: where a forward + backward leaves the GPU idle, ours against FlexAttention's.

Runs ``--steady`` back-to-back forward + backward calls of ``nc.torch_op`` attention (the op
``kernels/bench_fwd_bwd.py`` times) and of compiled FlexAttention under ``torch.profiler`` and
reads the GPU timeline: every kernel in launch order with its duration and the idle time before
it, summed per call into kernel time and idle time, and the host calls that wait for the GPU
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy``, ``cudaFree``...), which
would explain idle time inside a call.  The op's output is checked against float64 first.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/gpu_gaps.py --cases "f16,4096,64,0;f16,16384,64,0"
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench_fwd_bwd import DTYPES, flash, flex_fn, reference, rel  # noqa: E402

WAITS = ("Synchronize", "Memcpy", "cudaFree", "cuMemFree", "EventSynchronize", "cuCtxSynchronize",
         "cuStreamSynchronize", "cuMemcpy")


def timeline(fn, calls: int) -> dict:
    """GPU kernels of ``calls`` back-to-back calls of ``fn`` in start order, the idle time before
    each, and the host's waiting calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.device_time_total > 0 and "Memset" not in e.name and "Memcpy" not in e.name),
                 key=lambda e: e.time_range.start)
    waits = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and any(w in e.name for w in WAITS):
            waits[e.name] = waits.get(e.name, 0) + 1
    rows, busy, idle, prev_end = [], 0.0, 0.0, None
    for e in gpu:
        start, end = e.time_range.start, e.time_range.end
        gap = 0.0 if prev_end is None else max(0.0, start - prev_end)
        rows.append((e.name[:48], (end - start) / 1e3, gap / 1e3))
        busy += (end - start) / 1e3
        idle += gap / 1e3
        prev_end = max(end, prev_end or end)
    span = (gpu[-1].time_range.end - gpu[0].time_range.start) / 1e3 if gpu else 0.0
    return {"rows": rows, "busy_ms": busy / calls, "idle_ms": idle / calls, "span_ms": span / calls,
            "waits": {k: v / calls for k, v in waits.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="f16,4096,64,0;f16,16384,64,0")
    ap.add_argument("--steady", type=int, default=10)
    ap.add_argument("--bh", type=int, default=0, help="B*H (0: 32 for N <= 4096, else 16)")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    summary = []
    for spec in args.cases.split(";"):
        dt, N, D, causal = spec.split(",")
        N, D, causal = int(N), int(D), bool(int(causal))
        BH = args.bh or (32 if N <= 4096 else 16)
        g = torch.Generator(device="cuda").manual_seed(0)
        Q, K, V, dO = (torch.randn(BH, N, D, device="cuda", generator=g).to(DTYPES[dt]) for _ in range(4))
        Q, K, V = (t.requires_grad_() for t in (Q, K, V))
        op = nc.torch_op(flash(causal), verify=False)
        O = op(Q, K, V)
        grads = torch.autograd.grad(O, (Q, K, V), dO)
        want = reference(Q.detach(), K.detach(), V.detach(), dO, causal)
        err = max(rel(a, b) for a, b in zip((O,) + grads, want))
        del want, O, grads
        print(f"{spec}: B*H = {BH}, error against float64 {err:.2e}", flush=True)
        assert err < 5e-3, err
        fn, make_mask = flex_fn()
        q4, k4, v4 = (t.detach().unsqueeze(0).requires_grad_() for t in (Q, K, V))
        bm = make_mask(lambda b, h, i, j: i >= j, None, None, N, N, device="cuda") if causal else None
        peers = {"ours": lambda: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO),
                 "flex": lambda: torch.autograd.grad(fn(q4, k4, v4, block_mask=bm), (q4, k4, v4), dO.unsqueeze(0))}
        for name, f in peers.items():
            t = timeline(f, args.steady)
            per_call = len(t["rows"]) // args.steady
            print(f"  {name}: {per_call} kernels per call; one call's kernels (ms, idle before):")
            for r in t["rows"][per_call * (args.steady // 2): per_call * (args.steady // 2 + 1)]:
                print(f"    {r[0]:<48} {r[1]:8.4f} {r[2]:8.4f}")
            print(f"  {name}: waits per call {t['waits']}", flush=True)
            summary.append((spec, name, t["busy_ms"], t["idle_ms"], t["span_ms"]))
    print(f"\n{'case':<18} {'who':<5} {'kernels ms':>10} {'idle ms':>8} {'span ms':>8}   (per call, {args.steady} back to back)")
    for s in summary:
        print(f"{s[0]:<18} {s[1]:<5} {s[2]:10.3f} {s[3]:8.3f} {s[4]:8.3f}")


if __name__ == "__main__":
    main()
