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
from .plan import Coop, Flat, Frag, Micro, caps

MAX_FRAG_TILES = 16
"""At most this many mma tiles per warp (``MT * NT``: 4 fp32 accumulators each per lane)."""


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
    dtype: str = "f32"   # the kernel's input dtype: f16 / bf16 kernels may use tensor cores
    tf32x3: bool = False  # fp32 kernels too, by 3xTF32 (.tensorcore.TF32X3)

    @property
    def tensor_cores(self) -> bool:
        return self.dtype != "f32" or self.tf32x3

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # ---- tensor cores
    def mma_refusal(self, out_axes, operands, red) -> str | None:
        """Why a contraction of ``operands`` (their axes with extent > 1) into ``out_axes`` over
        ``red`` cannot run on tensor cores, or None when its shapes fit ``m16n8k16``."""
        if not self.tensor_cores:
            return f"inputs are {self.dtype} (tensor cores take f16 / bf16, or fp32 by 3xTF32)"
        names, cs = caps(out_axes, self.ax)
        if len(names) != 2:
            return f"its output has {len(names)} axes with extent > 1 in a block (fragments need 2)"
        red = [a for a in red if self.ax[a].cap > 1]
        if len(red) != 1:
            return f"it reduces over {len(red)} axes with extent > 1 (fragments need 1)"
        (k,) = red
        if self.ax[k].cap % 16:
            return f"the reduced extent {k} = {self.ax[k].cap} is not a multiple of 16"
        row, col = names
        kinds = sorted(("row" if row in o else "col" if col in o else "?") + ("" if k in o else "!")
                       for o in operands)
        if kinds != ["col", "row"] or any(row in o and col in o for o in operands):
            return (f"its factors ({', '.join('(' + ' '.join(sorted(o)) + ')' for o in operands)}) are not "
                    f"one ({row} {k}) and one ({k} {col}) operand")
        if self.T % 32:
            return f"{self.T} threads is not a whole number of warps"
        return None

    def _splits(self, cr: int, cc: int, warps_n: bool = True):
        """``(Wm, Wn, MT, NT)`` for each split of the ``T // 32`` warps over ``cr x cc`` into whole
        16x8 tiles (``MT x NT`` per warp; ``warps_n``: warps may also split the columns)."""
        W = self.T // 32
        for Wm in range(1, W + 1):
            Wn = W // Wm
            if W % Wm or (Wn > 1 and not warps_n) or cr % (16 * Wm) or cc % (8 * Wn):
                continue
            yield Wm, Wn, cr // (16 * Wm), cc // (8 * Wn)

    def frag_for(self, out_axes, warps_n: bool = True) -> Frag | None:
        """Fragments over the two output axes for all ``T // 32`` warps (``warps_n``: warps may
        also split the columns), the warp tiles as square as the extents allow."""
        names, (cr, cc) = caps(out_axes, self.ax)
        best, best_score = None, None
        for Wm, Wn, MT, NT in self._splits(cr, cc, warps_n):
            if MT * NT > MAX_FRAG_TILES:
                continue
            score = (min(16 * MT, 8 * NT), MT)
            if best_score is None or score > best_score:
                best_score = score
                best = Frag(names[0], names[1], cr, cc, 2 * MT, 2 * NT, 8 * Wm, 4 * Wn,
                            Wm=Wm, Wn=Wn, dtype=self.dtype)
        return best

    def frag_refusal(self, out_axes) -> str:
        """Why :meth:`frag_for` found no fragments over ``out_axes``: no split of the warps gives
        whole 16x8 tiles, or every split that does holds more than :data:`MAX_FRAG_TILES` per warp."""
        _, (cr, cc) = caps(out_axes, self.ax)
        W = self.T // 32
        fewest = min((MT * NT for _, _, MT, NT in self._splits(cr, cc)), default=None)
        if fewest is None:
            return f"no split of {W} warps over its extents {cr}x{cc} gives whole 16x8 tiles"
        return (f"its {cr}x{cc} tile takes at least {fewest} 16x8 tiles per warp on {W} warps ({4 * fewest} "
                f"fp32 accumulators per thread), more than the {MAX_FRAG_TILES} a warp holds "
                f"(threads.MAX_FRAG_TILES); smaller tiles or more threads keep it on tensor cores")

    def joint_frag(self, r: str, x: str, dcol: str) -> tuple[Frag, Frag] | None:
        """Fragments over ``(r, x)`` (scores, reduced over their own axis) and ``(r, dcol)`` (the
        weighted sum, reduced over ``x``) with the same warps along ``r`` (``Wn == 1``): a lane's
        rows are the same in both, the 4 lanes of a row consecutive."""
        W = self.T // 32
        cr, cs, co = self.ax[r].cap, self.ax[x].cap, self.ax[dcol].cap
        if self.T % 32 or cr % (16 * W) or cs % 16 or co % 8:
            return None
        MT = cr // (16 * W)
        if MT * max(cs, co) // 8 > MAX_FRAG_TILES:
            return None
        return (Frag(r, x, cr, cs, 2 * MT, cs // 4, 8 * W, 4, Wm=W, Wn=1, dtype=self.dtype),
                Frag(r, dcol, cr, co, 2 * MT, co // 4, 8 * W, 4, Wm=W, Wn=1, dtype=self.dtype))

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
