"""Probe: the 16-bit attention forward in the forms the generator can give it, timed in one run
beside FlexAttention.

- ``default``: ``nc.lower``'s choice (at d <= 64: 512 computing threads of 256 rows on warpgroup
  MMAs, 256 on an H100 until 2026-11-30, a copying warpgroup, chunks handed over by named barriers);
- ``block``: the same with ``producer.HAND_OVER = "block"`` (one block barrier per chunk);
- ``mma.sync``: ``producer.SWITCH = False`` (what the schedule chose before: 128 rows, 128
  threads, ``mma.sync``);
- ``summed-each-chunk``: ``emit_states.DEFER_ROW_SUMS = False`` (each row's normaliser summed
  over its lanes every chunk, as before the parts were kept per lane);
- ``--form NAME=SPEC``: a comma list of tunables (``REGS=72``: an upper-case name of
  ``producer``, ``emit_states`` or ``emit_mma``), blocks (``q=128``, ``x=64``) and ``threads=256``.

Each kernel is checked against float64 on 128 random rows of 2 heads before it is timed (kernel
ms by CUPTI), FlexAttention compiled, same inputs.  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/forward_forms.py [--d 64] [--causal 0,1]
        [--forms default,mma.sync] [--form "wg128=q=128,x=64,threads=256,REGS=72"]
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

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import emit_mma, emit_states, producer  # noqa: E402

FORMS = {"default": {}, "block": {"HAND_OVER": "block"}, "mma.sync": {"SWITCH": False},
         "summed-each-chunk": {"DEFER_ROW_SUMS": False}}


def parse_form(spec: str) -> dict:
    """``q=128,x=64,threads=256,REGS=72`` as a form: numbers as ints, other words as they are."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else {"False": False, "True": True}.get(value, value)
    return out


def lower(dia, form: dict):
    switches = {k: v for k, v in form.items() if k.isupper()}
    home = {k: next(m for m in (producer, emit_states, emit_mma) if hasattr(m, k)) for k in switches}
    saved = {k: getattr(home[k], k) for k in switches}
    for k, v in switches.items():
        setattr(home[k], k, v)
    axes = {a.name: a for a in dia.axes}
    tiles = {axes[k]: v for k, v in form.items() if k in ("q", "x")} or None
    try:
        return nc.lower(dia, tiles=tiles, threads=form.get("threads"), prefetch="auto", verify=False)
    finally:
        for k, v in saved.items():
            setattr(home[k], k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--form", action="append", default=[], help="NAME=SPEC: one more form (see above)")
    args = ap.parse_args()
    forms = {name: FORMS[name] for name in filter(None, args.forms.split(","))}
    forms.update({f.split("=", 1)[0]: parse_form(f.split("=", 1)[1]) for f in args.form})
    import torch
    from bench import checked_times, compiled_flex, reference_rows
    N, B, H, D = args.n, 2, 16, args.d
    rows = []
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        q, x, d, h, b = nc.axes("q x d h b")
        dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=causal, dtype=nc.f16).bind(
            {q: N, x: N, d: D, h: H, b: B})
        gen = torch.Generator(device="cuda").manual_seed(0)
        Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=gen).half() for _ in range(3))
        sel = torch.randperm(N, device="cuda", generator=gen)[:128].sort().values
        ref = reference_rows(Q, K, V, causal, D ** -0.5, sel, 2)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        for form, spec in forms.items():
            k = lower(dia, spec)
            O = torch.full_like(Q, float("nan"))
            err, ms, kms = checked_times(k.prepare(Q, K, V, out=O), lambda: O[:, :2, sel], ref)
            rows.append((causal, form, k.launch.block[0], k.schedule.diagram._sched_str(), err, kms,
                         flops / kms / 1e9, k.compiled_info().get("registers"), k.compiled_info().get("local_bytes")))
            print(rows[-1], flush=True)
        flex, fo = compiled_flex(), {}
        from torch.nn.attention.flex_attention import create_block_mask
        bm = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, N, N) if causal else None
        err, ms, kms = checked_times(lambda: fo.update(o=flex(Q, K, V, block_mask=bm)), lambda: fo["o"][:, :2, sel], ref)
        rows.append((causal, "FlexAttention (compiled)", None, "", err, kms, flops / kms / 1e9, None, None))
        print(rows[-1], flush=True)
    print(f"| causal | form (f16, N = {N}, d = {D}, B*H = {B * H}) | threads | blocks | err | kernel ms | TFLOP/s | regs | local bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {int(r[0])} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1e} | {r[5]:.3f} | {r[6]:.0f} | {r[7]} | {r[8]} |")


if __name__ == "__main__":
    main()
