"""Generic numba.cuda code generation from a final form (fp32).

Nothing here knows an algorithm by name: the kernel is read off the loop nest
(:meth:`napkin_cat.core.Diagram.loop_nest`), box by box through :data:`CODEGEN_RULES` (one
entry per box kind, keyed exactly like :data:`napkin_cat.ops.semantics.NUMPY_RULES`) and
accumulator by accumulator through :data:`ACC_CODEGEN` (keyed like
:data:`napkin_cat.relabel.accumulators.ACC_RULES`).

How the loop nest maps onto the GPU
    * grid loops (tiled axes) -> ``blockIdx.x``, flattened; axes tiled by 1 that the lowering
      added for untiled weaved axes (batch, heads, groups) -> ``blockIdx.y``;
    * stream loops -> ``for`` loops inside the block; each chunk of every input that the loop
      partitions is staged in shared memory by all threads (cooperative, coalesced loads) and
      the block synchronises (``cuda.syncthreads``) before it is read;
    * inside a block every equation is a *phase*: a parallel loop over the elements of its
      output tile, distributed over the threads, with contractions and reductions as inner
      loops over the contracted axes.

Passes (in :class:`KernelGen`)
    1. ``_axes``        role of every axis: grid, batch (grid of size 1), stream or full;
    2. ``_classify``    each equation through its kind's rule: elementwise (inlined where it is
       read), reduction (contract, reduce), normaliser (softmax, normalize: row statistics);
    3. ``_targets``     what is materialised: a reduction's value is computed in registers,
       and the chain of elementwise boxes after it (scale, mask, bias, activation) is fused
       into its epilogue; the end of the chain is written once, to shared memory or straight
       to the output (``materialisation targets``);
    4. ``_mappings``    threads per phase: contractions with two output axes use per-thread
       *register micro-tiles* (``MR x MC`` accumulators in ``cuda.local.array``, indexed
       by constants in loops NVVM unrolls, operand fragments read from 16-byte aligned shared
       memory); reductions with few outputs use groups of lanes per output (row reductions:
       warp shuffles on a GPU, a shared-memory tree under the simulator; groups beyond the
       outputs, as when a tile of 3 rows meets 4 groups or 48 threads, take part in the group
       reductions and barriers but run empty loops and write nothing); the rest is a flat
       element loop;
    5. ``_layouts`` / ``_buffers``  shared-memory layout (the axis a micro-tile reads along is
       made contiguous) and offsets in one dynamic shared-memory array;
    6. ``emit``         the source text.

Rules that keep the GPU busy (each read off the loop nest, none keyed on a diagram)
    * **scores in registers** (:class:`FusedScores`): a normalising accumulator (online softmax,
      normalised contraction) whose score input is a contraction read by nothing else, when one
      ``TY x TX`` thread grid serves both micro-tiles (same rows per thread, the ``TX`` lanes of a
      row an aligned group of one warp): row max / sum by lane reductions (warp shuffles; shared
      memory under the simulator), ``o *= delta`` in registers, the weights through a
      warp-private staging area (``syncwarp``), one block barrier per chunk after the loads;
    * **unrolled reduction steps**: a micro-tile's innermost reduction loop is written out
      ``CONTRACTION_UNROLL`` times per iteration when its step count is static;
    * **loads**: fixed trip counts (all loads in flight before the first store); consecutive
      threads walk global order (coalesced), and a chunk buffer laid out transposed gets rows
      padded by ``TRANSPOSE_PAD`` floats (16-byte alignment kept, stores spread over banks);
    * ``prefetch=True``: each chunk's inputs are fetched into registers one chunk ahead;
      ``prefetch="double"``: two shared buffers per chunked input, chunk c + 1 fetched into
      registers while chunk c is computed, then stored into the other buffer: one barrier per
      chunk;
    * **launch bounds**: as many blocks per SM as shared memory allows when the register
      estimate fits (never below ``REGISTER_FLOOR`` registers), so the compiler keeps to them;
    * **longest blocks first**: when a causal mask bounds a stream loop by the tile's rows, the
      grid is one dimension with that tile index slowest and reversed.

Accumulator states live where the final form's levels say: ``registers`` -> in the registers of
the threads that own the elements (the update's thread mapping is fixed for the whole stream
loop), ``SMEM`` (or above) -> shared memory.  Ragged tiles and chunks are handled by
zero-filled loads, loop bounds on the valid part of a chunk, and bounds checks on stores.
Masks and index biases read global indices (tile or chunk start plus local index).
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field
from typing import Callable

from ..relabel.accumulators import ACC_RULES, Accumulator
from ..core.diagram import Diagram
from ..core.errors import LoweringError
from ..relabel.loopnest import Compute, Finalise, FinalForm, Init, Load, Loop, Store, Update, final_form
from ..ops.index import constant_value
from ..ops.kinds import NORMALISATIONS
from .source import Constants, Names, Source

# --------------------------------------------------------------------------- box kind rules


@dataclass(frozen=True)
class KindRule:
    """How one box kind lowers.  ``cls``: ``elementwise`` (an expression evaluated wherever the
    value is read), ``reduction`` (a phase with inner loops), ``normaliser`` (row statistics,
    then an expression) or ``unsupported``; ``check(box)`` gives the reason a particular box
    cannot lower (or None); ``expr(gen, box, args, env)`` renders an elementwise value."""

    cls: str
    check: Callable | None = None
    expr: Callable | None = None


def _fn_expr(gen: "KernelGen", fn: str, args: list[str], c=None) -> str:
    k = gen.consts
    a = args[0] if args else ""
    if fn == "exp":
        return f"math.exp({a})"
    if fn == "log":
        return f"math.log({a})"
    if fn == "neg":
        return f"-{a}"
    if fn == "abs":
        return f"abs({a})"
    if fn == "square":
        return f"{a} * {a}"
    if fn == "sqrt":
        return f"math.sqrt({a})"
    if fn == "rsqrt":
        return f"{k.f(1.0, 'ONE')} / math.sqrt({a})"
    if fn == "relu":
        return f"max({a}, {k.f(0.0, 'ZERO')})"
    if fn == "gelu":
        return (f"{k.f(0.5, 'HALF')} * {a} * ({k.f(1.0, 'ONE')} + "
                f"math.erf({a} * {k.f(1 / math.sqrt(2.0), 'INV_SQRT2')}))")
    # sigmoid / silu: exp of a non-positive argument only, so no overflow (the simulator's
    # math.exp raises where a GPU gives inf); NaN propagates (docs/NAN_POLICY.md)
    if fn == "sigmoid":
        one, zero = k.f(1.0, "ONE"), k.f(0.0, "ZERO")
        return (f"({one} / ({one} + math.exp(-{a})) if {a} >= {zero} else "
                f"math.exp({a}) / ({one} + math.exp({a})))")
    if fn == "silu":
        one, zero = k.f(1.0, "ONE"), k.f(0.0, "ZERO")
        return (f"({a} / ({one} + math.exp(-{a})) if {a} >= {zero} else "
                f"{a} * math.exp({a}) / ({one} + math.exp({a})))")
    if fn == "tanh":
        return f"math.tanh({a})"
    if fn == "recip":
        return f"{k.f(1.0, 'ONE')} / {a}"
    if fn == "identity":
        return a
    if fn == "sign":
        one, zero = k.f(1.0, "ONE"), k.f(0.0, "ZERO")
        return f"({one} if {a} > {zero} else (-{one} if {a} < {zero} else {a}))"  # 0 or NaN stays
    if fn == "scale":
        return f"{a} * {c}"
    if fn == "shift":
        return f"{a} + {c}"
    b = args[1] if len(args) > 1 else ""
    if fn == "add":
        return f"{a} + {b}"
    if fn == "sub":
        return f"{a} - {b}"
    if fn == "mul":
        return f"{a} * {b}"
    if fn == "div":
        return f"{a} / {b}"
    if fn == "maximum":   # NaN in either argument propagates, as np.maximum / torch.maximum
        return f"(max({a}, {b}) if {b} == {b} else {b})"
    raise LoweringError(f"no numba.cuda expression for elementwise function {fn!r}")


def _expr_map(gen, box, args, env):
    fn = box.param("fn")
    c = None
    if fn in ("scale", "shift"):
        value = constant_value(box.param("c"), gen.sizes)
        c = gen.consts.f(value, f"C_{fn.upper()}", comment=f"{box.name} constant")
    return _fn_expr(gen, fn, [f"({x})" if _compound(x) else x for x in args], c)


def _compound(x: str) -> bool:
    return any(ch in x for ch in " +-*/") and not (x.startswith("(") and x.endswith(")"))


def _check_mask(box):
    if box.param("pred").kind not in ("causal", "window"):
        return (f"{box.name}: a custom predicate is a Python function on index arrays; only "
                f"causal(offset) and window(left, right) lower to numba.cuda")
    return None


def _expr_mask(gen, box, args, env):
    i = gen.gidx(box.param("row"), env)
    j = gen.gidx(box.param("col"), env)
    pred = box.param("pred")
    k = gen.consts
    conds = []
    if pred.kind == "causal":
        off = pred.args[0]
        if off >= 0:
            conds.append(f"{j} <= {i} + {k.u(off)}" if off else f"{j} <= {i}")
        else:
            conds.append(f"{j} + {k.u(-off)} <= {i}")
    else:  # window: i - left <= j <= i + right
        left, right = pred.args
        conds.append(f"{i} <= {j} + {k.u(left)}" if left else f"{i} <= {j}")
        conds.append(f"{j} <= {i} + {k.u(right)}" if right else f"{j} <= {i}")
    return f"{args[0]} if {' and '.join(conds)} else {k.f(-math.inf, 'NEG_INF')}"


def _check_index_bias(box):
    if box.param("bias").kind != "alibi":
        return f"{box.name}: a custom index bias is a Python function; only alibi(slope) lowers"
    return None


def _expr_index_bias(gen, box, args, env):
    i = gen.gidx(box.param("row"), env)
    j = gen.gidx(box.param("col"), env)
    slope = gen.consts.f(box.param("bias").args[0], "SLOPE", comment=f"{box.name} slope")
    return f"{args[0]} + {slope} * (float32({j}) - float32({i}))"


def _check_reindex(box):
    if box.param("op") != "transpose":
        return (f"{box.name}: reindexing ({box.param('op')}) changes the index space; only "
                f"transposes (renamings of the same named axes) lower")
    return None


def _expr_identity(gen, box, args, env):
    return args[0]


def _check_cast(box):
    if box.cod[0].dtype.name not in ("f32", "f64"):
        return (f"{box.name}: cast to {box.cod[0].dtype.name}; the numba.cuda target computes "
                f"and stores fp32 only")
    return None


def _expr_const(gen, box, args, env):
    return gen.consts.f(box.param("value"), comment=f"{box.name}")


def _check_reduce(box):
    return None


CODEGEN_RULES: dict[str, KindRule] = {
    "contract": KindRule("reduction"),
    "map": KindRule("elementwise", None, _expr_map),
    "reduce": KindRule("reduction", _check_reduce),
    "softmax": KindRule("normaliser"),
    "normalize": KindRule("normaliser"),
    "mask": KindRule("elementwise", _check_mask, _expr_mask),
    "index_bias": KindRule("elementwise", _check_index_bias, _expr_index_bias),
    "reindex": KindRule("elementwise", _check_reindex, _expr_identity),
    "param": KindRule("unsupported", lambda box: (
        f"parameter {box.param('pname')!r} is a value bound at evaluation time; pass it to the "
        f"kernel as an input of the diagram instead")),
    "const": KindRule("elementwise", None, _expr_const),
    "cast": KindRule("elementwise", _check_cast, _expr_identity),
    "softmax_contract": KindRule("unsupported", lambda box: (
        f"{box.name} is only lowered as a streamed accumulator: stream axis "
        f"{box.param('axis')} (or write softmax followed by contract)")),
    "norm_contract": KindRule("unsupported", lambda box: (
        f"{box.name} is only lowered as a streamed accumulator: stream axis "
        f"{box.param('axis')} (or write normalize followed by contract)")),
}

# reductions: identity, binary combine, group (cross-thread) helper
REDUCE_OPS = {
    "sum": (0.0, "{a} + {b}", "_group_sum"),
    "mean": (0.0, "{a} + {b}", "_group_sum"),
    "max": (-math.inf, "max({a}, {b})", "_group_max"),
    "min": (math.inf, "min({a}, {b})", "_group_min"),
}


# --------------------------------------------------------------------------- kernel structure


@dataclass
class KAxis:
    """An axis as the kernel sees it.  ``role``: ``grid`` (tiled), ``batch`` (tiled by 1, on
    ``blockIdx.y``), ``stream`` (a loop in the block) or ``full`` (whole axis in the block)."""

    name: str
    size: int
    role: str
    cap: int
    size_c: str = ""      # constant: global size
    cap_c: str = ""       # constant: tile / chunk extent
    start: str | None = None   # variable: global index of local index 0
    count: str = ""       # valid extent here: a constant, or a variable for ragged tiles
    index: str = ""       # loop / decode variable for the local index

    @property
    def ragged(self) -> bool:
        return self.role in ("grid", "stream") and self.size % self.cap != 0


@dataclass
class SBuf:
    """A shared-memory buffer: a view ``smem[offset:offset+size]`` with a row-major layout over
    ``axes`` (those with extent > 1)."""

    key: tuple
    name: str
    axes: tuple[str, ...]
    caps: tuple[int, ...]
    what: str
    offset: int = 0
    copies: int = 1              # 2: double-buffered chunks (``cur`` names the copy in use)
    cur: str | None = None
    pad: int = 0                 # extra floats per row of the last axis (bank spreading)

    @property
    def ld(self) -> int:
        """Floats between consecutive indices of the second-to-last axis."""
        return self.caps[-1] + self.pad if self.caps else 1

    @property
    def elems(self) -> int:
        return max(1, math.prod(self.caps[:-1]) * self.ld) if self.caps else 1

    @property
    def stride(self) -> int:
        """Floats per copy, rounded up to 16 bytes."""
        return -(-self.elems // 4) * 4

    @property
    def size(self) -> int:
        return self.elems if self.copies == 1 else self.copies * self.stride


@dataclass
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


@dataclass
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


@dataclass
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


@dataclass
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


@dataclass
class FusedScores:
    """A normalising accumulator whose score input stays in registers: the scores' contraction
    runs on micro-tile ``ms`` (rows: the statistics axis, columns: the streamed axis) with the
    same thread -> row ownership as the accumulator's main micro-tile, so row statistics are
    reductions among the lanes of a row (warp shuffles) and the weights reach the main
    contraction through a warp-private shared-memory staging area."""

    target: int      # the score variable (end of its fused elementwise chain)
    source: int      # the contraction's output
    ms: Micro


def _paren(expr: str) -> str:
    """``expr`` parenthesised unless it is a name, a call or already parenthesised."""
    depth = 0
    for ch in expr:
        depth += ch in "([" 
        depth -= ch in ")]"
        if depth == 0 and ch in "+-*/% ":
            return f"({expr})"
    return expr


IDLE_START = 0x7FFFFFFF
"""First index of an idle lane group's loops (past every bound: the loops are empty)."""

