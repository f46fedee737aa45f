"""Probe: which forward a mask that reads data should run, measured over the data.

Masks that read data (``lowering/tabled.py``) get their block tables at each launch.  Two
forwards can read them: ``nc.lower``'s own blocks (128 rows on ``mma.sync``) and four warpgroups
of 64 rows with a copying one (256 rows, the dense forward's blocks at d = 64).  Taller tiles
keep more of a narrow mask's partial chunks; the warpgroups do more per kept chunk.  This probe
runs both (blocks given, so each is one form) over masks whose kept share moves: causal windows of each head ``(h + 1) * W`` wide
and packed documents (``cuts`` boundaries at multiples of 64), with FlexAttention's kernels in
the same run, and prints each form's kept share (its derived tables, by the cost model), the
ratio of the two shares and of the two kernel times.  Every kernel is checked against float64
first (``kernels/variants.py``'s ``flex_variant``).  GPU only; N = 4096, B * H = 32, f16; d = 64, or
``--d 128`` with that width's two forms (64 rows on ``mma.sync``, three warpgroups of 64 rows);
``--forms`` gives others (``name=rows,chunk,threads``, the first the one the ratios divide by);
``--user R,C``: the same masks reading the user's table of ``R x C`` blocks (``nc.blocked``), as ``TableChoice`` chooses for them from the chunks each form visits
(``relabel/chunk_area.py``), and a last column with ``nc.lower``'s own choice (both forms).

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/table_choice.py [--widths 32,96,256] [--cuts 3,12,40] [--d 128] [--user 256,128]
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
import variants as V  # noqa: E402

FORMS = {64: {"128 rows": ({"q": 128, "x": 64}, 128), "four warpgroups": ({"q": 256, "x": 64}, 512)},
         128: {"64 rows": ({"q": 64, "x": 64}, 128), "three warpgroups": ({"q": 192, "x": 64}, 384)}}
"""The two forms ``nc.lower`` lowers such a mask to at each head width (``lowering/tabled.py``,
``TableChoice``), forced here."""


def forms_of(specs: list[str], d: int) -> dict:
    """``name=rows,chunk,threads`` each, or the head width's two forms (:data:`FORMS`)."""
    if not specs:
        return FORMS[d]
    out = {}
    for spec in specs:
        name, nums = spec.split("=")
        rows, chunk, threads = (int(v) for v in nums.split(","))
        out[name] = ({"q": rows, "x": chunk}, threads)
    return out


def doc_ids(n: int, cuts: int, gen) -> torch.Tensor:
    """Sorted ids of ``cuts + 1`` packed documents, boundaries at random multiples of 64."""
    at = torch.sort(torch.randperm(n // 64 - 1, generator=gen)[:cuts] + 1).values * 64
    ids = torch.zeros(n, dtype=torch.int64)
    ids[at] = 1
    return torch.cumsum(ids, 0)


def _users(spec, rows, cols, H=None):
    """The mask of a case reading the user's table of ``rows x cols`` blocks (``nc.blocked``),
    the table among its tensors."""
    kw, score, mask, aux, *flex = spec
    N = V.FLEX_N
    lead = (nc.Axis("nh", H),) if H else ()
    bt = nc.aux("bt", *lead, nc.Axis("rb", -(-N // rows)), nc.Axis("cb", -(-N // cols)))
    table = nc.block_table(kw["mask"], N, N, rows, cols, aux, **({"heads": H} if H else {}))
    return (dict(mask=nc.blocked(kw["mask"], bt, rows, cols)), score, mask, {**aux, "bt": table}, *flex)


def cases(widths, cuts, user=None):
    N, H = V.FLEX_N, V.FLEX_H
    nh, n_ax = nc.Axis("nh", H), nc.Axis("n", N)
    cpu = torch.Generator().manual_seed(0)
    out = {}
    for w in widths:
        wv = torch.arange(1, H + 1, device=V.DEV, dtype=torch.float32) * w
        wq = nc.aux("wq", nh)
        m = nc.mask_mod(lambda b, h, i, j, wq=wq: (j <= i) & (i - j <= wq[h]))
        out[f"head windows (h+1) x {w}"] = (dict(mask=m), None,
                                            lambda b, h, i, j, wv=wv: (j <= i) & (i - j <= wv[h]), {"wq": wv}, {"H": H})
    for c in cuts:
        doc = doc_ids(N, c, cpu).to(V.DEV)
        dd = nc.aux("doc", n_ax)
        m = nc.mask_mod(lambda b, h, i, j, dd=dd: (dd[i] == dd[j]) & (j <= i))
        out[f"documents, {c + 1}"] = (dict(mask=m), None, lambda b, h, i, j, doc=doc: (doc[i] == doc[j]) & (j <= i),
                                      {"doc": doc.float()})
    if user:
        r, c = user
        return {f"{k}, user's table {r} x {c}": _users(v, r, c, H if "head" in k else None) for k, v in out.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="32,96,256")
    ap.add_argument("--cuts", default="3,12,40")
    ap.add_argument("--d", type=int, default=64, choices=(64, 128))
    ap.add_argument("--forms", nargs="*", default=[], help="name=rows,chunk,threads ... (default: the width's two)")
    ap.add_argument("--user", default="", help="R,C: the masks read the user's table of R x C blocks (nc.blocked)")
    args = ap.parse_args(argv)
    V.FLEX_D = args.d
    forms = forms_of(args.forms, args.d)
    gen = torch.Generator(device=V.DEV).manual_seed(0)
    print(torch.cuda.get_device_name(0), torch.__version__, f"d={args.d}", flush=True)
    rows = []
    specs = cases([int(w) for w in args.widths.split(",") if w], [int(c) for c in args.cuts.split(",") if c],
                  tuple(int(v) for v in args.user.split(",")) if args.user else None)
    for name, spec in specs.items():
        got = {}
        for form, (tiles, threads) in forms.items():
            r = V.flex_variant(name, spec, gen, tiles=tiles, dt="f16", threads=threads, prefetch="auto")
            got[form] = r
            print(name, form, {k: r[k] for k in ("kept_share", "kernel_ms", "flex_kernel_ms", "rel_err", "threads")},
                  flush=True)
        if args.user:   # nc.lower's own: both forms, the one these tables visit less on chosen at the call
            r = V.flex_variant(name, spec, gen, dt="f16")
            got["nc.lower's choice"] = r
            print(name, "choice", {k: r[k] for k in ("forms", "tiles", "kernel_ms", "rel_err", "ms")}, flush=True)
        rows.append((name, got))
    a, *others = [f for f in forms] + (["nc.lower's choice"] if args.user else [])
    head = " | ".join(f"kept, ratio, ms, time ratio ({b})" for b in others)
    print(f"\n| mask | kept ({a}) | kernel ms ({a}) | {head} | Flex kernel ms | err |")
    print("|---|---|---|" + "---|" * len(others) + "---|---|")
    for name, got in rows:
        ra = got[a]
        cols = " | ".join(f"{got[b]['kept_share']:.3f}, {got[b]['kept_share'] / ra['kept_share']:.3f}, "
                          f"{got[b]['kernel_ms']:.3f}, {got[b]['kernel_ms'] / ra['kernel_ms']:.3f}" for b in others)
        err = max(r["rel_err"] for r in got.values())
        print(f"| {name} | {ra['kept_share']:.3f} | {ra['kernel_ms']:.3f} | {cols} | {ra['flex_kernel_ms']:.3f} | {err:.0e} |")


if __name__ == "__main__":
    main()
