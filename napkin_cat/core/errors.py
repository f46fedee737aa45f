"""The one exception family of napkin_cat, and the texts users read.

Every user-facing failure is a :class:`NapkinError`.  Subclasses say which stage refused:
typing (composition, evaluation inputs), relabeling, equivalence checking, cost, lowering.
Messages name the arrays, axes, sizes and dtypes involved so that nothing has to be
reconstructed by the reader.
"""

from __future__ import annotations


class NapkinError(Exception):
    """Base class of every error napkin_cat raises on purpose."""


class TypingError(NapkinError, TypeError):
    """Types do not fit: composition, weaving, box construction."""


class TraceError(TypingError):
    """A Python function an index expression cannot be traced from (the reason and the fix)."""


class ShapeError(NapkinError, ValueError):
    """An array passed to ``evaluate`` (or a kernel) does not match its wire."""


class EmptyAxisError(ShapeError):
    """An axis of size 0 (an empty input array, or ``sizes={axis: 0}``): every axis has at least
    one element, so that max, softmax and the accumulators' row statistics are defined
    (docs/NAN_POLICY.md)."""


class UnknownKindError(NapkinError, KeyError):
    """A box kind has no rule in an interpretation table."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the text readable
        return str(self.args[0]) if self.args else ""


class RelabelError(NapkinError, ValueError):
    """A relabeling (tile, stream, place, require, order) is not valid here."""


class EquivalenceError(NapkinError, AssertionError):
    """Two diagrams disagree; carries the shrunk counterexample."""

    def __init__(self, message: str, counterexample: dict | None = None):
        super().__init__(message)
        self.counterexample = counterexample or {}


class UnverifiedError(EquivalenceError):
    """A check ran no example (time budget spent, every configuration refused): nothing was
    verified, so nothing passes."""


class CostError(NapkinError, ValueError):
    """A cost or optimisation request cannot be answered (e.g. nothing fits the level)."""


class DrawingError(NapkinError, ValueError):
    """A picture cannot be drawn or saved as asked (unknown format, unwritable path)."""


class LoweringError(NapkinError, ValueError):
    """A diagram cannot be lowered to the requested target."""


def describe_array(arr) -> str:
    """``Q[q=48 d=16] f32``: the way every message prints an array type."""
    return f"{arr.name}[{' '.join(ax.describe() for ax in arr.axes)}] {arr.dtype.name}"


def describe_ty(ty) -> str:
    return ", ".join(describe_array(a) for a in ty) if len(ty) else "()"


def compose_mismatch(f, g) -> str:
    lines = [f"{f.short()} does not compose with {g.short()}: cod != dom",
             f"  cod of left : {describe_ty(f.cod)}",
             f"  dom of right: {describe_ty(g.dom)}"]
    if len(f.cod) != len(g.dom):
        lines.append(f"  left produces {len(f.cod)} array(s), right expects {len(g.dom)}")
    else:
        for i, (a, b) in enumerate(zip(f.cod, g.dom)):
            if a != b:
                lines.append(f"  first mismatch at position {i}: {describe_array(a)} vs {describe_array(b)}"
                             + _why(a, b))
                break
    return "\n".join(lines)


def _why(a, b) -> str:
    if a.dtype != b.dtype:
        return f" (dtype {a.dtype.name} vs {b.dtype.name})"
    if tuple(x.name for x in a.axes) != tuple(x.name for x in b.axes):
        return f" (axes {[x.name for x in a.axes]} vs {[x.name for x in b.axes]})"
    return f" (sizes {[x.size for x in a.axes]} vs {[x.size for x in b.axes]})"
