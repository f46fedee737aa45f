"""Probe: each part of ``nc.torch_op``'s attention backward lowered under a form (tunables of
``napkin_cat.lowering``, ``prefetch=...``) and self-checked on the GPU, one process per form.

For a backward that ``nc.lower``'s self-check refuses on the GPU but not in the simulator, this
names the part and the form that differ (``--dump``: and saves the refused run): every part of the chosen backward form (``--backward``)
is lowered with ``verify=True`` on the inputs its forward would give it
(``backward_forms.residual_inputs``) and the first line of a refusal is printed, with the
part's blocks and whether it multiplies on warpgroups.  A table is printed last.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/backward_parts_check.py --groups 2 \\
        --form default= --form nodouble=prefetch=none --form mma=WGMMA=0
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))


def check_form(name: str, spec: str, groups: int, n: int, dim: int, dtype: str, backward: str,
               causal: bool, dump: Path | None = None) -> list[tuple]:
    import torch
    import napkin_cat as nc
    from bench_fwd_bwd import DTYPES, flash, switch_value
    from napkin_cat.lowering.backward_forms import residual_inputs
    from probes.op_forms import parse_form
    prefetch, items, home, tiles = parse_form(spec)
    for k, v in items.items():   # this process builds this form only: nothing to restore
        setattr(home[k], k, switch_value(getattr(home[k], k), v))
    op = nc.torch_op(flash(causal, groups), prefetch=prefetch, backward=backward, tiles=tiles or None)
    sizes = {"q": n, "x": n, "d": dim, "h": 2, **({"g": groups} if groups > 1 else {})}
    device = torch.device("cuda") if torch.cuda.is_available() else None   # None: the simulator (a smoke test)
    plan = op.backward_plan((0, 1, 2), tuple(sorted(sizes.items())), DTYPES[dtype], device)
    rows = []
    for i, part in enumerate(plan.parts):
        head = (name, i, part._sched_str())
        try:
            k = nc.lower(part, tiles=op._tiles(part), threads=op.threads, verify=True, prefetch=op.prefetch,
                         fp32=op._fp32(part), check_inputs=residual_inputs(plan, part))
            rows.append(head + ("ok", f"{k.launch.block[0]} threads, grid {k.launch.grid[0]}",
                                "wgmma" if "wgmma_" in k.source else "mma.sync" if "mma_" in k.source else "fma"))
        except nc.NapkinError as e:
            found = next((c.counterexample for c in (e, e.__cause__, e.__context__)
                          if "regime" in (getattr(c, "counterexample", None) or {})), None)
            if dump and found:
                save_case(dump / f"{name}_part{i}.npz", op, plan, part, found["regime"], found["seed"])
            lines = str(e).splitlines()
            first = next((ln.strip() for ln in lines if ln.strip().startswith("first difference")), "")
            regime = lines[0][lines[0].find("(regime"):].split(")")[0] + ")" if "(regime" in lines[0] else ""
            rows.append(head + ("REFUSED", regime or lines[0][:90], first[:200]))
    return rows


def save_case(path: Path, op, plan, part, regime: str, seed: int) -> None:
    """The refused self-check run again outside ``lower``: its inputs (as the forward gives them)
    and what the kernel, lowered the same way without the check, writes: ``in_<name>``,
    ``out_<name>`` arrays in ``path`` (npz), for the analysis off the GPU."""
    import numpy as np
    import napkin_cat as nc
    from napkin_cat.lowering.backward_forms import residual_inputs
    from napkin_cat.verify.data import REGIMES
    from napkin_cat.verify.kernelcheck import as_kernel_inputs, run_kernel
    kernel = nc.lower(part, tiles=op._tiles(part), threads=op.threads, verify=False, prefetch=op.prefetch,
                      fp32=op._fp32(part))
    inputs = [np.asarray(v, np.float64) for v in residual_inputs(plan, part)(np.random.default_rng(seed),
                                                                             REGIMES[regime][0])]
    x32 = as_kernel_inputs(inputs, kernel.diagram.dom)
    got = run_kernel(kernel, x32)
    np.savez(path, **{f"in_{a.name}": np.asarray(v) for a, v in zip(kernel.diagram.dom, x32)},
             **{f"out_{a.name}": np.asarray(v) for a, v in zip(kernel.diagram.cod, got)})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=320)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--dump", default="", help="a folder: each refused part's inputs and kernel outputs (npz)")
    ap.add_argument("--backward", default="two kernels", choices=("one kernel", "two kernels"))
    ap.add_argument("--form", action="append", default=[], help="NAME=SPEC (SPEC may be empty: the default)")
    args = ap.parse_args()
    forms = [f.split("=", 1) for f in (args.form or ["default="])]
    with ProcessPoolExecutor(max_workers=len(forms), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(check_form, name, spec, args.groups, args.n, args.d, args.dtype, args.backward,
                               bool(args.causal), Path(args.dump) if args.dump else None) for name, spec in forms]
        rows = [r for f in futures for r in f.result()]
    print(f"\n| form (groups {args.groups}, N = {args.n}, d = {args.d}, {args.dtype}, {args.backward}"
          f"{', causal' if args.causal else ''}) | part | "
          "schedule | verdict | kernel | engine or first difference |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
