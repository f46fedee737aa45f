"""Accumulator emitters: :data:`ACC_CODEGEN`, keyed like
:data:`napkin_cat.relabel.accumulators.ACC_RULES`.

Each entry renders one accumulator kind's ``init`` / ``update`` / ``publish`` (before the final
value is read) / ``final_value`` (the expression at a main-state element) from its
:class:`~.plan.AccPlan`; ``em`` is the renderer (:class:`.emit.Emitter`).  A contraction into the
main state goes through the engine the plan names (``em.contract``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..relabel.accumulators import ACC_RULES
from .emit_kinds import REDUCE_OPS, fn_expr, positive_scale
from .emit_threads import Operand
from .emit_states import defers_row_sum, state_names_of, state_ref, sum_deferred_z
from .plan import AccPlan, Coop, Micro, Rows, acc_reduced_axes
from .source import Source
from .unswitch import unswitched


@dataclass(frozen=True)
class AccCodegen:
    """Code for one accumulator kind: ``init`` / ``update`` / ``publish`` (before the final
    value is read) / ``final_value`` (expression at a main-state element).  ``contraction``:
    the update is a contraction into the main state (register micro-tiles); ``stats``: it keeps
    row statistics over the score axes; ``rescales``: earlier contributions are rescaled."""

    init: Callable
    update: Callable
    publish: Callable
    final_value: Callable
    contraction: bool = False
    stats: bool = False
    rescales: bool = False


def _shape(shape) -> str:
    """A local array's shape: plain int literals (numba needs compile-time constants)."""
    return str(shape[0]) if len(shape) == 1 else f"({', '.join(map(str, shape))})"


def _init_states(em, p: AccPlan, src: Source, values: dict):
    k = em.consts
    names = state_names_of(em, p)
    src.comment(f"init {p.acc.box.cod[0].name} ({p.acc.rule}): "
                + ", ".join(f"{s} @{'registers' if (p.main_regs if r == 'main' else p.stat_regs) else 'shared'}"
                            for s, _, r in p.acc.states()))
    for sname, axes, role in p.acc.states():
        m = p.main if role == "main" else (p.stat or p.main)
        regs = p.main_regs if role == "main" else p.stat_regs
        if regs:
            src(f"{names[sname]} = cuda.local.array({_shape(m.shape)}, float32)")
        init = k.f(values[sname])
        if isinstance(m, Rows):
            with src.block(f"for i in range({k.u(m.micro.RY)}):"):
                src(f"{names[sname]}[i] = {init}")
        elif isinstance(m, Micro):
            with em.mapping_begin(m, src):
                with em.micro_elements(m, src) as env:
                    src(f"{state_ref(em, p, sname, env)} = {init}")
        elif isinstance(m, Coop):
            with em.coop_elements(m, src) as env:
                src(f"{state_ref(em, p, sname, env)} = {init}")
        else:
            with em.flat_elements(m, src) as env:
                src(f"{state_ref(em, p, sname, env)} = {init}")


def _main_contraction(em, p: AccPlan, operands, red, src: Source, prescale=None):
    """``o (*= prescale) += contraction`` on the main mapping, state in registers or shared."""
    m = p.main
    acc = state_names_of(em, p)["o"]
    with em.mapping_begin(m, src):
        if not p.main_regs:   # a shared state is read into registers, updated, written back
            tmp = em.names.fresh("o_regs")
            src(f"{tmp} = cuda.local.array({_shape(m.shape)}, float32)")
            with em.elements(m, src) as env:
                src(f"{tmp}[{env['_slot']}] = {state_ref(em, p, 'o', env)}")
            acc = tmp
        if isinstance(m, Micro):
            em.contract(p.engine, m, acc, operands, red, src, init=False, prescale=prescale)
        else:
            with em.flat_elements(m, src) as env:
                em.contract(p.engine, m, acc, operands, red, src, init=False, prescale=prescale, env=env)
        if not p.main_regs:
            with em.elements(m, src) as env:
                src(f"{state_ref(em, p, 'o', env)} = {acc}[{env['_slot']}]")


def _red_of(em, p: AccPlan) -> list[str]:
    return list(acc_reduced_axes(p.acc))


# sum_contract ---------------------------------------------------------------

def _sc_init(em, p, src):
    _init_states(em, p, src, {"o": 0.0})


