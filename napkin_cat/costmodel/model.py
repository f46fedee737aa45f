"""The performance model: transfers, memory and FLOPs read off a relabelled diagram.

``cost(d)`` walks the final form (:meth:`Diagram.loop_nest`) once.  Nothing here knows an
algorithm by name: every number comes from the loop nest's nodes and one rule per box kind.

Transfers (values; :meth:`Cost.bytes` for bytes)
    A ``Load`` moves a buffer from the top level down, a ``Store`` moves it back; each costs its
    extent product times the trip counts of the loops around it (a loop over an axis the array
    has partitions it, a loop over an axis it lacks repeats it).  A node computes one level
    below its home (the level of its innermost loop), so an operand or result living above
    that level is moved too: in an unrelabelled diagram every box reads its operands from HBM
    and writes its results back (intermediates are materialised), inside a tile every operand
    read from shared memory is an ``SMEM`` transfer.  ``transfers[level]`` sums the moves
    between ``level`` and the level below it: ``transfers["HBM"]`` is what crosses HBM.
Memory
    The loop nest's exact live buffers per column; ``memory[level]`` is its peak (values).
FLOPs by unit
    ``tensor`` (contractions, ``2 * prod(all axes)``), ``fma`` (other elementwise work,
    reductions, accumulator merges) and ``exp`` (special-function unit: exp, log, sqrt, rsqrt,
    tanh, sigmoid, ...), from :data:`~.rules.COST_RULES`, one rule per box kind, keyed exactly
    like :data:`napkin_cat.ops.kinds.SPECS`.  A streamed accumulator is costed per chunk
    (its ``update`` phase), so the online softmax's per-chunk rescaling exps are counted.
Skipped chunks
    A stream loop that a mask bounds (causal, windowed attention) runs, for each row tile,
    only over the chunks the mask leaves: the transfers and the work inside it are counted
    over those chunks (:mod:`.skips`), exactly when the sizes are bound.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> c = nc.cost(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"))
>>> c.transfers["HBM"]
2*d*q + 2*d*q*x/g_q
>>> c.memory["SMEM"]
2*d*g_q + 2*d*s_x
>>> alphas, betas = c.closed_form("SMEM")
>>> alphas, betas
((2*d*q, 4*d**2*q*x), (0, 1))
>>> best = c.optimize({q: 8192, x: 8192, d: 128}, memory=65536, fixed={"s_x": 64})
>>> best.tiles
{'s_x': 64, 'g_q': 192}
"""

from __future__ import annotations

from fractions import Fraction

import sympy as sp

from ..core.diagram import Diagram, DType, f32
from ..core.errors import CostError
from ..core.hierarchy import Hierarchy
from ..ops.kinds import gather_expr
from ..relabel.loopnest import Compute, Init, Load, Loop, Store, Update, param_vars
from ..relabel.split import AddStore
from .atomics import add_store_records, zero_fill_moves
from .links import link_moves
from .records import ZERO, Move, Op, Resident, frozen
from .report import Cost
from .rules import UNITS, box_work, mask_work
from .skips import SkipCounter


