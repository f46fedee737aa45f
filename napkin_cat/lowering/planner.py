"""Planning one kernel: a final form in, a frozen :class:`~.plan.KernelPlan` out.

:func:`plan_kernel` is a short list of named passes; each reads the results of the earlier ones
(passed explicitly) and returns its own:

    1. :func:`plan_axes`        role of every axis: grid, batch (grid of size 1), stream or full;
    2. :func:`read_structure`   where each variable is defined and read in the loop nest;
    3. :func:`classify`         each equation through its kind's rule (:data:`.emit_kinds.CODEGEN_RULES`):
       elementwise (inlined where it is read), reduction, normaliser, or an accumulator;
    4. :func:`plan_targets`     what is materialised: a reduction's value is computed in
       registers and the chain of elementwise boxes after it is fused into its epilogue; the
       end of the chain is written once, to shared memory or straight to the output;
    5. :func:`plan_accumulators` / :func:`plan_mappings`  threads per phase (:class:`Threads`):
       register micro-tiles for contractions with two output axes, groups of lanes per output
       for reductions with few outputs, else a flat element loop;
    6. :func:`fuse_scores`      scores kept in registers (:class:`~.plan.FusedScores`);
       :func:`~.frag_operands.frag_operands`  a tensor-core update's row operand read from the
       registers of the phase that computed it;
       :func:`~.register_copies.register_copies`  a value read again by a later epilogue on
       the same threads kept in registers for it;
    7. :func:`~.sixteen_bit.sixteen_bit_targets`  intermediates read only by tensor cores, kept
       in 16 bits; :func:`~.layouts.plan_layouts` / :func:`plan_buffers`  shared-memory layouts and offsets;
    8. :func:`plan_launch`      grid, chunk skipping, launch bounds.

The tunables below are read at each call (``kernels/variants.py`` switches them).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import replace

from ..core.diagram import Diagram
from ..core.errors import LoweringError
from ..ops.index import IntAlgebra
from ..relabel.loopnest import Compute, Finalise, FinalForm, Init, Load, Loop, Update, final_form
from ..relabel.skipping import chunk_skips
from .emit_acc import ACC_CODEGEN
from .emit_kinds import CODEGEN_RULES, REDUCE_OPS
from .frag_operands import frag_operands
from .fuse import fuse_scores
from .layouts import FRAG_PAD, plan_layouts
from .producer import double_for_copies, staged_for_copies
from .register_copies import register_copies
from .reindex import check_axes as check_reindexed_axes, remaps
from .sixteen_bit import sixteen_bit_buffer, sixteen_bit_targets
from .threads import Threads, _check_micro
from .wgmma_plan import assign_offsets, column_only, plan_wgmma
from . import staged_add, tma
from .plan import (MMA_SLACK, AccPlan, AxisPlan, Buffer, Coop, Frag, KernelPlan, LaunchPlan, Micro, Rows,
                   Structure, Target, acc_reduced_axes, axes_set, caps, check_index_width, frozen_map, in_place,
                   kernel_dtype, load_plan, reduced_axes, storage, var_cls)

TRANSPOSE_PAD = 4
"""Floats added to each row of a shared buffer written transposed from global memory."""

FUSE_SCORES = True
"""Keep a normalising accumulator's scores in registers where :class:`~.plan.FusedScores` applies."""

REGISTER_COPIES = True
"""Keep a contraction's value in registers for a later epilogue on the same threads (:mod:`.register_copies`)."""

FRAG_OPERANDS = True
"""Keep a tensor-core update's row operand in the registers that computed it (:mod:`.frag_operands`;
needs ``REGISTER_COPIES``)."""

REGISTER_FLOOR = 128
"""Registers per thread below which the launch bounds never push the compiler."""

REGISTER_SLACK = 16
"""Registers for indices and addresses in :func:`register_estimate`."""
REGISTER_GRACE = 8
"""Registers the estimate may pass a block's share by, the block still counted (:func:`blocks_per_sm`;
kernels/BENCHMARKS.md, "Sixth session of 2026-11-30").  0: the estimate's share, as before."""

CONTRACTION_UNROLL = 8
"""Steps of a contraction's innermost reduction loop written out per iteration of the emitted
loop (when the step count is static and divisible; 1 turns it off)."""

MAX_THREADS = 1024  # threads per block on every CUDA device

PREFETCH_MODES = (False, True, "double", "auto")

