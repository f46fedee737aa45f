"""Axes, dtypes, array types, boxes, equations and relabelings: the values a diagram is made of.

No NumPy, no sympy: sizes are ints or symbol *names* (str).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from . import errors
from .errors import TypingError

Size = int | str


# --------------------------------------------------------------------------- axes and dtypes

@dataclass(frozen=True, slots=True)
class Axis:
    """A named axis.  ``size`` is a positive int, or a str naming a symbolic size."""

    name: str
    size: Size = None  # type: ignore[assignment]

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise TypingError(f"axis name must be an identifier, got {self.name!r}")
        if self.size is None:
            object.__setattr__(self, "size", self.name)
        if isinstance(self.size, bool) or not isinstance(self.size, (int, str)):
            raise TypingError(f"axis {self.name}: size must be an int or a symbol name, got {self.size!r}")
        if isinstance(self.size, int) and self.size < 1:
            raise TypingError(f"axis {self.name}: size must be >= 1, got {self.size}")
        if isinstance(self.size, str) and not self.size.isidentifier():
            raise TypingError(f"axis {self.name}: a symbolic size must be an identifier, got {self.size!r}")

    @property
    def symbolic(self) -> bool:
        return isinstance(self.size, str)

    def describe(self) -> str:
        return self.name if self.symbolic and self.size == self.name else f"{self.name}={self.size}"

    def bind(self, sizes: dict) -> "Axis":
        for key in (self, self.name) + ((self.size,) if self.symbolic else ()):
            if key in sizes:
                n = _int_size(self.name, sizes[key])
                if not self.symbolic and n != self.size:
                    raise TypingError(f"axis {self.name} has size {self.size}; cannot bind it to {n} "
                                      f"(only symbolic sizes are bound)")
                return self if n == self.size else Axis(self.name, n)
        return self

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, {self.size!r})"


def _int_size(name: str, value) -> Size:
    if isinstance(value, str):
        if not value.isidentifier():
            raise TypingError(f"axis {name}: a symbolic size must be an identifier, got {value!r}")
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypingError(f"axis {name}: size must be a positive integer, got {value!r}")
    value = int(value)
    if value < 1:
        raise TypingError(f"axis {name}: size must be >= 1, got {value}")
    return value


def axes(names: str, **sizes: int) -> tuple[Axis, ...]:
    """``q, x, d = axes("q x d")``: symbolic axes; ``axes("q d", q=48)`` fixes some sizes."""
    if not isinstance(names, str):
        raise TypingError(f"axes needs a string of axis names, got {names!r}")
    split = names.replace(",", " ").split()
    if not split:
        raise TypingError(f"axes({names!r}): no axis names given")
    dup = sorted({n for n in split if split.count(n) > 1})
    if dup:
        raise TypingError(f"axes({names!r}): axis name(s) {dup} given more than once")
    extra = sorted(set(sizes) - set(split))
    if extra:
        raise TypingError(f"axes({names!r}): sizes given for {extra}, which are not among the names {split}")
    out = tuple(Axis(n, sizes.get(n, n)) for n in split)
    if len(out) == 1:
        return out  # still a tuple: ``q, = axes("q")``
    return out


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    bytes: int
    kind: str = "float"

    def __repr__(self) -> str:
        return self.name


f32 = DType("f32", 4)
f16 = DType("f16", 2)
bf16 = DType("bf16", 2)
fp8_e4m3 = DType("fp8_e4m3", 1)
fp8_e5m2 = DType("fp8_e5m2", 1)
i8 = DType("i8", 1, "int")
f64 = DType("f64", 8)
DTYPES = {d.name: d for d in (f32, f16, bf16, fp8_e4m3, fp8_e5m2, i8, f64)}


# --------------------------------------------------------------------------- array types

@dataclass(frozen=True, slots=True)
class Array:
    """An array type: ordered named axes and a dtype.  ``name`` labels the wire only."""

    axes: tuple[Axis, ...]
    dtype: DType = f32
    name: str = field(default="_", compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypingError(f"array name must be a str, got {self.name!r}")
        if isinstance(self.axes, (str, Axis)) or not hasattr(self.axes, "__iter__"):
            raise TypingError(f"array {self.name}: axes must be a sequence of Axis values, got {self.axes!r}")
        object.__setattr__(self, "axes", tuple(self.axes))
        for a in self.axes:
            if not isinstance(a, Axis):
                raise TypingError(f"array {self.name}: axes must be Axis values, got {a!r}")
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise TypingError(f"array {self.name}: repeated axis in {names}")
        if not isinstance(self.dtype, DType):
            raise TypingError(f"array {self.name}: dtype must be a napkin_cat DType (e.g. nc.f16), got "
                              f"{self.dtype!r}; known: {sorted(DTYPES)}")

    def __repr__(self) -> str:
        return f"Array({self.axes!r}, {self.dtype!r}, {self.name!r})"

    def __str__(self) -> str:
        return errors.describe_array(self)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def has(self, axis: Axis | str) -> bool:
        name = axis if isinstance(axis, str) else axis.name
        return name in self.axis_names

    def named(self, name: str) -> "Array":
        return Array(self.axes, self.dtype, name)

    def with_axes(self, new_axes: Iterable[Axis]) -> "Array":
        return Array(tuple(new_axes), self.dtype, self.name)

    def with_dtype(self, dtype: DType) -> "Array":
        return Array(self.axes, dtype, self.name)

    def bind(self, sizes: dict) -> "Array":
        return Array(tuple(a.bind(sizes) for a in self.axes), self.dtype, self.name)


@dataclass(frozen=True, slots=True)
class Ty:
    """A tuple of arrays: the objects of the category.  ``@`` concatenates."""

    arrays: tuple[Array, ...] = ()

    def __init__(self, *arrays: Array):
        flat: list[Array] = []
        for a in arrays:
            if not isinstance(a, (Ty, Array)):
                raise TypingError(f"Ty takes Array values, got {a!r}")
            flat.extend(a.arrays if isinstance(a, Ty) else (a,))
        object.__setattr__(self, "arrays", tuple(flat))

    def __iter__(self) -> Iterator[Array]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i):
        return Ty(*self.arrays[i]) if isinstance(i, slice) else self.arrays[i]

    def __matmul__(self, other: "Ty") -> "Ty":
        return Ty(*self.arrays, *other.arrays)

    def __repr__(self) -> str:
        return f"Ty({', '.join(map(repr, self.arrays))})"

    def __str__(self) -> str:
        return errors.describe_ty(self)

    def bind(self, sizes: dict) -> "Ty":
        return Ty(*(a.bind(sizes) for a in self.arrays))


def _as_ty(x) -> Ty:
    if isinstance(x, Ty):
        return x
    if isinstance(x, Array):
        return Ty(x)
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise TypingError(f"expected a Ty, an Array or a sequence of Arrays, got {x!r}")
    return Ty(*x)


# --------------------------------------------------------------------------- relabelings

@dataclass(frozen=True, slots=True)
class Relabel:
    """One relabeling recorded on a diagram: ``tile``, ``stream``, ``place``, ``require``,
    ``order``.  The meaning lives in :mod:`napkin_cat.relabel`; the core only stores them."""

    op: str
    axis: str = ""
    size: Size | None = None
    level: str = ""
    extra: tuple = ()

    def __repr__(self) -> str:
        return f"Relabel({self.op!r}, {self.axis!r}, {self.size!r}, {self.level!r}, {self.extra!r})"


