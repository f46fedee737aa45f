"""Beyond one GPU: what crosses the link between devices, and when the ring waits for it.

A split over the devices (``tile(q, DEVICES)``, ``stream(x, DEVICES)``) gives each of the
``devices`` GPUs one block of the axis, in its own HBM.  Arrays start where the split puts them:

* an input carrying the tiled axis is sharded (each device holds its block), and so is an
  output: nothing crosses the link;
* an input carrying the streamed axis but not the tiled one rotates around the ring: each device
  holds one block and receives the ``devices - 1`` it lacks, one per step, so the ring moves
  ``(devices - 1) x`` its size over the link in all;
* with a stream over the devices and no tile, each device folds its own block into a partial
  state, and the partial states are all-gathered and merged by the accumulator, every device
  receiving the ``devices - 1`` it lacks (``(O, L)``: the main state and one row statistic);
* any other input is replicated: every device holds all of it.

The moves are counted once per device and ring step, whatever the relabelings inside a device:
the runtime runs a device's whole kernel on each block it holds (the ring is the outermost loop
on each device; the row tiles inside are independent, so this is the same computation).

:func:`device_time` reads a ring off the cost: per step a device computes ``1/devices^2`` of the
work while the next block travels (``bytes / link bandwidth + latency``), overlapped; the ring
is *bandwidth-bound* when a step's transfer outlasts its compute.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> ring = nc.library.attention(q=q, x=x, d=d).tile(q, "devices").stream(x, "devices")
>>> nc.cost(ring).transfers["NVLink"]
2*d*devices*x - 2*d*x
>>> t = nc.cost(ring).devices(nc.hardware.H200, {q: 2 ** 16, x: 2 ** 16, d: 64, "devices": 2})
>>> t.bandwidth_bound, round(t.compute_step / t.link_step, 1)      # fp32 on CUDA cores
(False, 97.2)
>>> nc.cost(ring).devices(nc.hardware.H200, {q: 2048, x: 2048, d: 64, "devices": 2}).bandwidth_bound
True

Under a mask the devices' shares differ: :func:`~napkin_cat.relabel.balance.kept_tiles` counts,
per device, the tiles it keeps (its query pieces against every key piece, cut into the tiles of
its relabelings inside a device, less those a mask on the ring's stream removes whole).  The
cost model counts the loops of a device split dense (:mod:`.skips`); the timing is the busiest
device's: a dense device's compute times its kept tiles over the dense ones.  ``imbalance`` is
the largest count over the mean: a causal ring laid out contiguously makes the last device do
nearly twice the mean, zig-zag (``order="zigzag"``) makes them equal.

>>> causal = nc.library.attention(q=q, x=x, d=d, causal=True)
>>> sizes = {q: 4096, x: 4096, d: 64, "devices": 4, "s": 256, "g": 256}
>>> for order in ("contiguous", "zigzag"):
...     r = causal.tile(q, "devices", order=order).stream(x, "devices", order=order).stream(x, "s").tile(q, "g")
...     t = nc.cost(r).devices(nc.hardware.H200, sizes)
...     print(order, t.tiles, round(t.imbalance, 2))
contiguous (10, 26, 42, 58) 1.71
zigzag (34, 34, 34, 34) 1.0
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..core.diagram import DType, f32
from ..core.errors import CostError, ShapeError
from ..core.hierarchy import DEVICES, LINK
from ..relabel.balance import kept_tiles, ring_skips
from ..relabel.loopnest import FinalForm, Loop
from ..relabel.symbols import size_expr, size_symbol
from .records import ZERO, Move, check_hw


def device_loops(ff: FinalForm) -> dict[str, Loop]:
    """``{"grid": loop, "stream": loop}`` of the splits over the devices in ``ff``."""
    return {lp.kind: lp for lp in ff.loops if lp.step == DEVICES}


def link_moves(ff: FinalForm) -> list[Move]:
    """The moves over the link (:data:`~napkin_cat.core.hierarchy.LINK` -> ``HBM``) of ``ff``."""
    loops = device_loops(ff)
    if "stream" not in loops:
        return []
    p = size_symbol(DEVICES)
    dd = ff.diagram
    tiled = loops["grid"].axis if "grid" in loops else None
    ring = loops["stream"].axis
    moves = []
    if tiled is not None:
        for arr in dd.dom:
            if arr.has(ring) and not arr.has(tiled):
                size = sp.Mul(*(size_expr(a.size) for a in arr.axes)) / p
                moves.append(Move("link", arr.name, arr.dtype, LINK, "HBM", size, p * (p - 1), p * (p - 1),
                                  (tiled, ring)))
        return moves
    for acc in ff.accumulators:
        if acc.axis != ring:
            continue
        stats = [(n, axes_) for n, axes_, role in acc.states() if role != "main"]
        sent = [(acc.box.cod[0].name, axes_, acc.box.cod[0].dtype) for n, axes_, role in acc.states()
                if role == "main"] + [("L", axes_, f32) for n, axes_ in stats[:1]]
        for name, axes_, dt in sent:
            size = sp.Mul(*(ff.extent(a, ()) for a in axes_)) if axes_ else sp.Integer(1)
            moves.append(Move("link", name, dt, LINK, "HBM", size, p * (p - 1), p * (p - 1), (ring,)))
    return moves


@dataclass(frozen=True)
class DeviceTiming:
    """A split over ``devices`` GPUs, per device: ``compute_step`` (seconds of one block's work),
    ``link_step`` (one block over the link, latency included), ``steps`` (blocks per device),
    ``seconds`` (compute overlapped with the transfers: the first step's compute, then each later
    step the longer of the two), ``link_seconds`` (the transfers alone) and
    ``bandwidth_bound`` (a step waits for its block); under a mask on the ring, ``tiles``
    (the tiles each device keeps, of ``dense_tiles`` each) and ``imbalance`` (the largest over
    the mean); the compute above is then the busiest device's."""

    devices: int
    compute_step: float
    link_step: float
    steps: int
    seconds: float
    link_seconds: float
    link_bytes_per_device: float
    bandwidth_bound: bool
    hardware: str
    tiles: tuple[int, ...] = ()
    dense_tiles: int = 0
    imbalance: float = 1.0


def device_time(cost, hw, sizes: dict, dtype: DType | None = None, *, ops=None,
                accumulators: bool = False) -> DeviceTiming:
    """Per-device timing of a split over the devices (see the module docstring): compute at
    the roofline of one GPU (:meth:`Cost.time`'s rates), link bytes at ``hw.link_bandwidth``.

    ``ops``: the work a device does, split as the forward's (default ``cost.ops``; the backward
    passes its own, :mod:`.backward_links`).  ``accumulators``: the ring's blocks travel with
    the accumulators of their gradients (as many bytes again per step, overlapped with the
    compute like the blocks), and after the last step each accumulator makes one more hop home."""
    ops = cost.ops if ops is None else ops
    check_hw(hw, "devices")
    loops = device_loops(cost.form)
    if not loops:
        raise CostError(f"devices: {cost.diagram.short()} is not split over the devices "
                        f"(tile(axis, {DEVICES!r}) or stream(axis, {DEVICES!r}))")
    if hw.link_bandwidth is None:
        raise CostError(f"devices: {hw.name} has no link bandwidth; profiles with one: H100, H200")
    if DEVICES not in {str(k) for k in sizes}:
        raise CostError(f"devices: pass the number of devices, sizes={{..., {DEVICES!r}: 2}}")
    subs = cost._subs(sizes)
    p = int(subs[size_symbol(DEVICES)])
    sym = [s for s in set().union(*(sp.sympify(o.total).free_symbols for o in ops)) if s not in subs]
    if sym:
        raise CostError(f"devices: sizes for {sorted(map(str, sym))} are needed (block sizes too)")
    work = {}
    for o in ops:
        prec = max((dt for _, dt in o.precision), key=lambda t: t.bytes, default=f32)
        prec = dtype or prec
        work[o.unit] = work.get(o.unit, 0.0) + float(o.total.subs(subs)) / hw.rate(o.unit, prec)
    steps = p if "stream" in loops and "grid" in loops else 1
    tiles, dense, imbalance, busiest = (), 0, 1.0, 1.0
    if ring_skips(cost.diagram):        # a mask on the ring: the devices' shares differ
        try:
            tiles = kept_tiles(cost.diagram, {**sizes, DEVICES: p})
            dense = kept_tiles(cost.diagram, {**sizes, DEVICES: p}, masked=False)[0]
        except ShapeError as e:
            raise CostError(f"devices: {e}") from None
        imbalance = max(tiles) * len(tiles) / sum(tiles) if sum(tiles) else 1.0
        busiest = max(tiles) / dense
    compute_step = max(work.values(), default=0.0) / (p * steps) * busiest
    link_bytes = float(sum((m.values * (dtype or m.dtype).bytes for m in cost.moves if m.upper == LINK),
                           ZERO).subs(subs)) / p
    messages = (p - 1) if link_bytes else 0
    link_step = link_bytes / messages / hw.link_bandwidth + hw.link_latency if messages else 0.0
    if accumulators:
        if steps == 1:
            raise CostError(f"devices: {cost.diagram.short()} is not a ring (tile and stream over the devices); "
                            f"the backward's timing covers the ring, whose gradient accumulators travel")
        hop = link_step                       # an accumulator: the gradients of the block, its size
        link_bytes += link_bytes / messages * p
        step = link_step + hop                # the next block and the held block's accumulator
        seconds = compute_step + (steps - 1) * max(compute_step, step) + hop
        return DeviceTiming(p, compute_step, step, steps, seconds, messages * link_step + p * hop, link_bytes,
                            step > compute_step, hw.name, tiles, dense, imbalance)
    if steps > 1:
        seconds = compute_step + (steps - 1) * max(compute_step, link_step)
    else:
        seconds = compute_step + messages * link_step
    return DeviceTiming(p, compute_step, link_step, steps, seconds, messages * link_step, link_bytes,
                        link_step > compute_step, hw.name, tiles, dense, imbalance)
