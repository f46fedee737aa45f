"""Chunks a mask skips, counted: the trips of a stream loop that a mask bounds.

A stream loop over ``c`` (chunks of ``s``, ``n`` columns) inside a grid loop over ``r`` (tiles
of ``g``, ``N`` rows) whose :func:`~napkin_cat.relabel.skipping.chunk_skips` are not empty
visits, for the rows ``[r0, r1)`` of a tile, only the chunks that meet ``[lo, hi) =``
:func:`~napkin_cat.relabel.skipping.visited` (the predicate's ``support``): chunks
``floor(lo/s) <= k < min(ceil(hi/s), ceil(n/s))``, as the tiled executor and the kernel do.  A
node inside that loop runs once per visited chunk of each row tile, so the product of the two
trip counts ``(N/g) (n/s)`` becomes

    E = sum over row tiles t of  rows(t)/g * cols(t)/s

with ``cols(t)`` the columns of the visited chunks (a last chunk may be ragged) and
``rows(t)/g`` the share of a full tile: as everywhere in the model, ``per_exec * execs`` is
the volume actually touched.  ``ragged_execs`` counts a tile whole for a buffer without the row
axis (a K chunk is loaded whole by a short tile) and whole chunks for a buffer without the
column axis.

Bound sizes (``N``, the row steps, ``n`` and ``s`` all ints)
    ``E`` is that sum, exactly: the row tiles and the chunks are iterated as the executor
    iterates them, over :class:`~napkin_cat.ops.index.IntAlgebra`.
Symbolic sizes
    The tiles are full (``T = N/g`` of them, as the model's trip counts are) and the sum over
    ``t`` is the integral over ``tau`` in ``[-1/2, T - 1/2]`` with ``r0 = g tau``,
    ``r1 = g tau + g`` (the midpoint rule: exact while a bound is linear in the tile index; the
    kink where a clipped bound reaches 0 or ``n`` costs at most ``g/8`` columns), the bounds
    ``lo, hi`` coming from ``support`` over :class:`SympyAlgebra`::

        E = (1/s) * integral of  C(hi) - C(lo) + p * ([0 < hi < n] + [0 < lo < n])  d tau
        C(u) = Min(Max(u, 0), n),   p = (s - Min(g, s)) / 2

    ``p`` is the padding a bound inside ``(0, n)`` adds on average (``hi`` rounds up to a
    chunk end, ``lo`` down to a chunk start): over the tiles such a bound falls on the
    multiples of ``gcd(g, s)`` inside a chunk, on average ``(s - gcd(g, s))/2`` columns from its
    edge; ``gcd`` is taken as ``Min(g, s)``, exact for powers of two and offsets that are
    multiples of ``Min(g, s)``.  A bound ``a tau + b`` integrates in closed form through
    ``F(u) = C(u)^2/2 + n Max(u - n, 0)`` (``F' = C``): ``(F(a tau1 + b) - F(a tau0 + b)) / a``.

    Causal (``j <= i``), ``N = n``: ``E = (N (N + g)/2 - g/8 + p (N - g/2)) / (g s)``
    against the dense ``N^2 / (g s)``: a ratio ``(1 + g/N)/2 + p/N``, 1/2 for long sequences.
    ``window(w)`` (``i - w <= j <= i``), ``N = n >> w``: about ``N (g + w + 2p) / (g s)``:
    linear in ``w`` and independent of ``n`` once ``n >= N``.

Error of the symbolic form against the exact count: at most ``s`` columns per bound per tile
(the padding guess) plus ``g/8`` per kink, plus one tile's columns when ``g`` does not divide
``N`` (the last, partial tile is taken with the slope of a full one); ``tests/test_cost.py``
checks it at ragged and aligned sizes.  Not counted (the loop is costed dense, an upper
bound): a support that is not piecewise linear in the row tile with one slope, a stream nested
in another loop over its own axis, masks on a second row axis, a second skipping stream
around the same node, and loops inside a split over the devices (whose blocks sit at the
device's global offsets; :func:`napkin_cat.costmodel.links.device_time` counts their tiles).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d", q=1024, x=1024, d=64)
>>> dense = nc.library.attention(q=q, x=x, d=d).stream(x, 64).tile(q, 128)
>>> causal = nc.library.attention(q=q, x=x, d=d, causal=True).stream(x, 64).tile(q, 128)
>>> nc.cost(causal).flops["tensor"] / nc.cost(dense).flops["tensor"]
9/16
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import sympy as sp

from ..core.hierarchy import DEVICES
from ..ops.index import IntAlgebra
from ..ops.index_support import BoolLogic
from ..relabel.chunk_area import host_values as _host, row_tiles as _tiles
from ..relabel.loopnest import FinalForm, Loop
from ..relabel.skipping import Skip, chunk_skips, visited
from ..relabel.symbols import size_expr

MAX_TILES = 1 << 20     # beyond this many row tiles, bound sizes are counted by the formula


class SympyAlgebra:
    """:meth:`~napkin_cat.ops.index.Predicate.support` on sympy expressions."""

    max = staticmethod(sp.Max)
    min = staticmethod(sp.Min)

    @staticmethod
    def sat_sub(a, k):
        return sp.Max(a - k, 0)


@dataclass(frozen=True)
class SkippedTrips:
    """For a node inside a stream loop that a mask bounds: the positions (in the node's loops)
    of the row loops and the stream loop, and what replaces the product of their trips;
    ``partial``: for each mask (its predicate), the executions of its arithmetic (the chunks
    it does not keep whole), at bound sizes, as ``((known, executions), ...)``: ``known`` the
    ``(block-table comparison, value)`` pairs that hold over those chunks (each chunk inside one
    entry of the table), with which the kernels write them; ``unknown``: the block
    tables whose data the count lacked (their chunks are counted as visited: an upper bound)."""

    loops: frozenset[int]
    execs: sp.Expr
    ragged_execs: sp.Expr
    partial: tuple = ()
    unknown: tuple = ()

    def mask_versions(self, pred) -> tuple | None:
        """``((known, executions), ...)`` of ``pred``'s arithmetic, or None where it is not
        counted apart (every execution, nothing known)."""
        return dict(self.partial).get(pred)


class SkipCounter:
    """Counts visited chunks for the nodes of one final form (cached per loop chain);
    ``data``: values of block tables by name (:mod:`napkin_cat.ops.block_table`), for
    masks that skip chunks by their data."""

    def __init__(self, ff: FinalForm, data: dict | None = None):
        self.ff = ff
        self.data = dict(data or {})
        self._skips: dict[int, tuple[Skip, ...]] = {}
        self._trips: dict[tuple, SkippedTrips | None] = {}
        self._chunks: dict[tuple, list] = {}

    def skips(self, loop: Loop) -> tuple[Skip, ...]:
        if id(loop) not in self._skips:
            self._skips[id(loop)] = chunk_skips(self.ff, loop)
        return self._skips[id(loop)]

    def trips(self, loops: tuple[Loop, ...], axes=None) -> SkippedTrips | None:
        """The trips replaced for a node inside ``loops`` touching a buffer with ``axes``
        (None: work, not a buffer), or None when no enclosing stream skips chunks."""
        if any(lp.step == DEVICES for lp in loops):
            return None
        for i, lp in enumerate(loops):
            skips = self.skips(lp)
            if not skips:
                continue
            if any(outer.axis == lp.axis for outer in loops[:i]):
                return None
            row = skips[0].row
            rows = tuple(j for j in range(i) if loops[j].axis == row)
            row_in = axes is not None and row in axes
            col_in = axes is not None and lp.axis in axes
            key = (tuple(map(id, loops[:i + 1])), row_in, col_in)
            if key not in self._trips:
                self._trips[key] = self._count(tuple(s for s in skips if s.row == row), loops, rows, i,
                                               row_in, col_in)
            return self._trips[key]
        return None

    def _count(self, skips, loops, rows, i, row_in, col_in) -> SkippedTrips | None:
        lp = loops[i]
        N = size_expr(self.ff.diagram.axis(skips[0].row).size)
        steps = [size_expr(loops[j].step) for j in rows]
        n, s = self.ff.extent(lp.axis, loops[:i]), size_expr(lp.step)
        sizes = [N, n, s, *steps]
        unknown = tuple(dict.fromkeys(a.table.name for sk in skips for a in sk.pred.block_atoms()
                                      if a.table.name not in self.data))
        if all(v.is_Integer for v in sizes) and int(N) // int(steps[-1]) <= MAX_TILES:
            key = tuple(map(id, loops[:i + 1]))
            if key not in self._chunks:   # one list of chunks per slice of the tables' leads
                memo: dict = {}
                self._chunks[key] = [chunk_states(skips, int(N), [int(v) for v in steps], int(n), int(s), dd, memo)
                                     for dd in lead_slices(self.data, skips)]
            e, r, partial = mean_counts([exact_counts(c, skips, int(steps[-1]), int(s), row_in, col_in)
                                         for c in self._chunks[key]])
            return SkippedTrips(frozenset(rows + (i,)), e, r, partial, unknown)
        e = approximate_visits(skips, N, steps[-1], n, s)
        if e is None:
            return None
        T = N / steps[-1]
        r = e if row_in else e * sp.ceiling(T) / T
        return SkippedTrips(frozenset(rows + (i,)), e, r, (), unknown)


def lead_slices(data: dict, skips) -> list[dict]:
    """``data`` once per slice of the block tables read with a lead (a table of each batch or
    head: ``table[b, i // r, j // c]``, ``table[h * G + g, ...]``), each such table replaced by
    its slice, so that the chunks are counted head by head and averaged (:func:`mean_counts`):
    the leads name each slice equally often (a batch, a head, a query head of a group).  Tables
    with different leading shapes are counted together, a chunk masked only where every slice
    masks it (an upper bound)."""
    names = {a.table.name for sk in skips for a in sk.pred.block_atoms() if a.lead}
    led = {k: _host(v) for k, v in data.items() if k in names}
    led = {k: v for k, v in led.items() if v.ndim > 2}
    shapes = {v.shape[:-2] for v in led.values()}
    if len(shapes) != 1:
        return [data]
    return [{**data, **{k: v[at] for k, v in led.items()}} for at in np.ndindex(*shapes.pop())]


def mean_counts(counts: list) -> tuple:
    """The mean of :func:`exact_counts`' ``(E, ragged E, partial)`` over the slices of
    :func:`lead_slices`."""
    k = len(counts)
    e = sum(c[0] for c in counts) / k
    r = sum(c[1] for c in counts) / k
    partial = []
    for m, (pred, _) in enumerate(counts[0][2]):
        merged: dict = {}
        for c in counts:
            for known, n in c[2][m][1]:
                merged[known] = merged.get(known, 0) + n
        partial.append((pred, tuple((known, n / k) for known, n in merged.items())))
    return e, r, tuple(partial)


def _table_atom(data: dict, held: dict, r0, r1, c0, c1):
    """``atom(block_atom) -> (full, empty)`` from the block tables' values in ``data``
    (indices clamped into the table, as the gather reads it); ``(False, False)`` (partial,
    visited) for a table whose values are not given.  ``held``: each atom's comparison over
    its whole table, computed once per table and comparison."""
    def atom(a):
        t = data.get(a.table.name)
        if t is None:
            return False, False
        key = (a.table.name, a.cmp, a.c)
        if key not in held:
            held[key] = np.asarray(a.holds(t), dtype=bool)
        # a table of each batch or head (a.lead) not sliced by lead_slices: a chunk counts as
        # masked (kept) only where every batch and head masks (keeps) it
        R, C = t.shape[-2:]
        hold = held[key][..., min(r0 // a.rows, R - 1):min((r1 - 1) // a.rows, R - 1) + 1,
                         min(c0 // a.cols, C - 1):min((c1 - 1) // a.cols, C - 1) + 1]
        return bool(hold.all()), not bool(hold.any())
    return atom


def chunk_states(skips, N: int, steps: list[int], n: int, s: int, data: dict | None = None,
                 memo: dict | None = None) -> list:
    """Every (row tile, visited chunk) as ``(rows, cols, empty, full by mask, known)``: the
    tile's rows, the chunk's columns, whether a mask masks it whole (its block table's data says
    so), for each mask whether it keeps it whole (:meth:`~napkin_cat.ops.index.Predicate.chunk_state`),
    and the ``(block-table comparison, value)`` pairs the tables' data fix over the chunk where
    it reads one entry of the table (as the kernels write it: ``lowering/unswitch.py``; a tile
    whose warps each read their own entry is counted with the comparisons, an upper bound).
    ``memo``: the masks' states by chunk and by what the tables say of it, shared by the calls
    for the slices of one table (:func:`lead_slices`)."""
    memo = {} if memo is None else memo
    atoms = tuple(dict.fromkeys(a for sk in skips for a in sk.pred.block_atoms()))
    out = []
    last = -(-n // s)
    data = {k: _host(v) for k, v in (data or {}).items()}
    held: dict = {}
    for r0, r1 in _tiles(0, N, steps):
        lo, hi = visited(skips, {skips[0].row: (r0, r1)}, n, IntAlgebra)
        for k in range(lo // s, min(-(-hi // s), last)):
            c0, c1 = k * s, min(k * s + s, n)
            atom = _table_atom(data, held, r0, r1, c0, c1)
            key = (r0, r1, c0, c1, tuple(atom(a) for a in atoms))
            if key not in memo:
                memo[key] = [sk.chunk_state(r0, r1, c0, c1, IntAlgebra, BoolLogic, atom) for sk in skips]
            states = memo[key]
            # a comparison the data fix over the chunk, read from one entry (as the kernels fold it)
            known = tuple((a, full) for a, (full, empty) in zip(atoms, key[4])
                          if (full or empty) and r0 // a.rows == (r1 - 1) // a.rows and c0 // a.cols == (c1 - 1) // a.cols)
            out.append((r1 - r0, c1 - c0, any(e for _, e in states), tuple(f for f, _ in states), known))
    return out


def exact_counts(chunks: list, skips, g: int, s: int, row_in: bool = True, col_in: bool = True):
    """``(E, ragged E, partial)`` from :func:`chunk_states` (``g``, ``s``: the tile and the
    chunk); ``partial``: ``(predicate, ((known, E), ...))`` per mask, ``E`` over the chunks it
    does not keep whole where the values ``known`` of its block-table comparisons hold."""
    e = r = Fraction(0)
    part: list[dict] = [{} for _ in skips]
    own = [frozenset(sk.pred.block_atoms()) for sk in skips]
    for rows, cols, empty, full, known in chunks:
        if empty:
            continue
        w, c = Fraction(rows, g), Fraction(cols, s)
        e += w * c
        r += (w if row_in else 1) * (c if col_in else 1)
        for k, f in enumerate(full):
            if not f:
                mine = tuple(kv for kv in known if kv[0] in own[k])
                part[k][mine] = part[k].get(mine, Fraction(0)) + w * c
    q = lambda f: sp.Rational(f.numerator, f.denominator)
    return q(e), q(r), tuple((sk.pred, tuple((known, q(p)) for known, p in versions.items()))
                             for sk, versions in zip(skips, part))


def exact_visits(skips, N: int, steps: list[int], n: int, s: int, row_in: bool = True,
                 col_in: bool = True) -> tuple[sp.Rational, sp.Rational]:
    """``(E, ragged E)`` over the row tiles of ``[0, N)`` (tiled by ``steps``) and the chunks
    of ``s`` of ``[0, n)``, iterated as the executor iterates them."""
    g = steps[-1]
    e = r = Fraction(0)
    last = -(-n // s)
    for r0, r1 in _tiles(0, N, steps):
        lo, hi = visited(skips, {skips[0].row: (r0, r1)}, n, IntAlgebra)
        k0, k1 = lo // s, min(-(-hi // s), last)
        chunks = max(k1 - k0, 0)
        cols = Fraction(min(k1 * s, n) - k0 * s if chunks else 0, s)
        w = Fraction(r1 - r0, g)
        e += w * cols
        r += (w if row_in else 1) * (cols if col_in else chunks)
    return sp.Rational(e.numerator, e.denominator), sp.Rational(r.numerator, r.denominator)


def approximate_visits(skips, N, g, n, s) -> sp.Expr | None:
    """``E`` for symbolic sizes: the integral of the module docstring (None: not linear)."""
    tau = sp.Dummy("tau", real=True)
    T = N / g
    t0, t1 = sp.Rational(-1, 2), T - sp.Rational(1, 2)
    lo, hi = visited(skips, {skips[0].row: (g * tau, g * tau + g)}, n, SympyAlgebra)
    pad = (s - sp.Min(g, s)) / 2
    cols = sp.Integer(0)
    for bound, sign in ((hi, 1), (lo, -1)):
        line = _affine(sp.sympify(bound), tau)
        if line is None:
            return None
        area, inside = _clipped(*line, t0, t1, n, T)
        cols += sign * area + pad * inside
    return cols / s


def _clipped(a, b, t0, t1, n, T):
    """The integral over ``[t0, t1]`` of ``C(a tau + b)`` and the measure of ``0 < a tau + b < n``."""
    C = lambda u: sp.Min(sp.Max(u, 0), n)
    if a == 0:
        return T * C(b), (0 if b == 0 or b == n else T)
    F = lambda u: C(u) ** 2 / 2 + n * sp.Max(u - n, 0)
    u0, u1 = a * t0 + b, a * t1 + b
    return (F(u1) - F(u0)) / a, (C(u1) - C(u0)) / a


def _affine(e: sp.Expr, tau) -> tuple | None:
    """``(slope, intercept)`` of ``e``, a Max / Min of lines in ``tau`` with one slope; a 0 in
    a Max is dropped (the bound is clipped at 0 where it is read, and clipping commutes with
    Max and Min).  None when ``e`` is not of that form."""
    if isinstance(e, (sp.Max, sp.Min)):
        args = [a for a in e.args if not (isinstance(e, sp.Max) and a == 0)]
        parts = [_affine(a, tau) for a in args]
        if not parts or any(p is None for p in parts) or len({p[0] for p in parts}) > 1:
            return None
        return parts[0][0], type(e)(*(p[1] for p in parts))
    try:
        poly = sp.Poly(e, tau)
    except sp.PolynomialError:
        return None
    if poly.degree() > 1:
        return None
    return poly.coeff_monomial(tau), poly.coeff_monomial(1)
