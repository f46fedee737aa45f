"""The nodes of a final form: loops, loads and stores, computations, accumulator phases, and
the buffers and program points the memory model reads (re-exported by :mod:`.loopnest`)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..core.diagram import Size


@dataclass(frozen=True)
class Loop:
    axis: str
    step: Size
    kind: str            # "grid" or "stream"
    level: str
    body: tuple = ()


@dataclass(frozen=True)
class Load:
    """Copy ``var`` (the slice the enclosing loops select) from ``src`` down into ``level``.
    An input crossing several levels (HBM -> L2 -> SMEM) has one Load per level; only the
    innermost (``final``) one feeds the computation, the outer ones stage data."""

    var: int
    level: str
    src: str = "HBM"
    final: bool = True


@dataclass(frozen=True)
class Store:
    """Copy ``var`` from ``level`` up into ``dst``.  A ``flush`` writes back, at the end of an
    outer level's group, what inner stores staged at ``level``."""

    var: int
    level: str
    dst: str = "HBM"
    flush: bool = False


@dataclass(frozen=True)
class Compute:
    """Apply equation ``eqn``.  A parameter lives at the top level like an input: its Compute is
    its ``Load`` (``src``, ``level``, ``final`` as there); ``src`` is None for other equations."""

    eqn: int
    src: str | None = None
    level: str | None = None
    final: bool = True


@dataclass(frozen=True)
class Init:
    acc: int


@dataclass(frozen=True)
class Update:
    acc: int


@dataclass(frozen=True)
class Finalise:
    acc: int


@dataclass(frozen=True)
class Buffer:
    """A resident allocation: ``name[extents] @level``; ``key`` is ``("var", id)`` or
    ``("state", acc, name)``."""

    key: tuple
    name: str
    axes: tuple[str, ...]
    extents: tuple[sp.Expr, ...]
    level: str
    dtype_bytes: int

    @property
    def size(self) -> sp.Expr:
        return sp.Mul(*self.extents) if self.extents else sp.Integer(1)

    def describe(self) -> str:
        return f"{self.name}[{' '.join(str(e) for e in self.extents)}]"


@dataclass(frozen=True)
class Column:
    """One program point: the node, its enclosing loops, the buffers live there."""

    node: object
    loops: tuple[Loop, ...]
    live: tuple[Buffer, ...]

    def memory(self) -> dict[str, sp.Expr]:
        out: dict[str, sp.Expr] = {}
        for b in self.live:
            out[b.level] = out.get(b.level, sp.Integer(0)) + b.size
        return out


