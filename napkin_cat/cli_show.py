"""How ``napkin`` shows things: plain lines, errors on stderr, rich tables and progress bars.

Text that contains square brackets (``Q[q d] f32``) is printed without rich markup.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


def _console(stderr: bool = False):
    from rich.console import Console
    return Console(stderr=stderr, highlight=False, markup=False, soft_wrap=True)


def say(text: str, end: str = "\n") -> None:
    _console().print(text, end=end)


def error(text: str) -> None:
    print(f"napkin: error: {text}", file=sys.stderr)


class _RichBar:
    """The part of tqdm's interface ``check_equivalent`` uses, drawn by rich on stderr."""

    def __init__(self, total=None, desc="", disable=False, **_):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self._progress = None
        if disable or not sys.stderr.isatty():
            return
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                                  console=_console(stderr=True), transient=True)
        self._progress.start()
        self._task = self._progress.add_task(desc, total=total, note="")

    def update(self, n=1):
        if self._progress:
            self._progress.advance(self._task, n)

    def set_description(self, desc):
        if self._progress:
            self._progress.update(self._task, description=desc)

    def set_postfix_str(self, s):
        if self._progress:
            self._progress.update(self._task, note=s)

    def close(self):
        if self._progress:
            self._progress.stop()
            self._progress = None


@contextmanager
def progress_bar():
    """``check_equivalent`` reports progress through a tqdm bar; here rich draws it (on a
    terminal only), so the command line has one look."""
    from unittest import mock
    with mock.patch("tqdm.auto.tqdm", _RichBar):
        yield


def _expr(e, full: bool, width: int = 64) -> str:
    s = str(e)
    return s if full or len(s) <= width else s[: width - 1] + "…"


def _num(v) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{int(f):,}" if f == int(f) else f"{f:,.1f}"


def _bytes(v) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(f) < 1000 or unit == "TB":
            return f"{f:,.0f} {unit}" if unit == "B" else f"{f:,.1f} {unit}"
        f /= 1000
    return str(v)


def cost_tables(c, sizes: dict, tiles: dict, dtype, full: bool) -> None:
    """Transfers and memory per level, FLOPs per unit: symbolic, and at the sizes and tiles."""
    from rich.table import Table
    from rich.text import Text

    at = c.subs({**sizes, **tiles}) if sizes else None
    where = ", ".join(f"{k}={v}" for k, v in {**sizes, **tiles}.items())
    t = Table(title=Text(f"per level ({dtype.name})" + (f" at {where}" if where else "")), title_justify="left")
    for col in ("level", "transfers (values)", "memory (values)"):
        t.add_column(col)
    if at is not None:
        for col in ("transfers", "memory"):
            t.add_column(f"{col} (bytes)", justify="right")
    levels = list(dict.fromkeys([*c.transfers, *c.memory]))
    for level in levels:
        row = [level, _expr(c.transfers.get(level, 0), full), _expr(c.memory.get(level, 0), full)]
        if at is not None:
            row += [_bytes(at.bytes(level, dtype)) if level in c.transfers else "",
                    _bytes(at.memory_bytes(level, dtype)) if level in c.memory else ""]
        t.add_row(*(Text(str(x)) for x in row))
    f = Table(title=Text("FLOPs per unit"), title_justify="left")
    f.add_column("unit")
    f.add_column("FLOPs")
    if at is not None:
        f.add_column("at the sizes", justify="right")
    for unit, e in c.flops.items():
        f.add_row(*(Text(x) for x in [unit, _expr(e, full)] + ([_num(at.flops[unit])] if at is not None else [])))
    con = _console()
    con.print(t)
    con.print(f)


def lowered(k, where: str, note: str | None) -> None:
    """The launch configuration, schedule and notes of a generated kernel."""
    from rich.table import Table
    from rich.text import Text
    t = Table(show_header=False, title=Text(f"kernel {k.name}"), title_justify="left")
    t.add_column()
    t.add_column()
    rows = [("computes", str(k.diagram)), ("grid", str(k.launch.grid)), ("block", str(k.launch.block)),
            ("shared memory", f"{k.launch.dynamic_smem_bytes:,} B (dynamic)"), ("runs on", where)]
    for name, value in rows:
        t.add_row(Text(name), Text(value))
    con = _console()
    con.print(t)
    for line in k.notes:
        say(f"- {line}")
    if note:
        say(f"- {note}")