AUTO_PREFETCH_REGISTERS = 255
"""``prefetch="auto"`` double-buffers a 16-bit kernel's streamed inputs (``"double"``: cp.async
into a second shared buffer) only while :func:`register_estimate` stays at or below this (on an
H100 the dK, dV kernel at d = 128, estimated 256, spilled and ran 2x slower with them), or where
a copying warpgroup takes their copies (:func:`.producer.double_for_copies`)."""

ENGINE = "cuda_core"  # the engine contractions are planned on (see :data:`.plan.ENGINES`)

WGMMA = "auto"
"""Multiply 16-bit contractions by warpgroups (``wgmma``, :mod:`.wgmma`) where their fragments and
column buffers allow, on compute capability 9.0 or later (the simulator plans for an H100):
``True`` wherever they allow, ``False`` never, ``"auto"`` (the default) where they were measured
faster than ``mma.sync``: several warpgroups, no accumulator rescaled every chunk
(:func:`.wgmma_plan.auto_why_not`)."""


TF32X3 = False
"""Multiply fp32 contractions on tensor cores by 3xTF32 (:data:`.tensorcore.TF32X3`: fp32-level
error, as SDPA's fp32 kernels on sm_80+) where their shapes fit; set per lowering by ``lower(...,
fp32="3xtf32")`` (:func:`tf32x3`).  Off by default: on an H100 a softmax-contraction's forward
+ backward ran 2.6x faster with it, a 4096^3 GEMM 1.4x slower (kernels/BENCHMARKS.md)."""


@contextlib.contextmanager
def tf32x3(on: bool):
    """:data:`TF32X3` set for one lowering (``lower(..., fp32="3xtf32")``), then restored."""
    global TF32X3
    old, TF32X3 = TF32X3, on
    try:
        yield
    finally:
        TF32X3 = old


