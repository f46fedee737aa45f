"""Planner pass 6: scores kept in registers (:class:`~.plan.FusedScores`).

A normalising accumulator (row statistics, weights, contraction with the weights) fed by a
contraction keeps the scores in registers when one thread mapping serves both contractions.
The scores' other readers may only be *logsumexp* accumulators over the same axis: the
normalising accumulator's own row statistics are their value (``L = mu + log z``), so they
take them (:attr:`~.plan.AccPlan.stats_of`) instead of reading the scores a second time.  This
is the FlashAttention forward with its logsumexp output (the backward's residual): one pass
over the scores, in registers.
"""

from __future__ import annotations

from dataclasses import replace

from ..relabel.loopnest import FinalForm, Update
from .emit_acc import ACC_CODEGEN
from .emit_kinds import CODEGEN_RULES
from .plan import FusedScores, Micro, Rows, Structure
from .threads import Threads


def fuse_scores(ff: FinalForm, ax, st: Structure, targets: dict, accs: list, th: Threads):
    """A normalising accumulator (row statistics, weights, contraction with the weights) fed
    by a contraction whose only other readers are logsumexps of the same rows (:func:`_siblings`)
    keeps the scores in registers when one thread mapping serves both contractions: rows of the
    statistics axis owned by the same thread in both micro-tiles, the lanes of a row an aligned
    group inside one warp, every thread active.  Then the statistics are lane reductions (warp
    shuffles), the rescale is applied to the main state in registers, and the weights go through
    a warp-private staging area (``syncwarp``, no block barrier) or stay in registers (tensor
    cores): the scores never make a round trip through a shared buffer that the whole block
    synchronises on.  Returns (accs, targets, fused score vars)."""
    dd = ff.diagram
    targets, accs = dict(targets), list(accs)
    fused: dict[int, int] = {}
    updates = {n.acc: n for n, _ in ff.walk() if isinstance(n, Update)}
    for p in list(accs):
        kind = ACC_CODEGEN[p.acc.rule]
        if not (kind.stats and p.main_regs and p.stat_regs and isinstance(p.main, Micro)):
            continue
        s, v = dd.eqns[p.acc.eqn].ins
        t = targets.get(s)
        if (t is None or t.source is None or t.source in st.acc_of_var or t.to_global
                or not isinstance(t.mapping, Micro)):
            continue
        if not CODEGEN_RULES[dd.eqns[st.eqn_of[t.source]].box.kind].contraction:
            continue
        siblings = _siblings(dd, st, accs, p, s)
        if siblings is None:
            continue
        if st.scope_of[id(st.def_node[s])] != st.scope_of[id(updates[p.index])]:
            continue
        rows = [a for a in p.stat_axes if ax[a].cap > 1]
        x = p.acc.axis
        if len(rows) != 1 or {t.mapping.row, t.mapping.col} != {rows[0], x}:
            continue
        r = rows[0]
        if r not in (p.main.row, p.main.col):
            continue
        dcol = p.main.col if p.main.row == r else p.main.row
        if (t.engine == "mma") != (p.engine == "mma"):
            continue
        joint = th.joint_frag(r, x, dcol) if p.engine == "mma" else th.joint_micro(r, x, dcol)
        if joint is None:
            continue
        ms, mo = joint
        targets[s] = replace(t, mapping=ms, to_smem=False)
        accs[p.index] = replace(p, main=mo, stat=Rows(ms), fused=FusedScores(s, t.source, ms))
        for j in siblings:
            accs[j] = replace(accs[j], stats_of=p.index)
        fused[s] = p.index
        for v2, tt in targets.items():
            if tt.source is not None and st.acc_of_var.get(tt.source) == p.index:
                targets[v2] = replace(tt, mapping=mo)
    return accs, targets, fused


def _siblings(dd, st: Structure, accs: list, p, s: int) -> tuple[int, ...] | None:
    """The logsumexp accumulators that read the scores ``s`` besides ``p`` (an online softmax),
    over the same streamed axis and the same rows; None when ``s`` has any other reader."""
    found = []
    for c in st.consumers[s]:
        if c == ("acc", p.index):
            continue
        if c[0] != "acc":
            return None
        o = accs[c[1]]
        same_rows = set(o.acc.box.cod[0].axis_names) == set(p.stat_axes)
        if (o.acc.rule != "logsumexp" or p.acc.rule != "online_softmax" or o.acc.axis != p.acc.axis
                or dd.eqns[o.acc.eqn].ins[0] != s or not same_rows or o.fused is not None):
            return None
        found.append(c[1])
    return tuple(found)
