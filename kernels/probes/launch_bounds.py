"""Probe: one more block per SM for issue 11's small masked forwards (a measurement, not the generator).

The sliding window (0.069 ms against FlexAttention's 0.064) and the block-diagonal mask (0.043
against 0.040) run 64-row tiles on 128 threads with 140 registers a thread, so the launch bounds
(``planner.blocks_per_sm``) ask for 3 blocks an SM: 2048 blocks make 5.2 waves of 396.  This
probe edits the generated kernel's ``launch_bounds`` to ask for ``--more`` blocks more (the
compiler then keeps within 65536 / (128 x blocks) registers, spilling if it must) and times it
beside the generated kernel and FlexAttention, each checked against float64 first.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/launch_bounds.py [--variants sliding_window,block_diagonal] [--more 1]
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
import variants  # noqa: E402
from probes.forward_stages import edited  # noqa: E402

BOUNDS = re.compile(r'"launch_bounds": \((\d+), (\d+)\)')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="sliding_window,block_diagonal")
    ap.add_argument("--more", type=int, default=1)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = variants.flex_variants(gen)
    lower, rows = nc.lower, []
    for name in args.variants.split(","):
        for more in (0, args.more):
            asked = {}

            def patched(*a, **k):
                kernel = lower(*a, **k)
                m = BOUNDS.search(kernel.source)
                assert m, "the generated launch bounds"
                asked["blocks"] = int(m.group(2)) + more
                return edited(kernel, BOUNDS.sub(f'"launch_bounds": ({m.group(1)}, {asked["blocks"]})', kernel.source, 1))
            nc.lower = patched
            try:
                r = variants.flex_variant(name, specs[name], gen, dt="f16")
            finally:
                nc.lower = lower
            rows.append((f"{name}, {asked['blocks']} blocks an SM asked" + (" (generated)" if not more else ""), r))
            print(rows[-1][0], r["kernel_ms"], r["flex_kernel_ms"], r.get("registers"), r.get("local_bytes"), flush=True)
    print("\n| form | registers, local bytes | kernel ms | Flex kernel ms | vs Flex | error |")
    print("|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r.get('registers')}, {r.get('local_bytes')} | {r['kernel_ms']:.3f} | "
              f"{r['flex_kernel_ms']:.3f} | {r['flex_kernel_ms'] / r['kernel_ms']:.2f}x | {r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
