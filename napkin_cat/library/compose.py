"""Wire library diagrams into a bigger one: :func:`call` inlines a diagram's equations into a
:class:`~napkin_cat.ops.Builder`, so a network is its parts composed, box for box.

>>> import napkin_cat as nc
>>> from napkin_cat.library.compose import call
>>> t, d = nc.axes("t d")
>>> g = nc.Builder()
>>> X, gamma, beta = g.input("X", t, d), g.input("gamma", d), g.input("beta", d)
>>> (Y,) = call(g, nc.library.layernorm(t, d), X, gamma, beta)
>>> print(g.diagram(Y))
X[t d] f32, gamma[d] f32, beta[d] f32 -> Y[t d] f32
"""

from __future__ import annotations

from ..core import Diagram
from ..core.errors import TypingError, describe_array
from ..ops import Builder, Wire


def call(g: Builder, d: Diagram, *wires: Wire) -> tuple[Wire, ...]:
    """Apply ``d`` to ``wires`` inside ``g`` (one wire per input of ``d``, of the same type up to
    names); returns one wire per output of ``d``."""
    if not isinstance(d, Diagram):
        raise TypingError(f"call needs a Diagram, got {type(d).__name__}")
    if d.schedule:
        raise TypingError(f"call {d.short()}: inline the unrelabelled diagram, then relabel the whole")
    if len(wires) != len(d.dom):
        raise TypingError(f"call {d.short()}: it takes {len(d.dom)} wires, got {len(wires)}")
    for w, arr in zip(wires, d.dom):
        if g.ty(w) != arr:
            raise TypingError(f"call {d.short()}: input {describe_array(arr)} gets wire {describe_array(g.ty(w))}")
    env: list = list(wires) + [None] * (len(d.var_types()) - len(d.dom))
    for k, e in enumerate(d.eqns):
        outs = g.box(e.box, *(env[v] for v in e.ins))
        outs = outs if isinstance(outs, tuple) else (outs,)
        for v, w in zip(d.eqn_outputs(k), outs):
            env[v] = w
    return tuple(env[v] for v in d.outs)


def weights(g: Builder, d: Diagram, prefix: str, skip: int = 1) -> list[Wire]:
    """Declare ``d``'s inputs after the first ``skip`` (its weights) as inputs of ``g``, named
    ``<prefix>_<name>``."""
    return [g.input(f"{prefix}_{a.name}", *a.axes, dtype=a.dtype) for a in d.dom[skip:]]


__all__ = ["call", "weights"]
