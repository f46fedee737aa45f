"""Threads for blocks the user gave: where the schedule's threads cannot split a 16-bit kernel's
given blocks into tensor-core fragments, the warpgroup multiples that can are tried.

``nc.lower(d, tiles=...)`` without ``threads`` takes the threads the schedule measured best for
``d``'s kind: 384 for the d = 128 warpgroup forward, three warpgroups of 64 rows.  Given 128-row
tiles, 12 warps split no 128 x 128 block into whole 16 x 8 tiles, so that forward's contractions
fell to CUDA cores.  On an H200 it took 19.9 ms, where 256 threads take about 1.1
(kernels/BENCHMARKS.md, fifth session of 2026-11-29).  So, for given tiles, no ``threads``, a
16-bit kernel for a GPU and a contraction left on CUDA cores, the block is planned again with
each of :data:`CANDIDATES` threads.  The first that leaves fewer contractions on CUDA cores is
kept, and the kernel's notes say so.  Threads the user gives are never changed.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.errors import LoweringError

CANDIDATES = (256, 128, 512)
"""Threads tried, in order: two warpgroups, one, four."""


def on_cuda_cores(plan) -> int:
    """The contractions of ``plan`` (targets' and accumulators') that run on CUDA cores."""
    engines = [t.engine for t in plan.targets.values()] + [p.engine for p in plan.accs]
    return sum(e == "cuda_core" for e in engines)


def refit(sched, gen, choose, make, prefetch):
    """``(sched, gen)``, or the schedule with other threads (``choose(T)``) and its generated
    kernel (``make(prefetch, schedule)``) where those put more of a 16-bit kernel's contractions
    on tensor cores."""
    left = on_cuda_cores(gen.plan)
    if not left or gen.plan.dtype == "f32":
        return sched, gen
    for T in CANDIDATES:
        if T == sched.threads:
            continue
        try:
            other = choose(T)
            note = (f"Threads: {T}, not the {sched.threads} chosen for this kind of kernel: those split the "
                    f"given blocks into no tensor-core fragments for {left} contraction(s) (.tile_threads).")
            other = replace(other, notes=[*other.notes, note])
            made = make(prefetch, other)
        except LoweringError:
            continue
        if on_cuda_cores(made.plan) < left:
            return other, made
    return sched, gen
