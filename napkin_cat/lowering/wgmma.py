"""Hopper's warpgroup tensor cores (``wgmma.mma_async.m64nNk16``, sm_90a) for 16-bit contractions.

A contraction planned on :class:`~.plan.Frag` fragments whose warps each hold all the columns
(``Wn == 1``) in whole warpgroups (``Wm % 4 == 0``, every thread of the block) multiplies with
one ``wgmma`` per warpgroup, row tile and 16-wide step instead of ``NT`` ``mma.sync``: the
column operand (B) is read by the tensor cores straight from shared memory through a matrix
descriptor, the row operand (A) comes from registers in the ``mma.sync`` A-fragment layout
(``ldmatrix``, packed values, or :mod:`.frag_operands`' registers), and the fp32 accumulators
sit exactly where ``mma.sync`` puts them: warp ``w`` of a warpgroup owns rows ``16 w .. 16 w + 15``
of the 64, lane ``(g, t)`` rows ``g``, ``g + 8`` and columns ``8 j + 2 t``, ``+1`` of every 8-column
tile ``j`` (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" of wgmma).  So every
epilogue, row statistic and register copy reads the accumulators unchanged.

B's buffer has the *core-matrix* layout (:attr:`~.plan.Buffer.core`, no swizzle): over its axes
``(s, f)`` (``f`` fastest), element ``(s, f)`` at ``(s // 8) * 8 F + (f // 8) * 64 + (s % 8) * 8
+ f % 8`` (``F``: ``f``'s extent rounded up to 8), i.e. panels of 8 rows, each a run of 8 x 8
blocks of 128 contiguous bytes.  Rows of 8 elements stay contiguous, so ``cp.async`` and
``ldmatrix`` read it through the same index function as any buffer.  The descriptor names the
byte distance between blocks adjacent along the reduced axis (LBO) and along B's own axis (SBO):
with the reduced axis fastest (K-major) LBO = 128, SBO = 16 F; with B's axis fastest (MN-major,
``imm-trans-b = 1``) LBO = 16 F, SBO = 128.  These meanings were measured on an H100
(``kernels/probes/wgmma_probe.py``: both assignments of both majors against float64; the other
assignment is wrong) and are what the simulated twin below reads.

Ordering: shared memory written by ordinary stores (or ``cp.async``) and read by the tensor
cores' asynchronous proxy needs ``fence.proxy.async`` in each writing thread before the barrier
(``fence_proxy_async``, emitted before the barriers that publish such writes: :data:`FENCE_BY_WRITES`);
``wgmma_fence`` orders the registers before the first ``wgmma`` of a contraction,
``wgmma_commit`` closes the group and ``wgmma_wait_n*`` waits for it, passing the accumulators
through, so nothing reads them early; where later contractions are issued before this one's
epilogue (:mod:`.issue_ahead`), it waits with their number as depth (``wgmma_wait{D}_n*``).
No barrier sits between a commit and the wait that completes its group
(:func:`no_barrier_in_flight`, checked on every kernel :func:`.emit.render` writes).

Which contractions move is planned by :mod:`.wgmma_plan`.  On a GPU the primitives are inline
PTX generated per ``N`` (:func:`cu_source`, linked by :mod:`.tensorcore_gpu`); under the
simulator they are Python (:func:`.tensorcore.sim_wgmma`) that read the descriptor's layout as
the hardware does, so a wrong stride or orientation fails in CI.
"""

from __future__ import annotations

import re

from ..core.errors import LoweringError
from . import issue_ahead
from .plan import Frag

MAX_N = 256
"""The widest ``wgmma`` (columns of B per instruction)."""

PRELOAD_A = False
"""Form every step's A fragments before the first ``wgmma`` of a contraction (one register fence
for all; more registers live), instead of each step's just before its ``wgmma``."""

MIN_CC = (9, 0)
"""Compute capability with ``wgmma`` (sm_90a: H100, H200)."""

FENCE_BY_WRITES = True
"""In a kernel with warpgroup MMAs, ``fence.proxy.async`` only before the barriers that publish
writes to a buffer the tensor cores read by descriptor (False: before every barrier, as until
the fourth session of 2026-11-25).  A barrier that only ends the reads of a chunk (its ``wgmma``
already waited for) or publishes a buffer read by ``ldmatrix`` needs none.  Measured on an H100:
kernels/BENCHMARKS.md, "Fourth session of 2026-11-25"."""

