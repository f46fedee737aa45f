"""Records and results of the cost model, argument checks, and the algebra of closed forms.

``Move`` (a transfer site), ``Op`` (a node's work) and ``Resident`` (a live buffer) are what
:func:`napkin_cat.costmodel.cost` reads off a final form; ``ClosedForm``, ``Optimum``,
``Occupancy``, ``Timing`` and ``MultiLevel`` are what :class:`napkin_cat.costmodel.Cost`
returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping

import sympy as sp

from ..core.diagram import DTYPES, DType
from ..core.errors import CostError
from ..core.hardware import PROFILES, FrozenDict, Hardware
from ..core.hierarchy import FULL

ZERO = sp.Integer(0)


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Move:
    """One transfer site: ``per_exec`` values of ``array`` between ``upper`` and ``lower``,
    executed ``execs`` times (``ragged_execs`` rounds repeats up for ragged last tiles)."""

    kind: str            # load, store, read, write
    array: str
    dtype: DType
    upper: str
    lower: str
    per_exec: sp.Expr
    execs: sp.Expr
    ragged_execs: sp.Expr
    loops: tuple[str, ...]

    @property
    def values(self) -> sp.Expr:
        return self.per_exec * self.execs


@dataclass(frozen=True)
class Op:
    """``per_exec`` operations on ``unit`` at one node, executed ``execs`` times."""

    unit: str
    per_exec: sp.Expr
    execs: sp.Expr
    what: str
    node: str
    precision: tuple[tuple[str, DType], ...]
    loops: tuple[str, ...]

    @property
    def total(self) -> sp.Expr:
        return self.per_exec * self.execs


@dataclass(frozen=True)
class Resident:
    """A buffer live at one program point; ``stat`` marks an accumulator's statistic (row max,
    row sum), which stays f32 whatever dtype the arrays are given, ``state`` any state of an
    accumulator."""

    level: str
    size: sp.Expr
    array: str
    dtype: DType
    stat: bool = False
    state: bool = False      # an accumulator's state (a kernel holds it in registers)


def resolve_dtype(name: str, dtype: DType, dtypes, stat: bool = False) -> DType:
    """Wire dtype, or an override: one DType for every array (statistics stay f32), or a
    mapping ``array name -> DType``."""
    if dtypes is None:
        return dtype
    if isinstance(dtypes, DType):
        return dtype if stat else dtypes
    got = dtypes.get(name)
    return got if got is not None else dtype


def frozen(d) -> FrozenDict:
    return FrozenDict(d)


def check_level(level, what: str) -> str:
    if not isinstance(level, str) or level not in FULL.names:
        raise CostError(f"{what}: unknown memory level {level!r}; levels are {list(FULL.names)}")
    return level


def check_hw(hw, what: str):
    if not isinstance(hw, Hardware):
        hint = f" (use nc.hardware.{hw})" if isinstance(hw, str) and hw in PROFILES else ""
        raise CostError(f"{what}: hw must be a hardware profile such as nc.hardware.H100, got {hw!r}{hint}; "
                        f"profiles: {sorted(PROFILES)}")
    return hw


def check_dtypes(dtypes, what: str):
    """None (wire dtypes), one DType, or a mapping ``array name -> DType``."""
    if dtypes is None or isinstance(dtypes, DType):
        return dtypes
    if hasattr(dtypes, "items") and all(isinstance(k, str) and isinstance(v, DType) for k, v in dtypes.items()):
        return dtypes
    raise CostError(f"{what}: dtype must be a napkin_cat DType (e.g. nc.f16) or {{array name: DType}}, got "
                    f"{dtypes!r}; known: {sorted(DTYPES)}")


def positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 1:
        raise CostError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def number(e) -> int | Fraction | float:
    """An exact sympy number as int / Fraction (float only for irrational values)."""
    e = sp.nsimplify(e) if isinstance(e, float) else sp.sympify(e)
    if e.free_symbols:
        raise CostError(f"expression still has free symbols {sorted(map(str, e.free_symbols))}: {e}")
    if e.is_Integer:
        return int(e)
    if e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    return float(e)


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class ClosedForm:
    """``H*(M) = sum_t alpha_t M^(-beta_t)``; unpacks as ``alphas, betas``."""

    alphas: tuple[sp.Expr, ...]
    betas: tuple[sp.Expr, ...]
    expr: sp.Expr
    M: sp.Symbol
    tiles: Mapping[str, sp.Expr]

    def __iter__(self):
        yield self.alphas
        yield self.betas

    def at(self, M, subs: Mapping | None = None) -> sp.Expr:
        e = self.expr.subs(dict(subs or {}))
        return sp.nsimplify(e.subs(self.M, sp.nsimplify(M)))

    def __str__(self) -> str:
        return f"H*({self.M}) = {self.expr}"


@dataclass(frozen=True)
class Optimum:
    """Integer tile/stream sizes minimising the transfers into ``level`` under its capacity.

    ``gap`` is ``objective / bound`` (the closed form ``H*(M)``).  With ``usable`` the sizes are
    ones a kernel can use (``rule``; :mod:`napkin_cat.costmodel.usable`): ``unconstrained`` is the
    optimum over every integer and ``usable_gap`` what the usable choice costs against it
    (``objective / unconstrained.objective``, at least 1).  ``registers`` and
    ``register_capacity`` (values per thread and per SM, with a hardware profile) and
    ``capacities`` (per level, in ``unit``) are the capacities the search checked."""

    tiles: Mapping[str, int]
    transfers: Mapping[str, int | Fraction]
    transfers_ragged: Mapping[str, int]
    bytes: Mapping[str, int | Fraction]
    memory: Mapping[str, int]
    memory_bytes: Mapping[str, int]
    flops: Mapping[str, int | Fraction]
    objective: int | Fraction          # transfers into ``level`` (in ``unit``)
    bound: int | Fraction | float | None
    gap: float | None
    level: str
    capacity: int
    unit: str                          # "values" or "bytes"
    exhaustive: bool
    usable: bool = False
    rule: str = ""
    capacities: Mapping[str, int] | None = None
    registers: Mapping[str, int] | None = None
    register_capacity: Mapping[str, int] | None = None
    threads: int | None = None
    unconstrained: "Optimum | None" = None
    usable_gap: float | None = None

    def __str__(self) -> str:
        tiles = ", ".join(f"{k}={v}" for k, v in self.tiles.items())
        gap = f", gap {self.gap:.4f}" if self.gap is not None else ""
        text = (f"optimum at {self.level} (capacity {self.capacity} {self.unit}): {tiles}; "
                f"transfers {dict(self.transfers)}, bound {self.bound}{gap}")
        if self.unconstrained is not None:
            free = ", ".join(f"{k}={v}" for k, v in self.unconstrained.tiles.items())
            text += (f"\n  usable tiles ({self.rule}); unconstrained optimum {free}, "
                     f"usable/unconstrained {self.usable_gap:.4f}")
        if self.registers is not None:
            text += (f"\n  registers {dict(self.registers)} of {dict(self.register_capacity)} "
                     f"({self.threads} threads)")
        return text

    def __repr__(self) -> str:
        return f"<{self}>"

    def _repr_html_(self) -> str:
        from .display import optimum_html
        return optimum_html(self)


@dataclass(frozen=True)
class Occupancy:
    """Concurrent groups per SM: ``(M_max - stages * M_block) / M_group``."""

    level: str
    capacity: int
    block: int
    group: int
    stages: int
    ratio: Fraction

    @property
    def groups(self) -> int:
        return math.floor(self.ratio)


@dataclass(frozen=True)
class Timing:
    """Roofline prediction: the slowest of compute (per unit) and each level's transfers."""

    seconds: float
    compute: Mapping[str, float]
    memory: Mapping[str, float]
    bound_by: str
    tiles: Mapping[str, int]
    groups: int
    occupancy: int
    flops: int
    hardware: str

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.seconds if self.seconds else float("inf")

    def __str__(self) -> str:
        return (f"{self.hardware}: {self.seconds * 1e6:.3f} us, bound by {self.bound_by} "
                f"({self.flops_per_second / 1e12:.1f} TFLOP/s); tiles {dict(self.tiles)}")


