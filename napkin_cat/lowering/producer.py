"""Warp specialisation: a copying warpgroup beside the warpgroups that multiply (FlashAttention-3's
producer), for a stream loop double-buffered by ``cp.async`` whose contractions run on ``wgmma``.

Why (measured on an H100, kernels/BENCHMARKS.md, "Fourth session of 2026-11-24"): ``wgmma.fence``
and ``fence.proxy.async`` wait for the executing thread's ``cp.async`` copies in flight, so copies
issued by the warps that multiply overlap nothing; given to warps that never multiply, they do.

The kernel (``NTHREADS`` multiplying threads, then :data:`THREADS` copying ones)::

    if tid >= NTHREADS:                       # the copying warpgroup
        setmaxnreg_dec_40()                   # its registers go to the multiplying warps
        (the block barriers the multiplying warps pass before the stream loop, but the last)
        copy chunk 0 into buffer 0; wait for the copies; fence them for the async proxy
        barrier                               # chunk 0 has landed
        for each chunk c:
            copy chunk c + 1 into buffer (c + 1) % 2; wait; fence
            barrier (as many as the multiplying warps pass per chunk)
        (the barriers they pass after the loop)
        return
    setmaxnreg_inc_R()
    ... the kernel as before, the stream loop without copies ...

"Each chunk" is each chunk the loop visits: where a block table masks whole chunks (:data:`TABLES`),
both sides scan it for the next chunk it keeps (:meth:`.emit_loads.Loads._next_kept`).  Buffer
``(c + 1) % 2`` was last read in chunk ``c - 1``, before the barrier that ended it, and chunk
``c + 1`` has landed, fenced, before the barrier that ends chunk ``c``.  Every block barrier of the
multiplying warps has its twin in the copying warpgroup (counted in the emitted code; else
:class:`NotSpecialised`, emitted as before); their own reductions meet at ``bar_named(1, NTHREADS)``.

With ``HAND_OVER = "named"`` (the default) the per-chunk block barrier goes: the copying
warpgroup arrives (``bar.arrive``) at "landed" barrier ``2 + s W + w`` for each computing
warpgroup ``w`` once chunk c + 1 has landed, ``s = (c + 1) % L`` its slot (:func:`landed_slots`);
computing warpgroup ``w`` waits at its "landed" barrier before each chunk but the first, and
arrives at "released" barrier ``2 + L W + b`` when done with a chunk in buffer ``b`` that another
follows; the copying warpgroup waits there before it refills buffer ``b`` (:func:`hand_over_ids`).

Stages (:data:`STAGES`, second session of 2026-11-30): with the named hand-over, a forward's chunks
cycle through three buffers, two chunks' copies in flight.  Where every chunk is visited
(:func:`_ahead_copies`): chunks 0 .. S - 2 copied before the loop; at chunk c, once buffer
(c - 1) % S is released, chunk c + S - 1 copied into it, then chunk c + 1 waited for alone
(``cp.async.wait_group``, or its mbarrier where TMA copies it: :mod:`.tma`), fenced and handed
over.  Where a block table skips chunks (:func:`_staged_copies`), the k-th kept chunk is issued
at step k and chunk k - 1 handed over behind it (the first form measured faster: ptxas kept values
in registers with it, kernels/logs/forward_copies_h200.log).  ``setmaxnreg`` moves registers from
the copying warpgroup (:data:`REGS`) to the computing ones (:func:`consumer_registers`).
"""

from __future__ import annotations

import contextlib

from ..relabel.loopnest import Load, Loop
from ..relabel.split import split_axes
from . import tma, wgmma as wg
from .chunk_copies import Copies

SWITCH = "auto"
"""Give the copies of a qualifying stream loop to a copying warpgroup (:func:`why_not`): ``True``
wherever it qualifies, ``False`` never, ``"auto"`` (the default) where it was measured faster on
an H100 (fp16, N = 4096, d = 64; kernels/BENCHMARKS.md, "Fifth session of 2026-11-25"):

- a stream loop whose accumulator is rescaled every chunk (an online softmax: the attention
  forward, 0.411 ms against ``mma.sync``'s 0.475 at 256 computing threads);
- a kernel that adds an output across blocks (the one-kernel backward, dQ by atomics: 1.08
  against 1.24 ms, causal 0.78 against 0.85, with the named hand-over; 2.58 against 2.66 at
  d = 128).

Not elsewhere: the two-kernel backward's dQ kernel measured slower with it (0.88 against 0.64 ms,
128 computing threads); plain sums on their own were not measured.  An accumulator rescaled every
chunk goes to warpgroup MMAs only with it (:func:`.wgmma_plan.auto_why_not`)."""

