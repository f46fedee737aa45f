"""Planner pass 7a: which axis each shared buffer puts last, and which fp32 buffers tensor cores
read as packed pairs (padded by :data:`FRAG_PAD` in :func:`.planner.plan_buffers`)."""

from __future__ import annotations

from ..relabel.loopnest import FinalForm
from .emit_acc import ACC_CODEGEN
from .paired_stores import prefer_columns
from .plan import Frag, Micro, Structure, acc_reduced_axes, axes_set, reduced_axes, storage

FRAG_PAD = 4
"""Floats added to each row of an fp32 shared buffer that tensor cores read as pairs along its
rows (3xTF32): lane ``(g, t)`` of a fragment reads row ``g``, column ``2t``, so rows of a multiple
of 32 floats put the 8 rows of a fragment on one bank (8-way conflicts); 4 more floats per row
leave two lanes per bank."""


def plan_layouts(ff: FinalForm, st: Structure, targets, absorbed, accs, ax,
                 sixteen=frozenset()) -> tuple[dict[tuple, str], frozenset]:
    """(``{buffer key: the axis it puts last}``, the fp32 buffers tensor cores read packed).
    Shared buffers read by a micro-tile along one axis put that axis last (contiguous); 16-bit
    buffers (inputs, and the targets in ``sixteen``) keep their own order."""
    dd = ff.diagram
    types = dd.var_types()
    n_in = len(dd.dom)
    pref: dict[tuple, str] = {}
    packed = set()

    def prefer(v, m: Micro, red=()):
        key = ("var", v)
        if storage(v, n_in, targets, absorbed) not in ("load", "smem") or key in pref:
            return
        axes = axes_set(types[v], ax)
        has_r, has_c = m.row in axes, m.col in axes
        if isinstance(m, Frag):
            # a 16-bit input or intermediate keeps its order (cp.async; ldmatrix reads either
            # orientation); other operands are packed from pairs along the reduced axis
            k = [a for a in red if a in axes]
            if k and has_r != has_c and types[v].dtype.name not in ("f16", "bf16") and v not in sixteen:
                pref[key] = k[0]
                packed.add(key)
        elif has_r != has_c:
            pref[key] = m.row if has_r else m.col

    prefer_columns(pref, targets, sixteen, types, ax)     # 16-bit fragments stored a pair per word
    for t in targets.values():
        if isinstance(t.mapping, Micro) and t.source is not None and t.source not in st.acc_of_var:
            k = st.eqn_of[t.source]
            for v in dd.eqns[k].ins:
                prefer(v, t.mapping, reduced_axes(dd.eqns[k].box))
    for p in accs:
        if isinstance(p.main, Micro) and ACC_CODEGEN[p.acc.rule].contraction:
            ins = dd.eqns[p.acc.eqn].ins
            # with row statistics the weights keep the scores' layout: the statistics read them
            # along the streamed axis (contiguous), the micro-tile reads them as broadcasts
            for v in (ins[1:] if p.stat is not None else ins):
                prefer(v, p.main, acc_reduced_axes(p.acc))
    return pref, frozenset(packed)
