"""The generated forward and backward kernels of ``nc.torch_op`` against float64 autograd of the
oracle on a real GPU, over attention variants and 16-bit dtypes.

    NUMBA_ENABLE_CUDASIM=0 python kernels/verify_backward_gpu.py [--n 320] [--d 64] [--backward auto|one|two]

Each variant (dense, causal, a window, ALiBi, grouped-query heads, d_v != d, a soft-cap, and
index functions: block-causal, prefix-LM, NATTEN, a relative bias, GQA with a window) is built
with ``nc.library.attention`` on heads, relabelled as ``nc.torch_op`` is used
(``stream(x).tile(q).tile(h, 1)``), run on CUDA tensors (fp16 and bf16; ``N`` not a multiple of the
blocks, so tiles are ragged), and O, dQ, dK, dV are compared with ``nc.to_torch`` of the same
diagram under float64 autograd on the same (rounded) inputs: the largest error over the largest
value of each.  Also printed: the backward's path and which kernels multiply by warpgroups
(``wgmma``), since the simulator cannot tell every hardware behaviour of that path.  A row is
``bad`` past 2e-2.  The last thing printed is a table.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402

TOL = 2e-2


def variants():
    q, x, d, h, g, g4, e = nc.axes("q x d h g g4 e")     # g4: four groups (SIZES)
    L = nc.library
    base = dict(q=q, x=x, d=d, heads=h)
    return {
        "dense": L.attention(**base),
        "causal": L.attention(**base, causal=True),
        "window 48": L.attention(**base, window_size=48),
        "ALiBi": L.attention(**base, bias=nc.alibi(0.25)),
        "GQA (2 groups)": L.attention(q=q, x=x, d=d, heads=h, groups=g, causal=True),
        "d_v = 32": L.attention(**base, dv=e),
        "soft-cap 20": L.attention(**base, softcap=20.0),
        # index functions (issue 11): tiles skipped from the definition, score modifications
        "block-causal 64": L.attention(**base, mask=nc.mask_mod(lambda b, h, i, j: i // 64 >= j // 64)),
        "prefix-LM 100": L.attention(**base, mask=nc.mask_mod(lambda b, h, i, j: (j <= i) | (j < 100))),
        "NATTEN radius 2": L.attention(**base, mask=nc.mask_mod(
            lambda b, h, i, j: (abs(i // 16 - j // 16) <= 2) & (abs(i % 16 - j % 16) <= 2))),
        "relative bias": L.attention(**base, score_mod=nc.score_mod(lambda s, b, h, i, j: s + (i - j) * 0.01)),
        "GQA (4 groups) window 48": L.attention(q=q, x=x, d=d, heads=h, groups=g4, window_size=48),
    }


def relabelled(dia):
    out = dia.stream("x", "s_x").tile("q", "g_q")
    return out.tile("h", 1) if "h" in {a.name for a in dia.axes} else out


DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
SIZES = {"h": 2, "g": 2, "g4": 4, "e": 32}
"""Every variant's sizes beside ``q = x = --n`` and ``d = --d``, by axis name."""


def check(name: str, dtype: str, n: int, dim: int, backward: str | None = None) -> tuple:
    """One variant at one dtype: (variant, dtype, verdict, largest error, backward path, kernels
    on wgmma), and the error of each output."""
    dia, dt = variants()[name], DTYPES[dtype]
    sizes = {"q": n, "x": n, "d": dim, **SIZES}
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(*(sizes[a.name] for a in arr.axes), device="cuda", generator=gen).to(dt)
               .requires_grad_() for arr in dia.dom]
    op = nc.torch_op(relabelled(dia), backward=backward)
    try:
        out = op(*tensors)
        cot = torch.randn(out.shape, device="cuda", generator=gen).to(dt)
        got = torch.autograd.grad(out, tensors, cot)
    except nc.NapkinError as err:
        lines = str(err).splitlines()
        why = [ln.strip() for ln in lines if ln.strip().startswith(("kernel:", "first difference"))]
        return (name, dtype, "refused", lines[0][:100], "", ""), {"refusal": " / ".join([lines[0]] + why)[:1500]}
    ts = [t.detach().cpu().double().requires_grad_() for t in tensors]
    want_out = nc.to_torch(op.diagram)(*ts)
    want = torch.autograd.grad(want_out, ts, cot.cpu().double())
    outs = {"O": out, **{f"d{a.name}": g for a, g in zip(op.diagram.dom, got)}}
    refs = {"O": want_out, **{f"d{a.name}": w for a, w in zip(op.diagram.dom, want)}}
    err = {k: float((outs[k].detach().cpu().double() - refs[k]).abs().max() / refs[k].abs().max()) for k in outs}
    worst = max(err.values())
    built = [k for k in op._cache.values() if hasattr(k, "source") and hasattr(k, "diagram")]
    wg = sorted({"+".join(a.name for a in k.diagram.cod) for k in built if "wgmma_" in k.source})
    return (name, dtype, "ok" if worst < TOL else "bad", f"{worst:.1e}", op.last_backward_path,
            ", ".join(wg) or "-"), err


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=320)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtypes", default="f16,bf16")
    ap.add_argument("--only", default="", help="comma list of variant names (default: all)")
    ap.add_argument("--backward", choices=("auto", "one", "two"), default="auto",
                    help="the backward's form (nc.torch_op(backward=...)): the cost model's, one kernel or two")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes (each compiles its own kernels: the compiles run side by side)")
    args = ap.parse_args()
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing
    cases = [(name, dt) for name in variants() for dt in args.dtypes.split(",")
             if not args.only or name in args.only.split(",")]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        form = {"auto": None, "one": "one kernel", "two": "two kernels"}[args.backward]
        futures = [pool.submit(check, name, dt, args.n, args.d, form) for name, dt in cases]
        rows = []
        for f in futures:
            row, err = f.result()
            rows.append(row)
            print(row, err, flush=True)
    print(f"| variant (N = {args.n}, d = {args.d}, 2 heads) | dtype | verdict | largest error | backward path | "
          f"kernels on wgmma |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    return 1 if any(r[2] == "bad" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
