"""The parts a residual backward is split into (:func:`fa2_parts`), read by :mod:`.torch_op`.

FlashAttention-2 splits the backward of an attention by the inputs it differentiates: those
with the key axis (K, V) on key tiles streaming the queries, the others (Q) on query tiles
streaming the keys.  The *auxiliary tensors* of an attention variant (a learned relative-bias
table, a per-head scale: :mod:`napkin_cat.ops.aux_grad`) form a third part: their gradient is a
scatter-add over every score (``scatter_aux``), which no tiling keeps independent and no kernel
computes, so that part stays unrelabelled and runs through its torch semantics on the tensors'
device (:func:`run_torch_part`) while the other parts run as kernels.  The one-kernel form
(``form="one kernel"``) puts the gradients of Q, K and V in one part on key tiles, dQ added
across them (``tile(x, g_x, partial="sum")``); :mod:`.backward_forms` chooses between the two.
In both forms a first part computes ``D = rowsum(dO O)`` once (:func:`row_terms`), which the
others read instead of ``O``.

>>> import napkin_cat as nc
>>> from napkin_cat.ops.residuals import with_logsumexp
>>> q, x, d = nc.axes("q x d")
>>> rb = nc.aux("rb", nc.Axis("nr", 5))
>>> att = nc.library.attention(q=q, x=x, d=d, bias=nc.bias_mod(lambda b, h, i, j: rb[i - j + 2]))
>>> aux_inputs(att)
(3,)
>>> parts, notes = fa2_parts(with_logsumexp(att), (0, 1, 2, 3), ["O"])
>>> [[a.name for a in p.cod] for p in parts], [has_scatter(p) for p in parts]
([['D'], ['dK', 'dV'], ['dQ'], ['drb']], [False, False, False, True])
>>> parts, _ = fa2_parts(with_logsumexp(att), (0, 1, 2, 3), ["O"], form="one kernel")
>>> [([a.name for a in p.cod], p._sched_str()) for p in parts]
[(['D'], 'tile(q, 64)'), (['dQ', 'dK', 'dV'], 'tile(x, g_x, partial=sum), stream(q, s_q)'), (['drb'], '')]
"""

from __future__ import annotations

import torch

from ..core.diagram import Diagram, Eqn
from ..core.errors import NapkinError, RelabelError
from ..core.hierarchy import DEVICES
from ..core.types import Ty
from ..ops.kinds import spec
from ..ops.residuals import grad_with_residuals, saved_softmaxes

__all__ = ["fa2_parts", "fa2_axes", "relabel_like", "read_only", "aux_inputs", "has_scatter", "run_torch_part"]



def aux_inputs(d: Diagram) -> tuple[int, ...]:
    """The inputs of ``d`` that index expressions gather from (their boxes' inputs after the first)."""
    d = d.unrelabelled() if d.schedule else d
    n = len(d.dom)
    return tuple(sorted({v for e in d.eqns if spec(e.box).gathers is not None for v in e.ins[1:] if v < n}))


def has_scatter(d: Diagram) -> bool:
    """``d`` adds into an auxiliary tensor (a ``scatter_aux`` box: not lowered)."""
    return any(e.box.kind == "scatter_aux" for e in d.eqns)


def fa2_axes(aug: Diagram) -> tuple[str, str, tuple[str, ...]] | str:
    """``(x, q, groups)``: the normalised (key) axis of ``aug``'s one softmax-contraction, its
    query axis and the other row axes; else the reason there are not.

    The query axis is a row axis of the scores that the values lack.  Grouped-query attention
    has several (``S[h g q x]``: the groups ``g`` share one K, V head): the query axis is the
    innermost of them (``q``, next to the key axis), the one the parts tile and stream; the
    others (``groups``) are streamed one at a time around the query chunks in the key-tile part,
    so dK, dV are summed over the groups in registers (FlashAttention-2's group-summed dK, dV,
    without an expanded ``dK[h g x d]`` summed afterwards), and tiled one at a time in the
    query-tile parts (a block per query head, as without groups)."""
    saved = saved_softmaxes(aug)
    if len(saved) != 1:
        return (f"the backward of {aug.short()} is not split FlashAttention-2's way: it has "
                f"{len(saved)} softmax-contractions (the split takes one)")
    (sv,) = saved
    types = aug.var_types()
    rows = [n for n in types[sv.s].axis_names if n != sv.axis and not types[sv.v].has(n)]
    if not rows:
        return f"the backward of {aug.short()} is not split: the scores have no row axis the values lack"
    return sv.axis, rows[-1], tuple(rows[:-1])