FENCE_SPECIALISED = False
"""Beside a copying warpgroup, ``fence.proxy.async`` before every barrier of the computing threads
and every release of a chunk's buffers, as until the fifth session of 2026-11-30 (False: by writes,
as :data:`FENCE_BY_WRITES`).  A release follows the ``wgmma.wait_group`` that completes the chunk's
reads, so the copies that refill the buffer after it need no fence; the fence did wait for the
thread's ``red.global`` adds of dQ still in flight (Nsight Compute: 6% of the computing warps'
samples in the d = 128 backward).  Measured: kernels/BENCHMARKS.md, "Fifth session of 2026-11-30"."""

SHARED_A = True
"""Read the row operand (A) of a warpgroup MMA from its shared buffer by descriptor (``wgmma``'s
SS form) where it is an input's 16-bit buffer in the core-matrix layout with the reduced axis
fastest, one 64-row tile per warp's warpgroup, and its fragments are not held in registers: no
``ldmatrix`` of A into registers before each step (the backward's ``K`` and ``V``, a masked
forward's ``Q``).  False: A always from registers (the RS form), as until the fourth session of
2026-11-29."""

NAME = re.compile(r"^wgmma_(?P<dt>f16|bf16)_n(?P<n>\d+)(?P<ss>_ss)?(?P<zero>_z)?$"
                  r"|^wgmma_wait(?P<depth>[1-9]?)_n(?P<wn>\d+)$")
"""``wgmma_{dt}_n{N}`` (``D += A B``), ``wgmma_{dt}_n{N}_z`` (``D = A B``: scale-d 0, the
accumulators only written), the same with ``_ss`` before ``_z`` (A by descriptor too) and
``wgmma_wait[D]_n{N}`` (``wait_group D``, 0 unwritten: :mod:`.issue_ahead`)."""
FIXED = ("wgmma_fence", "wgmma_commit", "fence_proxy_async", "wgmma_desc16")
"""The primitives every kernel with a warpgroup MMA imports, beside its ``wgmma_*_n{N}``."""
SETMAXNREG = re.compile(r"^setmaxnreg_(inc|dec)_(\d+)$")
"""``setmaxnreg_{inc,dec}_{R}``: this warpgroup's registers per thread raised / lowered to ``R``
(a multiple of 8 from 24 to 256; :mod:`.producer`)."""


def known(name: str) -> bool:
    """Whether ``name`` is a primitive of this module (fixed, an MMA or wait, or ``setmaxnreg``), of
    :mod:`.staged_add` or of :mod:`.tma`."""
    from .staged_add import PRIMITIVES as STAGED
    from .tma import PRIMITIVES as TMA
    return (name in FIXED or name in STAGED or name in TMA or parse(name) is not None
            or SETMAXNREG.match(name) is not None)


def parse(name: str):
    """``(dtype, N, zero)`` of an MMA primitive's name, ``(None, N, depth)`` of a wait's, else None."""
    hit = NAME.match(name)
    if hit is None:
        return None
    if hit["wn"] is not None:
        return None, int(hit["wn"]), int(hit["depth"] or 0)
    return hit["dt"], int(hit["n"]), hit["zero"] is not None


def shared_a(name: str) -> bool:
    """Whether MMA primitive ``name`` reads A by descriptor (``_ss``)."""
    hit = NAME.match(name)
    return bool(hit and hit["ss"])