@dataclass(frozen=True)
class MultiLevel:
    """``H* = sum_l (1/bw_l) H*(sizes, M_l)`` in seconds, per level and in total."""

    levels: Mapping[str, Mapping[str, object]]
    seconds: float
    closed_seconds: float | None


# --------------------------------------------------------------------------- the cost object


def uniform_bytes(c, level: str, dtypes) -> int | None:
    """Bytes per value when every array a cost ``c`` moves into or holds at ``level`` has the same
    size (None otherwise)."""
    seen = {resolve_dtype(m.array, m.dtype, dtypes).bytes for m in c.moves if m.lower == level}
    for col in c.columns:
        seen |= {resolve_dtype(r.array, r.dtype, dtypes, stat=r.stat).bytes
                 for r in col if r.level == level}
    return seen.pop() if len(seen) == 1 else None


# --------------------------------------------------------------------------- algebra of closed forms

def dtype_key(dtypes):
    if dtypes is None or isinstance(dtypes, DType):
        return dtypes
    return tuple(sorted((k, v.name) for k, v in dtypes.items()))


def dtype_name(dtype) -> str:
    if dtype is None:
        return "wire dtypes"
    if isinstance(dtype, DType):
        return dtype.name
    return "{" + ", ".join(f"{k}: {v.name}" for k, v in dtype.items()) + "}"


