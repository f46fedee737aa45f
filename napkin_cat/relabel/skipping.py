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
(:meth:`~napkin_cat.ops.index.Predicate.chunk_state`) skips the mask's arithmetic.

A sum over the streamed axis (a contraction: the backward's ``dV += P^T dO``, ``dK += dS^T Q``,
``dQ += dS K``) gains nothing from a chunk where every summand is exactly 0.  A value is 0
where a mask removes the entry when it is a box whose spec has ``zero_at_neg_inf`` (``exp``)
applied to a score that a mask sends to ``-inf`` (as above), or a box whose spec's
``keeps_zero`` names an input that is such a value (a product, a positive scale, a cast); a
product of such a value with finite factors is 0 (``0 * inf`` is NaN: non-finite values at
masked positions are not specified, docs/NAN_POLICY.md rule 5).  Any other box on the path
stops the derivation.  When the mask's rows are the streamed axis and its columns the tiled
one (keys tiled, queries streamed), the chunks kept are those of the transposed support
(:meth:`~napkin_cat.ops.index.Predicate.row_support`; ``j <= i``: queries from the tile's
first key).  A chunk is skipped only if every accumulator along the stream derives the mask.

The tiled executor, the cost model and the kernel generator all read :func:`chunk_skips` and
:func:`visited`, so what the NumPy check verifies is what the kernel skips and what the cost
model counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.index import Predicate
from ..ops.kinds import spec
from .loopnest import FinalForm, Loop, Update

# accumulators that a chunk of -inf scores leaves unchanged
SKIPPING_RULES = ("online_softmax", "logsumexp")
# accumulators that a chunk of exact zeros leaves unchanged (sums)
SUM_RULES = ("sum_contract",)


@dataclass(frozen=True)
class Skip:
    """Rows ``row`` (tiled by a grid loop) keep only the columns of ``pred``'s support along
    the streamed axis ``col``.  ``transposed``: the mask's rows are the streamed axis and its
    columns the tiled one (a stream over queries, keys tiled: the backward's dK / dV), so the
    chunks kept are those of :meth:`~napkin_cat.ops.index.Predicate.row_support`."""

    row: str
    col: str
    pred: Predicate
    transposed: bool = False

    def support(self, r0, r1, al):
        """``(lo, hi)``: the streamed indices that may survive for the tiled ``[r0, r1)``."""
        if self.transposed:
            return self.pred.row_support(r0, r1, al)
        return self.pred.support(r0, r1, al)

    def chunk_state(self, r0, r1, c0, c1, al, lg, atom):
        """:meth:`~napkin_cat.ops.index.Predicate.chunk_state` of the tile ``[r0, r1)`` x the
        chunk ``[c0, c1)``, in the mask's own (row, column) order."""
        if self.transposed:
            return self.pred.chunk_state(c0, c1, r0, r1, al, lg, atom)
        return self.pred.chunk_state(r0, r1, c0, c1, al, lg, atom)


def _skipping(acc) -> bool:
    return acc.rule in SKIPPING_RULES or (acc.rule == "reduce" and acc.box.param("op") == "max")


def _summing(acc) -> bool:
    return acc.rule in SUM_RULES or (acc.rule == "reduce" and acc.box.param("op") == "sum")


class _Paths:
    """The masks a value descends from along boxes with a trait (ordered sets: dicts)."""

    def __init__(self, ff: FinalForm, loop: Loop, grid: set):
        self.dd, self.loop, self.grid = ff.diagram, loop, grid
        self.n_in = len(self.dd.dom)
        self.eqn_of = {v: k for k in range(len(self.dd.eqns)) for v in self.dd.eqn_outputs(k)}
        self.sizes = _sizes(self.dd)

    def _box(self, v):
        e = self.dd.eqns[self.eqn_of[v]]
        return e.box, e.ins

    def neg_inf(self, v) -> dict:
        """Masks that send ``v`` to ``-inf`` (through boxes that keep ``-inf``)."""
        while v >= self.n_in:
            box, ins = self._box(v)
            if box.kind == "mask":
                skip = self._skip(box)
                return dict.fromkeys([skip] if skip else [])
            if not spec(box).keeps_neg_inf(box, self.sizes):
                return {}
            v = ins[0]
        return {}

    def zero(self, v) -> dict:
        """Masks where ``v`` is exactly 0: ``exp`` of a masked score, through products whose
        other factors are finite (docs/NAN_POLICY.md, rule 5)."""
        if v < self.n_in:
            return {}
        box, ins = self._box(v)
        k = spec(box)
        out = self.neg_inf(ins[0]) if k.zero_at_neg_inf(box, self.sizes) else {}
        for p in k.keeps_zero(box, self.sizes):
            out = {**out, **self.zero(ins[p])}
        return out

    def _skip(self, box) -> Skip | None:
        pred, row, col = box.param("pred"), box.param("row"), box.param("col")
        if col == self.loop.axis and row in self.grid and pred.skips_chunks():
            return Skip(row, col, pred)
        if row == self.loop.axis and col in self.grid and pred.skips_rows():
            return Skip(col, row, pred, transposed=True)
        return None


