"""Probe: what the relative bias's per-score instructions cost in the 16-bit forward (issue 11).

FlexAttention's relative bias ``s + (i - j) * 0.01`` costs it 6% over its dense kernel; the
generated d = 64 forward paid 17% (0.41 against 0.35 ms on an H200).  Per score the generated
kernel runs ``S * scale`` (FMUL), ``f_row - f_col`` (FADD) and ``* 0.01 +`` (FFMA) where the dense
kernel folds the scale into the exponent.  This probe edits the generated forward's text (a
measurement, not the generator) into two cheaper forms and times them beside the generated one,
the dense kernel and FlexAttention, in the same run, each checked against float64 first:

- ``hoisted``: the bias split into its row and column terms, ``i * 0.01`` once per row and
  ``j * 0.01`` once per column (``(i - j) c = i c - j c``, a rounding change only): FADD + FFMA a score;
- ``rowless``: the row term dropped (softmax over j does not see a term of i alone: O is
  unchanged, the logsumexp would carry ``i * 0.01``): one FFMA a score.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/bias_terms.py
"""
from __future__ import annotations

import os
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

BIAS_LINE = "S_5 = S_4 + ((f_row - float32(uint32(x0 + i_x2))) * F_0_01)"
EDITS = {
    "hoisted": "S_5 = S_regs[i, j] * C_SCALE + (f_row * F_0_01 - float32(uint32(x0 + i_x2)) * F_0_01)",
    "rowless": "S_5 = S_regs[i, j] * C_SCALE - float32(uint32(x0 + i_x2)) * F_0_01",
}


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = variants.flex_variants(gen)
    lower, rows = nc.lower, []
    for name, edit in [("dense", None), ("relative_bias", None), *(("relative_bias", e) for e in EDITS)]:
        def patched(*a, **k):
            kernel = lower(*a, **k)
            if edit is None:
                return kernel
            assert kernel.source.count(BIAS_LINE) == 1, "the generated bias line"
            return edited(kernel, kernel.source.replace(BIAS_LINE, EDITS[edit]))
        nc.lower = patched
        try:
            r = variants.flex_variant(name, specs[name], gen, dt="f16")
        finally:
            nc.lower = lower
        rows.append((name + (f" ({edit})" if edit else ""), r))
        print(name, edit, r["kernel_ms"], r["flex_kernel_ms"], r["rel_err"], flush=True)
    print("\n| form | blocks | kernel ms | Flex kernel ms | vs Flex | error |")
    print("|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['tiles']['q']} x {r['tiles']['x']}, {r['threads']} | {r['kernel_ms']:.3f} | "
              f"{r['flex_kernel_ms']:.3f} | {r['flex_kernel_ms'] / r['kernel_ms']:.2f}x | {r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
