"""Choosing a schedule for lowering: which axes to tile or stream, and by how much.

A diagram given to :func:`napkin_cat.lower` may carry its own relabelings (with int or symbolic
sizes), or none.  This module completes it:

* **Which axes.**  Axes the diagram is weaved over (``relabel.tile_problem`` is None) are
  tiled.  The *main* tiled axes are the weaved ones among the last two axes of an output (the
  matrix dimensions an input is shared across); the other weaved axes that every equation
  keeps (batch, heads, groups) get tiles of 1 and become extra grid dimensions.  Where the main
  axes all come from one operand of a contraction (a convolution's ``Y[b o ho wo]``: ``ho, wo``
  from the input), the other operand's last kept axis (``o``) is main too: an implicit GEMM tiles
  rows and columns.  Axes removed by an accumulator (``relabel.stream_plan``) are streamed.
* **How much.**  ``tiles={axis or symbol: size}`` wins.  Otherwise stream chunks come from a rule
  of thumb (:func:`_chunk`; 3 under the simulator), and tile sizes from the cost model
  (:meth:`napkin_cat.costmodel.Cost.optimize`) with the chunks fixed and SMEM capped at half the
  opt-in shared memory per block (two blocks an SM), rounded down to a power of two the thread
  mapping covers (at most 8 x 8 accumulators per thread per tile pair), or, where no multiple of
  16 fits (a convolution's rows), the optimum over every integer.  On a GPU the tiles are then halved (not below 16) while the grid has fewer blocks
  than 90% of the SMs.  Without the cost model, or if it fails, a heuristic (64 per main tiled axis,
  128 for two-axis tiles; 4 under the simulator).  :attr:`Schedule.how` records which.
* **Requirements.**  ``require(axis, k)`` holds for every size chosen here: a rule of thumb or
  the cost model's size is rounded down to a multiple of ``k`` (up to ``k`` if smaller); an axis
  shorter than ``k`` cannot be partitioned and is refused.  Given sizes that break a requirement
  are refused.
* **Given sizes.**  ``tiles`` keys name axes or block symbols of ``d``; a key naming nothing
  partitioned, or an axis whose concrete block differs from the given size, is refused
  (:class:`~napkin_cat.core.errors.LoweringError`): nothing in ``tiles`` is silently ignored.
* **Loop order.**  A stream loop nested inside another stream loop whose enclosing accumulator it
  updates slice by slice (its states carry the inner axis: ``stream(b).stream(a)`` of
  ``C[a c] = A[a b] B[b c]``) is hoisted outside it with ``order(...)`` (the accumulators do not
  depend on the nesting), so every state has the extent of its own loops; an explicit ``order``
  asking for such a nesting is refused.  :attr:`Schedule.notes` says so.
* **Threads.**  256 per block on a GPU (128 for a tensor-core normalisation), 16 under the
  simulator, unless ``threads`` is given (1 to ``MAX_THREADS``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from ..core.diagram import Axis, Diagram
from ..core.errors import LoweringError, NapkinError
from ..relabel.loopnest import FinalForm
from ..relabel.skipping import shorter_rows_pay
from ..relabel.rules import (check_blocks, fuse_norm_contract, fuse_softmax_contract, requirements, stream_plan,
                       tile_problem)
from . import planner
from .plan import kernel_dtype
from .reindex import remaps
from .wgmma_plan import computed_axes, forward_chunk, warpgroup_forward

GPU_THREADS, SIM_THREADS, MAX_THREADS = 256, 16, 1024   # MAX_THREADS: per block on every CUDA device


@dataclass
class Schedule:
    diagram: Diagram                 # relabelled, every size an int
    batch_axes: tuple[str, ...]      # axes tiled by 1 that the lowering added (grid dimensions)
    threads: int
    how: str                         # where the block sizes came from
    chosen: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)   # what the lowering changed (loop order), for the kernel
    final_form: FinalForm | None = None          # of ``diagram``, built once for the planner


def unbound_axes(d: Diagram) -> list[str]:
    return [a.name for a in d.axes if a.symbolic]


def _concrete(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LoweringError(f"{what} must be a positive int, got {v!r}")
    return v


def _key(k) -> str:
    if isinstance(k, Axis):
        return k.name
    if isinstance(k, str):
        return k
    raise LoweringError(f"tiles keys are axes or block-size symbols (str), got {k!r}")


def _threads(threads) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise LoweringError(f"threads must be an int from 1 to {MAX_THREADS} (threads per block), "
                            f"got {threads!r}")
    return threads


def _fit(n: int, v: int, k: int, what: str) -> int:
    """``v`` rounded down to a multiple of ``k`` (``require``), at least ``k``, at most ``n``."""
    if k <= 1:
        return max(1, min(v, n))
    if k > n:
        raise LoweringError(f"{what}: require() asks for a multiple of {k}, but the axis has only {n} "
                            f"elements; no block size fits")
    return max(k, min(v, n) // k * k)


def _check_required(name: str, v: int, req: dict, what: str) -> None:
    k = req.get(name, 1)
    if v % k:
        raise LoweringError(f"{what} {v} for axis {name} is not a multiple of {k} (require({name}, {k}))")


def _fused(d: Diagram, axis: str) -> Diagram:
    return fuse_norm_contract(fuse_softmax_contract(d, axis), axis)


def _fused_plan(d0: Diagram, axis: str):
    """The stream plan of ``axis`` after fusing its normalised contractions (or the error that
    fusing raised), once per diagram: :func:`analyse` and :func:`_chunk` both read it."""
    def compute():
        try:
            return stream_plan(_fused(d0, axis), axis)
        except NapkinError as e:
            return e
    return d0.memo(("lowering.fused_stream_plan", axis), compute)


def analyse(d0: Diagram):
    """(tileable axes, streamable axes, batch axes, main axes) of an unrelabelled diagram."""
    return d0.memo(("lowering.analyse",), lambda: _analyse(d0))


def _analyse(d0: Diagram):
    names = [a.name for a in d0.axes]
    tileable = [a for a in names if tile_problem(d0, a) is None]
    streamable = []
    for a in names:
        if a in tileable:
            continue
        plan = _fused_plan(d0, a)
        if not isinstance(plan, (str, NapkinError)) and plan.accumulators:
            streamable.append(a)
    main = []
    rank = max((len(arr.axis_names) for arr in d0.cod), default=0)
    for arr in d0.cod:   # the widest outputs' last two axes (O[b h q d], not L[b h q])
        if len(arr.axis_names) < rank:
            continue
        for a in arr.axis_names[-2:]:
            if a in tileable and a not in main:
                main.append(a)
    main += _gemm_columns(d0, tileable, main)
    types = d0.var_types()
    everywhere = [a for a in tileable
                  if all(all(types[v].has(a) for v in d0.eqn_outputs(k)) for k in range(len(d0.eqns)))]
    batch = [a for a in tileable if a not in main and a in everywhere]
    return tileable, streamable, batch, main


def _gemm_columns(d0: Diagram, tileable, main) -> list[str]:
    """The other side of an implicit GEMM whose main axes all come from one operand: a
    convolution ``Y[b o ho wo] = X[b c ho kh wo kw] W[o c kh kw]`` tiles ``ho, wo`` (rows,
    from ``X``) and also ``o`` (columns, from ``W``), so a block reuses its ``X`` tile for a
    tile of output channels instead of re-reading ``X`` once per channel."""
    out = []
    for e in d0.eqns:
        if e.box.kind != "contract" or len(e.box.dom) != 2:
            continue
        kept = e.box.cod[0].axis_names
        sides = [set(x.axis_names) & set(kept) for x in e.box.dom]
        own = [s - sides[1 - i] for i, s in enumerate(sides)]   # axes of one operand only
        for i in (0, 1):
            if main and all(a in own[i] for a in main):
                cols = [a for a in kept if a in own[1 - i] and a in tileable and a not in main + out]
                out += cols[-1:]
    return out


def choose(d: Diagram, tiles: dict | None = None, threads: int | None = None,
           simulate: bool = False, hw=None) -> Schedule:
    """Complete ``d``'s schedule (see the module docstring)."""
    missing = unbound_axes(d)
    if missing:
        raise LoweringError(f"cannot lower {d.short()}: axes {', '.join(missing)} have no size; "
                            f"bind them first, e.g. d.bind({{{', '.join(repr(m) + ': n' for m in missing)}}})")
    if tiles is not None and not isinstance(tiles, dict):
        raise LoweringError(f"tiles must be a dict {{axis or symbol: size}}, got {type(tiles).__name__}")
    tiles = {_key(k): v for k, v in (tiles or {}).items()}
    for key, v in tiles.items():
        _concrete(v, f"tiles[{key!r}]")
    d0 = d.unrelabelled()
    T = _threads(threads) if threads is not None else (
        SIM_THREADS if simulate else _tensor_core_threads(d0) or GPU_THREADS)
    req = requirements(d)
    tileable, streamable, batch, main = analyse(d0)
    has_blocks = any(r.op in ("tile", "stream") for r in d.schedule)
    how = "given"
    chosen: dict[str, int] = {}
    if not has_blocks:
        d, how, chosen = _build(d, d0, tiles, tileable, streamable, main, simulate, T, hw)
    else:
        d, how, chosen = _resolve_symbols(d, d0, tiles, simulate, T, hw)
    tiled = {r.axis for r in d.schedule if r.op == "tile"}
    streamed = {r.axis for r in d.schedule if r.op == "stream"}
    added = []
    for a in tileable:
        if a in tiled or a in streamed:
            continue
        if a in batch:
            k = req.get(a, 1)
            try:
                d = d.tile(a, _fit(d0.axis(a).size, k, k, f"grid dimension {a}"))
            except NapkinError as e:
                raise LoweringError(f"cannot make {a} a grid dimension: {e}") from None
            if k == 1:
                added.append(a)
    for r in d.schedule:
        if r.op in ("tile", "stream") and not isinstance(r.size, int):
            raise LoweringError(f"{r.op} size {r.size!r} of axis {r.axis} is still symbolic")
    try:
        check_blocks(d, {})
    except NapkinError as e:
        raise LoweringError(f"cannot lower {d.short()}: {e}") from None
    d, notes, ff = _hoist_slice_streams(d)
    return Schedule(d, tuple(added), T, how, chosen, notes, ff)


