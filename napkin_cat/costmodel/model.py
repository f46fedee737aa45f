"""The performance model: transfers, memory and FLOPs read off a relabelled diagram.

``cost(d)`` walks the final form (:meth:`Diagram.loop_nest`) once.  Nothing here knows an
algorithm by name: every number comes from the loop nest's nodes and one rule per box kind.

Transfers (values; :meth:`Cost.bytes` for bytes)
    A ``Load`` moves a buffer from the top level down, a ``Store`` moves it back; each costs its
    extent product times the trip counts of the loops around it (a loop over an axis the array
    has partitions it, a loop over an axis it lacks repeats it).  A node computes one level
    below its home (the level of its innermost loop), so an operand or result living above
    that level is moved too: in an unrelabelled diagram every box reads its operands from HBM
    and writes its results back (intermediates are materialised), inside a tile every operand
    read from shared memory is an ``SMEM`` transfer.  ``transfers[level]`` sums the moves
    between ``level`` and the level below it: ``transfers["HBM"]`` is what crosses HBM.
Memory
    The loop nest's exact live buffers per column; ``memory[level]`` is its peak (values).
FLOPs by unit
    ``tensor`` (contractions, ``2 * prod(all axes)``), ``fma`` (other elementwise work,
    reductions, accumulator merges) and ``exp`` (special-function unit: exp, log, sqrt, rsqrt,
    tanh, sigmoid, ...), from :data:`COST_RULES`, one rule per box kind, keyed exactly like
    :data:`napkin_cat.ops.semantics.NUMPY_RULES`.  A streamed accumulator is costed per chunk
    (its ``update`` phase), so the online softmax's per-chunk rescaling exps are counted.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> c = nc.cost(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"))
>>> c.transfers["HBM"]
2*d*q + 2*d*q*x/g_q
>>> c.memory["SMEM"]
2*d*g_q + 2*d*s_x
>>> alphas, betas = c.closed_form("SMEM")
>>> alphas, betas
((2*d*q, 4*d**2*q*x), (0, 1))
>>> best = c.optimize({q: 8192, x: 8192, d: 128}, memory=65536, fixed={"s_x": 64})
>>> best.tiles
{'s_x': 64, 'g_q': 192}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Callable, Mapping

import sympy as sp

from ..core.diagram import Array, Axis, Box, Diagram, DType, f32
from ..core.errors import CostError, UnknownKindError
from ..core.hardware import FrozenDict
from ..core.hierarchy import Hierarchy, hierarchy as make_hierarchy
from ..relabel.loopnest import Compute, FinalForm, Init, Load, Loop, Store, Update
from ..relabel.rules import requirements
from ..relabel.symbols import size_expr, size_symbol

UNITS = ("tensor", "fma", "exp")
ZERO = sp.Integer(0)


# --------------------------------------------------------------------------- cost rules

@dataclass(frozen=True, slots=True)
class Work:
    """``count`` operations on ``unit``; ``precision`` lists the arrays whose dtype sets the
    rate (the widest wins)."""

    unit: str
    count: sp.Expr
    what: str
    precision: tuple[Array, ...] = ()


# special-function-unit functions; "identity" is free; everything else is one CUDA-core op
SPECIAL = frozenset({"exp", "log", "sqrt", "rsqrt", "recip", "tanh", "sigmoid", "gelu", "silu"})


def _fn_work(fn: str, count, what: str, prec) -> tuple[Work, ...]:
    if fn == "identity":
        return ()
    return (Work("exp" if fn in SPECIAL else "fma", count, what, tuple(prec)),)


def _axes_union(arrays) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for a in arrays:
        for n in a.axis_names:
            seen.setdefault(n, None)
    return tuple(seen)


def _stat_axes(box: Box) -> tuple[str, ...]:
    axis = box.param("axis")
    return tuple(n for n in box.dom[0].axis_names if n != axis)


def rule_contract(box, vol, phase):
    if phase in ("init", "finalise"):
        return ()
    union = _axes_union(box.dom)
    v = vol(union)
    summed = set(union) - set(box.cod[0].axis_names)
    n = len(box.dom)
    if not summed:      # an outer or Hadamard product: no reduction, no tensor-core work
        return (Work("fma", (n - 1) * v, "product", box.dom),) if n > 1 else ()
    if n == 1:
        return (Work("fma", v, "sum", box.dom),)
    # k multiply-adds per output element = 2k FLOPs; n operands: n-1 multiplies and an add
    return (Work("tensor", (2 if n == 2 else n) * v, f"contract {box.cod[0].name}", box.dom),)


def rule_map(box, vol, phase):
    return _fn_work(box.param("fn"), vol(box.cod[0].axis_names), box.param("fn"), box.cod)


def rule_reduce(box, vol, phase):
    op, x, o = box.param("op"), vol(box.dom[0].axis_names), vol(box.cod[0].axis_names)
    out = box.cod
    if op == "logsumexp":
        return {"apply": (Work("fma", 3 * x + o, "max, shift, sum, add max", out),
                          Work("exp", x, "exp", out), Work("exp", o, "log", out)),
                "init": (),
                "update": (Work("fma", 3 * x + 2 * o, "max, shift, sum, merge", out),
                           Work("exp", x + o, "exp and rescale", out)),
                "finalise": (Work("exp", o, "log", out), Work("fma", o, "add max", out))}[phase]
    merge = o if phase == "update" else 0
    tail = o if op == "mean" and phase in ("apply", "finalise") else 0
    if phase == "init":
        return ()
    if phase == "finalise":
        return (Work("fma", tail, "mean divide", out),) if tail else ()
    return (Work("fma", x + merge + tail, op, out),)


def rule_softmax(box, vol, phase):
    x = vol(box.dom[0].axis_names)
    return (Work("exp", x, "exp", box.cod), Work("fma", 4 * x, "max, subtract, sum, divide", box.cod))


def rule_normalize(box, vol, phase):
    x = vol(box.dom[0].axis_names)
    rows = vol(_stat_axes(box))
    return (_fn_work(box.param("a1"), x, "a1", box.cod) + _fn_work(box.param("a2"), x, "a2", box.cod)
            + (Work("fma", x, "sum", box.cod),) + _fn_work(box.param("b"), rows, "b", box.cod)
            + (Work("fma", x, "divide", box.cod),))


def rule_mask(box, vol, phase):
    return (Work("fma", vol(box.cod[0].axis_names), "mask", box.cod),)


def rule_index_bias(box, vol, phase):
    return (Work("fma", 2 * vol(box.cod[0].axis_names), "bias and add", box.cod),)


def rule_free(box, vol, phase):
    return ()


def rule_cast(box, vol, phase):
    return (Work("fma", vol(box.cod[0].axis_names), "convert", box.cod),)


def rule_softmax_contract(box, vol, phase):
    """Online softmax-contraction (state mu, z, o).  Per chunk: ``mu' = max(mu, max s)``,
    ``delta = exp(mu - mu')``, ``p = exp(s - mu')``, ``z' = delta z + sum p``,
    ``o' = delta o + p.V``; the tensor work is P.V at the values' precision."""
    s, o, st = vol(box.dom[0].axis_names), vol(box.cod[0].axis_names), vol(_stat_axes(box))
    pv = Work("tensor", 2 * vol(_axes_union(box.dom)), "P.V", box.dom[1:])
    if phase == "init":
        return ()
    if phase == "finalise":
        return (Work("fma", o, "o / z", box.cod),)
    if phase == "apply":
        return (pv, Work("exp", s, "exp(s - mu)", box.cod),
                Work("fma", 3 * s, "row max, s - mu, row sum", box.cod), Work("fma", o, "o / z", box.cod))
    return (pv, Work("exp", s, "exp(s - mu)", box.cod), Work("exp", st, "delta = exp(mu - mu')", box.cod),
            Work("fma", 3 * s, "row max, s - mu, row sum", box.cod),
            Work("fma", 3 * st, "mu, z merge", box.cod),
            Work("fma", 2 * o, "rescale and accumulate o", box.cod))


def rule_norm_contract(box, vol, phase):
    """Normalised contraction ``sum_j a1(s_j) v_j / b(sum_j a2(s_j))`` with state (o, z)."""
    s, o, st = vol(box.dom[0].axis_names), vol(box.cod[0].axis_names), vol(_stat_axes(box))
    av = Work("tensor", 2 * vol(_axes_union(box.dom)), "a1(S).V", box.dom[1:])
    body = (_fn_work(box.param("a1"), s, "a1", box.cod) + _fn_work(box.param("a2"), s, "a2", box.cod)
            + (av, Work("fma", s, "sum a2", box.cod)))
    tail = _fn_work(box.param("b"), st, "b", box.cod) + (Work("fma", o, "o / b(z)", box.cod),)
    if phase == "init":
        return ()
    if phase == "finalise":
        return tail
    if phase == "apply":
        return body + tail
    return body + (Work("fma", st + o, "merge z, accumulate o", box.cod),)


# One rule per box kind; tests/test_cost.py keeps the keys equal to semantics.NUMPY_RULES.
COST_RULES: dict[str, Callable] = {
    "contract": rule_contract, "map": rule_map, "reduce": rule_reduce, "softmax": rule_softmax,
    "normalize": rule_normalize, "mask": rule_mask, "index_bias": rule_index_bias,
    "reindex": rule_free, "param": rule_free, "const": rule_free, "cast": rule_cast,
    "softmax_contract": rule_softmax_contract, "norm_contract": rule_norm_contract,
}


def box_work(box: Box, vol: Callable, phase: str = "apply") -> tuple[Work, ...]:
    try:
        rule = COST_RULES[box.kind]
    except KeyError:
        raise UnknownKindError(f"no cost rule for box kind {box.kind!r} (box {box.name})") from None
    return tuple(w for w in rule(box, vol, phase) if w.count != 0)


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
    level: str
    size: sp.Expr
    array: str
    dtype: DType


def _resolve(name: str, dtype: DType, dtypes, stat: bool = False) -> DType:
    """Wire dtype, or an override: one DType for every array (statistics stay f32), or a
    mapping ``array name -> DType``."""
    if dtypes is None:
        return dtype
    if isinstance(dtypes, DType):
        return dtype if stat else dtypes
    got = dtypes.get(name)
    return got if got is not None else dtype


def _ro(d) -> FrozenDict:
    return FrozenDict(d)


def _check_level(level, what: str) -> str:
    from ..core.hierarchy import FULL
    if not isinstance(level, str) or level not in FULL.names:
        raise CostError(f"{what}: unknown memory level {level!r}; levels are {list(FULL.names)}")
    return level


def _check_hw(hw, what: str):
    from ..core.hardware import PROFILES, Hardware
    if not isinstance(hw, Hardware):
        hint = f" (use nc.hardware.{hw})" if isinstance(hw, str) and hw in PROFILES else ""
        raise CostError(f"{what}: hw must be a hardware profile such as nc.hardware.H100, got {hw!r}{hint}; "
                        f"profiles: {sorted(PROFILES)}")
    return hw


def _check_dtypes(dtypes, what: str):
    """None (wire dtypes), one DType, or a mapping ``array name -> DType``."""
    if dtypes is None or isinstance(dtypes, DType):
        return dtypes
    if hasattr(dtypes, "items") and all(isinstance(k, str) and isinstance(v, DType) for k, v in dtypes.items()):
        return dtypes
    from ..core.diagram import DTYPES
    raise CostError(f"{what}: dtype must be a napkin_cat DType (e.g. nc.f16) or {{array name: DType}}, got "
                    f"{dtypes!r}; known: {sorted(DTYPES)}")


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 1:
        raise CostError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _num(e) -> int | Fraction | float:
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
    """Integer tile/stream sizes minimising the transfers into ``level`` under its capacity."""

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

    def __str__(self) -> str:
        tiles = ", ".join(f"{k}={v}" for k, v in self.tiles.items())
        gap = f", gap {self.gap:.4f}" if self.gap is not None else ""
        return (f"optimum at {self.level} (capacity {self.capacity} {self.unit}): {tiles}; "
                f"transfers {dict(self.transfers)}, bound {self.bound}{gap}")


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

@dataclass(frozen=True, repr=False)
class Cost:
    """The cost of one relabelled diagram, symbolic in its sizes.

    ``transfers`` / ``memory`` (values per level), ``flops`` (per unit) and the records they
    sum: ``moves`` (every transfer site with its trip counts), ``ops`` (every node's work),
    ``columns`` (the live buffers of each program point).  Methods turn them into bytes
    (:meth:`bytes`, :meth:`memory_bytes`), optima (:meth:`optimize`, :meth:`closed_form`,
    :meth:`optimum_bytes`) and predictions (:meth:`time`, :meth:`occupancy`,
    :meth:`multilevel`, :meth:`cross_transfer`)."""

    diagram: Diagram
    form: FinalForm
    moves: tuple[Move, ...]
    ops: tuple[Op, ...]
    columns: tuple[tuple[Resident, ...], ...]
    transfers: Mapping[str, sp.Expr]
    memory: Mapping[str, sp.Expr]
    flops: Mapping[str, sp.Expr]
    hierarchy: Hierarchy | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __repr__(self) -> str:
        return (f"Cost({self.diagram}, transfers={dict(self.transfers)}, memory={dict(self.memory)}, "
                f"flops={dict(self.flops)})")

    # ---- symbols
    @property
    def blocks(self) -> Mapping[str, tuple[tuple[str, str], ...]]:
        """Symbolic tile and stream sizes: ``name -> ((op, axis), ...)``."""
        out: dict[str, list] = {}
        for r in self.diagram.schedule:
            if r.op in ("tile", "stream") and isinstance(r.size, str):
                out.setdefault(r.size, []).append((r.op, r.axis))
        return _ro({k: tuple(v) for k, v in out.items()})

    def _subs(self, sizes: Mapping | None) -> dict:
        """Sizes keyed by Axis, axis name, symbol name or sympy symbol -> {Symbol: Integer}."""
        out: dict = {}
        by_name = {a.name: a for a in self.diagram.axes}
        if sizes is not None and not hasattr(sizes, "items"):
            raise CostError(f"sizes must be a dict {{axis or symbol: int}}, got {sizes!r}")
        known = set(by_name) | {a.size for a in by_name.values() if a.symbolic} | set(self.blocks)
        for k in (sizes or {}):
            name = k.name if isinstance(k, (Axis, sp.Symbol)) else k
            if isinstance(name, str) and name not in known:
                raise CostError(f"sizes names {name!r}, which is no axis, symbolic size or tile/stream size "
                                f"of {self.diagram.short()}; known: {sorted(known)}")
        for k, v in (sizes or {}).items():
            if isinstance(k, Axis):
                ax = by_name.get(k.name, k)
                sym = ax.size
            elif isinstance(k, sp.Symbol):
                sym = k.name
            elif isinstance(k, str) and k in by_name:
                sym = by_name[k].size
            elif isinstance(k, str):
                sym = k
            else:
                raise CostError(f"size key {k!r} is not an axis, an axis name or a symbol name")
            if isinstance(sym, int):
                if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) != sym:
                    raise CostError(f"axis {getattr(k, 'name', k)} has size {sym}, sizes says {v!r}")
                continue
            if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 1:
                raise CostError(f"size of {getattr(k, 'name', k)} must be a positive integer, got {v!r}")
            out[size_symbol(sym)] = sp.Integer(int(v))
        return out

    def subs(self, sizes: Mapping) -> "Cost":
        """The same cost with sizes (axes, tile/stream symbols) substituted."""
        s = self._subs(sizes)
        sub = lambda e: sp.sympify(e).subs(s)
        return replace(
            self,
            moves=tuple(replace(m, per_exec=sub(m.per_exec), execs=sub(m.execs), ragged_execs=sub(m.ragged_execs))
                        for m in self.moves),
            ops=tuple(replace(o, per_exec=sub(o.per_exec), execs=sub(o.execs)) for o in self.ops),
            columns=tuple(tuple(replace(r, size=sub(r.size)) for r in col) for col in self.columns),
            transfers=_ro({k: sub(v) for k, v in self.transfers.items()}),
            memory=_ro({k: sub(v) for k, v in self.memory.items()}),
            flops=_ro({k: sub(v) for k, v in self.flops.items()}),
            _cache={})

    # ---- bytes, memory, intensity
    def bytes(self, level: str | None = None, dtypes=None):
        """Transfers in bytes: per level (``level=None``) or for one level.  ``dtypes``: one
        DType for every array, or ``{array name: DType}`` (mixed precision)."""
        _check_dtypes(dtypes, "bytes")
        if level is not None:
            _check_level(level, "bytes")
        out: dict[str, sp.Expr] = {}
        for m in self.moves:
            out[m.upper] = out.get(m.upper, ZERO) + m.values * _resolve(m.array, m.dtype, dtypes).bytes
        if level is not None:
            return out.get(level, ZERO)
        return _ro(out)

    def memory_bytes(self, level: str | None = None, dtypes=None):
        """Peak resident bytes per level (``Max`` over the loop nest's columns)."""
        _check_dtypes(dtypes, "memory_bytes")
        if level is not None:
            _check_level(level, "memory_bytes")
        per: dict[str, list] = {}
        for col in self.columns:
            tot: dict[str, sp.Expr] = {}
            for r in col:
                b = _resolve(r.array, r.dtype, dtypes, stat=r.array in _STAT_NAMES).bytes
                tot[r.level] = tot.get(r.level, ZERO) + r.size * b
            for lv, m in tot.items():
                per.setdefault(lv, []).append(m)
        out = {lv: sp.Max(*ms) for lv, ms in per.items()}
        if level is not None:
            return out.get(level, ZERO)
        return _ro(out)

    @property
    def intensity(self) -> sp.Expr:
        """FLOPs (all units) per byte crossing the top level."""
        top = self.form.hierarchy.top
        return sp.simplify(sum(self.flops.values(), ZERO) / self.bytes(top))

    def objective(self, level: str = "SMEM", dtypes=None, in_bytes: bool = False) -> sp.Expr:
        """Transfers into and out of ``level`` from above (what its capacity trades against)."""
        _check_level(level, "objective")
        _check_dtypes(dtypes, "objective")
        tot = ZERO
        for m in self.moves:
            if m.lower == level:
                tot += m.values * (_resolve(m.array, m.dtype, dtypes).bytes if in_bytes else 1)
        return tot

    # ---- printing
    def table(self) -> str:
        lines = ["transfers (values):"] + [f"  {lv}: {e}" for lv, e in self.transfers.items()]
        lines += ["memory (values):"] + [f"  {lv}: {e}" for lv, e in self.memory.items()]
        lines += ["flops:"] + [f"  {u}: {e}" for u, e in self.flops.items()]
        return "\n".join(lines)

    __str__ = table

    # ---- closed form
    def closed_form(self, level: str = "SMEM", bytes: bool = False, dtypes=None) -> ClosedForm:
        """``H*(M) = sum_t alpha_t M^(-beta_t)``: the transfers into ``level`` with tile sizes
        chosen to minimise them under ``memory(level) = M``.  Stream sizes (and tiles the
        transfers do not depend on) are taken as small and only the leading-order memory terms
        kept, which relaxes the constraint: the result is a lower bound on every integer
        choice.  Derived with sympy (Lagrange conditions); raises CostError when the optimum
        is not a sum of powers of M."""
        _check_level(level, "closed_form")
        _check_dtypes(dtypes, "closed_form")
        key = ("closed", level, bytes, _dkey(dtypes))
        if key in self._cache:
            return self._cache[key]
        obj = sp.expand(self.objective(level, dtypes, bytes))
        mem = self.memory_bytes(level, dtypes) if bytes else self.memory.get(level, ZERO)
        M = size_symbol(f"M_{level}")
        syms = {size_symbol(n): ops for n, ops in self.blocks.items()}
        var = sorted((s for s in syms if s in obj.free_symbols), key=str)
        small = {s: (0 if all(op == "stream" for op, _ in ops) else 1)
                 for s, ops in syms.items() if s not in var}
        mem0 = _leading(_dominant(sp.sympify(mem).subs(small), level), var)
        if var and not (set(var) & mem0.free_symbols):
            raise CostError(f"the memory at {level} ({mem0}) does not depend on {var}: nothing bounds them")
        sol: dict = {}
        if len(var) == 1:
            roots = [r for r in sp.solve(sp.Eq(mem0, M), var[0]) if r.is_positive is not False]
            if not roots:
                raise CostError(f"cannot solve {mem0} = {M} for {var[0]}")
            sol = {var[0]: roots[0]}
        elif var:
            lam = sp.Dummy("lam")
            eqs = [sp.diff(obj, v) - lam * sp.diff(mem0, v) for v in var] + [mem0 - M]
            sols = sp.solve(eqs, var + [lam], dict=True)
            sols = [s for s in sols if all(s[v].is_positive is not False for v in var if v in s)]
            if not sols:
                raise CostError(f"no stationary point of {obj} under {mem0} = {M}")
            sol = {v: e for v, e in sols[0].items() if v in var}
        H = sp.simplify(obj.subs(sol))
        if set(var) & H.free_symbols:
            raise CostError(f"the optimum still depends on {sorted(map(str, set(var) & H.free_symbols))}: {H}")
        alphas, betas = _powers(H, M)
        H = sp.Add(*(a * M ** (-b) for a, b in zip(alphas, betas)))
        cf = ClosedForm(alphas, betas, H, M, _ro({str(k): v for k, v in sol.items()}))
        self._cache[key] = cf
        return cf

    def optimum_bytes(self, level: str = "SMEM") -> sp.Expr:
        """``H*_bytes = sum_t alpha_t M_bytes^(-beta_t) q^(1 + beta_t)`` with ``q`` bytes per
        value (symbol ``nbytes``) and ``M_bytes`` the capacity in bytes (symbol ``Mbytes_<level>``):
        halving q divides a beta-term by ``2^(1+beta)``."""
        alphas, betas = self.closed_form(level)
        Mb, q = size_symbol(f"Mbytes_{level}"), size_symbol("nbytes")
        return sp.Add(*(a * Mb ** (-b) * q ** (1 + b) for a, b in zip(alphas, betas)))

    # ---- optimisation
    def optimize(self, sizes: Mapping, hw=None, dtype=None, level: str = "SMEM",
                 fixed: Mapping | None = None, memory: int | None = None,
                 divides: bool = False) -> Optimum:
        """Exact integer search for the symbolic tile/stream sizes minimising the transfers into
        ``level`` subject to ``memory(level) <= capacity`` and ``require`` divisibility.

        Capacity: ``memory`` values if given (the paper's M), else ``hw.capacity(level)`` bytes
        with array sizes in bytes (``dtype``: a DType or ``{array: DType}``).  ``divides=True``
        keeps only tiles dividing their axis.  Transfers use the model's trip counts
        (``axis / tile``); ``transfers_ragged`` counts whole ragged last tiles."""
        _check_level(level, "optimize")
        _check_dtypes(dtype, "optimize")
        if fixed is not None and not hasattr(fixed, "items"):
            raise CostError(f"optimize: fixed must be a dict {{tile or stream size: int}}, got {fixed!r}")
        for name, v in (fixed or {}).items():
            _positive_int(v, f"optimize: fixed {name}")
        subs = self._subs(sizes)
        subs.update(self._subs(fixed or {}))
        in_bytes = memory is None
        if memory is not None and hw is not None:
            raise CostError(f"optimize: give hw (capacity from {getattr(hw, 'name', hw)}) or memory={memory!r} "
                            f"(capacity in values), not both: one of them would be ignored")
        if in_bytes:
            if hw is None:
                raise CostError("optimize needs hw (a hardware profile) or memory=<capacity in values>")
            _check_hw(hw, "optimize")
            cap = hw.capacity(level)
            mem_e = sp.sympify(self.memory_bytes(level, dtype)).subs(subs)
            obj_e = self.objective(level, dtype, True).subs(subs)
        else:
            cap = _positive_int(memory, "optimize: memory (capacity in values)")
            mem_e = sp.sympify(self.memory.get(level, ZERO)).subs(subs)
            obj_e = self.objective(level).subs(subs)
        blocks = self.blocks
        free = [size_symbol(n) for n in blocks if size_symbol(n) not in subs]
        missing = (mem_e.free_symbols | obj_e.free_symbols) - set(free)
        if missing:
            raise CostError(f"sizes missing for {sorted(map(str, missing))} (given: "
                            f"{sorted(str(k) for k in subs)})")
        cands, req = {}, requirements(self.diagram)
        for s in free:
            k, bound = 1, None
            for op, axis in blocks[s.name]:
                k = math.lcm(k, req.get(axis, 1))
                n = size_expr(self.diagram.axis(axis).size).subs(subs)
                if not n.is_Integer:
                    raise CostError(f"size of axis {axis} is needed to bound {s}")
                bound = int(n) if bound is None else min(bound, int(n))
            cand = list(range(k, bound + 1, k))
            if divides:
                cand = [v for v in cand if bound % v == 0]
            if not cand:
                raise CostError(f"no size for {s} is a multiple of {k} and at most {bound}")
            cands[s] = cand
        for name in (fixed or {}):
            if name not in blocks:
                raise CostError(f"fixed {name!r} is not a tile or stream size of this diagram "
                                f"(those are {sorted(blocks)})")
            for op, axis in blocks[name]:
                k = req.get(axis, 1)
                if int(fixed[name]) % k:
                    raise CostError(f"fixed {name}={fixed[name]} is not a multiple of {k} (require on {axis})")
                n = size_expr(self.diagram.axis(axis).size).subs(subs)
                if n.is_Integer and int(fixed[name]) > int(n):
                    raise CostError(f"fixed {name}={fixed[name]} is larger than axis {axis}={n}")
        mem_f = sp.lambdify(free, mem_e, "math")
        obj_f = sp.lambdify(free, obj_e, "math")
        unit = "bytes" if in_bytes else "values"

        def fits(assign) -> bool:
            return mem_f(*[assign[s] for s in free]) <= cap

        base = {s: cands[s][0] for s in free}
        if not fits(base):
            what = f"{cap} {unit}" + (f" ({hw.name}, {_dname(dtype)})" if in_bytes else "")
            shown = {str(k): int(v) for k, v in subs.items()}
            need = _num(mem_e.subs(base)) if free else _num(mem_e)
            raise CostError(f"nothing fits {level}: capacity {what}, sizes {shown}; the smallest "
                            f"blocks {({str(k): v for k, v in base.items()})} need {need} {unit} "
                            f"(memory at {level} = {self.memory.get(level, ZERO)})")
        obj_syms = [s for s in free if s in obj_e.free_symbols]
        mono = [s for s in obj_syms if (-sp.diff(obj_e, s)).is_nonnegative]
        inner = mono[-1] if mono else None
        outer = [s for s in obj_syms if s is not inner]
        exhaustive = True
        if math.prod(len(cands[s]) for s in outer) > 200_000:
            exhaustive = False
            for s in outer:
                cands[s] = _sparse(cands[s])
        found: list[tuple[float, dict]] = []

        def record(assign):
            found.append((float(obj_f(*[assign[s] for s in free])), dict(assign)))

        def visit(i, assign):
            if i == len(outer):
                if inner is not None:
                    lo, hi = 0, len(cands[inner]) - 1
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        assign[inner] = cands[inner][mid]
                        if fits(assign):
                            lo = mid
                        else:
                            hi = mid - 1
                    assign[inner] = cands[inner][lo]
                record(assign)
                if inner is not None:
                    assign[inner] = cands[inner][0]
                return
            s = outer[i]
            for v in cands[s]:
                assign[s] = v
                if not fits(assign):
                    break
                visit(i + 1, assign)
            assign[s] = cands[s][0]

        visit(0, dict(base))
        best = min(f for f, _ in found)
        close = [a for f, a in found if f <= best * (1 + 1e-9) + 1e-12]
        exact = sorted(close, key=lambda a: (obj_e.subs(a), mem_e.subs(a), tuple(a[s] for s in free)))
        choice = exact[0]
        tiles = {n: int(choice.get(size_symbol(n), subs.get(size_symbol(n)))) for n in blocks}
        return self._optimum(tiles, subs, choice, level, cap, unit, dtype, exhaustive, obj_e)

    def _optimum(self, tiles, subs, choice, level, cap, unit, dtype, exhaustive, obj_e) -> Optimum:
        allsubs = {**subs, **{size_symbol(k): sp.Integer(v) for k, v in tiles.items()}}
        at = lambda e: _num(sp.sympify(e).subs(allsubs))
        transfers = {lv: at(e) for lv, e in self.transfers.items()}
        ragged: dict[str, sp.Expr] = {}
        for m in self.moves:
            ragged[m.upper] = ragged.get(m.upper, ZERO) + m.per_exec * m.ragged_execs
        objective = at(obj_e.subs(choice))
        bound, gap = None, None
        try:
            if unit == "values":
                cf, M_val, obj_v = self.closed_form(level), sp.Integer(cap), objective
            else:
                q = _uniform_bytes(self, level, dtype)
                if q is not None:
                    cf, M_val = self.closed_form(level), sp.Rational(cap, q)
                    obj_v = at(self.objective(level))
                else:
                    cf, M_val, obj_v = self.closed_form(level, True, dtype), sp.Integer(cap), objective
            b = cf.at(M_val, allsubs)
            bound = _num(b)
            gap = float(sp.nsimplify(obj_v) / b) if b != 0 else None
        except CostError:
            pass
        return Optimum(
            tiles=_ro(tiles), transfers=_ro(transfers),
            transfers_ragged=_ro({lv: int(sp.ceiling(e.subs(allsubs))) for lv, e in ragged.items()}),
            bytes=_ro({lv: at(e) for lv, e in self.bytes(None, dtype).items()}),
            memory=_ro({lv: int(at(e)) for lv, e in self.memory.items()}),
            memory_bytes=_ro({lv: int(at(e)) for lv, e in self.memory_bytes(None, dtype).items()}),
            flops=_ro({u: at(e) for u, e in self.flops.items()}),
            objective=objective, bound=bound, gap=gap, level=level, capacity=cap, unit=unit,
            exhaustive=exhaustive)

    # ---- occupancy and time
    def occupancy(self, hw, sizes: Mapping, dtype=None, level: str = "SMEM", stages: int = 1,
                  capacity: int | None = None) -> Occupancy:
        """Groups per SM ``(M_max - stages * M_block) / M_group``: memory terms that scale with a
        tile size belong to one group; the rest (streamed chunks) is shared by the block and
        multiplied by ``stages`` (buffers in flight when loads are pipelined)."""
        _check_hw(hw, "occupancy")
        _check_level(level, "occupancy")
        _check_dtypes(dtype, "occupancy")
        _positive_int(stages, "occupancy: stages")
        if capacity is not None:
            _positive_int(capacity, "occupancy: capacity")
        subs = self._subs(sizes)
        tile_syms = {size_symbol(n) for n, ops in self.blocks.items() if any(op == "tile" for op, _ in ops)}
        axis_subs = {k: v for k, v in subs.items() if k not in tile_syms}
        expr = _dominant(sp.sympify(self.memory_bytes(level, dtype)).subs(axis_subs), level)
        group = block = ZERO
        for t in sp.Add.make_args(sp.expand(expr)):
            if t.free_symbols & tile_syms:
                group += t
            else:
                block += t
        group, block = int(group.subs(subs)), int(block.subs(subs))
        if group == 0:
            group, block = block, 0
        cap = capacity if capacity is not None else (hw.smem_per_sm if level == "SMEM" else hw.capacity(level))
        return Occupancy(level, cap, block, group, stages, Fraction(cap - stages * block, group))

    def time(self, hw, sizes: Mapping, dtype=None, level: str = "SMEM") -> Timing:
        """Roofline: ``max(compute, bytes_l / bandwidth_l)`` over the levels.  Compute is the
        slowest unit (units overlap), each op at the rate of its precision, divided by the
        fraction of the SMs the grid keeps busy (wave quantisation: ``G / (ceil(G/SMs) SMs)``
        for ``G`` groups).  Tile and stream sizes left symbolic are chosen to minimise this
        time among powers of two, divisors of the axis and the transfer optimum of
        :meth:`optimize`, subject to the capacity of ``level``."""
        _check_hw(hw, "time")
        _check_level(level, "time")
        _check_dtypes(dtype, "time")
        subs = self._subs(sizes)
        unbound = [a.name for a in self.diagram.axes if a.symbolic and size_symbol(a.size) not in subs]
        if unbound:
            raise CostError(f"time needs every axis size: {unbound} not given (sizes: "
                            f"{ {str(k): v for k, v in subs.items()} })")
        given = {n: int(subs[size_symbol(n)]) for n in self.blocks if size_symbol(n) in subs}
        free = [size_symbol(n) for n in self.blocks if n not in given]
        if not free:
            return self._roofline(hw, subs, given, dtype)
        opt = self.optimize(sizes, hw, dtype, level, fixed=given)   # raises when nothing fits
        req = requirements(self.diagram)
        cands = []
        for s in free:
            k = math.lcm(*(req.get(ax, 1) for _, ax in self.blocks[s.name]))
            top = min(int(size_expr(self.diagram.axis(ax).size).subs(subs)) for _, ax in self.blocks[s.name])
            vals = {v for v in (k * 2 ** i for i in range(64)) if v <= top}
            vals |= {v for v in range(k, top + 1, k) if top % v == 0} if top <= 1 << 20 else set()
            vals.add(opt.tiles[s.name])
            cands.append(sorted(vals))
        allsubs = dict(subs)
        fits = sp.lambdify(free, sp.sympify(self.memory_bytes(level, dtype)).subs(allsubs), "math")
        cap = hw.capacity(level)
        unit_f = []
        for u in UNITS:
            e = ZERO
            for o in self.ops:
                if o.unit == u:
                    prec = max((_resolve(nm, dt, dtype) for nm, dt in o.precision), key=lambda t: t.bytes,
                               default=f32)
                    e += o.total / sp.Float(hw.rate(u, prec))
            unit_f.append(sp.lambdify(free, e.subs(allsubs), "math"))
        mem_f = [sp.lambdify(free, e.subs(allsubs) / sp.Float(hw.bandwidth(lv)), "math")
                 for lv, e in self.bytes(None, dtype).items() if hw.bandwidth(lv)]
        groups_e = sp.Integer(1)
        for node, loops in self.form.walk():
            if isinstance(node, Loop) and node.kind == "grid":
                groups_e *= sp.ceiling(self.form.trip_count(node, loops))
        groups_f = sp.lambdify(free, groups_e.subs(allsubs), "math")
        best = None
        for combo in _product(cands):
            if fits(*combo) > cap:
                continue
            g = groups_f(*combo)
            busy = g / (math.ceil(g / hw.sms) * hw.sms)
            t = max([f(*combo) / busy for f in unit_f] + [f(*combo) for f in mem_f])
            if best is None or t < best[0]:
                best = (t, combo)
        tiles = {**given, **{s.name: int(v) for s, v in zip(free, best[1])}}
        return self._roofline(hw, subs, tiles, dtype)

    def _roofline(self, hw, subs, tiles, dtype) -> Timing:
        allsubs = {**subs, **{size_symbol(k): sp.Integer(v) for k, v in tiles.items()}}
        compute: dict[str, float] = {u: 0.0 for u in UNITS}
        total_flops = 0.0
        for o in self.ops:
            n = float(o.total.subs(allsubs))
            total_flops += n
            prec = max((_resolve(nm, dt, dtype) for nm, dt in o.precision), key=lambda t: t.bytes,
                       default=f32)
            compute[o.unit] += n / hw.rate(o.unit, prec)
        groups = 1
        for node, loops in self.form.walk():
            if isinstance(node, Loop) and node.kind == "grid":
                groups *= int(sp.ceiling(self.form.trip_count(node, loops).subs(allsubs)))
        busy = groups / (math.ceil(groups / hw.sms) * hw.sms)
        compute = {u: t / busy for u, t in compute.items()}
        mem_t = {}
        for lv, e in self.bytes(None, dtype).items():
            bw = hw.bandwidth(lv)
            if bw:
                mem_t[lv] = float(e.subs(allsubs)) / bw
        conc = []
        for lv, cap in (("SMEM", hw.smem_per_sm), ("registers", hw.registers_per_sm)):
            m = self.memory_bytes(lv, dtype)
            if m != 0:
                need = int(sp.sympify(m).subs(allsubs))
                conc.append(cap // need if need else hw.max_warps_per_sm)
        occupancy = min(conc) if conc else 1
        if occupancy < 1:
            raise CostError(f"one group needs more memory per SM than {hw.name} has "
                            f"(tiles {tiles}, dtype {_dname(dtype)})")
        worst = max([(t, f"compute:{u}") for u, t in compute.items()] + [(t, lv) for lv, t in mem_t.items()])
        return Timing(worst[0], _ro(compute), _ro(mem_t), worst[1], _ro(tiles), groups, occupancy,
                      int(total_flops), hw.name)

    # ---- hierarchies
    def multilevel(self, sizes: Mapping, hw, dtype: DType | None = None, hierarchy: Hierarchy | None = None,
                   cluster: int | None = None, level: str = "SMEM") -> MultiLevel:
        """``H* = sum_l (1/bw_l) H*(sizes, M_l)`` (seconds): the two-level optimum at ``level``
        re-evaluated with each lower level's capacity ``M_l`` (values) and priced at the
        bandwidth into it; the top level is free.  A cluster level (cross transfer, size
        ``cluster``) prices ``H*(N M_c)`` at the outer bandwidth and the rest at the cluster's
        (Theorem 3), with the profile's measured cluster figures (``cluster_bandwidth[N]``, and
        ``[1]`` for the outer price when present, from the same measurements).  Each ``H*(M_l)``
        is the exact integer optimum (tiles capped at their axes); ``closed_seconds`` uses the
        closed form, which beyond the size where a tile covers its axis undercuts the
        compulsory traffic."""
        _check_hw(hw, "multilevel")
        _check_level(level, "multilevel")
        _check_dtypes(dtype, "multilevel")
        if cluster is not None:
            _positive_int(cluster, "multilevel: cluster")
        if hierarchy is not None and not isinstance(hierarchy, Hierarchy):
            raise CostError(f"multilevel: hierarchy must be a Hierarchy, got {hierarchy!r}")
        h = hierarchy or self.hierarchy or make_hierarchy(l2=True, cluster=cluster is not None)
        q = (dtype.bytes if isinstance(dtype, DType) else _uniform_bytes(self, level, dtype))
        if q is None:
            raise CostError("multilevel needs one dtype (bytes per value) for every array")
        try:
            cf = self.closed_form(level)
        except CostError:
            cf = None
        subs = self._subs(sizes)

        def H(M_values: int):
            opt = self.optimize(sizes, memory=M_values, level=level)
            closed = _num(cf.at(M_values, subs)) if cf is not None else None
            return opt.objective, closed

        out: dict[str, dict] = {}
        total, closed_total = 0.0, 0.0
        names = h.names
        for i, lv in enumerate(h.levels[1:], start=1):
            if lv.kind == "cross" or lv.name not in ("L2", "SMEM", "registers"):
                continue
            parent = names[i - 1]
            M_l = hw.capacity(lv.name) // q
            if parent == "cluster":
                N = cluster or 1
                bw_xc = hw.cluster_bandwidth.get(N)
                bw_hc = hw.cluster_bandwidth.get(1) or hw.bandwidth(names[i - 2])
                if bw_xc is None or bw_hc is None:
                    raise CostError(f"{hw.name} has no cluster bandwidth for N={N}")
                big, big_c = H(N * M_l)
                small, small_c = H(M_l)
                secs = q * ((1 / bw_hc - 1 / bw_xc) * float(big) + float(small) / bw_xc)
                csecs = (q * ((1 / bw_hc - 1 / bw_xc) * float(big_c) + float(small_c) / bw_xc)
                         if cf is not None else None)
                out[lv.name] = {"M": M_l, "H": small, "H_cluster": big, "bandwidth": bw_hc,
                                "cluster_bandwidth": bw_xc, "seconds": secs}
            else:
                bw = hw.bandwidth(parent)
                if bw is None:
                    continue
                val, cval = H(M_l)
                secs = q * float(val) / bw
                csecs = q * float(cval) / bw if cf is not None else None
                out[lv.name] = {"M": M_l, "H": val, "H_closed": cval, "bandwidth": bw, "seconds": secs}
            total += secs
            closed_total = closed_total + csecs if (closed_total is not None and csecs is not None) else None
        return MultiLevel(_ro({k: _ro(v) for k, v in out.items()}), total, closed_total)

    def cross_transfer(self, M_c, N: int, inv_bw_outer, inv_bw_cluster, level: str = "SMEM",
                       sizes: Mapping | None = None) -> sp.Expr:
        """Theorem 3: with clusters of ``N`` cores exchanging data at cost ``inv_bw_cluster``
        per value, the transfers into ``level`` cost
        ``(inv_bw_outer - inv_bw_cluster) H*(N M_c) + inv_bw_cluster H*(M_c)``
        instead of ``inv_bw_outer H*(M_c)``."""
        _positive_int(N, "cross_transfer: N (cores per cluster)")
        cf = self.closed_form(level)
        subs = self._subs(sizes or {})
        Hn, H1 = cf.at(N * M_c, subs), cf.at(M_c, subs)
        return sp.nsimplify(inv_bw_outer - inv_bw_cluster) * Hn + sp.nsimplify(inv_bw_cluster) * H1


_STAT_NAMES = frozenset({"mu", "z", "m"})


def _dkey(dtypes):
    if dtypes is None or isinstance(dtypes, DType):
        return dtypes
    return tuple(sorted((k, v.name) for k, v in dtypes.items()))


def _dname(dtype) -> str:
    if dtype is None:
        return "wire dtypes"
    if isinstance(dtype, DType):
        return dtype.name
    return "{" + ", ".join(f"{k}: {v.name}" for k, v in dtype.items()) + "}"


def _uniform_bytes(c: Cost, level: str, dtypes) -> int | None:
    """Bytes per value when every array moved into or held at ``level`` has the same size."""
    seen = {_resolve(m.array, m.dtype, dtypes).bytes for m in c.moves if m.lower == level}
    for col in c.columns:
        seen |= {_resolve(r.array, r.dtype, dtypes, stat=r.array in _STAT_NAMES).bytes
                 for r in col if r.level == level}
    return seen.pop() if len(seen) == 1 else None


def _posynomial(e) -> bool:
    return all(t.as_coeff_Mul()[0] >= 0 for t in sp.Add.make_args(sp.expand(e)))


def _dominant(e, level: str):
    """Resolve ``Max(...)`` of memory columns: the argument that dominates every other
    coefficient-wise (sizes are positive)."""
    if not isinstance(e, sp.Max):
        return e
    for a in e.args:
        if all(_posynomial(a - b) for b in e.args if b is not a):
            return a
    raise CostError(f"the peak memory at {level} has no dominant column: {e}")


def _leading(mem, var):
    """The terms of highest total degree in ``var``: lower-order terms (a resident array that
    does not grow with the tiles, a bias tile) are small against M, and dropping them only
    relaxes the constraint, so the closed form stays a lower bound."""
    if not var:
        return mem
    terms = sp.Add.make_args(sp.expand(mem))
    deg = lambda t: sum(sp.degree(t, v) for v in var)
    top = max(deg(t) for t in terms)
    return sp.Add(*(t for t in terms if deg(t) == top))


def _powers(H, M) -> tuple[tuple, tuple]:
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


def _product(lists):
    out = [()]
    for lst in lists:
        out = [o + (v,) for o in out for v in lst]
    return out


def _sparse(cands: list[int]) -> list[int]:
    """Divisors of the bound, powers of two and every candidate up to 256 (a non-exhaustive
    candidate set when the full product is too large to enumerate)."""
    top = cands[-1]
    keep = {v for v in cands if v <= 256 or top % v == 0 or (v & (v - 1)) == 0}
    return sorted(keep)


# --------------------------------------------------------------------------- building

def cost(d: Diagram, hierarchy: Hierarchy | None = None) -> Cost:
    """The cost of ``d`` as relabelled (an unrelabelled diagram materialises every box's
    result at the top level).  ``hierarchy`` is kept for :meth:`Cost.multilevel`."""
    if not isinstance(d, Diagram):
        raise CostError(f"cost needs a Diagram, got {type(d).__name__}")
    if hierarchy is not None and not isinstance(hierarchy, Hierarchy):
        raise CostError(f"cost: hierarchy must be a Hierarchy (nc.hierarchy.hierarchy(l2=True)), got {hierarchy!r}")
    ff = d.loop_nest()
    h = ff.hierarchy
    top, bottom = h.top, h.names[-1]
    dd = ff.diagram
    types = dd.var_types()
    moves: list[Move] = []
    ops: list[Op] = []
    alias: dict[tuple, tuple] = {}

    def execs(loops, axes_=None):
        n, r = sp.Integer(1), sp.Integer(1)
        for i, lp in enumerate(loops):
            t = ff.trip_count(lp, loops[:i])
            n *= t
            r *= t if (axes_ is not None and lp.axis in axes_) else sp.ceiling(t)
        return n, r

    def ident(key) -> tuple[str, DType, bool]:
        if key[0] in ("var", "copy"):
            a = types[key[1]]
            return a.name, a.dtype, False
        _, i, sname = key
        acc = ff.accumulators[i]
        for name, _, role in acc.states():
            if name == sname:
                if role == "main":
                    return acc.box.cod[0].name, acc.box.cod[0].dtype, False
                return sname, f32, True
        raise AssertionError(key)

    def buf(v_or_key, loops):
        key = v_or_key if isinstance(v_or_key, tuple) else alias.get(("var", v_or_key), ("var", v_or_key))
        return key, ff.buffer(key, loops)

    def move(kind, key, b, upper, lower, loops):
        name, dt, _ = ident(key)
        n, r = execs(loops, set(b.axes))
        moves.append(Move(kind, name, dt, upper, lower, b.size, n, r, tuple(lp.axis for lp in loops)))

    def above(a, b):
        return h.index(a) < h.index(b)

    def touch(kind, keys, loops, clevel):
        for key in keys:
            k, b = buf(key, loops)
            if above(b.level, clevel):
                if kind == "read":
                    move("read", k, b, b.level, clevel, loops)
                else:
                    move("write", k, b, b.level, clevel, loops)

    def work(box, phase, loops, label):
        vol = lambda names: sp.Mul(*(ff.extent(n, loops) for n in names)) if names else sp.Integer(1)
        n, _ = execs(loops)
        for w in box_work(box, vol, phase):
            prec = tuple((a.name, a.dtype) for a in w.precision)
            ops.append(Op(w.unit, w.count, n, w.what, label, prec, tuple(lp.axis for lp in loops)))

    for node, loops in ff.walk():
        if isinstance(node, Loop):
            continue
        home = ff._home(loops)
        clevel = h.below(home) if home != bottom else home
        if isinstance(node, Load):
            if node.level != node.src:
                key, b = buf(("var", node.var) if node.final else ("copy", node.var, node.level), loops)
                move("load", key, b, node.src, node.level, loops)
        elif isinstance(node, Store):
            if node.level != node.dst:
                key, b = buf(("copy", node.var, node.level) if node.flush else ("var", node.var), loops)
                move("store", key, b, node.dst, node.level, loops)
        elif isinstance(node, Compute):
            e = dd.eqns[node.eqn]
            touch("read", e.ins, loops, clevel)
            touch("write", dd.eqn_outputs(node.eqn), loops, clevel)
            work(e.box, "apply", loops, e.box.name)
        else:
            acc = ff.accumulators[node.acc]
            states = [("state", node.acc, s) for s, _, _ in acc.states()]
            if isinstance(node, Init):
                touch("write", states, loops, clevel)
                work(acc.box, "init", loops, f"init {acc.box.cod[0].name}")
            elif isinstance(node, Update):
                touch("read", dd.eqns[acc.eqn].ins, loops, clevel)
                touch("read", states, loops, clevel)
                touch("write", states, loops, clevel)
                work(acc.box, "update", loops, f"update {acc.box.cod[0].name}")
            else:
                touch("read", states, loops, clevel)
                # a state machine without a "main" state (logsumexp: m, z) computes its result
                # from the statistics at the end: the output is a buffer of its own
                main = next((("state", node.acc, s) for s, _, role in acc.states() if role == "main"), None)
                if main is not None:
                    for v in dd.eqn_outputs(acc.eqn):
                        alias[("var", v)] = main
                touch("write", dd.eqn_outputs(acc.eqn), loops, clevel)
                work(acc.box, "finalise", loops, f"finalise {acc.box.cod[0].name}")

    columns = []
    for col in ff.columns():
        rows = []
        for b in col.live:
            name, dt, _ = ident(b.key)
            rows.append(Resident(b.level, b.size, name, dt))
        columns.append(tuple(rows))
    transfers: dict[str, sp.Expr] = {}
    for m in moves:
        transfers[m.upper] = transfers.get(m.upper, ZERO) + m.values
    flops = {u: ZERO for u in UNITS}
    for o in ops:
        flops[o.unit] += o.total
    return Cost(d, ff, tuple(moves), tuple(ops), tuple(columns),
                _ro({k: sp.expand(v) for k, v in transfers.items()}),
                _ro(ff.peak_memory()), _ro({u: sp.expand(v) for u, v in flops.items()}), hierarchy)


def concurrent_groups(capacity: int, block: int, group: int) -> Fraction:
    """``(M_max - M_block) / M_group`` as an exact fraction (floor it for a count)."""
    return Fraction(capacity - block, group)


__all__ = ["COST_RULES", "ClosedForm", "Cost", "FrozenDict", "MultiLevel", "Move", "Occupancy", "Op", "Optimum",
           "Timing", "Work", "box_work", "concurrent_groups", "cost"]
