"""16-bit fragments stored to shared memory a column pair per 32-bit word: an emitter pass.

A materialised 16-bit intermediate (:mod:`.sixteen_bit`: the one-kernel backward's ``dS``, read
by the dQ contraction through ``ldmatrix``) written from tensor-core fragments puts the
fragments' column axis last (:func:`prefer_columns`), so lane ``(g, t)``'s columns ``2t`` and
``2t + 1`` are adjacent halves of one 32-bit word: one packed store per pair
(:func:`stored_pair`) instead of two 16-bit stores and their byte permutes.  ``ldmatrix`` reads
either orientation (``.trans`` where needed), so the readers are unchanged.  The same column pairs
go as one reduction into an output blocks add into (:meth:`.emit.Emitter.write_target`,
:func:`.atomics.atomic_add_pair`), and as one 32-bit store into a 16-bit output in global memory
(:func:`global_pair`: a warp's store then fills 16 of a sector's 32 bytes, not 8): all collect
them by :func:`column_pair`.
"""

from __future__ import annotations

from contextlib import contextmanager

from .plan import Frag, axes_set
from .tensorcore import DTYPES

PAIRED_STORES = True
"""Store 16-bit fragment pairs as one word (False: one 16-bit store per element, the writer's
layout not preferred, as until the fourth session of 2026-11-25)."""


def prefer_columns(pref: dict, targets, sixteen, types, ax) -> None:
    """Each materialised 16-bit target written by fragments puts their column axis last (an even
    extent), unless another rule already chose."""
    for t in targets.values():
        m, key = t.mapping, ("var", t.var)
        if not (PAIRED_STORES and t.to_smem and t.var in sixteen and isinstance(m, Frag)) or key in pref:
            continue
        axes = axes_set(types[t.var], ax)
        if m.row in axes and m.col in axes and ax[m.col].cap % 2 == 0:
            pref[key] = m.col


def fragment_pairs(m, env, last: str | None) -> bool:
    """Whether an element loop over fragments ``m`` (``env``) holds each lane's column pair
    ``(2t, 2t + 1)`` as neighbours along ``last``, an array's last axis."""
    return isinstance(m, Frag) and env.get("_hoist") is not None and "," in env.get("_slot", "") and last == m.col


@contextmanager
def column_pair(em, name: str, purpose: str, val: str, env, src):
    """Collect ``val`` into a two-value register array declared in the fragment row's slot; the
    body runs at the pair's odd column, with the array's name."""
    k = em.consts
    pair = em.names.fresh(f"{name}_pair")
    env["_hoist"].src(f"{pair} = cuda.local.array(2, float32)  # a column pair of {name}, {purpose}")
    j = env["_slot"].split(",")[-1].strip()
    src(f"{pair}[{j} % {k.u(2)}] = {val}")
    with src.block(f"if {j} % {k.u(2)} == {k.u(1)}:"):
        yield pair


def stored_pair(em, t, env, val: str, cond: str | None, src) -> bool:
    """Store target ``t``'s 16-bit value ``val`` (zero where ``cond`` fails) a column pair per
    word, packed at the odd column (:func:`column_pair`).  False (nothing emitted) where that does
    not apply: not fragments, the column axis not last, ragged or of odd extent."""
    m, key = t.mapping, ("var", t.var)
    b = em.bufs[key]
    if not (PAIRED_STORES and b.axes and fragment_pairs(m, env, b.axes[-1])):
        return False
    a = em.ax[m.col]
    if a.ragged or a.cap % 2 or b.ld % 2:
        return False
    k = em.consts
    if not em.smem32_declared:
        em.smem32_slot("smem32 = cuda.shared.array(0, dtype=uint32, alignment=SMEM_ALIGN)  # the same memory, "
                       "32-bit words")
        em.smem32_declared = True
    name = em.types[t.var].name
    with column_pair(em, name, "stored as one word", f"{val} if {cond} else {k.f(0.0, 'ZERO')}" if cond else val,
                     env, src) as pair:
        word = f"({em.s16base(key)} + {em.sidx(b, env)}) // {k.u(2)}"
        src(f"smem32[{word}] = {DTYPES[em.plan.dtype].pack}({pair}[0], {pair}[1])")
    return True


def adds_pairs(em, t, arr, env, paired: bool = True) -> bool:
    """Whether output ``t`` that blocks add into goes a fragment column pair per reduction
    (:func:`.atomics.atomic_add_pair`): adjacent words of its last axis, an even extent."""
    if not (paired and arr.axis_names and fragment_pairs(t.mapping, env, arr.axis_names[-1])):
        return False
    a = em.ax[t.mapping.col]
    return a.size % 2 == 0 and a.cap % 2 == 0


def global_pair(em, t, arr, env, val: str, out: str, src) -> bool:
    """Store 16-bit output ``arr``'s value ``val`` a fragment column pair per 32-bit word
    (``st_pair16``; the output starts on a 4-byte boundary, :func:`.io.check_out`).  False (nothing
    emitted) where that does not apply: not 16-bit, not fragments, the column axis not last or of
    odd extent."""
    dt = DTYPES.get(arr.dtype.name)
    if not (PAIRED_STORES and dt and arr.axis_names and fragment_pairs(t.mapping, env, arr.axis_names[-1])):
        return False
    a = em.ax[t.mapping.col]
    if a.size % 2 or a.cap % 2:
        return False
    with column_pair(em, arr.name, "stored as one word", val, env, src) as pair:
        src(f"st_pair16({out}, {em.gindex(arr, env)} - {em.consts.u(1)}, {dt.pack}({pair}[0], {pair}[1]))")
    return True
