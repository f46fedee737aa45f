"""Cutting a diagram into pieces that run one after another, their boundaries in HBM.

A *cut* is a set of intermediate variables that are stored to HBM by the piece that computes
them and loaded back by the pieces that read them.  With the equations in program order, a
cut diagram is a sequence of :class:`Piece` values, each a contiguous run of equations
``[start, stop)`` with its own inputs (the diagram's inputs and earlier pieces' results it
reads) and outputs (what it computes that a later piece or the diagram's result reads).  Each
piece is a diagram of its own, so every later stage (final form, cost, lowering) reads it like
any other; composed in order they compute what the whole diagram computes (the equations are
the same, only the wires between pieces go through HBM).

``place(wire, "HBM")`` on an intermediate wire asks for a cut there (:func:`forced_cuts`).  A
softmax whose row does not fit one block has a two-pass form (:func:`softmax_two_pass`): a
statistics pass ``L = logsumexp(X)`` (streamed along the row) and a normalising pass
``P = exp(X - L)``, equal to ``softmax(X)`` wherever ``L`` is finite.

>>> import napkin_cat as nc
>>> from napkin_cat.core import Axis
>>> d = nc.library.mlp(Axis("t", 8), Axis("d", 8), Axis("f", 16))
>>> [p.eqns for p in pieces(d, (3,))]
[(0, 3), (3, 5)]
>>> print(pieces(d, (3,))[1].diagram.short())
[H[t=8 f=16] f32, W2[f=16 d=8] f32, b2[d=8] f32 -> Y[t=8 d=8] f32]
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.diagram import Diagram, Eqn
from ..core.errors import RelabelError
from ..core.types import Ty
from ..ops.boxes import map_box, reduce_box


@dataclass(frozen=True)
class Piece:
    """Equations ``eqns = (start, stop)`` of a diagram as a diagram of their own: ``ins`` (in
    order of first use) and ``outs`` are variable ids of the whole diagram, in the order of
    ``diagram.dom`` / ``diagram.cod``."""

    eqns: tuple[int, int]
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    diagram: Diagram


def readers(d: Diagram) -> dict[int, list[int]]:
    """Variable id -> the equations that read it."""
    out: dict[int, list[int]] = {}
    for k, e in enumerate(d.eqns):
        for v in e.ins:
            out.setdefault(v, []).append(k)
    return out


def producer(d: Diagram, v: int) -> int | None:
    """The equation that computes variable ``v`` (None for an input)."""
    for k in range(len(d.eqns)):
        if v in d.eqn_outputs(k):
            return k
    return None


def piece(d: Diagram, start: int, stop: int) -> Piece:
    """Equations ``start..stop-1`` of ``d`` as a diagram.  Its wires are renamed where two of
    them would share a name across its inputs and outputs (``H_5``: variable 5), so that each
    kernel argument has its own name."""
    if not 0 <= start < stop <= len(d.eqns):
        raise RelabelError(f"piece({start}, {stop}) of {d.short()}: equations run 0..{len(d.eqns)}")
    types = d.var_types()
    first = d.eqn_outputs(start)[0]
    last = d.eqn_outputs(stop - 1)[-1] + 1
    ins: list[int] = []
    for e in d.eqns[start:stop]:
        for v in e.ins:
            if v < first and v not in ins:
                ins.append(v)
    later = {v for e in d.eqns[stop:] for v in e.ins}
    outs = [v for v in range(first, last) if v in later or v in d.outs]
    names: dict[int, str] = {}
    used: set[str] = set()
    for v in (*ins, *outs):
        n = types[v].name
        if n in used:
            n = f"{n}_{v}"
        used.add(n)
        names[v] = n
    local = {v: i for i, v in enumerate(ins)}
    n = len(ins)
    eqns = []
    for j in range(start, stop):
        eqns.append(Eqn(d.eqns[j].box, tuple(local[v] for v in d.eqns[j].ins)))
        for v in d.eqn_outputs(j):
            local[v] = n
            n += 1
    from ..ops.builder import _rename_var
    eqns = list(eqns)
    for v in outs:
        eqns = _rename_var(eqns, len(ins), local[v], names[v])
    sub = Diagram(Ty(*(types[v].named(names[v]) for v in ins)), Ty(*(types[v].named(names[v]) for v in outs)),
                  tuple(eqns), tuple(local[v] for v in outs))
    return Piece((start, stop), tuple(ins), tuple(outs), sub)


def pieces(d: Diagram, cuts) -> list[Piece]:
    """``d`` cut before each equation index in ``cuts`` (0 < cut < number of equations)."""
    bounds = [0, *sorted(set(cuts)), len(d.eqns)]
    for c in bounds[1:-1]:
        if not 0 < c < len(d.eqns):
            raise RelabelError(f"cut before equation {c}: {d.short()} has equations 0..{len(d.eqns) - 1}")
    return [piece(d, a, b) for a, b in zip(bounds, bounds[1:])]


def forced_cuts(d: Diagram) -> tuple[str, ...]:
    """Names of intermediate wires that ``place(wire, "HBM")`` asks to store in HBM."""
    inputs = {a.name for a in d.dom}
    outputs = {a.name for a in d.cod}
    names = []
    for r in d.schedule:
        if r.op == "place" and r.level == "HBM":
            for n in r.extra:
                if n not in inputs and n not in outputs and n not in names:
                    names.append(n)
    return tuple(names)


def cut_after(d: Diagram, name: str) -> int:
    """Where ``place(name, "HBM")`` cuts: after the last equation whose output is ``name``
    (elementwise maps keep a wire's name; the value the name finally holds goes to HBM)."""
    found = [k for k in range(len(d.eqns)) if any(d.var_types()[v].name == name for v in d.eqn_outputs(k))]
    if not found:
        raise RelabelError(f"place({name}, 'HBM'): no equation of {d.short()} computes a wire named {name}")
    return found[-1] + 1


def softmax_two_pass(d: Diagram, k: int) -> Diagram:
    """``d`` with its softmax equation ``k`` written as ``P = exp(X - logsumexp(X))``: three
    equations, whose statistics ``L`` can be computed by a pass of its own."""
    e = d.eqns[k]
    if e.box.kind != "softmax":
        raise RelabelError(f"equation {k} of {d.short()} is {e.box.kind}, not softmax")
    x = e.box.dom[0]
    axis = e.box.param("axis")
    ax = next(a for a in x.axes if a.name == axis)
    lse = reduce_box("logsumexp", x, ax, f"{e.box.cod[0].name}_lse")
    sub = map_box("sub", [x, lse.cod[0]], e.box.cod[0].name, out_axes=x.axes)
    exp = map_box("exp", [sub.cod[0]], e.box.cod[0].name)
    n = d.eqn_outputs(k)[0]        # the softmax's output; the new equations add two variables before it
    shift = lambda v: v if v < n else v + 2
    eqns = [Eqn(b.box, tuple(shift(v) for v in b.ins)) for b in d.eqns[:k]]
    eqns += [Eqn(lse, e.ins), Eqn(sub, (e.ins[0], n)), Eqn(exp, (n + 1,))]
    eqns += [Eqn(b.box, tuple(shift(v) for v in b.ins)) for b in d.eqns[k + 1:]]
    return Diagram(d.dom, d.cod, tuple(eqns), tuple(shift(v) for v in d.outs))


__all__ = ["Piece", "piece", "pieces", "forced_cuts", "cut_after", "softmax_two_pass", "readers", "producer"]