def _sc_update(em, p, src):
    em.sync(src)
    ins = em.dd.eqns[p.acc.eqn].ins
    src.comment(f"update {p.acc.box.cod[0].name} (sum_contract) with "
                f"{', '.join(em.types[v].name for v in ins)}  ({p.main.describe()})")
    _main_contraction(em, p, em.contraction_operands(ins, p.index), _red_of(em, p), src)


def _no_publish(em, p, src):
    return None


def _sc_final(em, p, env, src):
    return state_ref(em, p, "o", env)


# reduce (sum, mean, max, min over a streamed axis) ----------------------------

def _reduce_init(em, p, src):
    ident = REDUCE_OPS[p.acc.box.param("op")][0]
    _init_states(em, p, src, {"o": ident})


def _reduce_update(em, p, src):
    em.sync(src)
    box = p.acc.box
    op = box.param("op")
    _, comb, _ = REDUCE_OPS[op]
    (x,) = em.dd.eqns[p.acc.eqn].ins
    ax = em.ax[p.acc.axis]
    src.comment(f"update {box.cod[0].name} ({op} over chunks of {ax.name})")
    with em.flat_elements(p.main, src) as env:
        ref = state_ref(em, p, "o", env)
        idx = em.names.fresh(ax.index)
        e2 = dict(env)
        e2[ax.name] = idx
        r = em.names.fresh("r")
        src(f"{r} = {ref}")
        with src.block(f"for {idx} in range({ax.count}):"):
            if op in ("max", "min"):   # NaN propagates (docs/NAN_POLICY.md): Python's max drops it
                xv = em.names.fresh("xv")
                src(f"{xv} = {em.value(x, e2, src, {})}")
                src(f"{r} = {xv} if {xv} {'>' if op == 'max' else '<'} {r} or {xv} != {xv} else {r}")
            else:
                src(f"{r} = {comb.format(a=r, b=em.value(x, e2, src, {}))}")
        src(f"{ref} = {r}")


def _reduce_final(em, p, env, src):
    ref = state_ref(em, p, "o", env)
    if p.acc.box.param("op") == "mean":
        n = em.sizes[p.acc.axis]
        return f"{ref} / {em.consts.f(float(n), comment=f'size of {p.acc.axis}')}"
    return ref


# logsumexp -------------------------------------------------------------------

def _lse_init(em, p, src):
    if p.stats_of is not None:
        src.comment(f"init {p.acc.box.cod[0].name} (logsumexp): none, it is "
                    f"{em.accs[p.stats_of].acc.box.cod[0].name}'s row statistics (L = mu + log z)")
        return
    _init_states(em, p, src, {"m": -math.inf, "z": 0.0})


def _lse_update(em, p, src):
    if p.stats_of is not None:
        return    # the online softmax that reads the same scores keeps the statistics
    em.sync(src)
    k = em.consts
    (x,) = em.dd.eqns[p.acc.eqn].ins
    ax = em.ax[p.acc.axis]
    src.comment(f"update {p.acc.box.cod[0].name} (logsumexp over chunks of {ax.name})")
    with em.flat_elements(p.main, src) as env:
        m_ref, z_ref = state_ref(em, p, "m", env), state_ref(em, p, "z", env)
        idx = em.names.fresh(ax.index)
        e2 = dict(env)
        e2[ax.name] = idx
        mx = em.names.fresh("mx")
        src(f"{mx} = {m_ref}")
        with src.block(f"for {idx} in range({ax.count}):"):
            src(f"{mx} = max({mx}, {em.value(x, e2, src, {})})")
        # docs/NAN_POLICY.md: a max of +inf stays the shift, and exp(inf - inf) counts as 1 (the
        # +inf element itself), so the result is +inf (NaN with a NaN) and no exp overflows
        safe = em.names.fresh("safe")
        src(f"{safe} = {mx} if {mx} > {k.f(-math.inf, 'NEG_INF')} else {k.f(0.0, 'ZERO')}")
        zs = em.names.fresh("zs")
        one = k.f(1.0, "ONE")
        src(f"{zs} = {z_ref} * ({one} if {m_ref} == {safe} else math.exp({m_ref} - {safe}))")
        with src.block(f"for {idx} in range({ax.count}):"):
            xv = em.names.fresh("xv")
            src(f"{xv} = {em.value(x, e2, src, {})}")
            src(f"{zs} += {one} if {xv} == {safe} else math.exp({xv} - {safe})")
        src(f"{z_ref} = {zs}")
        src(f"{m_ref} = {mx}")


