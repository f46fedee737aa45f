"""The tensor-core contraction engine (``engine == "mma"``): ``mma.sync.m16n8k16`` on fragments.

A contraction planned on a :class:`~.plan.Frag` mapping is rendered as, per step of 16 along its
reduced axis: the A fragments of the warp's row tiles (``a0..a3``: pairs of 16-bit values packed
from the row operand), per column tile the B fragment (``b0, b1``, from the column operand),
then one ``mma`` per (row tile, column tile) into the fp32 accumulators ``acc[i, j]``, which the
:class:`~.plan.Frag` layout places exactly where the mma's C/D fragment puts them.  So the rest
of the kernel (epilogues, row statistics, stores) reads ``acc[i, j]`` at the row and column
:func:`frag_rows` / :func:`frag_cols` give, as for any micro-tile.

An operand held as 16-bit patterns in shared memory (:attr:`Operand.buffer`: an f16 / bf16 input,
or an intermediate that only tensor cores read, stored in 16 bits by :mod:`.sixteen_bit`) is read
into fragments by ``ldmatrix`` (:class:`LdMatrix`, either orientation).  Other operand fragments
are packed from the operands' values (fp32, read from shared memory or computed by a fused
elementwise chain) with ``pack_f16`` / ``pack_bf16``: any operand the CUDA-core engine can read,
the tensor cores can multiply.  An operand held in registers in the
C layout of the same rows (:attr:`Operand.frag`: FlashAttention-2's probabilities, which never
leave the registers) is packed from there: the C fragment of two adjacent 8-column tiles is the
A fragment of one 16-wide step.  Entries past a ragged reduced extent read as zero unless the
operand is zero-padded there already (:attr:`Operand.padded`).

The primitives (and their simulated twins, which check this indexing in CI) are in
:mod:`.tensorcore`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import LoweringError
from ..relabel.loopnest import Load, Loop
from .plan import MMA_SLACK, Frag
from . import producer
from .source import Source
from .tensorcore import TF32X3, mma_dtype
from .wgmma import emit_wgmma, shared_a_buffer

UNROLL_LIMIT = 256
"""At most this many mma calls are written out per contraction (all its 16-wide steps unrolled
in the source); beyond it the steps are a loop (operands in registers need the unrolled form)."""

B_PAIRS = True
"""Read the B fragments of two adjacent 8-column tiles by one ``ldmatrix .x4`` instead of two
``.x2`` (half the shared-memory load instructions of a contraction's column operand)."""

HOIST_REGISTERS = 64
"""Registers per thread a kernel may spend on row-operand fragments loaded once before a stream
loop instead of once per chunk (:func:`hoisted_fragments`; 0: never).  Measured on an H100, fp16,
N = 4096 (``kernels/BENCHMARKS.md``, "Third session of 2026-11-24"): 32 hold FlashAttention's Q at
d = 64 (forward 0.473 -> 0.455 ms, ``kernels/probes/wgmma_pipeline.py``; dQ 0.755 -> 0.641 ms);
64 hold the dQ kernel's Q and dO at d = 128 (1.468 -> 1.340 ms).  A contraction whose fragments
do not fit is left alone."""

TF32X3_STAGED = True
"""3xTF32 updates of an accumulator that is not zeroed by the contraction itself (a stream's
state: O, dK, dV, dQ) add each step's products to it by an fp32 add (``mma_tf32x3s``), not on
the tensor cores (whose addition does not round to nearest): 1e-6 of max |O| at 4096 keys on an
H100 against 4e-5 (kernels/BENCHMARKS.md).  Fresh accumulators (scores) sum on the tensor cores."""

HOIST_CEILING = 255
"""Fragments are hoisted only while the plan's register estimate plus them stays at or below
this, the registers a thread can have (the dK, dV kernel at d = 128, estimated 258, already
spills: hoisting K there took its spills from 276 to 884 bytes, ``kernels/ptx_resources.py``)."""


def _past_the_computing_registers(em, m: Frag, more: int) -> bool:
    """Whether ``more`` registers of hoisted warpgroup fragments would take the computing threads
    of a kernel with a copying warpgroup past what ``setmaxnreg`` gives them
    (:func:`.producer.consumer_registers`), the estimate's per-step A fragments (:data:`.plan.MMA_SLACK`)
    replaced by the hoisted ones.  The d = 128 forward with key chunks of 128 (estimate 197, 160
    registers each) held Q's 32 and ran 1.104 ms against 0.781 with Q read by descriptor (H200,
    kernels/BENCHMARKS.md, "Session of 2026-11-30"); with chunks of 64 (165) it holds them, level."""
    if not (em.specialise and m.wg):
        return False
    budget = producer.consumer_registers(em.T, em.plan.launch.blocks_per_sm)
    return em.plan.launch.registers - MMA_SLACK + more > budget


@dataclass
class FragHoist:
    """A stream loop's preamble: a slot before the loop for fragments of shared buffers the loop
    never rewrites (``varying``: the inputs its body loads), and the register names already there
    by ``(buffer key, mapping, reduced axis, row tile, step)``."""
    slot: Source
    axis: str
    varying: frozenset
    settled: bool          # every shared write before the slot already waited for and behind a barrier
    names: dict = field(default_factory=dict)


def loaded_vars(nodes) -> frozenset:
    """The variables a loop body (nested loops included) loads into shared memory."""
    out = set()
    for n in nodes:
        if isinstance(n, Load):
            out.add(n.var)
        elif isinstance(n, Loop):
            out |= loaded_vars(n.body)
    return frozenset(out)


def hoisted_fragments(em, m: Frag, key, kax: str, steps: int):
    """``{(row tile, step): four register names}`` of the A fragments of a contraction whose row
    operand sits in shared buffer ``key`` that the innermost enclosing stream loop never rewrites
    (an input loaded before the loop: FlashAttention's Q while K, V stream), ``ldmatrix``-ed once
    in the loop's preamble (after every copy has landed and a barrier) instead of once per chunk;
    None when there is no such loop, the buffer changes in it, or the fragments would take the
    kernel past :data:`HOIST_REGISTERS` or its register estimate past :data:`HOIST_CEILING`, or,
    for warpgroup MMAs beside a copying warpgroup, past the registers ``setmaxnreg`` gives the
    computing threads (:func:`_past_the_computing_registers`).

    Nor for warpgroup MMAs in a kernel with a mask: measured wrong on an H100 where the mask set
    the loop's bounds (causal and windowed forwards, every row past the first chunk), and on an
    H200 where it did not (grouped-query heads' causal dK, dV kernel, which streams the groups
    around the query chunks and skips none; with a window too).  The same kernels are right with
    the fragments read per chunk, with ``mma.sync``, and without a mask; re-converging each warp
    before the ``wgmma`` fence does not help; the simulator cannot tell.  The cause is not found
    (kernels/BENCHMARKS.md, "Fourth session of 2026-11-24", "Session of 2026-11-28 (H200)")."""
    if not em.frag_hoists or key[0] != "var" or key[1] >= em.n_in:
        return None
    h = em.frag_hoists[-1]
    if key[1] in h.varying or (m.wg and any(e.box.kind == "mask" for e in em.dd.eqns)):
        return None
    want = {(mt, ks): (key, m, kax, mt, ks) for mt in range(m.MT) for ks in range(steps)}
    new = [w for w in want.values() if w not in h.names]
    more = em.hoisted_regs + 4 * len(new)
    if more > HOIST_REGISTERS or em.plan.launch.registers + more > HOIST_CEILING or \
            _past_the_computing_registers(em, m, more):
        return None
    if new:
        k, s = em.consts, h.slot
        if not h.names and not h.settled:     # the first fragments here: wait for the copies once
            s.comment(f"fragments that stay in registers for the whole stream over {h.axis}: every copy "
                      f"issued so far has landed, then they are read once")
            s("cp_async_wait_all()")
            em.barrier(s, fence=True)    # written into the loop's preamble: fenced whatever came since
        frag_begin(em, m, s)
        ld = LdMatrix(em, m, kax, s)
        b = em.bufs[key]
        for w in new:
            _, _, _, mt, ks = w
            names = [em.names.fresh(f"{b.name}_a{mt}{ks}_{reg}") for reg in range(4)]
            s(f"{', '.join(names)} = {ld.a_tile(key, mt, k.u(16 * ks))}")
            h.names[w] = names
        em.hoisted_regs += 4 * len(new)
        em.notes += (f"Registers: the tensor-core fragments of {b.name} ({4 * len(new)} per thread) are "
                     f"read once before the stream over {h.axis}, not once per chunk.",)
    return {mk: h.names[w] for mk, w in want.items()}


def frag_begin(em, m: Frag, src: Source) -> None:
    """``ty`` (row group: 8 per warp row) and ``tx`` (column group: 4 per warp column)."""
    k = em.consts
    if m.Wn == 1:
        src(f"ty = tid // {k.u(4)}")
        src(f"tx = tid % {k.u(4)}")
        return
    if m.wg:   # warpgroups split the columns: warp w at (w % Wm, w // Wm), a warpgroup's 4 warps one above another
        src(f"ty = tid // {k.u(32)} % {k.u(m.Wm)} * {k.u(8)} + tid % {k.u(32)} // {k.u(4)}")
        src(f"tx = tid // {k.u(32 * m.Wm)} * {k.u(4)} + tid % {k.u(4)}")
        return
    src(f"ty = tid // {k.u(32 * m.Wn)} * {k.u(8)} + tid % {k.u(32)} // {k.u(4)}")
    src(f"tx = tid // {k.u(32)} % {k.u(m.Wn)} * {k.u(4)} + tid % {k.u(4)}")


def frag_rows(em, m: Frag, i: str) -> str:
    """The local row of element row ``i`` (an expression or a literal) of a thread's fragments."""
    k = em.consts
    base = f"ty // {k.u(8)} * {k.u(16 * m.MT)} + ty % {k.u(8)}" if m.Wm > 1 else "ty"
    if i.isdigit():
        off = 16 * (int(i) // 2) + 8 * (int(i) % 2)
        return f"{base} + {k.u(off)}" if off else base
    return f"{base} + {i} // {k.u(2)} * {k.u(16)} + {i} % {k.u(2)} * {k.u(8)}"


def frag_cols(em, m: Frag, j: str) -> str:
    """The local column of element column ``j`` of a thread's accumulator fragments."""
    k = em.consts
    base = f"tx // {k.u(4)} * {k.u(8 * m.NT)} + tx % {k.u(4)} * {k.u(2)}" if m.Wn > 1 else f"tx * {k.u(2)}"
    if j.isdigit():
        off = 8 * (int(j) // 2) + int(j) % 2
        return f"{base} + {k.u(off)}" if off else base
    return f"{base} + {j} // {k.u(2)} * {k.u(8)} + {j} % {k.u(2)}"


def _bcol_base(em, m: Frag) -> str:
    """Column of a lane's B fragment in column tile 0: the lane's group ``g``."""
    k = em.consts
    g = f"ty % {k.u(8)}" if m.Wm > 1 else "ty"
    return f"tx // {k.u(4)} * {k.u(8 * m.NT)} + {g}" if m.Wn > 1 else g


def contract_mma(em, m: Frag, acc: str, operands, red, src: Source, init: bool = True,
                 prescale=None, env: dict | None = None) -> None:
    """``acc[i, j] (*= prescale) (+)= sum over red of A . B`` on tensor cores (see the module
    docstring); ``operands``: the row operand and the column operand, in either order."""
    k = em.consts
    dt = mma_dtype(m.dtype)
    split = dt is TF32X3    # a packed pair is two registers, its big and small tf32 parts
    # 3xTF32 into an accumulator that outlives this contraction (a stream's state): staged
    mma = dt.staged if dt.staged and not init and TF32X3_STAGED else dt.mma
    zero = k.f(0.0, "ZERO")
    (kax,) = [a for a in red if em.ax[a].cap > 1]
    A = next(o for o in operands if m.row in o.axes)
    B = next(o for o in operands if m.col in o.axes)
    em.start_micro_acc(m, acc, init, prescale, src)
    kv = em.ax[kax]
    steps = kv.cap // 16
    unrolled = steps * m.MT * m.NT <= UNROLL_LIMIT or A.frag is not None or B.frag is not None
    if m.wg and B.buffer is None:
        raise LoweringError(f"internal: a warpgroup MMA over ({m.row}, {m.col}) without its column "
                            f"operand's 16-bit buffer")
    if split and (A.buffer is not None or B.buffer is not None or m.wg):
        raise LoweringError(f"internal: a 3xTF32 contraction over ({m.row}, {m.col}) reading a 16-bit buffer")
    if not m.wg:
        how = (f"3xTF32: 2x3 mma.sync.m16n8k8.tf32 per {m.MT}x{m.NT} tile" if split
               else f"{m.MT}x{m.NT} mma.sync.m16n8k16 ({m.dtype})")
        src.comment(f"{acc} += {' . '.join(sorted(f'({chr(32).join(sorted(o.axes))})' for o in (A, B)))} "
                    f"on tensor cores: {steps} step(s) of 16 along {kax}, {how} per warp and step")
    kb0 = em.names.fresh("kq")
    src(f"{kb0} = tx % {k.u(4)} * {k.u(2)}  # this lane's pair of columns in a 16-wide step")
    rows = [frag_rows(em, m, str(i)) for i in range(m.RY)]
    bbase = _bcol_base(em, m)
    guard = kv.ragged

    def element(o, r_axis, r_expr, kexpr):
        env2 = {r_axis: r_expr, kax: kexpr}
        val = o.read(env2, {}, src)
        if guard and not o.padded:
            val = f"({val} if {kexpr} < {kv.count} else {zero})"
        return val

    def pair(o, r_axis, r_expr, kexpr):
        lo = element(o, r_axis, r_expr, kexpr)
        hi = element(o, r_axis, r_expr, f"{kexpr} + {k.u(1)}")
        return f"{dt.pack}({lo}, {hi})"

    def frag_pair(o, i: int, c0: str):
        c1 = str(int(c0) + 1) if c0.isdigit() else f"{c0} + 1"
        return f"{dt.pack}({o.frag}[{i}, {c0}], {o.frag}[{i}, {c1}])"

    def reg(prefix: str) -> str:
        """A fresh register for one packed pair (3xTF32: its big and its small part)."""
        name = em.names.fresh(prefix)
        return f"{name}, {em.names.fresh(prefix + 's')}" if split else name

    held = hoisted_fragments(em, m, A.buffer, kax, steps) if A.buffer is not None and unrolled else None
    a_shared = shared_a_buffer(em, m, A, kax) if held is None else None   # A by descriptor (.wgmma)
    a_ldsm = A.buffer is not None and held is None and a_shared is None
    ldsm = LdMatrix(em, m, kax, src) if a_ldsm or (B.buffer is not None and not m.wg) else None
    if ldsm is not None:
        ldsm.lane_bases((A.buffer if a_ldsm else None, "a"), (B.buffer if not m.wg else None, "b"))

    def a_regs(ks: str, literal: bool) -> tuple[dict, str, str]:
        """This warp's A fragments of step ``ks`` (names by (row tile, register)), the lane's
        first column of the step and the step's offset along k."""
        kb = em.names.fresh("kb")
        src(f"{kb} = {kb0} + {k.u(16 * int(ks))}" if literal else f"{kb} = {kb0} + {ks} * {k.u(16)}")
        k16 = k.u(16 * int(ks)) if literal else f"{ks} * {k.u(16)}"
        a = {}
        for mt in range(m.MT):
            if held is not None:
                a.update({(mt, reg): nm for reg, nm in enumerate(held[mt, int(ks)])})
                continue
            if A.buffer is not None:
                names = [em.names.fresh(f"a{mt}{reg}") for reg in range(4)]
                src(f"{', '.join(names)} = {ldsm.a_tile(A.buffer, mt, k16)}")
                a.update({(mt, reg): nm for reg, nm in enumerate(names)})
                continue
            for r, (h, kh) in enumerate(((0, 0), (1, 0), (0, 8), (1, 8))):
                name = reg(f"a{mt}{r}")
                if A.frag is not None:
                    c0 = str(4 * int(ks) + kh // 4) if literal else f"{ks} * 4 + {kh // 4}"
                    src(f"{name} = {frag_pair(A, 2 * mt + h, c0)}")
                else:
                    kexpr = f"{kb} + {k.u(kh)}" if kh else kb
                    src(f"{name} = {pair(A, m.row, rows[2 * mt + h], kexpr)}")
                a[mt, r] = name
        return a, kb, k16

    if m.wg:   # warpgroups read B from its buffer by descriptor (.wgmma)
        emit_wgmma(em, m, acc, B, kax, steps, lambda ks: a_regs(str(ks), True)[0], src, fresh=init,
                   a_shared=a_shared)
        return

    def step(ks: str, literal: bool):
        a, kb, k16 = a_regs(ks, literal)
        paired: dict = {}
        for nt in range(m.NT):
            col = f"{bbase} + {k.u(8 * nt)}" if nt else bbase
            b = paired.pop(nt, [])
            if B.buffer is not None and not b:
                pair_nt = nt + 1 < m.NT and nt % 2 == 0 and B_PAIRS
                b = [em.names.fresh(f"b{nt + i // 2}{i % 2}") for i in range(4 if pair_nt else 2)]
                src(f"{', '.join(b)} = {ldsm.b_tile(B.buffer, nt, k16, 2 if pair_nt else 1)}")
                if pair_nt:   # the next column tile's pair came with this one (ldmatrix .x4)
                    b, paired[nt + 1] = b[:2], b[2:]
            for kh in ((0, 8) if B.buffer is None else ()):
                name = reg(f"b{nt}{kh // 8}")
                kexpr = f"{kb} + {k.u(kh)}" if kh else kb
                src(f"{name} = {pair(B, m.col, col, kexpr)}")
                b.append(name)
            for mt in range(m.MT):
                i0, j0 = 2 * mt, 2 * nt
                c = [f"{acc}[{i0}, {j0}]", f"{acc}[{i0}, {j0 + 1}]", f"{acc}[{i0 + 1}, {j0}]",
                     f"{acc}[{i0 + 1}, {j0 + 1}]"]
                src(f"{', '.join(c)} = {mma}({', '.join(a[mt, r] for r in range(4))}, "
                    f"{b[0]}, {b[1]}, {', '.join(c)})")

    if unrolled:
        for ks in range(steps):
            step(str(ks), True)
    else:
        ks = em.names.fresh("ks")
        with src.block(f"for {ks} in range({k.u(steps)}):"):
            step(ks, False)


class LdMatrix:
    """``ldmatrix`` addresses of a warp's fragments in a 16-bit buffer, either orientation: the
    reduced axis last (rows of the 8x8 matrices are rows of the operand) or the operand's own
    axis last (``.trans``).  Lane ``l`` gives one row address: for an A tile (16x16, x4) rows
    ``l % 16`` and columns ``8 * (l // 16)``; for a B tile (16x8, x2) the 16 rows ``l % 16``.

    An address is the buffer's index (linear in the axes' positions) of a lane part (the lane's
    row and column, the warp's offset) plus a tile part (which 16x16 or 16x8 tile, which k step:
    constants).  The lane part of each (buffer, orientation) goes through ``pin`` once per
    multiplication, so the compiler forms each fragment's address beside its load as
    ``lane part + constant`` (an immediate) instead of hoisting every address out of the stream
    loop into a register of its own (72 registers of a 4-warp FlashAttention forward)."""

    def __init__(self, em, m: Frag, kax: str, src: Source):
        self.em, self.m, self.kax, self.src = em, m, kax, src
        k = em.consts
        self.lane = em.names.fresh("lm")
        src(f"{self.lane} = tid % {k.u(32)}  # the row address this lane gives ldmatrix")
        self.wrow = f"ty // {k.u(8)} * {k.u(16 * m.MT)}" if m.Wm > 1 else None
        self.wcol = f"tx // {k.u(4)} * {k.u(8 * m.NT)}" if m.Wn > 1 else None
        self.pinned: dict = {}

    def lane_bases(self, *keys_and_tiles):
        """Pin the lane parts of the given ``(buffer, "a" | "b")`` operands now (before a loop
        over k steps, whose every load adds only its tile part)."""
        for key, tile in keys_and_tiles:
            if key is not None:
                if tile == "a":
                    self.a_tile(key, 0, None)
                    continue
                pairs = self.m.NT >= 2 and B_PAIRS
                if pairs:
                    self.b_tile(key, 0, None, 2)
                if self.m.NT % 2 or not pairs:
                    self.b_tile(key, 0, None, 1)

    def _at(self, key, fn: str, lane_env: dict, tile_env: dict) -> str:
        em = self.em
        b = em.bufs[key]
        if (key, fn) not in self.pinned:
            name = em.names.fresh(f"{b.name}_lane")
            self.src(f"{name} = pin({em.s16base(key)} + {em.sidx(b, lane_env)})  "
                     f"# this lane's row of {b.name} for ldmatrix")
            self.pinned[key, fn] = name
        zero = em.consts.u(0, "U0")
        if all(tile_env.get(a) in (None, zero) for a in lane_env):
            return f"{fn}(smem16, {self.pinned[key, fn]})"
        tile = em.sidx(b, {a: tile_env.get(a) or zero for a in lane_env})
        return f"{fn}(smem16, {self.pinned[key, fn]} + {tile})"

    @staticmethod
    def _plus(*terms) -> str:
        return " + ".join(t for t in terms if t)

    def a_tile(self, key, mt: int, k16: str | None) -> str:
        em, m, k, lane = self.em, self.m, self.em.consts, self.lane
        b = em.bufs[key]
        tile = {m.row: k.u(16 * mt) if mt else None, self.kax: k16}
        if b.axes[-1] == self.kax:
            env = {m.row: self._plus(self.wrow, f"{lane} % {k.u(16)}"),
                   self.kax: f"{lane} // {k.u(16)} * {k.u(8)}"}
            return self._at(key, "ldsm_x4", env, tile)
        env = {self.kax: self._plus(f"{lane} % {k.u(8)}", f"{lane} // {k.u(16)} * {k.u(8)}"),
               m.row: self._plus(self.wrow, f"{lane} // {k.u(8)} % {k.u(2)} * {k.u(8)}")}
        return self._at(key, "ldsm_x4_t", env, tile)

    def b_tile(self, key, nt: int, k16: str | None, count: int = 1) -> str:
        """B fragments of column tile ``nt`` (``count`` 2: and of tile ``nt + 1``, by one
        ``ldmatrix .x4``: lanes 16-31 address the second tile's rows, its two registers last)."""
        em, m, k, lane = self.em, self.m, self.em.consts, self.lane
        b = em.bufs[key]
        tile = {m.col: k.u(8 * nt) if nt else None, self.kax: k16}
        second = f"{lane} // {k.u(16)} * {k.u(8)}" if count == 2 else None
        x = "x4" if count == 2 else "x2"
        if b.axes[-1] == self.kax:
            env = {m.col: self._plus(self.wcol, f"{lane} % {k.u(8)}", second),
                   self.kax: f"{lane} // {k.u(8)} % {k.u(2)} * {k.u(8)}"}
            return self._at(key, f"ldsm_{x}", env, tile)
        env = {self.kax: f"{lane} % {k.u(16)}", m.col: self._plus(self.wcol, second) or k.u(0, "U0")}
        return self._at(key, f"ldsm_{x}_t", env, tile)
