"""Thread mappings as loops, and the phases that run on them (the CUDA-core engine).

:class:`Phases` is the part of the renderer (:class:`.emit.Emitter`) that turns a mapping of the
plan into loops over a thread's elements (:class:`~.plan.Flat`, :class:`~.plan.Micro`,
:class:`~.plan.Coop`), renders contractions on CUDA cores (register micro-tiles: operand
fragments, then outer products; ``engine == "cuda_core"`` in the plan), group reductions among
lanes (warp shuffles on a GPU, a shared-memory tree under the simulator), reduction targets and
the row statistics of normalisers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

from ..core.errors import LoweringError
from ..ops.kinds import NORMALISATIONS
from .emit_kinds import CODEGEN_RULES, REDUCE_OPS, fn_expr
from .emit_mma import contract_mma, frag_begin, frag_cols, frag_rows
from .plan import Coop, Flat, Frag, Micro, Target
from .register_copies import keep_copy, open_copy
from .column_values import column_hoist
from .source import RowHoist, Source
from .unswitch import unswitched

IDLE_START = 0x7FFFFFFF
"""First index of an idle lane group's loops (past every bound: the loops are empty)."""


def _unroll_factor(limit: int, n: int) -> int:
    u = max(1, int(limit))
    while u > 1 and n % u:
        u //= 2
    return u


@dataclass(frozen=True)
class Operand:
    """A factor of a contraction: the axes it depends on and how to read it at an index."""

    axes: frozenset
    read: Callable  # (env, memo, src) -> expression
    padded: bool = False      # reads as zero past a ragged extent (a zero-filled input chunk)
    frag: str | None = None   # a local array holding it in the C-fragment layout of the rows (mma)
    buffer: tuple | None = None   # the 16-bit shared buffer it is read from as is (mma: ldmatrix)


_GROUP_HELPER = '''
@cuda.jit(device=True, inline=True)
def _group_{name}(v, lane, width, smem, base, tid):
    """{doc}"""
    if WARP_SHUFFLE and width <= 32:
        off = width // uint32(2)
        while off > uint32(0):
            {shuffle}
            off //= uint32(2)
        return v
    smem[base + tid] = v
    cuda.syncthreads()
    off = width // uint32(2)
    while off > uint32(0):
        if lane < off:
            smem[base + tid] = {combine}
        cuda.syncthreads()
        off //= uint32(2)
    v = smem[base + tid - lane]
    cuda.syncthreads()
    return v
'''


def _group_helper(name: str, doc: str, combine: str) -> str:
    """One group reduction (warp shuffles on a GPU, a shared-memory tree under the simulator)
    for the combining expression ``combine`` of ``{a}`` and ``{b}``."""
    shuffled = combine.format(a="v", b="cuda.shfl_xor_sync(FULL_MASK, v, off)")
    shuffle = "v += " + shuffled[len("v + "):] if shuffled.startswith("v + ") else "v = " + shuffled
    tree = combine.format(a="smem[base + tid]", b="smem[base + tid + off]")
    return _GROUP_HELPER.format(name=name, doc=doc, shuffle=shuffle, combine=tree).strip("\n")


GROUP_HELPERS = "\n\n\n".join(_group_helper(*spec) for spec in (
    ("sum", "Sum of ``v`` over the ``width`` lanes of a group (a power of two), in every lane.", "{a} + {b}"),
    ("max", "Maximum of ``v`` over the ``width`` lanes of a group, in every lane.", "max({a}, {b})"),
    ("min", "Minimum of ``v`` over the ``width`` lanes of a group, in every lane.", "min({a}, {b})"),
))