def _lse_publish(em, p, src):
    """A logsumexp taken from an online softmax's row statistics (``p.stats_of``): lane 0 of
    each row writes the row's ``mu`` and ``z`` (held by every lane of the row) to shared memory,
    where the logsumexp's own mapping reads them."""
    if p.stats_of is None:
        return
    o = em.accs[p.stats_of]
    ms, k = o.fused.ms, em.consts
    sum_deferred_z(em, o, src)
    em.sync(src)
    src.comment(f"finalise {p.acc.box.cod[0].name} = mu + log z of {o.acc.box.cod[0].name}: lane 0 of "
                f"each row publishes the row statistics")
    em.micro_begin(ms, src)
    guard = em.micro_guard(ms)
    with src.block(f"if tx == {k.u(0, 'U0')}" + (f" and {guard}:" if guard else ":")):
        with src.block(f"for i in range({k.u(ms.RY)}):"):
            env = {ms.row: em.names.fresh(em.ax[ms.row].index), "_row": "i"}
            src(f"{env[ms.row]} = {em.micro_rows(ms, 'i')}")
            src(f"{em.sread(('mupub', o.index), env)} = {state_ref(em, o, 'mu', env)}")
            src(f"{em.sread(('zpub', o.index), env)} = {state_ref(em, o, 'z', env)}")
    em.pending_sync = True


def _lse_final(em, p, env, src):
    k = em.consts
    if p.stats_of is not None:
        m_ref, z_ref = em.sread(("mupub", p.stats_of), env), em.sread(("zpub", p.stats_of), env)
    else:
        m_ref, z_ref = state_ref(em, p, "m", env), state_ref(em, p, "z", env)
    mt, zt = em.names.fresh("m"), em.names.fresh("z")
    src(f"{mt} = {m_ref}")
    src(f"{zt} = {z_ref}")
    # z == 0: every x was -inf (logsumexp -inf); z NaN (a NaN x) gives NaN, never -inf
    return (f"(({mt} if {mt} > {k.f(-math.inf, 'NEG_INF')} else {k.f(0.0, 'ZERO')}) + math.log({zt})"
            f" if {zt} != {k.f(0.0, 'ZERO')} else {k.f(-math.inf, 'NEG_INF')})")


# online softmax-contraction and the normalisation family ------------------------

def _osc_init(em, p, src):
    _init_states(em, p, src, {"mu": -math.inf, "z": 0.0, "o": 0.0})


def _norm_init(em, p, src):
    _init_states(em, p, src, {"z": 0.0, "o": 0.0})


