"""Several kernels for one diagram: cut where one fused kernel does not fit, launch in order.

:func:`napkin_cat.lower` first tries one fused kernel.  When that is refused (shared memory
over the limit, a loop nest the single-kernel schedule cannot build, a structure the planner
refuses), or when the diagram asks for it with ``place(wire, "HBM")``, :func:`lower_split`
cuts the diagram into pieces (:mod:`napkin_cat.relabel.cut`): contiguous runs of equations,
whose boundary wires are stored to HBM by one kernel and loaded back by the next.

Where to cut comes from the cost model.  Each candidate piece ``[i, j)`` of the equations is
lowered as one kernel (its tiles and chunks chosen by :func:`~.schedule.choose` as for any
diagram); a piece that is refused cannot be one kernel, but a longer one from the same start
may be (the scores of attention alone are a piece that does not stream, with the softmax and
the product with V it is FlashAttention), so longer pieces are tried until
:data:`MAX_REFUSED` in a row are refused.  Among the cuts into pieces that all lower, the one of least cost wins: the sum
over kernels of :meth:`napkin_cat.costmodel.Cost.bytes` at HBM of each kernel's relabelled
diagram (its inputs, re-read per tile, and its outputs; a cut wire is written once and read by
every later kernel that needs it), each multiplied by its *fill factor*: how many times fewer
blocks it launches than the device has SMs, where its outputs could fill them (a piece that
keeps a whole 1024-token layer in one block moves few bytes, on one SM of 132).  A piece
whose inputs and outputs alone cost more than the best way found to its end is not lowered.
A piece made only of reindexings
(a convolution's unfolds whose input does not fit one block) is a gather kernel
(:mod:`.gather`: one thread per element, read from HBM through the index maps); it moves one
read per valid element and one write per element.  ``place(wire, "HBM")`` forbids
pieces that span the wire.  A softmax whose row cannot be one block is first written in its
two-pass form (a statistics pass ``L = logsumexp(X)`` streamed along the row, then
``P = exp(X - L)``), so that the cut can fall between the passes.

The result is a :class:`MultiKernel`: one callable with the conventions of
:class:`~napkin_cat.lowering.Kernel` (numpy / torch in and out, ``out=``, ``stream=``,
``prepare``), its kernels in ``.kernels``, their sources in ``.source``, and notes that say
why one kernel did not do, where it was cut and what the cut costs.  ``nc.lower`` self-checks
it against the oracle like a single kernel, and ``nc.check_equivalent(oracle, multi)`` accepts
it.

>>> import dataclasses, napkin_cat as nc
>>> from napkin_cat.core import Axis
>>> d = nc.library.mlp(Axis("t", 8), Axis("d", 8), Axis("f", 16)).place("H", "HBM")
>>> k = nc.lower(d, verify=False)
>>> [kk.name for kk in k.kernels]
['kernel_t_d_0_3', 'kernel_t_d_3_5']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.diagram import Diagram
from ..core.errors import LoweringError, NapkinError, RelabelError, ShapeError
from ..relabel.cut import Piece, cut_after, forced_cuts, piece, softmax_two_pass
from .gather import gather_bytes, gather_kernel, is_gather

MAX_PIECES_TRIED = 400   # candidate kernels lowered while searching for the cut, at least ...
PIECES_PER_EQUATION = 12  # ... and this many per equation (a ViT block's 59 equations lower ~440)
MAX_REFUSED = 4          # refused pieces in a row from one start before longer ones are not tried


@dataclass
class _Search:
    """The candidate pieces lowered so far: ``(start, stop)`` -> kernel, or the refusal text."""

    d: Diagram
    lower_one: object
    options: dict
    base: str
    tried: dict = field(default_factory=dict)

    @property
    def budget(self) -> int:
        """How many candidate pieces may be lowered: :data:`MAX_PIECES_TRIED`, or
        :data:`PIECES_PER_EQUATION` per equation for a longer diagram (every start grows its
        pieces until refusals, so the work grows with the length)."""
        return max(MAX_PIECES_TRIED, PIECES_PER_EQUATION * len(self.d.eqns))

    def sms(self) -> int:
        """SMs of the device the kernels are for (``hw=``, else an H100)."""
        from ..core.hardware import H100
        return (self.options.get("hw") or H100).sms

    def kernel(self, start: int, stop: int):
        key = (start, stop)
        if key not in self.tried:
            if len(self.tried) >= self.budget:
                raise LoweringError(f"cannot cut {self.d.short()} into kernels: more than {self.budget} "
                                    f"candidate pieces lowered; place(wire, 'HBM') fixes cuts by hand")
            p = piece(self.d, start, stop)
            view = View.of(p)
            if view is not None:
                self.tried[key] = (p, view)
                return self.tried[key]
            names = {a.name for a in p.diagram.axes}
            tiles = {k: v for k, v in (self.options.get("tiles") or {}).items()
                     if (k.name if hasattr(k, "name") else k) in names}
            opts = {**self.options, "tiles": tiles or None, "name": f"{self.base}_{start}_{stop}"}
            try:
                if is_gather(p.diagram):   # reindexings only: one thread per element, read from HBM
                    self.tried[key] = (p, gather_kernel(p.diagram, opts["name"]))
                    return self.tried[key]
                self.tried[key] = (p, self.lower_one(p.diagram, **opts))
            except (LoweringError, RelabelError) as e:
                self.tried[key] = (p, _first_line(str(e)))
        return self.tried[key]


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else text


def _hbm_bytes(kernel) -> float:
    """HBM bytes the cost model gives one kernel's relabelled diagram (its inputs and outputs,
    re-read per tile); if the cost model cannot read it, its inputs and outputs once; a
    :class:`View` moves nothing."""
    if isinstance(kernel, View):
        return 0.0
    return kernel.diagram.memo(("lowering.multi.hbm_bytes",), lambda: _diagram_hbm_bytes(kernel.diagram))


def _diagram_hbm_bytes(d: Diagram) -> float:
    from ..costmodel.model import cost
    if is_gather(d):
        return float(gather_bytes(d))
    try:
        return float(cost(d).bytes("HBM"))
    except (NapkinError, TypeError, ValueError):
        return float(sum(a.dtype.bytes * _size(a) for a in (*d.dom, *d.cod)))


def _fill_factor(kernel, sms: int) -> float:
    """How many times fewer blocks ``kernel`` launches than the device has SMs, where its
    outputs (one thread per element, 256 per block) could fill them: a cut kernel with one
    block for a 1024-token layer runs on one SM of 132.  At least 1; 1 for a view."""
    if isinstance(kernel, View) or kernel.launch is None:
        return 1.0
    blocks = 1
    for g in kernel.launch.grid:
        blocks *= g
    could = min(sms, max(1, sum(_size(a) for a in kernel.diagram.cod) // 256))
    return max(1.0, could / max(1, blocks))


def _kernel_cost(kernel, sms: int) -> float:
    """What the cut minimises: the kernel's HBM bytes (:func:`_hbm_bytes`), times its
    :func:`_fill_factor` (a kernel on a fraction of the SMs moves its bytes that much slower)."""
    return _hbm_bytes(kernel) * _fill_factor(kernel, sms)


def _io_bytes(p: Piece) -> int:
    """A lower bound of any kernel's cost for piece ``p``: its inputs read once, outputs written once."""
    return sum(a.dtype.bytes * _size(a) for a in (*p.diagram.dom, *p.diagram.cod))