def operand_bytes(desc, n: int, trans):
    """The shared byte address of each element ``(k, c)`` (16 x ``n``) of the operand descriptor
    ``desc`` names: core matrices (swizzle mode 0), or 128-byte swizzled rows (mode 1, :mod:`.tma`):
    K-major, row ``c`` 128 bytes from row ``c - 1`` within 8-row groups SBO apart, ``k`` along it;
    MN-major (``trans``), row ``k`` 128 bytes from ``k - 1`` within groups SBO apart, 64 columns
    ``c`` along it, panels of 64 LBO apart; then the 16-byte unit XOR the row within 1024 bytes."""
    import numpy as np
    addr, lbo, sbo = desc_fields(desc)
    mode = (int(desc) >> 62) & 3
    k = np.arange(16)[:, None]
    c = np.arange(n)[None, :]
    if mode == 0:
        inner = (k % 8) * 16 + (c % 8) * 2 if int(trans) else (c % 8) * 16 + (k % 8) * 2
        return addr + (c // 8) * sbo + (k // 8) * lbo + inner
    if mode != 1:
        raise ValueError(f"descriptor swizzle mode {mode}: only 0 and 1 (128 bytes) are read")
    if int(trans):
        byte = addr + (c // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + (c % 64) * 2
    else:
        byte = addr + (c // 8) * sbo + (c % 8) * 128 + k * 2
    return byte ^ (((byte >> 7) & 7) << 4)


def desc_fields(desc) -> tuple[int, int, int]:
    """``(byte address, LBO, SBO)`` of a descriptor without swizzle (each field 14 bits of 16-byte
    units: bits 0-13, 16-29, 32-45), the inverse of :func:`descriptor`."""
    desc = int(desc)
    return tuple(((desc >> shift) & 0x3FFF) << 4 for shift in (0, 16, 32))


def descriptor(addr: int, lbo: int, sbo: int) -> int:
    """The 64-bit ``wgmma`` matrix descriptor (no swizzle, base offset 0) of shared byte address
    ``addr`` and byte strides ``lbo`` / ``sbo``: what the GPU's ``wgmma_desc16`` builds and the
    simulated twin decodes."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32)


# --------------------------------------------------------------------------- what a plan uses

def uses_wgmma(plan) -> bool:
    return any(isinstance(m, Frag) and m.wg for m in _mappings(plan))


def _mappings(plan):
    for t in plan.targets.values():
        yield t.mapping
    for p in plan.accs:
        yield p.main
        if p.fused is not None:
            yield p.fused.ms


def primitive_names(plan) -> tuple[str, ...]:
    """The warpgroup primitives a kernel's source imports (none without a warpgroup MMA)."""
    ms = sorted({(m.dtype, 8 * m.NT) for m in _mappings(plan) if isinstance(m, Frag) and m.wg})
    if not ms:
        return ()
    from .staged_add import PRIMITIVES as STAGED, staged_vars
    from .tma import PRIMITIVES as TMA, copied
    return (*FIXED, *sorted({f"wgmma_{dt}_n{n}{a}{z}" for dt, n in ms for a in ("", "_ss") for z in ("", "_z")}
                            | {f"wgmma_wait{d or ''}_n{n}" for _, n in ms for d in range(1 + issue_ahead.MAX_AHEAD)}),
            *(STAGED if staged_vars(plan.buffers) else ()),
            *(TMA if copied(plan.buffers.values()) else ()))


# --------------------------------------------------------------------------- layout and emission

def core_index(s: str, f: str, ld: int, u) -> str:
    """The element index of ``(s, f)`` in a core-matrix buffer whose rows hold ``ld`` elements;
    ``u(n)`` names an unsigned constant."""
    zero = u(0)
    terms = []
    if s != zero:
        terms += [f"({s}) // {u(8)} * {u(8 * ld)}", f"({s}) % {u(8)} * {u(8)}"]
    if f != zero:
        terms += [f"({f}) // {u(8)} * {u(64)}", f"({f}) % {u(8)}"]
    return " + ".join(terms) if terms else zero


def strides(b, kax: str) -> tuple[int, int, int, int]:
    """``(trans, LBO, SBO, elements per 16-wide step)`` of a core-matrix buffer read as B along
    ``kax``: K-major (``kax`` fastest, ``trans = 0``) or MN-major (``trans = 1``); a swizzled one
    (:mod:`.tma`): LBO the panel's bytes (MN-major; K-major: unused), SBO 8 rows of 128 bytes, and
    its steps :func:`step_units`."""
    if b.swizzle:
        panel = 128 * -(-b.caps[0] // 8) * 8
        return (0, 16, 1024, 0) if b.axes[-1] == kax else (1, panel, 1024, 0)
    F = b.ld
    if b.axes[-1] == kax:
        return 0, 128, 16 * F, 128
    return 1, 16 * F, 128, 16 * F


def step_units(b, kax: str, ks: int) -> int:
    """16-byte units from step 0's descriptor to step ``ks``'s (16 along ``kax`` a step): a swizzled
    K-major buffer's steps go 32 bytes along its 128-byte rows, then to the next panel."""
    if not b.swizzle:
        return 2 * strides(b, kax)[3] * ks // 16
    if b.axes[-1] == kax:
        return (16 * ks // 64) * 8 * -(-b.caps[0] // 8) * 8 + (16 * ks % 64) * 2 // 16
    return 16 * ks * 128 // 16


def shared_a_fits(m: Frag, key, b, kax: str, n_in: int) -> bool:
    """Whether a warpgroup MMA on ``m`` can read its row operand, buffer ``b`` under ``key``, by
    descriptor (:data:`SHARED_A`): an input's 16-bit shared buffer over ``(m.row, kax)`` in that
    order (K-major), one row tile per warp (``MT == 1``) so that each warpgroup's 64 rows are
    contiguous, and warpgroups stacked along the rows (``Wn == 1``) or each holding all of them
    (``Wm == 4``).  The planner puts such a buffer in the core-matrix layout
    (:func:`.wgmma_plan.plan_wgmma`), emission reads it so (:func:`shared_a_buffer`)."""
    return (SHARED_A and m.MT == 1 and (m.Wn == 1 or m.Wm == 4) and key is not None and key[0] == "var"
            and key[1] < n_in and b is not None and b.bits == 16 and tuple(b.axes) == (m.row, kax))


def shared_a_buffer(em, m: Frag, A, kax: str):
    """The buffer key of row operand ``A`` where this warpgroup MMA reads it by descriptor
    (:func:`shared_a_fits`, the buffer in core matrices, A not in registers already), else None."""
    b = em.bufs.get(A.buffer) if A.buffer is not None else None
    fits = (m.wg and A.frag is None and b is not None and b.core and not b.swizzle
            and shared_a_fits(m, A.buffer, b, kax, em.n_in))
    return A.buffer if fits else None


def emit_wgmma(em, m: Frag, acc: str, B, kax: str, steps: int, a_regs, src, fresh: bool = False,
               a_shared=None) -> None:
    """``acc += A . B`` as warpgroup MMAs: per 16-wide step ``ks`` and row tile ``mt`` one
    ``wgmma`` on this warp's A fragments ``a_regs(ks)[mt, 0..3]``, or with ``a_shared`` (A's buffer
    key, :func:`shared_a_buffer`) on A read by descriptor from the warpgroup's 64 rows of that
    buffer, advanced a step as B's; one commit and wait at the end.

    B's descriptor is built once and each step's is that one plus a constant (the address field
    counts 16-byte units and a buffer never crosses 256 KB, so the add stays in its field).  With
    ``fresh`` (``acc`` was just set to zero) the first step writes the accumulators without reading
    them (scale-d 0): no zeros are moved into the registers the tensor cores write."""
    k = em.consts
    n = 8 * m.NT
    b = em.bufs[B.buffer]
    trans, lbo, sbo, step = strides(b, kax)
    fn = f"wgmma_{m.dtype}_n{n}"
    desc = em.names.fresh(f"{b.name}_desc")
    src.comment(f"{acc} {'=' if fresh else '+='} on tensor cores by warpgroups: {steps} step(s) of 16 along {kax}, "
                f"{m.MT} wgmma.m64n{n}k16 ({m.dtype}) per step, B = {b.name} by descriptor "
                f"({'MN' if trans else 'K'}-major {'128-byte swizzled rows' if b.swizzle else 'core matrices'}), advanced "
                f"{16 * step_units(b, kax, 1)} bytes a step")
    base = em.s16base(B.buffer)
    if m.Wn > 1:   # this warpgroup's slice of the columns: its first column, 8 NT (tx // 4), in the core layout
        first = f"tx // {k.u(4)} * {k.u(8 * m.NT)}"
        base = f"{base} + {core_index(first, k.u(0), b.ld, k.u) if trans == 0 else core_index(k.u(0), first, b.ld, k.u)}"
    if b.swizzle and m.Wn > 1:
        raise LoweringError(f"{b.name}: a swizzled buffer read by warpgroups holding part of its columns")
    swz = f" | uint64({1 << 62})  # swizzle mode 1: 128-byte rows (.tma)" if b.swizzle else ""
    src(f"{desc} = wgmma_desc16(smem16, {base}, {k.u(lbo)}, {k.u(sbo)}){swz}")
    adesc = None
    if a_shared is not None:   # this warpgroup's first row: its first warp's (MT == 1), in the core layout
        a = em.bufs[a_shared]
        _, albo, asbo, astep = strides(a, kax)
        adesc = em.names.fresh(f"{a.name}_desc")
        row0 = f"tid // {k.u(128)} * {k.u(4)} % {k.u(m.Wm)} * {k.u(16)}" if m.Wm > 4 else k.u(0)
        src.comment(f"A = {a.name} by descriptor too (K-major core matrices): this warpgroup's 64 rows, "
                    f"advanced {2 * astep} bytes a step")
        src(f"{adesc} = wgmma_desc16(smem16, {em.s16base(a_shared)} + {core_index(row0, k.u(0), a.ld, k.u)}, "
            f"{k.u(albo)}, {k.u(asbo)})")
    tuples = []
    for mt in range(m.MT):
        t = em.names.fresh(f"{acc}_wg")
        elems = [e for nt in range(m.NT) for e in (f"{acc}[{2 * mt}, {2 * nt}]", f"{acc}[{2 * mt}, {2 * nt + 1}]",
                                                    f"{acc}[{2 * mt + 1}, {2 * nt}]", f"{acc}[{2 * mt + 1}, {2 * nt + 1}]")]
        tuples.append((t, elems))
        if not fresh:
            src(f"{t} = {' + '.join('(' + ', '.join(elems[i:i + 16]) + ',)' for i in range(0, len(elems), 16))}")
    pre = [a_regs(ks) for ks in range(steps)] if PRELOAD_A and adesc is None else None
    src("wgmma_fence()")
    for ks in range(steps):
        d = f"{desc} + {k.u(step_units(b, kax, ks))}" if ks else desc
        if adesc is not None:
            (t, _), = tuples
            ad = f"{adesc} + {k.u(2 * astep * ks // 16)}" if ks else adesc
            src(f"{t} = {fn}_ss_z(smem16, {ad}, {d}, {k.u(trans)})" if fresh and ks == 0
                else f"{t} = {fn}_ss(smem16, {ad}, {d}, {k.u(trans)}, {t})")
            continue
        a = pre[ks] if pre else a_regs(ks)
        for mt, (t, _) in enumerate(tuples):
            regs = ", ".join(a[mt, r] for r in range(4))
            if fresh and ks == 0:
                src(f"{t} = {fn}_z(smem16, {d}, {k.u(trans)}, {regs})")
            else:
                src(f"{t} = {fn}(smem16, {d}, {k.u(trans)}, {regs}, {t})")
    src("wgmma_commit()")
    issue_ahead.after_commit(em, m, [(t, n, elems) for t, elems in tuples], src, steps)


# --------------------------------------------------------------------------- the GPU's source

def setmaxnreg_source(name: str) -> str:
    """The PTX wrapper of ``setmaxnreg_{inc,dec}_{R}`` (the count is an immediate)."""
    how, regs = SETMAXNREG.match(name).groups()
    if int(regs) % 8 or not 24 <= int(regs) <= 256:
        raise ValueError(f"{name}: setmaxnreg takes a multiple of 8 from 24 to 256")
    return (f'extern "C" __device__ int nc_{name}(int* ret) {{\n'
            f'  asm volatile("setmaxnreg.{how}.sync.aligned.u32 {regs};\\n" ::: "memory");\n'
            f'  *ret = 0;\n  return 0;\n}}\n')


def cu_source(n: int) -> str:
    """Inline PTX of ``wgmma.m64n{n}k16`` (f16 and bf16 in, fp32 accumulators, A in registers):
    ``D += A B`` (the accumulators read and written, scale-d 1) and ``D = A B`` (``_z``: only
    written, scale-d 0), and of the waits that pass ``n / 2`` accumulators through, behind numba's
    device ABI (a tuple argument arrives as its elements; the result through the first pointer)."""
    r = n // 2
    params = ", ".join(f"float c{i}" for i in range(r))
    regs = ", ".join(f"%{i}" for i in range(r))
    init = " ".join(f"o.v[{i}] = c{i};" for i in range(r))
    text = [f"struct nc_acc{n} {{ float v[{r}]; }};"]
    # the A operand (then B's descriptor) of each form: RS, A in registers; SS, A by descriptor too,
    # K-major (imm-trans-a 0)
    forms = (("", f"{{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}", "",
              "unsigned a0, unsigned a1, unsigned a2, unsigned a3", '"r"(a0), "r"(a1), "r"(a2), "r"(a3), '),
             ("_ss", f"%{r}, %{r + 1}", "0, ", "unsigned long long adesc", '"l"(adesc), '))
    for dt in ("f16", "bf16"):
        for zero in (False, True):
            outs = ", ".join(f'"{"=" if zero else "+"}f"(o.v[{i}])' for i in range(r))
            acc_in, start = ("", f"nc_acc{n} o;") if zero else (f", {params}", f"nc_acc{n} o; {init}")
            for form, operands, trans_a, a_params, a_in in forms:
                body = [f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dt}.{dt} '
                        f'{{{regs}}}, {operands}, {0 if zero else 1}, 1, 1, {trans_a}{tb};\\n"\n'
                        f'                 : {outs}\n'
                        f'                 : {a_in}"l"(desc));' for tb in (0, 1)]
                text.append(
                    f'extern "C" __device__ int nc_wgmma_{dt}_n{n}{form}{"_z" if zero else ""}(nc_acc{n}* ret, '
                    f'{a_params}, unsigned long long desc, int trans{acc_in}) {{\n'
                    f'  {start}\n'
                    f'  if (trans) {{\n{body[1]}\n  }} else {{\n{body[0]}\n  }}\n'
                    f'  *ret = o;\n  return 0;\n}}')
    outs = ", ".join(f'"+f"(o.v[{i}])' for i in range(r))
    for depth in range(1 + max(1, issue_ahead.MAX_AHEAD)):   # wait D: all but the newest D groups done (:mod:`.issue_ahead`)
        text.append(
            f'extern "C" __device__ int nc_wgmma_wait{depth or ""}_n{n}(nc_acc{n}* ret, {params}) {{\n'
            f'  nc_acc{n} o; {init}\n'
            f'  asm volatile("wgmma.wait_group.sync.aligned {depth};\\n" : {outs} :: "memory");\n'
            f'  *ret = o;\n  return 0;\n}}')
    return "\n\n".join(text) + "\n"


_BARRIER = re.compile(r"\b(bar_named|bar_arrive|cuda\.syncthreads)\(")


def barriers_in_flight(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each barrier of ``source`` between a ``wgmma_commit()`` and the wait that
    completes its group (``wgmma_wait{D}_n*`` leaves the ``D`` latest groups pending; a plain wait,
    none), in the order of the text."""
    pending, found = 0, []
    for i, line in enumerate(source.splitlines(), 1):
        s = line.strip()
        if s == "wgmma_commit()":
            pending += 1
        elif "= wgmma_wait" in s:
            depth = re.search(r"wgmma_wait(\d*)_", s)[1]
            pending = min(pending, int(depth)) if depth else 0
        elif pending and _BARRIER.search(s):
            found.append((i, s))
    return found


def no_barrier_in_flight(source: str) -> str:
    """``source``, or :class:`LoweringError` where a barrier sits while a warpgroup MMA group is in
    flight.  Measured on an H200 (kernels/BENCHMARKS.md, "Session of 2026-11-30", the ping-pong
    probe): a named-barrier arrival in a branch between a commit and its wait gave a forward whose O
    was wrong (relative error 1.05), right in the simulator, whose twins cannot show it; out of
    the branch, the same kernel was right.  The generator places its barriers after the waits."""
    found = barriers_in_flight(source)
    if found:
        line, text = found[0]
        raise LoweringError(f"internal: a barrier while a warpgroup MMA group is in flight (line {line}: "
                            f"{text!r}), measured wrong on the GPU: {len(found)} such barrier(s)")
    return source