def _stats_phase(em, p: AccPlan, src: Source, softmax: bool):
    """Row statistics of one chunk: ``mu' = max(mu, max_j s)``, ``delta = exp(mu - mu')``,
    ``p_j = exp(s_j - mu')``, ``z' = delta z + sum_j p_j`` (softmax) or ``p_j = a1(s_j)``,
    ``z' = z + sum_j a2(s_j)`` (normalisation family); ``p`` goes to shared memory."""
    k = em.consts
    zero = k.f(0.0, "ZERO")
    box = p.acc.box
    s, _ = em.dd.eqns[p.acc.eqn].ins
    m = p.stat
    ax = em.ax[p.acc.axis]
    pb = em.bufs[p.p_buf]
    src.comment(f"update {box.cod[0].name} ({p.acc.rule}): row statistics of the chunk  ({m.describe()})")
    with em.coop_elements(m, src) as env:
        term = lambda e2, memo: em.value(s, e2, src, memo)
        lane = env["_lane"]
        idx = em.names.fresh(ax.index)
        e2 = dict(env)
        e2[ax.name] = idx
        active = env["_active"]
        if softmax:
            mx = em.lanes_reduce(m, env, (ax.name,), "max", term, src)
            mu_ref, z_ref = state_ref(em, p, "mu", env), state_ref(em, p, "z", env)
            mu_old, mu_new = em.names.fresh("mu_old"), em.names.fresh("mu_new")
            src(f"{mu_old} = {mu_ref}")
            src(f"{mu_new} = max({mu_old}, {mx})")
            safe = em.names.fresh("safe")
            src(f"{safe} = {mu_new} if {mu_new} > {k.f(-math.inf, 'NEG_INF')} else {zero}"
                "  # no finite score yet: shift by 0, weights stay 0")
            delta = em.names.fresh("delta")
            src(f"{delta} = math.exp({mu_old} - {safe})")
            ps = em.names.fresh("psum")
            src(f"{ps} = {zero}")
            with src.block(f"for {idx} in range({env['_first']}, {ax.count}, {k.u(m.R)}):"):
                w = em.names.fresh("w")
                src(f"{w} = math.exp({term(e2, {})} - {safe})")
                with src.maybe(active):   # idle groups (clamped onto the last row) only read
                    src(f"{em.sread(pb.key, e2)} = {w}")
                src(f"{ps} += {w}")
            if m.R > 1:
                src(f"{ps} = _group_sum({ps}, {lane}, {k.u(m.R)}, smem, {em.red_offset()}, tid)")
            cond = active if p.stat_regs else (f"{lane} == {k.u(0, 'U0')}" + (f" and {active}" if active else ""))
            with src.maybe(cond):
                src(f"{z_ref} = {delta} * {z_ref} + {ps}")
                src(f"{mu_ref} = {mu_new}")
            cond = f"{lane} == {k.u(0, 'U0')}" + (f" and {active}" if active else "")
            with src.block(f"if {cond}:"):
                src(f"{em.sread(('delta', p.index), env)} = {delta}")
        else:
            a1, a2 = box.param("a1"), box.param("a2")
            z_ref = state_ref(em, p, "z", env)
            ps = em.names.fresh("zsum")
            src(f"{ps} = {zero}")
            with src.block(f"for {idx} in range({env['_first']}, {ax.count}, {k.u(m.R)}):"):
                sv = em.names.fresh("sv")
                src(f"{sv} = {term(e2, {})}")
                with src.maybe(active):   # idle groups (clamped onto the last row) only read
                    src(f"{em.sread(pb.key, e2)} = {fn_expr(em.consts, a1, [sv])}")
                src(f"{ps} += {fn_expr(em.consts, a2, [sv])}")
            if m.R > 1:
                src(f"{ps} = _group_sum({ps}, {lane}, {k.u(m.R)}, smem, {em.red_offset()}, tid)")
            cond = active if p.stat_regs else (f"{lane} == {k.u(0, 'U0')}" + (f" and {active}" if active else ""))
            with src.maybe(cond):
                src(f"{z_ref} = {z_ref} + {ps}")
    em.pending_sync = True


def _warp_sync(em, src: Source):
    """Order a warp's shared-memory writes before its own reads (the simulator has no
    ``syncwarp``; there every thread reaches this point, so a block barrier serves)."""
    with src.block("if SIMULATOR:"):
        src("cuda.syncthreads()")
    with src.block("else:"):
        src("cuda.syncwarp(FULL_MASK)")


# Gathers per element (auxiliary tensors read by index functions) from which a fragment's
# epilogue is written out row by row.  Measured with ``ptxas -v`` (kernels/ptx_resources.py) on
# the f16 FlashAttention kernel at q 128 x chunks of 64: with two gathers per element (a document
# mask) the compiler unrolls the loops over the fragment and keeps it in registers; with four (the
# same mask reading its block table) it does not, and the 4 x 16 fragment goes to local memory
# (256 bytes per thread, 0.425 ms against FlexAttention's 0.150 on an H100).  Written out row by
# row it stays in registers (255, no spills); rows and columns both written out compile 5x slower.
UNROLL_GATHERS = 3


def _gathers(em, v: int) -> int:
    """Gathers per element in the index functions of the chain computing ``v`` in registers."""
    if v < em.n_in or v in em.st.acc_of_var:
        return 0
    e = em.dd.eqns[em.st.eqn_of[v]]
    # the box's index functions: parameters with an index expression (a mask's predicate,
    # an index bias, a score modification)
    exprs = [x.expr for _, x in e.box.params if getattr(x, "expr", None) is not None]
    own = sum(n.op == "gather" for x in exprs for n in x.walk())
    return own + sum(_gathers(em, a) for a in e.ins if em.plan.storage(a) in ("inline", "regs"))


