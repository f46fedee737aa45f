"""Loads and stream loops of :class:`.emit.Emitter`: global -> shared copies of the inputs
(element loops, or ``cp.async`` 16-byte copies of 16-bit inputs), stream loops with chunk
skipping, prefetch into registers, and double buffering (through registers, or with
``cp.async`` straight into the other buffer).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..relabel.loopnest import Load, Loop
from . import producer
from .emit_tables import TableReads
from .tensorcore import DTYPES
from .source import Code, CodeAlgebra, Source, paren as _paren, render_code


# comments on the bounds of a stream over a mask's rows (its columns tiled: the backward's dK / dV)
_TRANSPOSED_NOTES = ("later chunks are masked for every column of the tile (transposed support)",
                     "earlier chunks are masked for every column of the tile (transposed support)")

STRIDED_COPIES = True
"""``cp.async`` copies decode each thread's element once and step by a constant (see
:meth:`Loads._decode_strided`); False: every step decodes ``e = tid + u * T`` anew, as before."""


class _CodeLogic:
    """:meth:`napkin_cat.ops.index.Predicate.chunk_state` as code: conditions on the bounds."""

    def __init__(self, u):
        self.u = u

    def le(self, a, b) -> str:
        return f"{render_code(a, self.u)} <= {render_code(b, self.u)}"

    @staticmethod
    def and_(a, b) -> str:
        return f"({a} and {b})"

    @staticmethod
    def or_(a, b) -> str:
        return f"({a} or {b})"


TRANSPOSED_FLAGS = True
"""Chunk flags (kept whole, masked whole by a block table) also for masks whose rows a loop
streams (the backward's dK, dV: queries streamed inside key tiles); False: only for masks whose
columns it streams (a switch for measuring: ``kernels/probes/table_fwd_bwd.py --compare``)."""


class Loads(TableReads):
    """The load and stream-loop part of the renderer (see the module docstring)."""

    def _emit_stream_loop(self, lp: Loop, src: Source):
        if self.plan.prefetch == "double" and any(isinstance(n, Load) for n in lp.body):
            return self._emit_double_buffered_loop(lp, src)
        a = self.ax[lp.axis]
        lo, hi = self._stream_bounds(lp, src)
        loads = [n for n in lp.body if isinstance(n, Load)] if self.plan.prefetch else []
        if loads:
            src.comment(f"stream {a.name} in chunks of {a.cap}; each chunk's inputs are fetched into "
                        f"registers one chunk ahead, so the global loads overlap the compute")
            regs = {n.var: self.names.fresh(f"{self.types[n.var].name}_next") for n in loads}
            for n in loads:
                src(f"{regs[n.var]} = cuda.local.array({self.plan.load_plan(n.var)[1]}, {self._reg_type(n.var)})")
            first = self._first_chunk(lp, lo, hi, src)
            # a mask may start the loop past the axis (lo >= hi): then there is nothing to fetch
            with src.maybe(None if first == self.consts.u(0, "U0") else f"{first} < {hi}"):
                self._emit_fetch(loads, regs, first, src, lp.axis)
        else:
            src.comment(f"stream {a.name} in chunks of {a.cap}")
        with src.block(self._chunk_header(lp, lo, hi, first if loads else None, src)):
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            empty = self._chunk_flags(lp, src)
            if loads:
                for n in loads:
                    self._emit_load(n.var, src, regs[n.var])
                self.sync(src)
                nxt = self._next_chunk(lp, hi, src)
                with src.block(f"if {nxt} < {hi}:"):
                    self._emit_fetch(loads, regs, nxt, src, lp.axis)
            body = [n for n in lp.body if not (loads and isinstance(n, Load))]
            self._emit_guarded(body, empty, src)
            self.pending_sync = True
            self.sync(src)
            if loads:
                self._advance(lp, nxt, src)
        self._drop_flags(lp)

    # ---- which chunks a prefetching loop visits
    def _skips_by_data(self, lp: Loop) -> bool:
        """Whether a block table (data) masks whole chunks of ``lp``: then a loop that fetches
        one chunk ahead visits the chunks it computes only, and fetches the next of those."""
        return any(s.pred.block_atoms() and (TRANSPOSED_FLAGS or not s.transposed) for s in self.plan.skips[lp.axis])

    def _next_kept(self, lp: Loop, start: str, hi: str, src: Source) -> str:
        """The first chunk at or after ``start`` that no block table masks whole (``hi`` or past
        it when none): a scan of the table's entries, which the tile loaded and every thread reads
        alike, so the block stays in step."""
        a = saved = self.ax[lp.axis]
        name = self.names.fresh(f"{a.name}_kept")
        src(f"{name} = uint64({start})")
        with src.block(f"while {name} < {hi}:"):
            self.ax[lp.axis] = replace(saved, start=name)
            if saved.ragged:
                cnt = self.names.fresh(f"len_{a.name}")
                src(f"{cnt} = min({a.cap_c}, {a.size_c} - {name})")
                self.ax[lp.axis] = replace(self.ax[lp.axis], count=cnt)
            flags = dict(self.full_flags)
            empty = self._chunk_flags(lp, src)
            self.full_flags.clear()            # the scanned chunk's flags are not the current one's
            self.full_flags.update(flags)
            with src.maybe(None if empty is None else f"not {empty}"):
                src("break")
            src(f"{name} = {name} + {a.cap_c}")
        self.ax[lp.axis] = saved
        return name

    def _first_chunk(self, lp: Loop, lo: str, hi: str, src: Source) -> str:
        return self._next_kept(lp, lo, hi, src) if self._skips_by_data(lp) else lo

    def _chunk_header(self, lp: Loop, lo: str, hi: str, first: str | None, src: Source) -> str:
        """``for x0 in range(lo, hi, cap):``, or, for a prefetching loop (``first``: its first
        chunk) over chunks a block table skips, ``while x0 < hi:`` from ``first`` over the kept
        chunks (:meth:`_advance` moves it)."""
        a = self.ax[lp.axis]
        if first is None or not self._skips_by_data(lp):
            return f"for {a.start} in range({lo}, {hi}, {a.cap_c}):"
        src(f"{a.start} = {first}")
        return f"while {a.start} < {hi}:"

    def _next_chunk(self, lp: Loop, hi: str, src: Source) -> str:
        """The chunk a prefetching loop fetches next: the following one, or the next kept one."""
        a = self.ax[lp.axis]
        if self._skips_by_data(lp):
            return self._next_kept(lp, f"{a.start} + {a.cap_c}", hi, src)
        nxt = self.names.fresh(f"{a.name}_next")
        src(f"{nxt} = {a.start} + {a.cap_c}")
        return nxt

    def _advance(self, lp: Loop, nxt: str, src: Source):
        if self._skips_by_data(lp):
            src(f"{self.ax[lp.axis].start} = {nxt}")

    def _emit_async_loop(self, lp: Loop, src: Source):
        """Double buffering with ``cp.async`` (16-bit inputs, :meth:`_vector_ok`): chunk c + 1 is
        copied into one buffer while chunk c is computed from the other, with no registers in
        between; each thread waits for its own copies of chunk c, then one barrier."""
        if self.specialise:     # the copies go to a copying warpgroup
            return producer.emit_loop(self, lp, src)
        k = self.consts
        a = self.ax[lp.axis]
        lo, hi = self._stream_bounds(lp, src)
        loads = [n for n in lp.body if isinstance(n, Load)]
        bufs = [self.bufs[("var", n.var)] for n in loads]
        src.comment(f"stream {a.name} in chunks of {a.cap}, double-buffered with cp.async: chunk c + 1 "
                    f"is in flight while chunk c is computed")
        stride, base = self._copy_layout(bufs)
        par = self.names.fresh(f"buf_{a.name}")
        src(f"{par} = {k.u(0, 'U0')}  # which copy holds the current chunk")
        first = self._first_chunk(lp, lo, hi, src)
        with src.block(f"if {first} < {hi}:"):
            self._issue_chunk(lp, loads, bufs, first, k.u(0, "U0"), src)
        with src.block(self._chunk_header(lp, lo, hi, first, src)):
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            nxt = self._next_chunk(lp, hi, src)
            with src.block(f"if {nxt} < {hi}:"):
                self._issue_chunk(lp, loads, bufs, nxt, f"({k.u(1, 'U1')} - {par})", src)
                src("cp_async_wait1()  # this chunk's copies have landed; the next one's may not")
            with src.block("else:"):
                src("cp_async_wait_all()")
            self.barrier(src, fence=any(b.core for b in bufs) or None)   # this chunk's copies land here
            self.core_dirty = False       # the next chunk's (issued above) land at the next one, fenced there
            self.pending_async = False    # earlier copies were committed with the first chunk's
            for b in bufs:
                self.cur[b.key] = self.names.fresh(f"{b.name}_cur")
                src(f"{self.cur[b.key]} = {base[b.name]} + {par} * {stride[b.name]}")
            self.pending_sync = False
            empty = self._chunk_flags(lp, src)
            self._emit_guarded([n for n in lp.body if not isinstance(n, Load)], empty, src)
            self.pending_sync = True
            self.sync(src)
            src(f"{par} = {k.u(1, 'U1')} - {par}")
            self._advance(lp, nxt, src)
        self._drop_flags(lp)
        for b in bufs:
            del self.cur[b.key]

    def _copy_layout(self, bufs) -> tuple[dict, dict]:
        """``(stride, base)`` of double-buffered chunk buffers: the words between the two copies,
        the first copy's offset."""
        k = self.consts
        return ({b.name: k.u(b.stride, f"STRIDE_{b.name}", comment=f"words per copy of {b.name}") for b in bufs},
                {b.name: (b.name if b.offset else k.u(0, "U0")) for b in bufs})

    def _issue_chunk(self, lp: Loop, loads, bufs, start: str, copy: str, src: Source):
        """``cp.async`` of the chunk of ``lp`` starting at ``start`` into copy ``copy`` of its
        buffers, committed as one group (by :attr:`copy_threads`)."""
        a = self.ax[lp.axis]
        stride, base = self._copy_layout(bufs)
        self.ax[lp.axis] = replace(a, start=start)
        if a.ragged:
            cnt = self.names.fresh(f"len_{a.name}")
            src(f"{cnt} = min({a.cap_c}, {a.size_c} - {_paren(start)})")
            self.ax[lp.axis] = replace(self.ax[lp.axis], count=cnt)
        for n, b in zip(loads, bufs):
            self.cur[b.key] = self.names.fresh(f"{b.name}_fill")
            src(f"{self.cur[b.key]} = {base[b.name]} + {copy} * {stride[b.name]}")
            self._vector_load(n.var, src, wait=False)
        src("cp_async_commit()")
        self.ax[lp.axis] = a

    def _emit_double_buffered_loop(self, lp: Loop, src: Source):
        if all(self._vector_ok(n.var) for n in lp.body if isinstance(n, Load)):
            return self._emit_async_loop(lp, src)
        k = self.consts
        a = self.ax[lp.axis]
        lo, hi = self._stream_bounds(lp, src)
        loads = [n for n in lp.body if isinstance(n, Load)]
        bufs = [self.bufs[("var", n.var)] for n in loads]
        src.comment(f"stream {a.name} in chunks of {a.cap}, double-buffered: chunk c + 1 is fetched into "
                    f"registers while chunk c is computed from one shared buffer, then stored into the "
                    f"other; one barrier per chunk")
        regs = {n.var: self.names.fresh(f"{self.types[n.var].name}_next") for n in loads}
        for n in loads:
            src(f"{regs[n.var]} = cuda.local.array({self.plan.load_plan(n.var)[1]}, {self._reg_type(n.var)})")
        first = self._first_chunk(lp, lo, hi, src)
        with src.block(f"if {first} < {hi}:"):
            self._emit_fetch(loads, regs, first, src, lp.axis)
            for n, b in zip(loads, bufs):
                self.cur[b.key] = b.name if b.offset else k.u(0, "U0")
                self._emit_load(n.var, src, regs[n.var])
        self.pending_sync = True
        self.sync(src)
        par = self.names.fresh(f"buf_{a.name}")
        src(f"{par} = {k.u(0, 'U0')}  # which copy holds the current chunk")
        with src.block(self._chunk_header(lp, lo, hi, first, src)):
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            stride = {}
            for b in bufs:
                stride[b.name] = k.u(b.stride, f"STRIDE_{b.name}", comment=f"floats per copy of {b.name}")
                self.cur[b.key] = self.names.fresh(f"{b.name}_cur")
                base = b.name if b.offset else k.u(0, "U0")
                src(f"{self.cur[b.key]} = {base} + {par} * {stride[b.name]}")
            nxt = self._next_chunk(lp, hi, src)
            with src.block(f"if {nxt} < {hi}:"):
                self._emit_fetch(loads, regs, nxt, src, lp.axis)
            body = [n for n in lp.body if not isinstance(n, Load)]
            self._emit_guarded(body, self._chunk_flags(lp, src), src)
            with src.block(f"if {nxt} < {hi}:"):
                cur = [self.cur[b.key] for b in bufs]
                for n, b in zip(loads, bufs):
                    base = b.name if b.offset else k.u(0, "U0")
                    self.cur[b.key] = self.names.fresh(f"{b.name}_other")
                    src(f"{self.cur[b.key]} = {base} + ({k.u(1, 'U1')} - {par}) * {stride[b.name]}")
                    self._emit_load(n.var, src, regs[n.var])
                for b, c in zip(bufs, cur):
                    self.cur[b.key] = c
            self.pending_sync = True
            self.sync(src)
            src(f"{par} = {k.u(1, 'U1')} - {par}")
            self._advance(lp, nxt, src)
        self._drop_flags(lp)
        for b in bufs:
            del self.cur[b.key]

    def _emit_fetch(self, loads, regs, start: str, src: Source, axis: str):
        """Global -> registers for the chunk starting at ``start`` (a prefetch)."""
        k = self.consts
        for n in loads:
            arr = self.types[n.var]
            names, _ = self.plan.caps(arr.axis_names)
            order = self._load_order(n.var)
            total, per = self.plan.load_plan(n.var)
            ax = saved = self.ax[axis]
            ax = self.ax[axis] = replace(ax, start=start)   # the chunk being fetched
            if ax.ragged:
                cnt = self.names.fresh(f"len_{ax.name}")
                src(f"{cnt} = min({ax.cap_c}, {ax.size_c} - {start})")
                self.ax[axis] = replace(ax, count=cnt)
            with src.block(f"for u in range({k.u(per)}):"):
                src("e = tid + u * NTHREADS")
                with src.maybe(f"e < {k.u(total)}" if total % self.T else None):
                    env = {}
                    self._decode(src, "e", order, env)
                    raw = self.bufs[("var", n.var)].bits == 16
                    g = f"{self.garg(n.var)}[{self.gindex(arr, env)}]" if raw else self.gread(n.var, env)
                    cond = self.valid(names, env)
                    if cond:
                        src(f"{regs[n.var]}[u] = {g} if {cond} else {'ZERO16' if raw else k.f(0.0, 'ZERO')}")
                    else:
                        src(f"{regs[n.var]}[u] = {g}")
            self.ax[axis] = saved

    def _stream_bounds(self, lp: Loop, src: Source) -> tuple[str, str]:
        """Chunks every score of which a mask sends to -inf contribute nothing to an online
        softmax (or max / logsumexp), nor to a sum of terms a mask zeroes: skip them.
        The bounds are the supports of the masks
        (:func:`napkin_cat.relabel.skipping.chunk_skips`) over the rows of the block's tile:
        an end where a mask bounds the columns from above (``j <= i``), a start where it bounds
        them from below (``j >= i``), both for a window."""
        k = self.consts
        lo, hi = k.u(0, "U0"), self.ax[lp.axis].size_c
        a = self.ax[lp.axis]
        for s in self.plan.skips[lp.axis]:
            r = self.ax[s.row]
            first, end = s.support(Code(r.start), Code(f"{r.start} + {r.count}"), CodeAlgebra)
            later, earlier = _TRANSPOSED_NOTES if s.transposed else s.pred.rule.skip_notes
            if end is not None:
                end = render_code(end, k.u)
                name = self.names.fresh(f"{a.name}_end")
                src(f"{name} = min({hi}, {end})  # {later}")
                hi = name
            if not (isinstance(first, int) and first == 0):
                first = render_code(first, k.u)
                start = self.names.fresh(f"{a.name}_begin")
                if lo == k.u(0, "U0"):
                    src(f"{start} = {_paren(first)} // {a.cap_c} * {a.cap_c}  # {earlier}")
                else:
                    src(f"{start} = max({lo}, {_paren(first)} // {a.cap_c} * {a.cap_c})  # {earlier}")
                lo = start
        if any(p.block_atoms() for _, p, _, _ in self._chunk_masks(lp)):
            self.sync(src)      # the block tables (loaded with the tile) are read per chunk
        return lo, hi

    # ---- per-chunk mask states
    def _chunk_masks(self, lp: Loop):
        """``(eqn, predicate, tiled axis, transposed)`` of the masks over a tiled axis and
        ``lp``'s: rows tiled and columns streamed, or (``transposed``: the backward's dK / dV)
        rows streamed and columns tiled."""
        out = []
        for k, e in enumerate(self.dd.eqns):
            if e.box.kind != "mask":
                continue
            row, col = e.box.param("row"), e.box.param("col")
            orders = [(row, col, False)] + ([(col, row, True)] if TRANSPOSED_FLAGS else [])
            for tiled, streamed, transposed in orders:
                if streamed == lp.axis and tiled in self.ax and self.ax[tiled].role == "grid":
                    out.append((k, e.box.param("pred"), tiled, transposed))
        return out

    def _chunk_flags(self, lp: Loop, src: Source) -> str | None:
        """At the top of a chunk: for each mask over (tiled rows, this axis), whether it keeps
        the whole chunk (then its expression is not evaluated: :func:`.emit_kinds._expr_mask`
        reads the flag), and for a mask that reads a block table and bounds the chunks
        (:attr:`.plan.KernelPlan.skips`), whether it masks the whole chunk: the returned
        condition, under which the chunk's work is skipped (None: never).  Both come from
        :meth:`napkin_cat.ops.index.Predicate.chunk_state` over the tile's rows and the chunk's
        columns; every thread of the block computes the same values (no divergence at the
        barriers inside)."""
        k = self.consts
        a = self.ax[lp.axis]
        flags = self.full_flags
        self._chunk_entries = {}
        skipping = {(s.row, s.pred, s.transposed) for s in self.plan.skips[lp.axis] if s.pred.block_atoms()}
        empties = []
        lg = _CodeLogic(k.u)
        chunk = (Code(a.start), Code(f"{a.start} + {a.count}"))
        for eqn, pred, tiled, transposed in self._chunk_masks(lp):
            t = self.ax[tiled]
            tile = (Code(t.start), Code(f"{t.start} + {t.count}"))
            # in the mask's (row, column) order: the tile's rows and the chunk's columns, or transposed
            (r0, r1), (c0, c1) = (chunk, tile) if transposed else (tile, chunk)
            over = (lp.axis, tiled) if transposed else (tiled, lp.axis)
            read = []   # the table entries this block reads (none where it holds several of its slices)

            def atom(at, eqn=eqn, pred=pred, over=over, r0=r0, r1=r1, c0=c0, c1=c1):
                state = self._block_atom(at, eqn, pred, over, r0, r1, c0, c1, src)
                read.append(state != (False, False))
                return state
            full, empty = pred.chunk_state(r0, r1, c0, c1, CodeAlgebra, lg, atom)
            if full is not False:
                name = self.names.fresh(f"{a.name}_full")
                src(f"{name} = {full}  # the mask keeps the whole chunk: its arithmetic is skipped")
                flags[(*over, pred)] = name
            if (tiled, pred, transposed) in skipping and empty is not False and any(read):
                empties.append(empty)   # the bounds alone are the loop's (relabel.skipping)
                flags[(*over, pred, ("skips",))] = (r0, r1, c0, c1)   # the chunk's extent (.unswitch)
        if not empties:
            return None
        name = self.names.fresh(f"{a.name}_empty")
        src(f"{name} = {' or '.join(empties)}  # the block table masks the whole chunk: skipped")
        return name

    def _emit_guarded(self, nodes, empty: str | None, src: Source):
        with src.maybe(None if empty is None else f"not {empty}"):
            self._emit_nodes(nodes, src)

    def _drop_flags(self, lp: Loop):
        flags = self.full_flags
        for key in [key for key in flags if lp.axis in key[:2]]:
            del flags[key]

    # ---- loads and stores
    def _emit_load(self, v: int, src: Source, from_regs: str | None = None):
        arr = self.types[v]
        if self.ff.in_place(v):
            src.comment(f"{arr} stays in global memory: its gathers read it in place")
            return
        b = self.bufs[("var", v)]
        k = self.consts
        names, caps = self.plan.caps(arr.axis_names)
        order = self._load_order(v)
        n = max(1, math.prod(caps))
        env = {}
        if from_regs:
            src.comment(f"chunk of {arr}: registers -> shared {b.name} [{' '.join(b.axes)}]")
            with src.block(f"for u in range({k.u(-(-n // self.T))}):"):
                src("e = tid + u * NTHREADS")
                with src.maybe(f"e < {k.u(n)}" if n % self.T else None):
                    self._decode(src, "e", order, env)
                    src(f"{self.swrite(b.key, env)} = {from_regs}[u]")
            self.wrote(b.key)
            return
        if self._vector_load(v, src):
            return
        src.comment(f"load {arr} -> shared {b.name} [{' '.join(b.axes)}]  (a fixed trip count: "
                    f"the loop unrolls and every load is in flight before the first store)")
        with src.block(f"for u in range({k.u(-(-n // self.T))}):"):
            src("e = tid + u * NTHREADS")
            with src.maybe(f"e < {k.u(n)}" if n % self.T else None):
                self._decode(src, "e", order, env)
                g = self.gread(v, env) if b.bits == 32 else f"{self.garg(v)}[{self.gindex(arr, env)}]"
                cond = self.valid(names, env)
                if cond:
                    zero = k.f(0.0, 'ZERO') if b.bits == 32 else "ZERO16"
                    src(f"{self.swrite(b.key, env)} = {g} if {cond} else {zero}")
                else:
                    src(f"{self.swrite(b.key, env)} = {g}")
        self.wrote(b.key)

    def _reg_type(self, v: int) -> str:
        return "int16" if self.bufs[("var", v)].bits == 16 else "float32"

    def _vector_width(self, v: int) -> int:
        """Elements per 16-byte ``cp.async`` copy of input ``v``'s block: 8 for a 16-bit input, 4
        for an fp32 input of a kernel that links the tensor-core primitives (16-bit, or fp32 on
        tensor cores); 0 where its block rows are not whole 16-byte groups in global memory and
        in its buffer, or it holds anything else (then no ``cp.async``)."""
        arr = self.types[v]
        b = self.bufs[("var", v)]
        names, _ = self.plan.caps(arr.axis_names)
        if not names or b.axes[-1] != names[-1] or arr.axis_names[-1] != names[-1]:
            return 0
        if b.bits == 16:
            w = 8
        elif arr.dtype.name == "f32" and not b.core and (DTYPES.get(self.plan.dtype) or self._uses_mma()):
            w = 4
        else:
            return 0
        last = self.ax[names[-1]]
        return 0 if (last.cap % w or last.size % w or b.ld % w) else w

    def _vector_ok(self, v: int) -> bool:
        """Whether ``cp.async`` copies input ``v`` (:meth:`_vector_width`)."""
        return self._vector_width(v) > 0

    def _vector_load(self, v: int, src: Source, wait: bool = True) -> bool:
        """``cp.async`` of input ``v``'s block (:meth:`_vector_width`), 16 bytes per thread and
        step, zero-filled past a ragged end; ``wait``: waited for at the next barrier (:meth:`sync`),
        so the inputs loaded one after another are in flight together (``False``: the caller
        commits and waits).  Returns False (nothing emitted) where that does not apply."""
        w = self._vector_width(v)
        if not w:
            return False
        arr = self.types[v]
        b = self.bufs[("var", v)]
        names, caps = self.plan.caps(arr.axis_names)
        last = self.ax[names[-1]]
        k = self.consts
        groups = math.prod(caps[:-1]) * (last.cap // w)
        src.comment(f"load {arr} -> shared {b.name} [{' '.join(b.axes)}]: cp.async, 16 bytes "
                    f"({w} elements of {names[-1]}) per thread and step")
        env = {}
        tid, nthreads, T = self.copy_threads    # every thread, or the copying warpgroup's (.producer)
        g = f"_g{w}"
        if b.core:   # 8 consecutive threads fill one 8 x 8 block: 128 contiguous bytes
            digits = {"_p8": -(-caps[0] // 8), g: last.cap // 8, "_r8": 8}
        else:
            digits = {**dict(zip(names[:-1], caps[:-1])), g: last.cap // w}
        with src.block(f"for u in range({k.u(-(-groups // T))}):"):
            src(f"e = {tid} + u * {nthreads}")
            with src.maybe(f"e < {k.u(groups)}" if groups % T else None):
                self._decode_strided(src, tid, T, digits, env)
                if b.core:
                    row = self.names.fresh(self.ax[names[0]].index)
                    src(f"{row} = {env['_p8']} * {k.u(8)} + {env['_r8']}")
                    env[names[0]] = row
                col = self.names.fresh(last.index)
                src(f"{col} = {env[g]} * {k.u(w)}")
                env[names[-1]] = col
                cond = self.valid(names, env) or "True"
                if b.bits == 16:
                    src(f"cp_async16(smem16, {self.s16base(b.key)} + {self.sidx(b, env)}, {self.garg(v)}, "
                        f"{self.gindex(arr, env)}, {cond})")
                else:
                    base = self.sbase(b.key)
                    at = self.sidx(b, env) if base is None else f"{base} + {self.sidx(b, env)}"
                    src(f"cp_async16_f32(smem, {at}, {self.garg(v)}, {self.gindex(arr, env)}, {cond})")
        if wait:        # waited for at the next barrier, with the copies issued after it
            self.pending_async = True
        self.wrote(b.key)
        return True

    def _decode_strided(self, src, tid: str, T: int, digits: dict, env: dict):
        """The digits (outermost first, ``{name: radix}``) of ``e = tid + u * T``.  Where ``T`` is
        a multiple of the inner digits' span, they depend on ``tid`` alone and the outermost digit
        grows by ``T / span`` a step: each step's addresses are then the first's plus a constant,
        which the compiler folds into the copy instruction (so a copying warpgroup keeps no address
        per step in registers: measured at d = 128, its copies spilled at 40 and 56 registers)."""
        k = self.consts
        names = tuple(digits)
        span = math.prod(digits[a] for a in names[1:])
        if len(names) < 2 or T % span or not STRIDED_COPIES:
            self._decode(src, "e", names, env, caps={a: k.u(r) for a, r in digits.items()})
            return
        inner = self.names.fresh("e_in")
        src(f"{inner} = {tid} % {k.u(span)}  # the same every step")
        self._decode(src, inner, names[1:], env, caps={a: k.u(r) for a, r in digits.items()})
        a = names[0]
        stem = self.ax[a].index if a in self.ax else f"i{a}"
        idx = self.names.fresh(stem) if a in env or a not in self.ax else stem   # as _decode names it
        src(f"{idx} = {tid} // {k.u(span)} + u * {k.u(T // span)}")
        env[a] = idx

    def _load_order(self, v: int) -> tuple[str, ...]:
        """Axes in the order consecutive threads walk an input's elements: global order
        (coalesced reads) unless the buffer is transposed and unpadded, then shared order
        (conflict-free stores; such a buffer is loaded once, outside the stream loops)."""
        names, _ = self.plan.caps(self.types[v].axis_names)
        b = self.bufs[("var", v)]
        if b.axes and names and b.axes[-1] != names[-1] and not b.pad:
            return b.axes
        return names
