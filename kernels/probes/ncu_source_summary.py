"""Summarise Nsight Compute's per-instruction source page: executed instructions by opcode and
warp-stall reasons, side by side for every kernel in the file.

    ncu --section SourceCounters --section WarpStateStats --page source --csv --print-source sass \\
        -k regex:"kernel_b_h|triton" python3 kernels/probes/wgmma_pipeline.py --once --only mma:none,wg:pipe > src.csv
    python3 kernels/probes/ncu_source_summary.py src.csv [--top 12]

Kernels with fewer than 50 instructions (torch's fills) are left out.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def kernels(path: str):
    """``(name, header, rows)`` per kernel of an ncu ``--page source --csv`` file."""
    blocks, cur = [], None
    for ln in open(path).read().splitlines():
        if ln.startswith('"Kernel Name"'):
            cur = [ln]
            blocks.append(cur)
        elif cur is not None and ln.startswith('"'):
            cur.append(ln)
    for b in blocks:
        name = next(csv.reader([b[0]]))[1]
        rows = list(csv.reader(io.StringIO("\n".join(b[1:]))))
        if len(rows) > 50:
            yield name, rows[0], rows[1:]


def opcode(sass: str) -> str:
    sass = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return sass.split()[0].split(".")[0] if sass else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--names", default="", help="comma list naming the kernels' columns, in file order")
    ap.add_argument("--lines", type=int, default=0, help="also the N instructions with the most samples of each "
                                                         "of the four largest stall reasons, per kernel")
    args = ap.parse_args()
    found = list(kernels(args.csv))
    short = [re.sub(r"^napkin_cat::generated::(\w+)::.*", r"\1", n)[:28] for n, _, _ in found]
    if args.names:
        short = args.names.split(",")
    ops, stalls = [], []
    for name, hdr, rows in found:
        ix = {h: i for i, h in enumerate(hdr)}
        c = collections.Counter()
        for r in rows:
            c[opcode(r[ix["Source"]])] += int(r[ix["Instructions Executed"]])
        ops.append(c)
        cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        tot = sum(int(r[ix["Warp Stall Sampling (All Samples)"]]) for r in rows) or 1
        stalls.append({h[6:]: sum(int(r[ix[h]]) for r in rows) / tot for h in cols})
    print("Executed warp instructions (millions) by opcode")
    print(f"| opcode | {' | '.join(short)} |")
    print("|---" * (len(short) + 1) + "|")
    print(f"| all | {' | '.join(f'{sum(c.values()) / 1e6:.1f}' for c in ops)} |")
    every = sorted({o for c in ops for o in c}, key=lambda o: -max(c[o] for c in ops))
    for o in every[:args.top * 2]:
        print(f"| {o} | {' | '.join(f'{c[o] / 1e6:.2f}' for c in ops)} |")
    print("\nWarp-stall samples by reason (share of all samples)")
    print(f"| reason | {' | '.join(short)} |")
    print("|---" * (len(short) + 1) + "|")
    reasons = sorted({k for s in stalls for k in s}, key=lambda k: -max(s.get(k, 0) for s in stalls))
    for k in reasons[:args.top]:
        print(f"| {k} | {' | '.join(f'{100 * s.get(k, 0):.0f}%' for s in stalls)} |")
    for (name, hdr, rows), label, st in zip(found, short, stalls) if args.lines else ():
        ix = {h: i for i, h in enumerate(hdr)}
        tot = sum(int(r[ix["Warp Stall Sampling (All Samples)"]]) for r in rows) or 1
        print(f"\nInstructions with the most stall samples: {label}")
        for reason in sorted(st, key=lambda k: -st[k])[:4]:
            top = sorted(rows, key=lambda r: -int(r[ix["stall_" + reason]]))[:args.lines]
            print(f"  {reason}: " + "; ".join(f"{r[ix['Source']].strip()[:48]} {100 * int(r[ix['stall_' + reason]]) / tot:.1f}%"
                                            for r in top))


if __name__ == "__main__":
    main()
