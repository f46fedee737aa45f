"""Outputs the blocks add into, staged in shared memory and added by one bulk reduction per chunk.

An output summed across blocks (``tile(axis, size, partial="sum")``: the one-kernel backward's
``dQ``) is added with fp32 atomics, a column pair per reduction (:mod:`.atomics`).  On the H200
those reductions were the backward's largest measured cost at d = 128: 67 M L2 sectors of
reductions per call, and warps stalled 1.37 cycles per issued instruction on the queue of global
memory instructions (``lg_throttle``; ``kernels/logs/ncu_issue_ahead_h200_d128.txt``).

Here, in a kernel on warpgroup MMAs (sm_90), such an output written once per chunk of a stream
loop, whose chunk is one contiguous run of global memory (its axes after the first that the block
splits are whole), is instead written into a shared buffer laid out as global memory is, and one
thread adds the whole chunk with one bulk reduction (``cp.reduce.async.bulk ... .add.f32``), which
the copy engine carries out while the threads go on.  The rows of both are padded
(:func:`row_pad`: 4 words after a row of 128): rows of a multiple of 32 words put a fragment's
eight rows in four banks, 8-way conflicts on every write.  The kernel's launcher allocates the
global array padded and hands the caller the view without the padding (:mod:`.calls`).  The
order, per chunk:

1. before the barrier that precedes the writes, thread 0 waits until the previous chunk's
   reduction has *read* the buffer (``bulk_wait_read``);
2. every thread writes its values into the buffer, fenced for the async proxy at the next barrier;
3. after that barrier, thread 0 issues the reduction of the rows this chunk holds (a ragged last
   chunk: only its rows) and commits it;
4. after the stream loop, thread 0 waits for every reduction (``bulk_wait_all``): a block does
   not exit while the copy engine still reads its shared memory.

The simulator's twins keep the reductions pending and read the buffer only at the wait, as the
hardware may: a write into the buffer before thread 0's wait, or a reduction never waited for,
gives a wrong sum there (``tests/test_staged_add.py`` plants both).  Not staged (atomics as
before, :func:`why_not`): an output whose chunk is not contiguous, one not written once per chunk of
a stream loop, and a buffer that would take shared memory past :data:`SMEM_LIMIT` (the
document-masked backward already holds 222 KB).

**Where rows are at least 512 bytes and a mask skips chunks** (:data:`STAGED_ADD` ``"auto"``,
:data:`MIN_ROW_BYTES`), as measured on the H200 (N = 4096, B*H = 32, the backward kernel against
the atomics in the same runs; ``kernels/probes/staged_conflicts.py``, ``kernels/probes/op_forms.py``,
``kernels/logs/staged_rows_h200.log``): causal at d = 128, 1.096 against 1.209 ms (fp16), 1.084
against 1.199 (bf16); unmasked at d = 128 level or slower over four runs (1.935-2.093 against
1.919-2.003), where every key tile's block adds into the same query chunk at the same time; at
d = 64 slower (1.066 against 1.010, causal 0.693 against 0.649).  Unpadded, the staged kernel ran
2.088 ms at d = 128 (the conflicts); a fragment's column pairs written as one 64-bit store each
(no conflict at all) ran as the padded single words did, 1.936 ms.  The padded fp32 dQ goes to
16 bits by a kernel of its own (:mod:`.unpad`: 0.034 ms where torch's strided copy took 0.044, a
contiguous one 0.024).
"""
from __future__ import annotations

import math
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

from ..relabel.loopnest import Compute, Finalise, Loop
from .plan import Buffer, Frag

STAGED_ADD = "auto"
"""Stage outputs the blocks add into in shared memory, one bulk reduction per chunk (sm_90):
``True``, ``False`` (atomics), or ``"auto"``: where a row of the output is at least
:data:`MIN_ROW_BYTES` and a mask skips chunks of the stream loop, or TMA copies its chunks (:mod:`.tma`;
measured: the module docstring; by TMA, unmasked at d = 128 on an H200, the backward kernel 1.608 ms
against the atomics' 1.818, FlexAttention's 1.639: kernels/BENCHMARKS.md, "Seventh session of 2026-11-30")."""

MIN_ROW_BYTES = 512
"""``"auto"`` stages an output whose rows (its last axis, fp32) are at least this many bytes: the
one-kernel backward's dQ at d = 128 (causal: faster staged on the H200, 1.096 against 1.209 ms),
not at d = 64 (slower, 1.066 against 1.010 unmasked, 0.693 against 0.649 causal)."""

