"""Probe: the generated fp16 attention forward with warpgroup MMAs (``wgmma``) against the same
kernel on ``mma.sync``, and variants of the warpgroup path, in one run on a Hopper GPU.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/wgmma_forward.py [--d 64,128] [--causal 0,1]

Each kernel is checked first against float64 on 128 random rows of 2 heads (N = 4096,
B*H = 32, the schedule's blocks), then timed (CUDA events, median); SASS counts of the tensor-core
instructions and the warpgroup fences / waits the compiler added are printed beside.  Variants:
``mma`` (planner.WGMMA off), ``wg`` (on), ``wg-preload`` (every step's A fragments before the
first wgmma: wgmma.PRELOAD_A), ``wg-scores`` / ``wg-update`` (only the scores' contraction or only
the output's update on warpgroups), ``wg-producer`` (a copying warpgroup: lowering/producer.py),
``wg-producer64`` (the same keeping 64 registers per copying thread instead of 40).
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
from napkin_cat.lowering import planner, producer, wgmma, wgmma_plan  # noqa: E402
from bench import checked_times, compiled_flex, reference_rows  # noqa: E402

_ALL = wgmma_plan._contractions


def only(place: str):
    def pick(*args):
        return (c for c in _ALL(*args) if c[0][0] == place)
    return pick


VARIANTS = {
    "mma": dict(WGMMA=False),
    "wg": dict(WGMMA=True),
    "wg-preload": dict(WGMMA=True, PRELOAD_A=True),
    "wg-scores": dict(WGMMA=True, only="fused"),
    "wg-update": dict(WGMMA=True, only="main"),
    "wg-producer": dict(WGMMA=True, PRODUCER=True),
    "wg-producer64": dict(WGMMA=True, PRODUCER=True, REGS=64),
}


def sass_counts(kernel) -> dict:
    disp = kernel.dispatcher
    try:
        sass = disp.inspect_sass()
        sass = sass if isinstance(sass, str) else "\n".join(sass.values())
    except Exception as exc:  # noqa: BLE001
        return {"sass": str(exc)[:80]}
    return {op: sass.count(op) for op in ("HGMMA", "HMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "LDSM", "LDL", "IMAD.MOV", "UIADD3", "MEMBAR")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--causal", default="0")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--blocks", default="", help="semicolon list of q,x,threads (empty: the schedule's)")
    ap.add_argument("--flex", action="store_true", help="time compiled FlexAttention too (its block mask when causal)")
    args = ap.parse_args()
    N, B, H = 4096, 2, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for D in map(int, args.d.split(",")):
        for causal in map(int, args.causal.split(",")):
            Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=gen).half() for _ in range(3))
            sel = torch.randperm(N, device="cuda", generator=gen)[:128].sort().values
            ref = reference_rows(Q, K, V, bool(causal), D ** -0.5, sel, 2)
            q, x, d, h, b = nc.axes("q x d h b")
            dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=bool(causal), dtype=nc.f16).bind(
                {q: N, x: N, d: D, h: H, b: B})
            for name, blk in [(n, b) for b in args.blocks.split(";") for n in args.variants.split(",")]:
                v = VARIANTS[name]
                opts = {}
                if blk:
                    tq, tx, thr = map(int, blk.split(","))
                    opts = dict(tiles={"q": tq, "x": tx}, threads=thr)
                planner.WGMMA = v["WGMMA"]
                producer.SWITCH = v.get("PRODUCER", False)
                regs = producer.REGS
                producer.REGS = v.get("REGS", regs)
                wgmma.PRELOAD_A = v.get("PRELOAD_A", False)
                wgmma_plan._contractions = only(v["only"]) if "only" in v else _ALL
                try:
                    k = nc.lower(dia, prefetch="auto", verify=False, **opts)
                finally:
                    planner.WGMMA, wgmma.PRELOAD_A, wgmma_plan._contractions = True, False, _ALL
                    producer.SWITCH, producer.REGS = False, regs
                O = torch.full_like(Q, float("nan"))
                err, ms, kms = checked_times(k.prepare(Q, K, V, out=O), lambda: O[:, :2, sel], ref)
                flops = 4 * B * H * N * N * D * (0.5 if causal else 1)
                info = k.compiled_info()
                rows.append((D, causal, f"{name} {blk} (block {k.launch.block[0]})".strip(), err, ms, kms,
                             flops / kms / 1e9 if kms == kms else 0, info.get("registers"),
                             info.get("local_bytes"), sass_counts(k)))
                print(rows[-1], flush=True)
            if args.flex:
                from torch.nn.attention.flex_attention import create_block_mask
                bm = create_block_mask(lambda b, h, i, j: i >= j, B=None, H=None, Q_LEN=N, KV_LEN=N,
                                       device="cuda") if causal else None
                flex, fo = compiled_flex(), {}
                err, ms, kms = checked_times(lambda: fo.update(o=flex(Q, K, V, block_mask=bm)),
                                             lambda: fo["o"][:, :2, sel], ref)
                flops = 4 * B * H * N * N * D * (0.5 if causal else 1)
                rows.append((D, causal, "FlexAttention (compiled)", err, ms, kms, flops / kms / 1e9, None, None, {}))
                print(rows[-1], flush=True)
    print("| d | causal | variant | err | events ms | kernel ms | TFLOP/s | regs | local | SASS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1e} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.0f} | {r[7]} | {r[8]} | "
              f"{' '.join(f'{a}={b}' for a, b in r[9].items())} |")


if __name__ == "__main__":
    main()
