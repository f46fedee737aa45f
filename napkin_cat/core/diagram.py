"""Axis-typed monoidal category: axes, dtypes, array types, boxes and diagrams.

A :class:`Diagram` is a morphism ``dom -> cod`` between tuples of named-axis arrays.  It is
stored as a small typed IR (as in JAX's jaxprs): variables ``0 .. len(dom)-1`` are the inputs,
each :class:`Eqn` applies a :class:`Box` to earlier variables and defines the next variables in
order, and ``outs`` says which variables form the codomain.  Copy, discard, swaps and
identities are pure wiring (a variable used twice, never, or out of order), so ``>>`` and ``@``
are two renumberings, defined once here.

Laws (checked numerically in tests/test_laws.py)::

    >>> import napkin_cat as nc
    >>> a, b, c = nc.axes("a b c")
    >>> f = nc.library.matmul(a=a, b=b, c=c)
    >>> (f >> nc.Diagram.id(f.cod)) == f == (nc.Diagram.id(f.dom) >> f)
    True
    >>> eval(repr(f), vars(nc)) == f
    True

This module imports neither NumPy nor sympy: sizes are ints or symbol *names* (str), turned
into sympy symbols in :mod:`napkin_cat.relabel.symbols`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from . import errors, registry
from .errors import RelabelError, TypingError
from .hierarchy import DEVICES
from .types import (DTYPES, Array, Axis, DType, Relabel, Size, Ty, _as_ty, _int_size, axes, bf16, f16,  # noqa: F401
                    f32, f64, fp8_e4m3, fp8_e5m2, i8)

# --------------------------------------------------------------------------- boxes

@dataclass(frozen=True, slots=True)
class Box:
    """A generator: ``kind`` selects the rule in every interpretation table (NumPy, torch,
    cost, lowering); ``params`` is a sorted tuple of ``(key, value)`` pairs."""

    kind: str
    dom: Ty
    cod: Ty
    params: tuple[tuple[str, Any], ...] = ()
    name: str = field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "dom", _as_ty(self.dom))
        object.__setattr__(self, "cod", _as_ty(self.cod))
        object.__setattr__(self, "params", tuple(sorted(tuple(self.params))))
        if not self.name:
            object.__setattr__(self, "name", self.kind)

    def param(self, key: str, default: Any = ...) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        if default is ...:
            raise KeyError(f"box {self.name} ({self.kind}) has no parameter {key!r}")
        return default

    def __repr__(self) -> str:
        return f"Box({self.kind!r}, {self.dom!r}, {self.cod!r}, {_repr_param(self.params)}, {self.name!r})"

    def diagram(self) -> "Diagram":
        n = len(self.dom)
        return Diagram(self.dom, self.cod, (Eqn(self, tuple(range(n))),), tuple(range(n, n + len(self.cod))))

    def bind(self, sizes: dict) -> "Box":
        return Box(self.kind, self.dom.bind(sizes), self.cod.bind(sizes),
                   tuple((k, _bind_param(v, sizes)) for k, v in self.params), self.name)


def _repr_param(value) -> str:
    """``repr`` that ``eval`` reads back: ``repr(-inf)`` is ``-inf``, a name nobody defines
    (a ``const`` of ``-inf`` is the initial state of a running max)."""
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_repr_param, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def _derived_sizes(d: "Diagram") -> dict:
    """Sizes of still symbolic axes that box parameters derive from bound ones (a parameter
    with ``derived_sizes()``: a convolution's output length, :mod:`napkin_cat.ops.sizes`); a
    bound size that disagrees is refused, naming the size the parameter gives."""
    have = {a.name: a for a in d.axes}
    out = {}
    for e in d.eqns:
        for _, v in e.box.params:
            derive = getattr(v, "derived_sizes", None)
            for name, n in (derive() if derive is not None else {}).items():
                a = have.get(name)
                if a is not None and a.symbolic:
                    out[name] = n
                elif a is not None and a.size != n:
                    raise TypingError(f"axis {name} has size {a.size}, but {e.box.name} needs {n}: {v.explain()}; "
                                      f"bind {name} to {n} or leave it unbound")
    return out


def _bind_param(value, sizes):
    if isinstance(value, Axis):
        return value.bind(sizes)
    if isinstance(value, tuple):
        return tuple(_bind_param(v, sizes) for v in value)
    if hasattr(value, "bind"):  # parameter values that mention an axis (ops.AxisPower)
        return value.bind(sizes)
    return value


@dataclass(frozen=True, slots=True)
class Eqn:
    """``box`` applied to variables ``ins``; its outputs are the next ``len(box.cod)`` ids."""

    box: Box
    ins: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Eqn({self.box!r}, {self.ins!r})"


# --------------------------------------------------------------------------- diagrams

@dataclass(frozen=True, slots=True)
class Diagram:
    """A morphism ``dom -> cod``.  Build with the library, boxes, ``>>``, ``@`` and
    ``weave``; relabel with ``tile``/``stream``/``place``/``require``/``order``."""

    dom: Ty
    cod: Ty
    eqns: tuple[Eqn, ...] = ()
    outs: tuple[int, ...] = ()
    schedule: tuple[Relabel, ...] = ()
    # analyses of this (immutable) diagram, computed once: variable types, equation output
    # offsets, and what later stages memoise through :meth:`memo` (the final form, fusions)
    _types: tuple = field(default=(), init=False, repr=False, compare=False)
    _starts: tuple = field(default=(), init=False, repr=False, compare=False)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "dom", _as_ty(self.dom))
        object.__setattr__(self, "cod", _as_ty(self.cod))
        object.__setattr__(self, "eqns", tuple(self.eqns))
        object.__setattr__(self, "outs", tuple(self.outs))
        object.__setattr__(self, "schedule", tuple(self.schedule))
        types = self._check_types()
        object.__setattr__(self, "_types", types)
        starts, n = [], len(self.dom)
        for e in self.eqns:
            starts.append(n)
            n += len(e.box.cod)
        object.__setattr__(self, "_starts", tuple(starts))
        if len(self.outs) != len(self.cod):
            raise TypingError(f"diagram has {len(self.outs)} outputs but cod has {len(self.cod)} arrays")
        for i, (v, a) in enumerate(zip(self.outs, self.cod)):
            if not 0 <= v < len(types) or types[v] != a:
                raise TypingError(f"output {i} of the diagram is {types[v] if 0 <= v < len(types) else v}"
                                  f" but cod says {a}")

    # ---- variables
    def var_types(self) -> tuple[Array, ...]:
        """The type of every variable: inputs, then each equation's outputs in order."""
        return self._types

    def memo(self, key, compute):
        """``compute()``, once per diagram and ``key`` (diagrams are immutable)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute()
            return value

    def _check_types(self) -> tuple[Array, ...]:
        types = list(self.dom)
        for k, e in enumerate(self.eqns):
            for pos, v in enumerate(e.ins):
                if not 0 <= v < len(types):
                    raise TypingError(f"equation {k} ({e.box.name}) reads undefined variable {v}")
                if types[v] != e.box.dom[pos]:
                    raise TypingError(f"equation {k} ({e.box.name}) input {pos}: wire carries "
                                      f"{types[v]}, box expects {e.box.dom[pos]}")
            if len(e.ins) != len(e.box.dom):
                raise TypingError(f"equation {k} ({e.box.name}) takes {len(e.box.dom)} inputs, got {len(e.ins)}")
            types.extend(e.box.cod)
        return tuple(types)

    def var_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.var_types())

    def eqn_outputs(self, k: int) -> tuple[int, ...]:
        start = self._starts[k]
        return tuple(range(start, start + len(self.eqns[k].box.cod)))

    def boxes(self) -> tuple[Box, ...]:
        return tuple(e.box for e in self.eqns)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Every axis on any wire, in order of first appearance."""
        seen: dict[str, Axis] = {}
        for a in self.var_types():
            for ax in a.axes:
                seen.setdefault(ax.name, ax)
        return tuple(seen.values())

    def axis(self, name: str | Axis) -> Axis:
        key = name.name if isinstance(name, Axis) else name
        for ax in self.axes:
            if ax.name == key:
                return ax
        raise TypingError(f"no axis named {key!r} in {self.short()}; axes are {[a.name for a in self.axes]}")

    # ---- constructors
    @staticmethod
    def id(ty) -> "Diagram":
        ty = _as_ty(ty)
        return Diagram(ty, ty, (), tuple(range(len(ty))))

    @staticmethod
    def permute(ty, perm: Sequence[int]) -> "Diagram":
        """Output ``i`` is input ``perm[i]``; ``perm`` may repeat (copy) or omit (discard)."""
        ty = _as_ty(ty)
        for p in perm:
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypingError(f"permutation indices must be ints, got {p!r}")
            if not 0 <= p < len(ty):
                raise TypingError(f"permutation index {p} out of range for {ty}")
        return Diagram(ty, Ty(*(ty[p] for p in perm)), (), tuple(perm))

    @staticmethod
    def swap(left, right) -> "Diagram":
        left, right = _as_ty(left), _as_ty(right)
        n, m = len(left), len(right)
        return Diagram.permute(left @ right, [*range(n, n + m), *range(n)])

    @staticmethod
    def copy(arr: Array, n: int = 2) -> "Diagram":
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TypingError(f"copy of {arr}: number of copies must be an int >= 0, got {n!r}")
        return Diagram.permute(Ty(arr), [0] * n)

    @staticmethod
    def discard(ty) -> "Diagram":
        return Diagram.permute(ty, [])

    # ---- composition, defined once
    def then(self, other: "Diagram") -> "Diagram":
        _check_diagram(other, ">>", self)
        _check_unscheduled(self, other, ">>")
        if self.cod != other.dom:
            raise TypingError(errors.compose_mismatch(self, other))
        var_map = list(self.outs)
        nvars = len(self.var_types())
        eqns = list(self.eqns)
        for e in other.eqns:
            eqns.append(Eqn(e.box, tuple(var_map[v] for v in e.ins)))
            var_map.extend(range(nvars, nvars + len(e.box.cod)))
            nvars += len(e.box.cod)
        return Diagram(self.dom, other.cod, tuple(eqns), tuple(var_map[v] for v in other.outs))

    def tensor(self, other: "Diagram") -> "Diagram":
        _check_diagram(other, "@", self)
        _check_unscheduled(self, other, "@")
        n, m = len(self.dom), len(other.dom)
        total = n + m
        eqns: list[Eqn] = []
        # self's variables: inputs stay, its equation outputs move up by m
        map_f = list(range(n))
        for e in self.eqns:
            eqns.append(Eqn(e.box, tuple(map_f[v] for v in e.ins)))
            map_f.extend(range(total, total + len(e.box.cod)))
            total += len(e.box.cod)
        map_g = list(range(n, n + m))
        for e in other.eqns:
            eqns.append(Eqn(e.box, tuple(map_g[v] for v in e.ins)))
            map_g.extend(range(total, total + len(e.box.cod)))
            total += len(e.box.cod)
        return Diagram(self.dom @ other.dom, self.cod @ other.cod, tuple(eqns),
                       tuple(map_f[v] for v in self.outs) + tuple(map_g[v] for v in other.outs))

    __rshift__ = then
    __matmul__ = tensor

    def __rrshift__(self, other):  # ``3 >> d``: the left operand is not a diagram
        _check_diagram(other, ">>", self, left=True)

    def __rmatmul__(self, other):
        _check_diagram(other, "@", self, left=True)

    # ---- weaving
    def weave(self, axis: Axis, inputs: Sequence[int] | None = None) -> "Diagram":
        """Broadcast over ``axis``: ``out[j] = self(in[j])`` for every index ``j`` (= vmap).

        ``inputs`` lists the inputs mapped over ``axis`` (default: all); the others are shared
        by every ``j`` (inner broadcasting).  The new axis goes first on every array it
        reaches; an axis already present is refused.  Weave before relabelling.

        >>> import napkin_cat as nc
        >>> print(nc.library.matmul().weave(nc.Axis("h", 8), inputs=[0]))
        A[h=8 a b] f32, B[b c] f32 -> C[h=8 a c] f32
        """
        weave_box = registry.verb("weave_box")  # box kinds (ops) own their weaving rule

        if not isinstance(axis, Axis):
            raise TypingError(f"weave needs an Axis, got {axis!r}")
        if self.schedule:
            raise RelabelError("weave before relabelling: this diagram already carries " + self._sched_str())
        if inputs is not None and (isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__")):
            raise TypingError(f"weave over {axis.name}: inputs must be a sequence of input indices, got {inputs!r}")
        mapped = tuple(range(len(self.dom))) if inputs is None else tuple(inputs)
        if len(set(mapped)) != len(mapped):
            raise TypingError(f"weave over {axis.name}: input indices {list(mapped)} repeat an index")
        for i in mapped:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypingError(f"weave over {axis.name}: input indices must be ints, got {i!r}")
            if not 0 <= i < len(self.dom):
                raise TypingError(f"weave over {axis.name}: input index {i} out of range (dom has {len(self.dom)})")
        for a in self.var_types():
            if a.has(axis):
                raise TypingError(f"cannot weave over {axis.describe()}: wire {a} already has an axis "
                                  f"named {axis.name}")
        types = [a.with_axes((axis, *a.axes)) if i in mapped else a for i, a in enumerate(self.dom)]
        eqns = []
        for e in self.eqns:
            has = tuple(types[v].has(axis) for v in e.ins)
            box = weave_box(e.box, axis, has) if any(has) else e.box
            eqns.append(Eqn(box, e.ins))
            types.extend(box.cod)
        return Diagram(Ty(*types[: len(self.dom)]), Ty(*(types[v] for v in self.outs)), tuple(eqns), self.outs)

    # ---- sizes
    def bind(self, sizes: dict) -> "Diagram":
        """Substitute sizes: keys are Axis values, axis names, or the names of symbolic tile and
        stream sizes (``"g_q"``); a key the diagram does not have is an error.

        >>> import napkin_cat as nc
        >>> print(nc.library.matmul().bind({"a": 4, "b": 8, "c": 2}))
        A[a=4 b=8] f32, B[b=8 c=2] f32 -> C[a=4 c=2] f32
        """
        check_size_keys(self, sizes, "bind")
        d = Diagram(self.dom.bind(sizes), self.cod.bind(sizes),
                    tuple(Eqn(e.box.bind(sizes), e.ins) for e in self.eqns), self.outs,
                    tuple(_bind_relabel(r, sizes) for r in self.schedule))
        derived = _derived_sizes(d)
        return d.bind(derived) if derived else d

    def rename(self, *names: str, inputs: bool = False) -> "Diagram":
        """Relabel the output (or input) wires' names; types are unchanged."""
        ty = self.dom if inputs else self.cod
        for n in names:
            if not isinstance(n, str) or not n:
                raise TypingError(f"rename: wire names must be non-empty strings, got {n!r}")
        if len(names) != len(ty):
            raise TypingError(f"rename: {len(names)} names for {len(ty)} arrays")
        new = Ty(*(a.named(n) for a, n in zip(ty, names)))
        if inputs:
            return Diagram(new, self.cod, self.eqns, self.outs, self.schedule)
        return Diagram(self.dom, new, self.eqns, self.outs, self.schedule)

    # ---- relabelings (the relabel stage registers them; methods for the fluent API)
    def tile(self, axis, size, level: str | None = None, partial: str | None = None,
             order: str | None = None) -> "Diagram":
        """Tile ``axis`` across cores: groups of ``size`` indices, one per block of the grid,
        their arrays held at ``level`` (default ``"SMEM"``).

        ``axis``: an :class:`Axis` or its name; ``size``: an int, or a name for a symbolic tile
        size (``"g_q"``) that :func:`napkin_cat.cost` keeps as a symbol.  Returns a new diagram
        (this one is unchanged); an axis that cannot be tiled raises
        :class:`~napkin_cat.core.errors.RelabelError` with the reason.  ``partial="sum"`` tiles
        an axis the diagram sums over: each block adds its partial sum into the outputs
        (split-K; :mod:`napkin_cat.relabel.split`).  ``order="zigzag"`` lays out a split over
        the devices zig-zag (:mod:`napkin_cat.relabel.devices`).

        >>> import napkin_cat as nc
        >>> print(nc.library.attention().tile("q", "g_q"))
        Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32  | tile(q, g_q)
        """
        return registry.verb('tile')(self, axis, size, level, partial, order)

    def stream(self, axis, size, level: str | None = None, order: str | None = None) -> "Diagram":
        """Stream ``axis`` through fast memory: a loop over chunks of ``size`` staged at ``level``
        (default ``"SMEM"``).

        A softmax (or streamable normalisation) followed by a contraction over ``axis`` is first
        fused into an accumulator (online softmax); anything else that needs the whole axis is
        refused with a :class:`~napkin_cat.core.errors.RelabelError` naming the reason.  ``size``
        is an int or a symbol name (``"s_x"``); ``order="zigzag"`` lays out a split over the
        devices zig-zag (:mod:`napkin_cat.relabel.devices`).  Returns a new diagram.

        >>> import napkin_cat as nc
        >>> print(nc.library.attention().stream("x", 64))
        Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32  | stream(x, 64)
        """
        return registry.verb('stream')(self, axis, size, level, order)

    def place(self, array: str, level: str) -> "Diagram":
        """Keep the wire(s) named ``array`` at memory ``level`` (``"SMEM"``, ``"registers"``,
        ...; :mod:`napkin_cat.core.hierarchy`).  Returns a new diagram; an unknown wire name
        is a :class:`~napkin_cat.core.errors.RelabelError` listing the names."""
        return registry.verb('place')(self, array, level)

    def require(self, axis, multiple_of: int) -> "Diagram":
        """Require the tile and stream sizes of ``axis`` to be multiples of ``multiple_of`` (the
        least common multiple of every requirement on ``axis``); :meth:`Cost.optimize` and
        ``lower`` respect it.  Returns a new diagram."""
        return registry.verb('require')(self, axis, multiple_of)

    def order(self, *axes_) -> "Diagram":
        """Nest the stream loops over ``axes_`` in this order, outer first (each must be
        streamed); loops not named keep their order.  Returns a new diagram."""
        return registry.verb('order')(self, *axes_)

    def loop_nest(self):
        """The final form of this relabelled diagram: the loop nest (grid, stream loops, loads,
        stores, accumulator init / update / finalise) that evaluation, cost and lowering read.
        Computed once per diagram; ``.pseudocode()`` prints it.

        >>> import napkin_cat as nc
        >>> print(nc.library.matmul().tile("a", 64).loop_nest().pseudocode(memory=False).splitlines()[0])
        for a in tiles of 64  (grid, SMEM)
        """
        return registry.verb("loop_nest")(self)

    def unrelabelled(self) -> "Diagram":
        return Diagram(self.dom, self.cod, self.eqns, self.outs)

    # ---- drawing
    def draw(self, path: str | None = None, **kwargs):
        """Draw this diagram as a Neural Circuit Diagram and return the matplotlib figure.

        ``path`` saves it in the format its extension names (``.svg``, ``.png``, ``.pdf``);
        keyword arguments (``levels``, ``title``, ``ax``, ``weaved``) are those of
        :func:`napkin_cat.drawing.draw`.  matplotlib is imported on the first drawing.
        Example: ``nc.library.attention().draw("attention.svg")``."""
        return registry.verb("draw")(self, path, **kwargs)

    def _repr_svg_(self) -> str:
        return registry.verb("to_svg")(self)

    # ---- printing
    @property
    def params(self) -> Ty:
        """The parameters: arrays of boxes without inputs that name a value bound at evaluation
        (``Builder.param``; ``params={name: array}`` to ``nc.evaluate``), in equation order.
        They belong to the signature as the inputs do: ``str(d)`` lists them after the inputs."""
        return Ty(*(e.box.cod[0] for e in self.eqns
                    if not e.box.dom and e.box.param("pname", None) is not None))

    def short(self) -> str:
        """``[inputs; params ... -> outputs]``: the signature, for messages."""
        params = self.params
        extra = f"; params {errors.describe_ty(params)}" if len(params) else ""
        return f"[{errors.describe_ty(self.dom)}{extra} -> {errors.describe_ty(self.cod)}]"

    def _sched_str(self) -> str:
        return ", ".join(_relabel_str(r) for r in self.schedule)

    def __str__(self) -> str:
        s = self.short()[1:-1]
        if self.schedule:
            s += "  | " + self._sched_str()
        return s

    def __repr__(self) -> str:
        return (f"Diagram({self.dom!r}, {self.cod!r}, {self.eqns!r}, {self.outs!r}"
                + (f", {self.schedule!r})" if self.schedule else ")"))

    def listing(self) -> str:
        """One line per equation: ``S[q x] = contract(Q, K)``."""
        names = [f"{a.name}#{i}" for i, a in enumerate(self.var_types())]
        lines = [f"in  {', '.join(f'{names[i]}: {a}' for i, a in enumerate(self.dom))}"]
        for k, e in enumerate(self.eqns):
            outs = self.eqn_outputs(k)
            lines.append(f"    {', '.join(names[o] for o in outs)} = {e.box.name}"
                         f"({', '.join(names[v] for v in e.ins)})")
        lines.append(f"out {', '.join(names[v] for v in self.outs)}")
        return "\n".join(lines)


def _relabel_str(r: Relabel, levels: bool = False) -> str:
    """``stream(x, s_x)``, ``place(O, SMEM)``, ``require(x, 4)``, ``order(x, c)``; ``levels``:
    with the level of a tile or stream that is not SMEM (``tile(q, 32, L2)``)."""
    if r.op == "place":
        args = [str(r.axis or (r.extra[0] if r.extra else "?")), str(r.level)]
    elif r.op == "order":
        args = [str(a) for a in r.extra]
    else:
        args = [r.axis] + ([str(r.size)] if r.size is not None else [])
        if levels and r.op in ("tile", "stream") and r.level and r.level != "SMEM" and r.size != DEVICES:
            args.append(str(r.level))
        if r.size == DEVICES and r.extra:   # tile(q, devices, order=zigzag): the blocks' layout
            args.append(f"order={r.extra[0]}")
        elif r.op == "tile" and r.extra:   # tile(b, 16, partial=sum): partial sums across blocks
            args.append(f"partial={r.extra[0]}")
    return f"{r.op}({', '.join(args)})"


def _check_diagram(other, op: str, d: "Diagram", left: bool = False) -> None:
    if not isinstance(other, Diagram):
        sides = f"{type(other).__name__} {op} {d.short()}" if left else f"{d.short()} {op} {type(other).__name__}"
        raise TypingError(f"'{op}' composes diagrams, got {sides} ({other!r})")


def check_size_keys(d: "Diagram", sizes, what: str) -> None:
    """``sizes`` is a mapping whose keys name something in ``d``: an axis (Axis value or name),
    a symbolic size, or a tile/stream size symbol of its relabelings.  Anything else would be
    ignored, so it is refused."""
    if sizes is None:
        return
    if not hasattr(sizes, "items"):
        raise TypingError(f"{what}: sizes must be a dict {{axis or symbol: int}}, got {sizes!r}")
    axes_ = {a.name: a for a in d.axes}
    known = set(axes_) | {a.size for a in axes_.values() if a.symbolic}
    known |= {r.size for r in d.schedule if isinstance(r.size, str)}
    for key in sizes:
        if isinstance(key, Axis):
            if key.name not in axes_:
                raise TypingError(f"{what}: sizes names axis {key.name!r}, which is not in {d.short()}; "
                                  f"its axes are {sorted(axes_)}")
            mine = axes_[key.name]
            if key.size != mine.size and not mine.symbolic and not key.symbolic:
                raise TypingError(f"{what}: sizes key {key.describe()} does not match axis {mine.describe()}")
        elif isinstance(key, str):
            if key not in known:
                raise TypingError(f"{what}: sizes names {key!r}, which is no axis, symbolic size or "
                                  f"block size of {d.short()}; known: {sorted(known)}")
        else:
            raise TypingError(f"{what}: sizes keys must be Axis values or names, got {key!r}")


def _bind_relabel(r: Relabel, sizes: dict) -> Relabel:
    size = r.size
    if size == DEVICES:   # a split over the devices: the count is bound where the devices run
        return r
    if isinstance(size, str) and size in sizes:
        size = _int_size(size, sizes[size])
    return replace(r, size=size)


def _check_unscheduled(f: Diagram, g: Diagram, op: str) -> None:
    for d in (f, g):
        if d.schedule:
            raise RelabelError(f"compose before relabelling: {d.short()} carries {d._sched_str()}; "
                               f"'{op}' is defined on unrelabelled diagrams")
