"""The final form: a small loop-nest IR read off a relabelled diagram, its printer, and the
tiled NumPy executor that gives it meaning.

Nodes: :class:`Loop` (``grid`` over a tiled axis, ``stream`` over a streamed one),
:class:`Load` / :class:`Store` (a colour change: data moves between levels),
:class:`Compute` (one equation), :class:`Init` / :class:`Update` / :class:`Finalise` (an
accumulator).  Grid loops are outermost (groups run on separate cores); stream loops nest in
the order given by ``order(...)`` or, failing that, in the order they were applied.  A second
stream of an axis already streamed is a sub-loop inside the first.

Buffers: every variable the nest touches, and every accumulator state, lives at a level with
an extent per axis (the tile or chunk size where a loop partitions that axis, else the full
size).  :meth:`FinalForm.columns` walks the nest with liveness, giving per program point the
live buffers and the memory per level: the paper's pseudocode diagram, and the numbers the
cost model reads.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> flash = nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
>>> print(flash.loop_nest().pseudocode(memory=False))
for q in tiles of g_q  (grid, SMEM)
  load Q[g_q d] -> SMEM
  init O: mu[g_q] @registers, z[g_q] @registers, o[g_q d] @SMEM
  for x in chunks of s_x  (stream, SMEM)
    load K[s_x d] -> SMEM
    load V[s_x d] -> SMEM
    S[g_q s_x] = contract(Q, K)  @registers
    S[g_q s_x] = scale(S)  @registers
    update O (online_softmax) with S, V
  finalise O[g_q d] = online_softmax(mu, z, o)  @SMEM
  store O[g_q d] -> HBM
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import sympy as sp

from .accumulators import Accumulator
from ..core.diagram import Diagram
from ..core.errors import RelabelError
from ..core.hierarchy import DEVICES, FULL, Hierarchy, hierarchy
from ..ops.kinds import gathered_only, spec
from .rules import stream_plan
from .nodes import Buffer, Column, Compute, Finalise, Init, Load, Loop, Store, Update  # noqa: F401 (re-exported)
from .symbols import size_expr, size_symbol
from .split import AddStore, add_stores, loop_note


# --------------------------------------------------------------------------- final form

@dataclass(frozen=True)
class FinalForm:
    diagram: Diagram
    body: tuple
    accumulators: tuple[Accumulator, ...]
    placements: tuple[tuple[str, str], ...] = ()

    # ---- structure
    def walk(self) -> Iterator[tuple[object, tuple[Loop, ...]]]:
        """Every node in program order with its enclosing loops (outer first)."""
        def go(nodes, loops):
            for n in nodes:
                yield n, loops
                if isinstance(n, Loop):
                    yield from go(n.body, loops + (n,))
        yield from go(self.body, ())

    @property
    def loops(self) -> tuple[Loop, ...]:
        return tuple(n for n, _ in self.walk() if isinstance(n, Loop))

    def trip_count(self, loop: Loop, loops: tuple[Loop, ...]) -> sp.Expr:
        """Iterations of ``loop`` (inside ``loops``): extent of its axis there over its step (a
        split over the devices runs once per device: ``devices`` times)."""
        if loop.step == DEVICES:
            return size_symbol(DEVICES)
        return self.extent(loop.axis, loops) / size_expr(loop.step)

    def extent(self, axis: str, loops: tuple[Loop, ...]) -> sp.Expr:
        for i in reversed(range(len(loops))):
            lp = loops[i]
            if lp.axis == axis:
                if lp.step == DEVICES:
                    return self.extent(axis, loops[:i]) / size_symbol(DEVICES)
                return size_expr(lp.step)
        return size_expr(self.diagram.axis(axis).size)

    # ---- levels
    def placed(self, name: str) -> str | None:
        """The level ``place(name, level)`` puts wire ``name`` at (or the default placement of a
        large auxiliary tensor), else None."""
        for n, lv in self.placements:
            if n == name:
                return lv
        return None

    def in_place(self, var: int) -> bool:
        """``var`` is an auxiliary tensor (an input read only by gathers) placed at the top level
        (``place(name, "HBM")``, or by :data:`AUX_WHOLE_BYTES`): never loaded, each gather reads
        its entries where it lives."""
        d = self.diagram
        return (var < len(d.dom) and self.placed(d.dom[var].name) == FULL.top
                and var in d.memo("loopnest.gathered_only", lambda: gathered_only(d)))

    def _home(self, loops) -> str:
        if loops:
            return loops[-1].level
        # A relabelled nest runs as one group on the core of its outermost loop, so what lives
        # outside every loop (a stream-only nest's resident operands and state) lives there
        # too; only an unrelabelled diagram computes at the top level.
        return next((n.level for n in self.body if isinstance(n, Loop)), FULL.top)

    def var_level(self, var: int, loops: tuple[Loop, ...]) -> str:
        """Inputs and outputs live at the level of the innermost loop around them; other
        intermediates one level lower (registers), unless placed."""
        d = self.diagram
        placed = self.placed(d.var_types()[var].name)
        if placed:
            return placed
        home = self._home(loops)
        if var < len(d.dom) or var in param_vars(d) or var in d.outs or home == FULL.top:
            return home
        return self.hierarchy.below(home)

    def state_level(self, acc: Accumulator, role: str, loops) -> str:
        home = self._home(loops)
        placed = self.placed(acc.box.cod[0].name)
        if role == "main":
            return placed or home
        return self.hierarchy.below(home) if home != FULL.top else home

    def buffer(self, key: tuple, loops: tuple[Loop, ...]) -> Buffer:
        d = self.diagram
        if key[0] in ("var", "copy"):
            arr = d.var_types()[key[1]]
            level = self.var_level(key[1], loops) if key[0] == "var" else key[2]
            return Buffer(key, arr.name, arr.axis_names, tuple(self.extent(a, loops) for a in arr.axis_names),
                          level, arr.dtype.bytes)
        _, i, sname = key
        acc = self.accumulators[i]
        for name, axes_, role in acc.states():
            if name == sname:
                dt = acc.box.cod[0].dtype.bytes if role == "main" else 4
                return Buffer(key, f"{sname}", tuple(axes_), tuple(self.extent(a, loops) for a in axes_),
                              self.state_level(acc, role, loops), dt)
        raise AssertionError(key)

    def loaded(self, node) -> int | None:
        """The variable ``node`` loads: a ``Load``'s, or a parameter's (its Compute); else None."""
        if isinstance(node, Load):
            return node.var
        return self.diagram.eqn_outputs(node.eqn)[0] if isinstance(node, Compute) and node.src else None

    # ---- liveness
    def columns(self) -> list[Column]:
        """Program points with their live buffers (the pseudocode diagram's columns).

        A buffer is live from the node that defines it to its last use; a use inside a loop
        that does not contain the definition keeps it live to the end of that loop.  A
        finalised accumulator writes its output in place of its main state."""
        points = list(self.walk())
        index = {id(n): i for i, (n, _) in enumerate(points)}

        def last(node) -> int:  # the last program point inside ``node``
            if isinstance(node, Loop) and node.body:
                return max(last(c) for c in node.body)
            return index[id(node)]

        loop_end = {i: last(n) for i, (n, _) in enumerate(points) if isinstance(n, Loop)}
        defs: dict[tuple, tuple[int, tuple]] = {}
        last_use: dict[tuple, int] = {}

        def use(key, i, loops):
            end = i
            if key in defs:
                dloops = defs[key][1]
                for lp in loops:
                    if lp not in dloops:
                        end = max(end, loop_end[index[id(lp)]])
                        break
            last_use[key] = max(last_use.get(key, -1), end)

        d = self.diagram
        alias: dict[tuple, tuple] = {}
        for i, (n, loops) in enumerate(points):
            if isinstance(n, Load) and self.in_place(n.var):
                continue   # not copied anywhere: its gathers read it where it lives
            if (v := self.loaded(n)) is not None:
                if n.src != FULL.top:
                    use(("copy", v, n.src), i, loops)
                defs[("var", v) if n.final else ("copy", v, n.level)] = (i, loops)
            elif isinstance(n, Compute):
                for v in d.eqns[n.eqn].ins:
                    use(alias.get(("var", v), ("var", v)), i, loops)
                for v in d.eqn_outputs(n.eqn):
                    defs[("var", v)] = (i, loops)
            elif isinstance(n, Init):
                for sname, _, _ in self.accumulators[n.acc].states():
                    defs[("state", n.acc, sname)] = (i, loops)
            elif isinstance(n, Update):
                acc = self.accumulators[n.acc]
                for v in d.eqns[acc.eqn].ins:
                    use(alias.get(("var", v), ("var", v)), i, loops)
                for sname, _, _ in acc.states():
                    use(("state", n.acc, sname), i, loops)
            elif isinstance(n, Finalise):
                acc = self.accumulators[n.acc]
                for sname, _, role in acc.states():
                    use(("state", n.acc, sname), i, loops)
                    if role == "main":
                        for v in d.eqn_outputs(acc.eqn):
                            alias[("var", v)] = ("state", n.acc, sname)
            elif isinstance(n, Store):
                if n.flush:  # the staged copy spans the whole group being flushed
                    key = ("copy", n.var, n.level)
                    if key in defs:
                        defs[key] = (defs[key][0], loops)
                    use(key, i, loops)
                else:
                    use(alias.get(("var", n.var), ("var", n.var)), i, loops)
                if n.dst != FULL.top:
                    defs.setdefault(("copy", n.var, n.dst), (i, loops))
        cols = []
        for i, (n, loops) in enumerate(points):
            live = tuple(self.buffer(k, dl) for k, (di, dl) in defs.items()
                         if di <= i <= last_use.get(k, di))
            cols.append(Column(n, loops, live))
        return cols

    def peak_memory(self) -> dict[str, sp.Expr]:
        """Largest total size resident at each level over all columns (values)."""
        peaks: dict[str, list] = {}
        for c in self.columns():
            for lv, m in c.memory().items():
                peaks.setdefault(lv, []).append(m)
        return {lv: sp.Max(*ms) for lv, ms in peaks.items()}

    # ---- printing
    def pseudocode(self, memory: bool = True) -> str:
        """The paper's pseudocode diagram: init / loop / finalise with every live variable."""
        d = self.diagram
        names = d.var_names()
        lines = []
        cols = self.columns() if memory else None
        for i, (n, loops) in enumerate(self.walk()):
            pad = "  " * len(loops)
            if isinstance(n, Loop):
                what = "tiles" if n.kind == "grid" else "chunks"
                if n.step == DEVICES:
                    how = "sharded" if n.kind == "grid" else "ring"
                    text = f"for {n.axis} in {what} of {self.extent(n.axis, loops + (n,))} over the devices  ({how}, {n.level})"
                else:
                    text = f"for {n.axis} in {what} of {n.step}  ({n.kind}, {n.level}{loop_note(self, n)})"
            elif isinstance(n, Load) and self.in_place(n.var):   # read where it lives
                b = self.buffer(("var", n.var), loops)
                text = f"{b.describe()} stays in {b.level}: gathered in place"
            elif (v := self.loaded(n)) is not None:
                b = self.buffer(("var", v) if n.final else ("copy", v, n.level), loops)
                src = "" if n.src == FULL.top else f"{n.src} "
                text = f"load {'' if isinstance(n, Load) else 'param '}{b.describe()} {src}-> {b.level}"
            elif isinstance(n, Store):
                b = self.buffer(("copy", n.var, n.level) if n.flush else ("var", n.var), loops)
                text = n.describe(b) if isinstance(n, AddStore) else \
                    f"{'flush' if n.flush else 'store'} {b.describe()} -> {n.dst}"
            elif isinstance(n, Compute):
                e = d.eqns[n.eqn]
                outs = [self.buffer(("var", v), loops) for v in d.eqn_outputs(n.eqn)]
                text = (f"{', '.join(b.describe() for b in outs)} = {e.box.name}"
                        f"({', '.join(names[v] for v in e.ins)})  @{outs[0].level}")
            elif isinstance(n, Init):
                acc = self.accumulators[n.acc]
                sts = [self.buffer(("state", n.acc, s), loops) for s, _, _ in acc.states()]
                text = f"init {acc.box.cod[0].name}: " + ", ".join(f"{b.describe()} @{b.level}" for b in sts)
            elif isinstance(n, Update):
                acc = self.accumulators[n.acc]
                text = (f"update {acc.box.cod[0].name} ({acc.rule}) with "
                        f"{', '.join(names[v] for v in d.eqns[acc.eqn].ins)}")
            elif isinstance(n, Finalise):
                acc = self.accumulators[n.acc]
                (v,) = d.eqn_outputs(acc.eqn)
                b = self.buffer(("var", v), loops)
                sts = ", ".join(s for s, _, _ in acc.states())
                lvl = self.state_level(acc, "main", loops)
                text = f"finalise {b.describe()} = {acc.rule}({sts})  @{lvl}"
            else:  # pragma: no cover - every node type is listed above
                raise AssertionError(n)
            if memory:
                mem = cols[i].memory()
                text = f"{pad + text:<60} | " + ", ".join(f"{lv}: {m}" for lv, m in sorted(mem.items()))
            else:
                text = pad + text
            lines.append(text)
        return "\n".join(lines)

    @property
    def hierarchy(self) -> Hierarchy:
        """The default hierarchy, extended by whatever optional levels the relabelings use."""
        used = {lp.level for lp in self.loops} | {lv for _, lv in self.placements}
        return hierarchy(l2="L2" in used, cluster="cluster" in used, tensor="tensor" in used)

    def __str__(self) -> str:
        return self.pseudocode()


# --------------------------------------------------------------------------- building

def final_form(d: Diagram) -> FinalForm:
    """Read the loop nest off ``d``'s relabelings (once per diagram: every stage reads the same one)."""
    return d.memo("final_form", lambda: _final_form(d))


def _final_form(d: Diagram) -> FinalForm:
    tiles = [r for r in d.schedule if r.op == "tile"]
    streams = [r for r in d.schedule if r.op == "stream"]
    order_r = [r for r in d.schedule if r.op == "order"]
    if order_r:
        rank = {n: i for i, n in enumerate(order_r[-1].extra)}
        streams.sort(key=lambda r: rank.get(r.axis, len(rank)))
    placements = tuple((r.extra[0], r.level) for r in d.schedule if r.op == "place")
    if tiles or streams:
        placements += aux_in_place(d, {n for n, _ in placements})
    plain = d.unrelabelled()
    accs: list[Accumulator] = []
    body = _build(plain, tuple(range(len(plain.eqns))), tuple(streams), accs)
    for r in reversed(sorted(tiles, key=lambda r: FULL.index(r.level))):  # slower levels outside
        body = (Loop(r.axis, r.size, "grid", r.level, body),)
    ff = FinalForm(plain, body, tuple(accs), placements)
    return FinalForm(plain, add_stores(d, _insert_moves(ff)), tuple(accs), placements)


AUX_WHOLE_BYTES = 16 * 1024
"""An auxiliary tensor (an input read only through the gathers of index expressions: a document
id per token, a block mask, a bias table) at most this large is loaded whole into each block's
fast memory, once; a larger one stays in HBM and each gather reads its entry there (through
the caches), as ``place(name, "HBM")`` asks for any size.  16 KiB keeps the tables of the
measured variants at N = 4096 (``doc[4096]``, a 64 x 64 block table) in shared memory, where
they were measured; the block mask of 4 x 4 blocks at N = 4096 (4 MiB) could not be held by
any block."""


def aux_in_place(d: Diagram, placed) -> tuple[tuple[str, str], ...]:
    """The default placement of ``d``'s large auxiliary tensors (:data:`AUX_WHOLE_BYTES`): in
    HBM, read in place by their gathers; those already ``placed`` keep their placement."""
    out = []
    for v in gathered_only(d):
        arr = d.dom[v]
        if arr.name in placed or any(not isinstance(a.size, int) for a in arr.axes):
            continue
        if arr.dtype.bytes * math.prod(a.size for a in arr.axes) > AUX_WHOLE_BYTES:
            out.append((arr.name, FULL.top))
    return tuple(out)


def _build(d: Diagram, eqns: tuple[int, ...], streams: tuple, accs: list, pending: tuple = ()) -> tuple:
    """The nest for ``eqns`` under ``streams`` (outer first).  ``pending`` are accumulators of
    enclosing stream loops: their updates follow the computations of ``eqns``."""
    if not streams:
        return tuple(Compute(k) for k in eqns) + tuple(Update(i) for i in pending)
    r, rest = streams[0], streams[1:]
    plan = stream_plan(d, r.axis)
    if isinstance(plan, str):
        raise RelabelError(f"cannot stream {r.axis}: {plan}")
    inside = set(eqns)
    region = tuple(k for k in plan.region if k in inside)
    my_accs = [a for a in plan.accumulators if a.eqn in inside]
    outside = [k for k in eqns if k not in region and k not in {a.eqn for a in my_accs}]
    for other in rest:
        if other.axis != r.axis:
            sub = stream_plan(d, other.axis)
            if not isinstance(sub, str):
                stray = [a.eqn for a in sub.accumulators if a.eqn in outside]
                if stray:
                    raise RelabelError(f"stream {other.axis} cannot nest inside stream {r.axis}: "
                                       f"{d.eqns[stray[0]].box.name} removes {other.axis} outside the "
                                       f"{r.axis} loop; use order({other.axis!r}, {r.axis!r})")
    ids = []
    for a in my_accs:
        accs.append(a)
        ids.append(len(accs) - 1)
    # An enclosing accumulator updates once per chunk of this loop when the loop streams its own
    # axis (a sub-stream) or every state of it carries the axis (it is weaved over the axis: each
    # chunk updates its own slice).  Otherwise it updates after the loop, which is only right
    # when it reads nothing computed chunk by chunk inside the loop.
    down = tuple(i for i in pending if _updates_per_chunk(accs[i], r.axis))
    after_loop = tuple(i for i in pending if i not in down)
    in_loop = {v for k in region for v in d.eqn_outputs(k)}
    for i in after_loop:
        acc = accs[i]
        if in_loop & set(d.eqns[acc.eqn].ins):
            lacking = [n for n, axes_, _ in acc.states() if r.axis not in axes_]
            raise RelabelError(f"stream {r.axis} cannot nest inside the stream of {acc.axis}: the "
                               f"accumulator of {acc.box.name} reads values computed a chunk of "
                               f"{r.axis} at a time, but its state {', '.join(lacking)} does not "
                               f"carry {r.axis}; put the {r.axis} loop outside: "
                               f"order({r.axis!r}, {acc.axis!r})")
    after = _downstream(d, set(a.eqn for a in my_accs), outside)
    post_vars = {v for k in outside if k in after for v in d.eqn_outputs(k)}
    for i in down:
        if post_vars & set(d.eqns[accs[i].eqn].ins):
            raise RelabelError(f"stream {r.axis} cannot nest inside the stream of {accs[i].axis}: "
                               f"{accs[i].box.name} reads a value finished only after the {r.axis} "
                               f"loop; use order({r.axis!r}, {accs[i].axis!r})")
    loop_body = _build(d, region, rest, accs, tuple(ids) + down)
    pre = tuple(Compute(k) for k in outside if k not in after)
    post = tuple(Compute(k) for k in outside if k in after)
    return (pre + tuple(Init(i) for i in ids) + (Loop(r.axis, r.size, "stream", r.level, loop_body),)
            + tuple(Finalise(i) for i in ids) + post + tuple(Update(i) for i in after_loop))


def _updates_per_chunk(acc: Accumulator, axis: str) -> bool:
    """An accumulator of an enclosing stream updates inside a loop over ``axis`` when the loop
    streams its own axis (a sub-stream), every state carries ``axis`` (each chunk its slice), or
    it sums a contraction over ``axis`` as well (``sum_contract``, a monoid: the chunks of the two
    loops partition the summed indices, so each pair of chunks adds its part; the backward of
    grouped-query attention sums dK over the groups and the queries so)."""
    if acc.axis == axis or all(axis in axes_ for _, axes_, _ in acc.states()):
        return True
    return acc.rule == "sum_contract" and acc.reduces(axis)


def _downstream(d: Diagram, acc_eqns: set[int], candidates) -> set[int]:
    tainted = {v for k in acc_eqns for v in d.eqn_outputs(k)}
    after = set()
    for k in sorted(candidates):
        if any(v in tainted for v in d.eqns[k].ins):
            after.add(k)
            tainted.update(d.eqn_outputs(k))
    return after


def _uses(ff: FinalForm, node) -> tuple[int, ...]:
    d = ff.diagram
    if isinstance(node, Compute):
        return d.eqns[node.eqn].ins
    if isinstance(node, Update):
        return d.eqns[ff.accumulators[node.acc].eqn].ins
    return ()


def _defines(ff: FinalForm, node) -> tuple[int, ...]:
    if isinstance(node, Compute):
        return ff.diagram.eqn_outputs(node.eqn)
    if isinstance(node, Finalise):
        return ff.diagram.eqn_outputs(ff.accumulators[node.acc].eqn)
    return ()


def param_vars(d: Diagram) -> dict[int, int]:
    """``{variable: equation}`` of the parameters of ``d`` (``source`` boxes naming a value bound
    at evaluation): they live at the top level, like inputs."""
    return d.memo("loopnest.param_vars", lambda: {
        v: k for k, e in enumerate(d.eqns) if spec(e.box).shape == "source" and e.box.param("pname", None)
        is not None for v in d.eqn_outputs(k)})


def _insert_moves(ff: FinalForm) -> tuple:
    """Insert the colour changes.  An input enters each level at the innermost loop of that
    level which partitions it (a grid loop, or a loop over one of its own axes) among the
    loops enclosing all its uses; an output leaves after its definition and is flushed from
    each outer level at the end of that level's innermost partitioning loop.  A parameter is
    loaded as an input is (:class:`Compute`); one nothing reads stays where it was."""
    d = ff.diagram
    n_in = len(d.dom)
    h = ff.hierarchy
    params = param_vars(d)
    source = lambda v: v < n_in or v in params
    uses: dict[int, list[tuple[Loop, ...]]] = {}
    defined_in: dict[int, tuple[Loop, ...]] = {}
    for node, loops in ff.walk():
        for v in _uses(ff, node):
            if source(v):
                uses.setdefault(v, []).append(loops)
        for v in _defines(ff, node):
            if v not in params:
                defined_in[v] = loops
    loads: dict[tuple, list[Load]] = {}   # enclosing loops -> loads at the top of that body
    flushes: dict[tuple, list[Store]] = {}  # enclosing loops -> flushes at the end of that body
    inner_store: dict[int, Store] = {}
    loaded = sorted(uses) + [v for v in dict.fromkeys(d.outs) if source(v) and v not in uses]
    for v in loaded:
        chain = _common_prefix(uses.get(v) or [_grid_chain(ff)])
        axes_ = d.var_types()[v].axis_names
        depth = {}
        for k, lp in enumerate(chain):
            if lp.kind == "grid" or lp.axis in axes_:
                depth[lp.level] = k + 1
        final = max(depth.values(), default=0)
        final_level = ff.var_level(v, chain[:final])
        src = h.top
        for lv in sorted(depth, key=h.index):
            if depth[lv] < final and h.index(lv) < h.index(final_level):
                loads.setdefault(chain[:depth[lv]], []).append(Load(v, lv, src, final=False))
                src = lv
        loads.setdefault(chain[:final], []).append(Load(v, final_level, src))
    for v in dict.fromkeys(d.outs):
        chain = defined_in.get(v, _common_prefix(uses.get(v) or [_grid_chain(ff)]))
        level = ff.var_level(v, chain)
        home = ff._home(chain)
        axes_ = d.var_types()[v].axis_names
        depth = {}  # levels above the group's own, each staging the output for its loops
        for k, lp in enumerate(chain):
            if (lp.kind == "grid" or lp.axis in axes_) and h.index(lp.level) < h.index(home):
                depth[lp.level] = k + 1
        outer = sorted(depth, key=h.index, reverse=True)  # innermost level first
        dsts = outer + [h.top]
        inner_store[v] = Store(v, level, dsts[0])
        for lv, dst in zip(outer, dsts[1:]):
            flushes.setdefault(chain[:depth[lv]], []).append(Store(v, lv, dst, flush=True))

    moved = {params[v] for v in loaded if v in params}
    load = lambda ld: Compute(params[ld.var], ld.src, ld.level, ld.final) if ld.var in params else ld

    def rebuild(nodes, loops):
        out = [load(ld) for ld in loads.get(loops, [])]
        out += [inner_store[ld.var] for ld in loads.get(loops, []) if ld.final and ld.var in inner_store]
        for n in nodes:
            if isinstance(n, Loop):
                out.append(Loop(n.axis, n.step, n.kind, n.level, rebuild(n.body, loops + (n,))))
            elif isinstance(n, Compute) and n.eqn in moved:
                continue
            else:
                out.append(n)
                out += [inner_store[v] for v in _defines(ff, n) if v in inner_store]
        return tuple(out + flushes.get(loops, []))

    return rebuild(ff.body, ())


def _common_prefix(chains: list[tuple[Loop, ...]]) -> tuple[Loop, ...]:
    common = chains[0]
    for lps in chains[1:]:
        k = 0
        while k < min(len(common), len(lps)) and common[k] is lps[k]:
            k += 1
        common = common[:k]
    return common


def _grid_chain(ff: FinalForm) -> tuple[Loop, ...]:
    chain = []
    nodes = ff.body
    while len(nodes) == 1 and isinstance(nodes[0], Loop) and nodes[0].kind == "grid":
        chain.append(nodes[0])
        nodes = nodes[0].body
    return tuple(chain)


def _final_form_html(self) -> str:
    """Jupyter's view of a final form: the pseudocode with its memory columns as an HTML table,
    rendered by the drawing stage (registered as ``final_form_html``); without it, the text."""
    from html import escape

    from ..core import registry
    from ..core.errors import NapkinError
    try:
        render = registry.verb("final_form_html")
    except NapkinError:
        return f"<pre>{escape(self.pseudocode())}</pre>"
    return render(self)


FinalForm._repr_html_ = _final_form_html
