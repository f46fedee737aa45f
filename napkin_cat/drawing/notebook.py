"""Notebook output of a final form: its pseudocode with the memory live at each line, per level,
as one self-contained HTML table (``FinalForm._repr_html_`` looks it up in the registry).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> html = final_form_html(nc.library.attention(q=q, x=x, d=d).stream(x, 16).tile(q, 32).loop_nest())
>>> "<table" in html and "for x in chunks of 16" in html and "SMEM" in html
True
"""

from __future__ import annotations

from html import escape

from ..core.hierarchy import FULL
from ..relabel.loopnest import FinalForm, Loop
from .styles import LEVEL_COLOURS

_CELL = "padding:1px 0.8em;text-align:left;vertical-align:top;border-bottom:1px solid #eee"


def final_form_html(ff: FinalForm) -> str:
    """One row per program point: the line of pseudocode (loops in bold) and, per memory
    level, the elements live there; a last row gives each level's peak."""
    lines = ff.pseudocode(memory=False).splitlines()
    columns = ff.columns()
    mems = [col.memory() for col in columns]
    levels = sorted({lv for m in mems for lv in m}, key=_rank)
    head = "".join(f'<th style="{_CELL};color:{LEVEL_COLOURS.get(lv, "#333")}">{escape(lv)}</th>' for lv in levels)
    rows = []
    for line, col, mem in zip(lines, columns, mems):
        code = escape(line)
        if isinstance(col.node, Loop):
            code = f"<b>{code}</b>"
        cells = "".join(f'<td style="{_CELL}">{escape(str(mem[lv])) if lv in mem else ""}</td>' for lv in levels)
        rows.append(f'<tr><td style="{_CELL};white-space:pre;font-family:monospace">{code}</td>{cells}</tr>')
    peak = ff.peak_memory()
    cells = "".join(f'<td style="{_CELL}"><b>{escape(str(peak.get(lv, "")))}</b></td>' for lv in levels)
    rows.append(f'<tr><td style="{_CELL}"><i>peak memory (elements)</i></td>{cells}</tr>')
    title = f"final form of {ff.diagram}"
    return (f'<div class="napkin-final-form"><p><b>{escape(title)}</b></p>'
            f'<table style="border-collapse:collapse;font-size:90%"><tr><th style="{_CELL}">loop nest</th>'
            f"{head}</tr>{''.join(rows)}</table></div>")


def _rank(level: str) -> tuple[int, str]:
    """Slow levels first (HBM, L2, ..., registers); a level outside the hierarchy last."""
    names = FULL.names
    return (names.index(level) if level in names else len(names), level)


__all__ = ["final_form_html"]
