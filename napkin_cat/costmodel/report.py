"""The cost of one relabelled diagram, and what it answers: bytes, closed forms, optima, time.

:class:`Cost` holds the transfer sites, the work and the live buffers that
:func:`napkin_cat.costmodel.cost` read off the final form, symbolic in the sizes; its methods
turn them into bytes, the closed form ``H*(M) = sum_t alpha_t M^(-beta_t)``, exact integer
optima under a memory capacity, occupancy and roofline time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Mapping

import sympy as sp

from ..core.diagram import Axis, Diagram, DType, f32
from ..core.errors import CostError
from ..core.hierarchy import Hierarchy, hierarchy as make_hierarchy
from ..relabel.loopnest import FinalForm, Loop
from ..relabel.rules import requirements
from ..relabel.symbols import size_expr, size_symbol
from .records import (ZERO, ClosedForm, Move, MultiLevel, Occupancy, Op, Optimum, Resident, Timing,
                      check_dtypes, check_hw, check_level, dominant, dtype_key, dtype_name, frozen,
                      leading, number, positive_int, powers, product, resolve_dtype, sparse,
                      uniform_bytes)
from .links import device_loops, device_time
from .rules import UNITS
from .search import search
from .usable import THREADS


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
    notes: tuple[str, ...] = ()     # what the count could not know (a block table's values)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __repr__(self) -> str:
        return (f"<Cost of {self.diagram}: transfers {dict(self.transfers)}, memory {dict(self.memory)}, "
                f"flops {dict(self.flops)}>")

    # ---- symbols
    @property
    def blocks(self) -> Mapping[str, tuple[tuple[str, str], ...]]:
        """Symbolic tile and stream sizes: ``name -> ((op, axis), ...)``."""
        out: dict[str, list] = {}
        for r in self.diagram.schedule:
            if r.op in ("tile", "stream") and isinstance(r.size, str):
                out.setdefault(r.size, []).append((r.op, r.axis))
        return frozen({k: tuple(v) for k, v in out.items()})

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
            transfers=frozen({k: sub(v) for k, v in self.transfers.items()}),
            memory=frozen({k: sub(v) for k, v in self.memory.items()}),
            flops=frozen({k: sub(v) for k, v in self.flops.items()}),
            _cache={})

    # ---- bytes, memory, intensity
    def bytes(self, level: str | None = None, dtypes=None):
        """Transfers in bytes: per level (``level=None``) or for one level.  ``dtypes``: one
        DType for every array, or ``{array name: DType}`` (mixed precision)."""
        check_dtypes(dtypes, "bytes")
        if level is not None:
            check_level(level, "bytes")
        out: dict[str, sp.Expr] = {}
        for m in self.moves:
            out[m.upper] = out.get(m.upper, ZERO) + m.values * resolve_dtype(m.array, m.dtype, dtypes).bytes
        if level is not None:
            return out.get(level, ZERO)
        return frozen(out)

    def memory_bytes(self, level: str | None = None, dtypes=None):
        """Peak resident bytes per level (``Max`` over the loop nest's columns)."""
        check_dtypes(dtypes, "memory_bytes")
        if level is not None:
            check_level(level, "memory_bytes")
        per: dict[str, list] = {}
        for col in self.columns:
            tot: dict[str, sp.Expr] = {}
            for r in col:
                b = resolve_dtype(r.array, r.dtype, dtypes, stat=r.stat).bytes
                tot[r.level] = tot.get(r.level, ZERO) + r.size * b
            for lv, m in tot.items():
                per.setdefault(lv, []).append(m)
        out = {lv: sp.Max(*ms) for lv, ms in per.items()}
        if level is not None:
            return out.get(level, ZERO)
        return frozen(out)

    @property
    def intensity(self) -> sp.Expr:
        """FLOPs (all units) per byte crossing the top level."""
        top = self.form.hierarchy.top
        return sp.simplify(sum(self.flops.values(), ZERO) / self.bytes(top))

    def objective(self, level: str = "SMEM", dtypes=None, in_bytes: bool = False) -> sp.Expr:
        """Transfers into and out of ``level`` from above (what its capacity trades against)."""
        check_level(level, "objective")
        check_dtypes(dtypes, "objective")
        tot = ZERO
        for m in self.moves:
            if m.lower == level:
                tot += m.values * (resolve_dtype(m.array, m.dtype, dtypes).bytes if in_bytes else 1)
        return tot

    # ---- printing
    def table(self) -> str:
        lines = ["transfers (values):"] + [f"  {lv}: {e}" for lv, e in self.transfers.items()]
        lines += ["memory (values):"] + [f"  {lv}: {e}" for lv, e in self.memory.items()]
        lines += ["flops:"] + [f"  {u}: {e}" for u, e in self.flops.items()]
        return "\n".join(lines)

    __str__ = table

    def html(self, hw=None, dtype=None) -> str:
        """An HTML table per level (transfers, peak memory, ``hw``'s capacity; bytes at
        ``dtype`` beside the values) and the FLOPs per unit: the notebook view."""
        from .display import cost_html
        return cost_html(self, hw, dtype)

    def _repr_html_(self) -> str:
        return self.html()

    # ---- closed form
    def closed_form(self, level: str = "SMEM", bytes: bool = False, dtypes=None) -> ClosedForm:
        """``H*(M) = sum_t alpha_t M^(-beta_t)``: the transfers into ``level`` with tile sizes
        chosen to minimise them under ``memory(level) = M``.  Stream sizes (and tiles the
        transfers do not depend on) are taken as small and only the leading-order memory terms
        kept, which relaxes the constraint: the result is a lower bound on every integer
        choice.  Derived with sympy (Lagrange conditions); raises CostError when the optimum
        is not a sum of powers of M."""
        check_level(level, "closed_form")
        check_dtypes(dtypes, "closed_form")
        key = ("closed", level, bytes, dtype_key(dtypes))
        if key in self._cache:
            return self._cache[key]
        obj = sp.expand(self.objective(level, dtypes, bytes))
        if obj.has(sp.Min, sp.Max, sp.ceiling, sp.floor):
            # chunks a mask skips are counted with Min / Max of sizes (see .skips)
            raise CostError(f"the transfers into {level} are not a sum of products of sizes, so they "
                            f"have no closed form H*(M): {obj}")
        mem = self.memory_bytes(level, dtypes) if bytes else self.memory.get(level, ZERO)
        M = size_symbol(f"M_{level}")
        syms = {size_symbol(n): ops for n, ops in self.blocks.items()}
        var = sorted((s for s in syms if s in obj.free_symbols), key=str)
        small = {s: (0 if all(op == "stream" for op, _ in ops) else 1)
                 for s, ops in syms.items() if s not in var}
        mem0 = leading(dominant(sp.sympify(mem).subs(small), level), var)
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
        alphas, betas = powers(H, M)
        H = sp.Add(*(a * M ** (-b) for a, b in zip(alphas, betas)))
        cf = ClosedForm(alphas, betas, H, M, frozen({str(k): v for k, v in sol.items()}))
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
                 divides: bool = False, usable: bool = True, threads: int = THREADS) -> Optimum:
        """Exact integer search for the symbolic tile/stream sizes minimising the transfers into
        ``level`` subject to ``memory(level) <= capacity`` and ``require`` divisibility.

        Capacity: ``memory`` values if given (the paper's M), else ``hw.capacity(level)`` bytes
        with array sizes in bytes (``dtype``: a DType or ``{array: DType}``).  ``divides=True``
        keeps only tiles dividing their axis.  Transfers use the model's trip counts
        (``axis / tile``); ``transfers_ragged`` counts whole ragged last tiles.

        Usable tiles (``usable=True``, the default): every size left free is a multiple of 16 up
        to its axis (powers of two from 16 and multiples of a warp's 32 among them; an axis
        shorter than 16 is one block), the granule of the lowering's thread mappings; with
        ``hw`` the register level is a capacity too: a group's register-resident buffers and
        accumulator states, over ``threads`` threads, fit one micro-tile per thread (64 values),
        255 registers per thread and the SM's register file (:mod:`napkin_cat.costmodel.usable`).
        ``fixed`` sizes are taken as given.  The result also holds the optimum over every integer
        (``unconstrained``) and ``usable_gap``, what the usable choice costs against it;
        ``usable=False`` searches every integer (the paper's optimum) and checks no registers.

        >>> import napkin_cat as nc
        >>> q, x, d = nc.axes("q x d")
        >>> c = nc.cost(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"))
        >>> best = c.optimize({q: 8192, x: 8192, d: 128}, hw=nc.hardware.H100, dtype=nc.f16)
        >>> best.tiles, best.unconstrained.tiles, round(best.usable_gap, 2)
        ({'s_x': 16, 'g_q': 128}, {'s_x': 1, 'g_q': 453}, 3.41)
        >>> best.registers                       # o[g_q d], two score chunks, the row max and sum
        {'micro per thread': 64, 'per thread': 81, 'per SM': 20736}
        """
        best = search(self, sizes, hw, dtype, level, fixed, memory, divides, usable, threads)
        if not usable:
            return best
        free = search(self, sizes, hw, dtype, level, fixed, memory, divides, False, threads)
        ratio = float(sp.nsimplify(best.objective) / sp.nsimplify(free.objective)) if free.objective else 1.0
        return replace(best, unconstrained=free, usable_gap=ratio)

    # ---- occupancy and time
    def occupancy(self, hw, sizes: Mapping, dtype=None, level: str = "SMEM", stages: int = 1,
                  capacity: int | None = None) -> Occupancy:
        """Groups per SM ``(M_max - stages * M_block) / M_group``: memory terms that scale with a
        tile size belong to one group; the rest (streamed chunks) is shared by the block and
        multiplied by ``stages`` (buffers in flight when loads are pipelined)."""
        check_hw(hw, "occupancy")
        check_level(level, "occupancy")
        check_dtypes(dtype, "occupancy")
        positive_int(stages, "occupancy: stages")
        if capacity is not None:
            positive_int(capacity, "occupancy: capacity")
        subs = self._subs(sizes)
        tile_syms = {size_symbol(n) for n, ops in self.blocks.items() if any(op == "tile" for op, _ in ops)}
        axis_subs = {k: v for k, v in subs.items() if k not in tile_syms}
        expr = dominant(sp.sympify(self.memory_bytes(level, dtype)).subs(axis_subs), level)
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
        check_hw(hw, "time")
        if device_loops(self.form):
            raise CostError(f"time: {self.diagram.short()} is split over the devices and this roofline is "
                            f"one GPU's; use cost.devices(hw, sizes) for the per-device timing with the link")
        check_level(level, "time")
        check_dtypes(dtype, "time")
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
                    prec = max((resolve_dtype(nm, dt, dtype) for nm, dt in o.precision), key=lambda t: t.bytes,
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
        for combo in product(cands):
            if fits(*combo) > cap:
                continue
            g = groups_f(*combo)
            busy = g / (math.ceil(g / hw.sms) * hw.sms)
            t = max([f(*combo) / busy for f in unit_f] + [f(*combo) for f in mem_f])
            if best is None or t < best[0]:
                best = (t, combo)
        tiles = {**given, **{s.name: int(v) for s, v in zip(free, best[1])}}
        return self._roofline(hw, subs, tiles, dtype)

    def devices(self, hw, sizes: Mapping, dtype=None):
        """Per-device timing of a split over the devices, link transfers overlapped with the
        compute (:func:`.links.device_time`)."""
        return device_time(self, hw, sizes, dtype)

    def _roofline(self, hw, subs, tiles, dtype) -> Timing:
        allsubs = {**subs, **{size_symbol(k): sp.Integer(v) for k, v in tiles.items()}}
        compute: dict[str, float] = {u: 0.0 for u in UNITS}
        total_flops = 0.0
        for o in self.ops:
            n = float(o.total.subs(allsubs))
            total_flops += n
            prec = max((resolve_dtype(nm, dt, dtype) for nm, dt in o.precision), key=lambda t: t.bytes,
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
                            f"(tiles {tiles}, dtype {dtype_name(dtype)})")
        worst = max([(t, f"compute:{u}") for u, t in compute.items()] + [(t, lv) for lv, t in mem_t.items()])
        return Timing(worst[0], frozen(compute), frozen(mem_t), worst[1], frozen(tiles), groups, occupancy,
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
        is the exact integer optimum over every size (``usable=False``; tiles capped at their
        axes); ``closed_seconds`` uses the closed form, which beyond the size where a tile covers
        its axis undercuts the compulsory traffic."""
        check_hw(hw, "multilevel")
        check_level(level, "multilevel")
        check_dtypes(dtype, "multilevel")
        if cluster is not None:
            positive_int(cluster, "multilevel: cluster")
        if hierarchy is not None and not isinstance(hierarchy, Hierarchy):
            raise CostError(f"multilevel: hierarchy must be a Hierarchy, got {hierarchy!r}")
        h = hierarchy or self.hierarchy or make_hierarchy(l2=True, cluster=cluster is not None)
        q = (dtype.bytes if isinstance(dtype, DType) else uniform_bytes(self, level, dtype))
        if q is None:
            raise CostError("multilevel needs one dtype (bytes per value) for every array")
        try:
            cf = self.closed_form(level)
        except CostError:
            cf = None
        subs = self._subs(sizes)

        def H(M_values: int):
            opt = self.optimize(sizes, memory=M_values, level=level, usable=False)
            closed = number(cf.at(M_values, subs)) if cf is not None else None
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
        return MultiLevel(frozen({k: frozen(v) for k, v in out.items()}), total, closed_total)

    def cross_transfer(self, M_c, N: int, inv_bw_outer, inv_bw_cluster, level: str = "SMEM",
                       sizes: Mapping | None = None) -> sp.Expr:
        """Theorem 3: with clusters of ``N`` cores exchanging data at cost ``inv_bw_cluster``
        per value, the transfers into ``level`` cost
        ``(inv_bw_outer - inv_bw_cluster) H*(N M_c) + inv_bw_cluster H*(M_c)``
        instead of ``inv_bw_outer H*(M_c)``."""
        positive_int(N, "cross_transfer: N (cores per cluster)")
        cf = self.closed_form(level)
        subs = self._subs(sizes or {})
        Hn, H1 = cf.at(N * M_c, subs), cf.at(M_c, subs)
        return sp.nsimplify(inv_bw_outer - inv_bw_cluster) * Hn + sp.nsimplify(inv_bw_cluster) * H1
