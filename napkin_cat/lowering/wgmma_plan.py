"""Which tensor-core contractions move to warpgroup MMAs (:mod:`.wgmma`), and their column
operands' buffers to the core-matrix layout: a planner pass (after the shared buffers are laid
out, before the launch is sized)."""

from __future__ import annotations

import re
from dataclasses import replace

from .emit_acc import ACC_CODEGEN
from .plan import Frag, Structure, acc_reduced_axes, axes_set, reduced_axes, storage
from .wgmma import MAX_N, MIN_CC


# --------------------------------------------------------------------------- planning

def _contractions(ff, st: Structure, targets, accs):
    """``(place, mapping, operand vars, reduced axes)`` of every tensor-core contraction; ``place``
    says where the mapping lives: ``("t", var)``, ``("main", i)`` or ``("fused", i)``."""
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
    """(targets, accs, buffers, notes): contractions whose fragments and column buffer allow it
    move to warpgroup MMAs (``Frag.wg``) and their column buffers to the core-matrix layout
    (offsets reassigned); ``notes`` say why each other one stays on ``mma.sync``.  A mapping
    shared by several contractions moves only if each of them can."""
    if not enabled:
        return targets, accs, bufs, ()
    found = list(_contractions(ff, st, targets, accs))
    ok: dict[Frag, bool] = {}
    cores = set()
    notes = []
    for _, m, ins, red in found:
        key = mapping_ok(m, T) or column_buffer(ff, ax, m, ins, red, bufs, n_in, targets, absorbed)
        ok[m] = ok.get(m, True) and isinstance(key, tuple)
        if isinstance(key, tuple):
            cores.add((m, key))
        else:
            notes.append(f"Warpgroup MMA: the contraction over ({m.row}, {m.col}) stays on mma.sync: {key}.")
    if not any(ok.values()):
        return targets, accs, bufs, tuple(notes)
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
    return targets, accs, assign_offsets(bufs), tuple(notes)


def assign_offsets(bufs: dict) -> dict:
    """Each buffer at a 16-byte aligned word offset, in order."""
    off, out = 0, {}
    for key, b in bufs.items():
        out[key] = replace(b, offset=off)
        off += -(-b.size // 4) * 4
    return out
