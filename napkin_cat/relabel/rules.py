"""Relabelings: change how a diagram executes, never what it computes.

``tile(axis, g)``    group partition: ``axis/g`` groups run on lower-level cores.  Allowed only
                     when the computation is weaved over ``axis`` (no box acts along it, every
                     output keeps it); inputs without ``axis`` are sent to every group.
``tile(axis, g, partial="sum")``  a summed axis tiled across blocks, each adding its partial
                     sum into the outputs (split-K; the conditions are in :mod:`.split`).
``stream(axis, s)``  stream partition: ``axis`` arrives ``s`` at a time while a state stays
                     resident.  Allowed when every box acting on ``axis`` is weaved over it up
                     to the boxes that remove it, each of which has an accumulator (fusion
                     theorem); rewrite rules first fuse softmax/normalisation + contraction.
``place(array, level)``  colour an array's wires with a memory level.
``require(axis, k)`` tile/stream sizes on ``axis`` must be multiples of ``k`` (LCM combined).
``order(*axes)``     explicit nesting of the stream loops (outer first).

``tile(axis, DEVICES)`` / ``stream(axis, DEVICES)`` split ``axis`` over the devices, one block
of ``axis/devices`` per GPU, living in its ``HBM``: a tiled axis is sharded (each device keeps
its block), a streamed one rotates around a ring of devices (ring attention: each device's
online-softmax state meets every block of keys), under the same conditions as on one GPU.
A device split comes before the relabelings inside a device.  ``order="zigzag"`` lays the
blocks out zig-zag (device ``r`` of ``W`` holds chunks ``r`` and ``2W - 1 - r`` of ``2W``: causal
work balanced over the devices; :mod:`.devices`).

Every relabeling and rewrite is a registered :class:`Rule` value (name, side conditions,
function, proof obligation); ``tests/test_rules.py`` checks every registered rule generically.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> flash = nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
>>> print(flash)
Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32  | stream(x, s_x), tile(q, g_q)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from .accumulators import Accumulator, derive_accumulator
from .devices import check_layout
from ..core.diagram import Axis, Box, Diagram, Eqn, Relabel
from ..core.errors import RelabelError
from ..core.hierarchy import DEVICES, FULL
from ..ops.boxes import norm_contract_box, softmax_contract_box
from ..ops.kinds import normalises_along, spec
from .split import check_partial, split_problem

DEFAULT_LEVEL = "SMEM"


# --------------------------------------------------------------------------- rule values

@dataclass(frozen=True)
class Rule:
    """A rewrite or relabeling as a value.  ``check(d, **args)`` returns ``None`` when the
    rule applies or the reason it does not; ``apply(d, **args)`` returns the new diagram."""

    name: str
    kind: str                 # "relabel" or "rewrite"
    side_conditions: str
    check: Callable
    apply: Callable
    proof: str


RULES: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    RULES[rule.name] = rule
    return rule


# --------------------------------------------------------------------------- analysis helpers

def _axis_name(d: Diagram, axis) -> str:
    name = axis.name if isinstance(axis, Axis) else axis
    if not isinstance(name, str):
        raise RelabelError(f"expected an axis or an axis name, got {axis!r}")
    if name not in [a.name for a in d.axes]:
        raise RelabelError(f"{d.short()} has no axis {name!r}; its axes are {[a.name for a in d.axes]}")
    if isinstance(axis, Axis) and axis != d.axis(name):
        raise RelabelError(f"axis {axis.describe()} does not match the diagram's axis {d.axis(name).describe()}")
    return name


def consumers(d: Diagram) -> dict[int, list[int]]:
    """var id -> equations that read it."""
    uses: dict[int, list[int]] = {v: [] for v in range(len(d.var_types()))}
    for k, e in enumerate(d.eqns):
        for v in e.ins:
            uses[v].append(k)
    return uses


def acts_along(box: Box, axis: str) -> str | None:
    """Why ``box`` is not weaved over ``axis`` although its input and output carry it."""
    if normalises_along(box, axis):
        return f"{box.name} normalises along {axis}"
    if spec(box).shape == "reindex" and box.param("op") != "transpose":
        touched = {box.param(k, None) for k in ("axis", "outer", "inner", "keep", "drop", "new")}
        if axis in touched:
            return f"{box.name} reindexes axis {axis}"
    return None


# --------------------------------------------------------------------------- tiling

def tile_problem(d: Diagram, axis: str) -> str | None:
    """None when ``d`` is weaved over ``axis`` (so it may be tiled), else why not."""
    types = d.var_types()
    for k, e in enumerate(d.eqns):
        ins_have = [types[v].has(axis) for v in e.ins]
        outs_have = [a.has(axis) for a in e.box.cod]
        if any(ins_have) and not all(outs_have):
            return (f"{e.box.name} removes axis {axis} (it reduces or contracts over it): the groups "
                    f"would each hold a partial result; stream {axis} instead")
        if any(ins_have):
            why = acts_along(e.box, axis)
            if why:
                return why + "; groups along it would not be independent"
    for i, v in enumerate(d.outs):
        if not types[v].has(axis):
            return (f"output {types[v]} has no axis {axis}: every group would write all of it; "
                    f"tiling needs the computation weaved over {axis}")
    return None


# --------------------------------------------------------------------------- streaming

@dataclass(frozen=True)
class StreamPlan:
    """How ``axis`` streams through ``d``: equations run per chunk (``region``), the
    accumulators that remove the axis, and the rest (``outside``)."""

    axis: str
    region: tuple[int, ...]
    accumulators: tuple[Accumulator, ...]
    outside: tuple[int, ...]


def stream_plan(d: Diagram, axis: str) -> StreamPlan | str:
    """The fusion theorem, read off the IR: the plan, or the reason ``axis`` cannot stream
    (computed once per diagram and axis)."""
    return d.memo(("stream_plan", axis), lambda: _stream_plan(d, axis))


def _stream_plan(d: Diagram, axis: str) -> StreamPlan | str:
    types = d.var_types()
    region: list[int] = []
    accs: list[Accumulator] = []
    outside: list[int] = []
    after_acc: set[int] = set()  # vars downstream of an accumulator's output
    for k, e in enumerate(d.eqns):
        outs = d.eqn_outputs(k)
        ins_have = [types[v].has(axis) for v in e.ins]
        outs_have = [types[v].has(axis) for v in outs]
        depends_on_acc = any(v in after_acc for v in e.ins)
        if any(ins_have) or any(outs_have):
            if all(outs_have):
                if depends_on_acc:
                    src = next(v for v in e.ins if v in after_acc)
                    return (f"{e.box.name} combines the streamed axis {axis} with {types[src]}, which "
                            f"needs all of {axis} first (the streamed axis was removed before it is "
                            f"used again): two passes over {axis}, not streamable")
                why = acts_along(e.box, axis)
                if why:
                    if spec(e.box).shape == "normaliser":
                        got = derive_accumulator(e.box, k, axis)
                        return got if isinstance(got, str) else why
                    return why + f"; it cannot see {axis} a chunk at a time"
                region.append(k)
            elif not any(outs_have):
                if depends_on_acc:
                    return (f"{e.box.name} mixes a finished reduction over {axis} with a chunk of "
                            f"{axis}: two passes over {axis}, not streamable")
                acc = derive_accumulator(e.box, k, axis)
                if isinstance(acc, str):
                    return acc
                accs.append(acc)
                after_acc.update(outs)
            else:
                return f"{e.box.name} keeps {axis} on some outputs and not others"
        else:
            outside.append(k)
            if depends_on_acc:
                after_acc.update(outs)
    if not accs and not any(types[v].has(axis) for v in d.outs):
        return f"nothing in {d.short()} consumes axis {axis}"
    return StreamPlan(axis, tuple(region), tuple(accs), tuple(outside))


# --------------------------------------------------------------------------- rewrites

def _rebuild(d: Diagram, drop: set[int], replace_eqn: dict[int, tuple[Box, tuple[int, ...]]]) -> Diagram:
    """Re-emit ``d`` without equations ``drop`` and with ``replace_eqn[k] = (box, old ins)``;
    renumbers variables.  Outputs of dropped equations must be unused."""
    n_in = len(d.dom)
    var_map = list(range(n_in))
    nvars = n_in
    eqns = []
    for k, e in enumerate(d.eqns):
        outs = d.eqn_outputs(k)
        if k in drop:
            var_map.extend([-1] * len(outs))
            continue
        box, ins = replace_eqn.get(k, (e.box, e.ins))
        new_ins = tuple(var_map[v] for v in ins)
        assert all(v >= 0 for v in new_ins), "rewrite left a dangling wire"
        eqns.append(Eqn(box, new_ins))
        var_map.extend(range(nvars, nvars + len(box.cod)))
        nvars += len(box.cod)
    return Diagram(d.dom, d.cod, tuple(eqns), tuple(var_map[v] for v in d.outs), d.schedule)


def _fusable(d: Diagram, axis: str, kind: str):
    """(normalising eqn, contraction eqn) pairs over ``axis`` that can be fused."""
    uses = consumers(d)
    types = d.var_types()
    for k, e in enumerate(d.eqns):
        if e.box.kind != kind or e.box.param("axis") != axis:
            continue
        (p,) = d.eqn_outputs(k)
        if p in d.outs or len(uses[p]) != 1:
            continue
        j = uses[p][0]
        c = d.eqns[j]
        if c.box.kind != "contract" or len(c.ins) != 2 or c.box.cod[0].has(axis):
            continue
        other = c.ins[1] if c.ins[0] == p else c.ins[0]
        if other == p or not types[other].has(axis):
            continue
        yield k, j, e.ins[0], other


# the fused box that replaces ``contract_x(<kind>_x(S), V)``, from the normaliser box ``nb``
_FUSED_BOX = {
    "softmax": lambda nb, s, v, ax, out: softmax_contract_box(s, v, ax, out.axes, out.name),
    "normalize": lambda nb, s, v, ax, out: norm_contract_box(s, v, ax, out.axes, nb.param("a1"), nb.param("a2"),
                                                             nb.param("b"), nb.param("eps"), out.name),
}


def fuse_softmax_contract(d: Diagram, axis) -> Diagram:
    """``contract_x(softmax_x(S), V)`` -> ``softmax_contract_x(S, V)`` (online softmax)."""
    return _fuse(d, _axis_name(d, axis), "softmax")


def fuse_norm_contract(d: Diagram, axis) -> Diagram:
    """``contract_x(normalize_x(S), V)`` -> ``norm_contract_x(S, V)`` (normalisation family)."""
    return _fuse(d, _axis_name(d, axis), "normalize")


def _fuse(d: Diagram, axis: str, kind: str) -> Diagram:
    """Every fusable ``kind`` over ``axis`` fused, one at a time (computed once per diagram)."""
    def compute():
        for k, j, s, v in _fusable(d, axis, kind):
            types = d.var_types()
            box = _FUSED_BOX[kind](d.eqns[k].box, types[s], types[v], d.axis(axis), d.eqns[j].box.cod[0])
            return _fuse(_rebuild(d, {k}, {j: (box, (s, v))}), axis, kind)
        return d
    return d.memo(("fuse", kind, axis), compute)


def _fuse_check(kind):
    def check(d, axis):
        return None if next(_fusable(d, _axis_name(d, axis), kind), None) else \
            f"no {kind} over {axis} feeding a single two-operand contraction over {axis}"
    return check


register(Rule("fuse_softmax_contract", "rewrite",
              "softmax over x whose only consumer is a two-operand contraction over x; the "
              "probabilities are not an output",
              _fuse_check("softmax"), fuse_softmax_contract,
              "proofs/test_accumulators.py::test_online_softmax_lemma"))
register(Rule("fuse_norm_contract", "rewrite",
              "normalize over x whose only consumer is a two-operand contraction over x",
              _fuse_check("normalize"), fuse_norm_contract,
              "proofs/test_accumulators.py::test_normalisation_family_lemma"))


# --------------------------------------------------------------------------- relabelings

def _check_size(d: Diagram, axis: str, size, what: str):
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise RelabelError(f"{what} size for axis {axis} must be a positive int or a symbol name, got {size!r}")
    if isinstance(size, int):
        if size < 1:
            raise RelabelError(f"{what} size for axis {axis} must be >= 1, got {size}")
        n = d.axis(axis).size
        if isinstance(n, int) and size > n:
            raise RelabelError(f"{what} size {size} is larger than axis {axis}={n}")
    elif not size.isidentifier():
        raise RelabelError(f"{what} size {size!r} for axis {axis} is not a valid symbol name")
    for r in d.schedule:  # a later relabeling of the same axis nests inside the earlier ones
        if r.op == what and r.axis == axis and isinstance(r.size, int) and isinstance(size, int) and size > r.size:
            raise RelabelError(f"{what} size {size} for axis {axis} is larger than the enclosing "
                               f"{r.op}({axis}, {r.size}) it nests in")
    for r in d.schedule:
        if r.op == "require" and r.axis == axis and isinstance(size, int) and size % r.size:
            raise RelabelError(f"{what} size {size} for axis {axis} is not a multiple of {r.size} "
                               f"(required by require({axis}, multiple_of={r.size}))")


def _check_level(level: str) -> str:
    if not isinstance(level, str):
        raise RelabelError(f"a memory level is a name such as 'SMEM', got {level!r}; levels: {list(FULL.names)}")
    FULL.index(level)
    if level == FULL.top:
        raise RelabelError(f"cannot partition into the top level {level}; pick a lower one")
    return level


def _device_split(d: Diagram, op: str, axis: str, level, order=None) -> Relabel:
    """The ``Relabel`` of ``op(axis, DEVICES)``: one block of ``axis/devices`` per GPU, in its
    HBM, laid out by ``order`` (recorded in ``extra``: ``("zigzag",)``, or nothing for contiguous)."""
    extra = check_layout(op, axis, DEVICES, order)
    if level not in (None, "HBM"):
        raise RelabelError(f"{op}({axis}, {DEVICES!r}): a device's block lives in its HBM; got level {level!r}")
    inner = [r for r in d.schedule if r.op in ("tile", "stream") and r.size != DEVICES]
    if inner:
        raise RelabelError(f"{op}({axis}, {DEVICES!r}) after {inner[0].op}({inner[0].axis}, {inner[0].size}): "
                           f"split over the devices first, then relabel within a device")
    if any(r.op == op and r.size == DEVICES for r in d.schedule):
        raise RelabelError(f"{op}({axis}, {DEVICES!r}): {d.short()} already has a {op} over the devices "
                           f"({d._sched_str()}); one axis per kind of device split")
    return Relabel(op, axis, DEVICES, "HBM", extra)


def device_splits(d: Diagram) -> dict[str, str]:
    """``{"tile": axis, "stream": axis}`` for the axes ``d`` splits over the devices."""
    return {r.op: r.axis for r in d.schedule if r.op in ("tile", "stream") and r.size == DEVICES}


def tile(d: Diagram, axis, size, level: str | None = None, partial: str | None = None,
         order: str | None = None) -> Diagram:
    """Group partition of ``axis`` into groups of ``size`` living at ``level`` (default SMEM);
    ``size=DEVICES`` (``"devices"``): one group per device, laid out by ``order``
    (``"contiguous"``, the default, or ``"zigzag"``: :mod:`.devices`).  ``partial="sum"``: ``axis`` is
    summed over, each group adds its partial sum into the outputs (:mod:`.split`)."""
    name = _axis_name(d, axis)
    check_layout("tile", name, size, order)
    if check_partial(partial):
        return split_tile(d, name, size, level, partial)
    problem = tile_problem(d.unrelabelled(), name)
    if problem:
        raise RelabelError(f"cannot tile {name}: {problem}")
    if size == DEVICES:
        return replace(d, schedule=d.schedule + (_device_split(d, "tile", name, level, order),))
    _check_size(d, name, size, "tile")
    if any(r.op == "stream" and r.axis == name for r in d.schedule):
        raise RelabelError(f"cannot tile {name}: it is already streamed; tile before streaming")
    level = _check_level(DEFAULT_LEVEL if level is None else level)
    return replace(d, schedule=d.schedule + (Relabel("tile", name, size, level),))


def split_tile(d: Diagram, name: str, size, level, partial: str) -> Diagram:
    """``tile(name, size, level, partial=...)``: the checks of :mod:`.split`, then a tile."""
    problem = split_problem(d.unrelabelled(), name, acts_along)
    if problem:
        raise RelabelError(f"cannot tile {name} with partial={partial!r}: {problem}")
    if size == DEVICES:
        raise RelabelError(f"tile({name}, {DEVICES!r}, partial={partial!r}): partial sums over the devices "
                           f"(an all-reduce) are not supported; tile {name} within a device")
    level = DEFAULT_LEVEL if level is None else level
    if level != DEFAULT_LEVEL:
        raise RelabelError(f"tile({name}, {size}, {level!r}, partial={partial!r}): the blocks add their partial "
                           f"sums into HBM with atomics; a split axis is tiled at {DEFAULT_LEVEL}")
    _check_size(d, name, size, "tile")
    if any(r.op == "stream" and r.axis == name for r in d.schedule):
        raise RelabelError(f"cannot tile {name}: it is already streamed; tile before streaming")
    return replace(d, schedule=d.schedule + (Relabel("tile", name, size, _check_level(level), (partial,)),))


def stream(d: Diagram, axis, size, level: str | None = None, order: str | None = None) -> Diagram:
    """Stream partition of ``axis`` in chunks of ``size`` staged at ``level`` (default SMEM);
    ``size=DEVICES``: one block per device, laid out by ``order`` (as in :func:`tile`).

    Softmax (or a streamable normalisation) followed by a contraction over ``axis`` is first
    rewritten into the fused accumulator form; anything else that needs the whole axis is
    refused with the reason."""
    name = _axis_name(d, axis)
    check_layout("stream", name, size, order)
    if size == DEVICES:
        step = _device_split(d, "stream", name, level, order)
    else:
        _check_size(d, name, size, "stream")
        step = Relabel("stream", name, size, _check_level(DEFAULT_LEVEL if level is None else level))
    fused = fuse_norm_contract(fuse_softmax_contract(d, name), name)
    plan = stream_plan(fused.unrelabelled(), name)
    if isinstance(plan, str):
        raise RelabelError(f"cannot stream {name}: {plan}")
    return replace(fused, schedule=fused.schedule + (step,))


def place(d: Diagram, array: str, level: str) -> Diagram:
    """Place the wire(s) named ``array`` at ``level``."""
    names = set(d.var_names())
    if array not in names:
        raise RelabelError(f"no wire named {array!r}; wires are {sorted(names)}")
    if not isinstance(level, str):
        raise RelabelError(f"place({array}): a memory level is a name such as 'SMEM', got {level!r}")
    FULL.index(level)
    return replace(d, schedule=d.schedule + (Relabel("place", "", None, level, (array,)),))


def require(d: Diagram, axis, multiple_of: int) -> Diagram:
    """Tile and stream sizes on ``axis`` must be multiples of ``multiple_of`` (LCM of all)."""
    name = _axis_name(d, axis)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise RelabelError(f"require({name}): multiple_of must be a positive int, got {multiple_of!r}")
    k = multiple_of
    for r in d.schedule:
        if r.op == "require" and r.axis == name:
            k = math.lcm(k, r.size)
    for r in d.schedule:
        if r.op in ("tile", "stream") and r.axis == name and isinstance(r.size, int) and r.size % k:
            raise RelabelError(f"{r.op} size {r.size} for axis {name} is not a multiple of {k}")
    kept = tuple(r for r in d.schedule if not (r.op == "require" and r.axis == name))
    return replace(d, schedule=kept + (Relabel("require", name, k),))


def order(d: Diagram, *axes_) -> Diagram:
    """Nest the stream loops in this order (outer first); unnamed loops keep their order."""
    names = tuple(_axis_name(d, a) for a in axes_)
    if len(set(names)) != len(names):
        raise RelabelError(f"order: axes {list(names)} name an axis more than once")
    streamed = [r.axis for r in d.schedule if r.op == "stream"]
    for n in names:
        if n not in streamed:
            raise RelabelError(f"order: axis {n} is not streamed (streamed: {streamed})")
    ring = device_splits(d).get("stream")
    if ring is not None and names and names[0] != ring:
        raise RelabelError(f"order{names}: the stream of {ring} over the devices is the outermost loop; "
                           f"name it first: order({', '.join(repr(n) for n in (ring,) + names if n)})")
    kept = tuple(r for r in d.schedule if r.op != "order")
    return replace(d, schedule=kept + (Relabel("order", "", None, "", names),))


def requirements(d: Diagram) -> dict[str, int]:
    return {r.axis: r.size for r in d.schedule if r.op == "require"}


def check_blocks(d: Diagram, sizes: dict) -> None:
    """Divisibility of concrete block sizes (symbolic ones are checked once bound)."""
    req = requirements(d)
    for r in d.schedule:
        if r.op in ("tile", "stream") and r.axis in req:
            s = sizes.get(r.size, r.size) if isinstance(r.size, str) else r.size
            if isinstance(s, int) and s % req[r.axis]:
                raise RelabelError(f"{r.op} size {r.size}={s} for axis {r.axis} is not a multiple "
                                   f"of {req[r.axis]} (require)")


def _relabel_rule(name, fn, conditions, proof):
    def check(d, **kw):
        try:
            fn(d, **kw)
        except RelabelError as e:
            return str(e)
        return None
    return register(Rule(name, "relabel", conditions, check, lambda d, **kw: fn(d, **kw), proof))


_relabel_rule("tile", tile, "the diagram is weaved over the axis: nothing removes or acts along it, "
              "every output keeps it", "napkin_cat/relabel.py::tile_problem (group partition)")
_relabel_rule("stream", stream, "every box removing the axis has an accumulator and nothing after it "
              "reads the axis again (fusion theorem)", "proofs/test_fusion.py")
_relabel_rule("place", place, "the wire exists and the level is in the hierarchy", "colouring only")
_relabel_rule("require", require, "positive multiple; existing blocks divide", "labels only")
_relabel_rule("order", lambda d, axes: order(d, *axes), "every named axis is streamed",
              "loop order only: the accumulators are independent of the nesting")
