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
(``fence_proxy_async``, emitted before every block barrier of a kernel with a warpgroup MMA);
``wgmma_fence`` orders the registers before the first ``wgmma`` of a contraction,
``wgmma_commit`` closes the group and ``wgmma_wait_n*`` waits for it, passing the accumulators
through, so nothing reads them early.

On a GPU the primitives are inline PTX generated per ``N`` (:func:`cu_source`, linked by
:mod:`.tensorcore_gpu`); under the simulator they are Python (:func:`sim_primitive`) that read
the descriptor's layout as the hardware does, so a wrong stride or orientation fails in CI.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from .plan import Frag, Structure, acc_reduced_axes, axes_set, reduced_axes, storage

MAX_N = 256
"""The widest ``wgmma`` (columns of B per instruction)."""

MIN_CC = (9, 0)
"""Compute capability with ``wgmma`` (sm_90a: H100, H200)."""

NAME = re.compile(r"^wgmma_(f16|bf16)_n(\d+)$|^wgmma_wait_n(\d+)$")
FIXED = ("wgmma_fence", "wgmma_commit", "fence_proxy_async")
"""The primitives every kernel with a warpgroup MMA imports, beside its ``wgmma_*_n{N}``."""


# --------------------------------------------------------------------------- planning

def _contractions(ff, st: Structure, targets, accs):
    """``(place, mapping, operand vars, reduced axes)`` of every tensor-core contraction; ``place``
    says where the mapping lives: ``("t", var)``, ``("main", i)`` or ``("fused", i)``."""
    from .emit_acc import ACC_CODEGEN   # (emit_acc reaches this module through emit_mma)
    dd = ff.diagram
    fused_targets = {p.fused.target for p in accs if p.fused is not None}
    for v, t in targets.items():
        if t.engine == "mma" and isinstance(t.mapping, Frag) and t.source is not None \
                and t.source not in st.acc_of_var and v not in fused_targets:
            k = st.eqn_of[t.source]
            yield ("t", v), t.mapping, dd.eqns[k].ins, reduced_axes(dd.eqns[k].box)
    for p in accs:
        if p.engine != "mma" or not ACC_CODEGEN[p.acc.rule].contraction:
            continue
        ins = dd.eqns[p.acc.eqn].ins
        if p.fused is not None and isinstance(p.fused.ms, Frag):
            k = st.eqn_of[p.fused.source]
            yield ("fused", p.index), p.fused.ms, dd.eqns[k].ins, reduced_axes(dd.eqns[k].box)
        if isinstance(p.main, Frag):
            ops = ins[1:] if p.stat is not None else ins
            yield ("main", p.index), p.main, ops, acc_reduced_axes(p.acc)


