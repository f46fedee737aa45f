"""Probe: fp32 matmul and attention forward on CUDA cores (fp32 FMAs) against the same diagrams
on tensor cores by 3xTF32 (``nc.lower(..., fp32="3xtf32")``), beside cuBLAS SGEMM (TF32 off) and SDPA fp32.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/tf32x3_matmul.py [--n 4096] [--matmul-only] [--tiles "a=128,c=128,b=32;..."]

Each kernel is lowered by ``nc.lower`` (the schedule's blocks, its self-check against float64 at
the bound sizes on), checked again here on new random inputs (max error / max |ref|, float64
reference), then timed (CUDA events, median).  Prints a table last.
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
from bench import cuda_time  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


def case(name, diagram, inputs, reference, peer, tf32x3: bool, tiles=None, prefetch=False):
    k = nc.lower(diagram, fp32="3xtf32" if tf32x3 else "fma", tiles=tiles, prefetch=prefetch)
    out = k(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    ref = reference()
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    ms = cuda_time(lambda: k(*inputs))
    peer_out = peer()
    peer_err = float((peer_out.double() - ref).abs().max() / ref.abs().max())
    return {"kernel": name, "engine": "3xTF32" if "mma_tf32x3" in k.source else "FMA", "err": err,
            "ms": ms, "peer_ms": cuda_time(peer), "peer_err": peer_err, "threads": k.launch.block[0],
            "schedule": k.schedule.diagram._sched_str()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--matmul-only", action="store_true", help="leave the attention forward out")
    ap.add_argument("--tiles", default="", help="semicolon list of matmul block choices for 3xTF32, each "
                    "a comma list axis=size over a, b, c (nc.lower(tiles=...)) and prefetch=double|auto, timed after "
                    "the schedule's")
    args = ap.parse_args()
    n = args.n
    g = torch.Generator(device="cuda").manual_seed(0)
    A, B = (torch.randn(n, n, device="cuda", generator=g) for _ in range(2))
    a, b, c = nc.axes("a b c")
    mm = nc.library.matmul(a=a, b=b, c=c).bind({a: n, b: n, c: n})
    q, x, d, h = nc.axes("q x d h")
    att = nc.library.attention(q=q, x=x, d=d, heads=h).bind({q: 4096, x: 4096, d: 64, h: 32})
    Q, K, V = (torch.randn(32, 4096, 64, device="cuda", generator=g) for _ in range(3))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(Q, K, V)  # noqa: E731
    rows = []
    for on in (False, True):
        rows.append(case(f"matmul {n}^3", mm, (A, B), lambda: A.double() @ B.double(), lambda: A @ B, on))
        print(rows[-1], flush=True)
        if args.matmul_only:
            continue
        rows.append(case("attention N=4096 d=64 BH=32", att, (Q, K, V),
                         lambda: torch.softmax(Q.double() @ K.double().transpose(1, 2) / 8.0, -1) @ V.double(),
                         sdpa, on))
        print(rows[-1], flush=True)
    for choice in filter(None, args.tiles.split(";")):
        tiles = dict(kv.split("=") for kv in choice.split(","))
        prefetch = tiles.pop("prefetch", False)
        rows.append(case(f"matmul {n}^3 {choice}", mm, (A, B), lambda: A.double() @ B.double(), lambda: A @ B,
                         True, {k: int(v) for k, v in tiles.items()}, prefetch))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; peers: cuBLAS SGEMM (TF32 off), SDPA fp32")
    print("| kernel | engine | err | ms | peer ms | peer err | vs peer | threads | blocks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['engine']} | {r['err']:.1e} | {r['ms']:.3f} | {r['peer_ms']:.3f} | "
              f"{r['peer_err']:.1e} | {r['peer_ms'] / r['ms']:.2f}x | {r['threads']} | {r['schedule']} |")


if __name__ == "__main__":
    main()
