"""The package's import graph, checked: stages import only the stages before them.

``python -m napkin_cat.imports`` (or ``napkin imports``) reads every module of ``napkin_cat``
with :mod:`ast` (nothing is imported, so a broken module is still reported), prints the
arrows between stage folders and exits 1 when

* an arrow points from a stage to a later one, or between two folders of the same rank
  (``library`` and ``relabel`` know nothing of each other);
* modules import each other in a circle (function-level imports count: they are arrows too);
* a module is longer than :data:`MAX_LINES` lines.

``--png PATH`` draws the stage graph (the picture in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE = "napkin_cat"

# stage folder -> rank; a module may import its own folder and folders of lower rank only
STAGES: dict[str, int] = {"core": 0, "ops": 1, "library": 2, "relabel": 2, "verify": 3, "costmodel": 3,
                          "lowering": 4, "drawing": 4, "face": 5}
MAX_LINES = 600


@dataclass(frozen=True)
class Arrow:
    source: str      # module, dotted
    target: str      # module, dotted
    line: int
    lazy: bool       # inside a function (imported when called)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES) else "face"


def _resolve(module: str, is_package: bool, node: ast.ImportFrom, known: dict) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    if not base.startswith(PACKAGE):
        return []
    # ``from .x import y``: y may be a submodule of x (an arrow to it) or a name in x
    targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    if len(targets) < len(node.names):
        targets.append(base)
    return targets


def arrows(root: Path = ROOT) -> list[Arrow]:
    known = modules(root)
    out = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        lazy_lines = {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(module, path.name == "__init__.py", node, known)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(PACKAGE)]
            else:
                continue
            for t in targets:
                while t not in known and "." in t:   # ``import napkin_cat.x.y`` of a name: its module
                    t = t.rsplit(".", 1)[0]
                if t != module:
                    out.append(Arrow(module, t, node.lineno, node.lineno in lazy_lines))
    return out


def upward(arrs: list[Arrow]) -> list[Arrow]:
    """Arrows to a later stage, or across folders of the same rank."""
    bad = []
    for a in arrs:
        s, t = stage(a.source), stage(a.target)
        if s != t and STAGES[t] >= STAGES[s]:
            bad.append(a)
    return bad


def cycles(arrs: list[Arrow]) -> list[list[str]]:
    """Circles of modules (strongly connected components of more than one module)."""
    graph: dict[str, set[str]] = {}
    for a in arrs:
        graph.setdefault(a.source, set()).add(a.target)
        graph.setdefault(a.target, set())
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v):   # Tarjan, recursive: the graph is a few dozen modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_modules(root: Path = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    return {m: n for m, p in modules(root).items() if (n := len(p.read_text().splitlines())) > limit}


def stage_arrows(arrs: list[Arrow]) -> Counter:
    return Counter((stage(a.source), stage(a.target)) for a in arrs if stage(a.source) != stage(a.target))


def report(root: Path = ROOT) -> tuple[str, bool]:
    arrs = arrows(root)
    lines = [f"{len(modules(root))} modules, {len(arrs)} import arrows "
             f"({sum(a.lazy for a in arrs)} inside functions)", "", "stage arrows (count):"]
    for (s, t), n in sorted(stage_arrows(arrs).items(), key=lambda kv: (STAGES[kv[0][0]], kv[0])):
        lines.append(f"  {s:>9} -> {t:<9} {n}")
    problems = []
    for a in upward(arrs):
        problems.append(f"upward arrow: {a.source} ({stage(a.source)}) imports {a.target} "
                        f"({stage(a.target)}), line {a.line}")
    for c in cycles(arrs):
        problems.append(f"import cycle: {' <-> '.join(c)}")
    for m, n in sorted(long_modules(root).items()):
        problems.append(f"long module: {m} has {n} lines (limit {MAX_LINES})")
    lines += ["", *(problems or ["no upward arrow, no cycle, no module over "
                                 f"{MAX_LINES} lines"])]
    return "\n".join(lines), not problems


def draw(path: str, root: Path = ROOT) -> None:
    """The stage graph: folders by rank (left to right), arrows with their import counts."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    counts = stage_arrows(arrows(root))
    per_rank: dict[int, list[str]] = {}
    for s, r in STAGES.items():
        per_rank.setdefault(r, []).append(s)
    pos = {}
    for r, names in per_rank.items():
        for k, s in enumerate(names):
            pos[s] = (r * 2.2, (len(names) - 1) / 2 - k * 1.2)
    fig = Figure(figsize=(11, 3.6), dpi=150)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.9, 5 * 2.2 + 0.9)
    ax.set_ylim(-1.6, 1.6)
    ax.axis("off")
    colors = ["#35507a", "#7a3535", "#357a4a", "#7a6a35", "#5a357a", "#35707a"]
    for (s, t), n in counts.items():
        (x0, y0), (x1, y1) = pos[s], pos[t]
        ax.add_patch(FancyArrowPatch((x0 - 0.6, y0), (x1 + 0.6, y1), arrowstyle="-|>", mutation_scale=10,
                                     color=colors[STAGES[s] % len(colors)], alpha=0.7, lw=0.5 + 0.25 * n ** 0.5,
                                     connectionstyle="arc3,rad=0.08"))
    mods = Counter(stage(m) for m in modules(root))
    for s, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch((x - 0.6, y - 0.3), 1.2, 0.6, boxstyle="round,pad=0.02",
                                    facecolor="#e8eef7", edgecolor="#35507a"))
        ax.text(x, y + 0.06, s, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x, y - 0.17, f"{mods[s]} module{'s' if mods[s] != 1 else ''}", ha="center", va="center",
                fontsize=7, color="0.3")
    ax.text(-0.8, 1.45, "napkin_cat: a folder per pipeline stage; each imports only the stages to its left",
            fontsize=9, weight="bold")
    ax.text(-0.8, -1.45, "arrow = imports between two folders (width grows with the number of import "
            "statements); drawn by python -m napkin_cat.imports --png", fontsize=7, color="0.3")
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m napkin_cat.imports", description=__doc__.splitlines()[0])
    ap.add_argument("--png", help="also draw the stage graph to this PNG")
    args = ap.parse_args(argv)
    text, ok = report()
    print(text)
    if args.png:
        draw(args.png)
        print(f"wrote {args.png}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