TABLES = True
"""Give the copying warpgroup a stream loop whose chunks a block table skips: both sides scan the
table (in shared memory, published before the copying warpgroup's first copy) for the chunks it
keeps, so it copies and hands over those only.  ``False``: such a kernel keeps its copies (the
computing threads' ``cp.async``, or single-buffered), as before 2026-11-29."""

THREADS = 128  # threads of the copying warpgroup (setmaxnreg acts on whole warpgroups)

REGS = 24
"""Registers per thread the copying warpgroup keeps, the fewest ``setmaxnreg`` allows: its copies
step by constant offsets (``emit_loads.STRIDED_COPIES``), and the computing warpgroups get the
rest (240 each at 256).  Measured on an H100 (fp16, N = 4096; kernels/BENCHMARKS.md, "Sixth
session of 2026-11-25") against 40: the one-kernel backward 1.17 -> 1.05 ms at d = 64 (causal
0.74 -> 0.71) and 2.48 -> 2.30 at d = 128 (1.56 -> 1.37)."""

HAND_OVER = "named"
"""How a chunk's buffer passes between the copying warpgroup and the computing ones: ``"named"``,
per buffer and computing warpgroup by named barriers (:func:`hand_over_ids`), so that each
warpgroup waits only for its own chunk and the two drift apart; ``"block"``, one block barrier per
chunk, which also holds the computing warpgroups in step.  Measured on an H100 (fp16, d = 64,
256 computing threads; kernels/BENCHMARKS.md, "Fifth session of 2026-11-25"): the forward 0.411
ms against the block barriers' 0.425, the one-kernel backward 1.08 against 1.22.  A kernel that
cannot (more than six computing warpgroups, ``cp.async`` copies of the computing threads in the
loop) gets ``"block"``."""

STAGES = 3
"""Chunk buffers the copying warpgroup cycles through with the named hand-over, copies of
``STAGES - 1`` chunks in flight (at most 4); 2: the double buffer, each chunk's copies waited for
before the next chunk's are issued.  A kernel whose named barriers (:func:`hand_over_ids`) or
shared memory do not allow it, whose blocks per SM it would lower, or that rescales no accumulator
every chunk (:func:`stages_for`) keeps two.  Measured on an H200 (fp16, N = 4096, B*H = 32;
kernels/BENCHMARKS.md, "Second session of 2026-11-30"): the d = 128 forward kernel on three
computing warpgroups 0.718-0.721 ms with three buffers of 64 keys, against 0.872 with two of 64
and 0.780-0.784 with two of 128 (0.529 with its copies removed); causal 0.398-0.400 against 0.462."""

MASKED_GROUPS = 3
"""The most computing warpgroups a forward whose stream loop a mask bounds takes :data:`STAGES`
buffers with copied by ``cp.async``; more keep two, unless TMA copies them (:mod:`.tma`).  Measured
on an H200 (fp16, N = 4096, d = 64, four warpgroups), forward kernel ms with three buffers against
two: by ``cp.async`` unmasked 0.344 against 0.383, causal, block-causal, prefix-LM, GQA causal 1-4%
slower ("Fourth session of 2026-11-30"); by TMA causal 0.200 against 0.238 ("Seventh session")."""

MIN_THREADS = 256
"""Computing threads a kernel needs for a copying warpgroup: measured on an H100 (fp16 forward,
d = 64), two computing warpgroups sharing each chunk ran 0.426 ms against ``mma.sync``'s 0.459,
one ran 0.548 (its copying warpgroup idle half the time; the dQ kernel likewise, 0.88 against
0.64 ms)."""

REGISTER_FILE = 65536
MAX_REGS = 248
"""The most ``setmaxnreg`` gives a thread here (a multiple of 8 at most 255)."""


class NotSpecialised(Exception):
    """The emitted kernel's barriers do not allow the copying warpgroup (the reason)."""