def column_buffer(ff, ax, m: Frag, ins, red, bufs, n_in, targets, absorbed):
    """The key of the 16-bit buffer a warpgroup MMA on ``m`` reads its column operand from, or
    the reason it cannot (a string)."""
    types = ff.diagram.var_types()
    kax = [a for a in red if ax[a].cap > 1]
    if len(kax) != 1:
        return f"{len(kax)} reduced axes of extent > 1"
    (kax,) = kax
    cols = [v for v in ins if m.col in axes_set(types[v], ax) and m.row not in axes_set(types[v], ax)]
    if len(cols) != 1:
        return "no single column operand"
    v = cols[0]
    key = ("var", v)
    b = bufs.get(key)
    if storage(v, n_in, targets, absorbed) not in ("load", "smem") or b is None or b.bits != 16:
        return "its column operand is not a 16-bit shared buffer"
    if set(b.axes) != {m.col, kax} or len(b.axes) != 2 or b.copies not in (1, 2):
        return f"its column operand's buffer has axes {b.axes}, not ({m.col}, {kax})"
    if ax[kax].cap % 16 or ax[m.col].cap % 8 or -(-ax[m.col].cap // 8) != m.NT:
        return f"{kax} % 16 or {m.col} % 8 or the warp's {8 * m.NT} columns"
    return key


def wgmma_capable() -> bool:
    """Whether the GPU kernels are built for (the current one; without one, the H100 of
    :data:`~.devices.H100_DEFAULTS`) has warpgroup MMAs."""
    import sys
    from .devices import H100_DEFAULTS, device_limits
    lim = device_limits() if "numba.cuda" in sys.modules else H100_DEFAULTS
    return tuple(lim.compute_capability) >= MIN_CC


def mapping_ok(m: Frag, T: int) -> str | None:
    """Why fragments ``m`` cannot be multiplied by warpgroups on ``T`` threads (None: they can)."""
    if m.Wn != 1 or m.Wm % 4 or 32 * m.Wm * m.Wn != T:
        return f"{m.Wm}x{m.Wn} warps on {T} threads (needs whole warpgroups of warps holding every column)"
    if 8 * m.NT > MAX_N:
        return f"{8 * m.NT} columns per warp (at most {MAX_N})"
    return None


def plan_wgmma(ff, ax, st: Structure, targets, accs, bufs, T: int, n_in: int, absorbed, enabled: bool):
    """(targets, accs, buffers): contractions whose fragments and column buffer allow it move to
    warpgroup MMAs (``Frag.wg``) and their column buffers to the core-matrix layout (offsets
    reassigned).  A mapping shared by several contractions moves only if each of them can."""
    if not enabled:
        return targets, accs, bufs
    found = list(_contractions(ff, st, targets, accs))
    ok: dict[Frag, bool] = {}
    cores = set()
    for _, m, ins, red in found:
        key = column_buffer(ff, ax, m, ins, red, bufs, n_in, targets, absorbed) \
            if mapping_ok(m, T) is None else None
        ok[m] = ok.get(m, True) and isinstance(key, tuple)
        if isinstance(key, tuple):
            cores.add((m, key))
    if not any(ok.values()):
        return targets, accs, bufs
    wg = {m: replace(m, wg=True) for m, good in ok.items() if good}
    targets = {v: (replace(t, mapping=wg[t.mapping]) if t.mapping in wg else t) for v, t in targets.items()}
    accs = [replace(p, main=wg.get(p.main, p.main),
                    fused=(replace(p.fused, ms=wg[p.fused.ms]) if p.fused is not None and p.fused.ms in wg
                           else p.fused)) for p in accs]
    bufs = dict(bufs)
    for m, key in cores:
        if m in wg and not bufs[key].core:
            b = bufs[key]
            what = re.sub(r", rows padded by \d+\)", ")", b.what) + " (core matrices for wgmma)"
            bufs[key] = replace(b, core=True, pad=0, what=what)
    return targets, accs, assign_offsets(bufs)


def assign_offsets(bufs: dict) -> dict:
    """Each buffer at a 16-byte aligned word offset, in order."""
    off, out = 0, {}
    for key, b in bufs.items():
        out[key] = replace(b, offset=off)
        off += -(-b.size // 4) * 4
    return out


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
    return (*FIXED, *sorted({f"wgmma_{dt}_n{n}" for dt, n in ms} | {f"wgmma_wait_n{n}" for _, n in ms}))


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
    ``kax``: K-major (``kax`` fastest, ``trans = 0``) or MN-major (``trans = 1``)."""
    F = b.ld
    if b.axes[-1] == kax:
        return 0, 128, 16 * F, 128
    return 1, 16 * F, 128, 16 * F


def emit_wgmma(em, m: Frag, acc: str, B, kax: str, steps: int, a_regs, src) -> None:
    """``acc += A . B`` as warpgroup MMAs: per 16-wide step ``ks`` and row tile ``mt`` one
    ``wgmma`` on this warp's A fragments ``a_regs(ks)[mt, 0..3]``; one commit and wait at the end."""
    k = em.consts
    n = 8 * m.NT
    b = em.bufs[B.buffer]
    trans, lbo, sbo, step = strides(b, kax)
    fn = f"wgmma_{m.dtype}_n{n}"
    base = em.s16base(B.buffer)
    src.comment(f"{acc} += on tensor cores by warpgroups: {steps} step(s) of 16 along {kax}, {m.MT} "
                f"wgmma.m64n{n}k16 ({m.dtype}) per step, B = {b.name} by descriptor "
                f"({'MN' if trans else 'K'}-major core matrices)")
    tuples = []
    for mt in range(m.MT):
        t = em.names.fresh(f"{acc}_wg")
        elems = [e for nt in range(m.NT) for e in (f"{acc}[{2 * mt}, {2 * nt}]", f"{acc}[{2 * mt}, {2 * nt + 1}]",
                                                    f"{acc}[{2 * mt + 1}, {2 * nt}]", f"{acc}[{2 * mt + 1}, {2 * nt + 1}]")]
        tuples.append((t, elems))
        src(f"{t} = {' + '.join('(' + ', '.join(elems[i:i + 16]) + ',)' for i in range(0, len(elems), 16))}")
    src("wgmma_fence()")
    for ks in range(steps):
        a = a_regs(ks)
        off = f"{base} + {k.u(ks * step)}" if ks else base
        for mt, (t, _) in enumerate(tuples):
            regs = ", ".join(a[mt, r] for r in range(4))
            src(f"{t} = {fn}(smem16, {off}, {k.u(lbo)}, {k.u(sbo)}, {k.u(trans)}, {regs}, {t})")
    src("wgmma_commit()")
    for t, elems in tuples:
        src(f"{t} = wgmma_wait_n{n}({t})")
        src(f"{', '.join(elems)} = {t}")


# --------------------------------------------------------------------------- the GPU's source

def cu_source(n: int) -> str:
    """Inline PTX of ``wgmma.m64n{n}k16`` (f16 and bf16 in, fp32 accumulators, A in registers)
    and of the wait that passes ``n / 2`` accumulators through, behind numba's device ABI (a
    tuple argument arrives as its elements; the result through the first pointer)."""
    r = n // 2
    params = ", ".join(f"float c{i}" for i in range(r))
    outs = ", ".join(f'"+f"(o.v[{i}])' for i in range(r))
    regs = ", ".join(f"%{i}" for i in range(r))
    init = " ".join(f"o.v[{i}] = c{i};" for i in range(r))
    text = [f"struct nc_acc{n} {{ float v[{r}]; }};"]
    for dt in ("f16", "bf16"):
        body = []
        for tb in (0, 1):
            body.append(f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dt}.{dt} '
                        f'{{{regs}}}, {{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, 1, 1, 1, {tb};\\n"\n'
                        f'                 : {outs}\n'
                        f'                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));')
        text.append(
            f'extern "C" __device__ int nc_wgmma_{dt}_n{n}(nc_acc{n}* ret, unsigned a0, unsigned a1, '
            f'unsigned a2, unsigned a3, unsigned long long desc, int trans, {params}) {{\n'
            f'  nc_acc{n} o; {init}\n'
            f'  if (trans) {{\n{body[1]}\n  }} else {{\n{body[0]}\n  }}\n'
            f'  *ret = o;\n  return 0;\n}}')
    text.append(
        f'extern "C" __device__ int nc_wgmma_wait_n{n}(nc_acc{n}* ret, {params}) {{\n'
        f'  nc_acc{n} o; {init}\n'
        f'  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" : {outs} :: "memory");\n'
        f'  *ret = o;\n  return 0;\n}}')
    return "\n\n".join(text) + "\n"


# --------------------------------------------------------------------------- the simulator's twins

def _lane():
    from .tensorcore import _context
    ctx = _context()
    tid = int(ctx.threadIdx.x)
    return ctx, tid // 32, tid % 32


def sim_wgmma(values, n: int, smem16, off, lbo, sbo, trans, a0, a1, a2, a3, acc):
    """One lane's part of a warpgroup MMA: the warp's A fragments are exchanged (the rows of A
    this warp owns), B is read from ``smem16`` as the descriptor describes, and the lane's
    accumulators of ``D = A B + C`` are returned in the ``mma.sync`` C order per 8-column tile."""
    from .tensorcore import _A_HALF, _A_LANE
    ctx, warp, lane = _lane()
    exchange = ctx.shared.array((32, 32, 4), np.uint32)
    exchange[warp, lane] = (a0, a1, a2, a3)
    ctx.syncthreads()
    words = np.array(exchange[warp], dtype=np.uint32)
    ctx.syncthreads()
    A = values(words.view(np.uint16).reshape(32, 8))[_A_LANE, _A_HALF]       # 16 x 16
    k = np.arange(16)[:, None]
    c = np.arange(n)[None, :]
    inner = (k % 8) * 16 + (c % 8) * 2 if int(trans) else (c % 8) * 16 + (k % 8) * 2
    byte = 2 * int(off) + (c // 8) * int(sbo) + (k // 8) * int(lbo) + inner
    B = values(np.asarray(smem16)[byte // 2].astype(np.int16).view(np.uint16))  # 16 x n
    D = A @ B
    g, t = divmod(lane, 4)
    out = []
    for nt in range(n // 8):
        col = 8 * nt + 2 * t
        out += [D[g, col], D[g, col + 1], D[g + 8, col], D[g + 8, col + 1]]
    return tuple(np.float32(float(x) + float(y)) for x, y in zip(acc, out))


def sim_primitive(name: str):
    """The simulated twin of warpgroup primitive ``name`` (None: not one)."""
    from .tensorcore import _bf16_values, _f16_values
    if name in FIXED:
        return lambda: 0
    hit = NAME.match(name)
    if hit is None:
        return None
    if hit.group(3):
        return lambda acc: tuple(acc)
    values = _f16_values if hit.group(1) == "f16" else _bf16_values
    n = int(hit.group(2))
    return lambda *args: sim_wgmma(values, n, *args)
