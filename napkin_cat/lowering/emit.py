"""Rendering a :class:`~.plan.KernelPlan` as numba.cuda source: :func:`render`.

:class:`Emitter` walks the final form's loop nest inside the grid loops and writes each node
with the plan's decisions: loads (global -> shared, fixed trip counts), stream loops (chunk
skipping, prefetch into registers, double buffering), computes (a target's phase, on its thread
mapping: :mod:`.emit_threads`), accumulators (:data:`.emit_acc.ACC_CODEGEN`) and stores.  The
renderer's own state is the source being written: identifiers and constants (:mod:`.source`),
the barrier owed before the next shared read, and the copy of each double-buffered chunk in use."""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, replace

from ..core.errors import LoweringError
from ..relabel.loopnest import Compute, Finalise, Init, Load, Loop, Store, Update
from .atomics import atomic_add, atomic_add_pair, check_added_outputs
from .column_values import column_value
from .paired_stores import adds_pairs, column_pair, global_pair, stored_pair
from .emit_acc import ACC_CODEGEN
from .emit_kinds import CODEGEN_RULES, scaled_exponent
from . import issue_ahead, producer, reindex, staged_add
from .emit_loads import Loads
from .emit_mma import FragHoist, loaded_vars
from .emit_threads import GROUP_HELPERS, Phases
from .plan import Buffer, KernelPlan, Target
from .source import Constants, Names, Source, paren as _paren
from .tma import params as tma_params, swizzled_index
from .tensorcore import DTYPES, FP32_COPIES, PRIMITIVES, SHARED_PRIMITIVES, TF32X3
from .wgmma import core_index, primitive_names, uses_wgmma
from . import wgmma as wg

RESERVED = {"tid", "smem", "bx", "by", "cuda", "math", "float32", "uint32", "lane", "e", "i", "j",
            "u", "k", "ty", "tx", "acc", "val", "SIMULATOR", "SMEM_ALIGN", "WARP_SHUFFLE",
            "FULL_MASK", "simulator_active", "red_s", "smem16", "smem32", "int16", "ZERO16", "ptid"} | set(PRIMITIVES)


def render(plan: KernelPlan, notes: tuple[str, ...] = ()) -> tuple[str, dict, tuple[str, ...], int, int]:
    """(source, buffer key -> identifier, notes, threads of a copying warpgroup, blocks per SM of
    its launch bounds) of ``plan``;
    ``notes`` go into the docstring, followed by what the renderer itself decided (fragments held
    in registers: .emit_mma; a copying warpgroup: .producer)."""
    why = producer.why_not(plan)
    for mode in producer.hand_overs() if why is None else ():
        em = Emitter(plan, notes, specialise=mode)
        try:
            source = em.emit()
            break
        except producer.NotSpecialised as e:     # emitted again: another hand-over, or every thread copying
            why = str(e)
    else:
        em = Emitter(plan, notes)
        source = em.emit()
    em.notes += producer.note(plan, why, em.producer_threads)
    return wg.no_barrier_in_flight(source), {key: b.name for key, b in em.bufs.items()}, em.notes, em.producer_threads, em.blocks()


@dataclass(frozen=True)
class AxisView:
    """An axis with its identifiers: ``size_c`` / ``cap_c`` constants (global size, extent in a
    block), ``start`` (global index of local index 0), ``count`` (valid extent here: a constant
    or, ragged, a variable), ``index`` (stem of its local index variables)."""

    name: str
    size: int
    role: str
    cap: int
    size_c: str
    cap_c: str
    start: str | None
    count: str
    index: str

    @property
    def ragged(self) -> bool:
        return self.role in ("grid", "stream") and self.size % self.cap != 0


PAIRED_ATOMICS = True
"""Tensor-core fragments added across blocks go two adjacent words per reduction
(:meth:`Emitter._adds_pairs`); False: one ``cuda.atomic.add`` per element (for measuring)."""