def fa2_parts(aug: Diagram, wrt: tuple[int, ...], cts, schedule=(),
              form: str = "two kernels") -> tuple[tuple[Diagram, ...], tuple[str, ...]]:
    """The backward of ``aug`` split as FlashAttention-2 does (``form="two kernels"``): the
    inputs with the normalised axis ``x`` (K, V) on key tiles streaming the queries, the others
    (Q) on query tiles streaming the keys, the auxiliary tensors unrelabelled; the forward's
    tilings of other axes (``schedule``: heads, batch) kept where a part has the axis.
    One softmax-contraction and its query axis (the innermost row axis the values lack; other
    such axes, GQA's groups, streamed or tiled one at a time: :func:`fa2_axes`), or no split
    (``()``, the reason in the notes).  ``form="one kernel"``: the gradients of Q, K and V in one
    part on key tiles streaming the queries, ``tile(x, g_x, partial="sum")`` when a gradient
    sums over ``x`` (dQ: added across the key tiles, :mod:`napkin_cat.relabel.split`); where
    that form cannot be had the :class:`~napkin_cat.core.errors.RelabelError` says why."""
    axes_ = fa2_axes(aug)
    if isinstance(axes_, str):
        if form == "one kernel":
            raise RelabelError(axes_)
        return (), (axes_,)
    x, qn, extra = axes_
    aux = [i for i in wrt if i in aux_inputs(aug)]
    if form == "one kernel":
        idx = [i for i in wrt if i not in aux]
        groups = [(idx, x, "g_" + x, qn, "s_" + qn, any(not aug.dom[i].has(x) for i in idx))]
    else:
        groups = [([i for i in wrt if aug.dom[i].has(x) and i not in aux], x, "g_" + x, qn, "s_" + qn, False),
                  ([i for i in wrt if not aug.dom[i].has(x) and i not in aux], qn, "g_" + qn, x, "s_" + x, False)]
    parts, notes = [], []
    others = [r for r in schedule if r.op == "tile" and r.axis not in (x, qn, *extra)]
    grads = [(read_only(grad_with_residuals(aug, g[0], cotangents=cts), keep=cts), *g[1:])
             for g in groups if g[0]]
    pre, cut = row_terms([g[0] for g in grads], x)
    if pre is not None:
        size = pre.axis(qn).size
        rows = ROW_TERM_TILE if not isinstance(size, int) else min(ROW_TERM_TILE, size)
        try:
            names = {a.name for a in pre.axes}
            parts.append(relabel_like(_by_group(pre.tile(qn, rows), extra, "tile"),
                                      [r for r in others if r.axis in names]))
            grads = [(c, *g[1:]) for c, g in zip(cut, grads)]
        except NapkinError as e:   # the terms stay where they are
            notes.append(f"{', '.join(a.name for a in pre.cod)} not computed before the parts "
                         f"(tile({qn}, {rows}) refused: {e}), so each part computes it")
    for part, tiled, g, streamed, s_, added in grads:
        try:
            names = {a.name for a in part.axes}
            blocks = part.tile(tiled, g, partial="sum" if added else None)
            blocks = _by_group(blocks, extra, "stream" if tiled == x else "tile")   # groups around the chunks
            parts.append(relabel_like(blocks.stream(streamed, s_), [r for r in others if r.axis in names]))
        except NapkinError as e:
            if form == "one kernel":
                raise RelabelError(f"the backward -> {', '.join(a.name for a in part.cod)} is not relabelled "
                                   f"tile({tiled}, {g}, partial=sum).stream({streamed}, {s_}): {e}") from None
            notes.append(f"backward part -> {', '.join(a.name for a in part.cod)} not relabelled "
                         f"tile({tiled}).stream({streamed}), so it runs unrelabelled: {e}")
            parts.append(part)
    if aux:
        parts.append(read_only(grad_with_residuals(aug, aux, cotangents=cts), keep=cts))
    return tuple(parts), tuple(notes)


def _by_group(d: Diagram, groups, how: str) -> Diagram:
    """``d`` tiled (a block each) or streamed (one after another) one group at a time over each
    axis of ``groups`` it has."""
    names = {a.name for a in d.axes}
    for ga in groups:
        if ga in names:
            d = d.tile(ga, 1) if how == "tile" else d.stream(ga, 1)
    return d


ROW_TERM_KINDS = ("contract",)
"""Box kinds that :func:`row_terms` computes once, before the parts: reductions."""

ROW_TERM_TILE = 64
"""Rows per block of the row-terms part: with 64 features, 4 lanes per row of a 256-thread block
(a symbolic tile there is sized by the schedule's heuristic, which picks 4 rows of 64 lanes)."""