PAD_ROWS = True
"""Pad the rows of staged outputs (:func:`row_pad`); off: rows of d words, as first built, for
measuring the two (``kernels/probes/staged_conflicts.py``)."""

SMEM_LIMIT = 227 * 1024
"""Shared memory per block a staged kernel may take in all (the H100's and H200's opt-in limit)."""

PRIMITIVES = ("bulk_add_f32", "bulk_commit", "bulk_wait_read", "bulk_wait_all")
"""``bulk_add_f32(out, goff, smem, soff, nbytes)``: ``out[goff:] += smem[soff:]``, ``nbytes``
bytes (a multiple of 16), issued by one thread; ``bulk_commit()`` closes the issued ones into a
group; ``bulk_wait_read()``: every group has read its shared memory; ``bulk_wait_all()``: every
group is complete."""


def staged_vars(bufs) -> tuple[int, ...]:
    """The output variables a plan stages (buffers ``("stage", v)``)."""
    return tuple(k[1] for k in bufs if k[0] == "stage")


def plan(ff, ax, targets, accs, bufs, skipping: bool = True) -> dict:
    """``bufs`` with a staging buffer (at offset 0: the planner assigns them) for each output the
    blocks add into (:func:`~napkin_cat.relabel.split.added_outputs`) that :func:`why_not` allows;
    ``skipping``: a mask skips chunks of the kernel's stream loops, or TMA copies them."""
    from ..relabel.split import added_outputs
    added = added_outputs(ff) if STAGED_ADD in (True, "auto") else {}
    if not (added and _on_warpgroups(targets, accs)):
        return bufs
    types = ff.diagram.var_types()
    out = dict(bufs)
    for v in added:
        if v in targets and why_not(ff, ax, targets[v], types[v], out, skipping) is None:
            names = types[v].axis_names
            axes = tuple(a for a in names if ax[a].cap > 1)
            pad = _pad(ax, names)
            spread = f", rows padded by {pad} words" if pad else ""
            out[("stage", v)] = Buffer(("stage", v), f"{types[v].name}_add_s", axes, tuple(ax[a].cap for a in axes),
                                       f"{types[v].name}'s partial sums, added by one bulk reduction a chunk{spread}",
                                       pad=pad)
    return out   # the planner assigns the offsets


def row_pad(width: int) -> int:
    """Words added to each row of a staged output ``width`` words wide, in the staging buffer and
    in the global array the kernel adds into (the copy engine reads one run of both, so both are
    laid out alike): the fewest, a multiple of 4 (rows stay 16-byte aligned), that spread a warp's
    stores of a tensor-core accumulator over the most banks.  Such a store writes eight rows, four
    lanes a row, every other word; rows of a multiple of 32 words put all eight rows in the same
    four banks (8-way conflicts), 4 words more put them 2-way, the least any row stride gives:

    >>> row_pad(128), row_pad(64), row_pad(16), row_pad(24)
    (4, 4, 4, 0)
    >>> [_conflicts(s) for s in (128, 132, 136, 144)]
    [8, 2, 2, 4]
    """
    return min(range(0, 32, 4), key=lambda p: (_conflicts(width + p), p)) if PAD_ROWS else 0


def _conflicts(stride: int) -> int:
    """The most lanes of one fragment store that fall in one bank, rows ``stride`` words apart."""
    return max(Counter((r * stride + 2 * k) % 32 for r in range(8) for k in range(4)).values())


def _pad(ax, names) -> int:
    """Words after each row of a staged output of axes ``names`` (:func:`row_pad`), where its last
    axis comes after the first one the block splits and the block holds all of it, more than one
    (the staging buffer's last axis is then the array's); else 0."""
    first = next(i for i, a in enumerate(names) if ax[a].cap > 1)
    last = ax[names[-1]]
    return row_pad(last.size) if first < len(names) - 1 and last.cap == last.size > 1 else 0


def out_pads(plan, outputs: int) -> tuple[int, ...]:
    """Words of padding after each row of each of the ``outputs`` outputs of a kernel of ``plan``
    (0: not padded; a kernel made without a plan, a gather's, pads none): the global arrays its
    launcher allocates for staged outputs have rows this much longer, and the caller gets the view
    without them (:class:`~napkin_cat.lowering.Kernel`)."""
    bufs = getattr(plan, "buffers", None) or {}
    if not staged_vars(bufs):
        return (0,) * outputs
    return tuple(bufs[("stage", v)].pad if ("stage", v) in bufs else 0 for v in plan.dd.outs)


