"""Pictures of the cost model, drawn from costed diagrams (matplotlib, Agg backend).

``python -m napkin_cat.drawing.plots`` regenerates every picture in ``docs/``: the diagrams
(``attention``, ``attention_relabelled``, ``multihead_attention``, ``matmul``, as ``.png`` and
``.svg``), ``docs/cost_curves.png``, ``docs/derivation_costs.png`` and ``docs/derivation_costs.md``.

* :func:`diagram_pictures`: the Neural Circuit Diagrams the README and the docs show.

* :func:`cost_curves`: optimal transfers against the memory size M (log-log) for the tiled
  matmul and the streamed, tiled attention, from exact integer optimisation at each M, with
  the closed form's tiling term; the fitted slopes are -beta (-1/2 and -1).
* :func:`derivation_costs`: HBM transfers and memory per derivation step of attention
  (unrelabelled, tiled, streamed, streamed and tiled), as a markdown table and a plot
  against the sequence length.
"""

from __future__ import annotations

import math
import os

import sympy as sp

from .. import library
from ..core.diagram import axes, f16
from ..costmodel.model import cost
from ..core.errors import CostError
from ..core.hardware import H100
from ..relabel.symbols import size_symbol

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _slope(xs, ys) -> float:
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((u - mx) * (v - my) for u, v in zip(lx, ly)) / sum((u - mx) ** 2 for u in lx)