def why_not(plan) -> str | None:
    """Why ``plan``'s kernel gets no copying warpgroup (None: it gets one)."""
    from .wgmma import uses_wgmma
    if SWITCH not in (True, False, "auto"):
        raise ValueError(f"producer.SWITCH must be True, False or 'auto', got {SWITCH!r}")
    if not SWITCH:
        return "producer.SWITCH is off"
    if not asked_for(plan):
        return ("no accumulator rescaled every chunk and no output added across blocks (producer.SWITCH = 'auto': "
                "measured faster for those)")
    if not uses_wgmma(plan):
        return "no contraction on warpgroup MMAs"
    if plan.prefetch != "double":
        return f"prefetch is {plan.prefetch!r}, not 'double'"
    if plan.threads % 128 or plan.threads + THREADS > 1024:
        return f"{plan.threads} threads: not whole warpgroups, or more than 1024 with the copying warpgroup"
    if plan.threads < MIN_THREADS:
        return (f"{plan.threads} computing threads: one warpgroup, measured slower with a copying one "
                f"(kernels/BENCHMARKS.md)")
    loops = [n for n in plan.inner if isinstance(n, Loop)]
    nested = [n for lp in loops for n in lp.body if isinstance(n, Loop)]
    if len(loops) != 1 or loops[0].kind != "stream" or nested:
        return "not one stream loop at the kernel's top level"
    if not TABLES and any(s.pred.block_atoms() for s in plan.skips.get(loops[0].axis, ())):
        return "chunks skipped by a block table (producer.TABLES is off)"
    return None


def note(plan, why: str | None, threads: int) -> tuple[str, ...]:
    """What a kernel's notes say of its copying warpgroup where it got none or the block-barrier
    hand-over (``threads``: its copying threads; ``why``: the reason), when it would be asked for:
    :data:`SWITCH` on, and under ``"auto"`` an accumulator rescaled every chunk or an output
    added across blocks."""
    if why is None or not SWITCH or not asked_for(plan):
        return ()
    return (f"Copying warpgroup: {'chunks handed over by block barriers' if threads else 'none'} ({why}).",)


def asked_for(plan) -> bool:
    """Whether :data:`SWITCH` asks for a copying warpgroup in ``plan``'s kernel (``"auto"``: an
    accumulator rescaled every chunk, or an output added across blocks)."""
    return SWITCH is True or (SWITCH == "auto" and (rescaled(plan.accs) or bool(split_axes(plan.d))))


@contextlib.contextmanager
def switched_off():
    """Within: no copying warpgroup (``SWITCH = False``), so ``planner.WGMMA = "auto"`` plans as
    without one."""
    global SWITCH
    saved, SWITCH = SWITCH, False
    try:
        yield
    finally:
        SWITCH = saved


def double_for_copies(plan, double):
    """``plan``, or where ``prefetch="auto"`` left it single-buffered (its register estimate over
    a thread's registers) and the double-buffered plan (``double()``) gets a copying warpgroup, that
    plan: the copying warpgroup fills the second buffers, not the computing threads' registers.
    Measured on an H100 (fp16, d = 128, N = 4096; kernels/BENCHMARKS.md, "Sixth session of
    2026-11-25"): the one-kernel backward 2.65 -> 2.48 ms with 40 copying registers and 2.30 with
    24 (:data:`REGS`); causal 1.50 -> 1.56 with 40, 1.37 with 24."""
    if plan.prefetch is not False or plan.dtype not in ("f16", "bf16") or not SWITCH or not asked_for(plan):
        return plan
    twin = double()
    return twin if why_not(twin) is None else plan


def staged_for_copies(plan, staged):
    """``plan``, or where it gets a copying warpgroup whose named barriers allow :data:`STAGES`
    buffers (:func:`stages_for`), the plan with them (``staged(stages)``), when its shared memory
    fits a block and leaves as many blocks per SM."""
    from .runtime import H100_DEFAULTS as lim
    stages = stages_for(plan) if plan.prefetch == "double" else 2
    if stages == 2:
        return plan
    twin = staged(stages)
    crowded = plan.threads // 128 > MASKED_GROUPS and any(plan.skips.values())
    if (twin.smem_bytes > lim.max_shared_per_block_optin or twin.launch.blocks_per_sm < plan.launch.blocks_per_sm
            or why_not(twin) is not None or (crowded and not tma.copied(twin.buffers.values()))):
        return plan
    return twin


def rescaled(accs) -> bool:   # an accumulator of accs rescaled every chunk (an online softmax's output)
    return any(p.stat is not None for p in accs)


