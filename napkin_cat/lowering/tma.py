"""The tensor memory accelerator (TMA, sm_90): a stream loop's chunks copied by
``cp.async.bulk.tensor``, one instruction a 64-column panel, completing on an ``mbarrier``.

Why (measured on an H200, fp16, N = 4096, B*H = 32; kernels/BENCHMARKS.md, "Seventh session of
2026-11-30"; ``kernels/probes/tma_copies.py`` rewrote the generated forward's text first): the
copying warpgroup issued 16-byte ``cp.async`` copies, through the load/store units and the queue
the computing warps' shuffles, ``wgmma`` issue and dQ's atomic adds share.  With TMA the d = 128
forward kernel ran 0.599 ms against 0.717 (FlexAttention 0.572), the one-kernel backward at d = 64
0.853 against 0.972 (1.150); forward + backward through ``nc.torch_op`` 1.03x FlexAttention at
d = 128 (0.91x before), 1.32x at d = 64 (1.18x).

Where (:func:`plan`): a 16-bit kernel's stream loop over :data:`MIN_STAGES` or more chunk buffers
(every chunk, or those a block table keeps), each of whose loads is either

- a 16-bit input read only as the column operand (B) of warpgroup MMAs whose warps hold all its
  columns (``Wn == 1``), its last axis whole and a multiple of 64, its rows (the streamed axis) a
  multiple of 8: laid out as TMA's 128-byte swizzle writes it (:attr:`.plan.Buffer.swizzle`),
  panels of 64 columns, each of the chunk's rows 128 bytes, the 16-byte units of row ``r``
  permuted by ``unit ^ r % 8`` (:func:`swizzled_index`), each panel on a 1024-byte boundary, read
  by ``wgmma`` descriptors of swizzle mode 1 (:func:`.wgmma.strides`, :func:`.wgmma.operand_bytes`);
  every other reader indexes it through :func:`swizzled_index`, so a kernel that ends up without
  its copying warpgroup fills it by ``cp.async`` correctly;
- or a row of the streamed axis whose chunk is a multiple of 128 bytes (the backward's ``L``,
  ``D``): copied as it is, no swizzle.

The protocol (:class:`.chunk_copies.Copies`, for every loop of :mod:`.producer`): the copying
warpgroup's first thread initialises one ``mbarrier`` per chunk buffer (a named barrier of the
warpgroup then orders that before any wait), and for each chunk arms the buffer's ``mbarrier`` with
the chunk's bytes (``mbarrier.arrive.expect_tx``) and issues the tensor copies; the whole warpgroup
waits on that ``mbarrier`` (its parity: how many times the buffer was filled before, mod 2) where
it waited for its ``cp.async`` groups, and hands the chunk over at the same named barriers.  TMA
writes through the async proxy that ``wgmma`` reads through: no ``fence.proxy.async``.

The tensor maps are made at launch (:func:`map_args`): ``cuTensorMapEncodeTiled`` over the input's
own shape, contiguous, as 16- or 32-bit words, boxes of the chunk's rows (by 64 columns), zeros
outside the array (a ragged chunk's rows); cached per kernel, input and address.  The kernel reads
each map from device memory (a parameter ``<input>_tmap`` after the outputs).  Under the simulator
the map is the array's dimensions, strides, box and swizzle, and the twins (:func:`sim_primitive`)
read the box when the copy is issued and land it when a thread waits for the phase it belongs to:
a missing wait, or one for the wrong phase, reads the buffer as it was.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, replace

import numpy as np

from ..relabel.loopnest import Load, Loop
from . import sim_waits

TMA = "auto"
"""TMA copies for the stream loops :func:`plan` finds eligible: ``True`` / ``"auto"`` (the same:
every eligible kernel was measured faster), ``False`` never (``cp.async``, as until the seventh
session of 2026-11-30)."""

TABLE_LOOPS = True
"""TMA copies for a stream loop whose chunks a block table skips too (the chunk's coordinates read
from the table, as the ``cp.async`` copies read them); ``False``: those keep ``cp.async``, as until
the first session of 2026-12-01."""

MIN_STAGES = 2
"""The fewest chunk buffers a stream loop copied by TMA has: 2 takes the one-kernel backward's
double buffer too, 3 the forwards' three buffers only."""

PANEL = 64
"""16-bit elements in one 128-byte swizzled row (and columns per tensor copy)."""

MAX_RANK = 5
PRIMITIVES = ("mbar_init", "mbar_fence_init", "mbar_expect", "mbar_wait",
              *(f"tma_load{r}" for r in range(1, MAX_RANK + 1)))
