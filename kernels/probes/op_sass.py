"""Probe: the SASS and the generated source of the kernels ``nc.torch_op`` compiles for the causal
document mask (``doc[i] == doc[j]`` and ``j <= i``), after one call, for reading what the GPU runs
(``dispatcher.inspect_sass()``, which needs ``nvdisasm``).  Writes ``<out>/d<D>_<k>.sass`` and
``.py`` for each kernel found in the op's cache.  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/op_sass.py [--d 128,64] [--out $OUT]
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


def kernels_of(op) -> list:
    """The compiled kernels in ``op``'s cache (a derived table's kernel, its forms' inner kernels)."""
    found, seen = [], set()

    def walk(obj, depth=0):
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        if hasattr(obj, "source") and hasattr(obj, "dispatcher"):
            found.append(obj)
        for name in ("inner", "forms"):
            for it in (lambda v: v if isinstance(v, (list, tuple)) else [v])(getattr(obj, name, None)):
                if it is not None:
                    walk(it, depth + 1)
    for value in op._cache.values():
        walk(value)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    q, x, d, h = nc.axes("q x d h")
    dd = nc.aux("doc", nc.Axis("n", args.n))
    mask = nc.mask_mod(lambda b, hh, i, j: (dd[i] == dd[j]) & (j <= i))
    gen = torch.Generator().manual_seed(0)
    for D in (int(v) for v in args.d.split(",")):
        att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=mask)
        op = nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1), verify=False)
        Q, K, V = (torch.randn(32, args.n, D, generator=gen).to("cuda", torch.float16) for _ in range(3))
        ids = torch.cumsum((torch.rand(args.n, generator=gen) < 0.003).long(), 0).float().cuda()
        op(Q, K, V, ids)
        torch.cuda.synchronize()
        for k, kernel in enumerate(kernels_of(op)):
            sass = kernel.dispatcher.inspect_sass()
            sass = sass if isinstance(sass, str) else "\n".join(sass.values())
            Path(args.out, f"d{D}_{k}.sass").write_text(sass)
            Path(args.out, f"d{D}_{k}.py").write_text(kernel.source)
            print(f"d={D}: kernel {k} ({type(kernel).__name__}): {sass.count('FSETP')} FSETP, "
                  f"{sass.count('HGMMA')} HGMMA in its SASS", flush=True)


if __name__ == "__main__":
    main()
