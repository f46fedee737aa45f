"""Planner pass 7a: which materialised intermediates live in shared memory in 16 bits.

In a 16-bit kernel (f16 / bf16 inputs) the tensor cores read 16-bit inputs straight from their
shared buffers with ``ldmatrix``.  An intermediate written to shared memory (a
:class:`~.plan.Target` with ``to_smem``) whose *every* reader is a tensor-core contraction that
takes it as a plain operand (FlashAttention-2's backward: ``dS = P * (dP - D)``, read only by
the ``dK`` / ``dQ`` updates) is stored the same way: rounded once to the kernel's dtype where
it is written, laid out and padded like a 16-bit input buffer (:func:`sixteen_bit_buffer`), and
read by ``ldmatrix`` (``.trans`` where its layout needs it) instead of being packed into
fragments element by element.  Entries past a ragged extent are written as zero, so the
fragments read zero there as they do from a zero-filled input chunk.

One more reader is allowed, for a target a tensor-core contraction also reads: a product
(``mul`` / ``scale``, and ``neg``) inlined into the definition of another target that is itself
stored in 16 bits (FlashAttention-2's ``P``: the ``dV`` update reads it, and so does
``dS = P * (dP - D)``, rounded to 16 bits where it is stored).  A product carries the relative
error of its factor, so reading ``P`` rounded costs ``dS`` at most one more rounding of the same
size as its own; a sum or a difference could cancel (``dP - D``), so ``dP`` stays fp32.

Anything else reads fp32 values: a target that is an output, that an elementwise box, a
reduction or a normaliser reads on CUDA cores, that an accumulator reads for its row statistics,
or that is written by a cooperative mapping (not every element written) stays in an fp32 buffer.
"""

from __future__ import annotations

from dataclasses import replace

from .emit_acc import ACC_CODEGEN
from .emit_kinds import CODEGEN_RULES
from .plan import Buffer, Flat, Micro, Structure


def sixteen_bit_targets(ff, st: Structure, cls, targets, absorbed, accs, dtype: str) -> frozenset:
    """The materialised targets stored as 16-bit patterns (see the module docstring)."""
    if dtype == "f32":
        return frozenset()
    dd = ff.diagram
    chosen: set[int] = set()
    open_ = [v for v, t in targets.items()
             if t.to_smem and not t.to_global and isinstance(t.mapping, (Micro, Flat))]
    grew = True
    while grew:          # a product into a 16-bit target counts once that target is chosen
        grew = False
        for v in open_:
            if v in chosen:
                continue
            mma = [c for c in st.consumers[v] if _mma_operand(v, c, dd, st, cls, targets, absorbed, accs)]
            rest = [c for c in st.consumers[v] if c not in mma]
            if not rest or (mma and all(_product_into(v, c, dd, st, cls, targets, chosen) for c in rest)):
                chosen.add(v)
                grew = True
    return frozenset(chosen)


PRODUCTS = ("mul", "scale", "neg")
"""Elementwise functions whose result carries the relative error of a factor (no cancellation)."""


def _product_into(v: int, c: tuple, dd, st: Structure, cls, targets, chosen) -> bool:
    """Whether consumer ``c`` of ``v`` is a product inlined (through more products) into the
    definition of a target in ``chosen`` other than ``v``."""
    while True:
        if c[0] != "eqn" or cls[c[1]] != "elementwise" or dd.eqns[c[1]].box.kind != "map" \
                or dd.eqns[c[1]].box.param("fn") not in PRODUCTS:
            return False
        (u,) = dd.eqn_outputs(c[1])
        if u in targets:
            return u in chosen and u != v
        if len(st.consumers[u]) != 1:
            return False
        (c,) = st.consumers[u]


def _mma_operand(v: int, c: tuple, dd, st: Structure, cls, targets, absorbed, accs) -> bool:
    """Whether consumer ``c`` of ``v`` reads it only as an operand of a tensor-core contraction."""
    if c[0] == "eqn":
        k = c[1]
        box = dd.eqns[k].box
        if cls[k] != "reduction" or not CODEGEN_RULES[box.kind].contraction:
            return False
        (out,) = dd.eqn_outputs(k)
        t = targets.get(absorbed.get(out, out))
        return t is not None and t.source == out and t.engine == "mma"
    if c[0] == "acc":
        p = accs[c[1]]
        if p.engine != "mma" or not ACC_CODEGEN[p.acc.rule].contraction:
            return False
        ins = dd.eqns[p.acc.eqn].ins
        # with row statistics the first input (the scores) is read on CUDA cores
        return (p.stat is None and p.fused is None) or v not in ins[:1]
    return False


def sixteen_bit_buffer(b: Buffer, role: str = "") -> Buffer:
    """A buffer of 16-bit patterns (an f16 / bf16 input, or an intermediate chosen by
    :func:`sixteen_bit_targets`): rows of a multiple of 8 elements (16-byte ``cp.async`` stores,
    16-byte ``ldmatrix`` row addresses) and an odd number of 16-byte units (the 8 rows one
    ``ldmatrix`` phase reads fall in different banks).  ``role`` opens the note in parentheses
    (``"materialised, "``)."""
    if len(b.caps) < 2 or b.caps[-1] < 8:
        return replace(b, bits=16, what=b.what + f" ({role}16-bit)")
    ld = -(-b.caps[-1] // 8) * 8
    if (ld // 8) % 2 == 0:
        ld += 8
    return replace(b, bits=16, pad=ld - b.caps[-1],
                   what=b.what + f" ({role}16-bit, rows padded by {ld - b.caps[-1]})")
