"""Chunk skipping: which chunks of a stream a mask removes, read off the final form once.

An online softmax (or a running max / logsumexp) over a streamed axis ``x`` gains nothing from
a chunk whose every score a mask sent to ``-inf``.  When the scores come from a mask on
(``row``, ``x``) through boxes that keep ``-inf`` (their kind spec's ``keeps_neg_inf``: a
positive scale, a shift, an added bias...), and ``row`` is tiled by a grid loop around the
stream, the rows ``[r0, r1)`` of a tile need only the columns of the predicate's *support*
(:meth:`napkin_cat.ops.index.Predicate.support`), bounded from above (causal), from below
(``j >= i``) or both (a window).  A mask that reads a block table
(:meth:`~napkin_cat.ops.index.Predicate.block_atoms`) skips, besides, the chunks the table
marks empty, chunk by chunk, when the kernel runs; and a chunk that a mask keeps whole
(:meth:`~napkin_cat.ops.index.Predicate.chunk_state`) skips the mask's arithmetic.  The tiled executor, the cost model and the
kernel generator all read :func:`chunk_skips` and :func:`visited`, so what the NumPy check
verifies is what the kernel skips and what the cost model counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.index import Predicate
from ..ops.kinds import spec
from .loopnest import FinalForm, Loop, Update

# accumulators that a chunk of -inf scores leaves unchanged
SKIPPING_RULES = ("online_softmax", "logsumexp")


@dataclass(frozen=True)
class Skip:
    """Rows ``row`` (tiled by a grid loop) keep only the columns of ``pred``'s support along
    the streamed axis ``col``."""

    row: str
    col: str
    pred: Predicate


def _skipping(acc) -> bool:
    return acc.rule in SKIPPING_RULES or (acc.rule == "reduce" and acc.box.param("op") == "max")


def chunk_skips(ff: FinalForm, loop: Loop) -> tuple[Skip, ...]:
    """The masks that bound the chunks ``loop`` (a stream loop) must visit."""
    if loop.kind != "stream":
        return ()
    dd = ff.diagram
    n_in = len(dd.dom)
    eqn_of = {v: k for k in range(len(dd.eqns)) for v in dd.eqn_outputs(k)}
    grid_rows = set()
    found: list[Skip] = []
    for n, loops in ff.walk():
        if n is loop:
            grid_rows = {lp.axis for lp in loops if lp.kind == "grid"}
    for n, loops in ff.walk():
        if not isinstance(n, Update) or loop not in loops:
            continue
        acc = ff.accumulators[n.acc]
        if acc.axis != loop.axis or not _skipping(acc):
            continue
        v = dd.eqns[acc.eqn].ins[0]
        # follow -inf preserving boxes back to a mask on (tiled row, streamed col)
        while v >= n_in:
            box = dd.eqns[eqn_of[v]].box
            if box.kind == "mask":
                pred, row = box.param("pred"), box.param("row")
                if box.param("col") == loop.axis and row in grid_rows and pred.skips_chunks():
                    skip = Skip(row, loop.axis, pred)
                    if skip not in found:
                        found.append(skip)
                break
            if not spec(box).keeps_neg_inf(box, _sizes(dd)):
                break
            v = dd.eqns[eqn_of[v]].ins[0]
    return tuple(found)


def _sizes(d) -> dict:
    return {a.name: a.size for a in d.axes if not a.symbolic}


def visited(skips: tuple[Skip, ...], rows: dict, n, al):
    """``(lo, hi)``: the columns the stream visits for the row ranges ``rows`` (row axis ->
    ``(r0, r1)``), over the algebra ``al`` (see :mod:`napkin_cat.ops.index`); ``hi`` is not
    clipped to the column count ``n`` unless no mask bounds it (then it is ``n``)."""
    lo, hi = 0, n
    for s in skips:
        r0, r1 = rows[s.row]
        a, b = s.pred.support(r0, r1, al)
        if not _zero(a):            # bounded from below (j >= i): the early chunks are skipped
            lo = a if _zero(lo) else al.max(lo, a)
        if b is not None:
            hi = b if hi is n else al.min(hi, b)
    return lo, hi


def _zero(v) -> bool:
    return not hasattr(v, "op") and v == 0      # a code bound (lowering) is never the int 0
