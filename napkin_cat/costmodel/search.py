"""The exact integer search behind :meth:`Cost.optimize <napkin_cat.costmodel.Cost.optimize>`.

:func:`search` enumerates the symbolic tile and stream sizes of a cost (a binary search along
one size the transfers fall with, the rest exhaustively, or over a sparse set when there are too
many), keeping those whose memory fits the level's capacity and, with ``usable``, those a kernel
can use (:mod:`.usable`: the granule of the thread mappings, the register level).
"""

from __future__ import annotations

import math
from dataclasses import replace

import sympy as sp

from ..core.errors import CostError
from ..relabel.rules import requirements
from ..relabel.symbols import size_expr, size_symbol
from .records import (ZERO, Optimum, check_dtypes, check_hw, check_level, dtype_name, frozen, number,
                      positive_int, sparse, uniform_bytes)
from .usable import RULE, register_capacity, register_exprs, register_use, usable_size


def search(cost, sizes, hw, dtype, level, fixed, memory, divides, usable, threads, *,
           tiles_only: bool = False) -> Optimum | dict:
    """One search; see :meth:`Cost.optimize`.  ``tiles_only``: return the chosen sizes
    ``{name: int}`` without the report (transfers, bound, gap) that most of the time goes to."""
    check_level(level, "optimize")
    check_dtypes(dtype, "optimize")
    if not isinstance(usable, bool):
        raise CostError(f"optimize: usable must be True or False, got {usable!r}")
    positive_int(threads, "optimize: threads")
    if fixed is not None and not hasattr(fixed, "items"):
        raise CostError(f"optimize: fixed must be a dict {{tile or stream size: int}}, got {fixed!r}")
    for name, v in (fixed or {}).items():
        positive_int(v, f"optimize: fixed {name}")
    subs = cost._subs(sizes)
    subs.update(cost._subs(fixed or {}))
    in_bytes = memory is None
    if memory is not None and hw is not None:
        raise CostError(f"optimize: give hw (capacity from {getattr(hw, 'name', hw)}) or memory={memory!r} "
                        f"(capacity in values), not both: one of them would be ignored")
    if in_bytes:
        if hw is None:
            raise CostError("optimize needs hw (a hardware profile) or memory=<capacity in values>")
        check_hw(hw, "optimize")
        cap = hw.capacity(level)
        mem_e = sp.sympify(cost.memory_bytes(level, dtype)).subs(subs)
        obj_e = cost.objective(level, dtype, True).subs(subs)
    else:
        cap = positive_int(memory, "optimize: memory (capacity in values)")
        mem_e = sp.sympify(cost.memory.get(level, ZERO)).subs(subs)
        obj_e = cost.objective(level).subs(subs)
    blocks = cost.blocks
    free = [size_symbol(n) for n in blocks if size_symbol(n) not in subs]
    missing = (mem_e.free_symbols | obj_e.free_symbols) - set(free)
    if missing:
        raise CostError(f"sizes missing for {sorted(map(str, missing))} (given: "
                        f"{sorted(str(k) for k in subs)})")
    cands, req = {}, requirements(cost.diagram)
    for s in free:
        k, bound = 1, None
        for op, axis in blocks[s.name]:
            k = math.lcm(k, req.get(axis, 1))
            n = size_expr(cost.diagram.axis(axis).size).subs(subs)
            if not n.is_Integer:
                raise CostError(f"size of axis {axis} is needed to bound {s}")
            bound = int(n) if bound is None else min(bound, int(n))
        cand = list(range(k, bound + 1, k))
        if divides:
            cand = [v for v in cand if bound % v == 0]
        if usable:
            cand = [v for v in cand if usable_size(v, bound)]
        if not cand:
            rule = f", usable by a kernel ({RULE}; usable=False searches every size)" if usable else ""
            raise CostError(f"no size for {s} is a multiple of {k} and at most {bound}{rule}")
        cands[s] = cand
    for name in (fixed or {}):
        if name not in blocks:
            raise CostError(f"fixed {name!r} is not a tile or stream size of this diagram "
                            f"(those are {sorted(blocks)})")
        for op, axis in blocks[name]:
            k = req.get(axis, 1)
            if int(fixed[name]) % k:
                raise CostError(f"fixed {name}={fixed[name]} is not a multiple of {k} (require on {axis})")
            n = size_expr(cost.diagram.axis(axis).size).subs(subs)
            if n.is_Integer and int(fixed[name]) > int(n):
                raise CostError(f"fixed {name}={fixed[name]} is larger than axis {axis}={n}")
    mem_f = sp.lambdify(free, mem_e, "math")
    obj_f = sp.lambdify(free, obj_e, "math")
    unit = "bytes" if in_bytes else "values"
    regs = register_exprs(cost.columns) if (usable and hw is not None) else None
    reg_cap = register_capacity(hw, threads) if regs is not None else None
    if regs is not None:
        reg_f = sp.lambdify(free, [sp.sympify(e).subs(subs) for e in regs], "math")

    def reg_fits(assign) -> bool:
        if regs is None:
            return True
        micro, total = reg_f(*[assign[s] for s in free])
        use = register_use(math.ceil(micro), math.ceil(total), threads)
        return all(use[k] <= reg_cap[k] for k in reg_cap)

    def fits(assign) -> bool:
        return mem_f(*[assign[s] for s in free]) <= cap and reg_fits(assign)

    base = {s: cands[s][0] for s in free}
    if not fits(base):
        what = f"{cap} {unit}" + (f" ({hw.name}, {dtype_name(dtype)})" if in_bytes else "")
        shown = {str(k): int(v) for k, v in subs.items()}
        need = number(mem_e.subs(base)) if free else number(mem_e)
        if mem_f(*[base[s] for s in free]) <= cap:   # the registers refuse it
            micro, total = reg_f(*[base[s] for s in free])
            use = register_use(math.ceil(micro), math.ceil(total), threads)
            raise CostError(f"nothing fits the registers of {hw.name}: with {threads} threads per block the "
                            f"smallest usable blocks {({str(k): v for k, v in base.items()})} (sizes {shown}) "
                            f"hold {use} values, capacity {reg_cap}; usable=False drops the check")
        raise CostError(f"nothing fits {level}: capacity {what}, sizes {shown}; the smallest "
                        f"blocks {({str(k): v for k, v in base.items()})} need {need} {unit} "
                        f"(memory at {level} = {cost.memory.get(level, ZERO)})")
    obj_syms = [s for s in free if s in obj_e.free_symbols]
    mono = [s for s in obj_syms if (-sp.diff(obj_e, s)).is_nonnegative]
    inner = mono[-1] if mono else None
    outer = [s for s in obj_syms if s is not inner]
    exhaustive = True
    if math.prod(len(cands[s]) for s in outer) > 200_000:
        exhaustive = False
        for s in outer:
            cands[s] = sparse(cands[s])
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
            if fits(assign):
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
    if tiles_only:
        return tiles
    opt = _optimum(cost, tiles, subs, choice, level, cap, unit, dtype, exhaustive, obj_e)
    caps = {level: cap}
    if hw is not None:
        caps = {lv: hw.capacity(lv) for lv in cost.form.hierarchy.names if lv != "tensor"}
    rule = (RULE + ("; accumulators within the registers" if regs is not None else "")) if usable else ""
    extra = {"usable": usable, "rule": rule, "capacities": frozen(caps)}
    if regs is not None:
        at = {**subs, **{size_symbol(k): sp.Integer(v) for k, v in tiles.items()}}
        micro, total = (int(sp.ceiling(sp.sympify(e).subs(at))) for e in regs)
        extra.update(registers=frozen(register_use(micro, total, threads)), register_capacity=frozen(reg_cap),
                     threads=threads)
    return replace(opt, **extra)