def cost(d: Diagram, hierarchy: Hierarchy | None = None, data: dict | None = None) -> Cost:
    """The cost of ``d`` as relabelled (an unrelabelled diagram materialises every box's
    result at the top level).  ``hierarchy`` is kept for :meth:`Cost.multilevel`; ``data``:
    values of block tables by input name (:func:`napkin_cat.block_table`), or of the data a mask
    reads (``doc``: then the table a kernel derives from it, :mod:`napkin_cat.ops.derived_tables`),
    so that the chunks a mask skips by its data are counted (without them they are counted as
    visited, and :attr:`Cost.notes` says so)."""
    if not isinstance(d, Diagram):
        raise CostError(f"cost needs a Diagram, got {type(d).__name__}")
    if hierarchy is not None and not isinstance(hierarchy, Hierarchy):
        raise CostError(f"cost: hierarchy must be a Hierarchy (nc.hierarchy.hierarchy(l2=True)), got {hierarchy!r}")
    from ..ops.derived_tables import derivation_notes, for_cost   # a mask that reads data: its derived table
    derived = derivation_notes(d)
    d, data, lacking = for_cost(d, data)
    ff = d.loop_nest()
    h = ff.hierarchy
    bottom = h.names[-1]
    dd = ff.diagram
    types = dd.var_types()
    params = set(param_vars(dd).values())
    moves: list[Move] = []
    ops: list[Op] = []
    alias: dict[tuple, tuple] = {}

    skipping = SkipCounter(ff, data)
    notes: list[str] = [f"a mask reads {', '.join(map(repr, lacking))}: a kernel skips the chunks that data masks "
                        f"(a block table derived at each launch); without its values (cost(..., data={{"
                        f"{lacking[0]!r}: values}})) they are counted as visited"] if lacking else []
    notes += derived

    def execs(loops, axes_=None):
        """Executions of a node inside ``loops`` (and, rounding repeats of a buffer with
        ``axes_`` up to whole tiles, ``ragged``): the product of the trip counts, the chunks a
        mask skips left out."""
        skip = skipping.trips(loops, axes_)
        n, r = (skip.execs, skip.ragged_execs) if skip else (sp.Integer(1), sp.Integer(1))
        for i, lp in enumerate(loops):
            if skip and i in skip.loops:
                continue
            t = ff.trip_count(lp, loops[:i])
            n *= t
            r *= t if (axes_ is not None and lp.axis in axes_) else sp.ceiling(t)
        return n, r

    def ident(key) -> tuple[str, DType, bool]:
        if key[0] in ("var", "copy"):
            a = types[key[1]]
            return a.name, a.dtype, False
        _, i, sname = key
        acc = ff.accumulators[i]
        for name, _, role in acc.states():
            if name == sname:
                if role == "main":
                    return acc.box.cod[0].name, acc.box.cod[0].dtype, False
                return sname, f32, True
        raise AssertionError(key)

    def buf(v_or_key, loops):
        key = v_or_key if isinstance(v_or_key, tuple) else alias.get(("var", v_or_key), ("var", v_or_key))
        return key, ff.buffer(key, loops)

    def move(kind, key, b, upper, lower, loops, size=None):
        name, dt, _ = ident(key)
        n, r = execs(loops, set(b.axes))
        moves.append(Move(kind, name, dt, upper, lower, b.size if size is None else size, n, r,
                          tuple(lp.axis for lp in loops)))

    def gathers(e, loops) -> dict[int, sp.Expr]:
        """``{input: entries}`` for the auxiliary tensors ``e``'s index expression gathers from:
        the entries it can read over the loops' extents (:meth:`~napkin_cat.ops.index_expr.Ix.footprint`),
        not the whole tensor."""
        expr = gather_expr(e.box)
        if expr is None:
            return {}
        names = {a for v in e.ins for a in types[v].axis_names}
        fp = expr.footprint({a: ff.extent(a, loops) for a in names})
        return {v: fp[types[v].name] for v in e.ins[1:] if types[v].name in fp}

    def above(a, b):
        return h.index(a) < h.index(b)

    def touch(kind, keys, loops, clevel):
        for key in keys:
            k, b = buf(key, loops)
            if above(b.level, clevel):
                if kind == "read":
                    move("read", k, b, b.level, clevel, loops)
                else:
                    move("write", k, b, b.level, clevel, loops)

    def work(box, phase, loops, label):
        vol = lambda names: sp.Mul(*(ff.extent(n, loops) for n in names)) if names else sp.Integer(1)
        n, _ = execs(loops)
        skip = skipping.trips(loops)
        if skip is not None:
            for name in skip.unknown:
                note = (f"the chunks that block table {name!r} masks are skipped when the kernel runs; "
                        f"without its values (cost(..., data={{{name!r}: table}})) they are counted as visited")
                if note not in notes:
                    notes.append(note)
            versions = skip.mask_versions(box.param("pred")) if box.kind == "mask" else None
            if versions is not None and skip.execs != 0:
                # the mask's arithmetic runs only on the chunks it does not keep whole, each
                # with the block-table comparisons that the chunk's entries fix folded away
                for known, e in versions or (((), 0),):   # no such chunk: listed, run 0 times
                    record(mask_work(box, vol, known), n / skip.execs * e, loops, label)
                return
        record(box_work(box, vol, phase), n, loops, label)

    def record(works, n, loops, label):
        for w in works:
            prec = tuple((a.name, a.dtype) for a in w.precision)
            ops.append(Op(w.unit, w.count, n, w.what, label, prec, tuple(lp.axis for lp in loops)))

    for node, loops in ff.walk():
        if isinstance(node, Loop):
            continue
        home = ff._home(loops)
        clevel = h.below(home) if home != bottom else home
        if isinstance(node, Load):
            if node.level != node.src:
                key, b = buf(("var", node.var) if node.final else ("copy", node.var, node.level), loops)
                move("load", key, b, node.src, node.level, loops)
        elif isinstance(node, AddStore):   # a read-modify-write: fp32 atomics (.atomics)
            key, b = buf(("var", node.var), loops)
            added_moves, added_ops = add_store_records(ff, node, b, execs(loops, set(b.axes)), loops)
            moves.extend(added_moves)
            ops.extend(added_ops)
        elif isinstance(node, Store):
            if node.level != node.dst:
                key, b = buf(("copy", node.var, node.level) if node.flush else ("var", node.var), loops)
                move("store", key, b, node.dst, node.level, loops)
        elif isinstance(node, Compute) and node.eqn in params:
            # a parameter lives at the top level like an input: its Compute is its load (one
            # that nothing reads has no load, and costs nothing)
            (v,) = dd.eqn_outputs(node.eqn)
            if node.src is not None and node.level != node.src:
                key, b = buf(("var", v) if node.final else ("copy", v, node.level), loops)
                move("load", key, b, node.src, node.level, loops)
        elif isinstance(node, Compute):
            e = dd.eqns[node.eqn]
            gathered = gathers(e, loops)
            touch("read", [v for v in e.ins if v not in gathered], loops, clevel)
            for v, entries in gathered.items():
                key, b = buf(v, loops)
                if above(b.level, clevel):
                    move("read", key, b, b.level, clevel, loops, size=entries)
            touch("write", dd.eqn_outputs(node.eqn), loops, clevel)
            work(e.box, "apply", loops, e.box.name)
        else:
            acc = ff.accumulators[node.acc]
            states = [("state", node.acc, s) for s, _, _ in acc.states()]
            if isinstance(node, Init):
                touch("write", states, loops, clevel)
                work(acc.box, "init", loops, f"init {acc.box.cod[0].name}")
            elif isinstance(node, Update):
                touch("read", dd.eqns[acc.eqn].ins, loops, clevel)
                touch("read", states, loops, clevel)
                touch("write", states, loops, clevel)
                work(acc.box, "update", loops, f"update {acc.box.cod[0].name}")
            else:
                touch("read", states, loops, clevel)
                # a state machine without a "main" state (logsumexp: m, z) computes its result
                # from the statistics at the end: the output is a buffer of its own
                main = next((("state", node.acc, s) for s, _, role in acc.states() if role == "main"), None)
                if main is not None:
                    for v in dd.eqn_outputs(acc.eqn):
                        alias[("var", v)] = main
                touch("write", dd.eqn_outputs(acc.eqn), loops, clevel)
                work(acc.box, "finalise", loops, f"finalise {acc.box.cod[0].name}")

    columns = []
    for col in ff.columns():
        rows = []
        for b in col.live:
            name, dt, stat = ident(b.key)
            rows.append(Resident(b.level, b.size, name, dt, stat, b.key[0] == "state"))
        columns.append(tuple(rows))
    moves.extend(link_moves(ff))
    moves.extend(zero_fill_moves(ff))
    transfers: dict[str, sp.Expr] = {}
    for m in moves:
        transfers[m.upper] = transfers.get(m.upper, ZERO) + m.values
    flops = {u: ZERO for u in UNITS}
    for o in ops:
        flops[o.unit] += o.total
    return Cost(d, ff, tuple(moves), tuple(ops), tuple(columns),
                frozen({k: sp.expand(v) for k, v in transfers.items()}),
                frozen(ff.peak_memory()), frozen({u: sp.expand(v) for u, v in flops.items()}), hierarchy,
                tuple(notes))



def concurrent_groups(capacity: int, block: int, group: int) -> Fraction:
    """``(M_max - M_block) / M_group`` as an exact fraction (floor it for a count)."""
    return Fraction(capacity - block, group)