def _fused_update(em, p: AccPlan, src: Source, softmax: bool):
    """One chunk of a normalising accumulator with its scores in registers (:class:`FusedScores`):
    scores on micro-tile ``ms`` with the fused epilogue, row statistics by lane reductions,
    ``o *= delta`` in registers, weights to the warp-private staging area, ``syncwarp``, then
    ``o += weights . v`` on the main micro-tile (same rows per thread)."""
    k = em.consts
    zero, neg = k.f(0.0, "ZERO"), k.f(-math.inf, "NEG_INF")
    f = p.fused
    ms, mo = f.ms, p.main
    t = em.targets[f.target]
    kk = em.st.eqn_of[f.source]
    e = em.dd.eqns[kk]
    ax = em.ax[p.acc.axis]
    names = state_names_of(em, p)
    box = p.acc.box
    oname = box.cod[0].name
    em.sync(src)
    src.comment(f"update {oname} ({p.acc.rule}) with {em.types[f.target].name} in registers: "
                f"{em.types[f.target]} = {em.describe_chain(f.target)}  ({ms.describe()})")
    em.micro_begin(ms, src)
    sreg = em.names.fresh(f"{em.types[f.target].name}_regs")
    src(f"{sreg} = cuda.local.array(({ms.RY}, {ms.RX}), float32)")
    em.contract(t.engine, ms, sreg, em.contraction_operands(e.ins), list(em.plan.reduced_axes(kk)), src)
    prescale = positive_scale(em, t.var) if softmax else None

    def epilogue(env):
        slot = env["_slot"]
        val = em.value(t.var if prescale is None else prescale[1], env, src, {},
                       {t.source: f"{sreg}[{slot}]"}, define=t.var)
        cond = em.valid([ax.name], env)
        if cond and softmax:
            val = f"{val} if {cond} else {neg}"   # past the ragged end of the chunk: weight 0
        src(f"{sreg}[{slot}] = {val}")

    gathers = _gathers(em, f.target)
    if prescale is not None and prescale[1] == t.source and not (ax.ragged and ax.cap > 1):
        src.comment(f"{em.types[f.target].name} = {prescale[0]:g} * the product: the scale is "
                    f"folded into the softmax's exponent below")
    elif t.engine == "mma" and gathers >= UNROLL_GATHERS:
        # row by row: a fragment indexed by loop variables that the compiler does not unroll
        # leaves registers for local memory (see UNROLL_GATHERS)
        src.comment(f"{em.types[f.target].name}'s index functions read {gathers} "
                    f"gathers per element: written out row by row ({ms.RY} rows), the fragment "
                    f"stays in registers")

        def rows():
            for env in em.micro_element_rows(ms, src):
                epilogue(env)
        unswitched(em, t, src, rows, ms)
    else:
        def elements():
            with em.micro_elements(ms, src) as env:
                epilogue(env)
        unswitched(em, t, src, elements, ms)
    src.comment(f"row statistics: {ms.TX} lanes per row "
                f"({'warp shuffles' if ms.TX > 1 else 'one lane'}; shared memory in the simulator); "
                + (f"weights -> warp-private {em.bufs[p.p_buf].name}" if p.p_buf is not None
                   else "weights stay in registers"))
    lanes = k.u(ms.TX)
    with src.block(f"for i in range({k.u(ms.RY)}):"):
        env = {ms.row: em.names.fresh(em.ax[ms.row].index), "_row": "i"}
        src(f"{env[ms.row]} = {em.micro_rows(ms, 'i')}")
        if softmax:
            mx = em.names.fresh("mx")
            src(f"{mx} = {neg}")
            with src.block(f"for j in range({k.u(ms.RX)}):"):
                src(f"{mx} = max({mx}, {sreg}[i, j])")
            if ms.TX > 1:
                src(f"{mx} = _group_max({mx}, tx, {lanes}, smem, {em.red_offset()}, tid)")
            log2e = k.f(1.0 / math.log(2.0), "LOG2E")
            if prescale is not None:
                c = k.f(prescale[0], "C_PRESCALE", comment="the scores' scale, folded into the exponent")
                src(f"{mx} = {mx} * {c}  # the registers hold unscaled scores (c > 0: max commutes)")
                w_mult = k.f(prescale[0] / math.log(2.0), "C_PRESCALE_LOG2E", comment="scale * log2(e)")
            else:
                w_mult = log2e
            mu_ref, z_ref = state_ref(em, p, "mu", env), state_ref(em, p, "z", env)
            mu_old, mu_new, safe = em.names.fresh("mu_old"), em.names.fresh("mu_new"), em.names.fresh("safe")
            src(f"{mu_old} = {mu_ref}")
            src(f"{mu_new} = max({mu_old}, {mx})")
            src(f"{safe} = {mu_new} if {mu_new} > {neg} else {zero}"
                "  # no finite score yet: shift by 0, weights stay 0")
            delta = em.names.fresh("delta")
            src(f"{delta} = math.exp({mu_old} - {safe})")
            ps, shift = em.names.fresh("psum"), em.names.fresh("shift2")
            src(f"{ps} = {zero}")
            src(f"{shift} = {safe} * {log2e}  # weights exp(s - safe) = exp2(s log2 e - safe log2 e)")
            with src.block(f"for j in range({k.u(ms.RX)}):"):
                w = em.names.fresh("w")
                src(f"{w} = math.exp2({sreg}[i, j] * {w_mult} - {shift})")
                src(f"{sreg}[i, j] = {w}")
                src(f"{ps} += {w}")
            if ms.TX > 1 and not defers_row_sum(em, p):
                src(f"{ps} = _group_sum({ps}, tx, {lanes}, smem, {em.red_offset()}, tid)")
            src(f"{z_ref} = {delta} * {z_ref} + {ps}")
            src(f"{mu_ref} = {mu_new}")
            o = names["o"]
            with src.block(f"for j in range({k.u(mo.RX)}):"):
                src(f"{o}[i, j] *= {delta}")
        else:
            a1, a2 = box.param("a1"), box.param("a2")
            z_ref = state_ref(em, p, "z", env)
            ps = em.names.fresh("zsum")
            src(f"{ps} = {zero}")
            with src.block(f"for j in range({k.u(ms.RX)}):"):
                e2 = dict(env)
                cond = None
                if ax.ragged:
                    e2[ax.name] = em.names.fresh(ax.index)
                    src(f"{e2[ax.name]} = {em.micro_cols(ms, 'j')}")
                    cond = em.valid([ax.name], e2)
                sv = em.names.fresh("sv")
                src(f"{sv} = {sreg}[i, j]")
                if cond:
                    src(f"{sreg}[i, j] = {fn_expr(em.consts, a1, [sv])} if {cond} else {zero}")
                    src(f"{ps} += {fn_expr(em.consts, a2, [sv])} if {cond} else {zero}")
                else:
                    src(f"{sreg}[i, j] = {fn_expr(em.consts, a1, [sv])}")
                    src(f"{ps} += {fn_expr(em.consts, a2, [sv])}")
            if ms.TX > 1 and not defers_row_sum(em, p):
                src(f"{ps} = _group_sum({ps}, tx, {lanes}, smem, {em.red_offset()}, tid)")
            src(f"{z_ref} = {z_ref} + {ps}")
    if p.p_buf is None:
        # tensor cores: the weights stay in registers, the C fragments of the scores being the
        # A fragments of the weighted sum (emit_mma)
        src.comment(f"update {oname}: o += weights . {em.types[em.dd.eqns[p.acc.eqn].ins[1]].name}  "
                    f"({mo.describe()}; the weights stay in registers: {sreg})")
        weights = Operand(frozenset((ms.row, ax.name)), None, padded=True, frag=sreg)
        em.contract(p.engine, mo, names["o"], [weights] + em.contraction_operands([em.dd.eqns[p.acc.eqn].ins[1]]),
                    _red_of(em, p), src, init=False)
        return
    with src.block(f"for j in range({k.u(ms.RX)}):"):   # rows innermost: vector stores
        env = {ax.name: em.names.fresh(ax.index)}
        src(f"{env[ax.name]} = {em.micro_cols(ms, 'j')}")
        with src.block(f"for i in range({k.u(ms.RY)}):"):
            env[ms.row] = em.names.fresh(em.ax[ms.row].index)
            src(f"{env[ms.row]} = {em.micro_rows(ms, 'i')}")
            src(f"{em.sread(p.p_buf, env)} = {sreg}[i, j]")
    _warp_sync(em, src)
    src.comment(f"update {oname}: o += weights . {em.types[em.dd.eqns[p.acc.eqn].ins[1]].name}  "
                f"({mo.describe()}; the rows of o are the rows of the weights this warp staged)")
    em.contract(p.engine, mo, names["o"], _weights_operands(em, p), _red_of(em, p), src, init=False)


