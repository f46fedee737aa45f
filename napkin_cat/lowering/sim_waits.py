"""The simulator's waits fail fast on a deadlock, naming what each thread waits for.

The simulated twins of named barriers (:class:`.tensorcore._NamedBarrier`, which the warp and
warpgroup exchanges of :func:`.tensorcore._group_barrier` use too) and of ``mbarrier`` waits
(:class:`.tma._MBarrier`) block a simulator thread until other threads arrive.  A kernel whose
protocol is wrong (an arrival missing, a barrier of the wrong count, a wait for a phase nobody
completes) used to hang there until a timeout of 300 or 600 seconds; a fuzzing run or a user's
``nc.lower`` stalled that long before saying anything.

Here a wait is taken in slices (:data:`SLICE_S`).  Once no thread has arrived anywhere for
:data:`STALL_S` seconds, a waiting thread looks at the other threads of its block: when every live
one is blocked (in one of these waits, its wait not yet over, or at the simulator's
``cuda.syncthreads``, which releases only when all are there), nobody can release anyone:
:class:`Deadlock` is raised, with a count of the threads at each wait.  A thread that computes, or
sleeps, is not blocked, so a slow block is never taken for a deadlock; nor is a thread whose wait
is over (its barrier completed) and that has not yet woken: with hundreds of simulator threads on
a loaded machine that wake can take longer than :data:`STALL_S` (two slow-tier runs of CI reported
such a block, 511 of 512 arrived, as a deadlock), so each wait says, changing nothing, whether it
is over (``released``) and the look asks it.  Arrivals bump a counter (:func:`progress`): a look
during which one arrives reports nothing.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from typing import Callable

SLICE_S = 1.0
"""How long a wait sleeps between looks at its block."""

STALL_S = 5.0
"""How long every live thread of a block must have been blocked, with no arrival anywhere, before
the wait reports a deadlock."""

_ARRIVALS = [0]
_LAST_ARRIVAL = [time.monotonic()]
_BLOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # launch -> {block: {threads that waited}}


class Deadlock(RuntimeError):
    """Every live thread of a simulated block waits and none can arrive."""


def progress() -> None:
    """Count an arrival (at a barrier, an ``mbarrier``, an exchange): a deadlock needs none."""
    _ARRIVALS[0] += 1
    _LAST_ARRIVAL[0] = time.monotonic()


def _block_threads(me) -> list | None:
    """The threads of ``me``'s launch and block that are alive or have waited here (a thread a
    deadlock has ended is no longer alive, and still counts), or None for a thread of no launch."""
    launch, block = getattr(me, "_manager", None), getattr(me, "blockIdx", None)
    if launch is None or block is None:
        return None
    waited = _BLOCKS.setdefault(launch, {}).setdefault(tuple(block), set())
    waited.add(me)
    alive = [t for t in threading.enumerate()
             if getattr(t, "_manager", None) is launch and tuple(getattr(t, "blockIdx", ())) == tuple(block)]
    return list(set(alive) | waited)


def _waits(threads) -> Counter | None:
    """What each live thread of ``threads`` waits for, counted, where every one waits, none of
    them released yet, and one of them in these waits; None where one is running or released."""
    seen = Counter()
    for t in threads:
        what = getattr(t, "napkin_waits", None)
        if not t.is_alive():     # finished, or ended by this very deadlock (its wait left marked)
            if what is not None:
                seen[what] += 1
            continue
        if what is None and not getattr(t, "syncthreads_blocked", False):
            return None
        released = getattr(t, "napkin_released", None)
        if what is not None and released is not None and released():
            return None
        seen[what or "cuda.syncthreads()"] += 1
    return seen if any(k != "cuda.syncthreads()" for k in seen) else None


def wait_for(cv: threading.Condition, ready: Callable[[], bool], what: str, timeout: float,
             state: Callable[[], str] | None = None, released: Callable[[], bool] | None = None) -> bool:
    """``cv.wait_for(ready, timeout)`` (``cv`` held), raising :class:`Deadlock` when the calling
    simulator thread's whole block is stuck (module docstring); ``what`` names this wait, ``state()``
    says how far it got (read when the deadlock is reported), ``released()`` whether the wait is
    over, read by other threads without ``cv`` and so changing nothing (``ready`` where it changes
    nothing itself)."""
    me = threading.current_thread()
    me.napkin_waits, me.napkin_state, me.napkin_released = what, state, released or ready
    stuck = False
    try:
        start = time.monotonic()
        while True:
            if cv.wait_for(ready, timeout=SLICE_S):
                return True
            now = time.monotonic()
            if now - start >= timeout:
                return False
            if now - _LAST_ARRIVAL[0] < STALL_S:
                continue
            mark = _ARRIVALS[0]
            threads = _block_threads(me)
            waits = None if threads is None else _waits(threads)
            if waits is not None and mark == _ARRIVALS[0]:
                stuck = True
                raise Deadlock(_report(me, threads, waits))
    finally:
        if not stuck:    # a thread this deadlock ends stays counted as waiting (_waits)
            me.napkin_waits = me.napkin_state = me.napkin_released = None


def _report(me, threads, waits: Counter) -> str:
    states = {}
    for t in threads:
        what, state = getattr(t, "napkin_waits", None), getattr(t, "napkin_state", None)
        if what is not None and state is not None:
            states.setdefault(what, state)
    parts = "; ".join(f"{n} at {w}" + (f" ({states[w]()})" if w in states else "")
                      for w, n in sorted(waits.items(), key=lambda kv: (-kv[1], kv[0])))
    block = tuple(int(v) for v in me.blockIdx)
    return (f"deadlock in block {block}: every thread waits or has ended, and none can arrive "
            f"(no arrival for {STALL_S:g} s): {parts}")
