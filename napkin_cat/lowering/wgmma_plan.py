"""Which tensor-core contractions move to warpgroup MMAs (:mod:`.wgmma`), and their column
operands' buffers to the core-matrix layout: a planner pass (after the shared buffers are laid
out, before the launch is sized)."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace

from ..relabel.loopnest import Loop
from .emit_acc import ACC_CODEGEN
from .plan import Frag, Structure, acc_reduced_axes, axes_set, reduced_axes, storage
from .wgmma import MAX_N, MIN_CC, shared_a_fits


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
    if set(b.axes) != {m.col, kax} or len(b.axes) != 2:
        return f"its column operand's buffer has axes {b.axes}, not ({m.col}, {kax})"
    if ax[kax].cap % 16 or ax[m.col].cap % 8 or -(-ax[m.col].cap // 8) != m.NT * m.Wn:
        return f"{kax} % 16 or {m.col} % 8 or the warps' {8 * m.NT} x {m.Wn} columns"
    return key


def row_buffer(ff, ax, m: Frag, ins, red, bufs, n_in):
    """The key of the buffer a warpgroup MMA on ``m`` may read its row operand from by descriptor
    (:func:`.wgmma.shared_a_fits`), or None."""
    types = ff.diagram.var_types()
    kax = [a for a in red if ax[a].cap > 1]
    rows = [v for v in ins if m.row in axes_set(types[v], ax) and m.col not in axes_set(types[v], ax)]
    if len(kax) != 1 or len(rows) != 1:
        return None
    key = ("var", rows[0])
    b = bufs.get(key)
    return key if shared_a_fits(m, key, b, kax[0], n_in) else None


def column_only(ff, ax, st, targets, accs, bufs, n_in, v) -> bool:
    """Whether variable ``v`` is read by contractions only as the column operand (B, by descriptor)
    of warpgroup MMAs whose warps each hold all its columns (``Wn == 1``): no ``ldmatrix`` reads
    it, nor a descriptor of a slice (:mod:`.tma`)."""
    key = ("var", v)
    return all(m.wg and m.Wn == 1 and row_buffer(ff, ax, m, ins, red, bufs, n_in) != key
               and column_buffer(ff, ax, m, ins, red, bufs, n_in, targets, {}) == key
               for _, m, ins, red in _contractions(ff, st, targets, accs) if v in ins)


def wgmma_capable() -> bool:
    """Whether the GPU kernels are built for (the current one; without one, the H100 of
    :data:`~.devices.H100_DEFAULTS`) has warpgroup MMAs."""
    import sys
    from .devices import H100_DEFAULTS, device_limits
    lim = device_limits() if "numba.cuda" in sys.modules else H100_DEFAULTS
    return tuple(lim.compute_capability) >= MIN_CC


AUTO_MIN_THREADS = 256
"""Threads a kernel needs for warpgroup MMAs under ``planner.WGMMA = "auto"`` (several warpgroups)."""

AUTO_MIN_COLUMNS = 64
"""Columns (``N``) a contraction's warpgroup MMA needs under ``planner.WGMMA = "auto"`` where its
columns are a stream loop's chunk: measured on an H100 (fp16, N = 4096), the causal dQ kernel,
whose keys stream in chunks of 32 (``m64n32``), ran 0.42-0.44 ms against ``mma.sync``'s 0.36 at
d = 64 and 0.91 against 0.78 at d = 128, where the kernels with 64 columns or more gained
(kernels/BENCHMARKS.md, "Third session of 2026-11-25").  Narrower columns of a whole block (the
one-kernel backward's dQ = dS K, ``m64n32`` over d = 64 split between two warpgroups) are not
limited: that kernel measured faster on warpgroups (kernels/BENCHMARKS.md, "Fourth session of
2026-11-25")."""


def auto_why_not(T: int, accs) -> str | None:
    """Why a kernel of ``T`` threads with accumulators ``accs`` gets no warpgroup MMAs under
    ``planner.WGMMA = "auto"`` (None: its contractions move where their fragments and buffers
    allow, and each has :data:`AUTO_MIN_COLUMNS`).

    ``"auto"`` follows what was measured on an H100 (fp16, N = 4096, every kernel checked against
    float64 first; kernels/BENCHMARKS.md, "Warpgroup MMA" and "Third session of 2026-11-25"):

    - kernels whose accumulators are plain sums, on two warpgroups or more, multiplied faster by
      ``wgmma`` (the attention backward's dK, dV kernel 0.892 against 0.920 ms at d = 64, 1.889
      against 2.056 at d = 128, where ``mma.sync``'s fragments read each column operand once per
      warp and saturate shared memory; the dQ kernel 0.62 against 0.64 at d = 64);
    - one warpgroup ran slower (the forward at 64 rows, 1.056 against 0.532 ms): each ``wgmma``
      is collective over the warpgroup, its warps wait on each other at every contraction;
    - an accumulator rescaled every chunk (an online softmax's output) ran slower on two
      warpgroups too (0.604 against 0.543 ms, 128 rows and 256 threads): it is waited for and
      rescaled on the CUDA cores every chunk.  With a copying warpgroup (``producer.SWITCH``) it
      wins (0.427 ms at 256 rows against 0.459), so it moves where one joins
      (:func:`.producer.joins`; where the kernel then gets none, :func:`napkin_cat.lower` plans
      it again without, :func:`.producer.switched_off`)."""
    if T < AUTO_MIN_THREADS:
        return f"{T} threads, one warpgroup: measured slower than mma.sync (planner.WGMMA = True forces it)"
    from . import producer
    if producer.rescaled(accs) and not producer.joins(T):
        return ("an accumulator rescaled every chunk (online softmax): measured slower than mma.sync unless a "
                "copying warpgroup joins 256 computing threads or more (producer.SWITCH)")
    return None


def mapping_ok(m: Frag, T: int) -> str | None:
    """Why fragments ``m`` cannot be multiplied by warpgroups on ``T`` threads (None: they can):
    whole warpgroups of 4 warps one above another (``Wm % 4 == 0``), each holding every column
    or, with ``Wn > 1``, one slice of them (:attr:`~.plan.Frag.wg`'s warp order)."""
    if m.Wm % 4 or 32 * m.Wm * m.Wn != T:
        return f"{m.Wm}x{m.Wn} warps on {T} threads (needs whole warpgroups of 4 warps one above another)"
    if 8 * m.NT > MAX_N:
        return f"{8 * m.NT} columns per warp (at most {MAX_N})"
    return None


def warpgroup_frag(m: Frag, T: int) -> Frag | None:
    """``m``'s extents on the same ``T`` threads as warpgroups: ``Wm`` a multiple of 4 (rows in
    slabs of 64 per warpgroup) and the columns split among ``Wn`` warpgroup columns, the widest
    slices first; None where no such split fits (or ``m`` already is one)."""
    if mapping_ok(m, T) is None:
        return None
    W = T // 32
    rows, cols = 16 * m.MT * m.Wm, 8 * m.NT * m.Wn
    for Wm in range(4, W + 1, 4):
        Wn = W // Wm
        if W % Wm or rows % (16 * Wm) or cols % (8 * Wn) or cols // Wn > MAX_N:
            continue
        MT, NT = rows // (16 * Wm), cols // (8 * Wn)
        return replace(m, RY=2 * MT, RX=2 * NT, TY=8 * Wm, TX=4 * Wn, Wm=Wm, Wn=Wn)
    return None


def plan_wgmma(ff, ax, st: Structure, targets, accs, bufs, T: int, n_in: int, absorbed, mode):
    """(targets, accs, buffers, notes): contractions whose fragments and column buffer allow it
    move to warpgroup MMAs (``Frag.wg``) and their column buffers to the core-matrix layout
    (offsets reassigned); ``notes`` say why each other one stays on ``mma.sync``.  A mapping
    shared by several contractions moves only if each of them can.  ``mode``: ``planner.WGMMA``
    (``"auto"``: only where :func:`auto_why_not` finds nothing and every contraction whose
    columns are a stream's chunk has :data:`AUTO_MIN_COLUMNS`, else none, said in a note)."""
    if mode not in (True, False, "auto", 0, 1):
        from ..core.errors import LoweringError
        raise LoweringError(f"planner.WGMMA must be True, False or 'auto', got {mode!r}")
    if not mode or not wgmma_capable():
        return targets, accs, bufs, ()
    found = list(_contractions(ff, st, targets, accs))
    shaped = _reshaped(ff, ax, found, targets, accs, bufs, T, n_in, absorbed)
    found = [(place, shaped.get(m, m), ins, red) for place, m, ins, red in found]
    if mode == "auto":
        why = auto_why_not(T, accs)
        if why is not None:   # said where a contraction could have moved
            could = any(mapping_ok(m, T) is None for _, m, _, _ in found)
            return targets, accs, bufs, ((f"Warpgroup MMA: not used: {why}.",) if could else ())
        streamed = {n.axis for n, _ in ff.walk() if isinstance(n, Loop) and n.kind == "stream"}
        narrow = [m for _, m, _, _ in found if 8 * m.NT < AUTO_MIN_COLUMNS and m.col in streamed]
        if narrow:   # the whole kernel stays: kernels with engines mixed were not measured
            m = narrow[0]
            return targets, accs, bufs, (f"Warpgroup MMA: not used: the contraction over ({m.row}, {m.col}) has "
                                         f"{8 * m.NT} columns, fewer than {AUTO_MIN_COLUMNS}: measured slower than "
                                         f"mma.sync (planner.WGMMA = True forces it).",)
    ok: dict[Frag, bool] = {}
    cores = set()
    notes = []
    for _, m, ins, red in found:
        key = mapping_ok(m, T) or column_buffer(ff, ax, m, ins, red, bufs, n_in, targets, absorbed)
        ok[m] = ok.get(m, True) and isinstance(key, tuple)
        if isinstance(key, tuple):
            cores.add((m, key))
            if (a := row_buffer(ff, ax, m, ins, red, bufs, n_in)) is not None:
                cores.add((m, a))   # A read by descriptor where emission finds it so (.wgmma.shared_a_buffer)
        else:
            notes.append(f"Warpgroup MMA: the contraction over ({m.row}, {m.col}) stays on mma.sync: {key}.")
    if not any(ok.values()):
        return targets, accs, bufs, tuple(notes)
    wg = {m: replace(m, wg=True) for m, good in ok.items() if good}
    wg.update({old: wg[new] for old, new in shaped.items() if new in wg})
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


def _reshaped(ff, ax, found, targets, accs, bufs, T: int, n_in: int, absorbed) -> dict:
    """``{mapping: its warpgroup shape}`` (:func:`warpgroup_frag`) for the contractions whose
    warps are not in warpgroups: only a target's own mapping (no other target or accumulator
    shares it), and only where the reshaped warps' column operand is a buffer they can read."""
    out = {}
    for place, m, ins, red in found:
        alt = warpgroup_frag(m, T) if place[0] == "t" else None
        shared = sum(t.mapping == m for t in targets.values()) > 1 or any(
            m in (p.main, p.stat, p.fused.ms if p.fused is not None else None) for p in accs)
        if alt is not None and not shared \
                and isinstance(column_buffer(ff, ax, alt, ins, red, bufs, n_in, targets, absorbed), tuple):
            out[m] = alt
    return out


def assign_offsets(bufs: dict) -> dict:
    """Each buffer at a 16-byte aligned word offset, in order (TMA's at 128 bytes, swizzled ones at 1024: .tma)."""
    off, out = 0, {}
    for key, b in bufs.items():
        align = 256 if b.swizzle else 32 if b.tma else 4    # words: TMA's swizzle atoms, its 128-byte boxes
        off = -(-off // align) * align
        out[key] = replace(b, offset=off)
        off += -(-b.size // 4) * 4
    return out


def awaited_copying_warpgroup(plan, extra_threads: int, mode) -> bool:
    """Whether ``plan`` moved an accumulator rescaled every chunk to warpgroup MMAs under
    ``"auto"`` (``mode``: ``planner.WGMMA``) counting on a copying warpgroup that its kernel did
    not get (``extra_threads``)."""
    from . import producer
    from .wgmma import uses_wgmma
    return mode == "auto" and not extra_threads and uses_wgmma(plan) and producer.rescaled(plan.accs)


def warpgroup_forward(d0, simulate: bool, mode) -> int:
    """The computing threads of the blocks ``d0``'s (unrelabelled) warpgroup forward was measured
    fastest at, or 0 (the schedule's other rules): a 16-bit softmax-contraction on a GPU with
    warpgroup MMAs and a copying warpgroup (``mode``: ``planner.WGMMA``, ``"auto"``) gets

    - at head widths up to :data:`FORWARD_MAX_WIDTH`, with no mask: 512 threads and 256 rows (four
      warpgroups of 64 rows sharing each chunk: 0.381 ms against two warpgroups of 128 rows' 0.404-0.407
      on an H200, kernels/BENCHMARKS.md, "Session of 2026-11-30"; those two measured 0.411 against
      ``mma.sync``'s 0.475 at 128 rows on 128 threads, d = 64).  Masked from the first column on
      (causal; :data:`FORWARD_NARROW_MASKED`) likewise: 0.241 against ``mma.sync``'s 0.258 at 128
      rows (two warpgroups of 128 rows: 0.261, as 0.263 against 0.257 in the "Fifth session of
      2026-11-25"; block-causal, prefix-LM and grouped causal 5-8% faster too); not under a band nor
      a mask of unknown support (as at d = 128); under a mask that reads data (a document's ids) only
      inside :func:`data_masks`: :mod:`.tabled` lowers that form beside the other and chooses
      between them at each launch, from their block tables;
    - at width :data:`FORWARD_WIDE`, unmasked or masked from the first column on (causal): 384
      threads and 192 rows (three warpgroups of 64 rows: 0.837 ms against ``mma.sync``'s 0.955 at
      64 rows on 128 threads, causal 0.464 against 0.528, ALiBi 0.474 against 0.535; two warpgroups
      of 128 rows ran 1.11, of 64 rows with 128-key chunks 1.06); unmasked, key chunks of
      :data:`FORWARD_WIDE_CHUNK` (:func:`forward_chunk`).  Not with a band (a sliding
      window: 0.157 against 0.134, the taller tiles keeping a larger share of partial chunks) nor a
      mask of unknown support (kernels/BENCHMARKS.md, "Sixth session of 2026-11-25")."""
    from . import producer
    from .plan import kernel_dtype
    if simulate or mode != "auto" or not producer.joins(256) or kernel_dtype(d0) == "f32":
        return 0
    from ..relabel.rules import fuse_softmax_contract
    online = any(e.box.kind == "softmax_contract" for a in d0.axes if a.size not in (None, 1)
                 for e in fuse_softmax_contract(d0, a.name).eqns)
    widths = [a.size for a in computed_axes(d0, 256)]
    if not online or not widths or not wgmma_capable():
        return 0
    masks = [e.box.param("pred") for e in d0.eqns if e.box.kind == "mask"]
    if max(widths) == FORWARD_WIDE:
        return 384 if all(_from_first_column(p) for p in masks) else 0
    data = any(len(e.ins) > 1 for e in d0.eqns if e.box.kind == "mask")   # a mask reading auxiliary tensors
    if data and _DATA_MASKS[0]:   # the second form of such a mask, chosen at each launch (.tabled)
        return FORWARD_NARROW_THREADS if max(widths) <= FORWARD_MAX_WIDTH else 0
    narrow = not masks or (FORWARD_NARROW_MASKED and not data and all(_from_first_column(p) for p in masks))
    return FORWARD_NARROW_THREADS if max(widths) <= FORWARD_MAX_WIDTH and narrow else 0


_DATA_MASKS = [False]


@contextmanager
def data_masks():
    """Within: :func:`warpgroup_forward` gives masks that read data four warpgroups too (at widths
    up to :data:`FORWARD_MAX_WIDTH`), whatever their bounds: the second form :mod:`.tabled` lowers."""
    _DATA_MASKS[0] = True
    try:
        yield
    finally:
        _DATA_MASKS[0] = False


def forward_chunk(d0, simulate: bool, mode) -> int | None:
    """The key chunk of the warpgroup forward (:func:`warpgroup_forward`) where it is not the
    schedule's usual 64: :data:`FORWARD_WIDE_CHUNK` at width :data:`FORWARD_WIDE` with no mask.
    Measured on an H200 over two buffers (fp16, N = 4096, 32 heads; kernels/BENCHMARKS.md, "Session
    of 2026-11-30"): 0.781-0.783 ms against 0.860-0.870 for chunks of 64, the row operand read by
    descriptor (its fragments held, 1.104: :func:`.emit_mma.hoisted_fragments` refuses them); causal
    0.479 against 0.461, the diagonal's partial chunks twice as wide, so masked forwards keep 64.
    Over three buffers, 64 (:data:`FORWARD_WIDE_CHUNK`)."""
    if warpgroup_forward(d0, simulate, mode) != 384 or any(e.box.kind == "mask" for e in d0.eqns):
        return None
    return FORWARD_WIDE_CHUNK


def computed_axes(d0, at_most: int) -> list:
    """The axes of ``d0``'s computed arrays of at most ``at_most`` entries, not those its auxiliary
    tensors alone have: an axis of at most 256 among them is an attention's head width, where a
    block table's axes are not (one of 128 x 128 blocks at N = 16384 was taken for a head width of
    128, and the d = 64 forward got the three warpgroups measured for d = 128: 1.53 ms against
    0.47 on 128-row tiles, an H200; kernels/BENCHMARKS.md)."""
    from ..ops.kinds import gathered_only
    aux = set(gathered_only(d0))
    kept = {a.name for v, arr in enumerate(d0.var_types()) if v not in aux for a in arr.axes}
    return [a for a in d0.axes if a.name in kept and isinstance(a.size, int) and a.size <= at_most]


def _from_first_column(pred) -> bool:
    """Whether rows far down still keep the first column (causal: no lower bound), so a taller row
    tile adds little to the chunks it streams; a band (a window) would add its height to each."""
    from ..ops.index import IntAlgebra
    far = 2 ** 31
    support = pred.support(far, far + 1, IntAlgebra)
    return support is not None and support[0] == 0


FORWARD_MAX_WIDTH = 64
"""The widest head a 16-bit attention forward takes four warpgroups of 64 rows at (:func:`warpgroup_forward`)."""

FORWARD_NARROW_THREADS = 512
"""Computing threads of the 16-bit attention forward at widths up to :data:`FORWARD_MAX_WIDTH`
(:func:`warpgroup_forward`): four warpgroups of 64 rows; 256 gives two warpgroups of 128 rows, as
until the session of 2026-11-30."""

FORWARD_NARROW_MASKED = True
"""The forward at widths up to :data:`FORWARD_MAX_WIDTH` takes its warpgroups under masks that keep
the first column too (causal), as at :data:`FORWARD_WIDE` (False: unmasked only, as until the
session of 2026-11-30)."""

FORWARD_WIDE_CHUNK = 64
"""Key chunk of the unmasked warpgroup forward at width :data:`FORWARD_WIDE` (:func:`forward_chunk`).
128 was measured faster over two buffers (session of 2026-11-30: 0.781 ms against 0.860); over
three (:data:`.producer.STAGES`, which chunks of 128 cannot have: three of 64 KB and Q's 48 KB pass
a block's shared memory) 64 ran 0.718 against 128's 0.784 on an H200 (kernels/BENCHMARKS.md,
"Second session of 2026-11-30").  With ``producer.STAGES = 2``, set 128."""

FORWARD_WIDE = 128
"""The head width a 16-bit attention forward takes three warpgroups of 64 rows at (:func:`warpgroup_forward`)."""

