"""Notebook views of a cost and of an optimum: HTML tables per memory level.

:func:`cost_html` (``Cost._repr_html_``): per level, the transfers crossing it, the peak memory
resident there and the level's capacity on a hardware profile (``nc.hardware.H100`` unless
given), then the FLOPs per unit.  :func:`optimum_html` (``Optimum._repr_html_``): the tiles
chosen (usable, against the unconstrained optimum), the gaps, and per level the transfers,
memory and capacity the search checked, registers included.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> c = nc.cost(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"))
>>> page = c._repr_html_()
>>> all(f"<td>{lv}</td>" in page for lv in ("HBM", "SMEM", "registers"))
True
"""

from __future__ import annotations

from html import escape

from ..core.errors import CostError

_STYLE = "border-collapse:collapse;margin:0.3em 0"
_CELL = "border:1px solid #bbb;padding:2px 8px;text-align:left"


def _table(head: list[str], rows: list[list[object]], caption: str = "") -> str:
    cap = f"<caption style='text-align:left'><b>{escape(caption)}</b></caption>" if caption else ""
    th = "".join(f"<th style='{_CELL}'>{escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(_text(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table style='{_STYLE}'>{cap}<tr>{th}</tr>{body}</table>"


def _text(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def _levels(names, *maps) -> list[str]:
    seen = [lv for lv in names if any(lv in m for m in maps if m)]
    for m in maps:
        for lv in (m or {}):
            if lv not in seen:
                seen.append(lv)
    return seen


def cost_html(cost, hw=None, dtype=None) -> str:
    """The per-level table of ``cost`` (values; bytes at ``dtype`` too when given)."""
    if hw is None:
        from ..core.hardware import H100
        hw = H100
    names = cost.form.hierarchy.names
    byt = cost.bytes(None, dtype) if dtype is not None else None
    mem_b = cost.memory_bytes(None, dtype) if dtype is not None else None
    head = ["level", "transfers (values)", "memory (values)"]
    head += ["transfers (bytes)", "memory (bytes)"] if dtype is not None else []
    head += [f"capacity (bytes, {hw.name})"]
    rows = []
    for lv in _levels(names, cost.transfers, cost.memory):
        row = [lv, cost.transfers.get(lv), cost.memory.get(lv)]
        if dtype is not None:
            row += [byt.get(lv), mem_b.get(lv)]
        try:
            row.append(hw.capacity(lv))
        except CostError:   # a level the profile has no capacity for (tensor fragments)
            row.append(None)
        rows.append(row)
    flops = [[u, e] for u, e in cost.flops.items()]
    return (f"<div><b>cost of</b> <code>{escape(str(cost.diagram))}</code>"
            + _table(head, rows, "per level: transfers cross from the level down, memory is the peak")
            + _table(["unit", "FLOPs"], flops, "work per unit") + "</div>")


def optimum_html(opt) -> str:
    """The tiles, the gaps and the per-level table of an optimum."""
    free = opt.unconstrained
    head = ["size", "chosen" + (" (usable)" if opt.usable else "")] + (["unconstrained"] if free else [])
    tiles = [[k, v] + ([free.tiles.get(k)] if free else []) for k, v in opt.tiles.items()]
    gaps = [["objective: transfers into " + opt.level + f" ({opt.unit})", opt.objective],
            ["closed-form bound H*(M)", opt.bound], ["gap (objective / bound)", opt.gap]]
    if free:
        gaps += [["unconstrained objective", free.objective], ["usable / unconstrained", opt.usable_gap]]
    caps = dict(opt.capacities or {opt.level: opt.capacity})
    rows = []
    for lv in _levels(tuple(caps), opt.transfers, opt.memory):
        mem = opt.memory_bytes.get(lv) if opt.unit == "bytes" else opt.memory.get(lv)
        rows.append([lv, opt.transfers.get(lv), mem, caps.get(lv)])
    out = ("<div>" + _table(head, tiles, f"optimum at {opt.level}"
                             + (f": usable tiles ({opt.rule})" if opt.usable else ": every integer size"))
           + _table(["", "value"], gaps)
           + _table(["level", "transfers (values)", f"memory ({opt.unit})", f"capacity ({opt.unit})"], rows,
                    "per level"))
    if opt.registers is not None:
        regs = [[k, opt.registers[k], opt.register_capacity[k]] for k in opt.registers]
        out += _table(["registers (values)", "used", "capacity"], regs, f"register level, {opt.threads} threads")
    out += _table(["unit", "FLOPs"], [[u, v] for u, v in opt.flops.items()], "work per unit")
    return out + "</div>"