def _posynomial(e) -> bool:
    return all(t.as_coeff_Mul()[0] >= 0 for t in sp.Add.make_args(sp.expand(e)))


def dominant(e, level: str):
    """Resolve ``Max(...)`` of memory columns: the argument that dominates every other
    coefficient-wise (sizes are positive)."""
    if not isinstance(e, sp.Max):
        return e
    for a in e.args:
        if all(_posynomial(a - b) for b in e.args if b is not a):
            return a
    raise CostError(f"the peak memory at {level} has no dominant column: {e}")


def leading(mem, var):
    """The terms of highest total degree in ``var``: lower-order terms (a resident array that
    does not grow with the tiles, a bias tile) are small against M, and dropping them only
    relaxes the constraint, so the closed form stays a lower bound."""
    if not var:
        return mem
    terms = sp.Add.make_args(sp.expand(mem))
    deg = lambda t: sum(sp.degree(t, v) for v in var)
    top = max(deg(t) for t in terms)
    return sp.Add(*(t for t in terms if deg(t) == top))


def powers(H, M) -> tuple[tuple, tuple]:
    """Split ``H(M)`` into ``sum_t alpha_t M^(-beta_t)``: write ``M = K^L`` so that every power
    is an integer power of ``K``, take partial fractions in ``K`` and read off the terms."""
    exps = [p.exp for p in H.atoms(sp.Pow) if p.base == M and p.exp.is_Rational]
    L = math.lcm(1, *(int(sp.Rational(e).q) for e in exps))
    K = sp.Dummy("K", positive=True)
    try:
        HK = sp.apart(sp.cancel(sp.together(H.subs(M, K ** L))), K)
    except (sp.PolynomialError, NotImplementedError, ValueError):
        raise CostError(f"H*(M) = {H} is not a sum of alpha_t M^(-beta_t)") from None
    terms = sp.collect(sp.expand(HK), K, evaluate=False)
    alphas, betas = [], []
    for k, coeff in terms.items():
        if K in coeff.free_symbols:
            raise CostError(f"H*(M) = {H} is not a sum of powers of {M}")
        if k == 1:
            p = sp.Integer(0)
        elif k == K:
            p = sp.Integer(1)
        elif k.is_Pow and k.base == K and k.exp.is_Integer:
            p = k.exp
        else:
            raise CostError(f"H*(M) = {H} is not a sum of alpha_t M^(-beta_t): term {k.subs(K, M ** sp.Rational(1, L))}")
        alphas.append(sp.factor(coeff))
        betas.append(-sp.Rational(p, L))
    order = sorted(range(len(betas)), key=lambda i: betas[i])
    return tuple(alphas[i] for i in order), tuple(betas[i] for i in order)


def product(lists):
    out = [()]
    for lst in lists:
        out = [o + (v,) for o in out for v in lst]
    return out


def sparse(cands: list[int]) -> list[int]:
    """Divisors of the bound, powers of two and every candidate up to 256 (a non-exhaustive
    candidate set when the full product is too large to enumerate)."""
    top = cands[-1]
    keep = {v for v in cands if v <= 256 or top % v == 0 or (v & (v - 1)) == 0}
    return sorted(keep)