def _weights_operands(em, p: AccPlan):
    _, v = em.dd.eqns[p.acc.eqn].ins
    p_axes = frozenset(a for a in (*p.stat_axes, p.acc.axis) if em.ax[a].cap > 1)
    weights = Operand(p_axes, lambda env, memo, src: em.sread(p.p_buf, env))
    return [weights] + em.contraction_operands([v])


def _osc_update(em, p, src):
    if p.fused is not None:
        return _fused_update(em, p, src, softmax=True)
    em.sync(src)
    _stats_phase(em, p, src, softmax=True)
    em.sync(src)
    src.comment(f"update {p.acc.box.cod[0].name}: o = delta * o + weights . "
                f"{em.types[em.dd.eqns[p.acc.eqn].ins[1]].name}  ({p.main.describe()})")
    st_axes = frozenset(a for a in p.stat_axes if em.ax[a].cap > 1)
    delta = Operand(st_axes, lambda env, memo, src: em.sread(("delta", p.index), env))
    _main_contraction(em, p, _weights_operands(em, p), _red_of(em, p), src, prescale=delta)


def _norm_update(em, p, src):
    if p.fused is not None:
        return _fused_update(em, p, src, softmax=False)
    em.sync(src)
    _stats_phase(em, p, src, softmax=False)
    em.sync(src)
    src.comment(f"update {p.acc.box.cod[0].name}: o += weights . "
                f"{em.types[em.dd.eqns[p.acc.eqn].ins[1]].name}  ({p.main.describe()})")
    _main_contraction(em, p, _weights_operands(em, p), _red_of(em, p), src)


