"""Planner pass 6b: a contraction's value read again by a later epilogue on the same threads
stays in registers (:func:`register_copies`).

A target computed on a register micro-tile (a contraction and its fused elementwise chain,
tensor-core fragments or CUDA-core micro-tiles) may be read again, element for element, by the
epilogue of a later contraction on the *same* mapping in the same loop body: the backward's
``dP = dO . V^T`` read by ``dS = P * (dP - D)`` in the epilogue of ``S = Q . K^T``, or ``P`` read
by that same epilogue in the dK, dV kernel.  Each thread then owns the same elements in both
phases, so the value needs no trip through shared memory: the first phase keeps a register
copy (``cuda.local.array`` of the micro-tile's shape, unrolled into registers), the second
reads it.  When every reader is such an epilogue the shared buffer is gone too, and with it
the block barrier between the phases; a value that another phase reads differently (a
tensor-core operand, another mapping) keeps its buffer and still gets the copy for the
epilogues.  The copy holds the fp32 value, before any 16-bit rounding of the buffer.
"""

from __future__ import annotations

from dataclasses import replace

from ..relabel.loopnest import FinalForm
from .emit_kinds import CODEGEN_RULES
from .plan import Micro, Structure, Target, storage


def _epilogue_target(t: Target, st: Structure, fused) -> bool:
    """``t`` is computed as a contraction's epilogue on a micro-tile (not an accumulator's
    finalisation, not scores fused into a normalising accumulator)."""
    return (isinstance(t.mapping, Micro) and t.source is not None and t.source not in st.acc_of_var
            and t.var not in fused and t.source not in fused)


def _elementwise_reads(dd, t: Target, st: Structure, cls, n_in: int, targets, absorbed) -> tuple[set, set]:
    """(vars read element for element by the inline chain of ``t``'s epilogue, vars read any other
    way there: through an index map, or gathered)."""
    same, other = set(), set()
    todo, seen = [t.var], set()
    while todo:
        v = todo.pop()
        if v in seen or v == t.source:
            continue
        seen.add(v)
        inline = v == t.var or storage(v, n_in, targets, absorbed) == "inline"
        if not inline or v not in st.eqn_of or cls[st.eqn_of[v]] != "elementwise":
            continue
        e = dd.eqns[st.eqn_of[v]]
        rule = CODEGEN_RULES[e.box.kind]
        if rule.reads_remapped(e.box):
            other.update(e.ins)
            continue
        n = rule.n_pointwise(e.box)
        other.update(e.ins[n:])
        for a in e.ins[:n]:
            same.add(a)
            todo.append(a)
    return same, other


def register_copies(ff: FinalForm, st: Structure, cls, targets: dict, absorbed: dict,
                    fused, frag_ops=None) -> tuple[dict, dict]:
    """(targets, copies): ``copies[v]`` the targets whose epilogues read target ``v`` from its
    register copy (empty where only tensor-core updates read it so: ``frag_ops[v]``, the
    accumulators of :mod:`.frag_operands`); ``v`` loses its shared buffer (``to_smem``) when
    they are all its readers."""
    dd = ff.diagram
    n_in = len(dd.dom)
    frag_ops = frag_ops or {}
    reads = {u: _elementwise_reads(dd, t, st, cls, n_in, targets, absorbed)
             for u, t in targets.items() if _epilogue_target(t, st, fused)}
    copies, out = {}, dict(targets)
    for v, t in targets.items():
        if not _epilogue_target(t, st, fused) or t.to_global:
            continue
        scope = st.scope_of[id(st.def_node[v])]
        readers = [u for u, (same, other) in reads.items()
                   if u != v and v in same and v not in other and targets[u].mapping == t.mapping
                   and st.scope_of[id(st.def_node[u])] == scope]
        accs = set(frag_ops.get(v, ()))
        if not readers and not accs:
            continue
        copies[v] = tuple(readers)
        out[v] = replace(t, to_smem=not all(c[0] == "acc" and c[1] in accs
                                            or _read_only_by(c, set(readers), dd, st, n_in, targets, absorbed)
                                            for c in st.consumers[v]))
    return out, copies


def _read_only_by(c, readers: set, dd, st: Structure, n_in: int, targets, absorbed) -> bool:
    """Consumer ``c`` of a value is an equation whose output, followed through inline values,
    ends only in the epilogues of ``readers`` (never in an accumulator, an output, or another
    target)."""
    if c[0] != "eqn":
        return False
    for w in dd.eqn_outputs(c[1]):
        if w in targets:
            if w not in readers:
                return False
        elif storage(w, n_in, targets, absorbed) != "inline":
            return False
        elif not all(_read_only_by(c2, readers, dd, st, n_in, targets, absorbed) for c2 in st.consumers[w]):
            return False
    return True


# --------------------------------------------------------------------------- emitted

def open_copy(em, t: Target, src) -> None:
    """Declare target ``t``'s register copy (``em.reg_copy[t.var]``), if the plan keeps one: a
    local array of its micro-tile's shape, its comment naming the epilogues and the tensor-core
    updates (:mod:`.frag_operands`) that read it."""
    if t.var not in em.plan.reg_copies:
        return
    m, arr = t.mapping, em.types[t.var]
    em.reg_copy[t.var] = em.names.fresh(f"{arr.name}_r")
    whom = [em.types[u].name for u in em.plan.reg_copies[t.var]]
    whom += [f"{em.accs[i].acc.box.cod[0].name}'s update (kept in registers as its tensor-core A operand)"
             for i in em.plan.frag_operands.get(t.var, ())]
    src(f"{em.reg_copy[t.var]} = cuda.local.array(({m.RY}, {m.RX}), float32)  # {arr.name} kept for "
        f"{', '.join(whom)}")


def keep_copy(em, t: Target, env, val: str, src) -> None:
    """Write the element at ``env`` of ``t``'s register copy; a tensor-core A operand is zero
    past a ragged extent, as the 16-bit buffer it replaces was (:mod:`.frag_operands`)."""
    if t.var not in em.plan.reg_copies:
        return
    cond = em.valid(em.plan.caps(em.types[t.var].axis_names)[0], env) if t.var in em.plan.frag_operands else None
    zero = em.consts.f(0.0, "ZERO")
    src(f"{em.reg_copy[t.var]}[i, j] = " + (f"{val} if {cond} else {zero}" if cond else val))
