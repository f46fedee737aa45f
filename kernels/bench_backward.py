"""The FlashAttention-2 backward generated from residuals, timed against SDPA fp32 (forward + backward).

    NUMBA_ENABLE_CUDASIM=0 python kernels/bench_backward.py

Forward with its logsumexp (``attention(heads=h, logsumexp=True)`` streamed over keys, tiled over
queries), then the two backward diagrams of ``nc.grad_with_residuals``: (dK, dV) with keys tiled
and queries streamed, dQ with queries tiled and keys streamed; block sizes chosen by ``nc.lower``.
Every gradient is checked against torch autograd in float64 on the same data before the table is
printed; times are medians of CUDA events over 10 runs.  fp32, H = 16 heads, d = 64.
"""
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

rows = []
for N in (1024, 4096):
    H, D = 16, 64
    fwd = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True)
    S = {q: N, x: N, d: D, h: H}
    kf = nc.lower(fwd.stream(x, "s_x").tile(q, "g_q").tile(h, 1).bind(S), verify=(N == 1024))
    kkv = nc.lower(nc.grad_with_residuals(fwd, wrt=["K", "V"]).tile(x, "g_x").stream(q, "s_q").tile(h, 1).bind(S), verify=(N == 1024))
    kq = nc.lower(nc.grad_with_residuals(fwd, wrt=["Q"]).tile(q, "g_q").stream(x, "s_x").tile(h, 1).bind(S), verify=(N == 1024))
    Q, K, V, dO = (torch.randn(H, N, D, device="cuda") for _ in range(4))
    O, L = kf(Q, K, V)
    t_f = ev(lambda: kf(Q, K, V)); t_kv = ev(lambda: kkv(Q, K, V, O, L, dO)); t_q = ev(lambda: kq(Q, K, V, O, L, dO))
    # check against torch autograd (float64) at this size
    Qd, Kd, Vd = (t.double().requires_grad_() for t in (Q, K, V))
    ref = torch.softmax(Qd @ Kd.transpose(1, 2) / D ** 0.5, -1) @ Vd
    ref.backward(dO.double())
    dK, dV = kkv(Q, K, V, O, L, dO); dQ = kq(Q, K, V, O, L, dO)
    err = max(float((a.double() - b.grad).abs().max() / b.grad.abs().max()) for a, b in ((dQ, Qd), (dK, Kd), (dV, Vd)))
    q4, k4, v4 = (t.unsqueeze(0).requires_grad_() for t in (Q, K, V))
    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4); o.backward(dO.unsqueeze(0))
    t_s = ev(sdpa)
    rows.append((N, f"{t_f:.3f}", f"{t_kv:.3f}", f"{t_q:.3f}", f"{t_f + t_kv + t_q:.3f}", f"{t_s:.3f}", f"{err:.1e}",
                 str(kkv.launch.grid), str(kq.launch.grid)))
print("| N (H=16, d=64, fp32) | fwd ms | dK,dV ms | dQ ms | total ms | SDPA fwd+bwd ms | max rel err | grid kv | grid q |")
for r in rows:
    print("| " + " | ".join(map(str, r)) + " |")
