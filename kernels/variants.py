"""Build, check and time a few code-generator variants in one GPU call (fp32).

    python kernels/variants.py [--out DIR] [--only attention|matmul]

Each variant is (diagram, tiles, prefetch, planner switches); every kernel is checked against a
float64 reference on random inputs before it is timed, and PyTorch's SDPA / cuBLAS are timed in
the same run.  Prints a table last and writes variants.json to ``--out`` (``$OUT`` on the device).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner  # noqa: E402
from bench import cuda_time, reference_rows, rel_err  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
DEV = "cuda"
SWITCHES = ("CONTRACTION_UNROLL", "FUSE_SCORES", "REGISTER_FLOOR", "REGISTER_SLACK", "TRANSPOSE_PAD")

ATT = [  # (d, causal, tiles, prefetch, switches)
    (64, False, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8, "TRANSPOSE_PAD": 0}),
    (64, False, {"q": 256, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 256, "x": 32}, False, {"CONTRACTION_UNROLL": 4}),
    (64, False, {"q": 256, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 128, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 128, "x": 64}, "double", {"CONTRACTION_UNROLL": 8}),
    (64, True, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (64, True, {"q": 256, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (128, False, {"q": 128, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (128, False, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (128, False, {"q": 128, "x": 32}, "double", {"CONTRACTION_UNROLL": 8}),
    (128, True, {"q": 128, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
]
MM = [
    ({"a": 128, "c": 128, "b": 8}, True, {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 8}, True, {"CONTRACTION_UNROLL": 8, "REGISTER_FLOOR": 255}),
    ({"a": 128, "c": 128, "b": 8}, "double", {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 8}, False, {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 16}, "double", {"CONTRACTION_UNROLL": 8, "REGISTER_FLOOR": 255}),
    ({"a": 128, "c": 128, "b": 16}, True, {"CONTRACTION_UNROLL": 8, "REGISTER_FLOOR": 255}),
    ({"a": 128, "c": 128, "b": 16}, False, {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 8}, True, {"CONTRACTION_UNROLL": 8, "TRANSPOSE_PAD": 0}),
]


def with_switches(sw):
    old = {k: getattr(planner, k) for k in SWITCHES}
    for k, v in sw.items():
        setattr(planner, k, v)
    return old


def attention_variant(N, D, causal, BH, tiles, pf, sw, gen):
    B, H = 2, BH // 2
    q, x, d, h, b = nc.axes("q x d h b")
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=causal).bind(
        {q: N, x: N, d: D, h: H, b: B})
    old = with_switches(sw)
    try:
        kernel = nc.lower(dia, tiles=tiles, threads=256, prefetch=pf)
    finally:
        with_switches(old)
    Q, K, V = (torch.randn(B, H, N, D, device=DEV, generator=gen) for _ in range(3))
    O = torch.full_like(Q, float("nan"))
    run = kernel.prepare(Q, K, V, out=O)
    run()
    torch.cuda.synchronize()
    rows = torch.randperm(N, device=DEV, generator=gen)[:128].sort().values
    err = rel_err(O[:, :2, rows], reference_rows(Q, K, V, causal, 1 / math.sqrt(D), rows, 2))
    assert not torch.isnan(O).any()
    ms = cuda_time(run)
    flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    r = {"kind": "attention", "N": N, "d": D, "causal": causal, "tiles": tiles, "prefetch": pf,
         "switches": sw, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err,
         "smem": kernel.launch.dynamic_smem_bytes, "mappings": kernel.mappings}
    r.update(kernel.compiled_info())
    r["sdpa_ms"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal))
    return r


def matmul_variant(M, tiles, pf, sw, gen):
    a, b, c = nc.axes("a b c")
    dia = nc.library.matmul(a=a, b=b, c=c).bind({a: M, b: M, c: M})
    old = with_switches(sw)
    try:
        kernel = nc.lower(dia, tiles=tiles, threads=256, prefetch=pf)
    finally:
        with_switches(old)
    A = torch.randn(M, M, device=DEV, generator=gen)
    Bm = torch.randn(M, M, device=DEV, generator=gen)
    C = torch.full((M, M), float("nan"), device=DEV)
    run = kernel.prepare(A, Bm, out=C)
    run()
    torch.cuda.synchronize()
    rows = torch.randperm(M, device=DEV, generator=gen)[:128]
    err = rel_err(C[rows], torch.matmul(A[rows].double(), Bm.double()))
    assert not torch.isnan(C).any()
    ms = cuda_time(run)
    r = {"kind": "matmul", "N": M, "tiles": tiles, "prefetch": pf, "switches": sw, "ms": ms,
         "tflops": 2 * M ** 3 / ms / 1e9, "rel_err": err, "smem": kernel.launch.dynamic_smem_bytes,
         "mappings": kernel.mappings}
    r.update(kernel.compiled_info())
    r["cublas_ms"] = cuda_time(lambda: torch.matmul(A, Bm))
    return r


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = []
    out = Path(args.out)
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    jobs = []
    if args.only in ("", "attention"):
        jobs += [("a", (4096, D, causal, 16, t, pf, sw)) for D, causal, t, pf, sw in ATT]
    if args.only in ("", "matmul"):
        jobs += [("m", (4096, t, pf, sw)) for t, pf, sw in MM]
    for kind, job in jobs:
        t0 = time.perf_counter()
        try:
            r = attention_variant(*job, gen) if kind == "a" else matmul_variant(*job, gen)
        except Exception as e:  # noqa: BLE001
            r = {"kind": kind, "job": str(job), "error": f"{type(e).__name__}: {str(e)[:400]}"}
        r["wall_s"] = time.perf_counter() - t0
        res.append(r)
        print(json.dumps(r, default=str), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
    print("\nkind  d   c tiles                          pf      switches                   ms      TF/s  x_peer regs local err")
    for r in res:
        if "error" in r:
            print("ERR", r["job"], r["error"][:200])
            continue
        peer = r.get("sdpa_ms", r.get("cublas_ms"))
        print(f"{r['kind'][:4]:5s} {r.get('d', '-'):3} {str(r.get('causal', '-'))[0]} {str(r['tiles']):30s} {str(r['prefetch']):7s} "
              f"{str(r['switches']):26s} {r['ms']:7.3f} {r['tflops']:5.1f} {peer / r['ms']:5.2f} "
              f"{r.get('registers')} {r.get('local_bytes')} {r['rel_err']:.0e}")


if __name__ == "__main__":
    main()
