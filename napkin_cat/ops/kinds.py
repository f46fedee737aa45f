"""Box kinds: one :class:`KindSpec` each, carrying the traits every stage reads.

Stages never re-derive a trait from a kind's name (``box.kind == "softmax"``); they ask its
spec.  Each interpretation keeps its own table keyed by kind (NumPy/torch rules in
:mod:`.semantics`, cost rules in :mod:`napkin_cat.costmodel`, emitters in
:mod:`napkin_cat.lowering`, drawing styles in :mod:`napkin_cat.drawing`), and
``tests/test_kinds.py`` fails by name when one of them lacks a kind.

Traits
``shape``       ``elementwise`` (a value per element of its output, read where it is used),
                ``reduction`` (sums out axes: contract, reduce, the fused accumulators),
                ``normaliser`` (row statistics along ``axis``, then elementwise),
                ``source`` (no inputs: param, const) or ``reindex``;
``axis``        the parameter naming the axis it reduces or normalises along, if any;
``indexed``     it reads global row / column indices (``row`` and ``col`` parameters);
``softmax_like(box)``  exp-normalising along its axis, so invariant to a per-row shift of
                its input: the adversarial "jumps" data regime targets these;
``keeps_neg_inf(box, sizes)``  ``-inf`` in its first input stays ``-inf`` in the output and
                the output is increasing in that input: a masked score stays masked, which
                is what lets a stream skip chunks a mask removes (:mod:`napkin_cat.relabel`);
``zero_at_neg_inf(box, sizes)``  ``-inf`` in its first input gives exactly 0 in the output
                (``exp``): a masked score becomes a zero weight;
``gathers``     the parameter holding the index expression (:mod:`.index_expr`) whose gathers
                read the box's inputs after the first (the auxiliary tensors), if any;
``keeps_zero(box, sizes)``  the inputs at which an exact 0 gives an exact 0 output when the
                other inputs are finite (a product): a zero weight stays zero, so a sum over a
                streamed axis gains nothing from a chunk a mask removes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.diagram import Box
from ..core.errors import TypingError, UnknownKindError
from .functions import FUNCTIONS
from .index import constant_value
from .index_support import keeps_neg_inf as _expr_keeps_neg_inf

# the normalisation family N(x)_i = a1(x_i) / b(sum_j a2(x_j)); names from FUNCTIONS
NORMALISATIONS = {
    "softmax": ("exp", "exp", "identity"),   # evaluated with max-subtraction
    "l2": ("identity", "square", "sqrt"),
    "l1": ("identity", "abs", "identity"),
    "sigmoid_sum": ("sigmoid", "sigmoid", "identity"),
}
REDUCTIONS = ("sum", "max", "min", "mean", "logsumexp")


def _no(box, sizes=None) -> bool:
    return False


def _yes(box, sizes=None) -> bool:
    return True


def _none(box, sizes=None) -> tuple:
    return ()


def _first(box, sizes=None) -> tuple:
    return (0,)


@dataclass(frozen=True)
class KindSpec:
    name: str
    shape: str
    doc: str
    axis: str | None = None
    indexed: bool = False
    fused: bool = False
    softmax_like: Callable = _no
    keeps_neg_inf: Callable = _no
    zero_at_neg_inf: Callable = _no
    keeps_zero: Callable = _none
    gathers: str | None = None

    def __post_init__(self):
        if self.shape not in ("elementwise", "reduction", "normaliser", "source", "reindex"):
            raise ValueError(f"kind {self.name}: unknown shape {self.shape!r}")


def _map_keeps(box: Box, sizes=None) -> bool:
    f = FUNCTIONS[box.param("fn")]
    c = box.param("c", None)
    if f.constant:
        try:
            c = constant_value(c, sizes or {})
        except TypingError:  # an unbound AxisPower: not provably positive
            return False
    return f.keeps_neg_inf(c)


def _map_zero_at_neg_inf(box: Box, sizes=None) -> bool:
    return FUNCTIONS[box.param("fn")].zero_at_neg_inf


def _map_keeps_zero(box: Box, sizes=None) -> tuple:
    return FUNCTIONS[box.param("fn")].keeps_zero


def _exp_normalised(box: Box, sizes=None) -> bool:
    return box.param("a1") == "exp"


def _index_map_keeps(box: Box, sizes=None) -> bool:
    return _expr_keeps_neg_inf(box.param("fn").expr)


def _reduce_softmax_like(box: Box, sizes=None) -> bool:
    return box.param("op") in ("max", "logsumexp")


SPECS: dict[str, KindSpec] = {s.name: s for s in (
    KindSpec("contract", "reduction", "einsum over named axes: output axes are the cod's, the rest are summed"),
    KindSpec("map", "elementwise", "an elementwise function from ops.functions, unary or binary",
             keeps_neg_inf=_map_keeps, zero_at_neg_inf=_map_zero_at_neg_inf, keeps_zero=_map_keeps_zero),
    KindSpec("reduce", "reduction", "sum / max / min / mean / logsumexp over one axis", axis="axis",
             softmax_like=_reduce_softmax_like),
    KindSpec("softmax", "normaliser", "softmax over one axis (rows that are all -inf give zeros)",
             axis="axis", softmax_like=_yes),
    KindSpec("normalize", "normaliser", "a1(x_i) / b(sum_j a2(x_j)) over one axis (the streamable family)",
             axis="axis", softmax_like=_exp_normalised),
    KindSpec("mask", "elementwise", "where(pred(i, j), x, -inf) from global indices of two axes",
             indexed=True, keeps_neg_inf=_yes, gathers="pred"),
    KindSpec("index_bias", "elementwise", "x + bias(i, j) computed from global indices (ALiBi-like)",
             indexed=True, keeps_neg_inf=_yes, gathers="bias"),
    KindSpec("reindex", "reindex", "transpose, split, merge, slice, diagonal, rename, unfold (windows / pad)"),
    KindSpec("param", "source", "a named parameter (no inputs; value passed at evaluation)"),
    KindSpec("const", "source", "an array filled with a constant"),
    KindSpec("cast", "elementwise", "change of dtype", keeps_zero=_first),
    KindSpec("softmax_contract", "reduction", "softmax along axis, then contraction over it (fused)",
             axis="axis", fused=True, softmax_like=_yes),
    KindSpec("norm_contract", "reduction", "a normalisation along axis, then contraction over it (fused)",
             axis="axis", fused=True, softmax_like=_exp_normalised),
    KindSpec("index_map", "elementwise", "y = e(x, indices, aux gathers): an index expression whose score is x "
             "(ops.aux_grad)", indexed=True, keeps_neg_inf=_index_map_keeps, gathers="fn"),
    KindSpec("scatter_aux", "reduction", "out[clamp(idx)] += w: the adjoint of one aux gather (ops.aux_grad)",
             indexed=True),
)}
KINDS = tuple(SPECS)


def spec(box_or_kind) -> KindSpec:
    """The spec of a box (or of a kind name); an unknown kind is refused by name."""
    kind = box_or_kind if isinstance(box_or_kind, str) else box_or_kind.kind
    try:
        return SPECS[kind]
    except KeyError:
        raise UnknownKindError(f"unknown box kind {kind!r}; known: {list(SPECS)}") from None


def gather_expr(box: Box):
    """The index expression (:class:`~.index_expr.Ix`) whose gathers read ``box``'s inputs after
    the first, or None (a kind without gathers, or a custom Python index function)."""
    name = spec(box).gathers
    fn = box.param(name) if name is not None else None
    return getattr(fn, "expr", None)


def gathered_only(d) -> tuple[int, ...]:
    """The inputs of ``d`` read only through gathers (the auxiliary tensors of its index
    expressions), none read any other way."""
    n = len(d.dom)
    gathered, other = set(), set(d.outs)
    for e in d.eqns:
        own = spec(e.box).gathers is not None
        for pos, v in enumerate(e.ins):
            (gathered if own and pos > 0 else other).add(v)
    return tuple(sorted(v for v in gathered - other if v < n))


def axis_of(box: Box) -> str | None:
    """The axis ``box`` reduces or normalises along (None for other kinds)."""
    s = spec(box)
    return None if s.axis is None else box.param(s.axis)


def normalises_along(box: Box, axis: str) -> bool:
    """``box`` is a normaliser whose statistics run along ``axis``."""
    return spec(box).shape == "normaliser" and box.param("axis") == axis