def _size(arr) -> int:
    n = 1
    for a in arr.axes:
        n *= a.size
    return n


def _expand_softmaxes(d: Diagram, search_for) -> tuple[Diagram, list[str]]:
    """Every softmax that cannot be one kernel on its own, in its two-pass form."""
    notes = []
    for k in reversed(range(len(d.eqns))):
        if d.eqns[k].box.kind != "softmax":
            continue
        _, got = search_for(d).kernel(k, k + 1)
        if isinstance(got, str):
            x = d.eqns[k].box.dom[0]
            notes.append(f"softmax along {d.eqns[k].box.param('axis')} of {x} does not fit one kernel ({got}); "
                         f"two passes: statistics L = logsumexp(X), then P = exp(X - L).")
            d = softmax_two_pass(d, k)
    return d, notes


def _segment(search: _Search, lo: int, hi: int) -> list[tuple[int, int]]:
    """Pieces covering equations ``lo..hi-1`` at the least :func:`_kernel_cost` (dynamic
    programming over cut points; from each start, pieces grow until :data:`MAX_REFUSED` in a
    row are refused, or until one is refused once half of the search's budget is spent).  A piece
    of several equations whose inputs and outputs alone (:func:`_io_bytes`, a lower bound of
    its cost) cannot beat the best way found to its end is not lowered."""
    sms = search.sms()
    best: dict[int, tuple[float, list]] = {lo: (0.0, [])}
    for i in range(lo, hi):
        if i not in best:
            continue
        refused = 0
        for j in range(i + 1, hi + 1):
            if j > i + 1 and j in best and (i, j) not in search.tried and \
                    best[i][0] + _io_bytes(piece(search.d, i, j)) >= best[j][0]:
                continue
            p, got = search.kernel(i, j)
            if isinstance(got, str):
                if j == i + 1:
                    box = search.d.eqns[i].box
                    raise LoweringError(f"cannot lower equation {i} ({box.name or box.kind}: {p.diagram.short()}) "
                                        f"even as a kernel of its own: {got}")
                refused += 1     # past a refusal only while half the search's budget is left
                if refused >= MAX_REFUSED or len(search.tried) >= search.budget // 2:
                    break
                continue
            refused = 0
            total = best[i][0] + _kernel_cost(got, sms)
            if j not in best or total < best[j][0]:
                best[j] = (total, best[i][1] + [(i, j)])
    return best[hi][1]