def why_not(ff, ax, t, arr, bufs, skipping: bool = True) -> str | None:
    """Why output ``t`` (of array type ``arr``) is not staged, or None; ``skipping``: as :func:`plan`'s."""
    if not t.to_global or ff.diagram.outs.count(t.var) != 1:
        return "not stored once"
    names = arr.axis_names
    split = [i for i, a in enumerate(names) if ax[a].cap > 1]
    if not split:
        return "no axis the block holds more than one of"
    inner = names[split[0] + 1:]
    if any(ax[a].cap != ax[a].size for a in inner):
        return f"a chunk of {arr.name} is not contiguous: {', '.join(a for a in inner if ax[a].cap != ax[a].size)} split"
    if math.prod(ax[a].size for a in inner) % 4:
        return "a row is not a multiple of 16 bytes"
    if STAGED_ADD == "auto" and 4 * ax[names[-1]].size < MIN_ROW_BYTES:
        return f"rows of {4 * ax[names[-1]].size} bytes, under staged_add.MIN_ROW_BYTES ({MIN_ROW_BYTES}: measured slower)"
    if STAGED_ADD == "auto" and not skipping:
        return ("no mask skips chunks and cp.async copies them: every block adds into the same chunks "
                "(measured level or slower)")
    if not any(isinstance(n, (Compute, Finalise)) and loops and loops[-1].kind == "stream"
               and t.var in _outputs(ff, n) for n, loops in ff.walk()):
        return "not written once per chunk of a stream loop"
    words = math.prod(ax[a].cap for a in names[:-1]) * (ax[names[-1]].cap + _pad(ax, names))
    used = sum(-(-b.size // 4) * 4 + (255 if getattr(b, "swizzle", False) else 0)   # TMA's alignment
               for b in bufs.values())
    if 4 * (used + -(-words // 4) * 4) > SMEM_LIMIT:
        return "shared memory"
    return None


def _outputs(ff, n) -> tuple[int, ...]:
    if isinstance(n, Compute):
        return tuple(ff.diagram.eqn_outputs(n.eqn))
    return tuple(ff.diagram.eqn_outputs(ff.accumulators[n.acc].eqn))


def _on_warpgroups(targets, accs) -> bool:
    maps = [t.mapping for t in targets.values()] + [p.main for p in accs]
    return any(isinstance(m, Frag) and m.wg for m in maps)


# --------------------------------------------------------------------------- emission

@dataclass
class _State:
    """The emitter's staging in one stream loop: the barrier before the next writes owes thread
    0's wait (``waited`` False); the barrier after the writes owes the reduction (``issue``)."""

    waited: bool = True
    pending: tuple | None = None   # (output argument, global offset, buffer key) of the node being written
    issue: tuple | None = None     # the same, once its values are written


def _staged_here(em, n) -> int | None:
    """The staged output node ``n`` writes, or None."""
    if not isinstance(n, (Compute, Finalise)):
        return None
    return next((v for v in _outputs(em.ff, n) if ("stage", v) in em.bufs), None)


def _walk(nodes):
    for n in nodes:
        yield n
        if isinstance(n, Loop):
            yield from _walk(n.body)


@contextmanager
def loop(em, n, src):
    """Around a stream loop's emission: no bytes staged before it; every reduction waited for
    after it."""
    if not (isinstance(n, Loop) and any(_staged_here(em, m) is not None for m in _walk(n.body))) \
            or getattr(em, "_staged", None) is not None:
        yield
        return
    k = em.consts
    src(f"stage_bytes = {k.u(0, 'U0')}  # bytes of partial sums staged this chunk (.staged_add)")
    em._staged = st = _State()
    try:
        yield
    finally:
        em._staged = None
    if st.issue is not None:   # pragma: no cover - every stream loop ends its chunk with a barrier
        from ..core.errors import LoweringError
        raise LoweringError(f"internal: no barrier after {st.issue[0]}'s staged partial sums in the loop over {n.axis}")
    with src.block(f"if tid == {k.u(0, 'U0')}:"):
        src("bulk_wait_all()  # every bulk reduction of this block is complete before its shared memory goes")


def before(em, n, src) -> None:
    """Before node ``n``, where it writes a staged output: the bytes this chunk stages, and a
    barrier owed (thread 0's wait goes before it, :func:`before_barrier`) ahead of the writes."""
    st = getattr(em, "_staged", None)
    v = _staged_here(em, n) if st is not None else None
    if v is None:
        return
    arr = em.types[v]
    names = arr.axis_names
    pad = em.bufs[("stage", v)].pad   # the global array's rows are padded alike (:func:`row_pad`)
    row = next(a for a in names if em.ax[a].cap > 1)
    inner = math.prod(em.ax[a].size + (pad if a == names[-1] else 0) for a in names[names.index(row) + 1:])
    rows = em.ax[row].count if em.ax[row].ragged else em.ax[row].cap_c
    src(f"stage_bytes = {rows} * {em.consts.u(4 * inner)}  # {arr.name}'s rows this chunk, in bytes")
    zero = em.consts.u(0, "U0")
    st.pending = (em.out_args[em.dd.outs.index(v)], em.gindex(arr, {a: zero for a in names}, pad), ("stage", v))
    st.waited = False
    em.pending_sync = True


def before_barrier(em, src) -> None:
    """Thread 0's wait, owed before the barrier that precedes a staged output's writes."""
    st = getattr(em, "_staged", None)
    if st is not None and not st.waited:
        with src.block(f"if tid == {em.consts.u(0, 'U0')}:"):
            src("bulk_wait_read()  # the last chunk's reduction has read the buffer")
        st.waited = True


def after_barrier(em, src) -> None:
    """The reduction, owed after the barrier that follows a staged output's writes."""
    st = getattr(em, "_staged", None)
    if st is None or st.issue is None:
        return
    out, goff, key = st.issue
    k = em.consts
    with src.block(f"if tid == {k.u(0, 'U0')} and stage_bytes > {k.u(0, 'U0')}:"):
        src(f"bulk_add_f32({out}, {goff}, smem, {em.bufs[key].name}, stage_bytes)  # the chunk's partial sums")
        src("bulk_commit()")
    src(f"stage_bytes = {k.u(0, 'U0')}")
    st.issue = None


def write(em, t, env, val, src) -> bool:
    """Write value ``val`` of output ``t`` into its staging buffer (True), where it is staged."""
    st = getattr(em, "_staged", None)
    if st is None or st.pending is None or st.pending[2] != ("stage", t.var):
        return False
    src(f"{em.sread(st.pending[2], env)} = {val}")
    st.issue = st.pending   # added after the next barrier (the chunk's last at the latest: :func:`loop`)
    em.core_dirty = True    # the copy engine reads it: that barrier is fenced for the async proxy
    return True


# --------------------------------------------------------------------------- the simulator's twins

_BULK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # launch -> {(block, key): state}
_ADD_LOCK = threading.Lock()


def sim_primitive(name: str, context, per_launch):
    """The simulated twin of staged-add primitive ``name``; ``context()`` is the simulator's
    thread context and ``per_launch`` keeps state per launch and block
    (:func:`.tensorcore._per_launch`)."""
    def state() -> dict:
        """This thread's bulk reductions (each issuing thread's own, as the hardware's bulk groups
        are): issued since the last commit (``open``), committed and not yet waited for (``groups``)."""
        ctx = context()
        return per_launch(_BULK, ctx, ("bulk", int(ctx.threadIdx.x)), lambda: {"open": [], "groups": []})

    def add(out, goff, smem, soff, nbytes):
        n = int(nbytes)
        if n % 16 or n <= 0:
            raise ValueError(f"bulk_add_f32: {n} bytes; a bulk reduction takes a positive multiple of 16")
        state()["open"].append((out, int(goff), smem, int(soff), n // 4))
        return 0

    def commit():
        st = state()
        if st["open"]:
            st["groups"].append(list(st["open"]))
            st["open"].clear()
        return 0

    def wait():
        """Every committed group completes now, reading shared memory now (as the copy engine
        may, any time before the wait): what a thread wrote there before this wait is added."""
        st = state()
        with _ADD_LOCK:
            for group in st["groups"]:
                for out, goff, smem, soff, n in group:
                    for e in range(n):
                        out[goff + e] += smem[soff + e]
        st["groups"].clear()
        return 0

    return {"bulk_add_f32": add, "bulk_commit": commit, "bulk_wait_read": wait, "bulk_wait_all": wait}[name]
