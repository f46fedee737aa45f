"""Choosing a schedule for lowering: which axes to tile or stream, and by how much.

A diagram given to :func:`napkin_cat.lower` may carry its own relabelings (with int or symbolic
sizes), or none.  This module completes it:

* **Which axes.**  Axes the diagram is weaved over (``relabel.tile_problem`` is None) are
  tiled.  The *main* tiled axes are the weaved ones among the last two axes of an output (the
  matrix dimensions an input is shared across); the other weaved axes that every equation
  keeps (batch, heads, groups) get tiles of 1 and become extra grid dimensions.  Axes removed
  by an accumulator (``relabel.stream_plan``) are streamed.
* **How much.**  ``tiles={axis or symbol: size}`` wins.  Otherwise stream chunks come from a
  rule of thumb (64 for a normalised contraction's scores, 16 for a plain contraction, 4 and 3
  under the simulator), and tile sizes from the cost model: :meth:`napkin_cat.cost.Cost.optimize`
  with the chunks fixed and the memory at the SMEM level capped at a per-block budget (half
  the device's opt-in shared memory per block, so two blocks fit on an SM), rounded down to a
  power of two that the thread mapping covers (at most 8 x 8 register accumulators per thread
  per tile pair).  Without the cost model, or if it fails, a heuristic (64 per main tiled axis,
  128 for two-axis tiles; 4 under the simulator).  :attr:`Schedule.how` records which.
* **Threads.**  256 per block on a GPU, 16 under the simulator, unless ``threads`` is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..core import Axis, Diagram, Relabel
from ..errors import LoweringError, NapkinError
from ..relabel import fuse_norm_contract, fuse_softmax_contract, stream_plan, tile_problem

GPU_THREADS = 256
SIM_THREADS = 16


@dataclass
class Schedule:
    diagram: Diagram                 # relabelled, every size an int
    batch_axes: tuple[str, ...]      # axes tiled by 1 that the lowering added (grid dimensions)
    threads: int
    how: str                         # where the block sizes came from
    chosen: dict = field(default_factory=dict)


def unbound_axes(d: Diagram) -> list[str]:
    return [a.name for a in d.axes if a.symbolic]


def _concrete(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LoweringError(f"{what} must be a positive int, got {v!r}")
    return v


def _key(k) -> str:
    return k.name if isinstance(k, Axis) else str(k)


def _fused(d: Diagram, axis: str) -> Diagram:
    return fuse_norm_contract(fuse_softmax_contract(d, axis), axis)


def analyse(d0: Diagram):
    """(tileable axes, streamable axes, batch axes, main axes) of an unrelabelled diagram."""
    names = [a.name for a in d0.axes]
    tileable = [a for a in names if tile_problem(d0, a) is None]
    streamable = []
    for a in names:
        if a in tileable:
            continue
        try:
            fd = _fused(d0, a)
        except NapkinError:
            continue
        plan = stream_plan(fd, a)
        if not isinstance(plan, str) and plan.accumulators:
            streamable.append(a)
    main = []
    for arr in d0.cod:
        for a in arr.axis_names[-2:]:
            if a in tileable and a not in main:
                main.append(a)
    types = d0.var_types()
    everywhere = [a for a in tileable
                  if all(all(types[v].has(a) for v in d0.eqn_outputs(k)) for k in range(len(d0.eqns)))]
    batch = [a for a in tileable if a not in main and a in everywhere]
    return tileable, streamable, batch, main


def choose(d: Diagram, tiles: dict | None = None, threads: int | None = None,
           simulate: bool = False, hw=None) -> Schedule:
    """Complete ``d``'s schedule (see the module docstring)."""
    missing = unbound_axes(d)
    if missing:
        raise LoweringError(f"cannot lower {d.short()}: axes {', '.join(missing)} have no size; "
                            f"bind them first, e.g. d.bind({{{', '.join(repr(m) + ': n' for m in missing)}}})")
    tiles = {_key(k): v for k, v in (tiles or {}).items()}
    T = _concrete(threads, "threads") if threads is not None else (SIM_THREADS if simulate else GPU_THREADS)
    d0 = d.unrelabelled()
    tileable, streamable, batch, main = analyse(d0)
    has_blocks = any(r.op in ("tile", "stream") for r in d.schedule)
    how = "given"
    chosen: dict[str, int] = {}
    if not has_blocks:
        d, how, chosen = _build(d, tiles, tileable, streamable, main, simulate, T, hw)
    else:
        d, how, chosen = _resolve_symbols(d, tiles, simulate, T, hw)
    tiled = {r.axis for r in d.schedule if r.op == "tile"}
    streamed = {r.axis for r in d.schedule if r.op == "stream"}
    added = []
    for a in tileable:
        if a in tiled or a in streamed:
            continue
        if a in batch:
            try:
                d = d.tile(a, 1)
            except NapkinError as e:
                raise LoweringError(f"cannot make {a} a grid dimension: {e}") from None
            added.append(a)
    for r in d.schedule:
        if r.op in ("tile", "stream") and not isinstance(r.size, int):
            raise LoweringError(f"{r.op} size {r.size!r} of axis {r.axis} is still symbolic")
    return Schedule(d, tuple(added), T, how, chosen)


