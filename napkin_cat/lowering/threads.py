"""Thread mappings of one kernel's phases: which threads compute which outputs.

:class:`Threads` chooses, for ``T`` threads over a block's extents, a register micro-tile
(:class:`~.plan.Micro`: ``MR x MC`` accumulators per thread), groups of lanes per output for
reductions with few outputs (:class:`~.plan.Coop`), or a flat element loop (:class:`~.plan.Flat`);
:meth:`Threads.joint_micro` the shared ``TY x TX`` grid of fused scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.errors import LoweringError
from .plan import Coop, Flat, Micro, caps


def _check_micro(micro):
    """``micro`` as ``(rows, cols)`` of positive ints (register accumulators per thread), or None."""
    if micro is None:
        return None
    ok = isinstance(micro, (tuple, list)) and len(micro) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in micro)
    if not ok:
        raise LoweringError(f"micro must be (rows, cols): two positive ints (register accumulators per "
                            f"thread along each axis of a micro-tile), got {micro!r}")
    return tuple(micro)


@dataclass
class Threads:
    """Chooses thread mappings for ``T`` threads over the block extents ``ax``; ``notes`` says
    where a requested micro-tile could not be used."""

    T: int
    override: tuple[int, int] | None
    ax: dict
    notes: list = field(default_factory=list)

    def micro_for(self, axes: tuple[str, ...]) -> Micro | None:
        names, cs = caps(axes, self.ax)
        if len(names) != 2:
            return None
        row, col = names
        cr, cc = cs
        if self.override:
            RY, RX = self.override
            if cr % RY == 0 and cc % RX == 0 and (cr // RY) * (cc // RX) <= self.T:
                return Micro(row, col, cr, cc, RY, RX, cr // RY, cc // RX)
            note = (f"micro={self.override} not used over ({row}, {col}): it must divide the "
                    f"extents ({cr}, {cc}) with at most {self.T} threads; chosen automatically.")
            if note not in self.notes:
                self.notes.append(note)
        best, best_score = None, None
        for RY in range(1, 9):
            if cr % RY:
                continue
            for RX in range(1, 9):
                if cc % RX:
                    continue
                TY, TX = cr // RY, cc // RX
                n = TY * TX
                if n > self.T:
                    continue
                score = (n, RX % 4 == 0, RY % 4 == 0, -abs(math.log(RY / RX)))
                if best_score is None or score > best_score:
                    best, best_score = Micro(row, col, cr, cc, RY, RX, TY, TX), score
        if best is None or 2 * best.active < min(self.T, cr * cc):
            return None
        return best

    def coop_for(self, axes: tuple[str, ...]) -> Coop:
        names, cs = caps(axes, self.ax)
        n = max(1, math.prod(cs))
        R = 1
        while R * 2 * n <= self.T and R * 2 <= self.T:
            R *= 2
        if self.T % R:
            R = 1
        return Coop(names, cs, self.T, R)

    def flat_for(self, axes: tuple[str, ...]) -> Flat:
        names, cs = caps(axes, self.ax)
        return Flat(names, cs, self.T)

    def joint_micro(self, r: str, x: str, dcol: str) -> tuple[Micro, Micro] | None:
        """Micro-tiles over ``(r, x)`` and ``(r, dcol)`` on the same ``TY x TX`` threads (all of
        them), ``TX`` a power of two <= 32: the lanes of a row are one aligned warp group."""
        cr, cs, co = self.ax[r].cap, self.ax[x].cap, self.ax[dcol].cap
        best, best_score = None, None
        TX = 1
        while TX <= 32:
            TY = self.T // TX
            if self.T % TX == 0 and cr % TY == 0 and cs % TX == 0 and co % TX == 0:
                RY, RXs, RXo = cr // TY, cs // TX, co // TX
                if max(RY, RXs, RXo) <= 8:
                    score = (RXs % 4 == 0, RXo % 4 == 0, RY % 4 == 0, -TX)
                    if best_score is None or score > best_score:
                        best_score = score
                        best = (Micro(r, x, cr, cs, RY, RXs, TY, TX), Micro(r, dcol, cr, co, RY, RXo, TY, TX))
            TX *= 2
        return best
