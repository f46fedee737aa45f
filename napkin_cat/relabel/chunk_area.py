"""The area of the chunks a kernel visits under masks that read block tables, from the tables' values.

A stream loop whose masks read a block table (:class:`~napkin_cat.ops.index_support.BlockAtom`:
``table[i // r, j // c] (cmp) v``) visits, for each row tile, the chunks of the masks' data-free
support (:func:`~.skipping.visited`) that the tables do not mask whole: which ones depends on the
values, known when the kernel runs.  :func:`visited_area` counts the entries (rows x columns) of
those chunks, as the kernel decides them (:meth:`~.skipping.Skip.chunk_state` over the atoms'
states on each chunk), for one form's blocks: a launch-time choice between two forms of one
diagram (:class:`napkin_cat.lowering.tabled.TableChoice`) runs the one that visits less.

The cost model counts the same chunks one at a time (:func:`napkin_cat.costmodel.skips.chunk_states`);
here the chunks of a row tile are read at once, each atom's state on them from prefix sums of its
comparison over the table (entries of ``rows x cols`` table blocks a chunk covers: all of them
hold, full; none, empty), and a table of each batch or head (``table[b, i // r, j // c]``) slice
by slice: O(row tiles x (leads x chunks)) array work, a few milliseconds where the one-by-one
count takes a second.  ``tests/test_user_table_choice.py`` checks that the two agree.

>>> import numpy as np, napkin_cat as nc
>>> from napkin_cat.relabel.chunk_area import visited_area
>>> from napkin_cat.relabel.skipping import Skip
>>> bm = nc.aux("bm", nc.Axis("rb", 4), nc.Axis("cb", 4))
>>> m = nc.mask_mod(lambda b, h, i, j: bm[i // 4, j // 4] > 0)
>>> table = np.eye(4, dtype=np.float32)          # the diagonal blocks of 4 x 4
>>> visited_area((Skip("q", "x", m),), 16, [4], 16, 4, {"bm": table}), visited_area((Skip("q", "x", m),), 16, [8], 16, 4, {"bm": table})
(64.0, 128.0)
"""

from __future__ import annotations

import numpy as np

from ..core.errors import LoweringError
from ..ops.index import IntAlgebra


class ArrayLogic:
    """The code logic of :func:`~napkin_cat.ops.index_support.chunk_state` over NumPy arrays
    (a condition per chunk and lead slice)."""

    le = staticmethod(np.less_equal)
    and_ = staticmethod(np.logical_and)
    or_ = staticmethod(np.logical_or)


def visited_area(skips, N: int, steps: list[int], n: int, s: int, data: dict) -> float:
    """The entries of the chunks visited over rows ``[0, N)`` tiled by ``steps`` (outer first)
    and columns ``[0, n)`` in chunks of ``s``, under ``skips`` (:func:`~.skipping.chunk_skips`
    of one stream loop, not transposed), the block tables' values in ``data`` (by name: NumPy
    arrays or torch tensors, copied to the host); the mean over the slices of tables of each
    batch or head.  Raises :class:`LoweringError` for a table ``data`` lacks."""
    if any(sk.transposed for sk in skips):
        raise LoweringError("visited_area: a stream over the mask's rows (transposed skips) is not counted here")
    atoms = tuple(dict.fromkeys(a for sk in skips for a in sk.pred.block_atoms()))
    missing = sorted({a.table.name for a in atoms} - set(data))
    if missing:
        raise LoweringError(f"visited_area: no values for block table(s) {', '.join(missing)}")
    sums = {a: _prefix(a, host_values(data[a.table.name])) for a in atoms}
    leads = {v.shape[:-2] for v in sums.values() if v.ndim > 2}
    sliced = len(leads) == 1          # one lead shape: slice by slice, else masked only where all slices mask
    total = np.zeros(leads.pop() if sliced else ())
    last = -(-n // s)
    for r0, r1 in row_tiles(0, N, steps):
        lo, hi = _visited(skips, r0, r1, n)
        k = np.arange(lo // s, min(-(-hi // s), last))
        if not k.size:
            continue
        c0, c1 = k * s, np.minimum(k * s + s, n)
        atom = _atom_states(sums, r0, r1, c0, c1, sliced)
        empty = False
        for sk in skips:
            _, e = sk.chunk_state(r0, r1, c0, c1, IntAlgebra, ArrayLogic, atom)
            empty = np.logical_or(empty, e)
        kept = np.broadcast_to(~np.asarray(empty, dtype=bool), total.shape + (k.size,))
        total = total + (kept * ((r1 - r0) * (c1 - c0))).sum(-1)
    return float(np.mean(total))


def _visited(skips, r0, r1, n):
    from .skipping import visited
    return visited(skips, {skips[0].row: (r0, r1)}, n, IntAlgebra)


def row_tiles(r0: int, r1: int, steps: list[int]):
    """The row ranges of the innermost tiles of ``[r0, r1)`` tiled by ``steps`` (outer first)."""
    if not steps:
        yield r0, r1
        return
    for a in range(r0, r1, steps[0]):
        yield from row_tiles(a, min(a + steps[0], r1), steps[1:])


def host_values(v) -> np.ndarray:
    """A table's values as a float NumPy array (a torch tensor copied off its device)."""
    return np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=float)


def _prefix(a, table: np.ndarray) -> np.ndarray:
    """Prefix sums over the table's last two axes of where atom ``a`` holds (a zero row and
    column first): the count over any rectangle of blocks in four reads."""
    held = np.asarray(a.holds(table), dtype=np.int64)
    out = np.zeros(held.shape[:-2] + (held.shape[-2] + 1, held.shape[-1] + 1), dtype=np.int64)
    out[..., 1:, 1:] = held.cumsum(-2).cumsum(-1)
    return out


def _atom_states(sums: dict, r0: int, r1: int, c0: np.ndarray, c1: np.ndarray, sliced: bool):
    """``atom(block_atom) -> (full, empty)``: arrays over (lead slices,) chunks of whether the
    atom holds on every / no table entry the tile ``[r0, r1)`` and each chunk cover (indices
    clamped into the table, as the gather reads them)."""
    def atom(a):
        S = sums[a]
        R, C = S.shape[-2] - 1, S.shape[-1] - 1
        i0, i1 = min(r0 // a.rows, R - 1), min((r1 - 1) // a.rows, R - 1)
        j0, j1 = np.minimum(c0 // a.cols, C - 1), np.minimum((c1 - 1) // a.cols, C - 1)
        count = S[..., i1 + 1, j1 + 1] - S[..., i0, j1 + 1] - S[..., i1 + 1, j0] + S[..., i0, j0]
        area = (i1 - i0 + 1) * (j1 - j0 + 1)
        full, empty = count == area, count == 0
        if not sliced and full.ndim > 1:   # tables of different lead shapes: every slice must agree
            lead = tuple(range(full.ndim - 1))
            full, empty = full.all(lead), empty.all(lead)
        return full, empty
    return atom