TRANSPOSE_PAD = 4
"""Floats added to each row of a shared buffer written transposed from global memory."""

FUSE_SCORES = True
"""Keep a normalising accumulator's scores in registers where :class:`FusedScores` applies."""

REGISTER_FLOOR = 128
"""Registers per thread below which the launch bounds never push the compiler."""

REGISTER_SLACK = 16
"""Registers for indices and addresses in :meth:`KernelGen.register_estimate`."""

CONTRACTION_UNROLL = 8
"""Steps of a contraction's innermost reduction loop written out per iteration of the emitted
loop (when the step count is static and divisible; 1 turns it off)."""


def _unroll_factor(limit: int, n: int) -> int:
    u = max(1, int(limit))
    while u > 1 and n % u:
        u //= 2
    return u


def _vec(r: int) -> int:
    for v in (4, 2):
        if r % v == 0:
            return v
    return 1


@dataclass
class Target:
    """A value written once per program point: ``var`` (the end of an elementwise chain) computed
    from ``source`` (a reduction or an accumulator's output, fused into the same phase) or from
    shared-memory values alone (``source is None``)."""

    var: int
    source: int | None
    to_smem: bool
    to_global: bool
    mapping: object = None


@dataclass
class AccPlan:
    index: int
    acc: Accumulator
    main: object                       # Micro or Flat over the output axes
    main_regs: bool
    stat_regs: bool = True
    stat: Coop | None = None           # row statistics (online softmax, normalised)
    stat_axes: tuple[str, ...] = ()
    p_buf: tuple | None = None         # key of the buffer holding a1(s) / exp(s - mu)
    names: dict = field(default_factory=dict)
    fused: FusedScores | None = None   # scores kept in registers (see FusedScores)


@dataclass
class Operand:
    """A factor of a contraction: the axes it depends on and how to read it at an index."""

    axes: frozenset
    read: Callable  # (env, memo) -> expression


# --------------------------------------------------------------------------- the generator

MAX_THREADS = 1024
"""Threads per block on every CUDA device."""

PREFETCH_MODES = (False, True, "double")


def _check_micro(micro):
    """``micro`` as ``(rows, cols)`` of positive ints (register accumulators per thread), or None."""
    if micro is None:
        return None
    ok = isinstance(micro, (tuple, list)) and len(micro) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in micro)
    if not ok:
        raise LoweringError(f"micro must be (rows, cols): two positive ints (register accumulators per "
                            f"thread along each axis of a micro-tile), got {micro!r}")
    return tuple(micro)


RESERVED = {"tid", "smem", "bx", "by", "cuda", "math", "float32", "uint32", "lane", "e", "i", "j",
            "u", "k", "ty", "tx", "acc", "val", "SIMULATOR", "SMEM_ALIGN", "WARP_SHUFFLE",
            "FULL_MASK", "simulator_active", "red_s"}