class Phases:
    """Mappings, contractions and reductions of :class:`.emit.Emitter` (see the module docstring)."""

    # ---- mappings as element loops
    def flat_elements(self, m: Flat, src: Source):
        gen = self

        class _C:
            def __enter__(self_):
                self_.env = {}
                self_.u = gen.names.fresh("u")
                self_.loop = src.block(f"for {self_.u} in range({gen.consts.u(m.per_thread)}):")
                self_.loop.__enter__()
                e = gen.names.fresh("e")
                src(f"{e} = tid + {self_.u} * NTHREADS" if m.per_thread > 1 else f"{e} = tid")
                self_.cond = src.maybe(f"{e} < {gen.consts.u(m.n)}" if m.n % gen.T or m.n < gen.T else None)
                self_.cond.__enter__()
                gen._decode(src, e, m.axes, self_.env)
                self_.env["_slot"] = self_.u
                return self_.env

            def __exit__(self_, *exc):
                self_.cond.__exit__(*exc)
                self_.loop.__exit__(*exc)
                return False

        return _C()

    def micro_rows(self, m: Micro, i: str) -> str:
        if isinstance(m, Frag):
            return frag_rows(self, m, i)
        k = self.consts
        if m.RY == 1:
            return "ty"
        if m.VY == m.RY:
            return f"ty * {k.u(m.RY)} + {i}"
        return f"ty * {k.u(m.VY)} + {i} // {k.u(m.VY)} * {k.u(m.TY * m.VY)} + {i} % {k.u(m.VY)}"

    def micro_cols(self, m: Micro, j: str) -> str:
        if isinstance(m, Frag):
            return frag_cols(self, m, j)
        k = self.consts
        if m.RX == 1:
            return "tx"
        if m.VX == m.RX:
            return f"tx * {k.u(m.RX)} + {j}"
        return f"tx * {k.u(m.VX)} + {j} // {k.u(m.VX)} * {k.u(m.TX * m.VX)} + {j} % {k.u(m.VX)}"

    def micro_begin(self, m: Micro, src: Source):
        if isinstance(m, Frag):
            return frag_begin(self, m, src)
        k = self.consts
        src(f"ty = tid // {k.u(m.TX)}")
        src(f"tx = tid % {k.u(m.TX)}")

    def micro_guard(self, m: Micro) -> str | None:
        return f"tid < {self.consts.u(m.active)}" if m.active < self.T else None

    @contextlib.contextmanager
    def micro_elements(self, m: Micro, src: Source):
        """Context: ``for i, j`` over a thread's micro-tile; yields the env (``_slot`` = ``i, j``)."""
        k = self.consts
        col = column_hoist(self, m, src)
        with src.block(f"for i in range({k.u(m.RY)}):"):
            r = self.names.fresh(self.ax[m.row].index)
            src(f"{r} = {self.micro_rows(m, 'i')}")
            row = RowHoist(src.slot(), {}, m.col)
            with src.block(f"for j in range({k.u(m.RX)}):"):
                c = self.names.fresh(self.ax[m.col].index)
                src(f"{c} = {self.micro_cols(m, 'j')}")
                yield {m.row: r, m.col: c, "_slot": "i, j", "_row": "i", "_hoist": row, "_colhoist": col}

    def micro_element_rows(self, m: Micro, src: Source):
        """:meth:`micro_elements` with the rows written out: yields the env of each row ``i``
        inside its ``for j`` loop (``_slot`` = ``i, j`` with ``i`` a literal, the row's index
        from uint32 constants), so a micro-tile indexed by the slot needs no unrolling of ``i``."""
        k = self.consts
        col = column_hoist(self, m, src)
        for i in range(m.RY):
            r = self.names.fresh(self.ax[m.row].index)
            src(f"{r} = {self.micro_rows(m, k.u(i))}")   # uint32 constants: no signed mix
            row = RowHoist(src.slot(), {}, m.col)
            with src.block(f"for j in range({k.u(m.RX)}):"):
                c = self.names.fresh(self.ax[m.col].index)
                src(f"{c} = {self.micro_cols(m, 'j')}")
                yield {m.row: r, m.col: c, "_slot": f"{i}, j", "_row": str(i), "_hoist": row, "_colhoist": col}

    def elements(self, m, src):
        return self.micro_elements(m, src) if isinstance(m, Micro) else self.flat_elements(m, src)

    def mapping_begin(self, m, src):
        if isinstance(m, Micro):
            self.micro_begin(m, src)
            return src.maybe(self.micro_guard(m))
        return src.maybe(None)

    # ---- contractions
    def contraction_operands(self, ins, acc: int | None = None) -> list[Operand]:
        """The factors ``ins`` of a contraction (of accumulator ``acc``'s update, if any)."""
        ops = []
        for v in ins:
            where = self.plan.storage(v)
            # 16-bit patterns (an input, or an intermediate of .sixteen_bit) are read as they are,
            # zero past ragged extents (zero-filled chunks; zeros written there)
            raw = where in ("load", "smem") and self.bufs[("var", v)].bits == 16
            # a row operand kept in the registers that computed it (.frag_operands)
            frag = self.reg_copy[v] if acc in self.plan.frag_operands.get(v, ()) else None
            ops.append(Operand(self.plan.axes_set(v),
                               (lambda v: lambda env, memo, src: self.value(v, env, src, memo))(v),
                               padded=where == "load" or raw or frag is not None,
                               buffer=("var", v) if raw and frag is None else None, frag=frag))
        return ops

    def contract(self, engine: str, m, acc: str, operands: list[Operand], red: list[str], src: Source,
                 init: bool = True, prescale: Operand | None = None, env: dict | None = None):
        """``acc[slot] (+)= sum over red of prod(operands)`` on mapping ``m``, rendered by the
        contraction engine the plan names (:data:`CONTRACTION_ENGINES`)."""
        try:
            emit = CONTRACTION_ENGINES[engine]
        except KeyError:
            raise LoweringError(f"internal: no emitter for contraction engine {engine!r}") from None
        self.columns_slot = None   # a slot before an earlier contraction's wait serves its epilogue alone
        emit(self, m, acc, operands, red, src, init, prescale, env)

    def contract_cuda_core(self, m, acc: str, operands: list[Operand], red: list[str], src: Source,
                           init: bool = True, prescale: Operand | None = None, env: dict | None = None):
        """The CUDA-core engine: register micro-tiles (``m`` a Micro) or one element per loop
        iteration (``m`` a Flat, the caller inside the element loop at ``env``)."""
        k = self.consts
        zero = k.f(0.0, "ZERO")
        if isinstance(m, Micro):
            self.start_micro_acc(m, acc, init, prescale, src)
            roww = [o for o in operands if m.row in o.axes and m.col not in o.axes]
            colw = [o for o in operands if m.col in o.axes and m.row not in o.axes]
            both = [o for o in operands if m.row in o.axes and m.col in o.axes]
            none = [o for o in operands if m.row not in o.axes and m.col not in o.axes]
            frag_a = [self.names.fresh("fa") for _ in roww]
            frag_b = [self.names.fresh("fb") for _ in colw]
            for f in frag_a:
                src(f"{f} = cuda.local.array({m.RY}, float32)")
            for f in frag_b:
                src(f"{f} = cuda.local.array({m.RX}, float32)")
            env = {}
            opened = []
            steps = [None]
            for pos, a in enumerate(red):
                ax = self.ax[a]
                # the valid extent (a ragged chunk's, or a ragged tile's of an axis summed across
                # blocks): values computed past it from the zero padding need not be zero
                bound = ax.count
                idx = self.names.fresh(ax.index)
                unroll = _unroll_factor(self.unroll, ax.cap) if pos == len(red) - 1 and not ax.ragged else 1
                if unroll > 1:
                    # the innermost reduction loop unrolled in the source: the next steps' shared
                    # loads are issued while this step's FMAs run
                    base = self.names.fresh(f"{ax.index}_base")
                    blk = src.block(f"for {base} in range({k.u(0, 'U0')}, {bound}, {k.u(unroll)}):")
                    steps = [(base, u) for u in range(unroll)]
                else:
                    blk = src.block(f"for {idx} in range({bound}):")
                env[a] = idx
                blk.__enter__()
                opened.append(blk)
            for step in steps:
                if step is not None:
                    base, u = step
                    idx = self.names.fresh(self.ax[red[-1]].index)
                    src(f"{idx} = {base} + {k.u(u)}" if u else f"{idx} = {base}")
                    env[red[-1]] = idx
                self._micro_step(m, acc, env, roww, colw, both, none, frag_a, frag_b, src)
            for blk in reversed(opened):
                blk.__exit__(None, None, None)
        else:
            slot = f"{acc}[{env['_slot']}]"
            if init:
                src(f"{slot} = {zero}")
            elif prescale is not None:
                src(f"{slot} *= {prescale.read(env, {}, src)}")
            opened = []
            e2 = dict(env)
            for a in red:
                ax = self.ax[a]
                bound = ax.count
                idx = self.names.fresh(ax.index)
                e2[a] = idx
                blk = src.block(f"for {idx} in range({bound}):")
                blk.__enter__()
                opened.append(blk)
            memo = {}
            factors = [o.read(e2, memo, src) for o in operands]
            src(f"{slot} += {' * '.join(factors) or k.f(1.0, 'ONE')}")
            for blk in reversed(opened):
                blk.__exit__(None, None, None)

    def start_micro_acc(self, m: Micro, acc: str, init: bool, prescale, src: Source):
        """Before a contraction into micro-tile ``m``: ``acc = 0`` (``init``), else
        ``acc *= prescale`` where one is given."""
        k = self.consts
        if init:
            with src.block(f"for i in range({k.u(m.RY)}):"):
                with src.block(f"for j in range({k.u(m.RX)}):"):
                    src(f"{acc}[i, j] = {k.f(0.0, 'ZERO')}")
        elif prescale is not None:
            self.prescale_micro(m, acc, prescale, src)

    def prescale_micro(self, m: Micro, acc: str, prescale: Operand, src: Source):
        """``acc[i, j] *= prescale`` at each element of micro-tile ``m``."""
        k = self.consts
        with src.block(f"for i in range({k.u(m.RY)}):"):
            env = {}
            if m.row in prescale.axes:
                env[m.row] = self.names.fresh(self.ax[m.row].index)
                src(f"{env[m.row]} = {self.micro_rows(m, 'i')}")
            sc = None
            if m.col not in prescale.axes:
                sc = self.names.fresh("scale")
                src(f"{sc} = {prescale.read(env, {}, src)}")
            with src.block(f"for j in range({k.u(m.RX)}):"):
                if sc is None:
                    env[m.col] = self.names.fresh(self.ax[m.col].index)
                    src(f"{env[m.col]} = {self.micro_cols(m, 'j')}")
                    sc = self.names.fresh("scale")
                    src(f"{sc} = {prescale.read(env, {}, src)}")
                src(f"{acc}[i, j] *= {sc}")

    def _micro_step(self, m: Micro, acc: str, env: dict, roww, colw, both, none, frag_a, frag_b,
                    src: Source):
        """One step of the reduction loops on a micro-tile: fragments, then the outer product."""
        k = self.consts
        scal = []
        for o in none:
            t = self.names.fresh("f")
            src(f"{t} = {o.read(dict(env), {}, src)}")
            scal.append(t)
        if roww:
            with src.block(f"for i in range({k.u(m.RY)}):"):
                e2 = dict(env)
                e2[m.row] = self.names.fresh(self.ax[m.row].index)
                src(f"{e2[m.row]} = {self.micro_rows(m, 'i')}")
                memo = {}
                for f, o in zip(frag_a, roww):
                    src(f"{f}[i] = {o.read(e2, memo, src)}")
        if colw:
            with src.block(f"for j in range({k.u(m.RX)}):"):
                e2 = dict(env)
                e2[m.col] = self.names.fresh(self.ax[m.col].index)
                src(f"{e2[m.col]} = {self.micro_cols(m, 'j')}")
                memo = {}
                for f, o in zip(frag_b, colw):
                    src(f"{f}[j] = {o.read(e2, memo, src)}")
        with src.block(f"for i in range({k.u(m.RY)}):"):
            e2 = dict(env)
            if both:
                e2[m.row] = self.names.fresh(self.ax[m.row].index)
                src(f"{e2[m.row]} = {self.micro_rows(m, 'i')}")
            with src.block(f"for j in range({k.u(m.RX)}):"):
                factors = [f"{f}[i]" for f in frag_a] + [f"{f}[j]" for f in frag_b] + scal
                if both:
                    e2[m.col] = self.names.fresh(self.ax[m.col].index)
                    src(f"{e2[m.col]} = {self.micro_cols(m, 'j')}")
                    memo = {}
                    factors += [o.read(e2, memo, src) for o in both]
                src(f"{acc}[i, j] += {' * '.join(factors) or k.f(1.0, 'ONE')}")


    def _emit_reduction_target(self, t: Target, src: Source):
        kk = self.st.eqn_of[t.source]
        e = self.dd.eqns[kk]
        box = e.box
        red = self.plan.reduced_axes(kk)
        m = t.mapping
        arr = self.types[t.var]
        src.comment(f"{arr} = {self.describe_chain(t.var)}  ({m.describe()})")
        if isinstance(m, Micro):
            acc = self.names.fresh("acc")
            self.micro_begin(m, src)
            copies = self.plan.reg_copies
            open_copy(self, t, src)   # read again from registers on these threads (.register_copies)
            with src.maybe(self.micro_guard(m)):
                src(f"{acc} = cuda.local.array(({m.RY}, {m.RX}), float32)")
                self.contract(t.engine, m, acc, self.contraction_operands(e.ins), list(red), src)
                regs = {t.source: f"{acc}[i, j]", **{v: f"{self.reg_copy[v]}[i, j]" for v, us in copies.items()
                                                     if t.var in us}}

                def elements():    # written twice where masks keep whole chunks (.unswitch)
                    with self.micro_elements(m, src) as env:
                        val = self.value(t.var, env, src, {}, regs, define=t.var)
                        self.write_target(t, env, val, src)
                        keep_copy(self, t, env, val, src)
                unswitched(self, t, src, elements, m)
        elif isinstance(m, Flat):
            acc = self.names.fresh("acc")
            src(f"{acc} = cuda.local.array({m.per_thread}, float32)")
            with self.flat_elements(m, src) as env:
                if CODEGEN_RULES[box.kind].contraction:
                    self.contract(t.engine, m, acc, self.contraction_operands(e.ins), list(red), src, env=env)
                    res = f"{acc}[{env['_slot']}]"
                else:
                    res = self._flat_reduce(box, e.ins[0], red[0], env, src)
                val = self.value(t.var, env, src, {}, {t.source: res}, define=t.var)
                self.write_target(t, env, val, src)
        else:
            self._coop_reduce_target(t, box, e.ins, red, src)

    def _flat_reduce(self, box, x: int, axis: str, env, src) -> str:
        k = self.consts
        op = box.param("op")
        ax = self.ax[axis]
        idx = self.names.fresh(ax.index)
        e2 = dict(env)
        e2[axis] = idx
        r = self.names.fresh("r")
        if op == "logsumexp":
            raise LoweringError("internal: logsumexp uses lanes")
        ident, comb, _ = REDUCE_OPS[op]
        src(f"{r} = {k.f(ident)}")
        with src.block(f"for {idx} in range({ax.count}):"):   # a split axis: its ragged tile's extent
            val = self.value(x, e2, src, {})
            src(f"{r} = {comb.format(a=r, b=val)}")
        if op == "mean":
            src(f"{r} = {r} / {k.f(float(ax.size), comment=f'size of {axis}')}")
        return r

    # ---- lanes (Coop): reductions with few outputs
    def coop_elements(self, m: Coop, src: Source):
        """Context over a thread's outputs in a Coop mapping: yields env with ``_lane``,
        ``_slot`` and ``_active``; every thread runs every iteration (barriers inside)."""
        gen = self

        class _C:
            def __enter__(self_):
                k = gen.consts
                u = gen.names.fresh("u")
                self_.loop = src.block(f"for {u} in range({k.u(m.per_thread)}):")
                self_.loop.__enter__()
                groups = m.threads // m.R
                o = gen.names.fresh("o")
                src(f"{o} = tid // {k.u(m.R)} + {u} * {k.u(groups)}" if m.per_thread > 1
                    else f"{o} = tid // {k.u(m.R)}")
                lane = gen.names.fresh("lane")
                src(f"{lane} = tid % {k.u(m.R)}")
                oc = o
                first = lane
                if m.per_thread * groups != m.n:
                    oc = gen.names.fresh("oc")
                    src(f"{oc} = min({o}, {k.u(m.n - 1)})  # idle groups index the last output ...")
                    first = gen.names.fresh("first")
                    src(f"{first} = {lane} if {o} < {k.u(m.n)} else {k.u(IDLE_START, 'IDLE_START')}"
                        f"  # ... but their loops are empty: they read nothing other groups write")
                env = {}
                gen._decode(src, oc, m.axes, env)
                env["_lane"] = lane
                env["_first"] = first
                env["_slot"] = u
                env["_active"] = f"{o} < {k.u(m.n)}" if m.per_thread * groups != m.n else None
                return env

            def __exit__(self_, *exc):
                self_.loop.__exit__(*exc)
                return False

        return _C()

    def lanes_reduce(self, m: Coop, env, axes: tuple[str, ...], op: str, term: Callable, src: Source,
                     bounds: dict | None = None) -> str:
        """All lanes of the group get ``op`` over ``axes`` of ``term(env2, memo)``."""
        k = self.consts
        ident, comb, helper = REDUCE_OPS[op]
        r = self.names.fresh("part")
        src(f"{r} = {k.f(ident)}")
        names = [a for a in axes if self.ax[a].cap > 1]
        bounds = bounds or {}
        lane = env["_lane"]
        first = env.get("_first", lane)   # the lane, or past every bound in an idle group
        if len(names) <= 1:
            e2 = dict(env)
            if names:
                a = names[0]
                bound = bounds.get(a, self.ax[a].count)
                idx = self.names.fresh(self.ax[a].index)
                e2[a] = idx
                loop = src.block(f"for {idx} in range({first}, {bound}, {k.u(m.R)}):")
            else:
                loop = src.maybe(f"{first} == {k.u(0, 'U0')}")
            with loop:
                val = term(e2, {})
                src(f"{r} = {comb.format(a=r, b=val)}")
        else:
            n = math.prod(self.ax[a].cap for a in names)
            rr = self.names.fresh("rr")
            with src.block(f"for {rr} in range({first}, {k.u(n)}, {k.u(m.R)}):"):
                e2 = dict(env)
                sub = {}
                self._decode(src, rr, tuple(names), sub)
                e2.update(sub)
                limit = {a: bounds.get(a, self.ax[a].count) for a in names if a in bounds or self.ax[a].ragged}
                cond = " and ".join(f"{sub[a]} < {limit[a]}" for a in limit) or None
                with src.maybe(cond):
                    val = term(e2, {})
                    src(f"{r} = {comb.format(a=r, b=val)}")
        if m.R > 1:
            src(f"{r} = {helper}({r}, {lane}, {k.u(m.R)}, smem, {self.red_offset()}, tid)")
        return r

    def _coop_reduce_target(self, t: Target, box, ins, red, src: Source):
        k = self.consts
        m = t.mapping
        with self.coop_elements(m, src) as env:
            if CODEGEN_RULES[box.kind].contraction:
                ops = self.contraction_operands(ins)
                term = lambda e2, memo: " * ".join(o.read(e2, memo, src) for o in ops)
                res = self.lanes_reduce(m, env, red, "sum", term, src)
            else:
                op = box.param("op")
                x = ins[0]
                term = lambda e2, memo: self.value(x, e2, src, memo)
                if op == "logsumexp":
                    mx = self.lanes_reduce(m, env, red, "max", term, src)
                    safe = self.names.fresh("safe")
                    src(f"{safe} = {mx} if {mx} > {k.f(-math.inf, 'NEG_INF')} else {k.f(0.0, 'ZERO')}")
                    one = k.f(1.0, "ONE")

                    def lse_term(e2, memo):   # exp(inf - inf) counts as 1, as in _lse_update
                        xv = term(e2, memo)
                        return f"({one} if {xv} == {safe} else math.exp({xv} - {safe}))"
                    sm = self.lanes_reduce(m, env, red, "sum", lse_term, src)
                    res = self.names.fresh("lse")
                    src(f"{res} = {safe} + math.log({sm}) if {sm} != {k.f(0.0, 'ZERO')} else "
                        f"{k.f(-math.inf, 'NEG_INF')}")
                else:
                    res = self.lanes_reduce(m, env, red, op, term, src)
                    if op == "mean":
                        n = math.prod(self.ax[a].size for a in red)
                        src(f"{res} = {res} / {k.f(float(n), comment='reduced size')}")
            cond = f"{env['_lane']} == {k.u(0, 'U0')}"
            if env["_active"]:
                cond += f" and {env['_active']}"
            with src.block(f"if {cond}:"):
                val = self.value(t.var, env, src, {}, {t.source: res}, define=t.var)
                self.write_target(t, env, val, src)

    # ---- normalisers (softmax, normalize over a whole axis in the block)
    def _emit_norm_stats(self, k: int, src: Source):
        kc = self.consts
        self.sync(src)
        e = self.dd.eqns[k]
        box = e.box
        axis = box.param("axis")
        a1, a2, b, eps = CODEGEN_RULES[box.kind].norm(box)
        m = self.norm_stats[k]
        x = e.ins[0]
        mb, zb = self.bufs[("norm_m", k)], self.bufs[("norm_z", k)]
        src.comment(f"row statistics of {box.name} over {axis}  ({m.describe()})")
        term = lambda e2, memo: self.value(x, e2, src, memo)
        zero = kc.f(0.0, "ZERO")
        with self.coop_elements(m, src) as env:
            if (a1, a2, b) == NORMALISATIONS["softmax"]:
                mx = self.lanes_reduce(m, env, (axis,), "max", term, src)
                safe = self.names.fresh("safe")
                src(f"{safe} = {mx} if {mx} > {kc.f(-math.inf, 'NEG_INF')} else {zero}")
                z = self.lanes_reduce(m, env, (axis,), "sum",
                                      lambda e2, memo: f"math.exp({term(e2, memo)} - {safe})", src)
                stat = safe
            else:
                z0 = self.lanes_reduce(m, env, (axis,), "sum",
                                       lambda e2, memo: fn_expr(self.consts, a2, [f"({term(e2, memo)})"]), src)
                z = self.names.fresh("z")
                src(f"{z} = {fn_expr(self.consts, b, [z0])} + {kc.f(eps, comment='eps of ' + box.name)}")
                stat = zero
            cond = f"{env['_lane']} == {kc.u(0, 'U0')}"
            if env["_active"]:
                cond += f" and {env['_active']}"
            with src.block(f"if {cond}:"):
                src(f"{self.sread(mb.key, env)} = {stat}")
                src(f"{self.sread(zb.key, env)} = {z}")
        self.pending_sync = True

    def _normalised_value(self, k: int, env, src, memo, regs, define=None) -> str:
        kc = self.consts
        e = self.dd.eqns[k]
        box = e.box
        a1, a2, b, eps = CODEGEN_RULES[box.kind].norm(box)
        xv = self.value(e.ins[0], env, src, memo, regs, define)
        mv = self.sread(("norm_m", k), env)
        zv = self.sread(("norm_z", k), env)
        zero = kc.f(0.0, "ZERO")
        (v,) = self.dd.eqn_outputs(k)
        tmp = self.names.fresh(f"{self.types[v].name}_{v}")
        if (a1, a2, b) == NORMALISATIONS["softmax"]:
            zt = self.names.fresh("z")
            src(f"{zt} = {zv}")
            src(f"{tmp} = math.exp({xv} - {mv}) / {zt} if {zt} != {zero} else {zero}")  # NaN row stays NaN
        else:
            zt = self.names.fresh("z")
            src(f"{zt} = {zv}")
            src(f"{tmp} = {fn_expr(self.consts, a1, [xv])} / {zt} if {zt} != {zero} else {zero}")
        return tmp


CONTRACTION_ENGINES: dict[str, Callable] = {
    "cuda_core": Phases.contract_cuda_core,
    "mma": contract_mma,
}
"""Contraction emitters keyed by the engine a plan names (:data:`.plan.ENGINES`)."""
