"""``napkin demo``: the whole pipeline on the library diagrams, in one run.

Build, print, draw and evaluate every library diagram; derive FlashAttention and verify each
step; cost it; lower it and run it (on a GPU, or in the CUDA simulator on tiny shapes).
"""

from __future__ import annotations

import time
from pathlib import Path


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def demo(out: Path) -> int:
    import numpy as np

    import napkin_cat as nc

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    q, x, d, h = nc.axes("q x d h")

    _section("1. diagrams: build, print, draw, evaluate (NumPy semantics, float64)")
    lib = {
        "matmul": nc.library.matmul(),
        "batched_matmul": nc.library.batched_matmul(),
        "linear": nc.library.linear(),
        "mlp": nc.library.mlp(),
        "softmax": nc.library.softmax(),
        "layernorm": nc.library.layernorm(),
        "rmsnorm": nc.library.rmsnorm(),
        "attention": nc.library.attention(q=q, x=x, d=d),
        "causal_attention": nc.library.attention(q=q, x=x, d=d, causal=True),
        "multihead_attention": nc.library.attention(q=q, x=x, d=d, heads=h),
        "l2_attention": nc.library.normalized_attention(q=q, x=x, d=d),
    }
    for name, dia in lib.items():
        sizes = {a.name: int(rng.integers(2, 9)) for a in dia.axes}
        args = [rng.standard_normal(tuple(sizes[a] for a in arr.axis_names)) for arr in dia.dom]
        res = nc.evaluate(dia, *args, sizes=sizes)
        path = out / f"{name}.png"
        dia.draw(str(path))
        print(f"{name:<20} {str(dia):<70} -> shape {np.shape(res)}  drawn: {path}")

    _section("2. a type error names both sides")
    try:
        lib["attention"] >> lib["matmul"]
    except nc.NapkinError as e:
        print(e)

    _section("3. derive FlashAttention: stream keys, tile queries; every step verified")
    attn = lib["attention"]
    der = nc.derive(attn, [("stream", x), ("tile", q)])
    for step in der.steps:
        print(f"{step.name:<8} {str(step.args):<28} verified={step.verified}")
    flash = der.final
    print(flash.loop_nest())
    try:
        nc.library.softmax().stream("c", 4)
    except nc.RelabelError as e:
        print("refused:", e)

    _section("4. cost read off the relabelled diagram")
    c = nc.cost(flash)
    print("HBM transfers (values):", c.transfers["HBM"])
    print("SMEM memory   (values):", c.memory["SMEM"])
    best = c.optimize(sizes={q: 8192, x: 8192, d: 128}, hw=nc.hardware.H100, dtype=nc.f16)
    print("H100, fp16, q = x = 8192, d = 128:", best)

    _section("5. lower to numba.cuda and run")
    from .lowering.runtime import gpu_available
    n = 512 if gpu_available() else 9
    dn = 64 if gpu_available() else 4
    small = flash.bind({q: n, x: n + 3, d: dn, "g_q": 64 if gpu_available() else 4,
                        "s_x": 32 if gpu_available() else 3})
    kernel = nc.lower(small, target="numba.cuda")
    print("\n".join(kernel.source.splitlines()[:30]) + "\n    ...")
    Q, K, V = (rng.standard_normal((n, dn)), rng.standard_normal((n + 3, dn)), rng.standard_normal((n + 3, dn)))
    t0 = time.perf_counter()
    O = kernel(Q.astype(np.float32), K.astype(np.float32), V.astype(np.float32))
    ref = nc.evaluate(attn, Q, K, V)
    err = float(np.abs(O - ref).max() / np.abs(ref).max())
    where = "GPU" if gpu_available() else "CUDA simulator"
    print(f"ran on the {where} in {time.perf_counter() - t0:.2f} s; max rel. error vs NumPy {err:.2e}")
    return 0 if err < 1e-4 else 1