class Emitter(Loads, Phases):
    """The renderer of one plan (see the module docstring)."""

    def __init__(self, plan: KernelPlan, notes: tuple[str, ...] = (), specialise: str | None = None):
        self.plan = plan
        self.specialise = specialise            # the stream loop's copies to a copying warpgroup: its hand-over (.producer)
        self.producer_loop = None
        self.consumers_only = False             # barriers meet the computing threads only (.producer, named)
        self.producer_threads = 0
        self.copy_threads = ("tid", "NTHREADS", plan.threads)   # who issues cp.async copies, how many
        self.notes = tuple(notes)
        self.d, self.ff, self.dd = plan.d, plan.ff, plan.dd
        self.types, self.n_in, self.T = plan.types, plan.n_in, plan.threads
        self.st, self.cls, self.targets, self.accs = plan.structure, plan.cls, plan.targets, plan.accs
        self.fused_targets, self.norm_stats, self.unroll = plan.fused_targets, plan.norm_stats, plan.unroll
        self.wgmma = uses_wgmma(plan)
        self.sizes = {a.name: a.size for a in self.dd.axes}
        self.names = Names(RESERVED | set(keyword.kwlist))
        self.consts = Constants(self.names)
        self.ax: dict[str, AxisView] = {}       # identifiers of each axis (_bind_names)
        self.bufs: dict[tuple, Buffer] = {}     # the plan's buffers with their identifiers
        self.cur: dict[tuple, str] = {}         # copy in use of a double-buffered chunk
        self.state_names: dict[int, dict] = {}  # accumulator -> state -> identifier
        self.deferred_z: set[int] = set()  # online softmaxes whose z lanes hold parts (emit_acc)
        self.pending_sync = self.pending_async = False   # a shared write not behind a barrier; cp.async not waited for
        self.core_dirty = False                 # a descriptor-read buffer written, not yet fenced
        self.columns_slot = None                # (mapping, slot before a wait): the next epilogue's column values
        self.full_flags: dict = {}              # (row, col, predicate) -> its chunk's 'keeps all' flag
        self.assumed_full = self.warp_flags = frozenset()   # flags assumed, of a warp's entry (.unswitch)
        self.arg_names, self.out_args = {}, []
        self.added = check_added_outputs(self.ff)   # outputs summed across blocks: atomics (.atomics)

    def _bind_names(self):
        """Constants and identifiers of the axes, then of the shared buffers (in plan order)."""
        k = self.consts
        k.u(self.T, "NTHREADS", comment="threads per block")
        for a in self.plan.axes.values():
            size_c = k.u(a.size, f"N_{a.name}", comment=f"size of axis {a.name}")
            if a.role == "grid":
                cap_c = k.u(a.cap, f"TILE_{a.name}", comment=f"tile of {a.name}")
            elif a.role == "stream":
                cap_c = k.u(a.cap, f"CHUNK_{a.name}", comment=f"chunk of {a.name}")
            elif a.role == "batch":
                cap_c = k.u(1, "U1")
            else:
                cap_c = size_c
            start = self.names.fresh(f"{a.name}0") if a.role in ("grid", "batch", "stream") else None
            count = self.names.fresh(f"len_{a.name}") if a.ragged else cap_c
            self.ax[a.name] = AxisView(a.name, a.size, a.role, a.cap, size_c, cap_c, start, count,
                                       self.names.fresh(f"i_{a.name}"))
        for key, b in self.plan.buffers.items():
            self.bufs[key] = replace(b, name=b.base if key == ("red",) else self.names.fresh(b.base))

    def red_offset(self) -> str:
        b = self.bufs[("red",)]
        return b.name if b.offset else self.consts.u(0, "U0")

    # ------------------------------------------------------------------ index helpers
    def gidx(self, axis: str, env: dict) -> str:
        """Global index of ``axis`` at the local index in ``env``."""
        a = self.ax[axis]
        local = env.get(axis) if a.cap > 1 else None
        if a.start is None:
            return local if local is not None else self.consts.u(0, "U0")
        return f"({a.start} + {local})" if local is not None else a.start

    def sidx(self, b: Buffer, env: dict) -> str:
        if b.key == ("red",):
            return env["_lanes"]
        if not b.axes:
            return self.consts.u(0, "U0")
        if b.core:   # 8 x 8 core matrices, or TMA's swizzled panels (.tma)
            return (swizzled_index(env[b.axes[0]], env[b.axes[1]], b, self.consts.u) if b.swizzle else
                    core_index(env[b.axes[0]], env[b.axes[1]], b.ld, self.consts.u))
        expr = env[b.axes[0]]
        for pos, a in enumerate(b.axes[1:], 1):
            mult = self.ax[a].cap_c
            if pos == len(b.axes) - 1 and b.pad:
                mult = self.consts.u(b.ld, f"LD_{b.name}", comment=f"padded row of {b.name}")
            expr = f"{_paren(expr)} * {mult} + {env[a]}"
        return expr

    def barrier(self, src: Source, fence: bool | None = None):
        """A block barrier, fenced for the tensor cores' async proxy (:mod:`.wgmma`) where a buffer they read by descriptor
        was written since the last fence (``fence=None``: :attr:`core_dirty`; True: copies that land here, or a barrier in an earlier slot)."""
        self.columns_slot = None   # column values are never read above a barrier (.column_values)
        if fence is None:
            fence = self.core_dirty or (self.specialise and wg.FENCE_SPECIALISED) or not wg.FENCE_BY_WRITES
            self.core_dirty = False
        staged_add.before_barrier(self, src)
        if self.wgmma and fence:
            src("fence_proxy_async()")
        src("bar_named(uint32(1), NTHREADS)  # the computing threads" if self.consumers_only else "cuda.syncthreads()")
        staged_add.after_barrier(self, src)

    def wrote(self, key) -> None:
        """Shared buffer ``key`` was written (stored, or copied by ``cp.async``): the next barrier
        publishes it, fenced for the tensor cores where they read it by descriptor."""
        self.pending_sync = True
        b = self.bufs.get(key)
        self.core_dirty |= b is None or b.core

    def sread(self, key, env) -> str:
        """Buffer ``key`` at ``env`` as an fp32 value (16-bit patterns converted)."""
        b = self.bufs[key]
        if b.bits == 16:
            return f"{DTYPES[self.plan.dtype].to_f32}({self.swrite(key, env)})"
        return self.swrite(key, env)

    def swrite(self, key, env) -> str:
        """Buffer ``key`` at ``env`` as a place to store (a 16-bit buffer holds bit patterns)."""
        b = self.bufs[key]
        idx = self.sidx(b, env)
        return f"smem16[{self.s16base(key)} + {idx}]" if b.bits == 16 else \
            f"smem[{self.sbase(key)} + {idx}]" if self.sbase(key) else f"smem[{idx}]"

    def sbase(self, key) -> str | None:
        """The word offset of buffer ``key`` (the copy in use of a double-buffered one)."""
        b = self.bufs[key]
        return self.cur.get(key) or (b.name if b.offset else None)

    def s16base(self, key) -> str:
        """The 16-bit element offset of buffer ``key`` (twice its word offset)."""
        base = self.sbase(key)
        return self.consts.u(0, "U0") if base is None else f"{base} * {self.consts.u(2, 'U2')}"

    def garg(self, v: int) -> str:
        return self.arg_names[v]

    def gread(self, v: int, env) -> str:
        """Input ``v`` at ``env`` read from global memory, as fp32 (16-bit patterns converted)."""
        arr = self.types[v]
        g = f"{self.garg(v)}[{self.gindex(arr, env)}]"
        dt = DTYPES.get(arr.dtype.name)
        return f"{dt.to_f32}({g})" if dt else g

    def gvalue(self, arr, val: str) -> str:
        """An fp32 value as stored in output ``arr`` (rounded to its 16-bit dtype)."""
        dt = DTYPES.get(arr.dtype.name)
        return f"{dt.from_f32}({val})" if dt else val

    def gindex(self, arr, env, pad: int = 0) -> str:
        """``arr``'s flat global index at ``env``; ``pad``: its rows (last axis) are that much longer."""
        expr = None
        for a in arr.axis_names:
            g = self.gidx(a, env)
            size = self.consts.u(self.ax[a].size + pad) if pad and a == arr.axis_names[-1] else self.ax[a].size_c
            expr = g if expr is None else f"{_paren(expr)} * {size} + {g}"
        return expr if expr is not None else self.consts.u(0, "U0")

    def valid(self, axes, env) -> str | None:
        """Bounds checks for the ragged axes among ``axes``."""
        conds = [f"{env[a]} < {self.ax[a].count}" for a in axes
                 if self.ax[a].ragged and self.ax[a].cap > 1 and a in env]
        return " and ".join(conds) if conds else None

    # ------------------------------------------------------------------ values
    def value(self, v: int, env: dict, src: Source, memo: dict, regs: dict | None = None,
              define: int | None = None) -> str:
        """An expression for variable ``v`` at ``env``; inline boxes become temporaries.
        ``define``: the target being computed (read from its definition, not its buffer)."""
        regs = regs or {}
        if v in regs:
            return regs[v]
        if v in memo:
            return memo[v]
        row = env.get("_hoist")
        if row is not None and row.src is not src and row.col not in self.types[v].axis_names:
            expr = self.value(v, env, row.src, row.memo, regs, define)    # once per row
            if not expr.isidentifier():                                     # a read: into a register
                row.memo[v] = self.names.fresh(f"{self.types[v].name}_{v}")
                row.src(f"{row.memo[v]} = {expr}")
            return row.memo[v]
        col = env.get("_colhoist")
        if col is not None and (hoisted := column_value(self, v, env, col, define)):
            return hoisted
        st = "inline" if v == define else self.plan.storage(v)
        if st in ("load", "smem"):
            expr = self.sread(("var", v), env)
        elif st == "inline" and self.plan.var_cls(v) == "elementwise":
            k = self.st.eqn_of[v]
            e = self.dd.eqns[k]
            rule = CODEGEN_RULES[e.box.kind]
            if rule.reads_remapped(e.box):                        # read through its index map
                expr = reindex.read(self, e.box, e.ins[0], env, src, define)
            elif (folded := scaled_exponent(self, v)) is not None:   # exp(c s - m) as one ex2
                c, s, m = folded
                cl = self.consts.f(c / math.log(2.0), "C_PRESCALE_LOG2E", comment="scale * log2(e)")
                log2e = self.consts.f(1.0 / math.log(2.0), "LOG2E")
                sv = self.value(s, env, src, memo, regs, define)
                mv = self.value(m, env, src, memo, regs, define)
                expr = f"math.exp2({_paren(sv)} * {cl} - {_paren(mv)} * {log2e})"
            else:
                n = rule.n_pointwise(e.box)                           # the rest are gathered
                args = [self.value(a, env, src, memo, regs, define) for a in e.ins[:n]] + list(e.ins[n:])
                expr = rule.expr(self, e.box, args, env)
            tmp = self.names.fresh(f"{self.types[v].name}_{v}")
            src(f"{tmp} = {expr}")
            expr = tmp
        elif st == "inline" and self.plan.var_cls(v) == "normaliser":
            expr = self._normalised_value(self.st.eqn_of[v], env, src, memo, regs, define)
        else:
            raise LoweringError(f"internal: {self.types[v]} (storage {st}) is not readable here")
        memo[v] = expr
        return expr

    # ------------------------------------------------------------------ emission
    def emit(self) -> str:
        """The kernel's source text."""
        try:
            self._bind_names()
        except ValueError as e:   # a constant beyond uint32 (Constants.u)
            raise LoweringError(f"{self.d.short()}: {e} (tiles, chunks and buffers must stay below "
                                f"2**32 elements)") from None
        self.arg_names = {}
        argn = Names(RESERVED | set(keyword.kwlist) | {a.start for a in self.ax.values() if a.start})
        for i, arr in enumerate(self.dd.dom):
            self.arg_names[i] = argn.fresh(arr.name)
        self.out_args = []
        for pos, v in enumerate(self.dd.outs):
            name = argn.fresh(self.dd.cod[pos].name if v >= self.n_in else self.dd.cod[pos].name + "_out")
            self.out_args.append(name)
            self.arg_names.setdefault(v, name)
            if v < self.n_in:
                self.arg_names[("out", pos)] = name
        self.names.used |= argn.used
        body = Source(1)
        self.pending_sync = self.pending_async = self.core_dirty = False
        self.reg_copy = {}   # target var -> its register copy (.register_copies)
        self.frag_hoists = []   # the enclosing stream loops' preambles, innermost last (.emit_mma)
        self.hoisted_regs = 0
        try:
            self._emit_prologue(body)
            slot = body.slot() if self.specialise else None   # the copying warpgroup's code (.producer)
            self._emit_nodes(self.plan.inner, body)
            if self.specialise:
                if self.producer_loop is None:
                    raise producer.NotSpecialised("the stream loop's inputs are not all copied by cp.async")
                producer.finish(self, body, slot)
                how = "TMA" if getattr(self, "tma_used", False) else "cp.async"
                self.notes += (f"Copying warpgroup: threads {self.T}..{self.T + self.producer_threads - 1} copy the "
                               f"stream loop's chunks ({how}, {producer.REGS} registers each by setmaxnreg); threads "
                               f"0..{self.T - 1} compute ({producer.consumer_registers(self.T, self.blocks())} registers "
                               f"each); chunks handed over by {self.specialise} barriers.",)
            return self._assemble(body)
        except LoweringError:
            raise
        except ValueError as e:   # a constant beyond uint32 (Constants.u)
            raise LoweringError(f"{self.d.short()}: {e} (tiles, chunks and buffers must stay below "
                                f"2**32 elements)") from None

    def _assemble(self, body: Source) -> str:
        dtype = self.plan.dtype
        compute = "fp32" if dtype == "f32" else f"{dtype} in and out, fp32 compute, tensor cores"
        head = [f'"""{self.plan.name}: generated by napkin_cat.lower (numba.cuda, {compute}); do not edit.', "",
                f"Diagram: {self.d}", "", "Loop nest:"]
        head += ["    " + ln for ln in self.ff.pseudocode(memory=False).splitlines()]
        head += ["", f"Launch: grid {self.plan.launch.grid}, block ({self.T + self.producer_threads}, 1, 1), dynamic shared memory "
                 f"{self.plan.smem_bytes} bytes"]
        head += ["Shared memory: " + ", ".join(f"{b.name}[{' x '.join(map(str, b.caps)) or '1'}] ({b.what})"
                                                for b in self.bufs.values())]
        head += self._engine_lines()
        for note in self.notes:
            head.append(note)
        head.append('"""')
        lines = head + ["", "import math", "", "from numba import cuda, float32, int64, uint32, uint64", "",
                        "from napkin_cat.lowering.runtime import simulator_active", "",
                        *self._primitive_imports(),
                        "SIMULATOR = simulator_active()",
                        "SMEM_ALIGN = None if SIMULATOR else 16  # 16-byte aligned shared memory "
                        "(128-bit loads); the simulator takes no alignment",
                        "WARP_SHUFFLE = not SIMULATOR  # the simulator has no warp shuffles: it "
                        "reduces through shared memory",
                        "FULL_MASK = 0xFFFFFFFF", ""]
        lines += self.consts.header()
        lines += [""]
        if self.plan.needs_scratch():   # with a copying warpgroup, the computing threads meet alone
            helpers = GROUP_HELPERS.replace("cuda.syncthreads()", "bar_named(uint32(1), NTHREADS)") \
                if self.producer_threads else GROUP_HELPERS
            lines += helpers.splitlines() + [""]
        args = [self.arg_names[i] for i in range(self.n_in)] + self.out_args + tma_params(self)
        blocks = self.blocks()
        threads = self.T + self.producer_threads
        lines += [f"# launch bounds: {blocks} block(s) of {threads} threads per SM (shared memory "
                  f"{self.plan.smem_bytes} B per block, about {self.plan.launch.registers} registers per thread "
                  f"estimated)",
                  f"LAUNCH_BOUNDS = {{}} if SIMULATOR else {{\"launch_bounds\": ({threads}, {blocks})}}"]
        lines += ["", f"@cuda.jit(fastmath={self.plan.fastmath}, **LAUNCH_BOUNDS)", f"def {self.plan.name}({', '.join(args)}):"]
        lines += body.lines
        return "\n".join(lines) + "\n"

    def blocks(self) -> int:
        """Blocks per SM the launch bounds ask for: the plan's, or with a copying warpgroup the
        most whose computing threads keep the plan's register estimate (.producer)."""
        b = self.plan.launch.blocks_per_sm
        if not self.producer_threads:
            return b
        need = min(self.plan.launch.registers, producer.MAX_REGS)
        while b > 1 and (producer.consumer_registers(self.T, b) < need
                         or producer.launch_registers(self.T, b) < producer.REGS):
            b -= 1
        return b

    def _engine_lines(self) -> list[str]:
        """Which contraction runs on tensor cores, on which fragments (owners: warps) and with what
        divisibility (the :class:`~.plan.Frag` descriptions)."""
        lines = []
        for t in self.targets.values():
            if t.engine == "mma" and t.source is not None and t.source not in self.st.acc_of_var:
                lines.append(f"Tensor cores: {self.types[t.source].name} = "
                             f"{self.dd.eqns[self.st.eqn_of[t.source]].box.name} on {t.mapping.describe()}")
        for p in self.accs:
            if p.engine == "mma":
                lines.append(f"Tensor cores: {p.acc.box.cod[0].name} ({p.acc.rule}) on {p.main.describe()}")
        return lines

    def _uses_mma(self) -> bool:
        """Whether any contraction of this kernel runs on tensor cores."""
        return any(t.engine == "mma" for t in self.targets.values()) or any(p.engine == "mma" for p in self.accs)

    def _primitive_imports(self) -> list[str]:
        """The tensor-core and 16-bit primitives this kernel's dtypes call (:mod:`.tensorcore`)."""
        dt = DTYPES.get(self.plan.dtype)
        if dt is None:
            if not self._uses_mma():
                return []
            return ["", f"from napkin_cat.lowering.tensorcore import {TF32X3.mma}, {TF32X3.staged}, {TF32X3.pack}, "
                    f"{', '.join(FP32_COPIES)}  # noqa: F401", ""]
        names = (dt.mma, dt.pack, dt.to_f32, dt.from_f32, *SHARED_PRIMITIVES, *primitive_names(self.plan))
        if self.producer_threads:
            names += producer.primitive_names(self.T, self.blocks())
        return ["from numba import int16", "",
                f"from napkin_cat.lowering.tensorcore import {', '.join(names)}  # noqa: F401", "",
                "ZERO16 = int16(0)", ""]

    def _emit_prologue(self, src: Source):
        src("tid = uint32(cuda.threadIdx.x)")
        if self.bufs:
            src("smem = cuda.shared.array(0, dtype=float32, alignment=SMEM_ALIGN)")
            if any(b.bits == 16 for b in self.bufs.values()):
                src("smem16 = cuda.shared.array(0, dtype=int16, alignment=SMEM_ALIGN)  # the same memory, "
                    "16-bit elements")
            self.smem32_slot, self.smem32_declared = src.slot(), False   # .paired_stores
            for b in self.bufs.values():   # views are offsets: NVVM then sees aligned addresses
                if b.offset:
                    self.consts.reserved(b.name, b.offset, comment=f"shared offset of {b.what}"
                                         + (f", layout [{' '.join(b.axes)}]" if b.axes and b.key != ('red',) else "")
                                         + f", {b.size} floats")
        launch = self.plan.launch
        if launch.x_axes:
            src("bx = uint32(cuda.blockIdx.x)")
            self._decode_blocks(src, "bx", [self.ax[a] for a in launch.x_axes])
        if launch.y_axes:
            src("by = uint32(cuda.blockIdx.y)")
            self._decode_blocks(src, "by", [self.ax[a] for a in launch.y_axes])

    def _decode_blocks(self, src, var, axes):
        k = self.consts
        rest = var
        for pos, a in enumerate(reversed(axes)):
            tiles = -(-a.size // a.cap)
            tiles_c = k.u(tiles, f"TILES_{a.name}", comment=f"tiles along {a.name}") if a.role == "grid" else a.size_c
            last = pos == len(axes) - 1
            idx = rest if last else f"{rest} % {tiles_c}"
            if a.name in self.plan.launch.heavy_last and a.role == "grid":
                idx = f"({k.u(tiles - 1)} - {_paren(idx)})"   # the most chunks first
            src(f"{a.start} = {idx} * {a.cap_c}" if a.role == "grid" else f"{a.start} = {idx}")
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            if not last:
                nxt = self.names.fresh(f"{var}_rest")
                src(f"{nxt} = {rest} // {tiles_c}")
                rest = nxt

    def sync(self, src: Source):
        """The barrier before shared memory written since the last one is read; ``cp.async``
        copies issued since (the inputs of one step, all in flight together) are waited for
        first, each thread its own, so the barrier publishes them."""
        if self.pending_async:
            src("cp_async_wait_all()  # every cp.async copy issued above has landed")
            self.pending_async = False
        if self.pending_sync:
            self.barrier(src)
            self.pending_sync = False

    def _emit_nodes(self, nodes, src: Source):
        for n in nodes:
            staged_add.before(self, n, src)   # an output staged for one bulk reduction (.staged_add)
            with issue_ahead.node(self, n, src) as s:   # a later contraction issued early (.issue_ahead)
                self._emit_node(n, s)
        issue_ahead.close(self)

    def _emit_node(self, n, src: Source):
        if isinstance(n, Load):
            self._emit_load(n.var, src)
        elif isinstance(n, Compute):
            self._emit_compute(n.eqn, src)
        elif isinstance(n, Loop):
            settled = not (self.pending_async or self.pending_sync)
            self.frag_hoists.append(FragHoist(src.slot(), n.axis, loaded_vars(n.body), settled))
            with staged_add.loop(self, n, src):
                self._emit_stream_loop(n, src)
            self.frag_hoists.pop()
        elif isinstance(n, Init):
            ACC_CODEGEN[self.ff.accumulators[n.acc].rule].init(self, self.accs[n.acc], src)
        elif isinstance(n, Update):
            ACC_CODEGEN[self.ff.accumulators[n.acc].rule].update(self, self.accs[n.acc], src)
        elif isinstance(n, Finalise):
            p = self.accs[n.acc]
            ACC_CODEGEN[p.acc.rule].publish(self, p, src)
            (v,) = self.dd.eqn_outputs(p.acc.eqn)
            if v in self.targets:
                self._emit_target(self.targets[v], src)
        elif isinstance(n, Store):
            if n.var < self.n_in:
                self._emit_input_store(n.var, src)
        else:  # pragma: no cover
            raise LoweringError(f"internal: unknown loop-nest node {n!r}")

    def _emit_input_store(self, v: int, src: Source):
        pos = self.dd.outs.index(v)
        arr = self.types[v]
        self.sync(src)
        m = self.plan.flat_for(arr.axis_names)
        src.comment(f"store {arr} (an input passed through)")
        with self.flat_elements(m, src) as env:
            cond = self.valid(m.axes, env)
            with src.maybe(cond):
                src(f"{self.arg_names[('out', pos)]}[{self.gindex(arr, env)}] = "
                    f"{self.gvalue(self.dd.cod[pos], self.sread(('var', v), env))}")

    def _decode(self, src, var, axes, env, caps=None):
        rest = var
        for pos, a in enumerate(reversed(axes)):
            stem = self.ax[a].index if a in self.ax else f"i{a}"
            idx = self.names.fresh(stem) if a in env or a not in self.ax else stem
            last = pos == len(axes) - 1
            cap = (caps or {}).get(a) or self.ax[a].cap_c
            src(f"{idx} = {rest}" if last else f"{idx} = {rest} % {cap}")
            env[a] = idx
            if not last:
                nxt = self.names.fresh(f"{var}_{a}")
                src(f"{nxt} = {rest} // {cap}")
                rest = nxt

    # ---- computes
    def _emit_compute(self, k: int, src: Source):
        c = self.cls[k]
        (v,) = self.dd.eqn_outputs(k)
        if c == "normaliser":
            self._emit_norm_stats(k, src)
        if v in self.targets and v not in self.fused_targets:
            self._emit_target(self.targets[v], src)

    # ---- writing a target's value
    def write_target(self, t: Target, env, val: str, src: Source):
        arr = self.types[t.var]
        if t.to_smem and self.bufs[("var", t.var)].bits == 16:
            # rounded once to the kernel's dtype (.sixteen_bit); zero past a ragged extent, where
            # ldmatrix reads whole fragments as it does from a zero-filled input chunk
            key = ("var", t.var)
            bits = f"{DTYPES[self.plan.dtype].from_f32}({val})"
            cond = self.valid(self.bufs[key].axes, env)
            if not stored_pair(self, t, env, val, cond, src):
                src(f"{self.swrite(key, env)} = " + (f"{bits} if {cond} else ZERO16" if cond else bits))
        elif t.to_smem:
            src(f"{self.sread(('var', t.var), env)} = {val}")
        if t.to_global:
            cond = self.valid(self.plan.caps(arr.axis_names)[0], env)
            pairs = t.var in self.added and adds_pairs(self, t, arr, env, PAIRED_ATOMICS)
            with src.maybe(cond):
                for pos, ov in enumerate(self.dd.outs):
                    if ov != t.var:
                        continue
                    out = self.out_args[pos]
                    if t.var in self.added and staged_add.write(self, t, env, val, src):
                        continue                       # staged in shared memory (.staged_add)
                    if pairs:                          # blocks add into it, a column pair at a time
                        with column_pair(self, arr.name, "added as one reduction", val, env, src) as pair:
                            src(atomic_add_pair(out, f"{self.gindex(arr, env)} - {self.consts.u(1)}",
                                                f"{pair}[0]", f"{pair}[1]"))
                    elif t.var in self.added:          # blocks add into it, a word at a time
                        src(atomic_add(out, self.gindex(arr, env), val))
                    elif not global_pair(self, t, arr, env, val, out, src):   # 16-bit pairs: one word
                        src(f"{out}[{self.gindex(arr, env)}] = {self.gvalue(arr, val)}")

    def _emit_target(self, t: Target, src: Source):
        self.sync(src)
        arr = self.types[t.var]
        m = t.mapping
        if t.source is None:
            src.comment(f"{arr} = {self.describe_chain(t.var)}  ({m.describe()})")
            with self.elements(m, src) as env:
                memo = {}
                val = self.value(t.var, env, src, memo, define=t.var)
                self.write_target(t, env, val, src)
        elif t.source in self.st.acc_of_var:
            p = self.accs[self.st.acc_of_var[t.source]]
            src.comment(f"{arr} = {self.describe_chain(t.var)}: finalise {p.acc.rule}  ({m.describe()})")
            with self.mapping_begin(m, src):
                with self.elements(m, src) as env:
                    memo = {}
                    fin = ACC_CODEGEN[p.acc.rule].final_value(self, p, env, src)
                    val = self.value(t.var, env, src, memo, {t.source: fin}, define=t.var)
                    self.write_target(t, env, val, src)
        else:
            self._emit_reduction_target(t, src)
        if t.to_smem:
            self.wrote(("var", t.var))

    def describe_chain(self, v: int) -> str:
        if v < self.n_in or v in self.st.acc_of_var:
            return self.types[v].name
        e = self.dd.eqns[self.st.eqn_of[v]]
        return f"{e.box.name}({', '.join(self.describe_chain(a) if self.plan.storage(a) in ('inline', 'regs') else self.types[a].name for a in e.ins)})"