def plan_kernel(d: Diagram, name: str, threads: int, batch_axes=(), *, fastmath: bool = True,
                micro: tuple[int, int] | None = None, prefetch: bool | str = False,
                unroll: int | None = None, ff: FinalForm | None = None, stages: int | None = None) -> KernelPlan:
    """The plan of one kernel for ``d`` (relabelled, every size bound); ``ff``: its final form, when the
    caller has it; ``stages``: a stream loop's chunk buffers (None: :func:`.producer.staged_for_copies`)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise LoweringError(f"threads must be an int from 1 to {MAX_THREADS} (threads per block), "
                            f"got {threads!r}")
    micro = _check_micro(micro)
    if prefetch not in PREFETCH_MODES or not isinstance(prefetch, (bool, str)):
        raise LoweringError(f"prefetch must be one of {PREFETCH_MODES} (False: no prefetch, True: into "
                            f"registers one chunk ahead, 'double': two shared buffers per chunk, 'auto': "
                            f"'double' for 16-bit inputs where registers allow, else False), got {prefetch!r}")
    ff = final_form(d) if ff is None else ff
    ax, grid_loops, inner = plan_axes(ff, tuple(batch_axes))
    check_reindexed_axes(ff, ax)   # reindexings read whole axes (.reindex)
    st = read_structure(ff, ax)
    cls = classify(ff)
    targets, absorbed = plan_targets(ff, ax, st, cls)
    threads_ = Threads(threads, micro, ax, dtype=kernel_dtype(ff.diagram), tf32x3=TF32X3)
    accs = plan_accumulators(ff, threads_)
    targets, norm_stats = plan_mappings(ff, ax, st, cls, targets, accs, threads_)
    accs, targets, fused = fuse_scores(ff, ax, st, targets, accs, threads_) if FUSE_SCORES else (accs, targets, {})
    targets, accs, frag_ops = frag_operands(ff, ax, st, cls, targets, absorbed, accs, threads_, fused) \
        if FRAG_OPERANDS and REGISTER_COPIES else (targets, accs, {})
    targets, copies = register_copies(ff, st, cls, targets, absorbed, fused, frag_ops) if REGISTER_COPIES \
        else (targets, {})
    if auto := prefetch == "auto":
        prefetch = auto_prefetch(ff, ax, targets, accs, threads, copies, threads_.dtype)
    sixteen = sixteen_bit_targets(ff, st, cls, targets, absorbed, accs, threads_.dtype)
    prefs, packed = plan_layouts(ff, st, targets, absorbed, accs, ax, sixteen)
    buffers, accs = plan_buffers(ff, ax, st, targets, absorbed, accs, norm_stats, prefs, threads, prefetch,
                                 sixteen, packed, stages or 2)
    targets, accs, buffers, wg_notes = plan_wgmma(ff, ax, st, targets, accs, buffers, threads, len(ff.diagram.dom),
                                                  absorbed, WGMMA)
    skips = {n.axis: tuple(s for s in chunk_skips(ff, n) if ax[s.row].role == "grid")
             for n, _ in ff.walk() if isinstance(n, Loop) and n.kind == "stream"}
    buffers = tma.plan(ff, ax, buffers, skips, stages or 2, threads_.dtype, len(ff.diagram.dom), functools.partial(
        column_only, ff, ax, st, targets, accs, buffers, len(ff.diagram.dom)))   # tensor copies of the chunks
    buffers = assign_offsets(staged_add.plan(ff, ax, targets, accs, buffers, any(skips.values()) or tma.copied(
        buffers.values())))   # one bulk add a chunk
    launch = plan_launch(ff, ax, grid_loops, targets, accs, buffers, skips, threads, prefetch, copies)
    plan = KernelPlan(name, d, ff, threads, fastmath, prefetch,
                      CONTRACTION_UNROLL if unroll is None else int(unroll), frozen_map(ax), tuple(grid_loops),
                      tuple(inner), st, frozen_map(cls), frozen_map(targets), frozen_map(absorbed), tuple(accs),
                      frozen_map(fused), frozen_map(norm_stats), frozen_map(buffers), frozen_map(skips), launch,
                      (*threads_.notes, *wg_notes), threads_.dtype, frozen_map(copies), frozen_map(frag_ops))
    again = functools.partial(plan_kernel, d, name, threads, batch_axes, fastmath=fastmath, micro=micro,
                              prefetch="double", unroll=unroll, ff=ff)   # the second buffers, then more (.producer)
    return plan if stages else staged_for_copies(double_for_copies(plan, lambda: again(stages=2)) if auto else plan,
                                                 lambda s: again(stages=s))


# --------------------------------------------------------------------------- 1. axes

def plan_axes(ff: FinalForm, batch_axes: tuple) -> tuple[dict, tuple, tuple]:
    """(axis plans, the grid loops outermost first, the nodes inside them)."""
    dd = ff.diagram
    grid = []
    nodes = ff.body
    while len(nodes) == 1 and isinstance(nodes[0], Loop) and nodes[0].kind == "grid":
        grid.append(nodes[0])
        nodes = nodes[0].body
    for n, _ in ff.walk():
        if isinstance(n, Loop) and n.kind == "grid" and n not in grid:
            raise LoweringError(f"grid loop over {n.axis} inside another loop: tiles must be "
                                f"outermost")
    ax: dict[str, AxisPlan] = {}
    for a in dd.axes:
        if not isinstance(a.size, int):
            raise LoweringError(f"axis {a.name} has no size")
        ax[a.name] = AxisPlan(a.name, a.size, "full", a.size)
    for lp in grid:
        ax[lp.axis] = replace(ax[lp.axis], role="batch" if lp.axis in batch_axes else "grid", cap=int(lp.step))
    streamed = set()
    for n, loops in ff.walk():
        if isinstance(n, Loop) and n.kind == "stream":
            if n.axis in streamed or any(lp.axis == n.axis for lp in loops):
                raise LoweringError(f"axis {n.axis} is streamed twice (a sub-stream); the "
                                    f"numba.cuda lowering streams each axis once")
            if ax[n.axis].role != "full":
                raise LoweringError(f"axis {n.axis} is both tiled and streamed; the numba.cuda "
                                    f"lowering needs one partition per axis")
            streamed.add(n.axis)
            ax[n.axis] = replace(ax[n.axis], role="stream", cap=int(n.step))
    init_loops = {n.acc: loops for n, loops in ff.walk() if isinstance(n, Init)}
    for n, loops in ff.walk():
        if isinstance(n, Update):
            acc = ff.accumulators[n.acc]
            for lp in loops[len(init_loops.get(n.acc, ())):]:
                if lp.kind == "stream" and acc.slice_updates(lp.axis):
                    # every buffer has one extent per axis (tile, chunk or whole): a state of
                    # the whole axis updated a chunk at a time has two (one without it adds whole)
                    raise LoweringError(
                        f"stream {lp.axis} nests inside stream {acc.axis} and updates "
                        f"{acc.box.name}'s accumulator one {lp.axis}-chunk slice at a time; the "
                        f"numba.cuda lowering keeps accumulator states at the extent of the loops "
                        f"around them: use order({lp.axis!r}, {acc.axis!r})")
    return ax, tuple(grid), tuple(nodes)


# --------------------------------------------------------------------------- 2. structure

def read_structure(ff: FinalForm, ax: dict) -> Structure:
    dd = ff.diagram
    types = dd.var_types()
    loops_of, scope_of, def_node, load_of = {}, {}, {}, {}
    for n, loops in ff.walk():
        loops_of[id(n)] = loops
        scope = tuple(lp for lp in loops if lp.kind == "stream")
        scope_of[id(n)] = scope
        if isinstance(n, Load) and in_place(ff, n, types):   # an auxiliary tensor its gathers read in HBM
            def_node[n.var] = n
        elif isinstance(n, Load):
            if n.var in load_of:
                raise LoweringError(f"input {types[n.var]} is loaded twice")
            load_of[n.var] = n
            def_node[n.var] = n
            for a in types[n.var].axis_names:
                if ax[a].role == "stream" and not any(lp.axis == a for lp in scope):
                    raise LoweringError(f"input {types[n.var]} is read outside the "
                                        f"stream loop over {a}; load it inside")
        elif isinstance(n, Compute):
            for v in dd.eqn_outputs(n.eqn):
                def_node[v] = n
        elif isinstance(n, Finalise):
            for v in dd.eqn_outputs(ff.accumulators[n.acc].eqn):
                def_node[v] = n
    consumers: dict[int, list] = {v: [] for v in range(len(types))}
    for n, _ in ff.walk():
        if isinstance(n, Compute):
            for v in dd.eqns[n.eqn].ins:
                consumers[v].append(("eqn", n.eqn))
        elif isinstance(n, Update):
            for v in dd.eqns[ff.accumulators[n.acc].eqn].ins:
                consumers[v].append(("acc", n.acc))
    for v in dd.outs:
        consumers[v].append(("out",))
    eqn_of = {v: k for k in range(len(dd.eqns)) for v in dd.eqn_outputs(k)}
    acc_of_var = {v: i for i, acc in enumerate(ff.accumulators) for v in dd.eqn_outputs(acc.eqn)}
    kernel_dtype(dd)
    check_index_width(dd)
    return Structure(frozen_map(loops_of), frozen_map(scope_of), frozen_map(def_node), frozen_map(load_of),
                     frozen_map({v: tuple(c) for v, c in consumers.items()}), frozen_map(eqn_of),
                     frozen_map(acc_of_var))


# --------------------------------------------------------------------------- 3. classify

def classify(ff: FinalForm) -> dict[int, str]:
    dd = ff.diagram
    out: dict[int, str] = {}
    acc_rule = {a.eqn: a.rule for a in ff.accumulators}
    for k, e in enumerate(dd.eqns):
        if k in acc_rule:
            if acc_rule[k] == "reduce" and e.box.param("op") not in REDUCE_OPS:
                raise LoweringError(f"{e.box.name}: no numba.cuda accumulator for {e.box.param('op')}")
            out[k] = "accumulator"
            continue
        rule = CODEGEN_RULES.get(e.box.kind)
        if rule is None:
            raise LoweringError(f"no numba.cuda rule for box kind {e.box.kind!r} (box {e.box.name})")
        why = rule.check(e.box) if rule.check else None
        if rule.cls == "unsupported" or why:
            raise LoweringError(f"cannot lower {e.box.name}: {why}")
        if len(e.box.cod) != 1:
            raise LoweringError(f"{e.box.name} has {len(e.box.cod)} outputs; lowered boxes have one")
        out[k] = rule.cls
    return out


# --------------------------------------------------------------------------- 4. materialisation

def _chain_top(c: int, dd, ax, st: Structure, cls) -> int:
    """Follow single-consumer elementwise boxes from ``c`` while they keep its axes."""
    types = dd.var_types()
    u = c
    scope = st.scope_of[id(st.def_node[c])]
    while u not in dd.outs:
        cons = st.consumers[u]
        if len(cons) != 1 or cons[0][0] != "eqn":
            break
        k = cons[0][1]
        if cls[k] != "elementwise" or remaps(dd.eqns[k].box):   # a reindexing reads other elements
            break
        (out,) = dd.eqn_outputs(k)
        if axes_set(types[out], ax) != axes_set(types[c], ax) or st.scope_of[id(st.def_node[out])] != scope:
            break
        u = out
    return u


def plan_targets(ff: FinalForm, ax, st: Structure, cls) -> tuple[dict, dict]:
    """(targets without mappings, reduction outputs absorbed into a chain's target)."""
    dd = ff.diagram
    n_in = len(dd.dom)
    targets: dict[int, Target] = {}
    absorbed: dict[int, int] = {}
    sources = [v for v in sorted(st.eqn_of) if var_cls(v, n_in, cls, st) == "reduction"]
    sources += sorted(st.acc_of_var)
    for c in sorted(sources):
        u = _chain_top(c, dd, ax, st, cls)
        if u != c and u in targets:
            u = c
        targets[u] = Target(u, c, False, False)
        if u != c:
            absorbed[c] = u
    for v in dd.outs:
        if v >= n_in and v not in targets:
            targets[v] = Target(v, None, False, False)
    return {v: replace(t, to_global=t.var in dd.outs,
                       to_smem=any(c[0] != "out" for c in st.consumers[t.var]))
            for v, t in targets.items()}, absorbed


# --------------------------------------------------------------------------- 5. thread mappings

def plan_accumulators(ff: FinalForm, th: Threads) -> list[AccPlan]:
    init_loops = {n.acc: loops for n, loops in ff.walk() if isinstance(n, Init)}
    plans = []
    for i, acc in enumerate(ff.accumulators):
        if acc.rule not in ACC_CODEGEN:
            raise LoweringError(f"no numba.cuda code for accumulator {acc.rule!r} ({acc.box.name})")
        loops = init_loops[i]
        out_axes = acc.box.cod[0].axis_names
        kind = ACC_CODEGEN[acc.rule]
        main, engine = None, None
        if kind.contraction:
            main, engine = _contraction_mapping(ff.diagram, acc.box.name, out_axes, acc.eqn,
                                                acc_reduced_axes(acc), th)
        plan = AccPlan(i, acc, main or th.flat_for(out_axes), ff.state_level(acc, "main", loops) == "registers",
                       ff.state_level(acc, "stat", loops) == "registers", engine=engine)
        if kind.stats:
            stat_axes = tuple(a for a in acc.box.dom[0].axis_names if a != acc.axis)
            plan = replace(plan, stat_axes=stat_axes, stat=th.coop_for(stat_axes))
        plans.append(plan)
    return plans


def _contraction_mapping(dd, what: str, out_axes, eqn: int, red, th: Threads):
    """(mapping, engine) of a contraction: tensor-core fragments where the kernel's dtype and
    the shapes fit ``mma.sync.m16n8k16``, else a register micro-tile on CUDA cores (None when
    no micro-tile fits either: the caller picks a flat or cooperative mapping)."""
    operands = [axes_set(dd.var_types()[v], th.ax) for v in dd.eqns[eqn].ins]
    if th.tensor_cores:
        why = th.mma_refusal(out_axes, operands, red)
        m = th.frag_for(out_axes) if why is None else None
        if why is None and m is None:
            why = th.frag_refusal(out_axes)
        if m is not None:
            return m, "mma"
        th.note(f"{what} on CUDA cores (fp32), not tensor cores: {why}.")
    return th.micro_for(out_axes) if red else None, ENGINE


def plan_mappings(ff: FinalForm, ax, st: Structure, cls, targets: dict, accs, th: Threads):
    """(targets with their mappings, row-statistics mappings of the normalisers)."""
    dd = ff.diagram
    types = dd.var_types()
    out = {}
    for v, t in targets.items():
        out_axes = types[t.var].axis_names
        engine = None
        if t.source is None:
            m = th.flat_for(out_axes)
        elif t.source in st.acc_of_var:
            m = accs[st.acc_of_var[t.source]].main
        else:
            k = st.eqn_of[t.source]
            box = dd.eqns[k].box
            red = reduced_axes(box)
            red_n = math.prod(ax[a].cap for a in red)
            n_out = math.prod(ax[a].cap for a in out_axes if ax[a].cap > 1)
            contraction = CODEGEN_RULES[box.kind].contraction
            m = None
            if contraction:
                m, engine = _contraction_mapping(dd, box.name, out_axes, k, red, th)
            if m is None and (2 * n_out <= th.T and red_n > 1 or box.param("op", "") == "logsumexp"):
                m = th.coop_for(out_axes)
            m = m or th.flat_for(out_axes)
        out[v] = replace(t, mapping=m, engine=engine)
    norm_stats = {}
    for k, c in cls.items():
        if c == "normaliser":
            box = dd.eqns[k].box
            stat = tuple(a for a in box.dom[0].axis_names if a != box.param("axis"))
            norm_stats[k] = th.coop_for(stat)
    return out, norm_stats


# --------------------------------------------------------------------------- 6. scores in registers: .fuse


# --------------------------------------------------------------------------- 7. layouts and buffers

def plan_buffers(ff: FinalForm, ax, st: Structure, targets, absorbed, accs: list, norm_stats, pref,
                 T: int, prefetch, sixteen=frozenset(), packed=frozenset(), stages=2) -> tuple[dict, list[AccPlan]]:
    """(every shared buffer with its layout and its 16-byte aligned offset, the accumulator
    plans with the buffers of their weights: ``p_buf``); the targets in ``sixteen`` are held
    as 16-bit patterns (:mod:`.sixteen_bit`); the fp32 buffers in ``packed`` (read by tensor
    cores as pairs along their last axis) get :data:`FRAG_PAD` more floats per row where their
    rows are a multiple of 16 floats."""
    dd = ff.diagram
    accs = list(accs)
    types = dd.var_types()
    n_in = len(dd.dom)
    bufs: dict[tuple, Buffer] = {}

    def buf(key, base: str, axes, what: str, **kw) -> Buffer:
        names = [a for a in axes if ax[a].cap > 1]
        last = pref.get(key)
        if last in names:
            names = [a for a in names if a != last] + [last]
        bufs[key] = Buffer(key, base, tuple(names), tuple(ax[a].cap for a in names), what, **kw)
        b = bufs[key]
        if key in packed and len(b.axes) >= 2 and b.axes[-1] == last and not b.pad and b.caps[-1] % 16 == 0:
            b = bufs[key] = replace(b, pad=FRAG_PAD, what=b.what + f" (rows padded by {FRAG_PAD} for fragment reads)")
        return b

    chunked = {m.var for n, _ in ff.walk() if isinstance(n, Loop) and n.kind == "stream"
               for m in n.body if isinstance(m, Load)}
    double = chunked if prefetch == "double" else set()
    for v in sorted(st.load_of):
        arr = types[v]
        b = buf(("var", v), f"{arr.name}_s", arr.axis_names, f"input {arr.name}")
        names = [a for a in arr.axis_names if ax[a].cap > 1]
        if arr.dtype.name in ("f16", "bf16"):
            b = bufs[b.key] = sixteen_bit_buffer(b)
        elif len(b.axes) >= 2 and names and b.axes[-1] != names[-1] and v in chunked and not b.pad:
            # a chunk written transposed (global order in, threads along the global last
            # axis): a row of 4 more floats keeps 16-byte alignment and spreads the stores
            b = bufs[b.key] = replace(b, pad=TRANSPOSE_PAD,
                                      what=b.what + f" (transposed, rows padded by {TRANSPOSE_PAD})")
        if v in double:
            bufs[b.key] = replace(b, copies=stages, what=b.what + f" ({'two' if stages == 2 else stages} chunk buffers)")
    for t in sorted(targets.values(), key=lambda t: t.var):
        if t.to_smem:
            arr = types[t.var]
            if t.var in sixteen:
                b = buf(("var", t.var), f"{arr.name}_s", arr.axis_names, arr.name)
                bufs[b.key] = sixteen_bit_buffer(b, "materialised, ")
            else:
                buf(("var", t.var), f"{arr.name}_s", arr.axis_names, f"{arr.name} (materialised)")
    for k in norm_stats:
        box = dd.eqns[k].box
        stat = tuple(a for a in box.dom[0].axis_names if a != box.param("axis"))
        buf(("norm_m", k), f"{box.cod[0].name}_max_s", stat, f"row max of {box.name}")
        buf(("norm_z", k), f"{box.cod[0].name}_sum_s", stat, f"row normaliser of {box.name}")
    for p in list(accs):
        acc, kind = p.acc, ACC_CODEGEN[p.acc.rule]
        oname = acc.box.cod[0].name
        if p.stats_of is not None:   # .fuse: the row statistics of an online softmax
            o = accs[p.stats_of]
            buf(("mupub", o.index), f"{o.acc.box.cod[0].name}_mu_s", o.stat_axes, f"row max of {o.acc.box.cod[0].name}")
            buf(("zpub", o.index), f"{o.acc.box.cod[0].name}_z_s", o.stat_axes, f"normaliser of {o.acc.box.cod[0].name}")
            continue
        for sname, axes, role in acc.states():
            if not (p.main_regs if role == "main" else p.stat_regs):
                buf(("state", p.index, sname), f"{oname}_{sname}_s", axes, f"state {sname} of {oname}")
        if p.fused is not None and p.engine == "mma":
            pass   # the weights stay in registers: their C fragments are the A fragments of o
        elif p.fused is not None:
            # weights staged by the warp that owns their rows, laid out [streamed, rows] so
            # the main micro-tile reads a thread's rows as one vector
            ms = p.fused.ms
            key = ("p", p.index)
            bufs[key] = Buffer(key, f"{oname}_p_s", (acc.axis, ms.row), (ms.cc, ms.cr),
                               f"weights of {oname} (warp-private rows)")
            accs[p.index] = replace(p, p_buf=key)
        elif p.stat is not None:
            s, _ = dd.eqns[acc.eqn].ins
            p_axes = (*p.stat_axes, acc.axis)
            if (storage(s, n_in, targets, absorbed) == "smem" and len(st.consumers[s]) == 1
                    and axes_set(types[s], ax) == frozenset(a for a in p_axes if ax[a].cap > 1)):
                accs[p.index] = replace(p, p_buf=("var", s))   # overwrite the scores with the weights
            else:
                buf(("p", p.index), f"{oname}_p_s", p_axes, f"weights of {oname}")
                accs[p.index] = replace(p, p_buf=("p", p.index))
            if kind.rescales:
                buf(("delta", p.index), f"{oname}_delta_s", p.stat_axes, f"per-row rescale of {oname}")
            if p.stat_regs:
                buf(("zpub", p.index), f"{oname}_z_s", p.stat_axes, f"normaliser of {oname} at the end")
    if norm_stats or any(p.stat is not None for p in accs) or any(
            isinstance(t.mapping, Coop) for t in targets.values()):
        bufs[("red",)] = Buffer(("red",), "red_s", ("_lanes",), (T,), "reduction scratch")
    return assign_offsets(bufs), accs


# --------------------------------------------------------------------------- 8. launch

def plan_launch(ff: FinalForm, ax, grid_loops, targets, accs, bufs, skips, T: int, prefetch,
                copies=()) -> LaunchPlan:
    grid = [lp.axis for lp in grid_loops if ax[lp.axis].role == "grid"]
    batch = [lp.axis for lp in grid_loops if ax[lp.axis].role == "batch"]
    gx = math.prod(-(-ax[a].size // ax[a].cap) for a in grid)
    gy = math.prod(ax[a].size for a in batch)
    heavy = frozenset(s.row for ss in skips.values() for s in ss if _grows_with_rows(s))
    if gy > 65535 or (heavy and batch):
        # one grid dimension, tiled axes slowest: with heavy_last, blocks are launched in
        # decreasing order of work (the longest first keeps the last wave short)
        grid, batch = grid + batch, []
        gx, gy = gx * gy, 1
    smem_floats = max((b.offset + -(-b.size // 4) * 4 for b in bufs.values()), default=0)   # offsets aligned (.tma)
    regs = register_estimate(ff, ax, targets, accs, T, prefetch, copies)
    return LaunchPlan((gx, gy, 1), tuple(grid), tuple(batch), heavy, smem_floats, regs,
                      blocks_per_sm(4 * smem_floats, T, regs))


def _grows_with_rows(skip) -> bool:
    """Later tiles of rows only stream more chunks (the first never moves), read through the
    skip's support: transposed (keys tiled, the backward), later causal tiles stream fewer."""
    far = 2 ** 31
    return skip.support(far, far + 1, IntAlgebra)[0] == 0


def register_estimate(ff: FinalForm, ax, targets, accs, T: int, prefetch, copies=()) -> int:
    """Registers a thread needs, roughly: values live across a stream loop (accumulator states,
    scores kept in registers, chunks prefetched into registers), register copies
    (:mod:`.register_copies`), the largest fragment pair of a micro-tile, and ``REGISTER_SLACK``."""
    types = ff.diagram.var_types()
    live, frag = 0, 0
    for p in accs:
        live += math.prod(p.main.shape)
        if p.stat is not None:
            live += len(p.acc.states()) - 1 if not isinstance(p.stat, Rows) else \
                (len(p.acc.states()) - 1) * p.stat.micro.RY
        if p.fused is not None:
            live += p.fused.ms.RY * p.fused.ms.RX
    for t in targets.values():
        if isinstance(t.mapping, Micro) and not isinstance(t.mapping, Frag):   # MMA_SLACK counts fragments
            frag = max(frag, t.mapping.RY + t.mapping.RX)
    live += sum(targets[v].mapping.RY * targets[v].mapping.RX for v in copies)
    frags = [m for m in [t.mapping for t in targets.values()] + [p.main for p in accs] if isinstance(m, Frag)]
    if frags:   # 3xTF32 pairs are four registers, not one: twice the slack (ptxas: spills at one)
        live += MMA_SLACK * (2 if any(m.dtype == "f32" for m in frags) else 1)
    if prefetch:   # a chunk held in registers (double buffers filled by cp.async hold none)
        linked = bool(frags) or any(a.dtype.name in ("f16", "bf16") for a in ff.diagram.dom)
        for n, _ in ff.walk():
            if isinstance(n, Loop) and n.kind == "stream":
                loads = [types[m.var] for m in n.body if isinstance(m, Load)]
                if not (prefetch == "double" and all(async_copied(a, ax, linked) for a in loads)):
                    live += sum(load_plan(a, ax, T)[1] for a in loads)
    return live + frag + REGISTER_SLACK


def async_copied(arr, ax, linked: bool) -> bool:
    """Whether ``cp.async`` fills ``arr``'s chunk buffers (``.emit_loads``: 16 bytes per copy, 8
    elements of a 16-bit input or 4 of an fp32 one in a kernel that ``linked`` the tensor-core
    primitives, along a last axis whose block and size they divide)."""
    w = 8 if arr.dtype.name in ("f16", "bf16") else 4 if arr.dtype.name == "f32" and linked else 0
    last = ax.get(arr.axis_names[-1]) if arr.axis_names else None
    return bool(w) and last is not None and not (last.cap % w or last.size % w)


def auto_prefetch(ff: FinalForm, ax, targets, accs, T: int, copies, dtype: str) -> bool | str:
    """What ``prefetch="auto"`` means for this kernel: ``"double"`` when its inputs are 16-bit (so
    the second buffers fill by cp.async, no registers in between), a stream loop loads a chunk,
    and the :func:`register_estimate` stays within :data:`AUTO_PREFETCH_REGISTERS`; fp32 on tensor
    cores (3xTF32, :data:`TF32X3`) ``"double"`` whenever a stream loop loads (the next chunk staged
    through registers: measured on an H100 at d = 64 and 128, forward 3.25 -> 2.99 and
    6.74 -> 6.14 ms, the one backward kernel 7.41 -> 6.84 and 15.19 -> 15.04, kernels/BENCHMARKS.md);
    else False."""
    streams = any(isinstance(n, Loop) and n.kind == "stream" and any(isinstance(m, Load) for m in n.body)
                  for n, _ in ff.walk())
    if not streams:
        return False
    if dtype == "f32":
        return "double" if TF32X3 else False
    fits = register_estimate(ff, ax, targets, accs, T, "double", copies) <= AUTO_PREFETCH_REGISTERS
    return "double" if fits else False


def blocks_per_sm(smem_bytes: int, T: int, registers: int) -> int:
    """Blocks per SM for the launch bounds: as many as shared memory, threads and the
    :func:`register_estimate` (less :data:`REGISTER_GRACE`, at least ``REGISTER_FLOOR``) allow;
    at least 1 (H100 / H200 limits: the source does not depend on the machine)."""
    from .runtime import H100_DEFAULTS as lim
    by_smem = lim.max_shared_per_sm // (smem_bytes + lim.reserved_shared_per_block)
    by_threads = lim.max_threads_per_sm // T
    by_regs = lim.max_registers_per_sm // (T * max(REGISTER_FLOOR, registers - REGISTER_GRACE))
    return max(1, min(by_smem, by_threads, by_regs, lim.max_blocks_per_sm))
