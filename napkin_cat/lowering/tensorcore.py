"""Tensor-core and 16-bit primitives that generated kernels call, on a GPU and in the simulator.

A kernel whose float inputs are fp16 or bf16 (:data:`DTYPES`) reads them as 16-bit bit patterns
(``int16`` arrays: torch's bf16 has no array-interface type), computes in fp32 and multiplies on
tensor cores with ``mma.sync.m16n8k16`` (fp32 accumulators).  Its source imports, by name:

``mma_f16`` / ``mma_bf16``   ``(a0..a3, b0, b1, c0..c3) -> (d0..d3)``: one warp's
                              ``D = A B + C`` on a 16x16 A, 16x8 B, fp32 C/D fragment
``pack_f16`` / ``pack_bf16`` ``(lo, hi) -> uint32``: two fp32 values rounded into a pair
``h2f`` / ``bf2f``           a 16-bit pattern -> fp32
``f2h`` / ``f2bf``           fp32 -> a 16-bit pattern (round to nearest even)
``ldsm_x4`` / ``ldsm_x2``    ``(smem16, offset)`` -> fragments by ``ldmatrix`` (``_t``: transposed)
``pin``                      ``v -> v`` through an instruction the compiler keeps in place (a
                              fragment address formed beside its load, :class:`.emit_mma.LdMatrix`)
``cp_async16``               16 bytes global -> shared, asynchronously (``cp_async_wait_*``)

An fp32 kernel may multiply on tensor cores too, by 3xTF32 (:data:`TF32X3`, CUTLASS's "FastF32",
what SDPA's fp32 kernels do on sm_80+): ``pack_tf32x3(lo, hi) -> (big, small)`` splits two fp32
values into their tf32 parts (64-bit registers, ``lo`` in bits 0-31), and
``mma_tf32x3(a0b, a0s, ..., a3b, a3s, b0b, b0s, b1b, b1s, c0..c3)`` multiplies a 16-wide step as
two ``m16n8k8.tf32`` halves of three products each (``mma_tf32x3s``: staged, the products
summed apart from ``C`` and added by an fp32 add; the twins of both compute in float64).  The
fragments have the 16-bit ownership below (each half's reduced index permuted: its ``k' = t`` is
column ``2t``, ``k' = t + 4`` column ``2t + 1``), so every emitter path of the 16-bit engine that
packs values reads them unchanged.

On a GPU they are inline PTX in ``tensorcore.cu``, linked by numba-cuda (NVRTC) and inlined
into the kernel.  Under the CUDA simulator (which links no C++) they are Python with the same
arguments and results: ``mma_*`` exchanges the warp's fragments through shared memory and
multiplies the matrices the fragments hold, so a kernel's fragment indexing is checked by
the simulator exactly as the GPU would read it (:func:`fragment_layout`).

Fragment layout of ``m16n8k16`` (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
floating point type"), lane ``l``, ``g = l // 4``, ``t = l % 4``:

* A (16x16, row-major): ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``,
  ``a2 = A[g, 2t+8:2t+10]``, ``a3 = A[g+8, 2t+8:2t+10]`` (low half first);
* B (16x8, column-major): ``b0 = B[2t:2t+2, g]``, ``b1 = B[2t+8:2t+10, g]``;
* C, D (16x8): ``c0, c1 = C[g, 2t], C[g, 2t+1]``, ``c2, c3 = C[g+8, 2t], C[g+8, 2t+1]``.

>>> DTYPES["bf16"].mma, DTYPES["f16"].to_f32
('mma_bf16', 'h2f')
>>> layout = fragment_layout()
>>> layout["A"][0, 0], layout["A"][9, 10], layout["B"][9, 3], layout["C"][8, 1]
((0, 0, 0), (3, 5, 0), (1, 12, 1), (3, 0))
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ..ops.arrays import bf16_bits, bf16_values
from . import sim_waits

MMA_SHAPE = (16, 8, 16)
"""``(m, n, k)`` of one ``mma.sync``: a warp multiplies a 16 x 16 tile by a 16 x 8 one."""


@dataclass(frozen=True)
class TensorDType:
    """The primitives of one 16-bit input dtype (names importable from this module)."""

    name: str
    mma: str
    pack: str
    to_f32: str
    from_f32: str
    ptx: str           # the PTX type of the mma operands
    torch: str         # the torch dtype's name
    numpy: str | None  # numpy's dtype, where numpy has one (bf16: none)
    staged: str = ""   # the mma that adds C after its products by an fp32 add (3xTF32 only)


TF32X3 = TensorDType("f32", "mma_tf32x3", "pack_tf32x3", "", "", "tf32", "float32", "float32", "mma_tf32x3s")
"""fp32 operands multiplied by 3xTF32: a packed pair is two registers, its big and small parts."""

DTYPES = {
    "f16": TensorDType("f16", "mma_f16", "pack_f16", "h2f", "f2h", "f16", "float16", "float16"),
    "bf16": TensorDType("bf16", "mma_bf16", "pack_bf16", "bf2f", "f2bf", "bf16", "bfloat16", None),
}

SHARED_PRIMITIVES = ("ldsm_x4", "ldsm_x4_t", "ldsm_x2", "ldsm_x2_t", "pin",
                     "cp_async16", "cp_async16_f32", "cp_async_wait_all", "cp_async_commit", "cp_async_wait1",
                     "cp_async_wait2", "red_add2", "st_pair16")
"""The primitives every 16-bit kernel imports, whatever its dtype (beside its dtype's four);
``cp_async16_f32(smem, soff, src, goff, valid)`` copies 4 fp32 words (offsets in words), as
``cp_async16`` copies 8 16-bit elements; ``red_add2(out, idx, a, b)`` adds two adjacent fp32
values atomically (``idx`` even: a tensor-core fragment's column pair, one reduction), as
``st_pair16(out, idx, word)`` stores a packed pair of 16-bit values (one word)."""

FP32_COPIES = ("cp_async16_f32", "cp_async_wait_all", "cp_async_commit", "cp_async_wait1", "cp_async_wait2",
               "red_add2")
"""The shared primitives an fp32 kernel on tensor cores (3xTF32) imports: fp32 copies and reductions."""

PRIMITIVES = ("mma_f16", "mma_bf16", "pack_f16", "pack_bf16", "h2f", "bf2f", "f2h", "f2bf", *SHARED_PRIMITIVES,
              "bar_named", "bar_arrive", "mma_tf32x3", "mma_tf32x3s", "pack_tf32x3")
"""Every primitive above, ``bar_named(id, count)``: named barrier ``id`` (1-15) of ``count`` threads,
waited at (the multiplying warps of a kernel with a copying warpgroup, or one warpgroup waiting for
its buffer, :mod:`.producer`), and ``bar_arrive(id, count)``: the same barrier, arrived at without
waiting (a buffer handed over)."""


def mma_dtype(name: str) -> TensorDType:
    """The tensor-core primitives of a :class:`~.plan.Frag` of dtype ``name`` (``f32``: 3xTF32)."""
    return TF32X3 if name == "f32" else DTYPES[name]


def fragment_layout() -> dict[str, np.ndarray]:
    """Where each element of the A, B and C tiles lives: ``A[r, k] = (register, lane, half)``,
    ``B[k, n]`` likewise, ``C[r, n] = (register, lane)``."""
    A = np.empty((16, 16), dtype=object)
    B = np.empty((16, 8), dtype=object)
    C = np.empty((16, 8), dtype=object)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for h in range(2):
            A[g, 2 * t + h] = (0, lane, h)
            A[g + 8, 2 * t + h] = (1, lane, h)
            A[g, 2 * t + 8 + h] = (2, lane, h)
            A[g + 8, 2 * t + 8 + h] = (3, lane, h)
            B[2 * t + h, g] = (0, lane, h)
            B[2 * t + 8 + h, g] = (1, lane, h)
            C[g, 2 * t + h] = (h, lane)
            C[g + 8, 2 * t + h] = (2 + h, lane)
    return {"A": A, "B": B, "C": C}


def lane_fragments(A, B, C) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What each lane holds of a 16x16 A, 16x8 B and 16x8 C by :func:`fragment_layout`:
    ``a[lane, register, half]``, ``b[lane, register, half]`` and ``c[lane, register]`` (fp32)."""
    lay = fragment_layout()
    a, b, c = np.zeros((32, 4, 2), np.float32), np.zeros((32, 2, 2), np.float32), np.zeros((32, 4), np.float32)
    for (r, k), (reg, lane, half) in np.ndenumerate(lay["A"]):
        a[lane, reg, half] = A[r, k]
    for (k, n), (reg, lane, half) in np.ndenumerate(lay["B"]):
        b[lane, reg, half] = B[k, n]
    for (r, n), (reg, lane) in np.ndenumerate(lay["C"]):
        c[lane, reg] = C[r, n]
    return a, b, c


# --------------------------------------------------------------------------- the simulator's twins

def _index_arrays():
    lay = fragment_layout()
    a_lane = np.array([[lay["A"][r, k][1] for k in range(16)] for r in range(16)])
    a_half = np.array([[2 * lay["A"][r, k][0] + lay["A"][r, k][2] for k in range(16)] for r in range(16)])
    b_lane = np.array([[lay["B"][k, n][1] for n in range(8)] for k in range(16)])
    b_half = np.array([[8 + 2 * lay["B"][k, n][0] + lay["B"][k, n][2] for n in range(8)] for k in range(16)])
    return a_lane, a_half, b_lane, b_half


_A_LANE, _A_HALF, _B_LANE, _B_HALF = _index_arrays()


def _f16_values(halves: np.ndarray) -> np.ndarray:
    return halves.astype(np.uint16).view(np.float16).astype(np.float64)


def _bf16_values(halves: np.ndarray) -> np.ndarray:
    return bf16_values(halves).astype(np.float64)


def _context():
    from numba.cuda.simulator.kernel import _get_kernel_context
    return _get_kernel_context()


_BARRIERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # launch -> {(block, (key, parties)): barrier}
_BARRIERS_LOCK = threading.Lock()


def _per_launch(table, ctx, key, make):
    """``table``'s entry for this thread's own launch (its block manager), block and ``key``,
    made by ``make()`` the first time: state of one launch that no other launch's threads reach."""
    launch = threading.current_thread()._manager
    block = tuple(int(v) for v in (ctx.blockIdx.x, ctx.blockIdx.y, ctx.blockIdx.z))
    with _BARRIERS_LOCK:
        mine = table.setdefault(launch, {})
        entry = mine.get((block, key))
        if entry is None:
            entry = mine[block, key] = make()
    return entry


def _group_barrier(ctx, key, parties: int):
    """The simulator's barrier over ``parties`` threads of this block named by ``key``: the
    threads of one warp for the twins below (what they exchange stays within the warp), a
    warpgroup for ``wgmma``: a :class:`_NamedBarrier` (as ``bar_named``), so a deadlock through it
    is reported (:mod:`.sim_waits`).  Not numba's block barrier, so a kernel whose copying
    warpgroup passes only the block's own barriers runs in step (:mod:`.producer`).  Barriers
    belong to one launch (its block manager), so threads a failed launch left waiting never meet
    a later launch's."""
    barrier = _per_launch(_BARRIERS, ctx, (key, parties),
                          lambda: _NamedBarrier(parties, f"the {key[0]} exchange {key[1]}"))
    barrier.arrive(int(ctx.threadIdx.x), True)


_EXCHANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # launch -> {(block, name): array}


def _lane_exchange(ctx, name: str, shape: tuple, dtype) -> np.ndarray:
    """The array through which a twin's lanes publish their registers to the warp: one per
    launch, block and twin, found from the calling thread's own launch (as the barriers are),
    not from the simulator's global kernel context, so the threads of an aborted launch that
    run on never write into a later launch's."""
    return _per_launch(_EXCHANGES, ctx, name, lambda: np.zeros(shape, dtype))


def _warp_sync(ctx):
    """A barrier over this thread's warp (its live lanes: every lane of a block of whole warps)."""
    tid = int(ctx.threadIdx.x)
    warp = tid // 32
    _group_barrier(ctx, ("warp", warp), min(32, int(ctx.blockDim.x) - 32 * warp))


class _NamedBarrier:
    """The simulator's named barrier (``bar.sync`` / ``bar.arrive``): it completes when ``parties``
    threads have arrived, those that wait and those that only arrive; the waiters are released.  A
    thread arriving twice in one phase is refused: on the GPU that is a protocol error (the count
    reached early), here it would pass silently."""

    def __init__(self, parties: int, name: str = "a named barrier"):
        self.parties, self.phase, self.arrived = parties, 0, set()
        self.cv, self.name = threading.Condition(), name

    def arrive(self, me, wait: bool) -> None:
        sim_waits.progress()
        with self.cv:
            if me in self.arrived:
                raise RuntimeError(f"thread {me} arrived twice at one named barrier of {self.parties} "
                                   f"before it completed")
            phase = self.phase
            self.arrived.add(me)
            if len(self.arrived) == self.parties:
                self.arrived.clear()
                self.phase += 1
                self.cv.notify_all()
            elif wait and not sim_waits.wait_for(self.cv, lambda: self.phase != phase, f"{self.name} of {self.parties}",
                                                 300, lambda: f"phase {self.phase}, {len(self.arrived)} arrived"):
                raise threading.BrokenBarrierError(f"named barrier of {self.parties}: timed out")


def _sim_named(bid, count, wait: bool):
    ctx = _context()
    barrier = _per_launch(_BARRIERS, ctx, (("named", int(bid)), int(count)), lambda: _NamedBarrier(int(count), f"named barrier {int(bid)}"))
    barrier.arrive(int(ctx.threadIdx.x), wait)
    return 0


def _sim_bar_named(bid, count):
    return _sim_named(bid, count, True)


def _sim_bar_arrive(bid, count):
    return _sim_named(bid, count, False)


def _sim_mma(values, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """One lane's part of a warp's mma: the lanes publish their fragments in shared memory,
    then each reads the whole A and B tiles back and keeps its four outputs."""
    ctx = _context()
    tid = int(ctx.threadIdx.x)
    warp, lane = divmod(tid, 32)
    exchange = _lane_exchange(ctx, "mma", (32, 32, 6), np.uint32)   # 32 warps of 32 lanes
    exchange[warp, lane] = (a0, a1, a2, a3, b0, b1)
    _warp_sync(ctx)
    words = np.array(exchange[warp], dtype=np.uint32)
    _warp_sync(ctx)
    vals = values(words.view(np.uint16).reshape(32, 12))   # word w: halves 2w (low), 2w + 1
    A = vals[_A_LANE, _A_HALF]
    B = vals[_B_LANE, _B_HALF]
    C = A @ B
    g, t = divmod(lane, 4)
    return (np.float32(c0 + C[g, 2 * t]), np.float32(c1 + C[g, 2 * t + 1]),
            np.float32(c2 + C[g + 8, 2 * t]), np.float32(c3 + C[g + 8, 2 * t + 1]))


def tf32_round(x) -> np.ndarray:
    """fp32 values rounded to tf32 as ``tensorcore.cu``'s ``nc_tf32_big`` does: 10 mantissa bits,
    ties away from zero (``cvt.rna.tf32.f32`` for finite values), by adding half a tf32 ulp to the
    bits and clearing the low 13 (32-bit wrap-around, as on the device)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def tf32_trunc(x) -> np.ndarray:
    """fp32 values truncated to tf32 (the low 13 bits cleared), ``nc_tf32_small``'s rounding."""
    return (np.asarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def _sim_pack_tf32x3(lo, hi):
    x = np.array([lo, hi], dtype=np.float32)
    big = tf32_round(x)
    with np.errstate(invalid="ignore"):   # inf - inf: small is NaN, as on the device
        small = tf32_trunc(x - big)
    return big.view(np.uint64)[0], small.view(np.uint64)[0]


def _sim_mma_tf32x3(*args):
    """One lane's part of a warp's 3xTF32 step as the GPU computes it: the lanes publish their
    64-bit registers, each m16n8k8 half's A (16x8) and B (8x8) are assembled from the registers
    in PTX's tf32 fragment layout (``tensorcore.cu`` passes a register's low word as ``k' = t``,
    its high word as ``k' = t + 4``), and the three products of each half are summed."""
    regs, c = args[:12], args[12:]
    ctx = _context()
    warp, lane = divmod(int(ctx.threadIdx.x), 32)
    exchange = _lane_exchange(ctx, "mma_tf32x3", (32, 32, 12), np.uint64)   # 32 warps of 32 lanes
    exchange[warp, lane] = regs
    _warp_sync(ctx)
    words = np.array(exchange[warp], dtype=np.uint64)
    _warp_sync(ctx)
    v = words.view(np.float32).astype(np.float64).reshape(32, 12, 2)   # [lane, register, lo / hi]
    gs, ts = np.divmod(np.arange(32), 4)
    total = np.zeros((16, 8))
    for half in range(2):
        for big_a, big_b in ((False, True), (True, False), (True, True)):
            A, B = np.zeros((16, 8)), np.zeros((8, 8))
            r0, r1 = 4 * half + (0 if big_a else 1), 4 * half + (2 if big_a else 3)    # a(2h), a(2h+1)
            A[gs, ts], A[gs + 8, ts] = v[:, r0, 0], v[:, r1, 0]
            A[gs, ts + 4], A[gs + 8, ts + 4] = v[:, r0, 1], v[:, r1, 1]
            rb = 8 + 2 * half + (0 if big_b else 1)
            B[ts, gs], B[ts + 4, gs] = v[:, rb, 0], v[:, rb, 1]
            total += A @ B
    g, t = divmod(lane, 4)
    return (np.float32(c[0] + total[g, 2 * t]), np.float32(c[1] + total[g, 2 * t + 1]),
            np.float32(c[2] + total[g + 8, 2 * t]), np.float32(c[3] + total[g + 8, 2 * t + 1]))


def _sim_ldsm(arr, off, count: int, trans: bool):
    """One lane's part of ``ldmatrix``: the lanes publish their row addresses, then each takes
    its pair of every 8x8 matrix (of its transpose with ``trans``)."""
    ctx = _context()
    tid = int(ctx.threadIdx.x)
    warp, lane = divmod(tid, 32)
    rows = _lane_exchange(ctx, "ldmatrix", (32, 32), np.int64)   # each lane's row address
    rows[warp, lane] = int(off)
    _warp_sync(ctx)
    offs = [int(v) for v in rows[warp]]
    _warp_sync(ctx)
    g, t = divmod(lane, 4)
    out = []
    for q in range(count):
        if trans:
            lo, hi = arr[offs[8 * q + 2 * t] + g], arr[offs[8 * q + 2 * t + 1] + g]
        else:
            lo, hi = arr[offs[8 * q + g] + 2 * t], arr[offs[8 * q + g] + 2 * t + 1]
        out.append(np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16)))
    return tuple(out)


def _sim_primitives() -> dict:
    def mma_f16(*args):
        return _sim_mma(_f16_values, *args)

    def mma_bf16(*args):
        return _sim_mma(_bf16_values, *args)

    def pack_f16(lo, hi):
        return np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint32)[0]

    def pack_bf16(lo, hi):
        return bf16_bits(np.array([lo, hi], dtype=np.float32)).view(np.uint32)[0]

    def h2f(bits):
        return np.float32(np.array(bits, dtype=np.int16).view(np.float16))

    def bf2f(bits):
        return bf16_values(np.array([bits], dtype=np.int16))[0]

    def f2h(x):
        return np.array(x, dtype=np.float32).astype(np.float16).view(np.int16)[()]

    def f2bf(x):
        return bf16_bits(np.array([x], dtype=np.float32))[0]

    def cp_async16(smem16, soff, src16, goff, valid):
        for e in range(8):   # the simulator copies at once; a fetch past the end is zeros
            smem16[int(soff) + e] = src16[int(goff) + e] if valid else 0
        return 0

    def cp_async16_f32(smem, soff, src, goff, valid):
        for e in range(4):
            smem[int(soff) + e] = src[int(goff) + e] if valid else 0
        return 0

    def red_add2(out, idx, a, b):
        from numba.cuda.simulator.kernelapi import FakeCUDAAtomic   # the simulator's atomics: a lock each
        atomic = FakeCUDAAtomic()
        atomic.add(out, int(idx), a)
        atomic.add(out, int(idx) + 1, b)
        return 0

    def st_pair16(out, idx, word):
        out[int(idx):int(idx) + 2] = np.array([word], dtype=np.uint32).view(np.int16)   # low half first
        return 0

    def done():
        return 0

    return dict(mma_f16=mma_f16, mma_bf16=mma_bf16, pack_f16=pack_f16, pack_bf16=pack_bf16,
                h2f=h2f, bf2f=bf2f, f2h=f2h, f2bf=f2bf,
                ldsm_x4=lambda a, o: _sim_ldsm(a, o, 4, False), ldsm_x4_t=lambda a, o: _sim_ldsm(a, o, 4, True),
                ldsm_x2=lambda a, o: _sim_ldsm(a, o, 2, False), ldsm_x2_t=lambda a, o: _sim_ldsm(a, o, 2, True),
                pin=lambda v: v, cp_async16=cp_async16, cp_async16_f32=cp_async16_f32, red_add2=red_add2, st_pair16=st_pair16, cp_async_wait_all=done, cp_async_commit=done, cp_async_wait1=done,
                cp_async_wait2=done, bar_named=_sim_bar_named, bar_arrive=_sim_bar_arrive,
                mma_tf32x3=_sim_mma_tf32x3,
                mma_tf32x3s=_sim_mma_tf32x3, pack_tf32x3=_sim_pack_tf32x3)


def _by_descriptor(values, smem16, desc, n: int, trans) -> np.ndarray:
    """The 16 x ``n`` operand a descriptor names in ``smem16`` (core matrices; ``trans``: the
    operand's own axis fastest), as the hardware reads B, or A (``n = 64``, transposed)."""
    from .wgmma import operand_bytes
    byte = operand_bytes(desc, n, trans)
    return values(np.asarray(smem16)[byte // 2].astype(np.int16).view(np.uint16))


def sim_wgmma(values, n: int, smem16, desc, trans, a0, a1, a2, a3, acc=None, adesc=None):
    """One lane's part of a warpgroup MMA: the warp's A fragments are exchanged (the rows of A
    this warp owns), or with ``adesc`` (the SS form) A's 64 rows are read by that descriptor, K-major;
    B is read from ``smem16`` where the descriptor's fields say (its address a
    byte offset into ``smem16``: :func:`sim_desc16`), and the lane's accumulators of
    ``D = A B + C`` (``C = 0`` without ``acc``: scale-d 0) are returned in the ``mma.sync`` C order
    per 8-column tile."""
    ctx = _context()
    warp, lane = divmod(int(ctx.threadIdx.x), 32)
    group, slab = divmod(warp, 4)     # the warpgroup, and this warp's 16 of its 64 rows
    # two exchanges used in turn (this thread's count of calls), so one barrier per call: no thread
    # writes the exchange of call n + 2 before every thread of its warpgroup has met at n + 1
    calls = _lane_exchange(ctx, "wgmma-calls", (1024,), np.int64)
    turn = int(calls[warp * 32 + lane]) % 2
    calls[warp * 32 + lane] += 1
    exchange = _lane_exchange(ctx, f"wgmma{turn}", (32, 32, 4), np.uint32)
    descs = _lane_exchange(ctx, f"wgmma-desc{turn}", (32, 32), np.uint64)
    adescs = _lane_exchange(ctx, f"wgmma-adesc{turn}", (32, 32), np.uint64)
    exchange[warp, lane] = (a0, a1, a2, a3)
    descs[warp, lane] = desc
    adescs[warp, lane] = 0 if adesc is None else adesc
    _group_barrier(ctx, ("warpgroup", group), 128)
    words = np.array(exchange[4 * group:4 * group + 4], dtype=np.uint32)
    for what, got in (("B", descs), ("A", adescs)):
        mine = set(int(v) for v in got[4 * group:4 * group + 4].ravel())
        if len(mine) != 1:   # the instruction is collective: one B (and A) for the 64 rows of the warpgroup
            raise RuntimeError(f"wgmma: the warps of warpgroup {group} give {len(mine)} different "
                               f"descriptors of {what}")
    if adesc is None:
        # the 64 x 16 A of the warpgroup, warp w % 4 giving rows 16 (w % 4) .. + 15, and this warp's
        # result rows are those, whichever rows its code thinks it holds
        A = np.concatenate([values(words[w].view(np.uint16).reshape(32, 8))[_A_LANE, _A_HALF] for w in range(4)])
    else:
        A = _by_descriptor(values, smem16, adesc, 64, 0).T
    A = A[16 * slab:16 * slab + 16]
    B = _by_descriptor(values, smem16, desc, n, trans)   # 16 x n
    D = A @ B
    g, t = divmod(lane, 4)
    out = []
    for nt in range(n // 8):
        col = 8 * nt + 2 * t
        out += [D[g, col], D[g, col + 1], D[g + 8, col], D[g + 8, col + 1]]
    acc = (0.0,) * len(out) if acc is None else acc.values if isinstance(acc, InFlight) else acc
    return InFlight(tuple(np.float32(float(x) + float(y)) for x, y in zip(acc, out)))


_GROUPS = threading.local()   # this simulated thread's wgmma groups


def _groups():
    """``(open, pending)``: this thread's MMAs not yet committed, and its committed groups not yet
    completed, oldest first."""
    if not hasattr(_GROUPS, "open"):
        _GROUPS.open, _GROUPS.pending = [], []
    return _GROUPS.open, _GROUPS.pending


class InFlight:
    """Accumulators a simulated ``wgmma`` returned, as the hardware's registers are until a
    ``wgmma_wait`` completes their group: only another ``wgmma`` may take them; read otherwise
    (unpacked), or passed through a wait whose depth leaves their group pending, they fail."""

    def __init__(self, values: tuple):
        self.values, self.done = values, False
        _groups()[0].append(self)

    def __iter__(self):
        raise RuntimeError("wgmma: accumulators read before a wgmma_wait completed their group")


def sim_wgmma_commit():
    """``wgmma.commit_group``: the MMAs issued since the last commit form one group."""
    open_, pending = _groups()
    if open_:
        pending.append(list(open_))
        open_.clear()
    return 0


def sim_wgmma_wait(depth: int):
    """``wgmma.wait_group depth`` passing accumulators ``acc`` through: every group but the newest
    ``depth`` completes; ``acc``'s must be among them."""
    def wait(acc):
        _, pending = _groups()
        older = max(len(pending) - depth, 0)
        for group in pending[:older]:
            for a in group:
                a.done = True
        del pending[:older]
        if isinstance(acc, InFlight) and not acc.done:
            raise RuntimeError(f"wgmma_wait{depth or ''}: the accumulators passed through belong to a group "
                               f"still pending (one of the newest {depth} committed, or not committed)")
        return tuple(acc.values if isinstance(acc, InFlight) else acc)
    return wait


def sim_desc16(smem16, off, lbo, sbo):
    """The simulated descriptor: the GPU's bit fields, the address a byte offset into ``smem16``."""
    from .wgmma import descriptor
    return np.uint64(descriptor(2 * int(off), int(lbo), int(sbo)))


def sim_wgmma_primitive(name: str):
    """The simulated twin of warpgroup primitive ``name`` (None: not one)."""
    from .staged_add import PRIMITIVES as STAGED, sim_primitive
    from .wgmma import FIXED, SETMAXNREG, parse, shared_a
    if SETMAXNREG.match(name):
        return lambda: 0          # the simulator has no register file to share out
    if name == "wgmma_desc16":
        return sim_desc16
    if name == "wgmma_commit":
        return sim_wgmma_commit
    if name in STAGED:
        return sim_primitive(name, _context, _per_launch)   # bulk reductions of staged partial sums
    from . import tma
    if name in tma.PRIMITIVES:
        return tma.sim_primitive(name, _context, _per_launch)   # tensor copies and their mbarriers
    if name in FIXED:
        return lambda: 0
    hit = parse(name)
    if hit is None:
        return None
    dt, n, depth = hit
    if dt is None:
        return sim_wgmma_wait(depth)
    values = _f16_values if dt == "f16" else _bf16_values
    if shared_a(name):    # (smem16, adesc, desc, trans[, acc])
        return lambda smem16, adesc, desc, trans, *acc: sim_wgmma(values, n, smem16, desc, trans, 0, 0, 0, 0,
                                                                   *acc, adesc=adesc)
    return lambda *args: sim_wgmma(values, n, *args)


# --------------------------------------------------------------------------- the GPU's

def _gpu_primitives() -> dict:
    from . import tensorcore_gpu
    return {name: getattr(tensorcore_gpu, name) for name in PRIMITIVES}


_CACHE: dict[bool, dict] = {}


def primitives() -> dict:
    """The primitives for this process's numba.cuda (simulated or linked), made once."""
    from .devices import simulator_active
    sim = simulator_active()
    if sim not in _CACHE:
        _CACHE[sim] = _sim_primitives() if sim else _gpu_primitives()
    return _CACHE[sim]


_WG_CACHE: dict[tuple[bool, str], object] = {}


def wgmma_primitive(name: str):
    """A warpgroup primitive (:mod:`.wgmma`) for this process's numba.cuda, or None."""
    from .devices import simulator_active
    from .wgmma import known
    if not known(name):
        return None
    sim = simulator_active()
    if (sim, name) not in _WG_CACHE:
        if sim:
            _WG_CACHE[sim, name] = sim_wgmma_primitive(name)
        else:
            from .tensorcore_gpu import wgmma_primitive as gpu
            _WG_CACHE[sim, name] = gpu(name)
    return _WG_CACHE[sim, name]


def __getattr__(name: str):
    # generated kernels import the primitives by name: ``from ...tensorcore import mma_f16``
    if name in PRIMITIVES:
        return primitives()[name]
    fn = wgmma_primitive(name) if not name.startswith("__") else None
    if fn is not None:
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
