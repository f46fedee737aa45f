"""Probe: index functions with their integer arithmetic in float32 (exact: ``emit_kinds.exact_floats``)
against the same kernels with it in int64 (``emit_kinds.EXACT_FLOATS = False``), in one run.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/index_floats.py [--variants relative_bias,alibi_per_head]

f16, the variant table's sizes and tiles (``kernels/variants.py``: N = 4096, d = 64, B*H = 32, q 128 x
chunks of 64, 4 warps, prefetch auto). Each kernel is checked first against float64 from
FlexAttention's functions on 128 rows of 2 heads, then timed: CUDA events (median) and its
kernel time alone (CUPTI).  Prints a table last.
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
from napkin_cat.lowering import emit_kinds  # noqa: E402
from bench import cuda_time, device_ms, rel_err  # noqa: E402
from variants import FLEX_B, FLEX_D, FLEX_H, FLEX_N, FLEX_TILES, _flex_reference, flex_variants  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="relative_bias,alibi_per_head,sliding_window")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = flex_variants(gen)
    tiles, threads, prefetch = FLEX_TILES["f16"]
    N, D, B, H = FLEX_N, FLEX_D, FLEX_B, FLEX_H
    Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=gen).half() for _ in range(3))
    rows = torch.randperm(N, device="cuda", generator=gen)[:128].sort().values
    out = []
    for name in args.variants.split(","):
        kw, score, mask, aux = specs[name]
        q, x, d, h, b = nc.axes("q x d h b")
        dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, dtype=nc.f16, **kw).bind(
            {q: N, x: N, d: D, h: H, b: B})
        extra = [aux[a.name].to(torch.float16).contiguous() for a in dia.dom[3:]]
        ref = _flex_reference(Q, K, V, score, mask, rows, 2)
        for exact in (True, False):
            emit_kinds.EXACT_FLOATS = exact
            try:
                kernel = nc.lower(dia, tiles=tiles, threads=threads, prefetch=prefetch, verify=False)
            finally:
                emit_kinds.EXACT_FLOATS = True
            assert ("f_row" in kernel.source) == exact
            O = torch.full_like(Q, float("nan"))
            run = kernel.prepare(Q, K, V, *extra, out=O)
            run()
            torch.cuda.synchronize()
            err = rel_err(O[:, :2, rows], ref)
            assert err < 1e-2 and not torch.isnan(O).any(), (name, exact, err)
            out.append((name, "float32" if exact else "int64", kernel.compiled_info().get("registers"),
                        cuda_time(run), device_ms(run), err))
            print(out[-1], flush=True)
    print("| variant | index arithmetic | registers | ms (events) | kernel ms | err |")
    print("|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.0e} |")


if __name__ == "__main__":
    main()