def lower_split(d: Diagram, options: dict, lower_one, error: NapkinError | None = None) -> "MultiKernel":
    """``d`` as several kernels (see the module docstring); ``error``: why one kernel did not
    do (None when ``place(wire, "HBM")`` asked for the cut).  Raises ``error`` again where
    cutting cannot help: a diagram of one equation, or one the user tiled or streamed (those
    sizes are for one kernel, as are those of ``tiles=``)."""
    forced = forced_cuts(d)
    user_blocks = [r for r in d.schedule if r.op in ("tile", "stream", "order")]
    if error is not None and (len(d.eqns) < 2 and not any(e.box.kind == "softmax" for e in d.eqns)):
        raise error
    if error is not None and options.get("tiles"):
        raise error   # tiles= gives the block sizes of one kernel: cut only where place() asks
    if user_blocks:
        what = ", ".join(f"{r.op}({r.axis or ', '.join(r.extra)})" for r in user_blocks[:3])
        if error is not None:
            raise error
        raise LoweringError(f"place(..., 'HBM') on {', '.join(forced)} cuts {d.short()} into several kernels, "
                            f"but it is also relabelled ({what}), which schedules one kernel: relabel "
                            f"the unrelabelled diagram with place(..., 'HBM') only, and pass tiles= to lower")
    d0 = d.unrelabelled()
    for r in d.schedule:
        if r.op == "require":
            d0 = d0.require(r.axis, r.size)
    base = options.get("name") or _default_name(d0)
    searches: dict = {}

    def search_for(dd):
        return searches.setdefault(id(dd), _Search(dd, lower_one, options, base))

    notes = []
    if error is not None:
        notes.append(f"One kernel does not do: {_first_line(str(error))}")
    else:
        notes.append(f"place({', '.join(forced)}, 'HBM') asks for a cut.")
    work, expanded = _expand_softmaxes(d0, search_for)
    notes += expanded
    search = search_for(work)
    fixed = sorted({cut_after(work, n) for n in forced} - {len(work.eqns)})
    spans = []
    for lo, hi in zip([0, *fixed], [*fixed, len(work.eqns)]):
        spans += _segment(search, lo, hi)
    if len(spans) == 1 and error is not None:
        raise error   # pieces only differ from the whole by their schedule: nothing was cut
    chosen = [search.kernel(i, j) for i, j in spans]
    notes += _cut_notes(work, search, spans, chosen, fixed)
    return MultiKernel(d0, work, forced, [p for p, _ in chosen], [k for _, k in chosen], base, notes, options)


def _cut_notes(work: Diagram, search: _Search, spans, chosen, fixed) -> list[str]:
    types = work.var_types()
    notes = []
    total = 0.0
    for n, ((i, j), (p, k)) in enumerate(zip(spans, chosen)):
        b = _hbm_bytes(k)
        total += b
        what = "a view, no kernel" if isinstance(k, View) else f"cost model: {b:.0f} HBM bytes"
        fill = _fill_factor(k, search.sms())
        if fill > 1:
            what += f", {fill:.1f}x fewer blocks than SMs it could fill (counted {fill:.1f}x)"
        notes.append(f"Step {n + 1} of {len(spans)} ({k.name}): equations {i}..{j - 1}, "
                     f"{p.diagram.short()}; {what}.")
    for (i, j), (p, _) in zip(spans[:-1], chosen[:-1]):
        wires = ", ".join(f"{types[v]} ({_size(types[v]) * types[v].dtype.bytes} B)" for v in p.outs
                          if v not in work.outs)
        if isinstance(chosen[spans.index((i, j))][1], View) or isinstance(chosen[spans.index((i, j)) + 1][1], View):
            notes.append(f"After equation {j - 1}: {wires} read in place (a view of the same HBM array).")
            continue
        if j in fixed:
            why = "place(..., 'HBM')"
        else:
            nxt = search.tried.get((i, j + 1))
            why = f"equations {i}..{j} as one kernel are refused: {nxt[1]}" if nxt and isinstance(nxt[1], str) else \
                "least cost: HBM bytes, times the fill factor of kernels with few blocks"
        notes.append(f"Cut after equation {j - 1}: {wires} stored to HBM ({why}).")
    kernels = sum(not isinstance(k, View) for _, k in chosen)
    notes.append(f"Cut chosen by the cost model: {total:.0f} HBM bytes over {kernels} kernels.")
    return notes


