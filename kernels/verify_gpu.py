"""Generated kernels against the NumPy oracle on a real GPU, at GPU sizes and thread counts.

    NUMBA_ENABLE_CUDASIM=0 python kernels/verify_gpu.py [--examples N]

Every case is lowered (``lower``'s own self-check runs first), then checked with
``nc.check_equivalent(oracle, kernel)`` on drawn data (adversarial regimes included); the
relabelled cases are also checked with ``lowered=True`` over drawn blocks, non-powers of two
included, and GPU thread counts.  The cases include the wrong kernels of issue 8 (a tile of 48 at
q = 192, d = 64; threads = 48 and 192; nested streams).  A case ``lower`` refuses prints its
LoweringError.  The last thing printed is a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import napkin_cat as nc  # noqa: E402

q, x, d, h = nc.axes("q x d h")
a, b, c = nc.axes("a b c")
L = nc.library
ATTN = L.attention(q=q, x=x, d=d)
CAUSAL = L.attention(q=q, x=x, d=d, causal=True)
GQA = L.attention(q=q, x=x, d=d, groups=nc.Axis("g", 2), heads=nc.Axis("h", 2), window_size=37)
MM = L.matmul(a=a, b=b, c=c)

# (label, oracle, relabelled, sizes, lower options)
CASES = [
    ("tile 48 at q=192", ATTN, ATTN.stream(x, 64).tile(q, 48), {q: 192, x: 256, d: 64}, {}),
    ("tile 48, threads 192", ATTN, ATTN.stream(x, 64).tile(q, 48), {q: 192, x: 256, d: 64}, {"threads": 192}),
    ("threads 48", ATTN, ATTN.stream(x, 32).tile(q, 64), {q: 192, x: 256, d: 64}, {"threads": 48}),
    ("automatic, odd sizes", ATTN, ATTN, {q: 3, x: 11, d: 3}, {}),
    ("causal, ragged", CAUSAL, CAUSAL.stream(x, 64).tile(q, 96), {q: 300, x: 300, d: 64}, {"prefetch": "double"}),
    ("gqa + window 37", GQA, GQA.stream(x, 32).tile(q, 40), {q: 130, x: 130, d: 32}, {"prefetch": True}),
    ("nested streams matmul", MM, MM.stream(b, 16).stream(a, 16), {a: 100, b: 100, c: 100}, {}),
    ("nested streams attention", ATTN, ATTN.stream(x, 64).stream(q, 32), {q: 128, x: 256, d: 64}, {}),
    ("matmul tile 96x40", MM, MM.tile(a, 96).tile(c, 40).stream(b, 8), {a: 300, b: 70, c: 130}, {}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=12)
    args = ap.parse_args(argv)
    rows, bad = [], 0
    for label, oracle, rel, sizes, opts in CASES:
        t0 = time.perf_counter()
        try:
            kernel = nc.lower(rel.bind(sizes), **opts)
        except nc.LoweringError as e:
            rows.append((label, "refused", str(e).splitlines()[0][:90], time.perf_counter() - t0))
            continue
        except nc.EquivalenceError as e:
            bad += 1
            rows.append((label, "WRONG (self-check)", str(e).splitlines()[0][:90], time.perf_counter() - t0))
            continue
        try:
            r = nc.check_equivalent(oracle, kernel, examples=args.examples)
            rows.append((label, "verified", f"{r.kernels} runs, max abs err {r.max_abs_error:.2g}, "
                         f"launch {kernel.launch.block[0]} threads", time.perf_counter() - t0))
        except nc.EquivalenceError as e:
            bad += 1
            rows.append((label, "WRONG", str(e).splitlines()[0][:90], time.perf_counter() - t0))
    for label, oracle, rel in [("flash lowered=True", ATTN, ATTN.stream(x, "s_x").tile(q, "g_q")),
                               ("causal lowered=True", CAUSAL, CAUSAL.stream(x, 16).tile(q, "g_q")),
                               ("matmul lowered=True", MM, MM.stream(b, "s_b").tile(a, "g_a").tile(c, "g_c"))]:
        t0 = time.perf_counter()
        try:
            r = nc.check_equivalent(oracle, rel, lowered=True, examples=args.examples, max_size=40)
            rows.append((label, "verified", f"{r.kernels} kernels, {len(r.refused)} refused, "
                         f"max abs err {r.max_abs_error:.2g}", time.perf_counter() - t0))
        except nc.EquivalenceError as e:
            bad += 1
            rows.append((label, "WRONG", str(e).splitlines()[0][:90], time.perf_counter() - t0))
    from napkin_cat.lowering import runtime
    print(f"\ndevice: {runtime.device_name() if hasattr(runtime, 'device_name') else 'GPU'}; "
          f"simulator: {runtime.simulator_active()}")
    print(f"| case | result | detail | s |\n|---|---|---|---|")
    for label, res, detail, s in rows:
        print(f"| {label} | {res} | {detail} | {s:.1f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
