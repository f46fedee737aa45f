"""Later warpgroup MMAs issued before an earlier one's epilogue: the tensor cores multiply while
the CUDA cores run the epilogue (FlashAttention-3's overlap of softmax and MMA, within one chunk).

A contraction on warpgroup MMAs (:func:`.wgmma.emit_wgmma`) is *issued* (``wgmma_fence``, its
``wgmma``\\ s, ``wgmma_commit``) and *waited for* (``wgmma_wait``) before its epilogue reads the
accumulators.  Where the next nodes of a loop body that emit code are warpgroup contractions (a
target's, or a ``sum_contract`` update's) whose operands no earlier member writes, and no barrier
or copy is due before them, each is issued right after the first one's commit, in a *run*: the
later ones' code up to their commit is written there, the rest at their own place.  Each member
then waits with depth = the groups committed after it (``wgmma.wait_group N``, groups complete in
order), and its thread coordinates (``ty``, ``tx``) are set again before its wait, since the
members issued in between set their own.  In the one-kernel attention backward: ``dP = dO V^T``
multiplies while ``P = exp(S - L)`` is computed from ``S = Q K^T``, and the updates of dV and dK
while dQ's atomic adds run.

A run has at most ``1 + MAX_AHEAD`` members.  ``ISSUE_AHEAD = False`` gives the source of before.
The simulator's twins track the groups (:class:`.tensorcore.InFlight`): accumulators unpacked
before their wait, or passed through a wait whose depth leaves their group pending, fail there.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from ..core.errors import LoweringError
from ..relabel.loopnest import Compute, Update
from . import column_values
from .plan import Frag
from .source import Source

ISSUE_AHEAD = True
"""Issue later warpgroup contractions early (False: each waited for before the next is issued,
as until the fifth session of 2026-11-29)."""
MAX_AHEAD = 2
"""Contractions issued ahead of a run's first (the wait depths the primitives provide)."""


class SplitSource(Source):
    """Writes into ``first`` (the run's slot) until :meth:`switch`, then into ``then`` (the
    node's own place); both at the same depth."""

    def __init__(self, first: Source, then: Source):   # noqa: super().__init__: no storage of its own
        self.parts, self.cur = (first, then), 0

    @property
    def _items(self):
        return self.parts[self.cur]._items

    @property
    def depth(self):
        return self.parts[self.cur].depth

    @depth.setter
    def depth(self, value):
        self.parts[self.cur].depth = value

    def switch(self) -> Source:
        if self.cur or self.parts[0].depth != self.parts[1].depth:
            raise LoweringError("internal: a contraction issued ahead switched twice or inside a block")
        self.cur = 1
        return self.parts[1]


@dataclass
class Member:
    mapping: Frag
    waits: list          # (tuple name, N, elements) of its accumulators
    wait_slot: Source
    restore: Source      # ty, tx set again before the wait (filled when the run closes)


@dataclass
class Run:
    src: Source
    ahead: Source        # where the later members are issued
    members: list = field(default_factory=list)
    writes: set = field(default_factory=set)   # variables the members define
    mark: int = 0        # the end of the last member's code in ``src``
    split: SplitSource | None = None


def _state(em):
    """The emitter's open run and the node being emitted: its depth and :func:`member_of`."""
    if not hasattr(em, "_ahead"):
        em._ahead = {"run": None, "base": None, "member": None}
    return em._ahead


def member_of(em, n):
    """``(mapping, defined variable, operand variables)`` of loop-nest node ``n`` where it is a
    warpgroup contraction that can join a run, else None."""
    if isinstance(n, Compute):
        (v,) = em.dd.eqn_outputs(n.eqn)
        t = em.targets.get(v)
        if (t is None or v in em.fused_targets or em.cls[n.eqn] == "normaliser" or t.source is None
                or t.source in em.st.acc_of_var):
            return None
        m, ins, engine = t.mapping, em.dd.eqns[em.st.eqn_of[t.source]].ins, t.engine
    elif isinstance(n, Update):
        p = em.accs[n.acc]
        if p.acc.rule != "sum_contract" or not p.main_regs:
            return None
        m, ins, engine, v = p.main, em.dd.eqns[p.acc.eqn].ins, p.engine, None
    else:
        return None
    if not (isinstance(m, Frag) and m.wg and engine == "mma" and em.micro_guard(m) is None):
        return None
    return m, v, tuple(ins)


