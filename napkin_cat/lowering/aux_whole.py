"""Auxiliary tensors loaded whole into each block where that costs the kernel no blocks per SM.

:data:`~napkin_cat.relabel.loopnest.AUX_WHOLE_BYTES` leaves an auxiliary tensor larger than
16 KiB in HBM, each gather reading its entry there (through the caches): at N = 16384 the
document ids (64 KiB) and the block table of the one-kernel backward.  That default is right
for a kernel whose blocks share an SM (the forward on 128 threads runs 4 blocks of 55 KB; 64 KiB
more each would leave 2), and wrong for one that runs alone on its SM anyway (the one-kernel
backward, 384 threads, one block by its registers): its free shared memory holds both tensors.
Measured on an H200 (fp16, N = 16384, d = 64, 16 heads, 13 documents; ``kernels/probes/
document_breakdown.py``, kernels/BENCHMARKS.md): the backward kernel 1.167 ms with the ids and
its table read in place, 0.974 loaded whole; the forward 0.446 in place, 0.560 whole.

:func:`widened` places such a tensor at ``"SMEM"`` (what ``d.place(name, "SMEM")`` asks for)
when the kernel re-planned with it keeps its blocks per SM and fits a block's shared memory,
smallest first.  Only for a GPU: in the simulator the size alone decides, so both reads stay
reachable by the tests at their small sizes.  A tensor the user placed keeps its placement.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..relabel.loopnest import aux_in_place, final_form

SWITCH = True
"""Load an auxiliary tensor whole into each block where that costs no blocks per SM (see above);
``False``: :data:`~napkin_cat.relabel.loopnest.AUX_WHOLE_BYTES` alone decides."""

LEVEL = "SMEM"


def widened(sched, gen, regenerate, limits, limit: int):
    """``(sched, gen)`` with every auxiliary tensor the final form leaves in HBM by its size
    placed whole in shared memory where ``regenerate(sched)`` (a new plan and source) keeps
    ``gen``'s blocks per SM (``limits``: the device's) and ``limit`` bytes per block; as given
    where none does."""
    if not SWITCH:
        return sched, gen
    d = sched.diagram
    user = {r.extra[0] for r in d.schedule if r.op == "place"}
    sizes = {a.name: a.dtype.bytes * math.prod(x.size for x in a.axes) for a in d.dom}
    whole = []
    for name, _ in sorted(aux_in_place(d, user), key=lambda p: sizes[p[0]]):
        trial = _placed(sched, name)
        twin = regenerate(trial)
        smem = twin.plan.smem_bytes
        fits = smem <= limit and limits.max_shared_per_sm // (smem + limits.reserved_shared_per_block) >= gen.blocks
        if fits and twin.blocks >= gen.blocks:
            sched, gen = trial, twin
            whole.append(f"{name} ({sizes[name]} B)")
    if not whole:
        return sched, gen
    note = (f"Loaded whole into each block, as their shared memory keeps {gen.blocks} block(s) per SM: "
            f"{', '.join(whole)} (lowering/aux_whole.py).")
    return sched, replace(gen, notes=(*gen.notes, note))


def _placed(sched, name: str):
    d = sched.diagram.place(name, LEVEL)
    return replace(sched, diagram=d, final_form=final_form(d))

