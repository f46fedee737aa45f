"""Probe: the warpgroup path (``planner.WGMMA``, with and without the copying warpgroup of
``lowering/producer.py``) against float64 on the GPU, over masks, biases and blocks.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/wgmma_verify.py [--n 256]

The simulator's warpgroup twin cannot tell every hardware behaviour (a causal forward with its row
fragments held in registers was right there and wrong on an H100: kernels/BENCHMARKS.md, "Fourth
session of 2026-11-24"), so each variant is lowered and run on the GPU here and its largest error
against float64 printed; a row is 'bad' past 1e-2.  The variants: dense, causal, a window of 64,
ALiBi, a pattern mask (no chunk skipped); blocks (q, threads) 64/128, 128/128, 256/256; the copying
warpgroup off and on.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner, producer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    N, D, BH = args.n, args.d, 2
    q, x, d, h = nc.axes("q x d h")
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V = (torch.randn(BH, N, D, device="cuda", generator=gen).half() for _ in range(3))
    s = (Q.double() @ K.double().transpose(1, 2)) * D ** -0.5
    i = torch.arange(N, device="cuda")

    def att(keep=None, bias=None):
        s2 = s if bias is None else s + bias
        s2 = s2 if keep is None else s2.masked_fill(~keep, float("-inf"))
        return torch.softmax(s2, -1) @ V.double()

    lower_tri = i[:, None] >= i[None, :]
    cases = {
        "dense": (dict(), att()),
        "causal": (dict(causal=True), att(lower_tri)),
        "window 64": (dict(window_size=64), att(lower_tri & (i[:, None] - i[None, :] <= 64))),
        "alibi 0.5": (dict(bias=nc.alibi(0.5)), att(bias=0.5 * (i[None, :] - i[:, None]).double())),
        "(i + j) % 3 != 0": (dict(mask=lambda b, hh, ii, jj: (ii + jj) % 3 != 0),
                             att((i[:, None] + i[None, :]) % 3 != 0)),
    }
    rows = []
    saved = planner.WGMMA, producer.SWITCH
    try:
        for name, (kw, ref) in cases.items():
            dia = nc.library.attention(q=q, x=x, d=d, heads=h, dtype=nc.f16, **kw).bind({q: N, x: N, d: D, h: BH})
            for tq, threads in ((64, 128), (128, 128), (256, 256)):
                for copying in (False, True):
                    planner.WGMMA, producer.SWITCH = True, copying
                    k = nc.lower(dia, prefetch="auto", verify=False, tiles={"q": tq, "x": 64}, threads=threads)
                    O = torch.full_like(Q, float("nan"))
                    k.prepare(Q, K, V, out=O)()
                    torch.cuda.synchronize()
                    err = (O.double() - ref).abs().amax(dim=(0, 2))
                    held = any(n.startswith("Registers: the tensor-core fragments") for n in k.notes)
                    rows.append((name, tq, threads, k.launch.block[0], held, float(err.max()), int((err > 1e-2).sum())))
                    print(rows[-1], flush=True)
    finally:
        planner.WGMMA, producer.SWITCH = saved
    print(f"\n| variant | q tile | threads | block | fragments held | max error | bad rows (of {N}) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {'yes' if r[4] else 'no'} | {r[5]:.1e} | {r[6]} |")
    bad = [r for r in rows if r[6]]
    print(f"\n{len(bad)} of {len(rows)} kernels wrong")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