def _publish_z(em, p, src):
    """Statistics held in the lanes' registers are written where the main mapping reads them."""
    if p.fused is not None:
        return sum_deferred_z(em, p, src)   # then every lane of a row holds its statistics
    if not p.stat_regs:
        em.pending_sync = True
        return
    k = em.consts
    em.sync(src)
    src.comment(f"finalise {p.acc.box.cod[0].name}: publish the row normalisers")
    with em.coop_elements(p.stat, src) as env:
        cond = f"{env['_lane']} == {k.u(0, 'U0')}" + (f" and {env['_active']}" if env["_active"] else "")
        with src.block(f"if {cond}:"):
            src(f"{em.sread(('zpub', p.index), env)} = {state_ref(em, p, 'z', env)}")
    em.pending_sync = True


def _z_at(em, p, env) -> str:
    if p.fused is not None:
        return state_ref(em, p, "z", env)
    if p.stat_regs:
        return em.sread(("zpub", p.index), env)
    return em.sread(("state", p.index, "z"), env)


def _osc_final(em, p, env, src):
    k = em.consts
    zero = k.f(0.0, "ZERO")
    z = em.names.fresh("z")
    src(f"{z} = {_z_at(em, p, env)}")
    o = state_ref(em, p, "o", env)
    return f"({o} / {z} if {z} != {zero} else {zero})"


def _norm_final(em, p, env, src):
    k = em.consts
    zero = k.f(0.0, "ZERO")
    box = p.acc.box
    z = em.names.fresh("z")
    eps = k.f(box.param("eps"), comment=f"eps of {box.name}")
    src(f"{z} = {fn_expr(em.consts, box.param('b'), [_z_at(em, p, env)])} + {eps}")
    o = state_ref(em, p, "o", env)
    return f"({o} / {z} if {z} != {zero} else {zero})"


ACC_CODEGEN: dict[str, AccCodegen] = {
    "sum_contract": AccCodegen(_sc_init, _sc_update, _no_publish, _sc_final, contraction=True),
    "reduce": AccCodegen(_reduce_init, _reduce_update, _no_publish, _reduce_final),
    "logsumexp": AccCodegen(_lse_init, _lse_update, _lse_publish, _lse_final),
    "online_softmax": AccCodegen(_osc_init, _osc_update, _publish_z, _osc_final,
                                 contraction=True, stats=True, rescales=True),
    "normalized": AccCodegen(_norm_init, _norm_update, _publish_z, _norm_final,
                             contraction=True, stats=True),
}

assert set(ACC_CODEGEN) == set(ACC_RULES)
