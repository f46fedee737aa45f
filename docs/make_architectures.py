"""Regenerate docs/architectures.md and its pictures: ``python docs/make_architectures.py``.

Every picture is drawn by ``nc.draw``, every cost is ``nc.cost`` of the library diagram, and the
kernel list is what ``nc.lower`` answers at small sizes (an error would be shown, caught)."""

from __future__ import annotations

import os
import sys

import matplotlib
import sympy as sp

matplotlib.use("Agg")
import napkin_cat as nc  # noqa: E402

L = nc.library
HERE = os.path.dirname(os.path.abspath(__file__))

ARCHS = [  # name, diagram, sizes for nc.lower, what it shows
    ("conv1d", lambda: L.conv1d(stride=2, padding=1), {"c": 4, "o": 4, "l": 16, "lo": 8},
     "stride-2 1D convolution: unfold l into windows (lo, k), contract over c and k"),
    ("conv2d_grouped", lambda: L.conv2d(4, 8, kernel=3, padding=1, groups=2, bias=False),
     {"h": 8, "w": 8, "ho": 8, "wo": 8}, "grouped 2D convolution: channels split into (g, c/g)"),
    ("conv_transpose1d", lambda: L.conv1d(kernel=4, stride=2, padding=1, transposed=True, bias=False),
     {"c": 4, "o": 4, "l": 8, "lo": 16}, "transposed convolution: windows read at (lo + p - k)/2"),
    ("transformer_block", L.transformer_block, {"t": 8, "d": 8, "h": 2, "e": 4, "f": 16},
     "pre-norm block: LN, attention weaved over heads, residual, LN, MLP, residual"),
    ("resnet_block", L.resnet_block, {"c": 4, "h": 8, "w": 8}, "basic residual block, identity shortcut"),
    ("unet", lambda: L.unet(widths=(8, 16)), {"c": 3, "k": 2, "h": 8, "w": 8, "h1": 4, "w1": 4},
     "one pooling level: encoder, bottleneck, transposed conv up, skip concatenation, decoder"),
    ("vit", lambda: L.vit(patch=4), {"c": 3, "h": 8, "w": 8, "gh": 2, "gw": 2, "n": 4, "t": 5, "d": 8,
                                     "heads": 2, "e": 4, "f": 16, "k": 10},
     "patch embedding (split + contract), class token (pad + add), position embedding, one block, head"),
]


def _fmt(e) -> str:
    return "`" + str(sp.factor_terms(sp.expand(e))).replace("**", "^").replace("*", "·") + "`"


def main(names=None) -> str:
    out = [open(os.path.join(HERE, "architectures_intro.md")).read().rstrip(), ""]
    for name, make, sizes, what in ARCHS:
        if names and name not in names:
            continue
        d = make()
        png = f"arch_{name}.png"
        nc.draw(d, os.path.join(HERE, png), title=name)
        c = nc.cost(d)
        try:
            k = nc.lower(d.bind(sizes), verify=False)
            ks = list(getattr(k, "kernels", [k]))
            rows = [f"| `{getattr(kk, 'name', type(kk).__name__)}` | `{', '.join(str(a) for a in kk.diagram.cod)}` | "
                    f"{tuple(kk.launch.grid)} x {kk.launch.block[0]} | {kk.launch.dynamic_smem_bytes} |"
                    for kk in ks if hasattr(kk, "launch")]
            views = len(ks) - len(rows)
            lowered = (f"{len(rows)} kernel{'s' * (len(rows) != 1)}" + (f" and {views} views" if views else "") + ":\n\n"
                       "| kernel | computes | grid x threads | shared bytes |\n|---|---|---|---|\n" + "\n".join(rows))
        except nc.NapkinError as e:
            text = " ".join(str(e).split())
            text = text.split("for lowering: ", 1)[-1] if text.startswith("cannot relabel") else text
            lowered = f"`{type(e).__name__}`: {text[:400]}"
        out += [f"## {name}", "", what + ".", "", f"`{d}`", "", f"![{name}]({png})", "",
                "| quantity | level / unit | value (values, symbolic) |", "|---|---|---|"]
        out += [f"| FLOPs | {u} | {_fmt(v)} |" for u, v in c.flops.items() if v != 0]
        out += [f"| transfers | {lv} | {_fmt(v)} |" for lv, v in c.transfers.items() if v != 0]
        out += [f"| memory (peak) | {lv} | {_fmt(v) if len(str(v)) < 300 else '`' + str(v)[:300] + ' …`'} |"
                for lv, v in c.memory.items() if v != 0]
        out += ["", f"Lowering (`nc.lower(d.bind({sizes}), verify=False)`, as in the CUDA simulator): {lowered}", ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = main(sys.argv[1:] or None)
    if not sys.argv[1:]:
        open(os.path.join(HERE, "architectures.md"), "w").write(text)
    print(text)
