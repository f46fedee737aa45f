"""Build diagrams by tracing: :class:`Builder` and its wires, and one-box diagrams (:func:`op`, :func:`contract`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.diagram import Array, Axis, Box, Diagram, DType, Eqn, Ty, f32
from ..core.errors import TypingError
from .boxes import (_check_arrays, _check_dtype, cast_box, const_box, contract_box, index_bias_box, map_box,
                    mask_box, normalize_box, param_box, reduce_box, rename_box, softmax_box, transpose_box,
                    unfold_box)
from .index import IndexBias, Predicate

class Builder:
    """Build a diagram by tracing: ``Q = b.input("Q", q, d)``, ``S = b.contract(Q, K, out=(q, x))``.

    Each call appends one equation and returns a :class:`Wire` handle; :meth:`diagram`
    closes the trace with the chosen outputs."""

    def __init__(self, dtype: DType = f32):
        _check_dtype("Builder", dtype)
        self.dtype = dtype
        self._inputs: list[Array] = []
        self._eqns: list[Eqn] = []
        self._types: list[Array] = []

    # wires
    def input(self, name: str, *axes_: Axis, dtype: DType | None = None) -> "Wire":
        """Declare an input array ``name`` with these axes (dtype: the Builder's unless given).
        Inputs come first: declaring one after an operation is a :class:`TypingError`."""
        if self._eqns:
            raise TypingError("declare every input before the first operation")
        if dtype is not None:
            _check_dtype(f"input {name}", dtype)
        arr = Array(tuple(axes_), dtype or self.dtype, name)
        self._inputs.append(arr)
        self._types.append(arr)
        return Wire(self, len(self._types) - 1)

    def _apply(self, box: Box, *wires: "Wire") -> tuple["Wire", ...]:
        self._wires(box.name, wires)
        ins = tuple(w.var for w in wires)
        for w, a in zip(wires, box.dom):
            if self._types[w.var] != a:
                raise TypingError(f"{box.name}: wire {self._types[w.var]} does not match {a}")
        self._eqns.append(Eqn(box, ins))
        start = len(self._types)
        self._types.extend(box.cod)
        return tuple(Wire(self, v) for v in range(start, len(self._types)))

    def box(self, box: Box, *wires: "Wire"):
        """Apply a ready-made :class:`Box` to ``wires`` (their types must match its dom): one
        wire back, or a tuple when the box has several outputs."""
        outs = self._apply(box, *wires)
        return outs[0] if len(outs) == 1 else outs

    def _wires(self, what: str, wires) -> None:
        for w in wires:
            if not isinstance(w, Wire) or w.builder is not self:
                raise TypingError(f"{what}: expected a wire of this Builder (from b.input or an operation), got {w!r}")

    def ty(self, w: "Wire") -> Array:
        """The array type (axes, dtype, name) carried by wire ``w``."""
        self._wires("Builder", (w,))
        return self._types[w.var]

    # operations
    def contract(self, *wires: "Wire", out: Sequence[Axis], name: str = "C") -> "Wire":
        """Einsum-style contraction of ``wires``: axes not in ``out`` are summed over.

        >>> import napkin_cat as nc
        >>> a, b, c = nc.axes("a b c"); g = nc.Builder()
        >>> A, B = g.input("A", a, b), g.input("B", b, c)
        >>> print(g.diagram(g.contract(A, B, out=(a, c))))
        A[a b] f32, B[b c] f32 -> C[a c] f32
        """
        return self.box(contract_box([self.ty(w) for w in wires], out, name), *wires)

    def map(self, fn: str, *wires: "Wire", c=None, name: str = "", out=None) -> "Wire":
        """Elementwise function ``fn`` (a name in :data:`napkin_cat.ops.FUNCTIONS`: ``"exp"``,
        ``"relu"``, ``"add"``, ``"scale"``...) over ``wires``, broadcasting on shared axis names.
        ``c``: the constant of a function that has one (``scale``, ``shift``; an
        :class:`AxisPower` such as ``AxisPower(d)`` for ``1/sqrt(d)``); ``out``: the order of the
        output axes; ``name``: the output's name (default: the first input's)."""
        return self.box(map_box(fn, [self.ty(w) for w in wires], name, c, out), *wires)

    def reduce(self, op: str, w: "Wire", axis: Axis, name: str = "") -> "Wire":
        """Reduce ``w`` along ``axis`` with ``op`` (``sum``, ``max``, ``min``, ``mean``,
        ``logsumexp``); the axis is dropped."""
        return self.box(reduce_box(op, self.ty(w), axis, name), w)

    def softmax(self, w: "Wire", axis: Axis, name: str = "P") -> "Wire":
        """Softmax of ``w`` along ``axis`` (the axis is kept)."""
        return self.box(softmax_box(self.ty(w), axis, name), w)

    def normalize(self, w: "Wire", axis: Axis, a1: str, a2: str, b: str, name: str = "N", eps: float = 0.0) -> "Wire":
        """A streamable normalisation along ``axis``: ``a1(s) / b(eps + sum a2(s))`` with unary
        functions ``a1``, ``a2``, ``b`` (softmax is ``exp, exp, identity``, l2 is ``identity, square, sqrt``; see
        :data:`napkin_cat.ops.NORMALISATIONS`)."""
        return self.box(normalize_box(self.ty(w), axis, a1, a2, b, name, eps), w)

    def mask(self, w: "Wire", row: Axis, col: Axis, pred: Predicate, *aux: "Wire") -> "Wire":
        """Set the entries ``(i, j)`` of ``w`` (``i`` along ``row``, ``j`` along ``col``) where
        ``pred`` is false to ``-inf``: ``nc.causal()``, ``nc.window(n)``, ``nc.predicate(fn)``,
        ``nc.mask_mod(fn)`` (whose auxiliary tensors are the wires ``aux``)."""
        return self.box(mask_box(self.ty(w), row, col, pred, aux=[self.ty(a) for a in aux]), w, *aux)

    def index_bias(self, w: "Wire", row: Axis, col: Axis, bias: IndexBias, *aux: "Wire") -> "Wire":
        """Add a bias computed from the indices ``(i, j)`` along ``row`` and ``col`` to ``w``
        (e.g. ``nc.alibi(0.5)``, ``nc.bias_mod(fn)`` with its auxiliary wires ``aux``)."""
        return self.box(index_bias_box(self.ty(w), row, col, bias, aux=[self.ty(a) for a in aux]), w, *aux)

    def param(self, name: str, *axes_: Axis, dtype: DType | None = None) -> "Wire":
        """A named parameter array (a source box, not an input of the diagram)."""
        if dtype is not None:
            _check_dtype(f"param {name}", dtype)
        return self.box(param_box(Array(tuple(axes_), dtype or self.dtype, name)))

    def const(self, value: float, *axes_: Axis, name: str = "c") -> "Wire":
        """An array of these axes filled with ``value`` (``float("-inf")`` allowed)."""
        return self.box(const_box(Array(tuple(axes_), self.dtype, name), value))

    def transpose(self, w: "Wire", *order: Axis) -> "Wire":
        """``w`` with its axes in ``order`` (every axis named once)."""
        return self.box(transpose_box(self.ty(w), order), w)

    def rename(self, w: "Wire", axis: Axis, new: Axis) -> "Wire":
        """``w`` with ``axis`` called ``new`` (same size)."""
        return self.box(rename_box(self.ty(w), axis, new), w)

    def unfold(self, w: "Wire", axis: Axis, new: Axis, window: Axis | None = None, **how) -> "Wire":
        """Windows of ``w`` along ``axis`` (``stride``, ``dilation``, ``offset``, ``divisor``; zero
        outside): see :func:`napkin_cat.ops.boxes.unfold_box`."""
        return self.box(unfold_box(self.ty(w), axis, new, window, **how), w)

    def cast(self, w: "Wire", dtype: DType) -> "Wire":
        """``w`` converted to ``dtype`` (e.g. ``nc.f16``)."""
        return self.box(cast_box(self.ty(w), dtype), w)

    def diagram(self, *outs: "Wire", names: Sequence[str] | None = None) -> Diagram:
        """Close the trace: the diagram from the declared inputs to ``outs``, which are
        renamed to ``names`` if given (one per output)."""
        self._wires("diagram", outs)
        if names is not None and (isinstance(names, str) or len(names) != len(outs)):
            raise TypingError(f"diagram: names={names!r} must give one name per output ({len(outs)})")
        cod = [self._types[w.var] for w in outs]
        if names:
            cod = [a.named(n) for a, n in zip(cod, names)]
            # renaming the producing equation's output keeps var types and cod consistent
            eqns = list(self._eqns)
            for w, n in zip(outs, names):
                eqns = _rename_var(eqns, len(self._inputs), w.var, n)
            return Diagram(Ty(*self._inputs), Ty(*cod), tuple(eqns), tuple(w.var for w in outs))
        return Diagram(Ty(*self._inputs), Ty(*cod), tuple(self._eqns), tuple(w.var for w in outs))


def _rename_var(eqns: list[Eqn], n_inputs: int, var: int, name: str) -> list[Eqn]:
    if var < n_inputs:
        return eqns
    v = n_inputs
    out = []
    for e in eqns:
        cod = list(e.box.cod)
        for k in range(len(cod)):
            if v + k == var:
                cod[k] = cod[k].named(name)
        v += len(cod)
        out.append(Eqn(Box(e.box.kind, e.box.dom, Ty(*cod), e.box.params, e.box.name), e.ins))
    return out


@dataclass(frozen=True)
class Wire:
    builder: Builder
    var: int

    @property
    def ty(self) -> Array:
        return self.builder._types[self.var]

    def __add__(self, other):
        return self.builder.map("add", self, other)

    def __sub__(self, other):
        return self.builder.map("sub", self, other)

    def __mul__(self, other):
        if isinstance(other, Wire):
            return self.builder.map("mul", self, other)
        return self.builder.map("scale", self, c=other)

    def __truediv__(self, other):
        return self.builder.map("div", self, other)


# --------------------------------------------------------------------------- one-box diagrams

def op(fn: str, *arrays: Array, c=None) -> Diagram:
    """A one-box elementwise diagram: ``op("exp", Array((q, x)))``."""
    return map_box(fn, arrays, c=c).diagram()


def contract(spec: str, *arrays: Array) -> Diagram:
    """``contract("q d, x d -> q x", Q, K)``: the names in ``spec`` must match the arrays'."""
    if not isinstance(spec, str) or spec.count("->") != 1:
        raise TypingError(f"contract spec must be a string 'in, in -> out', got {spec!r}")
    _check_arrays(f"contract {spec!r}", arrays)
    lhs, rhs = spec.split("->")
    ins = [s.split() for s in lhs.split(",")]
    if len(ins) != len(arrays):
        raise TypingError(f"contract {spec!r}: {len(ins)} operands in the spec, {len(arrays)} arrays given")
    for names, arr in zip(ins, arrays):
        if tuple(names) != arr.axis_names:
            raise TypingError(f"contract {spec!r}: operand {arr} does not read {' '.join(names)}")
    union = {a.name: a for arr in arrays for a in arr.axes}
    out = []
    for n in rhs.split():
        if n not in union:
            raise TypingError(f"contract {spec!r}: output axis {n} is on no operand")
        out.append(union[n])
    return contract_box(arrays, out).diagram()