def _optimum(cost, tiles, subs, choice, level, cap, unit, dtype, exhaustive, obj_e) -> Optimum:
    allsubs = {**subs, **{size_symbol(k): sp.Integer(v) for k, v in tiles.items()}}
    at = lambda e: number(sp.sympify(e).subs(allsubs))
    transfers = {lv: at(e) for lv, e in cost.transfers.items()}
    ragged: dict[str, sp.Expr] = {}
    for m in cost.moves:
        ragged[m.upper] = ragged.get(m.upper, ZERO) + m.per_exec * m.ragged_execs
    objective = at(obj_e.subs(choice))
    bound, gap = None, None
    try:
        if unit == "values":
            cf, M_val, obj_v = cost.closed_form(level), sp.Integer(cap), objective
        else:
            q = uniform_bytes(cost, level, dtype)
            if q is not None:
                cf, M_val = cost.closed_form(level), sp.Rational(cap, q)
                obj_v = at(cost.objective(level))
            else:
                cf, M_val, obj_v = cost.closed_form(level, True, dtype), sp.Integer(cap), objective
        b = cf.at(M_val, allsubs)
        bound = number(b)
        gap = float(sp.nsimplify(obj_v) / b) if b != 0 else None
    except CostError:
        pass
    return Optimum(
        tiles=frozen(tiles), transfers=frozen(transfers),
        transfers_ragged=frozen({lv: int(sp.ceiling(e.subs(allsubs))) for lv, e in ragged.items()}),
        bytes=frozen({lv: at(e) for lv, e in cost.bytes(None, dtype).items()}),
        memory=frozen({lv: int(at(e)) for lv, e in cost.memory.items()}),
        memory_bytes=frozen({lv: int(at(e)) for lv, e in cost.memory_bytes(None, dtype).items()}),
        flops=frozen({u: at(e) for u, e in cost.flops.items()}),
        objective=objective, bound=bound, gap=gap, level=level, capacity=cap, unit=unit,
        exhaustive=exhaustive)
