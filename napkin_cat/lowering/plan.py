"""The kernel IR: a frozen plan of one kernel, made by :mod:`.planner`, rendered by :mod:`.emit`.

A :class:`KernelPlan` says everything the renderer needs and nothing about source text:

``axes``        each axis's role (``grid``, ``batch``, ``stream`` or ``full``) and extent in a block;
``targets``     the values written once per program point (:class:`Target`) and the thread
                mapping of the phase that computes each (:class:`Micro`, :class:`Flat`,
                :class:`Coop`);
``accs``        one :class:`AccPlan` per accumulator: where its states live, the mappings of its
                main state and row statistics (:class:`Rows` when the scores stay in registers:
                :class:`FusedScores`), and the engine of its contraction;
``buffers``     the shared-memory buffers (:class:`Buffer`): axes in layout order, padding,
                copies, offsets in the one dynamic shared array;
``launch``      the grid, which tiled axes decode from ``blockIdx.x`` / ``y``, the shared memory
                and the launch bounds (:class:`LaunchPlan`);
``skips``       per stream loop, the masks that bound the chunks it visits
                (:func:`napkin_cat.relabel.skipping.chunk_skips`).

Every record is a frozen dataclass; mappings are read-only views.  Identifiers are chosen by the
renderer (a buffer's ``base`` is the stem of its name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from ..core.diagram import Diagram
from ..core.errors import LoweringError
from ..core.hardware import FP32_ENGINES as _ENGINES
from ..relabel.accumulators import Accumulator
from ..relabel.loopnest import FinalForm

ENGINES = ("cuda_core", "mma")
"""Engines a contraction can be planned on: ``cuda_core`` (register micro-tiles, fp32 FMAs;
:mod:`.emit_threads`) and ``mma`` (tensor cores, ``mma.sync.m16n8k16`` on fp16 / bf16 fragments
with fp32 accumulators, on a :class:`Frag` mapping; :mod:`.emit_mma`)."""


def frozen_map(d: dict) -> Mapping:
    return MappingProxyType(dict(d))


def _vec(r: int) -> int:
    for v in (4, 2):
        if r % v == 0:
            return v
    return 1


@dataclass(frozen=True)
class AxisPlan:
    """An axis as the kernel sees it.  ``role``: ``grid`` (tiled), ``batch`` (tiled by 1, on
    ``blockIdx.y``), ``stream`` (a loop in the block) or ``full`` (whole axis in the block);
    ``cap``: its extent in a block (tile, chunk or the whole axis)."""

    name: str
    size: int
    role: str
    cap: int

    @property
    def ragged(self) -> bool:
        return self.role in ("grid", "stream") and self.size % self.cap != 0


@dataclass(frozen=True)
class Buffer:
    """A shared-memory buffer: a view ``smem[offset:offset+size]`` with a row-major layout over
    ``axes`` (those with extent > 1)."""

    key: tuple
    base: str
    axes: tuple[str, ...]
    caps: tuple[int, ...]
    what: str
    offset: int = 0
    copies: int = 1              # 2: double-buffered chunks
    pad: int = 0                 # extra elements per row of the last axis (bank spreading)
    name: str = ""               # its identifier, chosen by the renderer
    bits: int = 32               # 32: fp32 values; 16: 16-bit patterns (an f16 / bf16 input, or an
                                 # intermediate read only by tensor cores: .sixteen_bit)
    core: bool = False           # the 8 x 8 "core matrix" layout a wgmma descriptor reads (.wgmma)
    swizzle: bool = False        # core, as 128-byte swizzled panels of 64 columns: what TMA writes (.tma)
    tma: bool = False            # a stream loop's chunks, copied by TMA (swizzled, or a row of the streamed axis)

    @property
    def ld(self) -> int:
        """Elements between consecutive indices of the second-to-last axis (a core-matrix
        buffer: the last axis rounded up to 8, its rows' extent in every panel of 8 rows;
        swizzled: 64, a panel's row)."""
        if self.swizzle:
            return 64
        if self.core:
            return -(-self.caps[-1] // 8) * 8
        return self.caps[-1] + self.pad if self.caps else 1

    @property
    def elems(self) -> int:
        if self.swizzle:   # panels of 64 columns, each its rows of 128 bytes
            return -(-self.caps[-1] // 64) * -(-self.caps[0] // 8) * 8 * 64
        if self.core:   # panels of 8 rows, the last one whole
            return -(-self.caps[0] // 8) * 8 * self.ld
        return max(1, math.prod(self.caps[:-1]) * self.ld) if self.caps else 1

    @property
    def words(self) -> int:
        """32-bit words of one copy."""
        return self.elems if self.bits == 32 else -(-self.elems // 2)

    @property
    def stride(self) -> int:
        """32-bit words per copy, rounded up to 16 bytes."""
        return -(-self.words // 4) * 4

    @property
    def size(self) -> int:
        """32-bit words in all (offsets into shared memory count words)."""
        return self.words if self.copies == 1 else self.copies * self.stride


# --------------------------------------------------------------------------- thread mappings

@dataclass(frozen=True)
class Micro:
    """Register micro-tiles over two axes: thread ``(ty, tx)`` owns rows
    ``ty*VY + (i//VY)*TY*VY + i%VY`` for ``i < RY`` and likewise columns: groups of ``VY``
    consecutive rows (vector loads), groups spread ``TY*VY`` apart (no bank conflicts)."""

    row: str
    col: str
    cr: int
    cc: int
    RY: int
    RX: int
    TY: int
    TX: int

    @property
    def VY(self) -> int:
        return _vec(self.RY)

    @property
    def VX(self) -> int:
        return _vec(self.RX)

    @property
    def active(self) -> int:
        return self.TY * self.TX

    @property
    def shape(self) -> tuple[int, int]:
        return (self.RY, self.RX)

    def describe(self) -> str:
        return (f"register micro-tiles {self.RY}x{self.RX} over ({self.row}, {self.col}) "
                f"on {self.TY}x{self.TX} threads")


@dataclass(frozen=True)
class Frag(Micro):
    """Tensor-core fragments over two axes (``mma.sync.m16n8k16``): ``Wm x Wn`` warps, warp
    ``(wm, wn)`` owns a ``16*MT x 8*NT`` patch (``MT = RY/2`` row tiles of 16, ``NT = RX/2``
    column tiles of 8); lane ``l`` of it (``g = l // 4``, ``t = l % 4``) holds the accumulator
    elements of rows ``g`` and ``g + 8`` and columns ``2t``, ``2t + 1`` of every tile.  As a
    :class:`Micro`: ``ty = 8*wm + g`` (``TY = 8*Wm``), ``tx = 4*wn + t`` (``TX = 4*Wn``), element
    ``(i, j)`` at row ``16*MT*(ty // 8) + 16*(i // 2) + 8*(i % 2) + ty % 8`` and column
    ``8*NT*(tx // 4) + 8*(j // 2) + 2*(tx % 4) + j % 2``.  With ``Wn == 1`` the 4 lanes of a row
    are consecutive threads (``tx = tid % 4``), as row statistics need.  ``dtype``: the
    operands' (``f16`` / ``bf16``; ``f32``: multiplied by 3xTF32).  Warp ``w`` is at
    ``(w // Wn, w % Wn)``; multiplied by warpgroups with ``Wn > 1`` (each warpgroup a slice of
    the columns) at ``(w % Wm, w // Wm)``, so the 4 warps of a warpgroup hold 64 consecutive rows
    of the same columns."""

    Wm: int = 1
    Wn: int = 1
    dtype: str = "f16"
    wg: bool = False    # multiplied by warpgroups (wgmma.m64nNk16, the column operand read by
                        # descriptor from a core-matrix buffer: .wgmma), not mma.sync

    @property
    def MT(self) -> int:
        return self.RY // 2

    @property
    def NT(self) -> int:
        return self.RX // 2

    def describe(self) -> str:
        if self.wg:
            return (f"tensor-core fragments over ({self.row}, {self.col}): {self.Wm}x{self.Wn} warps in "
                    f"{self.Wm * self.Wn // 4} warpgroup(s){' splitting the columns' if self.Wn > 1 else ''}, "
                    f"each warp {16 * self.MT}x{8 * self.NT}: {self.MT} "
                    f"wgmma.m64n{8 * self.NT}k16 per warpgroup and step ({self.dtype} in, A from registers "
                    f"or, an input's, by descriptor, B from shared memory, fp32 accumulators; requires "
                    f"{self.row} % {16 * self.Wm}, "
                    f"reduced extent % 16)")
        how = ("3xTF32 (fp32 in, six mma.sync.m16n8k8.tf32 per tile and 16-wide step)" if self.dtype == "f32"
               else f"{self.dtype} in")
        return (f"tensor-core fragments over ({self.row}, {self.col}): {self.Wm}x{self.Wn} warps, "
                f"each {16 * self.MT}x{8 * self.NT} = {self.MT}x{self.NT} mma.sync.m16n8k16 tiles "
                f"({how}, fp32 accumulators; requires {self.row} % {16 * self.Wm}, "
                f"{self.col} % {8 * self.Wn}, reduced extent % 16)")


@dataclass(frozen=True)
class Flat:
    """Element ``e = tid + NTHREADS * u`` for ``u < per_thread``, decoded over ``axes``
    (last fastest)."""

    axes: tuple[str, ...]
    caps: tuple[int, ...]
    threads: int

    @property
    def n(self) -> int:
        return max(1, math.prod(self.caps))

    @property
    def per_thread(self) -> int:
        return -(-self.n // self.threads)

    @property
    def shape(self) -> tuple[int]:
        return (self.per_thread,)

    def describe(self) -> str:
        return f"{self.n} elements, {self.per_thread} per thread"


@dataclass(frozen=True)
class Coop:
    """``R`` lanes per output element (a power of two): element ``tid // R + u * (NTHREADS // R)``
    for ``u < per_thread``; the lanes split the reduction and combine their partials.  Groups
    past the last output (idle) index the last output, so every thread reaches the barriers of
    the group reductions, but their loops start at ``IDLE_START`` (empty) and their writes are
    guarded: they read nothing that an active group is overwriting."""

    axes: tuple[str, ...]
    caps: tuple[int, ...]
    threads: int
    R: int

    @property
    def n(self) -> int:
        return max(1, math.prod(self.caps))

    @property
    def per_thread(self) -> int:
        return -(-self.n // (self.threads // self.R))

    @property
    def shape(self) -> tuple[int]:
        return (self.per_thread,)

    def describe(self) -> str:
        return f"{self.n} outputs, {self.R} lanes each"


@dataclass(frozen=True)
class Rows:
    """Row statistics in registers beside a micro-tile: thread ``(ty, tx)`` keeps the statistics
    of the ``RY`` rows it owns in ``micro``; the ``TX`` lanes of a row (one aligned group of a
    warp) hold the same values."""

    micro: Micro

    @property
    def shape(self) -> tuple[int]:
        return (self.micro.RY,)

    def describe(self) -> str:
        return (f"row statistics in registers, {self.micro.RY} rows per thread, "
                f"{self.micro.TX} lanes per row")


@dataclass(frozen=True)
class FusedScores:
    """A normalising accumulator whose score input stays in registers: the scores' contraction
    runs on micro-tile ``ms`` (rows: the statistics axis, columns: the streamed axis) with the
    same thread -> row ownership as the accumulator's main micro-tile, so row statistics are
    reductions among the lanes of a row (warp shuffles) and the weights reach the main
    contraction through a warp-private shared-memory staging area."""

    target: int      # the score variable (end of its fused elementwise chain)
    source: int      # the contraction's output
    ms: Micro


# --------------------------------------------------------------------------- phases

@dataclass(frozen=True)
class Target:
    """A value written once per program point: ``var`` (the end of an elementwise chain) computed
    from ``source`` (a reduction or an accumulator's output, fused into the same phase) or from
    shared-memory values alone (``source is None``).  ``engine``: what runs its contraction."""

    var: int
    source: int | None
    to_smem: bool
    to_global: bool
    mapping: object = None
    engine: str | None = None


@dataclass(frozen=True)
class AccPlan:
    index: int
    acc: Accumulator
    main: object                       # Micro or Flat over the output axes
    main_regs: bool
    stat_regs: bool = True
    stat: object = None                # Coop or Rows: row statistics (online softmax, normalised)
    stat_axes: tuple[str, ...] = ()
    p_buf: tuple | None = None         # key of the buffer holding a1(s) / exp(s - mu)
    fused: FusedScores | None = None   # scores kept in registers (see FusedScores)
    engine: str | None = None          # the contraction into the main state, if any
    stats_of: int | None = None        # a logsumexp read from this online softmax's statistics


@dataclass(frozen=True)
class Structure:
    """Where each variable is defined and read in the loop nest (keys: ``id(node)`` for nodes)."""

    loops_of: Mapping
    scope_of: Mapping          # id(node) -> enclosing stream loops
    def_node: Mapping          # var -> node defining it
    load_of: Mapping           # input var -> its Load
    consumers: Mapping         # var -> (("eqn", k) | ("acc", i) | ("out",), ...)
    eqn_of: Mapping            # var -> equation defining it
    acc_of_var: Mapping        # var -> accumulator computing it


MMA_SLACK = 48
"""Registers for tensor-core operand fragments (A fragments of every unrolled 16-wide step, B
fragments, ldmatrix addresses) in :func:`.planner.register_estimate`; fragments held across a
stream loop replace the A fragments it counts (:func:`.emit_mma.hoisted_fragments`)."""


@dataclass(frozen=True)
class LaunchPlan:
    grid: tuple[int, int, int]
    x_axes: tuple[str, ...]        # tiled axes decoded from blockIdx.x, slowest first
    y_axes: tuple[str, ...]        # batch axes decoded from blockIdx.y
    heavy_last: frozenset          # tiled axes decoded in reverse (their later tiles work longest)
    smem_floats: int
    registers: int                 # estimated registers per thread
    blocks_per_sm: int

    @property
    def smem_bytes(self) -> int:
        return 4 * self.smem_floats


@dataclass(frozen=True)
class KernelPlan:
    name: str
    d: Diagram                      # the relabelled diagram
    ff: FinalForm
    threads: int
    fastmath: bool
    prefetch: bool | str
    unroll: int
    axes: Mapping                   # name -> AxisPlan, in the diagram's axis order
    grid_loops: tuple
    inner: tuple                    # loop-nest nodes inside the grid loops
    structure: Structure
    cls: Mapping                    # eqn -> elementwise | reduction | normaliser | accumulator
    targets: Mapping                # var -> Target
    absorbed: Mapping               # reduction output -> the target its chain ends in
    accs: tuple                     # AccPlan per accumulator
    fused_targets: Mapping          # score var kept in registers -> accumulator index
    norm_stats: Mapping             # normaliser eqn -> Coop of its row statistics
    buffers: Mapping                # key -> Buffer, in offset order
    skips: Mapping                  # stream axis -> tuple of skipping.Skip
    launch: LaunchPlan
    notes: tuple[str, ...]
    dtype: str = "f32"              # f32, or the 16-bit dtype of its inputs (f16 / bf16)
    reg_copies: Mapping = field(default_factory=dict)   # target var -> targets reading its copy
    frag_operands: Mapping = field(default_factory=dict)  # target var -> accumulators reading its copy as A fragments

    @property
    def dd(self) -> Diagram:
        return self.ff.diagram

    @property
    def types(self):
        return self.dd.var_types()

    @property
    def n_in(self) -> int:
        return len(self.dd.dom)

    @property
    def smem_bytes(self) -> int:
        return self.launch.smem_bytes

    def var_cls(self, v: int) -> str:
        return var_cls(v, self.n_in, self.cls, self.structure)

    def storage(self, v: int) -> str:
        return storage(v, self.n_in, self.targets, self.absorbed)

    def axes_set(self, v: int) -> frozenset:
        return axes_set(self.types[v], self.axes)

    def caps(self, axes) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return caps(axes, self.axes)

    def reduced_axes(self, k: int) -> tuple[str, ...]:
        return reduced_axes(self.dd.eqns[k].box)

    def load_plan(self, v: int) -> tuple[int, int]:
        return load_plan(self.types[v], self.axes, self.threads)

    def needs_scratch(self) -> bool:
        return ("red",) in self.buffers

    def flat_for(self, axes) -> Flat:
        names, cs = self.caps(axes)
        return Flat(names, cs, self.threads)


# --------------------------------------------------------------------------- queries shared by planner and plan

def caps(axes, ax: Mapping) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The axes among ``axes`` with an extent > 1 in a block, and those extents."""
    names = tuple(a for a in axes if ax[a].cap > 1)
    return names, tuple(ax[a].cap for a in names)


def axes_set(arr, ax: Mapping) -> frozenset:
    return frozenset(a for a in arr.axis_names if ax[a].cap > 1)


def var_cls(v: int, n_in: int, cls: Mapping, st: Structure) -> str:
    return "input" if v < n_in else cls[st.eqn_of[v]]


def storage(v: int, n_in: int, targets: Mapping, absorbed: Mapping) -> str:
    """``load`` (an input in shared memory), ``smem`` / ``global`` (a target), ``regs`` (a
    reduction's value in registers, read by its chain, or a target read only from its register
    copy: :mod:`.register_copies`) or ``inline`` (recomputed where read)."""
    if v < n_in:
        return "load"
    if v in targets:
        t = targets[v]
        return "smem" if t.to_smem else "global" if t.to_global else "regs"
    if v in absorbed:
        return "regs"
    return "inline"


def reduced_axes(box) -> tuple[str, ...]:
    """The axes a reduction box sums out: its ``axis`` parameter, or (a contraction) the input
    axes its output lacks."""
    from ..ops.kinds import axis_of
    axis = axis_of(box)
    if axis is not None:
        return (axis,)
    out = set(box.cod[0].axis_names)
    seen = []
    for arr in box.dom:
        for a in arr.axis_names:
            if a not in out and a not in seen:
                seen.append(a)
    return tuple(seen)


FP32_ENGINES = tuple(_ENGINES)
"""``lower(..., fp32=...)``: fp32 FMAs on CUDA cores, or tensor cores by 3xTF32 (:mod:`.tensorcore`)."""

IO_DTYPES = ("f32", "f16", "bf16")
"""Dtypes a kernel reads and writes: fp32, or 16-bit floats (read as bit patterns, computed in
fp32, multiplied on tensor cores where the shapes fit)."""


def check_index_width(dd: Diagram) -> None:
    """Every wire of ``dd`` has fewer than 2**32 elements (the kernels index with uint32)."""
    for arr in list(dd.dom) + list(dd.cod):
        n = math.prod(a.size for a in arr.axes)
        if n >= 2 ** 32:
            raise LoweringError(f"wire {arr} has {n} elements; the numba.cuda kernels index "
                                f"arrays with 32-bit unsigned integers (fewer than 2**32 elements)")


def in_place(ff, load, types) -> bool:
    """``load`` (a final form's ``Load``) copies nothing: an auxiliary tensor that stays where
    it lives and is read there by its gathers (:meth:`~napkin_cat.relabel.loopnest.FinalForm.in_place`).
    Any other input placed at the top level is refused: the kernels read it from shared memory."""
    if ff.in_place(load.var):
        return True
    name = types[load.var].name
    if load.level == load.src and ff.placed(name) == load.level:
        raise LoweringError(f"place({name}, {load.level!r}) cannot be lowered: only an auxiliary tensor "
                            f"(an input read only by the gathers of index expressions) is read in place "
                            f"from {load.level}; the numba.cuda kernels read {types[load.var]} from shared memory")
    return False


def kernel_dtype(dd: Diagram) -> str:
    """The kernel's compute family: the 16-bit dtype among its inputs and outputs, else ``f32``.
    One 16-bit dtype per kernel (fp32 arrays may sit beside it)."""
    low = set()
    for arr in list(dd.dom) + list(dd.cod):
        if arr.dtype.name not in IO_DTYPES:
            raise LoweringError(f"wire {arr} has dtype {arr.dtype.name}; the numba.cuda target "
                                f"takes and returns {', '.join(IO_DTYPES)} arrays")
        if arr.dtype.name != "f32":
            low.add(arr.dtype.name)
    if len(low) > 1:
        raise LoweringError(f"{dd.short()} mixes {' and '.join(sorted(low))} wires; a kernel takes "
                            f"one 16-bit dtype (beside fp32)")
    return low.pop() if low else "f32"


def acc_reduced_axes(acc) -> tuple[str, ...]:
    """The axes an accumulator's contraction sums out: its streamed axis, and the input axes
    that are neither in its output nor axes of its row statistics."""
    box = acc.box
    out = set(box.cod[0].axis_names)
    keeps_stats = any(role != "main" for _, _, role in acc.states())
    stat = set(box.dom[0].axis_names) - {acc.axis} if keeps_stats else set()
    red = [acc.axis]
    for arr in box.dom:
        for a in arr.axis_names:
            if a not in out and a not in red and a not in stat:
                red.append(a)
    return tuple(red)


def load_plan(arr, ax: Mapping, threads: int) -> tuple[int, int]:
    """(elements, elements per thread) of loading ``arr``'s block."""
    n = max(1, math.prod(caps(arr.axis_names, ax)[1]))
    return n, -(-n // threads)