def row_terms(parts, x: str) -> tuple[Diagram | None, list[Diagram]]:
    """(a diagram of the reductions the backward parts compute from their inputs alone, without
    the key axis ``x``, or None; the parts reading them as inputs instead).

    ``D = sum_d dO O`` is one: each key tile of the dK, dV part would recompute it for every
    query chunk (and read ``O`` to do so), and the dQ part once per query tile.  FlashAttention-2
    computes it once, before both, into an fp32 row vector; so does this part
    (:meth:`~.backward_forms.BackwardPlan.at` keeps arrays passed between parts in fp32).  A
    term whose name another array of a part already has is left in place."""
    terms: dict[tuple, Eqn] = {}
    taken = {a.name for p in parts for a in (*p.dom, *p.cod)}
    for p in parts:
        n = len(p.dom)
        for k, e in enumerate(p.eqns):
            out = e.box.cod
            if (e.box.kind in ROW_TERM_KINDS and len(out) == 1 and not out[0].has(x) and out[0].name not in taken
                    and all(v < n and not p.dom[v].has(x) for v in e.ins)):
                terms.setdefault((e.box, _wires(p, e)), e)
    if not terms:
        return None, list(parts)
    arrays = {_wire(a): a for p in parts for a in p.dom}
    dom = list(dict.fromkeys(w for _, ins in terms for w in ins))
    eqns = tuple(Eqn(box, tuple(dom.index(w) for w in ins)) for box, ins in terms)
    pre = Diagram(Ty(*(arrays[w] for w in dom)), Ty(*(box.cod[0] for box, _ in terms)), eqns,
                  tuple(range(len(dom), len(dom) + len(eqns))))
    return pre, [_read_terms(p, set(terms)) for p in parts]


def _wire(a) -> tuple:
    """An input by name as well as type (arrays compare by type alone: O and dO are equal)."""
    return a.name, a


def _wires(p: Diagram, e: Eqn) -> tuple:
    return tuple(_wire(p.dom[v]) if v < len(p.dom) else None for v in e.ins)


def _read_terms(p: Diagram, terms: set) -> Diagram:
    """``p`` with the equations of ``terms`` (keys ``(box, input wires)``) replaced by inputs."""
    cut = {k for k, e in enumerate(p.eqns) if (e.box, _wires(p, e)) in terms}
    if not cut:
        return p
    n = len(p.dom)
    new = [p.eqns[k].box.cod[0] for k in sorted(cut)]
    renum, nxt = {v: v for v in range(n)}, n + len(new)
    for j, k in enumerate(sorted(cut)):
        renum[p.eqn_outputs(k)[0]] = n + j
    for k in range(len(p.eqns)):
        if k not in cut:
            for v in p.eqn_outputs(k):
                renum[v], nxt = nxt, nxt + 1
    eqns = tuple(Eqn(e.box, tuple(renum[v] for v in e.ins)) for k, e in enumerate(p.eqns) if k not in cut)
    return read_only(Diagram(Ty(*p.dom, *new), p.cod, eqns, tuple(renum[v] for v in p.outs)))


def relabel_like(d: Diagram, schedule) -> Diagram:
    """``d`` relabelled by ``schedule`` (another diagram's ``Relabel`` values), verb by verb;
    a relabeling ``d`` refuses raises its :class:`~napkin_cat.core.errors.RelabelError`."""
    for r in schedule:
        # ``extra``: a device split's layout (``order``), or a tile's ``partial`` sums
        extra = r.extra[0] if r.extra else None
        if r.op == "tile":
            device = r.size == DEVICES
            d = d.tile(r.axis, r.size, r.level or None, partial=None if device else extra,
                       order=extra if device else None)
        elif r.op == "stream":
            d = d.stream(r.axis, r.size, r.level or None, order=extra)
        elif r.op == "place":
            d = d.place(r.extra[0], r.level)
        elif r.op == "require":
            d = d.require(r.axis, r.size)
        elif r.op == "order":
            d = d.order(*r.extra)
        else:
            raise RelabelError(f"relabel_like: unknown relabeling {r.op!r} in {r!r}")
    return d


def read_only(d: Diagram, keep=()) -> Diagram:
    """``d`` without the inputs nothing reads (the names in ``keep`` stay): the arrays the forward
    need not save."""
    read = set(d.outs) | {v for e in d.eqns for v in e.ins}
    mine = [i for i, a in enumerate(d.dom) if i in read or a.name in keep]
    if len(mine) == len(d.dom):
        return d
    new = {v: k for k, v in enumerate(mine)}
    shift = len(d.dom) - len(mine)
    renum = lambda v: new[v] if v < len(d.dom) else v - shift   # noqa: E731
    eqns = tuple(Eqn(e.box, tuple(renum(v) for v in e.ins)) for e in d.eqns)
    return Diagram(Ty(*(d.dom[i] for i in mine)), d.cod, eqns, tuple(renum(v) for v in d.outs), d.schedule)


def run_torch_part(part: Diagram, tensors, dtypes) -> tuple[torch.Tensor, ...]:
    """``part`` through its torch semantics (:func:`napkin_cat.to_torch`) on the tensors' device:
    float64 stays float64, the kernel dtypes compute in float32; each output in ``dtypes``."""
    from ..ops.torch_semantics import to_torch
    work = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    with torch.no_grad():
        outs = to_torch(part.unrelabelled())(*(t.detach().to(work) for t in tensors))
    outs = outs if isinstance(outs, tuple) else (outs,)
    return tuple(o.to(dt) for o, dt in zip(outs, dtypes))