def _loop_order(d: Diagram) -> list[str]:
    """The stream axes of ``d`` outer first, as :func:`napkin_cat.relabel.loopnest.final_form` nests them."""
    streams = [r.axis for r in d.schedule if r.op == "stream"]
    order_r = [r for r in d.schedule if r.op == "order"]
    if order_r:
        rank = {n: i for i, n in enumerate(order_r[-1].extra)}
        streams.sort(key=lambda a: rank.get(a, len(rank)))
    return list(dict.fromkeys(streams))


def _final_form(d: Diagram) -> FinalForm:
    from ..relabel.loopnest import final_form
    try:
        return final_form(d)
    except NapkinError as e:
        raise LoweringError(f"cannot lower {d.short()}: {e}") from None


def slice_streams(d: Diagram, ff: FinalForm | None = None) -> list[tuple[str, str]]:
    """``(inner, outer)`` stream axes where the ``inner`` loop, nested in the ``outer`` one,
    updates an accumulator initialised outside it (one slice of its states per chunk);
    ``ff``: the final form of ``d``, when the caller has it."""
    from ..relabel.loopnest import Init, Update
    ff = _final_form(d) if ff is None else ff
    init_at = {}
    for n, loops in ff.walk():
        if isinstance(n, Init):
            init_at[n.acc] = loops
    found = []
    for n, loops in ff.walk():
        if not isinstance(n, Update):
            continue
        outer = init_at.get(n.acc, ())
        acc = ff.accumulators[n.acc]
        for lp in loops[len(outer):]:
            if lp.kind == "stream" and acc.slice_updates(lp.axis) and (lp.axis, acc.axis) not in found:
                found.append((lp.axis, acc.axis))
    return found


