"""Planner pass 6a: a tensor-core operand that never leaves the registers (:func:`frag_operands`).

An accumulator updated on tensor-core fragments, ``o[r, c] += sum_k A[r, k] B[k, c]``, whose row
operand ``A`` is itself computed in the same loop body as a tensor-core contraction's epilogue
(FlashAttention-2's backward: ``dV += P^T dO`` and ``dK += dS^T Q`` in the dK, dV kernel,
``dQ += dS K`` in the dQ kernel) can read ``A`` from the registers that computed it: the C
fragment of two adjacent 8-column tiles of ``A`` over ``(r, k)`` is the A fragment of one 16-wide
step of the update (:attr:`.emit_threads.Operand.frag`), provided both run on the same warps
along ``r`` and every warp holds all of ``k`` (:meth:`.threads.Threads.joint_frag`: ``Wn == 1``).

So this pass re-maps ``A``'s phase to fragments over ``(r, k)`` (rows ``r``: the scores are then
computed transposed, ``S^T = K Q^T``, as FlashAttention-2's dK, dV kernel does) and the
accumulator to fragments over ``(r, c)`` with the same warps along ``r``.  The targets whose
epilogues read each other element for element on the same threads (``dS = P (dP - D)`` reads
``P`` and ``dP``: :mod:`.register_copies`) move with it, so those reads stay in registers too.
:func:`.register_copies.register_copies` then keeps ``A``'s fp32 value in a register copy that
the update packs into 16-bit pairs, and drops ``A``'s shared buffer (and the block barriers
around it) when nothing else reads it.  The pairs are rounded once, as the 16-bit buffer they
replace was (:mod:`.sixteen_bit`); entries past a ragged ``k`` are written as zero in the copy,
as that buffer had them.

Only the mappings change: a value read any other way is still written where that reader finds
it, so the pass never makes a kernel wrong, at worst it keeps a buffer it meant to drop.
"""

from __future__ import annotations

from dataclasses import replace

from ..relabel.loopnest import FinalForm, Update
from .emit_acc import ACC_CODEGEN
from .plan import Frag, Structure, acc_reduced_axes, axes_set
from .register_copies import _elementwise_reads, _epilogue_target
from .threads import Threads


def frag_operands(ff: FinalForm, ax, st: Structure, cls, targets: dict, absorbed: dict, accs: list,
                  th: Threads, fused) -> tuple[dict, list, dict]:
    """(targets, accs, operands): ``operands[v]`` the accumulators that read target ``v`` as
    their row operand from its registers (see the module docstring)."""
    dd = ff.diagram
    types = dd.var_types()
    targets, accs = dict(targets), list(accs)
    updates = {n.acc: n for n, _ in ff.walk() if isinstance(n, Update)}
    n_in = len(dd.dom)
    groups = _epilogue_groups(dd, st, cls, targets, absorbed, fused, n_in)
    operands: dict[int, tuple[int, ...]] = {}
    for p in list(accs):
        if (p.engine != "mma" or not isinstance(p.main, Frag) or not p.main_regs or p.fused is not None
                or p.stat is not None or not ACC_CODEGEN[p.acc.rule].contraction):
            continue
        red = [a for a in acc_reduced_axes(p.acc) if ax[a].cap > 1]
        if len(red) != 1:
            continue
        (k,) = red
        r, c = p.main.row, p.main.col
        for v in dd.eqns[p.acc.eqn].ins:
            t = targets.get(v)
            if (t is None or t.engine != "mma" or not isinstance(t.mapping, Frag) or t.to_global
                    or not _epilogue_target(t, st, fused) or axes_set(types[v], ax) != frozenset((r, k))):
                continue
            if st.scope_of[id(st.def_node[v])] != st.scope_of[id(updates[p.index])]:
                continue
            joint = th.joint_frag(r, k, c)
            if joint is None:
                continue
            ms, mo = joint
            group = groups[v]
            if any(targets[u].mapping not in (ms, t.mapping) for u in group):
                continue      # another accumulator already re-mapped part of the group differently
            for u in group:
                targets[u] = replace(targets[u], mapping=ms)
            accs[p.index] = replace(p, main=mo)
            for v2, tt in targets.items():      # the accumulator's finalisation reads its state
                if tt.source is not None and st.acc_of_var.get(tt.source) == p.index:
                    targets[v2] = replace(tt, mapping=mo)
            operands[v] = operands.get(v, ()) + (p.index,)
            break                               # one row operand per update
    return targets, accs, operands


def _epilogue_groups(dd, st: Structure, cls, targets, absorbed, fused, n_in: int) -> dict[int, frozenset]:
    """Epilogue targets joined when one's epilogue reads another element for element on the
    same mapping in the same loop body (the reads :mod:`.register_copies` keeps in registers)."""
    ep = {v: t for v, t in targets.items() if _epilogue_target(t, st, fused)}
    parent = {v: v for v in ep}

    def find(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for u, t in ep.items():
        same, _ = _elementwise_reads(dd, t, st, cls, n_in, targets, absorbed)
        for v in same:
            if (v in ep and v != u and ep[v].mapping == t.mapping
                    and st.scope_of[id(st.def_node[v])] == st.scope_of[id(st.def_node[u])]):
                parent[find(u)] = find(v)
    members: dict[int, set] = {}
    for v in ep:
        members.setdefault(find(v), set()).add(v)
    return {v: frozenset(members[find(v)]) for v in ep}
