"""The FlashAttention-2 backward generated from residuals, two ways, timed against SDPA fp32.

    NUMBA_ENABLE_CUDASIM=0 python kernels/bench_backward.py [--sizes 1024,4096] [--out DIR]

Forward with its logsumexp (``attention(heads=h, logsumexp=True)`` streamed over keys, tiled over
queries), then the backward diagrams of ``nc.grad_with_residuals`` in two final forms:

* **two kernels**: (dK, dV) with keys tiled and queries streamed, then dQ with queries tiled and
  keys streamed (S and dP recomputed in both: 14 d q x tensor FLOPs);
* **one kernel**: keys tiled with ``partial="sum"``, queries streamed: dK, dV accumulate in
  registers, each block adds its partial dQ into a zero-filled fp32 output with atomics
  (10 d q x tensor FLOPs).

Block sizes chosen by ``nc.lower``.  Every gradient is checked against torch autograd in float64
on the same data before the table is printed; times are medians of CUDA events over 10 runs;
the cost model's prediction (``nc.cost(...).time(hw, {}).seconds`` at the chosen blocks, H100 / H200 profile)
is printed beside each measurement.  fp32, H = 16 heads, d = 64.  ``backward.json`` under
``--out`` has every field.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402

q, x, d, h = nc.axes("q x d h")


def ev(fn, reps=10):
    fn(); torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def predicted_ms(kernel, hw) -> float:
    """The cost model's time for the kernel's relabelled diagram (its blocks bound)."""
    return float(nc.cost(kernel.diagram).time(hw, {}).seconds) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--out", default=str(Path(__file__).parent))
    args = ap.parse_args(argv)
    hw = nc.hardware.H200 if "H200" in torch.cuda.get_device_name() else nc.hardware.H100
    rows, res = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for N in (int(n) for n in args.sizes.split(",")):
        H, D = 16, 64
        fwd = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True)
        S = {q: N, x: N, d: D, h: H}
        check = N <= 1024
        kf = nc.lower(fwd.stream(x, "s_x").tile(q, "g_q").tile(h, 1).bind(S), verify=check)
        kkv = nc.lower(nc.grad_with_residuals(fwd, wrt=["K", "V"]).tile(x, "g_x").stream(q, "s_q").tile(h, 1).bind(S),
                       verify=check)
        kq = nc.lower(nc.grad_with_residuals(fwd, wrt=["Q"]).tile(q, "g_q").stream(x, "s_x").tile(h, 1).bind(S),
                      verify=check)
        k1 = nc.lower(nc.grad_with_residuals(fwd, wrt=["Q", "K", "V"]).tile(x, "g_x", partial="sum")
                      .stream(q, "s_q").tile(h, 1).bind(S), verify=check)
        Q, K, V, dO = (torch.randn(H, N, D, device="cuda") for _ in range(4))
        O, L = kf(Q, K, V)
        t_f = ev(lambda: kf(Q, K, V))
        t_kv, t_q = ev(lambda: kkv(Q, K, V, O, L, dO)), ev(lambda: kq(Q, K, V, O, L, dO))
        t_1 = ev(lambda: k1(Q, K, V, O, L, dO))
        # gradients against torch autograd in float64 at this size
        Qd, Kd, Vd = (t.double().requires_grad_() for t in (Q, K, V))
        ref = torch.softmax(Qd @ Kd.transpose(1, 2) / D ** 0.5, -1) @ Vd
        ref.backward(dO.double())
        dK, dV = kkv(Q, K, V, O, L, dO)
        dQ = kq(Q, K, V, O, L, dO)
        dQ1, dK1, dV1 = k1(Q, K, V, O, L, dO)
        rel = lambda a, b: float((a.double() - b.grad).abs().max() / b.grad.abs().max())  # noqa: E731
        err2 = max(rel(a, b) for a, b in ((dQ, Qd), (dK, Kd), (dV, Vd)))
        err1 = max(rel(a, b) for a, b in ((dQ1, Qd), (dK1, Kd), (dV1, Vd)))
        q4, k4, v4 = (t.unsqueeze(0).requires_grad_() for t in (Q, K, V))

        def sdpa():
            o = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4)
            o.backward(dO.unsqueeze(0))
        t_s = ev(sdpa)
        case = {"N": N, "H": H, "d": D, "forward_ms": t_f, "dkdv_ms": t_kv, "dq_ms": t_q, "two_kernels_ms": t_kv + t_q,
                "one_kernel_ms": t_1, "sdpa_fwd_bwd_ms": t_s, "err_two": err2, "err_one": err1,
                "predicted_two_ms": predicted_ms(kkv, hw) + predicted_ms(kq, hw), "predicted_one_ms": predicted_ms(k1, hw),
                "grid_kv": kkv.launch.grid, "grid_q": kq.launch.grid, "grid_one": k1.launch.grid,
                "schedule_one": k1.diagram._sched_str(), "schedule_kv": kkv.diagram._sched_str(),
                "schedule_q": kq.diagram._sched_str()}
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
        rows.append(case)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "backward.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"\n{res['device']}, fp32, H=16, d=64 (ms; predicted by nc.cost in brackets)")
    print("| N | forward (O, L) | two kernels: dK,dV + dQ | one kernel (dQ atomics) | SDPA fwd+bwd | max rel err two / one |")
    print("|---|---|---|---|---|---|")
    for c in rows:
        print(f"| {c['N']} | {c['forward_ms']:.3f} | {c['dkdv_ms']:.3f} + {c['dq_ms']:.3f} = {c['two_kernels_ms']:.3f} "
              f"[{c['predicted_two_ms']:.3f}] | {c['one_kernel_ms']:.3f} [{c['predicted_one_ms']:.3f}] | "
              f"{c['sdpa_fwd_bwd_ms']:.3f} | {c['err_two']:.1e} / {c['err_one']:.1e} |")


if __name__ == "__main__":
    main()
