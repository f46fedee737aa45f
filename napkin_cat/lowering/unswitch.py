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
"""

from __future__ import annotations

from typing import Callable

UNSWITCH = True


def chunk_flags(em, v: int, stop: frozenset = frozenset()) -> tuple[str, ...]:
    """The chunk flags (:attr:`em.full_flags`) of the masks in the chain that computes ``v`` in
    registers (``v``'s own box, then its inline operands; not past ``stop``), in order."""
    out: list[str] = []
    seen: set[int] = set()

    def walk(u: int, first: bool = False):
        if u in seen or u in stop or u < em.n_in or u in em.st.acc_of_var:
            return
        seen.add(u)
        if not first and em.plan.storage(u) not in ("inline", "regs"):
            return
        e = em.dd.eqns[em.st.eqn_of[u]]
        if e.box.kind == "mask":
            flag = em.full_flags.get((e.box.param("row"), e.box.param("col"), e.box.param("pred")))
            if flag is not None and flag not in out:
                out.append(flag)
        for a in e.ins:
            if isinstance(a, int):
                walk(a)

    walk(v, first=True)
    return tuple(out)


def unswitched(em, t, src, body: Callable[[], None]) -> None:
    """``body()``, which writes the element loop of target ``t`` (its value from ``t.source`` in
    registers), under ``if flags: (masks left out) else: (as before)`` with the chunk flags of
    its masks (:func:`chunk_flags`); once, as before, where there are none or ``UNSWITCH`` is off."""
    flags = chunk_flags(em, t.var, frozenset({t.source})) if UNSWITCH else ()
    if not flags:
        body()
        return
    with src.block(f"if {' and '.join(flags)}:  # the masks keep the whole chunk: its elements without them"):
        before = em.assumed_full
        em.assumed_full = before | frozenset(flags)
        try:
            body()
        finally:
            em.assumed_full = before
    with src.block("else:"):
        body()