def chunk_skips(ff: FinalForm, loop: Loop) -> tuple[Skip, ...]:
    """The masks that bound the chunks ``loop`` (a stream loop) must visit: those that every
    accumulator along the loop's axis derives (one that derives none: nothing is skipped).  A sum
    along an enclosing stream's axis that also sums over this loop's (grouped-query heads' dK, dV:
    one sum over the groups and, inside each, the query chunks) counts as along this loop too."""
    if loop.kind != "stream":
        return ()
    grid_rows = set()
    for n, loops in ff.walk():
        if n is loop:
            grid_rows = {lp.axis for lp in loops if lp.kind == "grid"}
    paths = _Paths(ff, loop, grid_rows)
    found: list[Skip] | None = None
    seen = set()
    for n, loops in ff.walk():
        if not isinstance(n, Update) or loop not in loops:
            continue
        acc = ff.accumulators[n.acc]
        if (acc.axis != loop.axis and not (_summing(acc) and acc.reduces(loop.axis))) or n.acc in seen:
            continue
        seen.add(n.acc)
        ins = ff.diagram.eqns[acc.eqn].ins
        if _skipping(acc):
            mine = paths.neg_inf(ins[0])
        elif _summing(acc):
            mine = {s: None for v in ins for s in paths.zero(v)}
        else:
            return ()
        found = list(mine) if found is None else [s for s in found if s in mine]
    return tuple(found or ())


def _sizes(d) -> dict:
    return {a.name: a.size for a in d.axes if not a.symbolic}


def visited(skips: tuple[Skip, ...], rows: dict, n, al):
    """``(lo, hi)``: the columns the stream visits for the row ranges ``rows`` (row axis ->
    ``(r0, r1)``), over the algebra ``al`` (see :mod:`napkin_cat.ops.index`); ``hi`` is not
    clipped to the column count ``n`` unless no mask bounds it (then it is ``n``)."""
    lo, hi = 0, n
    for s in skips:
        r0, r1 = rows[s.row]
        a, b = s.support(r0, r1, al)
        if not _zero(a):            # bounded from below (j >= i): the early chunks are skipped
            lo = a if _zero(lo) else al.max(lo, a)
        if b is not None:
            hi = b if hi is n else al.min(hi, b)
    return lo, hi


def _zero(v) -> bool:
    return not hasattr(v, "op") and v == 0      # a code bound (lowering) is never the int 0


BAND_SHARE = 0.9
"""Row tiles are halved when a band keeps at most this share of the entries the taller tiles
visit: the shorter tiles' cost per entry, measured on an H200 (fp16 forward, N = 4096, d = 64,
64 against 128 rows on 4 warps), is 5-8% more (a sliding window of 256: 0.069 against 0.079 ms;
block-causal chunks, no band: 0.289 against 0.268; kernels/BENCHMARKS.md, "Session of
2026-11-28 (H200), second")."""


def band_span(d, row: str, rows: int) -> int | None:
    """How many columns a tile of ``rows`` rows of axis ``row`` far down the grid must visit
    under ``d``'s masks on ``row`` (their supports intersected, tile aligned), or None when none
    bounds them from below: no mask, a causal one (it keeps the first column), a custom one.

    >>> import napkin_cat as nc
    >>> q, x = nc.axes("q x")
    >>> band_span(nc.library.attention(q=q, x=x, window_size=256), "q", 64)
    320
    >>> band_span(nc.library.attention(q=q, x=x, causal=True), "q", 64) is None
    True
    """
    from ..ops.index import IntAlgebra
    far = 2 ** 31   # a power of two: every tile size divides it
    lo, hi = 0, None
    for e in d.eqns:
        if e.box.kind == "mask" and e.box.param("row") == row:
            s = e.box.param("pred").support(far, far + rows, IntAlgebra)
            if s is not None:
                lo = max(lo, s[0])
                hi = s[1] if hi is None else hi if s[1] is None else min(hi, s[1])
    return None if lo == 0 or hi is None else max(0, hi - lo)


def shorter_rows_pay(d, row: str, rows: int) -> bool:
    """Whether tiles of ``rows // 2`` rows visit at most :data:`BAND_SHARE` of the entries per
    row that tiles of ``rows`` visit under ``d``'s band masks (:func:`band_span`): a sliding
    window of 256 at 64 against 128 rows visits 320 against 384 columns per row."""
    short, tall = band_span(d, row, rows // 2), band_span(d, row, rows)
    return short is not None and tall is not None and tall > 0 and short <= BAND_SHARE * tall
