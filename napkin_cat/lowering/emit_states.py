"""Where an accumulator's states live in a generated kernel (:func:`state_ref`), and the
online softmax's normaliser kept as per-lane parts through the stream (:data:`DEFER_ROW_SUMS`).
Used by the accumulator emitters (:mod:`.emit_acc`); ``em`` is the renderer (:class:`.emit.Emitter`).
"""

from __future__ import annotations

from .plan import AccPlan, Rows
from .source import Source


def state_names_of(em, p: AccPlan):
    names = em.state_names.setdefault(p.index, {})
    if not names:
        oname = p.acc.box.cod[0].name
        for sname, _, _ in p.acc.states():
            names[sname] = em.names.fresh(f"{oname}_{sname}")
    return names


def state_ref(em, p: AccPlan, sname: str, env) -> str:
    """Where state ``sname`` is at the element ``env`` of its mapping."""
    role = {s: r for s, _, r in p.acc.states()}[sname]
    regs = p.main_regs if role == "main" else p.stat_regs
    if regs and role != "main" and isinstance(p.stat, Rows):
        return f"{state_names_of(em, p)[sname]}[{env['_row']}]"
    if regs:
        return f"{state_names_of(em, p)[sname]}[{env['_slot']}]"
    return em.sread(("state", p.index, sname), env)


DEFER_ROW_SUMS = True
"""An online softmax (or normalisation) whose rows are spread over several lanes, statistics in
registers, keeps each lane's own part of the normaliser ``z`` through the stream and sums the
lanes once at the end (:func:`sum_deferred_z`), not once per chunk: every lane of a row scales
its part by the same ``delta``, so the parts add up to the row's ``z``."""


def defers_row_sum(em, p: AccPlan) -> bool:
    """Whether ``p``'s fused update leaves ``z`` as per-lane parts (noted in ``em.deferred_z``)."""
    if not (DEFER_ROW_SUMS and p.stat_regs and isinstance(p.stat, Rows) and p.fused.ms.TX > 1):
        return False
    em.deferred_z.add(p.index)
    return True


def sum_deferred_z(em, p: AccPlan, src: Source) -> None:
    """The lanes' parts of each row's ``z`` summed into every lane of the row, once, before the
    first reader after the stream (the finalisation, or a logsumexp of these statistics)."""
    if p.index not in em.deferred_z:
        return
    em.deferred_z.discard(p.index)
    ms, k = p.fused.ms, em.consts
    src.comment(f"the row normalisers of {p.acc.box.cod[0].name}: each lane's part summed over the row's lanes")
    em.micro_begin(ms, src)
    with src.block(f"for i in range({k.u(ms.RY)}):"):
        z_ref = state_ref(em, p, "z", {"_row": "i"})
        src(f"{z_ref} = _group_sum({z_ref}, tx, {k.u(ms.TX)}, smem, {em.red_offset()}, tid)")
