"""16-bit attention forwards on adversarial data, on a real GPU: huge logits included.

    NUMBA_ENABLE_CUDASIM=0 python kernels/verify_huge_gpu.py [--n 1024] [--seeds 2]

A known gap (docs/NAN_POLICY.md, "16-bit forwards on a GPU past |s| ~ 1e8"): the forwards write
their weights ``exp2(s c log2 e - m log2 e)``, which the GPU compiler contracts into one fused
multiply-add (the simulator never does).  That keeps the product's rounding, half an ulp of the
shift: past |s| ~ 1e8 the largest weight of a row reaches 2**16 and more and its f16 copy
overflows (-inf and NaN rows; found 2026-12-01 by ``nc.check_equivalent`` on an H200).  Each case
is lowered as ``nc.lower`` chooses on this GPU (every form of a choice made at launch:
``lowering/tabled.py``) and compared with the NumPy float64 oracle (``kernelcheck.kernel_outcome``,
the check ``nc.lower`` runs) on each regime of ``napkin_cat.verify.data.REGIMES`` named below,
``--seeds`` seeds each.  The last thing printed is a table; a row is ``bad`` where any check
failed, naming the regimes.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.verify.data import REGIMES  # noqa: E402
from napkin_cat.verify.kernelcheck import describe_failure, kernel_outcome  # noqa: E402

q, x, d, h = nc.axes("q x d h")
HEADS = 4
CHECKED = ("normal", "jumps", "huge", "huge_one_sign")


def _head_windows(n):
    wq = nc.aux("wq", nc.Axis("nh", HEADS))
    return nc.mask_mod(lambda b, hh, i, j: (j <= i) & (i - j <= wq[hh]))


def _documents(n):
    doc = nc.aux("doc", nc.Axis("n", n))
    return nc.mask_mod(lambda b, hh, i, j: (doc[i] == doc[j]) & (j <= i))


CASES = [  # (label, attention keywords as a function of N, head width)
    ("dense", lambda n: {}, 64),
    ("dense", lambda n: {}, 128),
    ("causal", lambda n: {"causal": True}, 64),
    ("causal", lambda n: {"causal": True}, 128),
    ("window 300", lambda n: {"mask": nc.window(300, 0)}, 64),
    ("soft-cap 20, causal", lambda n: {"softcap": 20.0, "causal": True}, 64),
    ("windows of each head", lambda n: {"mask": _head_windows(n)}, 64),
    ("documents", lambda n: {"mask": _documents(n)}, 64),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16"))
    args = ap.parse_args(argv)
    dt = {"f16": nc.f16, "bf16": nc.bf16}[args.dtype]
    rows = []
    for label, kw, width in CASES:
        dia = nc.library.attention(q=q, x=x, d=d, heads=h, dtype=dt, **kw(args.n)).bind(
            {q: args.n, x: args.n, d: width, h: HEADS})
        kernel = nc.lower(dia, prefetch="auto", verify=False)
        for n, form in enumerate(getattr(kernel, "forms", (kernel,))):
            blocks = ", ".join(f"{r.op}({r.axis}, {r.size})" for r in form.diagram.schedule if r.op in ("tile", "stream"))
            failed = []
            for regime in CHECKED:
                for seed in range(args.seeds):
                    rng = np.random.default_rng(seed)
                    ins = [REGIMES[regime][0](rng, tuple(a.size for a in arr.axes)) for arr in dia.dom]
                    out = kernel_outcome(dia, form, ins)
                    if out.failure is not None:
                        failed.append(f"{regime} seed {seed}")
                        print(f"{label} d={width} form {n + 1}: {regime} seed {seed}: {describe_failure(out.failure)[:240]}",
                              flush=True)
            threads = form.launch.block[0] if hasattr(form, "launch") else form.inner.launch.block[0]
            rows.append((label, width, n + 1, blocks, threads, len(CHECKED) * args.seeds, failed))
            print(rows[-1], flush=True)
    print(f"\n| case | d | form | blocks | threads a block | checks | result |\n|---|---|---|---|---|---|---|")
    for label, width, n, blocks, threads, checks, failed in rows:
        print(f"| {label} | {width} | {n} | {blocks} | {threads} | {checks} | "
              f"{'ok' if not failed else 'bad: ' + '; '.join(failed)} |")


if __name__ == "__main__":
    main()