def _joins(em, run: Run, got, src: Source) -> bool:
    return (got is not None and run.src is src and len(run.members) <= MAX_AHEAD
            and not src.since(run.mark) and not (em.pending_sync or em.pending_async)
            and all(u not in run.writes and em.plan.storage(u) in ("load", "smem", "regs") for u in got[2]))


@contextmanager
def node(em, n, src: Source):
    """Around the emission of loop-nest node ``n``: yields the source to write it into, a
    :class:`SplitSource` where it joins the open run."""
    st = _state(em)
    got = member_of(em, n)
    run = before = st["run"]
    if run is not None and not _joins(em, run, got, src):
        if got is not None:   # a contraction of its own run; a node that emits no code keeps it open
            close(em)
        run = None
    mark, outer = src.mark(), (st["base"], st["member"])
    st["base"], st["member"] = src.depth, got
    if run is None:
        yield src
        st["base"], st["member"] = outer
        if st["run"] is not None and st["run"] is not before and st["run"].src is src:   # opened by this node
            st["run"].writes.add(got[1])
            st["run"].mark = src.mark()
        elif src.since(mark):                        # code between: no later member may pass it
            close(em)
        return
    run.split = SplitSource(run.ahead, src)
    yield run.split
    st["base"], st["member"] = outer
    if run.split.cur != 1:
        raise LoweringError(f"internal: {n!r} joined a run of warpgroup MMAs but issued none")
    run.split = None
    run.writes.add(got[1])
    run.mark = src.mark()


def after_commit(em, m: Frag, waits: list, src: Source, steps: int = 0) -> Source:
    """After ``wgmma_commit`` of a contraction of ``steps`` steps on ``m`` with accumulators
    ``waits`` (``(tuple name, N, its elements)``): the source for the rest of its node; its waits,
    each followed by the accumulators' unpacking, are written now or when its run closes."""
    st = _state(em)
    run = st["run"]
    if run is not None and isinstance(src, SplitSource) and src is run.split:
        src = src.switch()
    else:
        if run is not None:
            close(em)
        if not (ISSUE_AHEAD and st["base"] == src.depth and st["member"] is not None):
            columns_before_wait(em, m, src, steps)
            write_waits(waits, 0, src)
            return src
        run = st["run"] = Run(src, src.slot())
    restore = src.slot()
    columns_before_wait(em, m, src, steps)
    run.members.append(Member(m, waits, src.slot(), restore))
    return src


def columns_before_wait(em, m: Frag, src: Source, steps: int) -> None:
    """A slot before the wait for the values of a column alone that the epilogue on ``m`` reads
    (:mod:`.column_values`), for a contraction of at least :data:`~.column_values.BEFORE_WAIT`
    steps: they read shared memory, indices and constants, never the pending accumulators, so
    their loads overlap the wait."""
    least = column_values.BEFORE_WAIT
    em.columns_slot = (m, src.slot()) if least and steps >= least else None


def write_waits(waits: list, depth: int, src: Source) -> None:
    for t, n, elems in waits:
        src(f"{t} = wgmma_wait{depth or ''}_n{n}({t})")
        src(f"{', '.join(elems)} = {t}")


def close(em) -> None:
    """Fix the open run's wait depths (and ``ty``, ``tx`` before each member's wait where more
    than one was issued)."""
    st = _state(em)
    run, st["run"] = st["run"], None
    if run is None:
        return
    last = len(run.members) - 1
    for i, mem in enumerate(run.members):
        if last:
            em.micro_begin(mem.mapping, mem.restore)
        write_waits(mem.waits, last - i, mem.wait_slot)