def _hoist_slice_streams(d: Diagram) -> tuple[Diagram, list[str], FinalForm]:
    """Stream loops that update an enclosing accumulator slice by slice go outside it (see the
    module docstring); the numba.cuda kernel keeps accumulator states at the extent of the loops
    around their initialisation.  Returns the diagram, notes and its final form."""
    notes = []
    explicit = any(r.op == "order" for r in d.schedule)
    for _ in range(8):
        ff = _final_form(d)
        pairs = slice_streams(d, ff)
        if not pairs:
            break
        inner, outer = pairs[0]
        if explicit:
            raise LoweringError(
                f"order(...) nests stream {inner} inside stream {outer}, whose accumulator it then updates "
                f"one {inner}-chunk slice at a time (its states carry {inner} at full size); the numba.cuda "
                f"lowering keeps accumulator states at the extent of the loops around them: use "
                f"order({inner!r}, {outer!r})")
        axes = _loop_order(d)
        axes.remove(inner)
        axes.insert(axes.index(outer), inner)
        try:
            d = d.order(*axes)
        except NapkinError as e:
            raise LoweringError(f"cannot reorder stream {inner} outside stream {outer}: {e}") from None
        notes.append(f"Loop order: stream {inner} hoisted outside stream {outer} (order{tuple(axes)}): "
                     f"nested inside, it would update a slice of {outer}'s accumulator per chunk.")
    else:  # pragma: no cover - each step moves one loop outwards
        raise LoweringError(f"cannot order the stream loops of {d.short()}")
    return d, notes, ff