class KernelGen:
    """Plan and emit one kernel for a relabelled diagram with every size bound."""

    def __init__(self, d: Diagram, name: str, threads: int, batch_axes=(), fastmath: bool = True,
                 micro: tuple[int, int] | None = None, prefetch: bool | str = False,
                 unroll: int | None = None):
        self.d = d
        self.name = name
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise LoweringError(f"threads must be an int from 1 to {MAX_THREADS} (threads per block), "
                                f"got {threads!r}")
        self.T = threads
        self.batch_axes = tuple(batch_axes)
        self.fastmath = fastmath
        self.micro_override = _check_micro(micro)
        if prefetch not in PREFETCH_MODES or not isinstance(prefetch, (bool, str)):
            raise LoweringError(f"prefetch must be one of {PREFETCH_MODES} (False: no prefetch, True: into "
                                f"registers one chunk ahead, 'double': two shared buffers per chunk), "
                                f"got {prefetch!r}")
        self.prefetch = prefetch
        self.unroll = CONTRACTION_UNROLL if unroll is None else int(unroll)
        self.ff: FinalForm = final_form(d)
        self.dd = self.ff.diagram
        self.types = self.dd.var_types()
        self.n_in = len(self.dd.dom)
        self.names = Names(RESERVED | set(keyword.kwlist))
        self.consts = Constants(self.names)
        self.sizes = {a.name: a.size for a in self.dd.axes}
        self.notes: list[str] = []
        self.consts.u(self.T, "NTHREADS", comment="threads per block")
        self._axes()
        self._structure()
        self._classify()
        self._targets()
        self._accumulators()
        self._mappings()
        self._fuse_scores()
        self._layouts()
        self._buffers()

    # ------------------------------------------------------------------ 1. axes
    def _axes(self):
        k = self.consts
        self.ax: dict[str, KAxis] = {}
        grid = []
        nodes = self.ff.body
        while len(nodes) == 1 and isinstance(nodes[0], Loop) and nodes[0].kind == "grid":
            grid.append(nodes[0])
            nodes = nodes[0].body
        for n, _ in self.ff.walk():
            if isinstance(n, Loop) and n.kind == "grid" and n not in grid:
                raise LoweringError(f"grid loop over {n.axis} inside another loop: tiles must be "
                                    f"outermost")
        self.grid_loops = tuple(grid)
        self.inner = nodes
        for a in self.dd.axes:
            if not isinstance(a.size, int):
                raise LoweringError(f"axis {a.name} has no size")
            self.ax[a.name] = KAxis(a.name, a.size, "full", a.size)
        for lp in grid:
            a = self.ax[lp.axis]
            a.role = "batch" if lp.axis in self.batch_axes else "grid"
            a.cap = int(lp.step)
        streamed = {}
        for n, loops in self.ff.walk():
            if isinstance(n, Loop) and n.kind == "stream":
                if n.axis in streamed or any(lp.axis == n.axis for lp in loops):
                    raise LoweringError(f"axis {n.axis} is streamed twice (a sub-stream); the "
                                        f"numba.cuda lowering streams each axis once")
                if self.ax[n.axis].role != "full":
                    raise LoweringError(f"axis {n.axis} is both tiled and streamed; the numba.cuda "
                                        f"lowering needs one partition per axis")
                streamed[n.axis] = n
                self.ax[n.axis].role = "stream"
                self.ax[n.axis].cap = int(n.step)
        init_loops = {n.acc: loops for n, loops in self.ff.walk() if isinstance(n, Init)}
        for n, loops in self.ff.walk():
            if isinstance(n, Update):
                acc = self.ff.accumulators[n.acc]
                for lp in loops[len(init_loops.get(n.acc, ())):]:
                    if lp.kind == "stream" and lp.axis != acc.axis:
                        # every buffer has one extent per axis (tile, chunk or whole): a state of
                        # the whole axis updated a chunk at a time has two
                        raise LoweringError(
                            f"stream {lp.axis} nests inside stream {acc.axis} and updates "
                            f"{acc.box.name}'s accumulator one {lp.axis}-chunk slice at a time; the "
                            f"numba.cuda lowering keeps accumulator states at the extent of the loops "
                            f"around them: use order({lp.axis!r}, {acc.axis!r})")
        for a in self.ax.values():
            a.size_c = k.u(a.size, f"N_{a.name}", comment=f"size of axis {a.name}")
            if a.role == "grid":
                a.cap_c = k.u(a.cap, f"TILE_{a.name}", comment=f"tile of {a.name}")
            elif a.role == "stream":
                a.cap_c = k.u(a.cap, f"CHUNK_{a.name}", comment=f"chunk of {a.name}")
            elif a.role == "batch":
                a.cap_c = k.u(1, "U1")
            else:
                a.cap_c = a.size_c
            if a.role in ("grid", "batch", "stream"):
                a.start = self.names.fresh(f"{a.name}0")
            a.count = self.names.fresh(f"len_{a.name}") if a.ragged else a.cap_c
            a.index = self.names.fresh(f"i_{a.name}")

    # ------------------------------------------------------------------ structure
    def _structure(self):
        self.loops_of: dict[int, tuple] = {}
        self.scope_of: dict[int, tuple] = {}
        self.def_node: dict[int, object] = {}
        self.load_of: dict[int, Load] = {}
        for n, loops in self.ff.walk():
            self.loops_of[id(n)] = loops
            scope = tuple(lp for lp in loops if lp.kind == "stream")
            self.scope_of[id(n)] = scope
            if isinstance(n, Load):
                if n.var in self.load_of:
                    raise LoweringError(f"input {self.types[n.var]} is loaded twice")
                self.load_of[n.var] = n
                self.def_node[n.var] = n
                for a in self.types[n.var].axis_names:
                    if self.ax[a].role == "stream" and not any(lp.axis == a for lp in scope):
                        raise LoweringError(f"input {self.types[n.var]} is read outside the "
                                            f"stream loop over {a}; load it inside")
            elif isinstance(n, Compute):
                for v in self.dd.eqn_outputs(n.eqn):
                    self.def_node[v] = n
            elif isinstance(n, Finalise):
                for v in self.dd.eqn_outputs(self.ff.accumulators[n.acc].eqn):
                    self.def_node[v] = n
        self.consumers: dict[int, list[tuple]] = {v: [] for v in range(len(self.types))}
        for n, _ in self.ff.walk():
            if isinstance(n, Compute):
                for v in self.dd.eqns[n.eqn].ins:
                    self.consumers[v].append(("eqn", n.eqn))
            elif isinstance(n, Update):
                for v in self.dd.eqns[self.ff.accumulators[n.acc].eqn].ins:
                    self.consumers[v].append(("acc", n.acc))
        for v in self.dd.outs:
            self.consumers[v].append(("out",))
        self.eqn_of: dict[int, int] = {}
        for k in range(len(self.dd.eqns)):
            for v in self.dd.eqn_outputs(k):
                self.eqn_of[v] = k
        self.acc_of_var: dict[int, int] = {}
        for i, acc in enumerate(self.ff.accumulators):
            for v in self.dd.eqn_outputs(acc.eqn):
                self.acc_of_var[v] = i
        for arr in list(self.dd.dom) + list(self.dd.cod):
            if arr.dtype.name != "f32":
                raise LoweringError(f"wire {arr} has dtype {arr.dtype.name}; the numba.cuda target "
                                    f"takes and returns fp32 arrays")
            n = math.prod(a.size for a in arr.axes)
            if n >= 2 ** 32:
                raise LoweringError(f"wire {arr} has {n} elements; the numba.cuda kernels index "
                                    f"arrays with 32-bit unsigned integers (fewer than 2**32 elements)")

    # ------------------------------------------------------------------ 2. classify
    def _classify(self):
        self.cls: dict[int, str] = {}
        acc_eqns = {a.eqn for a in self.ff.accumulators}
        for k, e in enumerate(self.dd.eqns):
            if k in acc_eqns:
                if e.box.kind == "reduce" and e.box.param("op") not in (*REDUCE_OPS, "logsumexp"):
                    raise LoweringError(f"{e.box.name}: no numba.cuda accumulator for {e.box.param('op')}")
                self.cls[k] = "accumulator"
                continue
            rule = CODEGEN_RULES.get(e.box.kind)
            if rule is None:
                raise LoweringError(f"no numba.cuda rule for box kind {e.box.kind!r} (box {e.box.name})")
            why = rule.check(e.box) if rule.check else None
            if rule.cls == "unsupported" or why:
                raise LoweringError(f"cannot lower {e.box.name}: {why}")
            if len(e.box.cod) != 1:
                raise LoweringError(f"{e.box.name} has {len(e.box.cod)} outputs; lowered boxes have one")
            self.cls[k] = rule.cls

    def var_cls(self, v: int) -> str:
        if v < self.n_in:
            return "input"
        return self.cls[self.eqn_of[v]]

    # ------------------------------------------------------------------ 3. materialisation
    def _axes_set(self, v: int) -> frozenset:
        return frozenset(a for a in self.types[v].axis_names if self.ax[a].cap > 1)

    def _chain_top(self, c: int) -> int:
        """Follow single-consumer elementwise boxes from ``c`` while they keep its axes."""
        u = c
        scope = self.scope_of[id(self.def_node[c])]
        while u not in self.dd.outs:
            cons = self.consumers[u]
            if len(cons) != 1 or cons[0][0] != "eqn":
                break
            k = cons[0][1]
            if self.cls[k] != "elementwise":
                break
            (out,) = self.dd.eqn_outputs(k)
            if self._axes_set(out) != self._axes_set(c) or self.scope_of[id(self.def_node[out])] != scope:
                break
            u = out
        return u

    def _targets(self):
        self.targets: dict[int, Target] = {}
        self.absorbed: dict[int, int] = {}
        sources = [v for v in sorted(self.eqn_of) if self.var_cls(v) == "reduction"]
        sources += sorted(self.acc_of_var)
        for c in sorted(sources):
            u = self._chain_top(c)
            if u != c and u in self.targets:
                u = c
            self.targets[u] = Target(u, c, False, False)
            if u != c:
                self.absorbed[c] = u
        for v in self.dd.outs:
            if v >= self.n_in and v not in self.targets:
                self.targets[v] = Target(v, None, False, False)
        for t in self.targets.values():
            t.to_global = t.var in self.dd.outs
            t.to_smem = any(c[0] != "out" for c in self.consumers[t.var])

    def storage(self, v: int) -> str:
        if v < self.n_in:
            return "load"
        if v in self.targets:
            return "smem" if self.targets[v].to_smem else "global"
        if v in self.absorbed:
            return "regs"
        return "inline"

    # ------------------------------------------------------------------ 4. thread mappings
    def _caps(self, axes) -> tuple[tuple[str, ...], tuple[int, ...]]:
        names = tuple(a for a in axes if self.ax[a].cap > 1)
        return names, tuple(self.ax[a].cap for a in names)

    def micro_for(self, axes: tuple[str, ...]) -> Micro | None:
        names, caps = self._caps(axes)
        if len(names) != 2:
            return None
        row, col = names
        cr, cc = caps
        if self.micro_override:
            RY, RX = self.micro_override
            if cr % RY == 0 and cc % RX == 0 and (cr // RY) * (cc // RX) <= self.T:
                return Micro(row, col, cr, cc, RY, RX, cr // RY, cc // RX)
            note = (f"micro={self.micro_override} not used over ({row}, {col}): it must divide the "
                    f"extents ({cr}, {cc}) with at most {self.T} threads; chosen automatically.")
            if note not in self.notes:
                self.notes.append(note)
        best, best_score = None, None
        for RY in range(1, 9):
            if cr % RY:
                continue
            for RX in range(1, 9):
                if cc % RX:
                    continue
                TY, TX = cr // RY, cc // RX
                n = TY * TX
                if n > self.T:
                    continue
                score = (n, RX % 4 == 0, RY % 4 == 0, -abs(math.log(RY / RX)))
                if best_score is None or score > best_score:
                    best, best_score = Micro(row, col, cr, cc, RY, RX, TY, TX), score
        if best is None or 2 * best.active < min(self.T, cr * cc):
            return None
        return best

    def coop_for(self, axes: tuple[str, ...]) -> Coop:
        names, caps = self._caps(axes)
        n = max(1, math.prod(caps))
        R = 1
        while R * 2 * n <= self.T and R * 2 <= self.T:
            R *= 2
        if self.T % R:
            R = 1
        return Coop(names, caps, self.T, R)

    def flat_for(self, axes: tuple[str, ...]) -> Flat:
        names, caps = self._caps(axes)
        return Flat(names, caps, self.T)

    def _reduced_axes(self, k: int) -> tuple[str, ...]:
        box = self.dd.eqns[k].box
        if box.kind == "reduce":
            return (box.param("axis"),)
        out = set(box.cod[0].axis_names)
        seen = []
        for arr in box.dom:
            for a in arr.axis_names:
                if a not in out and a not in seen:
                    seen.append(a)
        return tuple(seen)

    def _mappings(self):
        for t in self.targets.values():
            out_axes = self.types[t.var].axis_names
            if t.source is None:
                t.mapping = self.flat_for(out_axes)
            elif t.source in self.acc_of_var:
                t.mapping = self.plans[self.acc_of_var[t.source]].main
            else:
                k = self.eqn_of[t.source]
                box = self.dd.eqns[k].box
                red = self._reduced_axes(k)
                red_n = math.prod(self.ax[a].cap for a in red)
                n_out = math.prod(self.ax[a].cap for a in out_axes if self.ax[a].cap > 1)
                m = self.micro_for(out_axes) if box.kind == "contract" and red else None
                if m is None and (2 * n_out <= self.T and red_n > 1 or box.param("op", "") == "logsumexp"):
                    m = self.coop_for(out_axes)
                t.mapping = m or self.flat_for(out_axes)
        self.norm_stats: dict[int, Coop] = {}
        for k, c in self.cls.items():
            if c == "normaliser":
                box = self.dd.eqns[k].box
                stat = tuple(a for a in box.dom[0].axis_names if a != box.param("axis"))
                self.norm_stats[k] = self.coop_for(stat)

    # ------------------------------------------------------------------ accumulators
    def _accumulators(self):
        self.plans: list[AccPlan] = []
        init_loops = {}
        for n, loops in self.ff.walk():
            if isinstance(n, Init):
                init_loops[n.acc] = loops
        for i, acc in enumerate(self.ff.accumulators):
            if acc.rule not in ACC_CODEGEN:
                raise LoweringError(f"no numba.cuda code for accumulator {acc.rule!r} ({acc.box.name})")
            loops = init_loops[i]
            out_axes = acc.box.cod[0].axis_names
            kind = ACC_CODEGEN[acc.rule]
            main = (self.micro_for(out_axes) if kind.contraction else None) or self.flat_for(out_axes)
            main_regs = self.ff.state_level(acc, "main", loops) == "registers"
            stat_regs = self.ff.state_level(acc, "stat", loops) == "registers"
            plan = AccPlan(i, acc, main, main_regs, stat_regs)
            if kind.stats:
                plan.stat_axes = tuple(a for a in acc.box.dom[0].axis_names if a != acc.axis)
                plan.stat = self.coop_for(plan.stat_axes)
            self.plans.append(plan)

    # ------------------------------------------------------------------ scores in registers
    def _fuse_scores(self):
        """A normalising accumulator (row statistics, weights, contraction with the weights) fed
        by a contraction whose only reader it is keeps the scores in registers when one thread
        mapping serves both contractions: rows of the statistics axis owned by the same thread
        in both micro-tiles, the lanes of a row an aligned group inside one warp, every thread
        active.  Then the statistics are lane reductions (warp shuffles), the rescale is applied
        to the main state in registers, and the weights go through a warp-private staging area
        (``syncwarp``, no block barrier): the scores never make a round trip through a shared
        buffer that the whole block synchronises on."""
        self.fused_targets: dict[int, int] = {}
        updates = {n.acc: n for n, _ in self.ff.walk() if isinstance(n, Update)}
        for p in (self.plans if FUSE_SCORES else []):
            kind = ACC_CODEGEN[p.acc.rule]
            if not (kind.stats and p.main_regs and p.stat_regs and isinstance(p.main, Micro)):
                continue
            s, v = self.dd.eqns[p.acc.eqn].ins
            t = self.targets.get(s)
            if (t is None or t.source is None or t.source in self.acc_of_var or t.to_global
                    or not isinstance(t.mapping, Micro)):
                continue
            if self.dd.eqns[self.eqn_of[t.source]].box.kind != "contract":
                continue
            if self.consumers[s] != [("acc", p.index)]:
                continue
            if self.scope_of[id(self.def_node[s])] != self.scope_of[id(updates[p.index])]:
                continue
            rows = [a for a in p.stat_axes if self.ax[a].cap > 1]
            x = p.acc.axis
            if len(rows) != 1 or {t.mapping.row, t.mapping.col} != {rows[0], x}:
                continue
            r = rows[0]
            if r not in (p.main.row, p.main.col):
                continue
            dcol = p.main.col if p.main.row == r else p.main.row
            joint = self._joint_micro(r, x, dcol)
            if joint is None:
                continue
            ms, mo = joint
            t.mapping, t.to_smem = ms, False
            p.main, p.stat, p.fused = mo, Rows(ms), FusedScores(s, t.source, ms)
            self.fused_targets[s] = p.index
            for tt in self.targets.values():
                if tt.source is not None and self.acc_of_var.get(tt.source) == p.index:
                    tt.mapping = mo

    def _joint_micro(self, r: str, x: str, dcol: str) -> tuple[Micro, Micro] | None:
        """Micro-tiles over ``(r, x)`` and ``(r, dcol)`` on the same ``TY x TX`` threads (all of
        them), ``TX`` a power of two <= 32: the lanes of a row are one aligned warp group."""
        cr, cs, co = self.ax[r].cap, self.ax[x].cap, self.ax[dcol].cap
        best, best_score = None, None
        TX = 1
        while TX <= 32:
            TY = self.T // TX
            if self.T % TX == 0 and cr % TY == 0 and cs % TX == 0 and co % TX == 0:
                RY, RXs, RXo = cr // TY, cs // TX, co // TX
                if max(RY, RXs, RXo) <= 8:
                    score = (RXs % 4 == 0, RXo % 4 == 0, RY % 4 == 0, -TX)
                    if best_score is None or score > best_score:
                        best_score = score
                        best = (Micro(r, x, cr, cs, RY, RXs, TY, TX), Micro(r, dcol, cr, co, RY, RXo, TY, TX))
            TX *= 2
        return best

    # ------------------------------------------------------------------ 5. layouts and buffers
    def _layouts(self):
        """Shared buffers read by a micro-tile along one axis put that axis last (contiguous)."""
        self.layout_pref: dict[tuple, str] = {}

        def prefer(key, axes: frozenset, m: Micro):
            if key in self.layout_pref:
                return
            has_r, has_c = m.row in axes, m.col in axes
            if has_r != has_c:
                self.layout_pref[key] = m.row if has_r else m.col

        for t in self.targets.values():
            if isinstance(t.mapping, Micro) and t.source is not None and t.source not in self.acc_of_var:
                box = self.dd.eqns[self.eqn_of[t.source]].box
                for v in self.dd.eqns[self.eqn_of[t.source]].ins:
                    if self.storage(v) in ("load", "smem"):
                        prefer(("var", v), self._axes_set(v), t.mapping)
        for p in self.plans:
            if isinstance(p.main, Micro) and ACC_CODEGEN[p.acc.rule].contraction:
                ins = self.dd.eqns[p.acc.eqn].ins
                if p.stat is not None:
                    # the weights keep the scores' layout: the row statistics read them along the
                    # streamed axis (contiguous), the micro-tile reads them as broadcasts
                    s, v = ins
                    if self.storage(v) in ("load", "smem"):
                        prefer(("var", v), self._axes_set(v), p.main)
                else:
                    for v in ins:
                        if self.storage(v) in ("load", "smem"):
                            prefer(("var", v), self._axes_set(v), p.main)

    def _buf(self, key, base: str, axes, what: str) -> SBuf:
        names = [a for a in axes if self.ax[a].cap > 1]
        last = self.layout_pref.get(key)
        if last in names:
            names = [a for a in names if a != last] + [last]
        b = SBuf(key, self.names.fresh(base), tuple(names), tuple(self.ax[a].cap for a in names), what)
        self.bufs[key] = b
        return b

    def _buffers(self):
        self.bufs: dict[tuple, SBuf] = {}
        double = self._double_buffered()
        chunked = {m.var for n, _ in self.ff.walk() if isinstance(n, Loop) and n.kind == "stream"
                   for m in n.body if isinstance(m, Load)}
        for v in sorted(self.load_of):
            arr = self.types[v]
            b = self._buf(("var", v), f"{arr.name}_s", arr.axis_names, f"input {arr.name}")
            names = [a for a in arr.axis_names if self.ax[a].cap > 1]
            if len(b.axes) >= 2 and names and b.axes[-1] != names[-1] and v in chunked:
                # a chunk written transposed (global order in, threads along the global last
                # axis): a row of 4 more floats keeps 16-byte alignment and spreads the stores
                b.pad = TRANSPOSE_PAD
                b.what += f" (transposed, rows padded by {TRANSPOSE_PAD})"
            if v in double:
                b.copies = 2
                b.what += " (two chunk buffers)"
        for t in sorted(self.targets.values(), key=lambda t: t.var):
            if t.to_smem:
                arr = self.types[t.var]
                self._buf(("var", t.var), f"{arr.name}_s", arr.axis_names, f"{arr.name} (materialised)")
        for k, coop in self.norm_stats.items():
            box = self.dd.eqns[k].box
            stat = tuple(a for a in box.dom[0].axis_names if a != box.param("axis"))
            self._buf(("norm_m", k), f"{box.cod[0].name}_max_s", stat, f"row max of {box.name}")
            self._buf(("norm_z", k), f"{box.cod[0].name}_sum_s", stat, f"row normaliser of {box.name}")
        for p in self.plans:
            acc, kind = p.acc, ACC_CODEGEN[p.acc.rule]
            oname = acc.box.cod[0].name
            for sname, axes, role in acc.states():
                regs = p.main_regs if role == "main" else p.stat_regs
                if not regs:
                    self._buf(("state", p.index, sname), f"{oname}_{sname}_s", axes,
                              f"state {sname} of {oname}")
            if p.fused is not None:
                # weights staged by the warp that owns their rows, laid out [streamed, rows] so
                # the main micro-tile reads a thread's rows as one vector
                ms = p.fused.ms
                key = ("p", p.index)
                self.bufs[key] = SBuf(key, self.names.fresh(f"{oname}_p_s"), (acc.axis, ms.row),
                                      (ms.cc, ms.cr), f"weights of {oname} (warp-private rows)")
                p.p_buf = key
            elif p.stat is not None:
                s, _ = self.dd.eqns[acc.eqn].ins
                p_axes = (*p.stat_axes, acc.axis)
                if (self.storage(s) == "smem" and len(self.consumers[s]) == 1
                        and self._axes_set(s) == frozenset(a for a in p_axes if self.ax[a].cap > 1)):
                    p.p_buf = ("var", s)   # overwrite the scores with the weights in place
                else:
                    self._buf(("p", p.index), f"{oname}_p_s", p_axes, f"weights of {oname}")
                    p.p_buf = ("p", p.index)
                if kind.rescales:
                    self._buf(("delta", p.index), f"{oname}_delta_s", p.stat_axes,
                              f"per-row rescale of {oname}")
                if p.stat_regs:
                    self._buf(("zpub", p.index), f"{oname}_z_s", p.stat_axes,
                              f"normaliser of {oname} at the end")
        if self._needs_scratch():
            self.bufs[("red",)] = SBuf(("red",), "red_s", ("_lanes",), (self.T,), "reduction scratch")
        off = 0
        for b in self.bufs.values():
            b.offset = off
            off += -(-b.size // 4) * 4   # 16-byte aligned offsets
        self.smem_floats = off

    def _double_buffered(self) -> set[int]:
        """Inputs loaded per chunk of a stream loop get two shared buffers with
        ``prefetch="double"``: chunk ``c + 1`` is fetched into registers while chunk ``c`` is
        computed from one buffer, then stored into the other; one barrier per chunk."""
        if self.prefetch != "double":
            return set()
        out = set()
        for n, _ in self.ff.walk():
            if isinstance(n, Loop) and n.kind == "stream":
                out |= {m.var for m in n.body if isinstance(m, Load)}
        return out

    def red_offset(self) -> str:
        b = self.bufs[("red",)]
        return b.name if b.offset else self.consts.u(0, "U0")

    def _needs_scratch(self) -> bool:
        if self.norm_stats or any(p.stat is not None for p in self.plans):
            return True
        return any(isinstance(t.mapping, Coop) for t in self.targets.values())

    @property
    def smem_bytes(self) -> int:
        return 4 * self.smem_floats

    def register_estimate(self) -> int:
        """Registers a thread needs, roughly: values live across a stream loop (accumulator
        states, scores kept in registers, chunks prefetched into registers), the largest
        fragment pair of a micro-tile, and ``REGISTER_SLACK`` for indices and addresses."""
        live, frag = 0, 0
        for p in self.plans:
            live += math.prod(p.main.shape)
            if p.stat is not None:
                live += len(p.acc.states()) - 1 if not isinstance(p.stat, Rows) else \
                    (len(p.acc.states()) - 1) * p.stat.micro.RY
            if p.fused is not None:
                live += p.fused.ms.RY * p.fused.ms.RX
        for t in self.targets.values():
            if isinstance(t.mapping, Micro):
                frag = max(frag, t.mapping.RY + t.mapping.RX)
        if self.prefetch:
            for n, _ in self.ff.walk():
                if isinstance(n, Loop) and n.kind == "stream":
                    live += sum(self._load_plan(m.var)[1] for m in n.body if isinstance(m, Load))
        return live + frag + REGISTER_SLACK

    def blocks_per_sm(self) -> int:
        """Blocks per SM for the launch bounds: as many as shared memory and threads allow when
        the :meth:`register_estimate` fits the registers that leaves (never fewer than
        ``REGISTER_FLOOR``); else 1, so the compiler keeps every value in registers (H100 / H200
        limits: the source does not depend on the machine)."""
        from .runtime import H100_DEFAULTS as lim
        by_smem = lim.max_shared_per_sm // (self.smem_bytes + lim.reserved_shared_per_block)
        by_threads = lim.max_threads_per_sm // self.T
        by_regs = lim.max_registers_per_sm // (self.T * max(REGISTER_FLOOR, self.register_estimate()))
        return max(1, min(by_smem, by_threads, by_regs, lim.max_blocks_per_sm))

    # ------------------------------------------------------------------ index helpers
    def gidx(self, axis: str, env: dict) -> str:
        """Global index of ``axis`` at the local index in ``env``."""
        a = self.ax[axis]
        local = env.get(axis) if a.cap > 1 else None
        if a.start is None:
            return local if local is not None else self.consts.u(0, "U0")
        return f"({a.start} + {local})" if local is not None else a.start

    def sidx(self, b: SBuf, env: dict) -> str:
        if b.key == ("red",):
            return env["_lanes"]
        if not b.axes:
            return self.consts.u(0, "U0")
        expr = env[b.axes[0]]
        for pos, a in enumerate(b.axes[1:], 1):
            mult = self.ax[a].cap_c
            if pos == len(b.axes) - 1 and b.pad:
                mult = self.consts.u(b.ld, f"LD_{b.name}", comment=f"padded row of {b.name}")
            expr = f"{_paren(expr)} * {mult} + {env[a]}"
        return expr

    def sread(self, key, env) -> str:
        b = self.bufs[key]
        idx = self.sidx(b, env)
        if b.cur:
            return f"smem[{b.cur} + {idx}]"
        return f"smem[{b.name} + {idx}]" if b.offset else f"smem[{idx}]"

    def garg(self, v: int) -> str:
        return self.arg_names[v]

    def gindex(self, arr, env) -> str:
        expr = None
        for a in arr.axis_names:
            g = self.gidx(a, env)
            expr = g if expr is None else f"{_paren(expr)} * {self.ax[a].size_c} + {g}"
        return expr if expr is not None else self.consts.u(0, "U0")

    def valid(self, axes, env) -> str | None:
        """Bounds checks for the ragged axes among ``axes``."""
        conds = [f"{env[a]} < {self.ax[a].count}" for a in axes
                 if self.ax[a].ragged and self.ax[a].cap > 1 and a in env]
        return " and ".join(conds) if conds else None

    # ------------------------------------------------------------------ values
    def value(self, v: int, env: dict, src: Source, memo: dict, regs: dict | None = None,
              define: int | None = None) -> str:
        """An expression for variable ``v`` at ``env``; inline boxes become temporaries.
        ``define``: the target being computed (read from its definition, not its buffer)."""
        regs = regs or {}
        if v in regs:
            return regs[v]
        if v in memo:
            return memo[v]
        st = "inline" if v == define else self.storage(v)
        if st in ("load", "smem"):
            expr = self.sread(("var", v), env)
        elif st == "inline" and self.var_cls(v) == "elementwise":
            k = self.eqn_of[v]
            e = self.dd.eqns[k]
            args = [self.value(a, env, src, memo, regs, define) for a in e.ins]
            expr = CODEGEN_RULES[e.box.kind].expr(self, e.box, args, env)
            tmp = self.names.fresh(f"{self.types[v].name}_{v}")
            src(f"{tmp} = {expr}")
            expr = tmp
        elif st == "inline" and self.var_cls(v) == "normaliser":
            expr = self._normalised_value(self.eqn_of[v], env, src, memo, regs, define)
        else:
            raise LoweringError(f"internal: {self.types[v]} (storage {st}) is not readable here")
        memo[v] = expr
        return expr

    # ------------------------------------------------------------------ emission
    def emit(self) -> str:
        self.arg_names = {}
        argn = Names(RESERVED | set(keyword.kwlist) | {a.start for a in self.ax.values() if a.start})
        for i, arr in enumerate(self.dd.dom):
            self.arg_names[i] = argn.fresh(arr.name)
        self.out_args = []
        for pos, v in enumerate(self.dd.outs):
            name = argn.fresh(self.dd.cod[pos].name if v >= self.n_in else self.dd.cod[pos].name + "_out")
            self.out_args.append(name)
            self.arg_names.setdefault(v, name)
            if v < self.n_in:
                self.arg_names[("out", pos)] = name
        self.names.used |= argn.used
        body = Source(1)
        self.pending_sync = False
        try:
            self._emit_prologue(body)
            self._emit_nodes(self.inner, body)
            return self._assemble(body)
        except ValueError as e:   # a constant beyond uint32 (Constants.u)
            if isinstance(e, LoweringError):
                raise
            raise LoweringError(f"{self.d.short()}: {e} (tiles, chunks and buffers must stay below "
                                f"2**32 elements)") from None

    def _assemble(self, body: Source) -> str:
        nt = self.consts.u(self.T, "NTHREADS", comment="threads per block")
        head = [f'"""{self.name}: generated by napkin_cat.lower (numba.cuda, fp32); do not edit.', "",
                f"Diagram: {self.d}", "", "Loop nest:"]
        head += ["    " + ln for ln in self.ff.pseudocode(memory=False).splitlines()]
        head += ["", f"Launch: grid {self.grid}, block ({self.T}, 1, 1), dynamic shared memory "
                 f"{self.smem_bytes} bytes"]
        head += [f"Shared memory: " + ", ".join(f"{b.name}[{' x '.join(map(str, b.caps)) or '1'}] ({b.what})"
                                                for b in self.bufs.values())]
        for note in self.notes:
            head.append(note)
        head.append('"""')
        lines = head + ["", "import math", "", "from numba import cuda, float32, uint32", "",
                        "from napkin_cat.lowering.runtime import simulator_active", "",
                        "SIMULATOR = simulator_active()",
                        "SMEM_ALIGN = None if SIMULATOR else 16  # 16-byte aligned shared memory "
                        "(128-bit loads); the simulator takes no alignment",
                        "WARP_SHUFFLE = not SIMULATOR  # the simulator has no warp shuffles: it "
                        "reduces through shared memory",
                        "FULL_MASK = 0xFFFFFFFF", ""]
        lines += self.consts.header()
        lines += [""]
        if self._needs_scratch():
            lines += _GROUP_HELPERS.splitlines() + [""]
        args = [self.arg_names[i] for i in range(self.n_in)] + self.out_args
        blocks = self.blocks_per_sm()
        lines += [f"# launch bounds: {blocks} block(s) of {self.T} threads per SM (shared memory "
                  f"{self.smem_bytes} B per block, about {self.register_estimate()} registers per thread "
                  f"estimated)",
                  f"LAUNCH_BOUNDS = {{}} if SIMULATOR else {{\"launch_bounds\": ({self.T}, {blocks})}}"]
        lines += ["", f"@cuda.jit(fastmath={self.fastmath}, **LAUNCH_BOUNDS)", f"def {self.name}({', '.join(args)}):"]
        lines += body.lines
        return "\n".join(lines) + "\n"

    def _emit_prologue(self, src: Source):
        k = self.consts
        src("tid = uint32(cuda.threadIdx.x)")
        if self.bufs:
            src("smem = cuda.shared.array(0, dtype=float32, alignment=SMEM_ALIGN)")
            for b in self.bufs.values():   # views are offsets: NVVM then sees aligned addresses
                if b.offset:
                    self.consts.reserved(b.name, b.offset, comment=f"shared offset of {b.what}"
                                  + (f", layout [{' '.join(b.axes)}]" if b.axes and b.key != ('red',) else "")
                                  + f", {b.size} floats")
        grid = [self.ax[lp.axis] for lp in self.grid_loops if self.ax[lp.axis].role == "grid"]
        batch = [self.ax[lp.axis] for lp in self.grid_loops if self.ax[lp.axis].role == "batch"]
        gx = math.prod(-(-a.size // a.cap) for a in grid)
        gy = math.prod(a.size for a in batch)
        self.heavy_last = self._heavy_last_axes()
        if gy > 65535 or (self.heavy_last and batch):
            # one grid dimension, tiled axes slowest: with heavy_last, blocks are launched in
            # decreasing order of work (the longest first keeps the last wave short)
            grid, batch = grid + batch, []
            gx, gy = gx * gy, 1
        self.grid = (gx, gy, 1)
        if grid:
            src("bx = uint32(cuda.blockIdx.x)")
            self._decode_blocks(src, "bx", grid)
        if batch:
            src("by = uint32(cuda.blockIdx.y)")
            self._decode_blocks(src, "by", batch)

    def _heavy_last_axes(self) -> set[str]:
        """Tiled axes whose later tiles stream more chunks: rows of causal masks that bound a
        stream loop (:meth:`_stream_bounds`)."""
        out = set()
        for n, _ in self.ff.walk():
            if isinstance(n, Loop) and n.kind == "stream":
                out |= {row for row, pred in self._skippable_masks(n) if pred.kind == "causal"}
        return out

    def _decode_blocks(self, src, var, axes):
        k = self.consts
        rest = var
        for pos, a in enumerate(reversed(axes)):
            tiles = -(-a.size // a.cap)
            tiles_c = k.u(tiles, f"TILES_{a.name}", comment=f"tiles along {a.name}") if a.role == "grid" else a.size_c
            last = pos == len(axes) - 1
            idx = rest if last else f"{rest} % {tiles_c}"
            if a.name in getattr(self, "heavy_last", ()) and a.role == "grid":
                idx = f"({k.u(tiles - 1)} - {_paren(idx)})"   # the most chunks first
            src(f"{a.start} = {idx} * {a.cap_c}" if a.role == "grid" else f"{a.start} = {idx}")
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            if not last:
                nxt = self.names.fresh(f"{var}_rest")
                src(f"{nxt} = {rest} // {tiles_c}")
                rest = nxt

    def sync(self, src: Source):
        if self.pending_sync:
            src("cuda.syncthreads()")
            self.pending_sync = False

    def _emit_nodes(self, nodes, src: Source):
        for n in nodes:
            if isinstance(n, Load):
                self._emit_load(n.var, src)
            elif isinstance(n, Compute):
                self._emit_compute(n.eqn, src)
            elif isinstance(n, Loop):
                self._emit_stream_loop(n, src)
            elif isinstance(n, Init):
                ACC_CODEGEN[self.ff.accumulators[n.acc].rule].init(self, self.plans[n.acc], src)
            elif isinstance(n, Update):
                ACC_CODEGEN[self.ff.accumulators[n.acc].rule].update(self, self.plans[n.acc], src)
            elif isinstance(n, Finalise):
                p = self.plans[n.acc]
                ACC_CODEGEN[p.acc.rule].publish(self, p, src)
                (v,) = self.dd.eqn_outputs(p.acc.eqn)
                if v in self.targets:
                    self._emit_target(self.targets[v], src)
            elif isinstance(n, Store):
                if n.var < self.n_in:
                    self._emit_input_store(n.var, src)
            else:  # pragma: no cover
                raise LoweringError(f"internal: unknown loop-nest node {n!r}")

    # ---- stream loops
    def _emit_stream_loop(self, lp: Loop, src: Source):
        if self.prefetch == "double" and any(isinstance(n, Load) for n in lp.body):
            return self._emit_double_buffered_loop(lp, src)
        a = self.ax[lp.axis]
        lo, hi = self._stream_bounds(lp, src)
        loads = [n for n in lp.body if isinstance(n, Load)] if self.prefetch else []
        if loads:
            src.comment(f"stream {a.name} in chunks of {a.cap}; each chunk's inputs are fetched into "
                        f"registers one chunk ahead, so the global loads overlap the compute")
            regs = {n.var: self.names.fresh(f"{self.types[n.var].name}_next") for n in loads}
            for n in loads:
                src(f"{regs[n.var]} = cuda.local.array({self._load_plan(n.var)[1]}, float32)")
            # a mask may start the loop past the axis (lo >= hi): then there is nothing to fetch
            with src.maybe(None if lo == self.consts.u(0, "U0") else f"{lo} < {hi}"):
                self._emit_fetch(loads, regs, lo, src, lp.axis)
        else:
            src.comment(f"stream {a.name} in chunks of {a.cap}")
        with src.block(f"for {a.start} in range({lo}, {hi}, {a.cap_c}):"):
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            if loads:
                for n in loads:
                    self._emit_load(n.var, src, regs[n.var])
                self.sync(src)
                nxt = self.names.fresh(f"{a.name}_next")
                src(f"{nxt} = {a.start} + {a.cap_c}")
                with src.block(f"if {nxt} < {hi}:"):
                    self._emit_fetch(loads, regs, nxt, src, lp.axis)
            body = [n for n in lp.body if not (loads and isinstance(n, Load))]
            self._emit_nodes(body, src)
            self.pending_sync = True
            self.sync(src)

    def _emit_double_buffered_loop(self, lp: Loop, src: Source):
        k = self.consts
        a = self.ax[lp.axis]
        lo, hi = self._stream_bounds(lp, src)
        loads = [n for n in lp.body if isinstance(n, Load)]
        bufs = [self.bufs[("var", n.var)] for n in loads]
        src.comment(f"stream {a.name} in chunks of {a.cap}, double-buffered: chunk c + 1 is fetched into "
                    f"registers while chunk c is computed from one shared buffer, then stored into the "
                    f"other; one barrier per chunk")
        regs = {n.var: self.names.fresh(f"{self.types[n.var].name}_next") for n in loads}
        for n in loads:
            src(f"{regs[n.var]} = cuda.local.array({self._load_plan(n.var)[1]}, float32)")
        with src.block(f"if {lo} < {hi}:"):
            self._emit_fetch(loads, regs, lo, src, lp.axis)
            for n, b in zip(loads, bufs):
                b.cur = b.name if b.offset else k.u(0, "U0")
                self._emit_load(n.var, src, regs[n.var])
        self.pending_sync = True
        self.sync(src)
        par = self.names.fresh(f"buf_{a.name}")
        src(f"{par} = {k.u(0, 'U0')}  # which copy holds the current chunk")
        with src.block(f"for {a.start} in range({lo}, {hi}, {a.cap_c}):"):
            if a.ragged:
                src(f"{a.count} = min({a.cap_c}, {a.size_c} - {a.start})")
            stride = {}
            for b in bufs:
                stride[b.name] = k.u(b.stride, f"STRIDE_{b.name}", comment=f"floats per copy of {b.name}")
                b.cur = self.names.fresh(f"{b.name}_cur")
                base = b.name if b.offset else k.u(0, "U0")
                src(f"{b.cur} = {base} + {par} * {stride[b.name]}")
            nxt = self.names.fresh(f"{a.name}_next")
            src(f"{nxt} = {a.start} + {a.cap_c}")
            with src.block(f"if {nxt} < {hi}:"):
                self._emit_fetch(loads, regs, nxt, src, lp.axis)
            body = [n for n in lp.body if not isinstance(n, Load)]
            self._emit_nodes(body, src)
            with src.block(f"if {nxt} < {hi}:"):
                cur = [b.cur for b in bufs]
                for n, b in zip(loads, bufs):
                    base = b.name if b.offset else k.u(0, "U0")
                    b.cur = self.names.fresh(f"{b.name}_other")
                    src(f"{b.cur} = {base} + ({k.u(1, 'U1')} - {par}) * {stride[b.name]}")
                    self._emit_load(n.var, src, regs[n.var])
                for b, c in zip(bufs, cur):
                    b.cur = c
            self.pending_sync = True
            self.sync(src)
            src(f"{par} = {k.u(1, 'U1')} - {par}")
        for b in bufs:
            b.cur = None

    def _load_plan(self, v: int):
        arr = self.types[v]
        names, caps = self._caps(arr.axis_names)
        n = max(1, math.prod(caps))
        return n, -(-n // self.T)

    def _emit_fetch(self, loads, regs, start: str, src: Source, axis: str):
        """Global -> registers for the chunk starting at ``start`` (a prefetch)."""
        k = self.consts
        for n in loads:
            arr = self.types[n.var]
            b = self.bufs[("var", n.var)]
            names, _ = self._caps(arr.axis_names)
            order = self._load_order(n.var)
            total, per = self._load_plan(n.var)
            ax = self.ax[axis]
            saved = (ax.start, ax.count)
            ax.start = start
            if ax.ragged:
                cnt = self.names.fresh(f"len_{ax.name}")
                src(f"{cnt} = min({ax.cap_c}, {ax.size_c} - {start})")
                ax.count = cnt
            with src.block(f"for u in range({k.u(per)}):"):
                src(f"e = tid + u * NTHREADS")
                with src.maybe(f"e < {k.u(total)}" if total % self.T else None):
                    env = {}
                    self._decode(src, "e", order, env)
                    g = f"{self.garg(n.var)}[{self.gindex(arr, env)}]"
                    cond = self.valid(names, env)
                    src(f"{regs[n.var]}[u] = {g} if {cond} else {k.f(0.0, 'ZERO')}" if cond
                        else f"{regs[n.var]}[u] = {g}")
            ax.start, ax.count = saved

    def _stream_bounds(self, lp: Loop, src: Source) -> tuple[str, str]:
        """Chunks every score of which a mask sends to -inf contribute nothing to an online
        softmax (or max / logsumexp): skip them.  The bounds come from the mask predicates on
        the streamed axis against a tiled axis."""
        k = self.consts
        lo, hi = k.u(0, "U0"), self.ax[lp.axis].size_c
        preds = self._skippable_masks(lp)
        if not preds:
            return lo, hi
        a = self.ax[lp.axis]
        for row, pred in preds:
            r = self.ax[row]
            last_row = f"{r.start} + {r.count}"      # one past the block's last row
            if pred.kind == "causal":
                off = pred.args[0]
                end = f"{last_row} + {k.u(off)}" if off > 0 else last_row
                if off < 0:
                    end = f"max({last_row}, {k.u(-off)}) - {k.u(-off)}"
                name = self.names.fresh(f"{a.name}_end")
                src(f"{name} = min({hi}, {end})  # later chunks are masked for every row of the tile")
                hi = name
            else:
                left, right = pred.args
                end = f"{last_row} + {k.u(right)}" if right else last_row
                name = self.names.fresh(f"{a.name}_end")
                src(f"{name} = min({hi}, {end})  # later chunks are outside every row's window")
                hi = name
                first = f"(max({r.start}, {k.u(left)}) - {k.u(left)})" if left else r.start
                start = self.names.fresh(f"{a.name}_begin")
                src(f"{start} = {first} // {a.cap_c} * {a.cap_c}  # earlier chunks are outside every window")
                lo = start
        return lo, hi

    def _skippable_masks(self, lp: Loop):
        found = []
        for n, _ in self.ff.walk():
            if not isinstance(n, Update):
                continue
            acc = self.ff.accumulators[n.acc]
            if acc.axis != lp.axis or acc.rule not in ("online_softmax", "logsumexp") and not (
                    acc.rule == "reduce" and acc.box.param("op") == "max"):
                continue
            v = self.dd.eqns[acc.eqn].ins[0]
            # follow -inf preserving boxes back to a mask on (tiled row, streamed col)
            while v >= self.n_in:
                e = self.dd.eqns[self.eqn_of[v]]
                if e.box.kind == "mask":
                    pred = e.box.param("pred")
                    row = e.box.param("row")
                    if (e.box.param("col") == lp.axis and self.ax[row].role == "grid"
                            and pred.kind in ("causal", "window")):
                        found.append((row, pred))
                    break
                if e.box.kind == "map" and e.box.param("fn") in ("scale",) and \
                        constant_value(e.box.param("c"), self.sizes) > 0:
                    v = e.ins[0]
                elif e.box.kind in ("index_bias",) or (e.box.kind == "map" and e.box.param("fn") in ("add", "shift")):
                    v = e.ins[0]
                else:
                    break
        return found

    # ---- loads and stores
    def _emit_load(self, v: int, src: Source, from_regs: str | None = None):
        arr = self.types[v]
        b = self.bufs[("var", v)]
        k = self.consts
        names, caps = self._caps(arr.axis_names)
        order = self._load_order(v)
        n = max(1, math.prod(caps))
        env = {}
        if from_regs:
            src.comment(f"chunk of {arr}: registers -> shared {b.name} [{' '.join(b.axes)}]")
            with src.block(f"for u in range({k.u(-(-n // self.T))}):"):
                src(f"e = tid + u * NTHREADS")
                with src.maybe(f"e < {k.u(n)}" if n % self.T else None):
                    self._decode(src, "e", order, env)
                    src(f"{self.sread(b.key, env)} = {from_regs}[u]")
            self.pending_sync = True
            return
        src.comment(f"load {arr} -> shared {b.name} [{' '.join(b.axes)}]  (a fixed trip count: "
                    f"the loop unrolls and every load is in flight before the first store)")
        with src.block(f"for u in range({k.u(-(-n // self.T))}):"):
            src("e = tid + u * NTHREADS")
            with src.maybe(f"e < {k.u(n)}" if n % self.T else None):
                self._decode(src, "e", order, env)
                g = f"{self.garg(v)}[{self.gindex(arr, env)}]"
                cond = self.valid(names, env)
                if cond:
                    src(f"{self.sread(b.key, env)} = {g} if {cond} else {k.f(0.0, 'ZERO')}")
                else:
                    src(f"{self.sread(b.key, env)} = {g}")
        self.pending_sync = True

    def _load_order(self, v: int) -> tuple[str, ...]:
        """Axes in the order consecutive threads walk an input's elements: global order
        (coalesced reads) unless the buffer is transposed and unpadded, then shared order
        (conflict-free stores; such a buffer is loaded once, outside the stream loops)."""
        names, _ = self._caps(self.types[v].axis_names)
        b = self.bufs[("var", v)]
        if b.axes and names and b.axes[-1] != names[-1] and not b.pad:
            return b.axes
        return names

    def _emit_input_store(self, v: int, src: Source):
        pos = self.dd.outs.index(v)
        arr = self.types[v]
        self.sync(src)
        m = self.flat_for(arr.axis_names)
        src.comment(f"store {arr} (an input passed through)")
        with self._flat_elements(m, src) as env:
            cond = self.valid(m.axes, env)
            with src.maybe(cond):
                src(f"{self.arg_names[('out', pos)]}[{self.gindex(arr, env)}] = {self.sread(('var', v), env)}")

    def _decode(self, src, var, axes, env):
        k = self.consts
        rest = var
        for pos, a in enumerate(reversed(axes)):
            idx = self.names.fresh(self.ax[a].index) if a in env else self.ax[a].index
            last = pos == len(axes) - 1
            cap = self.ax[a].cap_c
            src(f"{idx} = {rest}" if last else f"{idx} = {rest} % {cap}")
            env[a] = idx
            if not last:
                nxt = self.names.fresh(f"{var}_{a}")
                src(f"{nxt} = {rest} // {cap}")
                rest = nxt

    # ---- computes
    def _emit_compute(self, k: int, src: Source):
        c = self.cls[k]
        (v,) = self.dd.eqn_outputs(k)
        if c == "normaliser":
            self._emit_norm_stats(k, src)
        if v in self.targets and v not in self.fused_targets:
            self._emit_target(self.targets[v], src)

    # ---- mappings as element loops
    def _flat_elements(self, m: Flat, src: Source):
        gen = self

        class _C:
            def __enter__(self_):
                self_.env = {}
                self_.u = gen.names.fresh("u")
                self_.loop = src.block(f"for {self_.u} in range({gen.consts.u(m.per_thread)}):")
                self_.loop.__enter__()
                e = gen.names.fresh("e")
                src(f"{e} = tid + {self_.u} * NTHREADS" if m.per_thread > 1 else f"{e} = tid")
                self_.cond = src.maybe(f"{e} < {gen.consts.u(m.n)}" if m.n % gen.T or m.n < gen.T else None)
                self_.cond.__enter__()
                gen._decode(src, e, m.axes, self_.env)
                self_.env["_slot"] = self_.u
                return self_.env

            def __exit__(self_, *exc):
                self_.cond.__exit__(*exc)
                self_.loop.__exit__(*exc)
                return False

        return _C()

    def micro_rows(self, m: Micro, i: str) -> str:
        k = self.consts
        if m.RY == 1:
            return "ty"
        if m.VY == m.RY:
            return f"ty * {k.u(m.RY)} + {i}"
        return f"ty * {k.u(m.VY)} + {i} // {k.u(m.VY)} * {k.u(m.TY * m.VY)} + {i} % {k.u(m.VY)}"

    def micro_cols(self, m: Micro, j: str) -> str:
        k = self.consts
        if m.RX == 1:
            return "tx"
        if m.VX == m.RX:
            return f"tx * {k.u(m.RX)} + {j}"
        return f"tx * {k.u(m.VX)} + {j} // {k.u(m.VX)} * {k.u(m.TX * m.VX)} + {j} % {k.u(m.VX)}"

    def micro_begin(self, m: Micro, src: Source):
        k = self.consts
        src(f"ty = tid // {k.u(m.TX)}")
        src(f"tx = tid % {k.u(m.TX)}")

    def micro_guard(self, m: Micro) -> str | None:
        return f"tid < {self.consts.u(m.active)}" if m.active < self.T else None

    def micro_elements(self, m: Micro, src: Source):
        """Context: ``for i, j`` over a thread's micro-tile; yields the env (``_slot`` = ``i, j``)."""
        gen = self

        class _C:
            def __enter__(self_):
                k = gen.consts
                self_.b1 = src.block(f"for i in range({k.u(m.RY)}):")
                self_.b1.__enter__()
                r = gen.names.fresh(gen.ax[m.row].index)
                src(f"{r} = {gen.micro_rows(m, 'i')}")
                self_.b2 = src.block(f"for j in range({k.u(m.RX)}):")
                self_.b2.__enter__()
                c = gen.names.fresh(gen.ax[m.col].index)
                src(f"{c} = {gen.micro_cols(m, 'j')}")
                return {m.row: r, m.col: c, "_slot": "i, j", "_row": "i"}

            def __exit__(self_, *exc):
                self_.b2.__exit__(*exc)
                self_.b1.__exit__(*exc)
                return False

        return _C()

    def elements(self, m, src):
        return self.micro_elements(m, src) if isinstance(m, Micro) else self._flat_elements(m, src)

    def mapping_begin(self, m, src):
        if isinstance(m, Micro):
            self.micro_begin(m, src)
            return src.maybe(self.micro_guard(m))
        return src.maybe(None)

    # ---- contractions
    def contraction_operands(self, ins) -> list[Operand]:
        ops = []
        for v in ins:
            ops.append(Operand(self._axes_set(v),
                               (lambda v: lambda env, memo, src: self.value(v, env, src, memo))(v)))
        return ops

    def emit_contraction(self, m, acc: str, operands: list[Operand], red: list[str], src: Source,
                         init: bool = True, prescale: Operand | None = None):
        """``acc[slot] (+)= sum over red of prod(operands)`` on mapping ``m`` (Micro or Flat).
        For Flat the caller is inside the element loop (env given by ``self._env``)."""
        k = self.consts
        zero = k.f(0.0, "ZERO")
        if isinstance(m, Micro):
            rowset, colset = {m.row}, {m.col}
            if init:
                with src.block(f"for i in range({k.u(m.RY)}):"):
                    with src.block(f"for j in range({k.u(m.RX)}):"):
                        src(f"{acc}[i, j] = {zero}")
            elif prescale is not None:
                with src.block(f"for i in range({k.u(m.RY)}):"):
                    env = {}
                    if m.row in prescale.axes:
                        env[m.row] = self.names.fresh(self.ax[m.row].index)
                        src(f"{env[m.row]} = {self.micro_rows(m, 'i')}")
                    sc = None
                    if m.col not in prescale.axes:
                        sc = self.names.fresh("scale")
                        src(f"{sc} = {prescale.read(env, {}, src)}")
                    with src.block(f"for j in range({k.u(m.RX)}):"):
                        if sc is None:
                            env[m.col] = self.names.fresh(self.ax[m.col].index)
                            src(f"{env[m.col]} = {self.micro_cols(m, 'j')}")
                            sc = self.names.fresh("scale")
                            src(f"{sc} = {prescale.read(env, {}, src)}")
                        src(f"{acc}[i, j] *= {sc}")
            roww = [o for o in operands if m.row in o.axes and m.col not in o.axes]
            colw = [o for o in operands if m.col in o.axes and m.row not in o.axes]
            both = [o for o in operands if m.row in o.axes and m.col in o.axes]
            none = [o for o in operands if m.row not in o.axes and m.col not in o.axes]
            frag_a = [self.names.fresh("fa") for _ in roww]
            frag_b = [self.names.fresh("fb") for _ in colw]
            for f in frag_a:
                src(f"{f} = cuda.local.array({m.RY}, float32)")
            for f in frag_b:
                src(f"{f} = cuda.local.array({m.RX}, float32)")
            env = {}
            opened = []
            steps = [None]
            for pos, a in enumerate(red):
                ax = self.ax[a]
                bound = ax.count if ax.role == "stream" else ax.cap_c
                idx = self.names.fresh(ax.index)
                unroll = _unroll_factor(self.unroll, ax.cap) if pos == len(red) - 1 and not ax.ragged else 1
                if unroll > 1:
                    # the innermost reduction loop unrolled in the source: the next steps' shared
                    # loads are issued while this step's FMAs run
                    base = self.names.fresh(f"{ax.index}_base")
                    blk = src.block(f"for {base} in range({k.u(0, 'U0')}, {bound}, {k.u(unroll)}):")
                    steps = [(base, u) for u in range(unroll)]
                else:
                    blk = src.block(f"for {idx} in range({bound}):")
                env[a] = idx
                blk.__enter__()
                opened.append(blk)
            for step in steps:
                if step is not None:
                    base, u = step
                    idx = self.names.fresh(self.ax[red[-1]].index)
                    src(f"{idx} = {base} + {k.u(u)}" if u else f"{idx} = {base}")
                    env[red[-1]] = idx
                self._micro_step(m, acc, env, roww, colw, both, none, frag_a, frag_b, src)
            for blk in reversed(opened):
                blk.__exit__(None, None, None)
        else:
            env = self._env
            slot = f"{acc}[{env['_slot']}]"
            if init:
                src(f"{slot} = {zero}")
            elif prescale is not None:
                src(f"{slot} *= {prescale.read(env, {}, src)}")
            opened = []
            e2 = dict(env)
            for a in red:
                ax = self.ax[a]
                bound = ax.count if ax.role == "stream" else ax.cap_c
                idx = self.names.fresh(ax.index)
                e2[a] = idx
                blk = src.block(f"for {idx} in range({bound}):")
                blk.__enter__()
                opened.append(blk)
            memo = {}
            factors = [o.read(e2, memo, src) for o in operands]
            src(f"{slot} += {' * '.join(factors) or k.f(1.0, 'ONE')}")
            for blk in reversed(opened):
                blk.__exit__(None, None, None)

    def _micro_step(self, m: Micro, acc: str, env: dict, roww, colw, both, none, frag_a, frag_b,
                    src: Source):
        """One step of the reduction loops on a micro-tile: fragments, then the outer product."""
        k = self.consts
        scal = []
        for o in none:
            t = self.names.fresh("f")
            src(f"{t} = {o.read(dict(env), {}, src)}")
            scal.append(t)
        if roww:
            with src.block(f"for i in range({k.u(m.RY)}):"):
                e2 = dict(env)
                e2[m.row] = self.names.fresh(self.ax[m.row].index)
                src(f"{e2[m.row]} = {self.micro_rows(m, 'i')}")
                memo = {}
                for f, o in zip(frag_a, roww):
                    src(f"{f}[i] = {o.read(e2, memo, src)}")
        if colw:
            with src.block(f"for j in range({k.u(m.RX)}):"):
                e2 = dict(env)
                e2[m.col] = self.names.fresh(self.ax[m.col].index)
                src(f"{e2[m.col]} = {self.micro_cols(m, 'j')}")
                memo = {}
                for f, o in zip(frag_b, colw):
                    src(f"{f}[j] = {o.read(e2, memo, src)}")
        with src.block(f"for i in range({k.u(m.RY)}):"):
            e2 = dict(env)
            if both:
                e2[m.row] = self.names.fresh(self.ax[m.row].index)
                src(f"{e2[m.row]} = {self.micro_rows(m, 'i')}")
            with src.block(f"for j in range({k.u(m.RX)}):"):
                factors = [f"{f}[i]" for f in frag_a] + [f"{f}[j]" for f in frag_b] + scal
                if both:
                    e2[m.col] = self.names.fresh(self.ax[m.col].index)
                    src(f"{e2[m.col]} = {self.micro_cols(m, 'j')}")
                    memo = {}
                    factors += [o.read(e2, memo, src) for o in both]
                src(f"{acc}[i, j] += {' * '.join(factors) or k.f(1.0, 'ONE')}")

    # ---- writing a target's value
    def write_target(self, t: Target, env, val: str, src: Source):
        arr = self.types[t.var]
        if t.to_smem:
            src(f"{self.sread(('var', t.var), env)} = {val}")
        if t.to_global:
            cond = self.valid(self._caps(arr.axis_names)[0], env)
            with src.maybe(cond):
                for pos, ov in enumerate(self.dd.outs):
                    if ov == t.var:
                        src(f"{self.out_args[pos]}[{self.gindex(arr, env)}] = {val}")

    def _emit_target(self, t: Target, src: Source):
        self.sync(src)
        arr = self.types[t.var]
        m = t.mapping
        if t.source is None:
            src.comment(f"{arr} = {self._describe_chain(t.var)}  ({m.describe()})")
            with self.elements(m, src) as env:
                memo = {}
                val = self.value(t.var, env, src, memo, define=t.var)
                self.write_target(t, env, val, src)
        elif t.source in self.acc_of_var:
            p = self.plans[self.acc_of_var[t.source]]
            src.comment(f"{arr} = {self._describe_chain(t.var)}: finalise {p.acc.rule}  ({m.describe()})")
            with self.mapping_begin(m, src):
                with self.elements(m, src) as env:
                    self._env = env
                    memo = {}
                    fin = ACC_CODEGEN[p.acc.rule].final_value(self, p, env, src)
                    val = self.value(t.var, env, src, memo, {t.source: fin}, define=t.var)
                    self.write_target(t, env, val, src)
        else:
            self._emit_reduction_target(t, src)
        if t.to_smem:
            self.pending_sync = True

    def _describe_chain(self, v: int) -> str:
        if v < self.n_in or v in self.acc_of_var:
            return self.types[v].name
        e = self.dd.eqns[self.eqn_of[v]]
        return f"{e.box.name}({', '.join(self._describe_chain(a) if self.storage(a) in ('inline', 'regs') else self.types[a].name for a in e.ins)})"

    def _emit_reduction_target(self, t: Target, src: Source):
        k = self.consts
        kk = self.eqn_of[t.source]
        e = self.dd.eqns[kk]
        box = e.box
        red = self._reduced_axes(kk)
        m = t.mapping
        arr = self.types[t.var]
        src.comment(f"{arr} = {self._describe_chain(t.var)}  ({m.describe()})")
        if isinstance(m, Micro):
            acc = self.names.fresh("acc")
            self.micro_begin(m, src)
            with src.maybe(self.micro_guard(m)):
                src(f"{acc} = cuda.local.array(({m.RY}, {m.RX}), float32)")
                self.emit_contraction(m, acc, self.contraction_operands(e.ins), list(red), src)
                with self.micro_elements(m, src) as env:
                    val = self.value(t.var, env, src, {}, {t.source: f"{acc}[i, j]"}, define=t.var)
                    self.write_target(t, env, val, src)
        elif isinstance(m, Flat):
            acc = self.names.fresh("acc")
            src(f"{acc} = cuda.local.array({m.per_thread}, float32)")
            with self._flat_elements(m, src) as env:
                self._env = env
                if box.kind == "contract":
                    self.emit_contraction(m, acc, self.contraction_operands(e.ins), list(red), src)
                    res = f"{acc}[{env['_slot']}]"
                else:
                    res = self._flat_reduce(box, e.ins[0], red[0], env, src)
                val = self.value(t.var, env, src, {}, {t.source: res}, define=t.var)
                self.write_target(t, env, val, src)
        else:
            self._coop_reduce_target(t, box, e.ins, red, src)

    def _flat_reduce(self, box, x: int, axis: str, env, src) -> str:
        k = self.consts
        op = box.param("op")
        ax = self.ax[axis]
        idx = self.names.fresh(ax.index)
        e2 = dict(env)
        e2[axis] = idx
        r = self.names.fresh("r")
        if op == "logsumexp":
            raise LoweringError("internal: logsumexp uses lanes")
        ident, comb, _ = REDUCE_OPS[op]
        src(f"{r} = {k.f(ident)}")
        with src.block(f"for {idx} in range({ax.cap_c}):"):
            val = self.value(x, e2, src, {})
            src(f"{r} = {comb.format(a=r, b=val)}")
        if op == "mean":
            src(f"{r} = {r} / {k.f(float(ax.size), comment=f'size of {axis}')}")
        return r

    # ---- lanes (Coop): reductions with few outputs
    def coop_elements(self, m: Coop, src: Source):
        """Context over a thread's outputs in a Coop mapping: yields env with ``_lane``,
        ``_slot`` and ``_active``; every thread runs every iteration (barriers inside)."""
        gen = self

        class _C:
            def __enter__(self_):
                k = gen.consts
                u = gen.names.fresh("u")
                self_.loop = src.block(f"for {u} in range({k.u(m.per_thread)}):")
                self_.loop.__enter__()
                groups = m.threads // m.R
                o = gen.names.fresh("o")
                src(f"{o} = tid // {k.u(m.R)} + {u} * {k.u(groups)}" if m.per_thread > 1
                    else f"{o} = tid // {k.u(m.R)}")
                lane = gen.names.fresh("lane")
                src(f"{lane} = tid % {k.u(m.R)}")
                oc = o
                first = lane
                if m.per_thread * groups != m.n:
                    oc = gen.names.fresh("oc")
                    src(f"{oc} = min({o}, {k.u(m.n - 1)})  # idle groups index the last output ...")
                    first = gen.names.fresh("first")
                    src(f"{first} = {lane} if {o} < {k.u(m.n)} else {k.u(IDLE_START, 'IDLE_START')}"
                        f"  # ... but their loops are empty: they read nothing other groups write")
                env = {}
                gen._decode(src, oc, m.axes, env)
                env["_lane"] = lane
                env["_first"] = first
                env["_slot"] = u
                env["_active"] = f"{o} < {k.u(m.n)}" if m.per_thread * groups != m.n else None
                return env

            def __exit__(self_, *exc):
                self_.loop.__exit__(*exc)
                return False

        return _C()

    def lanes_reduce(self, m: Coop, env, axes: tuple[str, ...], op: str, term: Callable, src: Source,
                     bounds: dict | None = None) -> str:
        """All lanes of the group get ``op`` over ``axes`` of ``term(env2, memo)``."""
        k = self.consts
        ident, comb, helper = REDUCE_OPS[op]
        r = self.names.fresh("part")
        src(f"{r} = {k.f(ident)}")
        names = [a for a in axes if self.ax[a].cap > 1]
        bounds = bounds or {}
        lane = env["_lane"]
        first = env.get("_first", lane)   # the lane, or past every bound in an idle group
        if len(names) <= 1:
            e2 = dict(env)
            if names:
                a = names[0]
                bound = bounds.get(a, self.ax[a].count if self.ax[a].role == "stream" else self.ax[a].cap_c)
                idx = self.names.fresh(self.ax[a].index)
                e2[a] = idx
                loop = src.block(f"for {idx} in range({first}, {bound}, {k.u(m.R)}):")
            else:
                loop = src.maybe(f"{first} == {k.u(0, 'U0')}")
            with loop:
                val = term(e2, {})
                src(f"{r} = {comb.format(a=r, b=val)}")
        else:
            n = math.prod(self.ax[a].cap for a in names)
            rr = self.names.fresh("rr")
            with src.block(f"for {rr} in range({first}, {k.u(n)}, {k.u(m.R)}):"):
                e2 = dict(env)
                sub = {}
                self._decode(src, rr, tuple(names), sub)
                e2.update(sub)
                cond = " and ".join(f"{sub[a]} < {bounds[a]}" for a in names if a in bounds) or None
                with src.maybe(cond):
                    val = term(e2, {})
                    src(f"{r} = {comb.format(a=r, b=val)}")
        if m.R > 1:
            src(f"{r} = {helper}({r}, {lane}, {k.u(m.R)}, smem, {self.red_offset()}, tid)")
        return r

    def _coop_reduce_target(self, t: Target, box, ins, red, src: Source):
        k = self.consts
        m = t.mapping
        with self.coop_elements(m, src) as env:
            if box.kind == "contract":
                ops = self.contraction_operands(ins)
                term = lambda e2, memo: " * ".join(o.read(e2, memo, src) for o in ops)
                res = self.lanes_reduce(m, env, red, "sum", term, src)
            else:
                op = box.param("op")
                x = ins[0]
                term = lambda e2, memo: self.value(x, e2, src, memo)
                if op == "logsumexp":
                    mx = self.lanes_reduce(m, env, red, "max", term, src)
                    safe = self.names.fresh("safe")
                    src(f"{safe} = {mx} if {mx} > {k.f(-math.inf, 'NEG_INF')} else {k.f(0.0, 'ZERO')}")
                    one = k.f(1.0, "ONE")

                    def lse_term(e2, memo):   # exp(inf - inf) counts as 1, as in _lse_update
                        xv = term(e2, memo)
                        return f"({one} if {xv} == {safe} else math.exp({xv} - {safe}))"
                    sm = self.lanes_reduce(m, env, red, "sum", lse_term, src)
                    res = self.names.fresh("lse")
                    src(f"{res} = {safe} + math.log({sm}) if {sm} != {k.f(0.0, 'ZERO')} else "
                        f"{k.f(-math.inf, 'NEG_INF')}")
                else:
                    res = self.lanes_reduce(m, env, red, op, term, src)
                    if op == "mean":
                        n = math.prod(self.ax[a].size for a in red)
                        src(f"{res} = {res} / {k.f(float(n), comment='reduced size')}")
            cond = f"{env['_lane']} == {k.u(0, 'U0')}"
            if env["_active"]:
                cond += f" and {env['_active']}"
            with src.block(f"if {cond}:"):
                val = self.value(t.var, env, src, {}, {t.source: res}, define=t.var)
                self.write_target(t, env, val, src)

    # ---- normalisers (softmax, normalize over a whole axis in the block)
    def _norm_params(self, box):
        if box.kind == "softmax":
            return NORMALISATIONS["softmax"] + (0.0,)
        return (box.param("a1"), box.param("a2"), box.param("b"), box.param("eps"))

    def _emit_norm_stats(self, k: int, src: Source):
        kc = self.consts
        self.sync(src)
        e = self.dd.eqns[k]
        box = e.box
        axis = box.param("axis")
        a1, a2, b, eps = self._norm_params(box)
        m = self.norm_stats[k]
        x = e.ins[0]
        mb, zb = self.bufs[("norm_m", k)], self.bufs[("norm_z", k)]
        src.comment(f"row statistics of {box.name} over {axis}  ({m.describe()})")
        term = lambda e2, memo: self.value(x, e2, src, memo)
        zero = kc.f(0.0, "ZERO")
        with self.coop_elements(m, src) as env:
            if (a1, a2, b) == NORMALISATIONS["softmax"]:
                mx = self.lanes_reduce(m, env, (axis,), "max", term, src)
                safe = self.names.fresh("safe")
                src(f"{safe} = {mx} if {mx} > {kc.f(-math.inf, 'NEG_INF')} else {zero}")
                z = self.lanes_reduce(m, env, (axis,), "sum",
                                      lambda e2, memo: f"math.exp({term(e2, memo)} - {safe})", src)
                stat = safe
            else:
                z0 = self.lanes_reduce(m, env, (axis,), "sum",
                                       lambda e2, memo: _fn_expr(self, a2, [f"({term(e2, memo)})"]), src)
                z = self.names.fresh("z")
                src(f"{z} = {_fn_expr(self, b, [z0])} + {kc.f(eps, comment='eps of ' + box.name)}")
                stat = zero
            cond = f"{env['_lane']} == {kc.u(0, 'U0')}"
            if env["_active"]:
                cond += f" and {env['_active']}"
            with src.block(f"if {cond}:"):
                src(f"{self.sread(mb.key, env)} = {stat}")
                src(f"{self.sread(zb.key, env)} = {z}")
        self.pending_sync = True

    def _normalised_value(self, k: int, env, src, memo, regs, define=None) -> str:
        kc = self.consts
        e = self.dd.eqns[k]
        box = e.box
        a1, a2, b, eps = self._norm_params(box)
        xv = self.value(e.ins[0], env, src, memo, regs, define)
        mv = self.sread(("norm_m", k), env)
        zv = self.sread(("norm_z", k), env)
        zero = kc.f(0.0, "ZERO")
        (v,) = self.dd.eqn_outputs(k)
        tmp = self.names.fresh(f"{self.types[v].name}_{v}")
        if (a1, a2, b) == NORMALISATIONS["softmax"]:
            zt = self.names.fresh("z")
            src(f"{zt} = {zv}")
            src(f"{tmp} = math.exp({xv} - {mv}) / {zt} if {zt} != {zero} else {zero}")  # NaN row stays NaN
        else:
            zt = self.names.fresh("z")
            src(f"{zt} = {zv}")
            src(f"{tmp} = {_fn_expr(self, a1, [xv])} / {zt} if {zt} != {zero} else {zero}")
        return tmp


# --------------------------------------------------------------------------- accumulators

_GROUP_HELPER = '''
@cuda.jit(device=True, inline=True)
def _group_{name}(v, lane, width, smem, base, tid):
    """{doc}"""
    if WARP_SHUFFLE and width <= 32:
        off = width // uint32(2)
        while off > uint32(0):
            {shuffle}
            off //= uint32(2)
        return v
    smem[base + tid] = v
    cuda.syncthreads()
    off = width // uint32(2)
    while off > uint32(0):
        if lane < off:
            smem[base + tid] = {combine}
        cuda.syncthreads()
        off //= uint32(2)
    v = smem[base + tid - lane]
    cuda.syncthreads()
    return v
'''


def _group_helper(name: str, doc: str, combine: str) -> str:
    """One group reduction (warp shuffles on a GPU, a shared-memory tree under the simulator)
    for the combining expression ``combine`` of ``{a}`` and ``{b}``."""
    shuffled = combine.format(a="v", b="cuda.shfl_xor_sync(FULL_MASK, v, off)")
    shuffle = "v += " + shuffled[len("v + "):] if shuffled.startswith("v + ") else "v = " + shuffled
    tree = combine.format(a="smem[base + tid]", b="smem[base + tid + off]")
    return _GROUP_HELPER.format(name=name, doc=doc, shuffle=shuffle, combine=tree).strip("\n")


_GROUP_HELPERS = "\n\n\n".join(_group_helper(*spec) for spec in (
    ("sum", "Sum of ``v`` over the ``width`` lanes of a group (a power of two), in every lane.", "{a} + {b}"),
    ("max", "Maximum of ``v`` over the ``width`` lanes of a group, in every lane.", "max({a}, {b})"),
    ("min", "Minimum of ``v`` over the ``width`` lanes of a group, in every lane.", "min({a}, {b})"),
))


@dataclass(frozen=True)
class AccCodegen:
    """Code for one accumulator kind: ``init`` / ``update`` / ``publish`` (before the final
    value is read) / ``final_value`` (expression at a main-state element).  ``contraction``:
    the update is a contraction into the main state (register micro-tiles); ``stats``: it keeps
    row statistics over the score axes; ``rescales``: earlier contributions are rescaled."""

    init: Callable
    update: Callable
    publish: Callable
    final_value: Callable
    contraction: bool = False
    stats: bool = False
    rescales: bool = False


def _shape(shape) -> str:
    """A local array's shape: plain int literals (numba needs compile-time constants)."""
    return str(shape[0]) if len(shape) == 1 else f"({', '.join(map(str, shape))})"


def _state_names(gen: KernelGen, p: AccPlan):
    if not p.names:
        oname = p.acc.box.cod[0].name
        for sname, _, _ in p.acc.states():
            p.names[sname] = gen.names.fresh(f"{oname}_{sname}")
    return p.names


def _state_ref(gen, p: AccPlan, sname: str, env) -> str:
    """Where state ``sname`` is at the element ``env`` of its mapping."""
    role = {s: r for s, _, r in p.acc.states()}[sname]
    regs = p.main_regs if role == "main" else p.stat_regs
    if regs and role != "main" and isinstance(p.stat, Rows):
        return f"{_state_names(gen, p)[sname]}[{env['_row']}]"
    if regs:
        return f"{_state_names(gen, p)[sname]}[{env['_slot']}]"
    return gen.sread(("state", p.index, sname), env)


def _init_states(gen: KernelGen, p: AccPlan, src: Source, values: dict):
    k = gen.consts
    names = _state_names(gen, p)
    src.comment(f"init {p.acc.box.cod[0].name} ({p.acc.rule}): "
                + ", ".join(f"{s} @{'registers' if (p.main_regs if r == 'main' else p.stat_regs) else 'shared'}"
                            for s, _, r in p.acc.states()))
    for sname, axes, role in p.acc.states():
        m = p.main if role == "main" else (p.stat or p.main)
        regs = p.main_regs if role == "main" else p.stat_regs
        if regs:
            src(f"{names[sname]} = cuda.local.array({_shape(m.shape)}, float32)")
        init = k.f(values[sname])
        if isinstance(m, Rows):
            with src.block(f"for i in range({k.u(m.micro.RY)}):"):
                src(f"{names[sname]}[i] = {init}")
        elif isinstance(m, Micro):
            with gen.mapping_begin(m, src):
                with gen.micro_elements(m, src) as env:
                    src(f"{_state_ref(gen, p, sname, env)} = {init}")
        elif isinstance(m, Coop):
            with gen.coop_elements(m, src) as env:
                src(f"{_state_ref(gen, p, sname, env)} = {init}")
        else:
            with gen._flat_elements(m, src) as env:
                src(f"{_state_ref(gen, p, sname, env)} = {init}")


def _main_contraction(gen: KernelGen, p: AccPlan, operands, red, src: Source, prescale=None):
    """``o (*= prescale) += contraction`` on the main mapping, state in registers or shared."""
    k = gen.consts
    m = p.main
    acc = _state_names(gen, p)["o"]
    with gen.mapping_begin(m, src):
        if not p.main_regs:   # a shared state is read into registers, updated, written back
            tmp = gen.names.fresh("o_regs")
            src(f"{tmp} = cuda.local.array({_shape(m.shape)}, float32)")
            with gen.elements(m, src) as env:
                src(f"{tmp}[{env['_slot']}] = {_state_ref(gen, p, 'o', env)}")
            acc = tmp
        if isinstance(m, Micro):
            gen.emit_contraction(m, acc, operands, red, src, init=False, prescale=prescale)
        else:
            with gen._flat_elements(m, src) as env:
                gen._env = env
                gen.emit_contraction(m, acc, operands, red, src, init=False, prescale=prescale)
        if not p.main_regs:
            with gen.elements(m, src) as env:
                src(f"{_state_ref(gen, p, 'o', env)} = {acc}[{env['_slot']}]")


def _red_of(gen: KernelGen, p: AccPlan) -> list[str]:
    box = p.acc.box
    out = set(box.cod[0].axis_names)
    red = [p.acc.axis]
    for arr in box.dom:
        for a in arr.axis_names:
            if a not in out and a not in red and a not in p.stat_axes:
                red.append(a)
    return red


# sum_contract ---------------------------------------------------------------

def _sc_init(gen, p, src):
    _init_states(gen, p, src, {"o": 0.0})


def _sc_update(gen, p, src):
    gen.sync(src)
    ins = gen.dd.eqns[p.acc.eqn].ins
    src.comment(f"update {p.acc.box.cod[0].name} (sum_contract) with "
                f"{', '.join(gen.types[v].name for v in ins)}  ({p.main.describe()})")
    _main_contraction(gen, p, gen.contraction_operands(ins), _red_of(gen, p), src)


def _no_publish(gen, p, src):
    return None


def _sc_final(gen, p, env, src):
    return _state_ref(gen, p, "o", env)


# reduce (sum, mean, max, min over a streamed axis) ----------------------------

def _reduce_init(gen, p, src):
    ident = REDUCE_OPS[p.acc.box.param("op")][0]
    _init_states(gen, p, src, {"o": ident})


def _reduce_update(gen, p, src):
    gen.sync(src)
    box = p.acc.box
    op = box.param("op")
    _, comb, _ = REDUCE_OPS[op]
    (x,) = gen.dd.eqns[p.acc.eqn].ins
    ax = gen.ax[p.acc.axis]
    src.comment(f"update {box.cod[0].name} ({op} over chunks of {ax.name})")
    with gen._flat_elements(p.main, src) as env:
        ref = _state_ref(gen, p, "o", env)
        idx = gen.names.fresh(ax.index)
        e2 = dict(env)
        e2[ax.name] = idx
        r = gen.names.fresh("r")
        src(f"{r} = {ref}")
        with src.block(f"for {idx} in range({ax.count}):"):
            if op in ("max", "min"):   # NaN propagates (docs/NAN_POLICY.md): Python's max drops it
                xv = gen.names.fresh("xv")
                src(f"{xv} = {gen.value(x, e2, src, {})}")
                src(f"{r} = {xv} if {xv} {'>' if op == 'max' else '<'} {r} or {xv} != {xv} else {r}")
            else:
                src(f"{r} = {comb.format(a=r, b=gen.value(x, e2, src, {}))}")
        src(f"{ref} = {r}")


def _reduce_final(gen, p, env, src):
    ref = _state_ref(gen, p, "o", env)
    if p.acc.box.param("op") == "mean":
        n = gen.sizes[p.acc.axis]
        return f"{ref} / {gen.consts.f(float(n), comment=f'size of {p.acc.axis}')}"
    return ref


# logsumexp -------------------------------------------------------------------

def _lse_init(gen, p, src):
    _init_states(gen, p, src, {"m": -math.inf, "z": 0.0})


def _lse_update(gen, p, src):
    gen.sync(src)
    k = gen.consts
    (x,) = gen.dd.eqns[p.acc.eqn].ins
    ax = gen.ax[p.acc.axis]
    src.comment(f"update {p.acc.box.cod[0].name} (logsumexp over chunks of {ax.name})")
    with gen._flat_elements(p.main, src) as env:
        m_ref, z_ref = _state_ref(gen, p, "m", env), _state_ref(gen, p, "z", env)
        idx = gen.names.fresh(ax.index)
        e2 = dict(env)
        e2[ax.name] = idx
        mx = gen.names.fresh("mx")
        src(f"{mx} = {m_ref}")
        with src.block(f"for {idx} in range({ax.count}):"):
            src(f"{mx} = max({mx}, {gen.value(x, e2, src, {})})")
        # docs/NAN_POLICY.md: a max of +inf stays the shift, and exp(inf - inf) counts as 1 (the
        # +inf element itself), so the result is +inf (NaN with a NaN) and no exp overflows
        safe = gen.names.fresh("safe")
        src(f"{safe} = {mx} if {mx} > {k.f(-math.inf, 'NEG_INF')} else {k.f(0.0, 'ZERO')}")
        zs = gen.names.fresh("zs")
        one = k.f(1.0, "ONE")
        src(f"{zs} = {z_ref} * ({one} if {m_ref} == {safe} else math.exp({m_ref} - {safe}))")
        with src.block(f"for {idx} in range({ax.count}):"):
            xv = gen.names.fresh("xv")
            src(f"{xv} = {gen.value(x, e2, src, {})}")
            src(f"{zs} += {one} if {xv} == {safe} else math.exp({xv} - {safe})")
        src(f"{z_ref} = {zs}")
        src(f"{m_ref} = {mx}")


def _lse_final(gen, p, env, src):
    k = gen.consts
    m_ref, z_ref = _state_ref(gen, p, "m", env), _state_ref(gen, p, "z", env)
    mt, zt = gen.names.fresh("m"), gen.names.fresh("z")
    src(f"{mt} = {m_ref}")
    src(f"{zt} = {z_ref}")
    # z == 0: every x was -inf (logsumexp -inf); z NaN (a NaN x) gives NaN, never -inf
    return (f"(({mt} if {mt} > {k.f(-math.inf, 'NEG_INF')} else {k.f(0.0, 'ZERO')}) + math.log({zt})"
            f" if {zt} != {k.f(0.0, 'ZERO')} else {k.f(-math.inf, 'NEG_INF')})")


# online softmax-contraction and the normalisation family ------------------------

def _osc_init(gen, p, src):
    _init_states(gen, p, src, {"mu": -math.inf, "z": 0.0, "o": 0.0})


def _norm_init(gen, p, src):
    _init_states(gen, p, src, {"z": 0.0, "o": 0.0})


def _stats_phase(gen: KernelGen, p: AccPlan, src: Source, softmax: bool):
    """Row statistics of one chunk: ``mu' = max(mu, max_j s)``, ``delta = exp(mu - mu')``,
    ``p_j = exp(s_j - mu')``, ``z' = delta z + sum_j p_j`` (softmax) or ``p_j = a1(s_j)``,
    ``z' = z + sum_j a2(s_j)`` (normalisation family); ``p`` goes to shared memory."""
    k = gen.consts
    zero = k.f(0.0, "ZERO")
    box = p.acc.box
    s, _ = gen.dd.eqns[p.acc.eqn].ins
    m = p.stat
    ax = gen.ax[p.acc.axis]
    pb = gen.bufs[p.p_buf]
    src.comment(f"update {box.cod[0].name} ({p.acc.rule}): row statistics of the chunk  ({m.describe()})")
    with gen.coop_elements(m, src) as env:
        term = lambda e2, memo: gen.value(s, e2, src, memo)
        lane = env["_lane"]
        idx = gen.names.fresh(ax.index)
        e2 = dict(env)
        e2[ax.name] = idx
        active = env["_active"]
        if softmax:
            mx = gen.lanes_reduce(m, env, (ax.name,), "max", term, src)
            mu_ref, z_ref = _state_ref(gen, p, "mu", env), _state_ref(gen, p, "z", env)
            mu_old, mu_new = gen.names.fresh("mu_old"), gen.names.fresh("mu_new")
            src(f"{mu_old} = {mu_ref}")
            src(f"{mu_new} = max({mu_old}, {mx})")
            safe = gen.names.fresh("safe")
            src(f"{safe} = {mu_new} if {mu_new} > {k.f(-math.inf, 'NEG_INF')} else {zero}"
                "  # no finite score yet: shift by 0, weights stay 0")
            delta = gen.names.fresh("delta")
            src(f"{delta} = math.exp({mu_old} - {safe})")
            ps = gen.names.fresh("psum")
            src(f"{ps} = {zero}")
            with src.block(f"for {idx} in range({env['_first']}, {ax.count}, {k.u(m.R)}):"):
                w = gen.names.fresh("w")
                src(f"{w} = math.exp({term(e2, {})} - {safe})")
                with src.maybe(active):   # idle groups (clamped onto the last row) only read
                    src(f"{gen.sread(pb.key, e2)} = {w}")
                src(f"{ps} += {w}")
            if m.R > 1:
                src(f"{ps} = _group_sum({ps}, {lane}, {k.u(m.R)}, smem, {gen.red_offset()}, tid)")
            writes_stats = not p.stat_regs
            cond = active if p.stat_regs else (f"{lane} == {k.u(0, 'U0')}" + (f" and {active}" if active else ""))
            with src.maybe(cond):
                src(f"{z_ref} = {delta} * {z_ref} + {ps}")
                src(f"{mu_ref} = {mu_new}")
            cond = f"{lane} == {k.u(0, 'U0')}" + (f" and {active}" if active else "")
            with src.block(f"if {cond}:"):
                src(f"{gen.sread(('delta', p.index), env)} = {delta}")
        else:
            a1, a2 = box.param("a1"), box.param("a2")
            z_ref = _state_ref(gen, p, "z", env)
            ps = gen.names.fresh("zsum")
            src(f"{ps} = {zero}")
            with src.block(f"for {idx} in range({env['_first']}, {ax.count}, {k.u(m.R)}):"):
                sv = gen.names.fresh("sv")
                src(f"{sv} = {term(e2, {})}")
                with src.maybe(active):   # idle groups (clamped onto the last row) only read
                    src(f"{gen.sread(pb.key, e2)} = {_fn_expr(gen, a1, [sv])}")
                src(f"{ps} += {_fn_expr(gen, a2, [sv])}")
            if m.R > 1:
                src(f"{ps} = _group_sum({ps}, {lane}, {k.u(m.R)}, smem, {gen.red_offset()}, tid)")
            cond = active if p.stat_regs else (f"{lane} == {k.u(0, 'U0')}" + (f" and {active}" if active else ""))
            with src.maybe(cond):
                src(f"{z_ref} = {z_ref} + {ps}")
    gen.pending_sync = True


def _warp_sync(gen: KernelGen, src: Source):
    """Order a warp's shared-memory writes before its own reads (the simulator has no
    ``syncwarp``; there every thread reaches this point, so a block barrier serves)."""
    with src.block("if SIMULATOR:"):
        src("cuda.syncthreads()")
    with src.block("else:"):
        src("cuda.syncwarp(FULL_MASK)")


def _fused_update(gen: KernelGen, p: AccPlan, src: Source, softmax: bool):
    """One chunk of a normalising accumulator with its scores in registers (:class:`FusedScores`):
    scores on micro-tile ``ms`` with the fused epilogue, row statistics by lane reductions,
    ``o *= delta`` in registers, weights to the warp-private staging area, ``syncwarp``, then
    ``o += weights . v`` on the main micro-tile (same rows per thread)."""
    k = gen.consts
    zero, neg = k.f(0.0, "ZERO"), k.f(-math.inf, "NEG_INF")
    f = p.fused
    ms, mo = f.ms, p.main
    t = gen.targets[f.target]
    kk = gen.eqn_of[f.source]
    e = gen.dd.eqns[kk]
    ax = gen.ax[p.acc.axis]
    names = _state_names(gen, p)
    box = p.acc.box
    oname = box.cod[0].name
    gen.sync(src)
    src.comment(f"update {oname} ({p.acc.rule}) with {gen.types[f.target].name} in registers: "
                f"{gen.types[f.target]} = {gen._describe_chain(f.target)}  ({ms.describe()})")
    gen.micro_begin(ms, src)
    sreg = gen.names.fresh(f"{gen.types[f.target].name}_regs")
    src(f"{sreg} = cuda.local.array(({ms.RY}, {ms.RX}), float32)")
    gen.emit_contraction(ms, sreg, gen.contraction_operands(e.ins), list(gen._reduced_axes(kk)), src)
    with gen.micro_elements(ms, src) as env:
        val = gen.value(t.var, env, src, {}, {t.source: f"{sreg}[i, j]"}, define=t.var)
        cond = gen.valid([ax.name], env)
        if cond and softmax:
            val = f"{val} if {cond} else {neg}"   # past the ragged end of the chunk: weight 0
        src(f"{sreg}[i, j] = {val}")
    src.comment(f"row statistics: {ms.TX} lanes per row "
                f"({'warp shuffles' if ms.TX > 1 else 'one lane'}; shared memory in the simulator); "
                f"weights -> warp-private {gen.bufs[p.p_buf].name}")
    lanes = k.u(ms.TX)
    with src.block(f"for i in range({k.u(ms.RY)}):"):
        env = {ms.row: gen.names.fresh(gen.ax[ms.row].index), "_row": "i"}
        src(f"{env[ms.row]} = {gen.micro_rows(ms, 'i')}")
        if softmax:
            mx = gen.names.fresh("mx")
            src(f"{mx} = {neg}")
            with src.block(f"for j in range({k.u(ms.RX)}):"):
                src(f"{mx} = max({mx}, {sreg}[i, j])")
            if ms.TX > 1:
                src(f"{mx} = _group_max({mx}, tx, {lanes}, smem, {gen.red_offset()}, tid)")
            mu_ref, z_ref = _state_ref(gen, p, "mu", env), _state_ref(gen, p, "z", env)
            mu_old, mu_new, safe = gen.names.fresh("mu_old"), gen.names.fresh("mu_new"), gen.names.fresh("safe")
            src(f"{mu_old} = {mu_ref}")
            src(f"{mu_new} = max({mu_old}, {mx})")
            src(f"{safe} = {mu_new} if {mu_new} > {neg} else {zero}"
                "  # no finite score yet: shift by 0, weights stay 0")
            delta = gen.names.fresh("delta")
            src(f"{delta} = math.exp({mu_old} - {safe})")
            ps = gen.names.fresh("psum")
            src(f"{ps} = {zero}")
            with src.block(f"for j in range({k.u(ms.RX)}):"):
                w = gen.names.fresh("w")
                src(f"{w} = math.exp({sreg}[i, j] - {safe})")
                src(f"{sreg}[i, j] = {w}")
                src(f"{ps} += {w}")
            if ms.TX > 1:
                src(f"{ps} = _group_sum({ps}, tx, {lanes}, smem, {gen.red_offset()}, tid)")
            src(f"{z_ref} = {delta} * {z_ref} + {ps}")
            src(f"{mu_ref} = {mu_new}")
            o = names["o"]
            with src.block(f"for j in range({k.u(mo.RX)}):"):
                src(f"{o}[i, j] *= {delta}")
        else:
            a1, a2 = box.param("a1"), box.param("a2")
            z_ref = _state_ref(gen, p, "z", env)
            ps = gen.names.fresh("zsum")
            src(f"{ps} = {zero}")
            with src.block(f"for j in range({k.u(ms.RX)}):"):
                e2 = dict(env)
                cond = None
                if ax.ragged:
                    e2[ax.name] = gen.names.fresh(ax.index)
                    src(f"{e2[ax.name]} = {gen.micro_cols(ms, 'j')}")
                    cond = gen.valid([ax.name], e2)
                sv = gen.names.fresh("sv")
                src(f"{sv} = {sreg}[i, j]")
                if cond:
                    src(f"{sreg}[i, j] = {_fn_expr(gen, a1, [sv])} if {cond} else {zero}")
                    src(f"{ps} += {_fn_expr(gen, a2, [sv])} if {cond} else {zero}")
                else:
                    src(f"{sreg}[i, j] = {_fn_expr(gen, a1, [sv])}")
                    src(f"{ps} += {_fn_expr(gen, a2, [sv])}")
            if ms.TX > 1:
                src(f"{ps} = _group_sum({ps}, tx, {lanes}, smem, {gen.red_offset()}, tid)")
            src(f"{z_ref} = {z_ref} + {ps}")
    with src.block(f"for j in range({k.u(ms.RX)}):"):   # rows innermost: vector stores
        env = {ax.name: gen.names.fresh(ax.index)}
        src(f"{env[ax.name]} = {gen.micro_cols(ms, 'j')}")
        with src.block(f"for i in range({k.u(ms.RY)}):"):
            env[ms.row] = gen.names.fresh(gen.ax[ms.row].index)
            src(f"{env[ms.row]} = {gen.micro_rows(ms, 'i')}")
            src(f"{gen.sread(p.p_buf, env)} = {sreg}[i, j]")
    _warp_sync(gen, src)
    src.comment(f"update {oname}: o += weights . {gen.types[gen.dd.eqns[p.acc.eqn].ins[1]].name}  "
                f"({mo.describe()}; the rows of o are the rows of the weights this warp staged)")
    gen.emit_contraction(mo, names["o"], _weights_operands(gen, p), _red_of(gen, p), src, init=False)


def _weights_operands(gen: KernelGen, p: AccPlan):
    _, v = gen.dd.eqns[p.acc.eqn].ins
    p_axes = frozenset(a for a in (*p.stat_axes, p.acc.axis) if gen.ax[a].cap > 1)
    weights = Operand(p_axes, lambda env, memo, src: gen.sread(p.p_buf, env))
    return [weights] + gen.contraction_operands([v])


def _osc_update(gen, p, src):
    if p.fused is not None:
        return _fused_update(gen, p, src, softmax=True)
    gen.sync(src)
    _stats_phase(gen, p, src, softmax=True)
    gen.sync(src)
    src.comment(f"update {p.acc.box.cod[0].name}: o = delta * o + weights . "
                f"{gen.types[gen.dd.eqns[p.acc.eqn].ins[1]].name}  ({p.main.describe()})")
    st_axes = frozenset(a for a in p.stat_axes if gen.ax[a].cap > 1)
    delta = Operand(st_axes, lambda env, memo, src: gen.sread(("delta", p.index), env))
    _main_contraction(gen, p, _weights_operands(gen, p), _red_of(gen, p), src, prescale=delta)


def _norm_update(gen, p, src):
    if p.fused is not None:
        return _fused_update(gen, p, src, softmax=False)
    gen.sync(src)
    _stats_phase(gen, p, src, softmax=False)
    gen.sync(src)
    src.comment(f"update {p.acc.box.cod[0].name}: o += weights . "
                f"{gen.types[gen.dd.eqns[p.acc.eqn].ins[1]].name}  ({p.main.describe()})")
    _main_contraction(gen, p, _weights_operands(gen, p), _red_of(gen, p), src)


def _publish_z(gen, p, src):
    """Statistics held in the lanes' registers are written where the main mapping reads them."""
    if p.fused is not None:
        return None   # every lane of a row holds its statistics: nothing to publish
    if not p.stat_regs:
        gen.pending_sync = True
        return
    k = gen.consts
    gen.sync(src)
    src.comment(f"finalise {p.acc.box.cod[0].name}: publish the row normalisers")
    with gen.coop_elements(p.stat, src) as env:
        cond = f"{env['_lane']} == {k.u(0, 'U0')}" + (f" and {env['_active']}" if env["_active"] else "")
        with src.block(f"if {cond}:"):
            src(f"{gen.sread(('zpub', p.index), env)} = {_state_ref(gen, p, 'z', env)}")
    gen.pending_sync = True


def _z_at(gen, p, env) -> str:
    if p.fused is not None:
        return _state_ref(gen, p, "z", env)
    if p.stat_regs:
        return gen.sread(("zpub", p.index), env)
    return gen.sread(("state", p.index, "z"), env)


def _osc_final(gen, p, env, src):
    k = gen.consts
    zero = k.f(0.0, "ZERO")
    z = gen.names.fresh("z")
    src(f"{z} = {_z_at(gen, p, env)}")
    o = _state_ref(gen, p, "o", env)
    return f"({o} / {z} if {z} != {zero} else {zero})"


def _norm_final(gen, p, env, src):
    k = gen.consts
    zero = k.f(0.0, "ZERO")
    box = p.acc.box
    z = gen.names.fresh("z")
    eps = k.f(box.param("eps"), comment=f"eps of {box.name}")
    src(f"{z} = {_fn_expr(gen, box.param('b'), [_z_at(gen, p, env)])} + {eps}")
    o = _state_ref(gen, p, "o", env)
    return f"({o} / {z} if {z} != {zero} else {zero})"


ACC_CODEGEN: dict[str, AccCodegen] = {
    "sum_contract": AccCodegen(_sc_init, _sc_update, _no_publish, _sc_final, contraction=True),
    "reduce": AccCodegen(_reduce_init, _reduce_update, _no_publish, _reduce_final),
    "logsumexp": AccCodegen(_lse_init, _lse_update, _no_publish, _lse_final),
    "online_softmax": AccCodegen(_osc_init, _osc_update, _publish_z, _osc_final,
                                 contraction=True, stats=True, rescales=True),
    "normalized": AccCodegen(_norm_init, _norm_update, _publish_z, _norm_final,
                             contraction=True, stats=True),
}

assert set(ACC_CODEGEN) == set(ACC_RULES)
