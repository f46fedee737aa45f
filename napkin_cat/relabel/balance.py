"""Work per device of a split over the devices: the tiles each device keeps under its masks.

A ring (``tile(q, DEVICES).stream(x, DEVICES)``) runs, on device ``r``, every pair of its query
pieces and the key pieces of each device (:mod:`.devices`), cut inside the device into the
tiles of its own relabelings (``tile(q, g)``, ``stream(x, s)``).  A tile a mask on the ring's
stream removes whole is skipped (:func:`ring_skips`, the masks of :func:`~.skipping.chunk_skips`
on that stream), so under a causal mask the contiguous layout leaves the first device idle
while the last one keeps every tile, and the zig-zag layout evens them out.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> causal = nc.library.attention(q=q, x=x, d=d, causal=True)
>>> ring = causal.tile(q, "devices").stream(x, "devices")
>>> zig = causal.tile(q, "devices", order="zigzag").stream(x, "devices", order="zigzag")
>>> sizes = {"q": 64, "x": 64, "d": 8, "devices": 4}
>>> kept_tiles(ring.tile(q, 8).stream(x, 8), sizes), kept_tiles(zig.tile(q, 8).stream(x, 8), sizes)
((3, 7, 11, 15), (9, 9, 9, 9))
"""

from __future__ import annotations

from ..core.diagram import Diagram
from ..core.errors import CostError
from ..core.hierarchy import DEVICES
from .devices import block_state, layout_of, pieces
from .loopnest import final_form
from .rules import device_splits
from .skipping import chunk_skips


def ring_skips(d: Diagram) -> tuple:
    """The :class:`~.skipping.Skip` of the masks that empty a block of the stream over the
    devices (a mask on (tiled rows, streamed columns) feeding the online softmax)."""
    ff = final_form(d)
    loop = next((lp for lp in ff.loops if lp.step == DEVICES and lp.kind == "stream"), None)
    # the ring's blocks are read in the mask's (row, column) order: a transposed skip (a stream
    # over the mask's rows) is left to the executor and the kernel, which skip it exactly
    return () if loop is None else tuple(s for s in chunk_skips(ff, loop) if not s.transposed)


def _inner(d: Diagram, op: str, axis: str | None, sizes: dict) -> int | None:
    """The first block size of ``op(axis, ...)`` inside a device, resolved from ``sizes``."""
    for r in d.schedule:
        if r.op == op and r.axis == axis and r.size != DEVICES:
            s = sizes.get(r.size, r.size) if isinstance(r.size, str) else r.size
            if not isinstance(s, int):
                raise CostError(f"kept_tiles: the block size {r.size} of {op}({axis}, {r.size}) is needed: "
                                f"sizes={{..., {r.size!r}: n}}")
            return s
    return None


def _cut(piece: tuple[int, int], block: int | None):
    s, n = piece
    step = block or n
    return [(a, min(a + step, s + n)) for a in range(s, s + n, step)]


def kept_tiles(d: Diagram, sizes: dict, masked: bool = True) -> tuple[int, ...]:
    """Per device, the (query tile, key tile) pairs it computes over a whole run of ``d`` (a
    split over the devices), at concrete ``sizes`` (axis names or :class:`Axis` keys, the
    number of devices under ``"devices"``, block sizes by their symbols); ``masked=False``:
    every pair, as if no mask skipped any."""
    sizes = {getattr(k, "name", k): int(v) for k, v in sizes.items()}
    splits = device_splits(d)
    if not splits:
        raise CostError(f"kept_tiles: {d.short()} is not split over the devices")
    if DEVICES not in sizes:
        raise CostError(f"kept_tiles: pass the number of devices, sizes={{..., {DEVICES!r}: 2}}")
    world = sizes[DEVICES]
    tiled, ring = splits.get("tile"), splits.get("stream")
    for a in (tiled, ring):
        if a is not None and a not in sizes:
            size = d.axis(a).size
            if not isinstance(size, int):
                raise CostError(f"kept_tiles: the size of axis {a} is needed: sizes={{..., {a!r}: n}}")
            sizes[a] = size
    g, s = _inner(d, "tile", tiled, sizes), _inner(d, "stream", ring, sizes)
    skips = ring_skips(d) if masked else ()

    def mine(axis, rank):
        if axis is None:
            return [(0, 1)]
        return pieces(layout_of(d, axis), sizes[axis], world, rank)

    out = []
    for r in range(world):
        rows = [t for p in mine(tiled, r) for t in _cut(p, g)]
        sources = [(r - t) % world for t in range(world)] if tiled and ring else [r]
        cols = [t for src in sources for p in mine(ring, src) for t in _cut(p, s)]
        out.append(sum(1 for a in rows for b in cols
                       if not any(block_state(k.pred, a, b)[1] for k in skips)))
    return tuple(out)