def _chunk(d0: Diagram, axis: str, simulate: bool) -> int:
    plan = _fused_plan(d0, axis)
    if isinstance(plan, NapkinError):
        raise plan
    rules, n = {a.rule for a in plan.accumulators}, d0.axis(axis).size
    if simulate:
        return min(n, 3)
    # tensor cores: 64 when two or more accumulators share the stream (FA2's dK, dV kernel, H100);
    if _tensor_cores(d0) and kernel_dtype(d0) == "f32":   # 3xTF32: 32, 16 past d = 64 (H100, BENCHMARKS)
        return min(n, 16 if _widest(d0, axis) > 64 else 32)
    mma = (64 if len(plan.accumulators) >= 2 else 32) if _tensor_cores(d0) else 16
    online = rules & {"online_softmax", "normalized", "logsumexp"} and (forward_chunk(d0, simulate, planner.WGMMA) or 64)
    return min(n, online or mma)


def _heuristic_tile(d0: Diagram, axis: str, main: list[str], simulate: bool, T: int = GPU_THREADS) -> int:
    n = d0.axis(axis).size
    if simulate:
        return min(n, 4)
    if _tensor_cores(d0) and len(main) < 2:
        # tensor cores: 16 rows per warp and row tile, two per warp when the contractions are narrow
        # (d <= 64) on at most 4 warps (H100), or on the warpgroup forward's 8; one for 3xTF32 (spills
        # at two, ptxas); one under a band mask keeping few entries (shorter_rows_pay)
        warps = max(1, T // 32)
        one = (_widest(d0, axis) > 64 or warps > 4 or kernel_dtype(d0) == "f32" or shorter_rows_pay(
            d0, axis, 32 * warps)) and not (T == 256 and warpgroup_forward(d0, simulate, planner.WGMMA) == 256)
        return min(n, 16 * warps * (1 if one else 2))
    return min(n, 128 if len(main) >= 2 else 64)


def _widest(d0: Diagram, axis: str) -> int:   # another computed axis of at most 256: the head dimension
    return max((a.size for a in computed_axes(d0, 256) if a.name != axis), default=0)


def _tensor_cores(d0: Diagram) -> bool:
    """Tensor cores: 16-bit inputs, or fp32 ones by 3xTF32 (:data:`.planner.TF32X3`)."""
    return kernel_dtype(d0) != "f32" or planner.TF32X3


def _tensor_core_threads(d0: Diagram) -> int | None:
    """Threads of a tensor-core kernel: the warpgroup forward's, 4 warps with a normalisation
    (row statistics in registers), 8 for the rest; None for fp32 on CUDA cores."""
    if not _tensor_cores(d0):
        return None
    norm = any(e.box.kind in ("softmax", "normalize", "softmax_contract") for e in d0.eqns)
    return (warpgroup_forward(d0, False, planner.WGMMA) or 128) if norm else GPU_THREADS


def _row_tiles(d0: Diagram, free: list[str], tileable: list[str], given: dict, simulate: bool, T: int) -> dict:
    """Tiles of the ``free`` axes when nothing streams.  A block holds whole the axes that cannot
    be tiled (a reduction's row: one block-level reduction); the threads left over by the row
    (``T // row`` elements of the tiled axes, at least one) are shared among the ``free`` axes
    innermost first (the outputs' last axis: coalesced), the ``given`` tiles counted.  An
    elementwise map holds no row: about ``T`` elements per block, not one."""
    sizes = {a.name: a.size for a in d0.axes if isinstance(a.size, int)}
    if simulate:
        return {a: min(sizes.get(a, 2), 2) for a in free}
    row = math.prod(n for a, n in sizes.items() if a not in tileable) or 1
    budget = max(1, T // row if row < T else 1)
    for a, n in given.items():
        if a in tileable:
            budget = max(1, budget // max(1, int(n)))
    inner = [n for arr in d0.cod for n in reversed(arr.axis_names)]
    order = sorted(free, key=lambda a: inner.index(a) if a in inner else len(inner))
    out = {}
    for a in order:
        out[a] = max(1, min(sizes.get(a, 1), budget))
        budget = max(1, budget // out[a])
    return out


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def _build(d: Diagram, d0: Diagram, tiles: dict, tileable, streamable, main, simulate, T, hw):
    req = requirements(d)
    chosen: dict[str, int] = {}
    out = d0
    for a, k in req.items():   # keep the requirements on the diagram that is lowered
        out = out.require(a, k)
    size = lambda a: d0.axis(a).size
    for a in streamable:
        s = tiles.get(a)
        chosen[a] = (_concrete(s, f"chunk of {a}") if s is not None
                     else _fit(size(a), _chunk(d0, a, simulate), req.get(a, 1), f"chunk of {a}"))
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
    for a in tiles:
        _check_required(a, chosen[a], req, "tiles size")
    free = [a for a in main if a not in chosen]
    how = "given" if not free else "heuristic"
    if free:
        if not streamable:
            chosen.update(_row_tiles(d0, free, tileable, chosen, simulate, T))
            how = "heuristic (rows per block)"
        else:
            best = None if simulate or (_tensor_cores(d0) and len(free) < 2) else \
                _cost_tiles(d0, free, chosen, streamable, T, hw)
            if best:
                chosen.update(best)
                how = "cost model (SMEM budget), rounded to the thread mapping"
            else:
                for a in free:
                    chosen[a] = _heuristic_tile(d0, a, main, simulate, T)
        if not simulate and not _tensor_cores(d0) and _fill_device(d0, free, chosen, streamable, hw):
            how += ", halved until the grid fills the device"
        for a in free:
            chosen[a] = _fit(size(a), chosen[a], req.get(a, 1), f"tile of {a}")
        if any(req.get(a, 1) > 1 for a in free):
            how += f", rounded to the required multiples ({', '.join(f'{a}: {k}' for a, k in req.items())})"
    # the stream loops nest in the order they are applied: the first order the loop nest accepts
    # (an accumulator's loop outside the loops of accumulators that read its result)
    from ..relabel.loopnest import final_form
    first_error = None
    one = _one_stream_per_contraction(d0, streamable, size)
    orders = [p for p in itertools.permutations(one)][:24]
    orders += [p for p in itertools.permutations(streamable) if p not in orders][:24 - len(orders)]
    if any(remaps(e.box) for e in d0.eqns):   # convolutions: stream one axis, sum the rest in the block
        orders += [(a,) for a in sorted(streamable, key=lambda a: -size(a)) if (a,) not in orders]
    for order_ in orders:
        try:
            cand = out
            for a in order_:
                cand = cand.stream(a, chosen[a])
            for a in tileable:
                if a in chosen:
                    cand = cand.tile(a, chosen[a])
            ff = final_form(cand)
        except NapkinError as e:
            first_error = first_error or e
            continue
        return _registers_for_states(cand, ff), how, chosen
    raise LoweringError(f"cannot relabel {d.short()} for lowering: {first_error}")


def _one_stream_per_contraction(d0: Diagram, streamable, size) -> tuple:
    """``streamable`` less all but the longest of the axes one contraction sums over (a
    convolution's ``c, kh, kw``): the lowering streams one axis per accumulator and sums the
    others inside the block."""
    drop = set()
    for e in d0.eqns:
        if e.box.kind == "contract":
            out = set(e.box.cod[0].axis_names)
            red = [a for a in streamable if a not in out and any(a in x.axis_names for x in e.box.dom)]
            drop |= set(sorted(red, key=lambda a: -size(a))[1:])
    return tuple(a for a in streamable if a not in drop)


def _registers_for_states(d: Diagram, ff: FinalForm, skip=frozenset()) -> Diagram:
    """Main accumulator states of streamed contractions stay in the registers of the threads
    that own them (the update's thread mapping is fixed for the whole stream loop); ``ff``: the
    final form of ``d``; ``skip``: wires the user placed."""
    for acc in ff.accumulators:
        if acc.rule in ("sum_contract", "online_softmax", "normalized") and acc.box.cod[0].name not in skip:
            d = d.place(acc.box.cod[0].name, "registers")
    return d


def _resolve_symbols(d: Diagram, d0: Diagram, tiles: dict, simulate, T, hw):
    sched = []
    chosen = {}
    how = "given"
    req = requirements(d)
    tileable, _, _, main = analyse(d0)
    blocks = [r for r in d.schedule if r.op in ("tile", "stream")]
    symbols = {r.size for r in blocks if isinstance(r.size, str)}
    axes = {r.axis for r in blocks}
    unknown = [key for key in tiles if key not in symbols and key not in axes]
    if unknown:
        names = [a.name for a in d0.axes]
        what = ", ".join(f"{key!r} ({'an axis of the diagram that is neither tiled nor streamed' if key in names else 'no axis or block symbol of the diagram'})"
                         for key in unknown)
        raise LoweringError(f"tiles names {what}; {d.short()} is already relabelled "
                            f"({d._sched_str()}): tiles sets its block symbols {sorted(symbols)} or "
                            f"repeats the block size of its axes {sorted(axes)}")
    for r in blocks:
        if isinstance(r.size, int) and r.axis in tiles and tiles[r.axis] != r.size:
            raise LoweringError(f"tiles gives {r.axis}: {tiles[r.axis]}, but the diagram already "
                                f"{'tiles' if r.op == 'tile' else 'streams'} {r.axis} by {r.size} "
                                f"({r.op}({r.axis}, {r.size})); relabel the unrelabelled diagram or "
                                f"drop the key")
    no_stream = not any(x.op == "stream" for x in d.schedule)
    rows = _row_tiles(d0, [r.axis for r in d.schedule if r.op == "tile" and isinstance(r.size, str)
                           and tiles.get(r.size, tiles.get(r.axis)) is None and r.size not in chosen],
                      tileable, {}, simulate, T) if no_stream else {}
    for r in d.schedule:
        if r.op in ("tile", "stream") and isinstance(r.size, str):
            if r.size in tiles and r.axis in tiles and tiles[r.size] != tiles[r.axis]:
                raise LoweringError(f"tiles gives the symbol {r.size}: {tiles[r.size]} and its axis "
                                    f"{r.axis}: {tiles[r.axis]}; give one")
            v = tiles.get(r.size, tiles.get(r.axis))
            if r.size in chosen:
                v = chosen[r.size] if v is None else v
            if v is None:
                if r.op == "stream":
                    v = _chunk(d0, r.axis, simulate)
                elif no_stream:
                    v = rows.get(r.axis) or _row_tiles(d0, [r.axis], tileable, {}, simulate, T)[r.axis]
                else:
                    v = _heuristic_tile(d0, r.axis, main, simulate, T)
                v = _fit(d0.axis(r.axis).size, v, req.get(r.axis, 1), f"{r.op} of {r.axis}")
                how = "heuristic"
            v = _concrete(v, f"{r.op} size {r.size}")
            if r.size in chosen and chosen[r.size] != v:
                raise LoweringError(f"block symbol {r.size} gets {chosen[r.size]} and {v}")
            _check_required(r.axis, v, req, f"{r.op} size {r.size} =")
            chosen[r.size] = v
            r = replace(r, size=v)
        sched.append(r)
    d = replace(d, schedule=tuple(sched))
    placed = {r.extra[0] for r in d.schedule if r.op == "place"}
    try:
        from ..relabel.loopnest import final_form
        ff = final_form(d)
    except NapkinError:
        return d, how, chosen     # check_blocks below names what is wrong
    # as for an unrelabelled diagram: accumulator states the user did not place stay in registers
    return _registers_for_states(d, ff, skip=placed), how, chosen


MIN_FILL_TILE = 16   # the thread mappings' granule: tiles are not halved below it to fill the grid


def _fill_device(d0: Diagram, free, chosen: dict, streamable, hw) -> bool:
    """Halve the largest of the ``free`` tiles (not below :data:`MIN_FILL_TILE`) while the grid
    has fewer than 90% as many blocks as the device has SMs: a 1024 x 512 output in tiles of
    128 x 128 is 32 blocks for 132 SMs, and a block per SM moves more bytes per second than the
    tiles' reuse saves.  Changes ``chosen``; returns whether it did."""
    from ..core.hardware import H100
    sms = (hw or H100).sms
    batch = analyse(d0)[2]

    def blocks() -> int:
        n = 1
        for a in d0.axes:
            if a.name in streamable:
                continue
            if a.name in chosen:
                n *= -(-a.size // chosen[a.name])
            elif a.name in batch:
                n *= a.size
        return n

    changed = False
    while 10 * blocks() < 9 * sms:
        big = [a for a in free if chosen[a] >= 2 * MIN_FILL_TILE]
        if not big:
            break
        a = max(big, key=lambda a: (chosen[a], -free.index(a)))
        chosen[a] //= 2
        changed = True
    return changed


def _cost_tiles(d0: Diagram, free, chosen, streamable, T, hw) -> dict | None:
    """Tile sizes from the cost model: fewest HBM->SMEM transfers with the SMEM memory under a
    per-block budget, then rounded down to powers of two the thread mapping covers."""
    from ..core.hardware import H100
    from ..costmodel.model import cost
    from ..costmodel.search import search
    from ..costmodel.usable import THREADS
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
        for a in analyse(d0)[2]:   # batch axes: grid dimensions of one (choose adds them)
            if a not in chosen and a not in names:
                sym = sym.tile(a, 1)
        c = cost(sym)
        sizes = {a.name: a.size for a in d0.axes}
        budget = int(hw.capacity("SMEM")) // 2 // 4   # values: half the opt-in shared memory
        # Cost.optimize's search for the sizes alone: its report (transfers, bound, gap) and
        # its second, unconstrained search are most of the time of planning a kernel
        try:
            best = search(c, sizes, None, None, "SMEM", None, budget, False, True, THREADS, tiles_only=True)
        except NapkinError:
            # no multiple of 16 fits (a convolution's rows: each output row reads kh*kw
            # input values per channel): the optimum over every integer, rounded down below
            best = search(c, sizes, None, None, "SMEM", None, budget, False, False, THREADS, tiles_only=True)
    except NapkinError:
        return None
    out = {}
    limit = 8 * math.isqrt(T) if len(free) >= 2 else 128
    for a in free:
        v = best.get(names[a])
        if not isinstance(v, int) or v < 1:
            return None
        out[a] = max(1, min(_pow2_floor(v), limit, _pow2_floor(d0.axis(a).size) if d0.axis(a).size >= 1 else 1))
    return out