def _chunk(d0: Diagram, axis: str, simulate: bool) -> int:
    fd = _fused(d0, axis)
    plan = stream_plan(fd, axis)
    rules = {a.rule for a in plan.accumulators}
    n = d0.axis(axis).size
    if simulate:
        return min(n, 3)
    size = 64 if rules & {"online_softmax", "normalized", "logsumexp"} else 16
    return min(n, size)


def _heuristic_tile(d0: Diagram, axis: str, main: list[str], simulate: bool) -> int:
    n = d0.axis(axis).size
    if simulate:
        return min(n, 4)
    return min(n, 128 if len(main) >= 2 else 64)


def _row_tile(d0: Diagram, axis: str, simulate: bool, T: int) -> int:
    """Rows per block when nothing streams: the whole row is one block-level reduction."""
    n = d0.axis(axis).size
    row = math.prod(a.size for a in d0.axes if a.name != axis and isinstance(a.size, int)) or 1
    if simulate:
        return min(n, 2)
    return max(1, min(n, T // row if row < T else 1))


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def _build(d: Diagram, tiles: dict, tileable, streamable, main, simulate, T, hw):
    d0 = d.unrelabelled()
    chosen: dict[str, int] = {}
    out = d0
    for a in streamable:
        s = tiles.get(a)
        chosen[a] = _concrete(s, f"chunk of {a}") if s is not None else _chunk(d0, a, simulate)
    for a in main:
        if a in tiles:
            chosen[a] = _concrete(tiles[a], f"tile of {a}")
    unknown = set(tiles) - set(chosen) - {a for a in tileable}
    if unknown:
        raise LoweringError(f"tiles given for {sorted(unknown)}: not tileable or streamable axes of "
                            f"{d.short()} (tileable {tileable}, streamable {streamable})")
    for a in tileable:
        if a in tiles and a not in chosen:
            chosen[a] = _concrete(tiles[a], f"tile of {a}")
    free = [a for a in main if a not in chosen]
    how = "given" if not free else "heuristic"
    if free:
        if not streamable:
            for a in free:
                chosen[a] = _row_tile(d0, a, simulate, T)
            how = "heuristic (rows per block)"
        else:
            best = None if simulate else _cost_tiles(d0, free, chosen, streamable, T, hw)
            if best:
                chosen.update(best)
                how = "cost model (SMEM budget), rounded to the thread mapping"
            else:
                for a in free:
                    chosen[a] = _heuristic_tile(d0, a, main, simulate)
    try:
        for a in streamable:
            out = out.stream(a, chosen[a])
        for a in tileable:
            if a in chosen:
                out = out.tile(a, chosen[a])
    except NapkinError as e:
        raise LoweringError(f"cannot relabel {d.short()} for lowering: {e}") from None
    return _registers_for_states(out), how, chosen


def _registers_for_states(d: Diagram) -> Diagram:
    """Main accumulator states of streamed contractions stay in the registers of the threads
    that own them (the update's thread mapping is fixed for the whole stream loop)."""
    from ..loopnest import final_form
    ff = final_form(d)
    for acc in ff.accumulators:
        if acc.rule in ("sum_contract", "online_softmax", "normalized"):
            d = d.place(acc.box.cod[0].name, "registers")
    return d


def _resolve_symbols(d: Diagram, tiles: dict, simulate, T, hw):
    sched = []
    chosen = {}
    how = "given"
    d0 = d.unrelabelled()
    _, _, _, main = analyse(d0)
    for r in d.schedule:
        if r.op in ("tile", "stream") and isinstance(r.size, str):
            v = tiles.get(r.size, tiles.get(r.axis))
            if v is None:
                if r.op == "stream":
                    v = _chunk(d0, r.axis, simulate)
                elif not any(x.op == "stream" for x in d.schedule):
                    v = _row_tile(d0, r.axis, simulate, T)
                else:
                    v = _heuristic_tile(d0, r.axis, main, simulate)
                how = "heuristic"
            chosen[r.size] = _concrete(v, f"{r.op} size {r.size}")
            r = replace(r, size=chosen[r.size])
        sched.append(r)
    return replace(d, schedule=tuple(sched)), how, chosen


def _cost_tiles(d0: Diagram, free, chosen, streamable, T, hw) -> dict | None:
    """Tile sizes from the cost model: fewest HBM->SMEM transfers with the SMEM memory under a
    per-block budget, then rounded down to powers of two the thread mapping covers."""
    try:
        from ..cost import cost
        from ..hardware import H100
    except ImportError:
        return None
    hw = hw or H100
    try:
        sym = d0
        for a in streamable:
            sym = sym.stream(a, chosen[a])
        names = {}
        for a in free:
            names[a] = f"g_{a}"
            sym = sym.tile(a, names[a])
        for a, v in chosen.items():
            if a not in streamable:
                sym = sym.tile(a, v)
        c = cost(sym)
        sizes = {a.name: a.size for a in d0.axes}
        budget = int(hw.capacity("SMEM")) // 2 // 4   # values: half the opt-in shared memory
        best = c.optimize(sizes, memory=budget)
    except Exception:
        return None
    out = {}
    limit = 8 * math.isqrt(T) if len(free) >= 2 else 128
    for a in free:
        v = best.tiles.get(names[a])
        if not isinstance(v, int) or v < 1:
            return None
        out[a] = max(1, min(_pow2_floor(v), limit, _pow2_floor(d0.axis(a).size) if d0.axis(a).size >= 1 else 1))
    return out