def joins(threads: int) -> bool:
    """Whether a copying warpgroup may join a kernel of ``threads`` computing threads that rescales
    an accumulator every chunk (:data:`SWITCH`, :data:`MIN_THREADS`)."""
    return bool(SWITCH) and threads >= MIN_THREADS and threads % 128 == 0


def consumer_registers(threads: int, blocks: int) -> int:
    """Registers per multiplying thread once the copying warpgroup has given its own up: what the
    launch gave the whole block, less the copying warpgroup's.  ``setmaxnreg.inc`` waits until the
    block's pool holds what it asks for, so asking more than this hangs the kernel."""
    free = launch_registers(threads, blocks) * (threads + THREADS) - THREADS * REGS
    return min(MAX_REGS, free // threads // 8 * 8)


def launch_registers(threads: int, blocks: int) -> int:
    """Registers per thread at launch (every thread alike), what ``setmaxnreg`` starts from."""
    return min(MAX_REGS, REGISTER_FILE // (blocks * (threads + THREADS)) // 8 * 8)


def primitive_names(threads: int, blocks: int) -> tuple[str, ...]:
    return ("bar_named", "bar_arrive", f"setmaxnreg_dec_{REGS}",
            f"setmaxnreg_inc_{consumer_registers(threads, blocks)}")


def hand_overs() -> tuple[str, ...]:
    """The hand-overs to try, in order (the first a kernel allows is emitted)."""
    if HAND_OVER not in ("named", "block"):
        raise ValueError(f"producer.HAND_OVER must be 'named' or 'block', got {HAND_OVER!r}")
    return ("named", "block") if HAND_OVER == "named" else ("block",)


def landed_slots(stages: int) -> int:
    """The "landed" barriers of each computing warpgroup over ``stages`` buffers: chunk c's is slot
    ``c % L``.  A slot may be reused once the warpgroup has waited at it, so ``L`` must exceed the
    hand-overs the copying warpgroup can be ahead by: it arrives for chunk c + 1 after chunk c - 1's
    release (two ahead) or, where a block table skips chunks, chunk k - 1 after chunk k - S's (S - 1
    ahead).  A slot per buffer (until 2026-11-30): 17 named barriers for 4 warpgroups, 3 buffers."""
    return max(2, stages - 1)


def hand_over_ids(threads: int, stages: int = 2) -> tuple[int, int]:
    """The first named barrier of the ``"named"`` hand-over's "landed" barriers (slot ``s``,
    computing warpgroup ``w``: ``full + s * W + w``; :func:`landed_slots`) and of its "released"
    ones (buffer ``b``: ``empty + b``) over ``stages`` buffers; id 1 is the computing threads' own
    (reductions), 0 the block's."""
    groups = threads // 128
    full, empty = 2, 2 + landed_slots(stages) * groups
    if empty + stages > 16:
        raise NotSpecialised(f"{groups} computing warpgroups over {stages} buffers: more named barriers than the "
                             f"16 a block has")
    return full, empty


def _next_slot(slot: str, stages: int, k) -> str:
    """The statement moving landed slot ``slot`` to the next chunk's (:func:`landed_slots`)."""
    return _turn(slot, landed_slots(stages), k)


def stages_for(plan) -> int:
    """The chunk buffers :func:`.planner.plan_kernel` gives ``plan``'s stream loop: :data:`STAGES`
    where ``plan`` gets a copying warpgroup with the named hand-over, its barriers allow them and
    an accumulator is rescaled every chunk (an online softmax: the attention forward), else 2.  Not
    for outputs added across blocks: the one-kernel backward measured slower with three buffers on
    an H200 (fp16, N = 4096: 2.088 ms against 1.921 at d = 128, 1.051 against 1.014 at d = 64;
    causal level; kernels/BENCHMARKS.md, "Second session of 2026-11-30")."""
    if not isinstance(STAGES, int) or isinstance(STAGES, bool) or not 2 <= STAGES <= 4:
        raise ValueError(f"producer.STAGES must be an int from 2 to 4 (cp.async waits for all but up to 2 "
                         f"groups), got {STAGES!r}")
    if STAGES == 2 or HAND_OVER != "named" or not rescaled(plan.accs) or why_not(plan) is not None:
        return 2
    try:
        hand_over_ids(plan.threads, STAGES)
    except NotSpecialised:
        return 2
    return STAGES


def _stages(bufs) -> int:   # the buffers of a stream loop's chunks
    return max(b.copies for b in bufs)


def _turn(par: str, stages: int, k) -> str:
    """The statement moving buffer index ``par`` to the next chunk's buffer."""
    if stages == 2:
        return f"{par} = {k.u(1, 'U1')} - {par}"
    return f"{par} = ({par} + {k.u(1, 'U1')}) % {k.u(stages, f'U{stages}')}"


# --------------------------------------------------------------------------- emission

MARK = "the copying warpgroup fills the other buffer"


def emit_loop(em, lp: Loop, src) -> None:
    """The multiplying warps' side of stream loop ``lp`` (no copies), and the copying
    warpgroup's, kept to be written into its slot once the kernel's barriers are known
    (:func:`finish`)."""
    k = em.consts
    a = em.ax[lp.axis]
    lo, hi = em._stream_bounds(lp, src)
    loads = [n for n in lp.body if isinstance(n, Load)]
    bufs = [em.bufs[("var", n.var)] for n in loads]
    if not all(em._vector_ok(n.var) for n in loads):
        raise NotSpecialised("an input of the stream loop is not copied by cp.async")
    stride, base = em._copy_layout(bufs)
    # the first chunk no block table masks whole (the tables were published with the tile); above
    # the loop's mark, so that the scan's loop is not taken for the stream loop (_barrier_counts)
    first = em._first_chunk(lp, lo, hi, src)
    stages = _stages(bufs) if em.specialise == "named" else 2
    held = "double-buffered" if stages == 2 else f"{stages} buffers"
    src.comment(f"stream {a.name} in chunks of {a.cap}, {held}: while chunk c is computed, "
                f"{MARK} with chunk{'s' if stages > 2 else ''} c + 1{f' .. c + {stages - 1}' if stages > 2 else ''} "
                f"(warp specialisation, lowering/producer.py)")
    par = em.names.fresh(f"buf_{a.name}")
    src(f"{par} = {k.u(0, 'U0')}  # which copy holds the current chunk")
    slot = par if stages == 2 else em.names.fresh(f"land_{a.name}")
    if slot != par:
        src(f"{slot} = {k.u(0, 'U0')}  # the current chunk's landed barriers (lowering/producer.py, landed_slots)")
    em.pending_sync = True
    em.sync(src)   # chunk 0 has landed (the copying warpgroup's first barrier in the loop's turn)
    with src.block(em._chunk_header(lp, lo, hi, first, src)):
        if a.ragged:
            src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
        for b in bufs:
            em.cur[b.key] = em.names.fresh(f"{b.name}_cur")
            src(f"{em.cur[b.key]} = {base[b.name]} + {par} * {stride[b.name]}")
        named = em.specialise == "named"
        if named:
            full, empty_id = hand_over_ids(em.T, stages)
            groups = em.T // 128
            with src.block(f"if {a.start} > {first}:  # chunk 0 landed at the barrier above"):
                src(f"bar_named({k.u(full, f'U{full}')} + {slot} * {k.u(groups, f'U{groups}')} + tid // "
                    f"{k.u(128, 'U128')}, {k.u(128 + THREADS, f'U{128 + THREADS}')})  # this warpgroup's chunk has landed")
        em.pending_sync = False
        em.consumers_only = named     # the computing threads' own barriers: the copying warpgroup is not there
        start = src.mark()
        empty = em._chunk_flags(lp, src)
        kept_only = em._skips_by_data(lp)   # the loop visits the chunks no table masks whole
        em._emit_guarded([n for n in lp.body if n not in loads], None if kept_only else empty, src)
        nxt = em._next_chunk(lp, hi, src) if named or kept_only else None
        if named:
            if em.pending_async:
                raise NotSpecialised("cp.async copies of the computing threads in the stream loop")
            if em.pending_sync or any("bar_named(uint32(1)" in ln for ln in src.since(start)):
                em.pending_sync = True   # shared memory they wrote this chunk: read by all before the next writes
                em.sync(src)
            elif wg.FENCE_SPECIALISED:
                src("fence_proxy_async()  # this chunk's reads are done")
            em.consumers_only = False
            with src.block(f"if {nxt} < {hi}:"):   # the copying warpgroup waits for it (landed_slots)
                total = em.T + THREADS
                src(f"bar_arrive({k.u(empty_id, f'U{empty_id}')} + {par}, {k.u(total, f'U{total}')})  "
                    f"# this buffer is free: chunk c + {stages} may be copied into it")
        else:
            em.pending_sync = True
            em.sync(src)
        src(_turn(par, stages, k))
        if slot != par:
            src(_next_slot(slot, stages, k))
        if nxt is not None:
            em._advance(lp, nxt, src)
    em._drop_flags(lp)
    for b in bufs:
        del em.cur[b.key]
    em.producer_loop = (lp, loads, bufs)


def _barrier_counts(lines: list[str], named: bool = False) -> tuple[int, int, int]:
    """Block barriers of the multiplying warps before the stream loop, per chunk, after it: each
    at the kernel body's own depth or the loop body's (else :class:`NotSpecialised`); with the
    ``named`` hand-over, none per chunk."""
    body = "    "
    at = next(i for i, ln in enumerate(lines) if MARK in ln)
    head = next(i for i in range(at, len(lines)) if lines[i].startswith(body + "for ") or lines[i].startswith(body + "while "))
    end = next((i for i in range(head + 1, len(lines)) if lines[i].strip() and not lines[i].startswith(body + "    ")),
               len(lines))
    counts = [0, 0, 0]
    for i, ln in enumerate(lines):
        if ln.strip() != "cuda.syncthreads()":
            continue
        depth = (len(ln) - len(ln.lstrip())) // 4
        part = 0 if i < head else 1 if i < end else 2
        if depth != (2 if part == 1 else 1):
            raise NotSpecialised(f"a block barrier at depth {depth} (line {i}): not at a fixed place")
        counts[part] += 1
    if named and counts[1]:
        raise NotSpecialised(f"{counts[1]} block barrier(s) in the stream loop: the named hand-over needs none")
    if counts[0] < 1 or (counts[1] < 1 and not named):
        raise NotSpecialised("no barrier before the stream loop or none in it")
    return counts[0], counts[1], counts[2]


def finish(em, body, slot) -> None:
    """Write the copying warpgroup's code into ``slot`` (after the prologue), mirroring the
    barriers of the multiplying warps' emitted ``body``."""
    lp, loads, bufs = em.producer_loop
    named = em.specialise == "named"
    pre, per, post = _barrier_counts(body.lines, named)
    k = em.consts
    a = em.ax[lp.axis]
    em.producer_threads = THREADS
    blocks = em.blocks()
    saved = em.pending_sync, em.pending_async, dict(em.cur), em.copy_threads
    em.pending_sync = em.pending_async = False
    nthreads = k.u(THREADS, "NPRODUCER", comment="threads of the copying warpgroup")
    em.copy_threads = ("ptid", nthreads, THREADS)
    src = slot
    with src.block("if tid >= NTHREADS:  # the copying warpgroup: copies every chunk of the stream loop"):
        src(f"setmaxnreg_dec_{REGS}()  # its registers go to the multiplying warps")
        src("ptid = tid - NTHREADS")
        for _ in range(pre - 1):
            src("cuda.syncthreads()  # a barrier of the multiplying warps before the loop")
        lo, hi = em._stream_bounds(lp, src)
        par = em.names.fresh(f"pbuf_{a.name}")
        src(f"{par} = {k.u(0, 'U0')}")
        first = em._first_chunk(lp, lo, hi, src)   # the block tables were published at a barrier above

        if named and _stages(bufs) > 2 and not em._skips_by_data(lp):
            _ahead_copies(em, lp, loads, bufs, lo, hi, first, par, src)
        elif named and _stages(bufs) > 2:
            _staged_copies(em, lp, loads, bufs, lo, hi, first, par, src)
        else:
            _double_copies(em, lp, loads, bufs, lo, hi, first, par, per, src)
        for _ in range(post):
            src("cuda.syncthreads()  # a barrier of the multiplying warps after the loop")
        src("return")
    src(f"setmaxnreg_inc_{consumer_registers(em.T, blocks)}()  # the multiplying warps take the registers")
    em.pending_sync, em.pending_async, cur, em.copy_threads = saved
    em.cur.clear()
    em.cur.update(cur)


def _double_copies(em, lp, loads, bufs, lo, hi, first, par, per, src) -> None:
    """The copying warpgroup's loop over two buffers: chunk c + 1 copied and waited for while chunk
    c is computed."""
    k, a = em.consts, em.ax[lp.axis]
    named = em.specialise == "named"
    copies = _copies(em, lp, loads, bufs, 2, src)

    with src.block(f"if {first} < {hi}:"):
        copies.issue(first, k.u(0, "U0"))
        copies.landed(k.u(0, "U0"), k.u(0, "U0"), [], hi)
    src("cuda.syncthreads()  # chunk 0 has landed")
    with src.block(em._chunk_header(lp, lo, hi, first, src)):
        nxt = em._next_chunk(lp, hi, src)
        if named:
            empty, total = hand_over_ids(em.T)[1], em.T + THREADS
            with src.block(f"if {a.start} > {first}:"):
                src(f"bar_named({k.u(empty, f'U{empty}')} + ({k.u(1, 'U1')} - {par}), {k.u(total, f'U{total}')})"
                    f"  # chunk c - 1's buffer released by every computing warpgroup")
        with src.block(f"if {nxt} < {hi}:"):
            copies.issue(nxt, f"({k.u(1, 'U1')} - {par})")
            copies.landed(f"({k.u(1, 'U1')} - {par})", f"{copies.count} + {k.u(1, 'U1')}", [], hi)
            if named:
                _arrive_landed(em, f"({k.u(1, 'U1')} - {par})", "chunk c + 1", src)
        for _ in range(per):
            src("cuda.syncthreads()  # the next chunk has landed; the buffer of this one is free")
        src(f"{par} = {k.u(1, 'U1')} - {par}")
        copies.next()
        em._advance(lp, nxt, src)


def _copies(em, lp, loads, bufs, stages: int, src, count: str | None = None) -> Copies:
    """The chunk copies of the copying warpgroup; by TMA, its mbarriers initialised at the first
    named barrier the hand-over leaves free (``count``: the caller's counter of visited chunks)."""
    bar = hand_over_ids(em.T, stages)[1] + stages
    if tma.copied(bufs) and bar > 15:
        raise NotSpecialised("no named barrier left for the TMA mbarriers' initialisation")
    return Copies(em, lp, loads, bufs, stages, bar, THREADS, src, count)


def _arrive_landed(em, slot: str, which: str, src) -> None:
    """The copying warpgroup's arrivals at each computing warpgroup's "landed" barrier of slot
    ``slot`` (:func:`landed_slots`; ``which``: the chunk, in the comment)."""
    k, groups = em.consts, em.T // 128
    full = hand_over_ids(em.T)[0]
    for w in range(groups):
        src(f"bar_arrive({k.u(full + w, f'U{full + w}')} + {slot} * {k.u(groups, f'U{groups}')}, "
            f"{k.u(128 + THREADS, f'U{128 + THREADS}')})  # {which} has landed for warpgroup {w}")


def _ahead_copies(em, lp, loads, bufs, lo, hi, first, par, src) -> None:
    """The copying warpgroup's loop over :data:`STAGES` buffers where every chunk is visited (the
    module's docstring); swizzled buffers by tensor copies, waited for at mbarriers (:mod:`.tma`)."""
    k, a = em.consts, em.ax[lp.axis]
    stages = _stages(bufs)
    empty, total = hand_over_ids(em.T, stages)[1], em.T + THREADS
    S, C, U0, U1 = k.u(stages, f"U{stages}"), a.cap_c, k.u(0, "U0"), k.u(1, "U1")
    copies = _copies(em, lp, loads, bufs, stages, src)

    def start(base: str, j: int) -> str:
        return base if j == 0 else f"{base} + {k.u(j, f'U{j}')} * {C}"

    for j in range(stages - 1):
        with src.block(f"if {start(first, j)} < {hi}:"):
            copies.issue(start(first, j), k.u(j, f"U{j}"))
    with src.maybe(f"{first} < {hi}" if copies.tensor else None):
        copies.landed(U0, U0, [start(first, j) for j in range(1, stages - 1)], hi)
    src("cuda.syncthreads()  # chunk 0 has landed")
    back = f"(({par} + {k.u(stages - 1, f'U{stages - 1}')}) % {S})"
    slot, slots = em.names.fresh(f"pland_{a.name}"), landed_slots(stages)
    src(f"{slot} = {U0}  # chunk c's landed slot")
    with src.block(em._chunk_header(lp, lo, hi, first, src)):
        far = em.names.fresh(f"{a.name}_ahead")
        src(f"{far} = {start(a.start, stages - 1)}")
        with src.block(f"if {a.start} > {first}:"):   # at every chunk: the hand-overs at most two ahead
            src(f"bar_named({k.u(empty, f'U{empty}')} + {back}, {k.u(total, f'U{total}')})"
                f"  # chunk c - 1's buffer released by every computing warpgroup")
        with src.block(f"if {far} < {hi}:"):
            copies.issue(far, back)
        nxt = em.names.fresh(f"{a.name}_next")
        src(f"{nxt} = {start(a.start, 1)}")
        with src.block(f"if {nxt} < {hi}:"):
            copies.landed(f"(({par} + {U1}) % {S})", f"{copies.count} + {U1}", [start(a.start, j) for j in range(2, stages)], hi)
            _arrive_landed(em, f"(({slot} + {U1}) % {k.u(slots, f'U{slots}')})", "chunk c + 1", src)
        src(f"{par} = ({par} + {U1}) % {S}")
        src(_next_slot(slot, stages, k))
        copies.next()


def _staged_copies(em, lp, loads, bufs, lo, hi, first, par, src) -> None:
    """The copying warpgroup's loop over :data:`STAGES` buffers (the module's docstring): the k-th
    chunk's copies issued into buffer k % S once chunk k - S released it, then chunk k - 1 handed
    over; the last chunk after the loop, then the releases not yet waited for.  Chunk k - 1 is
    waited for by ``cp.async.wait_group 1``, or at its buffer's mbarrier where TMA copies it."""
    k, a = em.consts, em.ax[lp.axis]
    stages = _stages(bufs)
    empty, total = hand_over_ids(em.T, stages)[1], em.T + THREADS
    S, U0, U1 = k.u(stages, f"U{stages}"), k.u(0, "U0"), k.u(1, "U1")
    n = em.names.fresh(f"issued_{a.name}")
    copies = _copies(em, lp, loads, bufs, stages, src, count=n)
    src(f"{n} = {U0}  # chunks issued")

    def landed(last: bool) -> None:   # chunk n - 1 (buffer par - 1); the newest but one unless ``last``
        if copies.tensor:
            return copies.landed(f"(({par} + {k.u(stages - 1, f'U{stages - 1}')}) % {S})", f"{n} - {U1}", [], "")
        src("cp_async_wait_all()  # the last chunk's copies have landed" if last else
            "cp_async_wait1()  # the previous chunk's copies have landed; this one's may not")
        src("fence_proxy_async()  # ... and are visible to the tensor cores")

    def hand_over(which: str):   # the newest chunk but one (k - 1); n <= 1: chunk 0, or none
        with src.block(f"if {n} <= {U1}:"):
            src("cuda.syncthreads()  # chunk 0 has landed (or there is none)")
        with src.block("else:"):
            _arrive_landed(em, prev, which, src)

    slots = landed_slots(stages)
    prev = f"(({n} - {U1}) % {k.u(slots, f'U{slots}')})"   # chunk k - 1's landed slot (k >= 2 here)
    with src.block(em._chunk_header(lp, lo, hi, first, src)):
        nxt = em._next_chunk(lp, hi, src)
        with src.block(f"if {n} >= {S}:"):
            src(f"bar_named({k.u(empty, f'U{empty}')} + {par}, {k.u(total, f'U{total}')})"
                f"  # chunk k - {stages}'s buffer released by every computing warpgroup")
        copies.issue(a.start, par)
        with src.block(f"if {n} > {U0}:"):
            landed(False)
            hand_over("the previous chunk")
        src(f"{par} = ({par} + {U1}) % {S}")
        src(f"{n} += {U1}")
        em._advance(lp, nxt, src)
    with src.maybe(f"{n} > {U0}" if copies.tensor else None):   # no chunk: no mbarrier phase to wait for
        landed(True)
    for j in range(stages - 1):    # the computing warpgroups released chunks n - S .. n - 2 unwaited
        back = stages - j
        with src.block(f"if {n} >= {k.u(back, f'U{back}')}:"):
            src(f"bar_named({k.u(empty, f'U{empty}')} + ({n} - {k.u(back, f'U{back}')}) % {S}, "
                f"{k.u(total, f'U{total}')})  # chunk n - {back}'s release")
        if j == 0:   # chunk n - S's first: the last hand-over at most S - 1 ahead (landed_slots)
            hand_over("the last chunk")