def _default_name(d: Diagram) -> str:
    return "kernel_" + "_".join(a.name for a in d.cod[0].axes)[:40] if len(d.cod) else "kernel"


class View:
    """A reshaping box between kernels that moves no data: ``rename`` (the same values under
    another axis name), ``split`` and ``merge`` (a C-contiguous array read with one axis as two,
    or two adjacent as one), ``slice`` of an axis with only size-1 axes before it (a contiguous
    part).  It runs as a reshape or a slice of the array (numpy, torch or numba device array),
    not as a kernel."""

    def __init__(self, p: Piece, op: str, index: tuple | None):
        self.diagram = p.diagram
        self.op = op
        self.index = index
        self.shape = tuple(a.size for a in p.diagram.cod[0].axes)
        box = p.diagram.eqns[0].box
        self.name = f"view_{box.param('op')}"
        self.source = f"# {box.name}: {p.diagram.short()} read as a reshape of the same memory, no kernel"
        self.launch = None

    @staticmethod
    def of(p: Piece) -> "View | None":
        d = p.diagram
        if len(d.eqns) != 1 or d.eqns[0].box.kind != "reindex" or len(d.cod) != 1:
            return None
        box = d.eqns[0].box
        op = box.param("op")
        if op in ("rename", "split", "merge"):
            return View(p, op, None)
        if op == "slice":
            x = box.dom[0]
            pos = x.axis_names.index(box.param("axis"))
            if all(a.size == 1 for a in x.axes[:pos]):
                return View(p, op, (slice(None),) * pos + (slice(box.param("start"), box.param("stop")),))
        return None

    def __call__(self, x, stream=None):
        y = x[self.index] if self.index is not None else x
        return y.reshape(self.shape)

    def prepare(self, x, out=None, stream=None):
        return lambda: None   # out= is the view itself (made by the first run)


