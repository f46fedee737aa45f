"""Element loops written twice: once for a chunk that its masks keep whole, once for the rest.

A stream loop's chunk flags (:meth:`.emit_loads.Loads._chunk_flags`) say when a mask keeps the
whole chunk for the block's rows; :func:`.emit_kinds._expr_mask` then reads ``full or keep``, so
the mask's own arithmetic (its comparisons, its gathers) is not evaluated there.  But that test
stays in every element: after the compiler unrolls a fragment's loops, each element carries its
own branch on the flag.  Measured with Nsight Compute on the H200 (the document mask's backward,
fp16, N = 16384, ``kernels/probes/document_breakdown.py --ncu``): 313 M executed warp
instructions against FlexAttention's 255 M, with 26 M uniform compares (UISETP), 14 M predicate
operations (PLOP3) and 6 M uniform votes (VOTEU) that FlexAttention has none or few of.
FlexAttention's kernels loop over the partial blocks with the mask and over the full ones without.

Here the element loops of a target whose value reads such masks are written out twice under one
test of the flags: with every flag true, where the masks are left out (``em.assumed_full``), and
otherwise as before.  The flags are the same in every thread of the block, so the branch never
diverges.  ``UNSWITCH = False`` gives the single loop with the test in each element, for
measurement: on the H200 the document mask's forward at N = 16384 took 0.407 ms with it against
0.446 without (FlexAttention 0.417), its backward 0.964 against 0.977, and masks that compare
indices only (causal, windows) were level (kernels/BENCHMARKS.md, "fourth" session of 2026-11-29).

The chunks that are not kept whole are written once more for each value of the block-table
comparisons their masks read (``bt[i // R, j // C] >= 1``, ``>= 2``: :class:`~napkin_cat.ops.index_support.BlockAtom`)
where the tile and the chunk read one table entry: such a comparison has one value over the whole
chunk (its flag, :meth:`.emit_tables.TableReads._block_atom`), so each version has the mask with
those comparisons replaced by constants and folded (:func:`assumed`).  A derived table's
"partial" chunk then compares only the data (``doc[i] == doc[j]`` and the bounds), its "whole"
chunk on the diagonal only the bounds.  Before, each element of such a chunk compared the entry
twice and the bound twice besides the ids (five float compares an element in the SASS; Nsight
Compute on the H200, the causal document mask at d = 128, N = 4096, f16: the forward ran 50.4 M
warp instructions to FlexAttention's 31.4 M, 7.0 M of them FSETP to its 0.17 M).  Measured there,
kernel ms with and without (``ATOM_VERSIONS = 0``, the form before, in the same run): forward
0.153 against 0.156, backward 0.329 against 0.341; at d = 64 forward + backward 0.322 against 0.328
(kernels/BENCHMARKS.md, "Third session of 2026-12-01"; kernels/logs/table_versions_h200.log).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from ..ops.index_expr import Ix
from ..ops.index_support import BlockAtom, with_atoms
from .source import render_code

UNSWITCH = True

ATOM_VERSIONS = 2
"""At most this many block-table comparisons are written out by value (2 ** n versions of a
partial chunk's element loop, those no table value reaches left out); more: one version."""


def chunk_flags(em, v: int, stop: frozenset = frozenset()) -> tuple[str, ...]:
    """The chunk flags (:attr:`em.full_flags`) of the masks in the chain that computes ``v`` in
    registers (``v``'s own box, then its inline operands; not past ``stop``), in order."""
    out: list[str] = []
    for key in _chain_masks(em, v, stop):
        flag = em.full_flags.get(key)
        if flag is not None and flag not in out:
            out.append(flag)
    return tuple(out)


def atom_flags(em, v: int, stop: frozenset = frozenset()) -> tuple[tuple[BlockAtom, str], ...]:
    """``(comparison, flag)`` of the block-table comparisons that the masks of ``v``'s chain
    (:func:`chunk_flags`) read at one entry per chunk: the flag is the comparison's value there."""
    out: list = []
    for key in _chain_masks(em, v, stop):
        for k, flag in em.full_flags.items():
            if len(k) == 4 and k[:3] == key and isinstance(k[3][0], BlockAtom) and (k[3][0], flag) not in out:
                out.append((k[3][0], flag))
    return tuple(out)


def _chain_masks(em, v: int, stop: frozenset) -> tuple[tuple, ...]:
    """``(row, col, predicate)`` of each mask in the chain that computes ``v`` in registers."""
    out: list[tuple] = []
    seen: set[int] = set()

    def walk(u: int, first: bool = False):
        if u in seen or u in stop or u < em.n_in or u in em.st.acc_of_var:
            return
        seen.add(u)
        if not first and em.plan.storage(u) not in ("inline", "regs"):
            return
        e = em.dd.eqns[em.st.eqn_of[u]]
        if e.box.kind == "mask":
            key = (e.box.param("row"), e.box.param("col"), e.box.param("pred"))
            if key not in out:
                out.append(key)
        for a in e.ins:
            if isinstance(a, int):
                walk(a)

    walk(v, first=True)
    return tuple(out)


def unswitched(em, t, src, body: Callable[[], None], m=None) -> None:
    """``body()``, which writes the element loop of target ``t`` (its value from ``t.source`` in
    registers, on micro-tile ``m``), under ``if flags: (masks left out) else: (as before)`` with the
    chunk flags of its masks (:func:`chunk_flags`), the ``else`` once per value of their
    block-table comparisons (:func:`_by_value`), those of one entry per chunk or per warp
    (:func:`_warp_entries`); once, as before, where there are none or ``UNSWITCH`` is off."""
    stop = frozenset({t.source})
    flags = chunk_flags(em, t.var, stop) if UNSWITCH else ()
    masks = _chain_masks(em, t.var, stop) if UNSWITCH else ()

    def partial():
        with _warp_entries(em, src, masks, m, len(atom_flags(em, t.var, stop))):
            atoms = atom_flags(em, t.var, stop) if UNSWITCH else ()
            atoms = atoms if len(atoms) <= ATOM_VERSIONS else ()
            _by_value(em, src, atoms, body, masks if atoms else ())
    if not flags:
        partial()
        return
    with src.block(f"if {' and '.join(flags)}:  # the masks keep the whole chunk: its elements without them"):
        with _assuming(em, flags):
            body()
    with src.block("else:"):    # one flag: known false here
        with _assuming(em, (("not", flags[0]),) if len(flags) == 1 else ()):
            partial()


@contextmanager
def _warp_entries(em, src, masks: tuple, m, chunk_atoms: int):
    """Within: the block-table comparisons of ``masks`` whose tile spans several table blocks
    (:class:`WarpEntry`) but whose warps' rows each lie inside one, on fragment ``m``:
    each warp's entry read and compared, the flags in :attr:`em.full_flags` as a chunk's one entry
    (:func:`atom_flags`) and in :attr:`em.warp_flags` (they do not say the stream loop skips the
    chunk: :func:`_skipped`).  The flags are the same in every lane of a warp, so the versions by
    value never diverge within one (they have no barrier of the block).  Nothing where the versions
    would be past :data:`ATOM_VERSIONS` with the ``chunk_atoms`` of one entry per chunk."""
    from .plan import Frag
    found = [(key, k, w) for key in masks for k, w in em.full_flags.items()
             if isinstance(w, WarpEntry) and k[:3] == key] if isinstance(m, Frag) else []
    found = [(key, k, w, w.indices(em, m)) for key, k, w in found]
    found = [f for f in found if f[3] is not None]
    if not found or chunk_atoms + len(found) > ATOM_VERSIONS:
        yield
        return
    reads: dict = {}
    added = [((*key, k[3][1:]), em.entry_test(w.v, w.axes, idx, w.at, reads, src)) for key, k, w, idx in found]
    before = em.warp_flags
    for k, flag in added:
        em.full_flags[k] = flag
    em.warp_flags = before | {flag for _, flag in added}
    try:
        yield
    finally:
        for k, _ in added:
            del em.full_flags[k]
        em.warp_flags = before


def _by_value(em, src, atoms, body: Callable[[], None], masks: tuple, values: tuple = ()) -> None:
    """``body()`` once for each value of the block-table comparisons ``atoms`` (``(comparison,
    flag)``) that some table entry gives, under tests of their flags; inside, each comparison is
    assumed (``values``: ``(comparison, flag, value)``; :func:`assumed`).  Values under which one
    of ``masks`` (the chain's) masks the whole chunk, which the stream loop then skips, get no
    code (:func:`_skipped`)."""
    if not atoms:
        if _skipped(em, masks, values):
            src("pass  # the block table masks such a chunk whole: the loop skips it")
            return
        with _assuming(em, tuple(flag if value else ("not", flag) for _, flag, value in values)):
            body()
        return
    (at, flag), rest = atoms[0], atoms[1:]
    reached = [value for value in (True, False) if _reachable(values + ((at, flag, value),))]
    if len(reached) == 1:
        _by_value(em, src, rest, body, masks, values + ((at, flag, reached[0]),))
        return
    where = "this warp's part of the chunk" if flag in em.warp_flags else "the whole chunk"
    with src.block(f"if {flag}:  # the block table's {_describe(at)} holds over {where}"):
        _by_value(em, src, rest, body, masks, values + ((at, flag, True),))
    with src.block("else:"):
        _by_value(em, src, rest, body, masks, values + ((at, flag, False),))


class _Unknown:
    """:func:`~napkin_cat.ops.index_support.chunk_state`'s logic where only constants matter:
    a condition on the bounds is not known here (the chunk's own test decides it)."""

    le = and_ = or_ = staticmethod(lambda a, b: "?")


def _skipped(em, masks: tuple, values: tuple) -> bool:
    """Whether the assumed block-table values (``(comparison, flag, value)``) alone make one of
    ``masks`` mask the whole chunk, where the stream loop skips such chunks (the chunk's extent
    recorded by :meth:`.emit_loads.Loads._chunk_flags`): code written for them never runs."""
    from .source import CodeAlgebra
    known = {(at, _lead(at)): value for at, flag, value in values if flag not in em.warp_flags}

    def atom(at):
        value = known.get((at, _lead(at)))
        return (False, False) if value is None else (value, not value)
    for key in masks:
        extent = em.full_flags.get((*key, ("skips",)))
        if extent is not None and key[2].chunk_state(*extent, CodeAlgebra, _Unknown, atom)[1] is True:
            return True
    return False


def _lead(at: BlockAtom) -> tuple:
    return tuple(k.key() for k in at.lead)


@contextmanager
def _assuming(em, facts: tuple):
    """Within: ``facts`` (flags known true, ``("not", flag)`` known false) in ``em.assumed_full``."""
    before = em.assumed_full
    em.assumed_full = before | frozenset(facts)
    try:
        yield
    finally:
        em.assumed_full = before


def _describe(at: BlockAtom) -> str:
    ops = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
    return f"{at.table.name}[i // {at.rows}, j // {at.cols}] {ops[at.cmp]} {at.c}"


def _reachable(values: tuple) -> bool:
    """Whether one entry of each table gives every comparison of ``values`` (``(comparison, flag,
    value)``) its value: comparisons of one entry with constants, tried at each constant, between
    each two and beyond them."""
    groups: dict = {}
    for at, flag, value in values:
        groups.setdefault((at.table.name, at.rows, at.cols, tuple(k.key() for k in at.lead)), []).append((at, value))
    for group in groups.values():
        cs = sorted({float(at.c) for at, _ in group})
        tries = cs + [(a + b) / 2 for a, b in zip(cs, cs[1:])] + [cs[0] - 1, cs[-1] + 1]
        if not any(all(at.holds(v) == value for at, value in group) for v in tries):
            return False
    return True


def assumed(em, box, pred, expr: Ix) -> Ix:
    """``expr``, the mask ``box``'s index expression over its rows and columns, with each block-table
    comparison whose value the code being written assumes (:func:`_by_value`) replaced by that
    value, and folded (:func:`~napkin_cat.ops.index_support.fold`); ``expr`` itself where there is none."""
    key = (box.param("row"), box.param("col"), pred)
    known = {}     # (comparison, its slice's indices) -> value
    for k, flag in em.full_flags.items():
        if len(k) == 4 and k[:3] == key:
            if flag in em.assumed_full:
                known[k[3]] = True
            elif ("not", flag) in em.assumed_full:
                known[k[3]] = False
    if not known:
        return expr
    return with_atoms(expr, lambda at: known.get((at, tuple(k.key() for k in at.lead))),
                      box.param("row"), box.param("col"))


@dataclass(frozen=True)
class WarpEntry:
    """A block-table comparison of a mask over a tile x chunk that spans several of the table's
    blocks: the table (variable ``v``, its ``axes``), the slice's indices ``lead`` (code), the
    comparison ``at``, the tile's and the chunk's axes ``over`` and their first indices
    ``starts`` (:class:`~.source.Code`), in the mask's (row, column) order; recorded by
    :meth:`.emit_tables.TableReads._block_atom`."""
    v: int
    axes: tuple
    lead: tuple
    at: object
    over: tuple
    starts: tuple

    def indices(self, em, m) -> tuple | None:
        """The code of the one table entry that each warp of fragment ``m`` (:class:`~.plan.Frag`)
        reads, where the rows (columns) of each warp lie inside one table block: ``m``'s warps
        ``16 * MT`` rows (``8 * NT`` columns) apart, their extent dividing the block and the tile's;
        else None."""
        k = em.consts
        out = []
        narrowed = False
        for ax_, blk, axis, lo in zip(self.axes[len(self.lead):], (self.at.rows, self.at.cols), self.over, self.starts):
            cap = em.ax[axis].cap
            base, extent = "", cap
            if axis == m.row and m.Wm > 1:
                base, extent = f" + ty // {k.u(8)} * {k.u(16 * m.MT)}", 16 * m.MT
            elif axis == m.col and m.Wn > 1:
                base, extent = f" + tx // {k.u(4)} * {k.u(8 * m.NT)}", 8 * m.NT
            if em.ax[axis].role not in ("grid", "stream") or blk % extent or cap % extent:
                return None
            narrowed |= extent < cap
            last = k.u(em.sizes[ax_] - 1)
            out.append(f"uint32(min(({render_code(lo, k.u)}{base}) // {k.u(blk)}, {last}))")
        return (*self.lead, *out) if narrowed else None