"""``mbar_init(smem, word, count)``, ``mbar_fence_init()``, ``mbar_expect(smem, word, nbytes)``,
``mbar_wait(smem, word, parity)`` (the ``mbarrier`` at word offset ``word`` of the shared array);
``tma_load{r}(smem16, dst, arr, tmap, c_0 .. c_{r-1}, smem, bar)``: the box of ``arr``'s map at
coordinates ``c`` (innermost axis first) into ``smem16[dst:]``, completing on the ``mbarrier`` at
word ``bar``."""

MBAR_KEY = ("mbar",)


@dataclass(frozen=True)
class TmaInput:
    """An input copied by TMA: its position, shape (outermost first) and box (rows, columns per
    copy, outermost first, 1 along every other axis)."""

    index: int
    shape: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: bool = True       # 128-byte swizzled panels (a 16-bit matrix); False: a row as it is
    nbytes: int = 2            # bytes an element


def swizzled_index(s: str, f: str, b, u) -> str:
    """The 16-bit element index of ``(s, f)`` in swizzled buffer ``b`` (rows ``s``, columns ``f``):
    ``(f // 64) P + s 64 + ((f % 64 // 8) ^ (s % 8)) 8 + f % 8``, ``P`` a panel's elements."""
    rows = -(-b.caps[0] // 8) * 8
    unit = f"((({f}) % {u(64)} // {u(8)}) ^ (({s}) % {u(8)}))"
    return (f"({f}) // {u(64)} * {u(rows * PANEL)} + ({s}) * {u(PANEL)} + {unit} * {u(8)} + ({f}) % {u(8)}")


# --------------------------------------------------------------------------- planning

def why_not(ff, ax, bufs, skips, stages: int, dtype: str, n_in: int, column_only) -> str | None:
    """Why the stream loop's chunks are not copied by TMA (None: they are; see the module);
    ``column_only(v)``: whether input ``v`` is read only as the column operand of warpgroup MMAs
    whose warps hold all its columns (:func:`.wgmma_plan.column_only`)."""
    if TMA not in (True, False, "auto"):
        raise ValueError(f"tma.TMA must be True, False or 'auto', got {TMA!r}")
    if not TMA:
        return "tma.TMA is off"
    if dtype not in ("f16", "bf16") or stages < max(2, MIN_STAGES):
        return "not a 16-bit kernel's stream loop over chunk buffers"
    loops = [n for n, _ in ff.walk() if isinstance(n, Loop) and n.kind == "stream"]
    if len(loops) != 1:
        return "not one stream loop"
    if not TABLE_LOOPS and any(s.pred.block_atoms() for s in skips.get(loops[0].axis, ())):
        return "chunks skipped by a block table (tma.TABLE_LOOPS is off)"
    lp = loops[0]
    loads = [n for n in lp.body if isinstance(n, Load)]
    types = ff.diagram.var_types()
    for n in loads:
        b, arr = bufs.get(("var", n.var)), types[n.var]
        if n.var < n_in and b is not None and b.axes == (lp.axis,) and arr.axis_names[-1] == lp.axis \
                and (b.bits * b.caps[0]) % 1024 == 0 and (b.bits * ax[lp.axis].size) % 128 == 0 and not b.pad \
                and len(arr.axis_names) <= MAX_RANK and arr.dtype.name in ("f32", "f16", "bf16") \
                and ax[lp.axis].cap <= 256:
            continue   # a row of the streamed axis, as it is (a logsumexp's chunk; a box is at most 256 long)
        if n.var >= n_in or b is None or not b.core or b.bits != 16 or len(b.axes) != 2 or b.axes[0] != lp.axis:
            return f"{arr}: not a 16-bit input chunk in core matrices over ({lp.axis}, ...) nor a row of 128-byte copies"
        f = b.axes[1]
        if arr.axis_names[-1] != f or ax[f].cap != ax[f].size or ax[f].cap % PANEL or b.caps[0] % 8 \
                or len(arr.axis_names) > MAX_RANK or ax[lp.axis].cap > 256:
            return f"{arr}: its last axis is not whole and a multiple of {PANEL}, or its rows not a multiple of 8"
        if not column_only(n.var):
            return f"{arr}: read other than as the column operand of warpgroup MMAs holding all its columns"
    return None if loads else "no loads in the stream loop"


def plan(ff, ax, bufs, skips, stages: int, dtype: str, n_in: int, column_only) -> dict:
    """``bufs`` with the stream loop's chunk buffers swizzled and an ``mbarrier`` per chunk buffer
    where :func:`why_not` finds nothing (the caller reassigns offsets: swizzled buffers on 1024 bytes)."""
    if why_not(ff, ax, bufs, skips, stages, dtype, n_in, column_only) is not None:
        return bufs
    from .plan import Buffer
    lp = next(n for n, _ in ff.walk() if isinstance(n, Loop) and n.kind == "stream")
    out = {}
    for key, b in bufs.items():
        if any(key == ("var", n.var) for n in lp.body if isinstance(n, Load)):
            b = (replace(b, tma=True, swizzle=True, what=b.what.replace(
                "(core matrices for wgmma)", "(128-byte swizzled panels, copied by TMA)")) if b.core
                 else replace(b, tma=True, what=b.what + " (copied by TMA)"))
        out[key] = b
    out[MBAR_KEY] = Buffer(MBAR_KEY, "mbar_s", ("_bars",), (2 * stages,), "an mbarrier per chunk buffer (TMA)")
    return out


def inputs(plan_) -> tuple[TmaInput, ...]:
    """The inputs a kernel of ``plan_`` copies by TMA (its map parameters, in order)."""
    if MBAR_KEY not in getattr(plan_, "buffers", {}):   # none planned (or no plan: a gather kernel)
        return ()
    types, out = plan_.dd.var_types(), []
    for key, b in plan_.buffers.items():
        if b.tma:
            arr = types[key[1]]
            box = tuple(b.caps[0] if a == b.axes[0] else PANEL if a == b.axes[-1] and b.swizzle else 1
                        for a in arr.axis_names)
            out.append(TmaInput(key[1], tuple(plan_.axes[a].size for a in arr.axis_names), box, b.swizzle,
                                4 if arr.dtype.name == "f32" else 2))
    return tuple(sorted(out, key=lambda t: t.index))


# --------------------------------------------------------------------------- emission

def copied(bufs) -> bool:
    """Whether any of the buffers ``bufs`` is copied by TMA (a plan's, or a stream loop's)."""
    return any(b.tma for b in bufs)


def map_name(em, v: int) -> str:
    return f"{em.garg(v)}_tmap"


def params(em) -> list[str]:
    """The map parameters of the kernel ``em`` writes: one per input it copies by TMA, where it did
    (a kernel planned for TMA but emitted without its copying warpgroup copies by ``cp.async``)."""
    return [map_name(em, t.index) for t in inputs(em.plan)] if getattr(em, "tma_used", False) else []


def init(em, stages: int, bar: int, threads: int, src) -> None:
    """The copying warpgroup's first thread initialises the ``mbarrier`` of each of ``stages`` chunk
    buffers; named barrier ``bar`` of its ``threads`` orders that before any of them waits there."""
    k = em.consts
    with src.block(f"if ptid == {k.u(0, 'U0')}:"):
        with src.block(f"for s in range({k.u(stages, f'U{stages}')}):"):
            src(f"mbar_init(smem, {_bar(em, 's')}, {k.u(1, 'U1')})")
        src("mbar_fence_init()")
    src(f"bar_named({k.u(bar, f'U{bar}')}, {k.u(threads, f'U{threads}')})  # the mbarriers are initialised "
        f"before the copying warpgroup waits there")


def _bar(em, copy: str) -> str:
    k = em.consts
    return f"{em.bufs[MBAR_KEY].name} + ({copy}) * {k.u(2, 'U2')}"


def issue_chunk(em, lp: Loop, loads, bufs, start: str, copy: str, src) -> None:
    """The copying warpgroup's first thread arms buffer ``copy``'s ``mbarrier`` with the chunk's
    bytes and issues the tensor copies of the chunk of ``lp`` at ``start``: one per 64-column panel
    of each input."""
    k = em.consts
    em.tma_used = True
    stride, base = em._copy_layout(bufs)
    nbytes = sum(b.bits // 8 * math.prod(b.caps) for b in bufs)
    with src.block(f"if ptid == {k.u(0, 'U0')}:  # one thread issues the chunk's tensor copies"):
        src(f"mbar_expect(smem, {_bar(em, copy)}, {k.u(nbytes)})")
        for n, b in zip(loads, bufs):
            arr = em.types[n.var]
            rows = -(-b.caps[0] // 8) * 8
            for p in range(b.caps[1] // PANEL if b.swizzle else 1):
                coords = []
                for a in reversed(arr.axis_names):
                    coords.append(start if a == lp.axis else k.u(p * PANEL) if a == b.axes[-1] else em.gidx(a, {}))
                dst = f"({base[b.name]} + ({copy}) * {stride[b.name]}) * {k.u(2, 'U2')}"
                if p:
                    dst += f" + {k.u(p * rows * PANEL)}"
                src(f"tma_load{len(coords)}(smem16, {dst}, {em.garg(n.var)}, {map_name(em, n.var)}, "
                    f"{', '.join(coords)}, smem, {_bar(em, copy)})")


def wait(em, copy: str, parity: str, src) -> None:
    """The copying warpgroup waits until buffer ``copy``'s chunk has landed (its ``mbarrier``'s
    phase of parity ``parity`` complete)."""
    src(f"mbar_wait(smem, {_bar(em, copy)}, {parity})  # the chunk's tensor copies have landed")


# --------------------------------------------------------------------------- launch

_DRIVER = {}


def _encode(ptr: int, t: TmaInput) -> bytes:
    """The 128-byte CUtensorMap of ``t`` at device address ``ptr`` (16- or 32-bit words, contiguous)."""
    import ctypes
    if "fn" not in _DRIVER:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        _DRIVER["fn"] = fn
    r = len(t.shape)
    dims = list(reversed(t.shape))
    strides = [t.nbytes * math.prod(dims[:i + 1]) for i in range(r - 1)]
    raw = (ctypes.c_uint8 * 256)()
    at = (ctypes.addressof(raw) + 63) // 64 * 64
    rc = _DRIVER["fn"](ctypes.c_void_p(at), {2: 1, 4: 2}[t.nbytes], r, ctypes.c_void_p(ptr),   # UINT16 / UINT32
                       (ctypes.c_uint64 * r)(*dims), (ctypes.c_uint64 * max(1, r - 1))(*strides),
                       (ctypes.c_uint32 * r)(*reversed(t.box)), (ctypes.c_uint32 * r)(*([1] * r)),
                       0, 3 if t.swizzle else 0, 2, 0)   # no interleave, 128-byte swizzle or none, L2 128 B
    if rc:
        from ..core.errors import LoweringError
        raise LoweringError(f"cuTensorMapEncodeTiled refused the map of input {t.index} {t.shape} "
                            f"(box {t.box}, address {ptr:#x}): CUresult {rc}")
    return ctypes.string_at(at, 128)


def sim_map(t: TmaInput) -> np.ndarray:
    """The simulator's map: rank, then dimensions, element strides and box, innermost first, then
    whether it swizzles."""
    dims = list(reversed(t.shape))
    strides = [math.prod(dims[:i]) for i in range(len(dims))]
    return np.array([len(dims), *dims, *strides, *reversed(t.box), int(t.swizzle)], dtype=np.int64)


MAX_CACHED = 256


def map_args(kernel, args: list, sim: bool) -> list:
    """The map arguments of ``kernel`` (:func:`inputs`) for its flat input arguments ``args``."""
    specs = getattr(kernel, "tma", ())
    if not specs:
        return []
    if sim:
        return [sim_map(t) for t in specs]
    return [device_map(kernel, t, int(args[t.index].__cuda_array_interface__["data"][0])) for t in specs]


def device_map(kernel, t: TmaInput, ptr: int):
    """``t``'s map for address ``ptr`` in device memory (made once per kernel, input and address)."""
    cache = kernel.__dict__.setdefault("_tma_maps", {})
    got = cache.get((t.index, ptr))
    if got is None:
        from numba import cuda
        if len(cache) >= MAX_CACHED:
            cache.clear()
        got = cache[t.index, ptr] = cuda.to_device(np.frombuffer(_encode(ptr, t), dtype=np.uint8))
    return got


def map_pointers(kernel, pointers: list) -> list[int]:
    """The device addresses of the maps for input addresses ``pointers`` (the torch fast path)."""
    return [int(device_map(kernel, t, pointers[t.index]).__cuda_array_interface__["data"][0])
            for t in getattr(kernel, "tma", ())]


# --------------------------------------------------------------------------- the simulator's twins

class _MBarrier:
    """An ``mbarrier``: a phase completes once its expected arrivals are in and its tensor copies
    have landed.  A copy lands only when a thread waits for the phase it belongs to (the copy
    engine may write any time before that wait returns), so a missing wait, or one for the wrong
    phase, reads the buffer as it was."""

    def __init__(self, count: int, name: str = "an mbarrier"):
        self.count, self.arrivals, self.tx, self.phase, self.pending = count, 0, 0, 0, []
        self.cv, self.name = threading.Condition(), name

    def _check(self) -> None:
        if self.arrivals == self.count and self.tx == 0 and not self.pending:
            self.arrivals, self.phase = 0, self.phase + 1
            self.cv.notify_all()

    def expect(self, nbytes: int) -> None:
        sim_waits.progress()
        with self.cv:
            self.arrivals += 1
            self.tx += nbytes
            if self.arrivals > self.count:
                raise RuntimeError("mbarrier: more arrivals than its count in one phase")
            self._check()
            self.cv.notify_all()

    def issue(self, land) -> None:
        """A tensor copy of the current phase: ``land()`` writes it and returns its bytes."""
        sim_waits.progress()
        with self.cv:
            self.pending.append(land)
            self.cv.notify_all()

    def _landed(self, parity: int) -> bool:
        """Whether the phase of ``parity`` has completed; waiting for the current one lands its copies."""
        if self.phase % 2 == parity:
            for land in self.pending:
                self.tx -= land()
            self.pending.clear()
            if self.tx < 0:
                raise RuntimeError("mbarrier: more bytes landed than were expected")
            self._check()
        return self.phase % 2 != parity

    def wait(self, parity: int) -> None:
        with self.cv:
            if not sim_waits.wait_for(self.cv, lambda: self._landed(parity), f"{self.name}, parity {parity}", 600,
                                      lambda: f"phase {self.phase}, {self.arrivals} of {self.count} arrivals",
                                      lambda: self.phase % 2 != parity or bool(self.pending)):   # copies: landed at its next look
                raise RuntimeError(f"mbarrier: phase of parity {parity} never completed")


_BARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def sim_primitive(name: str, context, per_launch):
    """The simulated twin of TMA primitive ``name`` (``context`` / ``per_launch``: the simulator's
    thread context and per-launch, per-block state, :mod:`.tensorcore`)."""
    def bar(word) -> _MBarrier:
        got = per_launch(_BARS, context(), ("mbar", int(word)), lambda: [None])
        if got[0] is None:
            raise RuntimeError(f"mbarrier at word {int(word)} used before mbar_init")
        return got[0]

    def mbar_init(smem, word, count):
        per_launch(_BARS, context(), ("mbar", int(word)), lambda: [None])[0] = _MBarrier(int(count), f"the mbarrier at word {int(word)}")
        return 0

    def mbar_expect(smem, word, nbytes):
        bar(word).expect(int(nbytes))
        return 0

    def mbar_wait(smem, word, parity):
        bar(word).wait(int(parity))
        return 0

    def tma_load(smem16, dst, arr, tmap, *rest):
        *coords, smem, word = rest
        r = int(tmap[0])
        dims, strides, box = tmap[1:1 + r], tmap[1 + r:1 + 2 * r], tmap[1 + 2 * r:1 + 3 * r]
        if len(coords) != r:
            raise RuntimeError(f"tma_load{len(coords)} on a map of rank {r}")
        idx = np.indices(tuple(int(v) for v in reversed(box)))            # outermost first
        pos = [int(c) + idx[r - 1 - i] for i, c in enumerate(coords)]     # innermost first
        inside = np.ones(idx.shape[1:], dtype=bool)
        flat = np.zeros(idx.shape[1:], dtype=np.int64)
        for i in range(r):
            inside &= (pos[i] >= 0) & (pos[i] < dims[i])
            flat += np.clip(pos[i], 0, dims[i] - 1) * strides[i]
        src_ = np.asarray(arr)
        vals = np.where(inside, src_[flat], 0).astype(src_.dtype).reshape(-1, int(box[0]))   # rows, read now
        raw = vals.view(np.uint8).reshape(vals.shape[0], -1)            # their bytes, row by row
        byte = 2 * int(dst) + np.arange(raw.shape[0])[:, None] * raw.shape[1] + np.arange(raw.shape[1])[None, :]
        if tmap[1 + 3 * r]:
            byte ^= ((byte >> 7) & 7) << 4                              # the 128-byte swizzle

        def land() -> int:
            np.asarray(smem16).view(np.uint8)[byte] = raw
            return raw.size

        bar(word).issue(land)
        return 0

    fns = {"mbar_init": mbar_init, "mbar_fence_init": lambda: 0, "mbar_expect": mbar_expect, "mbar_wait": mbar_wait}
    return fns.get(name, tma_load)