def curves(memories=None) -> dict:
    """Tiling terms ``H*(M) - alpha_0`` (exact optimum and closed form) per M."""
    memories = memories or [2 ** k for k in range(11, 21)]
    a, b, c = axes("a b c")
    q, x, d = axes("q x d")
    cases = {
        "matmul a=b=c=4096": (cost(library.matmul(a=a, b=b, c=c).tile(a, "g_a").tile(c, "g_c").stream(b, "s_b")),
                              {"a": 4096, "b": 4096, "c": 4096}),
        "attention q=x=8192, d=128": (cost(library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")),
                                      {"q": 8192, "x": 8192, "d": 128}),
    }
    out = {}
    for name, (cst, sizes) in cases.items():
        cf = cst.closed_form("SMEM")
        subs = {size_symbol(k): v for k, v in sizes.items()}
        base = float(cf.alphas[0].subs(subs)) if cf.betas[0] == 0 else 0.0
        ms, exact, closed = [], [], []
        for M in memories:
            try:
                best = cst.optimize(sizes, memory=M, usable=False)  # the paper optimises over every integer
            except CostError:  # the smallest blocks the search allows do not fit M
                continue
            ms.append(M)
            exact.append(float(best.objective) - base)
            closed.append(float(cf.at(M, subs)) - base)
        out[name] = {"M": ms, "exact": exact, "closed": closed,
                     "beta": float(cf.betas[-1]), "slope": _slope(ms, exact)}
    return out


def cost_curves(path: str | None = None) -> dict:
    path = path or os.path.join(DOCS, "cost_curves.png")
    plt = _plt()
    data = curves()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for (name, row), colour in zip(data.items(), ("tab:blue", "tab:red")):
        ax.loglog(row["M"], row["exact"], "o", color=colour,
                  label=f"{name}: exact integer optimum (fitted slope {row['slope']:.3f})")
        ax.loglog(row["M"], row["closed"], "-", color=colour, alpha=0.6,
                  label=f"{name}: closed form, slope -beta = {-row['beta']:g}")
    ax.set_xlabel("memory M at SMEM (values)")
    ax.set_ylabel("optimal transfers minus the M-independent term (values)")
    ax.set_title("Optimal HBM transfers vs memory: beta = 1/2 (matmul), 1 (attention)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return data


def _steps():
    q, x, d = axes("q x d")
    att = library.attention(q=q, x=x, d=d)
    return [("unrelabelled (each box a kernel)", "-", att),
            ("tiled over queries", "tile(q, g_q)", att.tile(q, "g_q")),
            ("streamed over keys", "stream(x, s_x)", att.stream(x, "s_x")),
            ("streamed and tiled (FlashAttention)", "stream(x, s_x).tile(q, g_q)", att.stream(x, "s_x").tile(q, "g_q"))]


def _at(cst, sizes, hw=H100, dtype=f16):
    """HBM bytes at the best tiles for ``hw``, or the reason nothing fits."""
    try:
        best = cst.optimize(sizes, hw=hw, dtype=dtype)
    except CostError:
        return None, None
    return best.bytes.get("HBM", 0), dict(best.tiles)


def derivation_costs(md_path: str | None = None, png_path: str | None = None) -> str:
    md_path = md_path or os.path.join(DOCS, "derivation_costs.md")
    png_path = png_path or os.path.join(DOCS, "derivation_costs.png")
    sizes = {"q": 8192, "x": 8192, "d": 128}
    cap = H100.smem_per_block_optin
    rows = ["| step | relabelling | HBM transfers (values) | memory (values) | q*x at HBM | "
            "HBM bytes at q=x=8192, d=128, f16, H100 SMEM |",
            "|---|---|---|---|---|---|"]
    costs = []
    for name, rel, dg in _steps():
        cst = cost(dg)
        costs.append((name, cst))
        hbm = cst.transfers["HBM"]
        qx = size_symbol("q") * size_symbol("x")
        has_qx = any(sp.simplify(t / qx).free_symbols <= {size_symbol("d")} and
                     not (t / qx).has(size_symbol("g_q")) for t in sp.Add.make_args(sp.expand(hbm)))
        mem = "; ".join(f"{lv}: {e}" for lv, e in cst.memory.items())
        val, tiles = _at(cst, sizes)
        if val is None:
            smallest = {size_symbol(k): v for k, v in sizes.items()}
            smallest.update({size_symbol(n): 1 for n in cst.blocks})
            need = int(sp.sympify(cst.memory_bytes("SMEM", f16)).subs(smallest))
            what = f"does not fit SMEM ({cap:,} B per block): needs {need:,} B with blocks of 1"
        else:
            what = f"{int(val):,}" + (f" (tiles {tiles})" if tiles else "")
        rows.append(f"| {name} | `{rel}` | `{hbm}` | `{mem}` | {'yes' if has_qx else 'no'} | {what} |")
    text = ("# Cost per derivation step: attention\n\n"
            "Generated by `python -m napkin_cat.drawing.plots` from `nc.cost` of each relabelled diagram "
            "(values = elements; bytes at f16).  The unrelabelled diagram materialises the q x x "
            "scores (written and read back three times: S, scaled S, P); tiling alone keeps all of "
            "K and V resident and streaming alone all of Q, so neither fits an H100 thread block at "
            "this size; the streamed and tiled form moves no q x x array and fits.\n\n"
            + "\n".join(rows) + "\n")
    with open(md_path, "w") as fh:
        fh.write(text)

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    Ns = [2 ** k for k in range(6, 16)]
    # Tiling alone, streaming alone and FlashAttention move the same bytes while all of them
    # fit: the two short curves are drawn above FlashAttention's, hollow, dashed, shifted
    # sideways (by a factor 0.8 and 1.25 in N) and labelled at their ends, so no curve hides.
    styles = (dict(marker="s", color="tab:blue", zorder=2),
              dict(marker="^", markersize=9, fillstyle="none", linestyle="--", linewidth=1.6,
                   color="tab:orange", zorder=4, dodge=0.8, tag="tiled"),
              dict(marker="v", markersize=9, fillstyle="none", linestyle=":", linewidth=2.0,
                   color="tab:green", zorder=4, dodge=1.25, tag="streamed"),
              dict(marker="o", markersize=5, linewidth=2.2, color="tab:red", zorder=3))
    series = {}
    for (name, cst), style in zip(costs, styles):
        style = dict(style)
        dodge, tag = style.pop("dodge", 1.0), style.pop("tag", None)
        xs, ys = [], []
        for N in Ns:
            val, _ = _at(cst, {"q": N, "x": N, "d": 128})
            if val is not None:
                xs.append(N)
                ys.append(float(val))
        if not xs:
            continue
        series[name] = dict(zip(xs, ys))
        short = len(xs) != len(Ns)
        label = name + (f" (fits SMEM only up to N={xs[-1]}; drawn shifted x{dodge:g} in N)" if short else "")
        ax.loglog([v * dodge for v in xs], ys, label=label, **style)
        if short:
            above = dodge < 1
            ax.annotate(tag, xy=(xs[-1] * dodge, ys[-1]), xytext=(-6 if above else 8, 10 if above else -14),
                        textcoords="offset points", ha="right" if above else "left", fontsize=8,
                        color=style["color"])
    flash = series.get(costs[-1][0], {})
    notes = []
    for (name, _), style in zip(costs[1:-1], styles[1:-1]):
        pts = series.get(name)
        if pts:
            same = all(abs(v - flash.get(N, -1)) <= 1e-9 * v for N, v in pts.items())
            notes.append(f"{style['tag']} alone fits up to N = {max(pts)}"
                         + (", moving the same bytes as FlashAttention" if same else ""))
    if notes:
        ax.text(0.98, 0.04, ";\n".join(notes), transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
                color="#333333")
    ax.set_xlabel("sequence length N = q = x  (d = 128)")
    ax.set_ylabel("HBM bytes at the best tiles (f16, H100 SMEM per block)")
    ax.set_title("Attention: HBM traffic per derivation step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=130)
    plt.close(fig)
    return text


def diagram_pictures(folder: str | None = None) -> list[str]:
    """Draw the docs' diagrams into ``folder`` (default ``docs/``), each as PNG and SVG; returns
    the paths written."""
    from .diagram import draw
    from .styles import schedule_text
    folder = folder or DOCS
    q, x, d, h = axes("q x d h")
    a, b, c = axes("a b c")
    att = library.attention(q=q, x=x, d=d)
    flash = att.stream(x, "s_x").tile(q, "g_q")
    pictures = {
        "attention": (att, "attention  O = softmax_x(Q Kᵀ / √d) V"),
        "attention_relabelled": (flash, f"FlashAttention derived: {schedule_text(flash)}"),
        "multihead_attention": (library.attention(q=q, x=x, d=d, heads=h),
                                "multi-head attention = attention weaved over h"),
        "matmul": (library.matmul(a=a, b=b, c=c), "matmul  C[a c] = Σ_b A[a b] B[b c]"),
    }
    paths = []
    for name, (dg, title) in pictures.items():
        for ext in ("png", "svg"):
            path = os.path.join(folder, f"{name}.{ext}")
            draw(dg, path, title=title)
            paths.append(path)
    return paths


def main() -> None:
    os.makedirs(DOCS, exist_ok=True)
    for path in diagram_pictures():
        print("drawn:", os.path.relpath(path))
    data = cost_curves()
    for name, row in data.items():
        print(f"{name}: fitted slope {row['slope']:.4f} (beta = {row['beta']:g})")
    print(derivation_costs())


if __name__ == "__main__":
    main()