class MultiKernel:
    """Several generated kernels computing one diagram, launched in order; called like a
    :class:`~napkin_cat.lowering.Kernel`.

    ``.diagram``: the diagram it computes, its cut wires placed in HBM; ``.kernels``: the
    kernels in launch order; ``.pieces``: what each computes (:class:`~napkin_cat.relabel.cut.Piece`
    of ``.work``, the diagram that was cut: ``.diagram`` with softmaxes in two passes where
    needed); ``.source``: every kernel's source; ``.notes``: why and where it was cut."""

    def __init__(self, d0: Diagram, work: Diagram, forced, pieces: list[Piece], kernels: list, name: str,
                 notes: list[str], options: dict):
        names = {a.name for e in d0.eqns for a in e.box.cod}
        placed = d0
        for p in pieces[:-1]:
            for v in p.outs:
                n = work.var_types()[v].name
                if n in names and n not in {a.name for a in (*d0.dom, *d0.cod)}:
                    placed = placed.place(n, "HBM")
        self.diagram = placed
        self.work = work
        self.pieces = tuple(pieces)
        self.steps = tuple(kernels)                                   # kernels and views, in order
        self.kernels = tuple(k for k in kernels if not isinstance(k, View))
        self.name = name
        self.source = "\n\n".join(f"# ---- step {n + 1} of {len(kernels)}: {k.name} "
                                  f"(equations {p.eqns[0]}..{p.eqns[1] - 1})\n{k.source}"
                                  for n, (p, k) in enumerate(zip(pieces, kernels)))
        self.launches = tuple(k.launch for k in self.kernels)
        self.in_shapes = tuple(tuple(a.size for a in arr.axes) for arr in d0.dom)
        self.out_shapes = tuple(tuple(a.size for a in arr.axes) for arr in d0.cod)
        self.in_io = tuple(arr.dtype.name for arr in d0.dom)
        self.out_io = tuple(arr.dtype.name for arr in d0.cod)
        self.notes: tuple[str, ...] = tuple(notes)
        self.verified = False
        self.options = {"threads": options.get("threads"), "micro": options.get("micro"),
                        "fastmath": options.get("fastmath", True), "prefetch": options.get("prefetch", False),
                        "fp32": options.get("fp32", "fma"), "name": name}

    def __repr__(self) -> str:
        return f"MultiKernel({self.name}: {self.diagram}, {len(self.kernels)} kernels: " + \
            ", ".join(k.name for k in self.kernels) + ")"

    def pseudocode(self, memory: bool = False) -> str:
        """Each kernel's final form in launch order, and the wires that go between them in HBM."""
        types = self.work.var_types()
        out = []
        for n, (p, k) in enumerate(zip(self.pieces, self.steps)):
            out.append(f"# step {n + 1} of {len(self.steps)}: {k.name}")
            out.append(k.source if isinstance(k, View) else k.diagram.loop_nest().pseudocode(memory=memory))
            cut = [str(types[v]) for v in p.outs if v not in self.work.outs]
            if cut:
                out.append(f"# HBM between kernels: {', '.join(cut)}")
        return "\n".join(out)

    def _check_call(self, arrays, stream) -> None:
        """The number and shapes of the arrays (each kernel checks kinds and dtypes of its own)."""
        if len(arrays) != len(self.in_shapes):
            names = ", ".join(a.name for a in self.diagram.dom)
            raise ShapeError(f"{self.name} takes {len(self.in_shapes)} arrays ({names}), got {len(arrays)}")
        for arr, x, shape in zip(self.diagram.dom, arrays, self.in_shapes):
            if tuple(getattr(x, "shape", ())) != shape:
                raise ShapeError(f"input {arr}: expected shape {shape}, got {tuple(getattr(x, 'shape', ()))}")

    def _run(self, arrays, stream):
        """Every kernel in order; the variables of ``.work`` they computed."""
        env = dict(enumerate(arrays))
        for p, k in zip(self.pieces, self.steps):
            got = k(*[env[v] for v in p.ins], stream=stream)
            env.update(zip(p.outs, got if isinstance(got, tuple) else (got,)))
        return env

    def __call__(self, *arrays, out=None, stream=None):
        """Run the kernels in order on the arrays (see :meth:`Kernel.__call__`); the wires
        between them are allocated like the inputs; ``out=``: the final outputs are copied there."""
        self._check_call(arrays, stream)
        outs = [self._run(arrays, stream)[v] for v in self.work.outs]
        if out is not None:
            outs = _copy_out(self, out, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def prepare(self, *arrays, out=None, stream=None):
        """A zero-argument callable that launches every kernel on these arrays; the wires between
        kernels are allocated once (by a first run)."""
        self._check_call(arrays, stream)
        env = self._run(arrays, stream)
        if out is not None:
            finals = out if isinstance(out, (tuple, list)) else (out,)
            if len(finals) != len(self.out_shapes):
                raise ShapeError(f"{self.name} has {len(self.out_shapes)} outputs, out= gave {len(finals)}")
            env.update(zip(self.work.outs, finals))
        steps = [k.prepare(*[env[v] for v in p.ins], out=tuple(env[v] for v in p.outs), stream=stream)
                 for p, k in zip(self.pieces, self.steps)]

        def launch_all():
            for s in steps:
                s()
        return launch_all


def _copy_out(mk: MultiKernel, out, outs):
    finals = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(finals) != len(outs):
        raise ShapeError(f"{mk.name} has {len(outs)} outputs, out= gave {len(finals)}")
    for o, r, shape in zip(finals, outs, mk.out_shapes):
        if tuple(o.shape) != shape:
            raise ShapeError(f"out= for {mk.name}: expected shape {shape}, got {tuple(o.shape)}")
        if hasattr(o, "copy_"):
            o.copy_(r)
        elif hasattr(o, "copy_to_device"):
            o.copy_to_device(r)
        else:
            import numpy as np
            np.copyto(o, np.asarray(r))
    return finals


def wants_split(d: Diagram) -> bool:
    """Whether ``place(wire, "HBM")`` asks for a cut in ``d``."""
    return bool(forced_cuts(d))


__all__ = ["lower_split", "MultiKernel", "wants_split"]
