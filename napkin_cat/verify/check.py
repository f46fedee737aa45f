"""``check_equivalent``: two diagrams compute the same function, checked against NumPy.

Hypothesis draws every symbolic axis size (``1 .. max_size``, and up to ``max_chunks`` times a
concrete block, with a ragged tail, so that 4 or more chunks occur), every symbolic block size of
a relabelled diagram (``tile(q, "g_q")``: ``1 .. max_size``, small ones favoured, multiples of
``require``), a data regime and a seed.  The inputs come from ``np.random.default_rng(seed)`` in that regime:

``normal``    standard normal
``huge``      standard normal times ``1e4`` (scores near +-1e8: ``exp`` under- and overflows)
``repeated``  integers in ``{-1, 0, 1}`` (many equal values: repeated maxima)
``huge_one_sign``  ``|normal| * 1e4`` with one random sign per array: every score of a
              product of two such arrays has the same sign, e.g. all far below zero
``jumps``     standard normal plus a ramp of 10-300 along one random axis of each array: the
              running maximum of the scores jumps by about 10-100 between chunks, where the
              online rescale ``exp(mu - mu')`` matters and is neither 1 nor 0
``masked``    only for inputs that reach a softmax-like box through elementwise boxes (a score
              or bias input): ``-inf`` entries and fully ``-inf`` rows

Diagrams with masks also get sizes with more rows than columns, where window masks leave
rows fully masked.  Both diagrams run through :func:`napkin_cat.evaluate` in float64 and are
compared with the float64 tolerances (``|a - b| <= atol * scale + rtol * |a|`` with ``scale``
the largest finite magnitude of the output, at least 1); NaN and infinite entries must agree
exactly.  A failure is shrunk by Hypothesis to a minimal counterexample (smallest sizes,
plainest regime, smallest seed) and raised as :class:`~napkin_cat.core.errors.EquivalenceError`
whose message ends with Python code that reproduces it.  A check that ran no example (a time
budget of 0, say) raises :class:`~napkin_cat.core.errors.UnverifiedError`: it is never a pass.

Generated kernels are checked the same way (:mod:`napkin_cat.verify.kernelcheck`):
``check_equivalent(oracle, kernel)`` runs a :class:`~napkin_cat.lowering.Kernel` at its bound sizes,
``check_equivalent(oracle, relabelled, lowered=True)`` also lowers the relabelled diagram at
every drawn size, block and ``lower`` option (threads, prefetch) and runs it.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q=q, x=x, d=d)
>>> report = nc.check_equivalent(attn, attn.stream(x, 4).tile(q, "g_q"), examples=5, seed=0)
>>> report.examples
5
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..core.diagram import Axis, Box, Diagram
from ..core.errors import EquivalenceError, LoweringError, NapkinError, TypingError, UnverifiedError
from ..relabel.rules import requirements

# (rtol, atol) per dtype the comparison runs in; evaluation is float64 (the reference)
TOLERANCES: dict[str, tuple[float, float]] = {
    "f64": (1e-9, 1e-9), "f32": (1e-5, 1e-6), "f16": (1e-2, 1e-3), "bf16": (2e-2, 1e-2),
    "fp8_e4m3": (1.5e-1, 5e-2), "fp8_e5m2": (2.5e-1, 1e-1), "i8": (0.0, 0.0),
}
REFERENCE_DTYPE = "f64"

# boxes through which a -inf score stays a masked score (the "masked" regime's reach)
_PASS_KINDS = ("mask", "index_bias", "cast")
_PASS_FNS = ("add", "sub", "scale", "shift", "identity", "maximum")


# --------------------------------------------------------------------------- data regimes

def masked_normal(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard normal scores with about half the entries ``-inf`` and about a quarter of the
    rows (all but the last axis) entirely ``-inf``: partially and fully masked rows."""
    x = rng.standard_normal(shape)
    x[rng.random(shape) < 0.5] = -np.inf
    if len(shape) > 0:
        x[rng.random(shape[:-1]) < 0.25] = -np.inf
    return x


def jumps(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard normal plus a ramp of amplitude 10-300 (random sign) along one random axis:
    a contraction with such an array makes scores whose running maximum jumps by about
    10-100 from one chunk to the next."""
    x = rng.standard_normal(shape)
    if len(shape) == 0:
        return x
    k = int(rng.integers(len(shape)))
    amp = rng.uniform(10.0, 300.0) * rng.choice([-1.0, 1.0])
    ramp = np.arange(shape[k], dtype=float) / max(shape[k], 1)
    return x + amp * ramp.reshape([-1 if i == k else 1 for i in range(len(shape))])


# regime -> (generator, code template); the template is what the reproducer prints
REGIMES = {
    "normal": (lambda rng, s: rng.standard_normal(s), "rng.standard_normal({s})"),
    "huge": (lambda rng, s: rng.standard_normal(s) * 1e4, "rng.standard_normal({s}) * 1e4"),
    "repeated": (lambda rng, s: rng.integers(-1, 2, s).astype(float), "rng.integers(-1, 2, {s}).astype(float)"),
    "huge_one_sign": (lambda rng, s: rng.choice([-1.0, 1.0]) * np.abs(rng.standard_normal(s)) * 1e4,
                      "rng.choice([-1.0, 1.0]) * np.abs(rng.standard_normal({s})) * 1e4"),
    "jumps": (jumps, "jumps(rng, {s})"),
    "masked": (masked_normal, "masked_normal(rng, {s})"),
}
_INT_DATA = (lambda rng, s: rng.integers(-4, 5, s).astype(np.int8), "rng.integers(-4, 5, {s}).astype(np.int8)")


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class EquivalenceReport:
    """What a passing check ran: examples, largest errors seen, time, sizes and regimes."""

    examples: int
    max_abs_error: float
    max_rel_error: float
    seconds: float
    sizes_tried: tuple[tuple[str, int, int], ...]   # (symbol, smallest, largest)
    regimes_tried: tuple[tuple[str, int], ...]      # (regime, examples)
    stopped_by_time: bool = False
    kernels: int = 0                                 # generated kernels run against the oracle
    refused: tuple[str, ...] = ()                    # lowerings refused (lowered=True), one reason each

    def _kernel_str(self) -> str:
        if not self.kernels:
            return ""
        refused = f", {len(self.refused)} configuration(s) refused by lower()" if self.refused else ""
        return f"; {self.kernels} kernel run(s) against the oracle{refused}"

    def __str__(self) -> str:
        sizes = ", ".join(f"{s} in {lo}..{hi}" for s, lo, hi in self.sizes_tried) or "fixed sizes"
        regimes = ", ".join(f"{r} x{n}" for r, n in self.regimes_tried)
        budget = " (stopped by the time budget)" if self.stopped_by_time else ""
        return (f"equivalent on {self.examples} examples{budget} in {self.seconds:.2f} s: "
                f"max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}; "
                f"{sizes}; data {regimes}{self._kernel_str()}")


@dataclass(frozen=True)
class _Example:
    sizes: dict          # axis-size symbol -> int
    blocks: dict         # block-size symbol -> int
    regime: str
    seed: int
    options: dict = field(default_factory=dict)   # lower() options drawn (lowered=True)


@dataclass
class _Outcome:
    abs_error: float = 0.0
    rel_error: float = 0.0
    failure: dict | None = None


class _Mismatch(AssertionError):
    """Raised inside the Hypothesis test so that it shrinks; never leaves this module."""


class _OutOfTime(BaseException):
    """Stops Hypothesis when the time budget is spent (not an ``Exception``: not a failure)."""


# --------------------------------------------------------------------------- the problem

@dataclass
class _Problem:
    a: Diagram
    b: Diagram
    fixed: dict                      # user-fixed sizes, str keys
    symbols: dict                    # axis-size symbol -> upper bound
    blocks: dict                     # block symbol -> required multiple
    masks: list                      # (row symbol, col symbol)
    regimes: tuple
    score_inputs: frozenset          # dom positions that reach a softmax-like box elementwise
    score_params: frozenset
    params: dict                     # param name -> Array
    max_size: int
    axis_symbol: dict = field(default_factory=dict)  # axis name -> size symbol or int

    @staticmethod
    def build(a: Diagram, b: Diagram, sizes: dict, max_size: int, max_chunks: int = 6) -> "_Problem":
        axis_symbol: dict[str, object] = {}
        for d in (a, b):
            for ax in d.axes:
                axis_symbol.setdefault(ax.name, ax.size)
        fixed = _fixed_sizes(sizes, a, b, axis_symbol)
        # an axis fixed by name fixes its symbol too
        for name, sym in list(axis_symbol.items()):
            if name in fixed and isinstance(sym, str):
                fixed.setdefault(sym, fixed[name])
        block_for: dict[str, int] = {}   # size symbol -> largest concrete block on its axes
        blocks: dict[str, int] = {}
        for d in (a, b):
            req = requirements(d)
            for r in d.schedule:
                if r.op not in ("tile", "stream"):
                    continue
                sym = axis_symbol.get(r.axis)
                if isinstance(r.size, int):
                    if isinstance(sym, str):
                        block_for[sym] = max(block_for.get(sym, 0), r.size)
                elif r.size not in fixed and r.size not in axis_symbol.values():
                    k = req.get(r.axis, 1)
                    blocks[r.size] = math.lcm(blocks.get(r.size, 1), k)
        masks = []
        for d in (a, b):
            for e in d.eqns:
                if e.box.kind in ("mask", "index_bias"):
                    rs, cs = axis_symbol[e.box.param("row")], axis_symbol[e.box.param("col")]
                    if isinstance(rs, str) and isinstance(cs, str) and rs != cs and (rs, cs) not in masks:
                        masks.append((rs, cs))
        # a mask compares global row and column indices: blocks on one matter to the other
        for rs, cs in masks:
            if rs in block_for or cs in block_for:
                block_for[rs] = block_for[cs] = max(block_for.get(rs, 0), block_for.get(cs, 0))
        symbols = {}   # symbol -> (upper bound, smallest size with two chunks, or 0)
        for sym in axis_symbol.values():
            if isinstance(sym, str) and sym not in fixed and sym not in symbols:
                blk = block_for.get(sym, 0)
                upper = max(max_size, max_chunks * blk - 1)   # up to max_chunks chunks, the last ragged
                symbols[sym] = (upper, blk if blk and blk < upper else 0)
        masks = [(rs, cs) for rs, cs in masks if rs in symbols and cs in symbols]
        score_inputs, score_params = set(), set()
        params = {}
        for d in (a, b):
            ins, ps = _score_like(d)
            score_inputs |= ins
            score_params |= ps
            for e in d.eqns:
                if e.box.kind == "param":
                    params.setdefault(e.box.param("pname"), e.box.cod[0])
        regimes = ("normal", "repeated", "huge", "huge_one_sign", "jumps") + \
            (("masked",) if score_inputs or score_params else ())
        return _Problem(a, b, fixed, symbols, blocks, masks, regimes, frozenset(score_inputs),
                        frozenset(score_params), params, max_size, axis_symbol)

    # ---- drawing
    def draw(self, data, st, options: dict | None = None) -> _Example:
        sizes: dict[str, int] = {}
        tall = {}
        for rs, cs in self.masks:  # rows beyond the columns: fully masked rows under a window
            if rs not in tall:
                tall[rs] = cs
        for sym, (upper, multi) in self.symbols.items():
            if sym in tall and tall[sym] in sizes and data.draw(st.booleans(), label=f"{sym} > {tall[sym]}"):
                lo = min(sizes[tall[sym]] + 1, upper)
                sizes[sym] = data.draw(st.integers(lo, upper), label=sym)
            elif multi:  # most draws cross a concrete block (multi): two or more chunks, or four or more
                many = min(3 * multi + 1, upper)
                sizes[sym] = data.draw(st.one_of(st.integers(1, upper), st.integers(multi + 1, upper),
                                                 st.integers(many, upper)), label=sym)
            else:
                sizes[sym] = data.draw(st.integers(1, upper), label=sym)
        blocks = {}
        for sym, k in self.blocks.items():
            top = max(1, self.max_size // k)   # small blocks favoured: many chunks per axis
            blocks[sym] = k * data.draw(st.one_of(st.integers(1, min(3, top)), st.integers(1, top)),
                                        label=f"{sym} / {k}" if k > 1 else sym)
        regime = data.draw(st.sampled_from(self.regimes), label="regime")
        seed = data.draw(st.integers(0, 2 ** 32 - 1), label="seed")
        drawn = {k: data.draw(st.sampled_from(v), label=k) for k, v in (options or {}).items()}
        return _Example(sizes, blocks, regime, seed, drawn)

    def axis_sizes(self, ex: _Example) -> dict[str, int]:
        out = {}
        for name, sym in self.axis_symbol.items():
            if isinstance(sym, int):
                out[name] = sym
            else:
                out[name] = ex.sizes.get(sym, self.fixed.get(sym, self.fixed.get(name)))
        return out

    def eval_sizes(self, ex: _Example) -> dict:
        return {**self.fixed, **ex.sizes, **ex.blocks}

    @staticmethod
    def sizes_for(d: Diagram, sizes: dict) -> dict:
        """The entries of ``sizes`` that name an axis, size symbol or block of ``d``."""
        known = {ax.name for ax in d.axes} | {ax.size for ax in d.axes if ax.symbolic} | \
            {r.size for r in d.schedule if isinstance(r.size, str)}
        return {k: v for k, v in sizes.items() if k in known}

    def input_specs(self, ex: _Example):
        """(label, shape, (generator, template)) for every input then every param, in rng order."""
        ax = self.axis_sizes(ex)
        specs = []
        for i, arr in enumerate(self.a.dom):
            shape = tuple(int(ax[n]) for n in arr.axis_names)
            specs.append(("in", i, arr, shape, self._regime_for(arr, ex.regime, i in self.score_inputs)))
        for name in sorted(self.params):
            arr = self.params[name]
            shape = tuple(int(ax[n]) for n in arr.axis_names)
            specs.append(("param", name, arr, shape, self._regime_for(arr, ex.regime, name in self.score_params)))
        return specs

    @staticmethod
    def _regime_for(arr, regime, score_like):
        if arr.dtype.kind == "int":
            return _INT_DATA
        if regime == "masked" and not score_like:
            return REGIMES["normal"]
        return REGIMES[regime]

    def data(self, ex: _Example):
        rng = np.random.default_rng(ex.seed)
        inputs, params = [], {}
        for kind, key, arr, shape, (gen, _) in self.input_specs(ex):
            x = gen(rng, shape)
            if kind == "in":
                inputs.append(x)
            else:
                params[key] = x
        return inputs, params


def _fixed_sizes(sizes, a: Diagram, b: Diagram, axis_symbol: dict) -> dict[str, int]:
    """``sizes`` as ``{symbol or name: int}``; unknown keys and non-positive or non-integer
    sizes are refused by name."""
    if sizes is None:
        return {}
    if not isinstance(sizes, dict):
        raise TypingError(f"check_equivalent: sizes must be a dict {{axis: size}}, got {type(sizes).__name__}")
    known = set(axis_symbol) | {s for s in axis_symbol.values() if isinstance(s, str)}
    known |= {r.size for d in (a, b) for r in d.schedule if isinstance(r.size, str)}
    fixed = {}
    for key, n in sizes.items():
        name = key.size if isinstance(key, Axis) and key.symbolic else getattr(key, "name", key)
        if not isinstance(name, str) or name not in known:
            raise TypingError(f"check_equivalent: sizes names {key!r}, which is no axis, size symbol or block "
                              f"of the diagrams; known: {sorted(known)}")
        if isinstance(n, bool) or not hasattr(n, "__index__") or int(n) < 1:
            raise TypingError(f"check_equivalent: sizes[{name!r}] must be a positive integer, got {n!r}")
        fixed[name] = int(n)
    return fixed


def _score_like(d: Diagram) -> tuple[set, set]:
    """Inputs (dom positions) and params (names) whose values reach the score operand of a
    softmax-like box through elementwise boxes only: where ``-inf`` means "masked"."""
    score: set[int] = set()
    for e in d.eqns:
        box = e.box
        soft = box.kind in ("softmax", "softmax_contract") or \
            (box.kind == "reduce" and box.param("op") in ("max", "logsumexp")) or \
            (box.kind in ("normalize", "norm_contract") and box.param("a1") == "exp")
        if soft:
            score.add(e.ins[0])
    for k in reversed(range(len(d.eqns))):
        e = d.eqns[k]
        if not any(v in score for v in d.eqn_outputs(k)):
            continue
        box = e.box
        passes = box.kind in _PASS_KINDS or (box.kind == "map" and box.param("fn") in _PASS_FNS) or \
            (box.kind == "reindex" and box.param("op") == "transpose")
        if passes:
            score.update(e.ins)
    n = len(d.dom)
    ins = {v for v in score if v < n}
    params = set()
    for k, e in enumerate(d.eqns):
        if e.box.kind == "param" and d.eqn_outputs(k)[0] in score:
            params.add(e.box.param("pname"))
    return ins, params


# --------------------------------------------------------------------------- comparing

def _tolerance(dtype_tolerance) -> tuple[float, float]:
    if dtype_tolerance is None:
        return TOLERANCES[REFERENCE_DTYPE]
    if isinstance(dtype_tolerance, dict):
        return dtype_tolerance.get(REFERENCE_DTYPE, TOLERANCES[REFERENCE_DTYPE])
    if isinstance(dtype_tolerance, (int, float)) and not isinstance(dtype_tolerance, bool) and dtype_tolerance >= 0:
        return float(dtype_tolerance), float(dtype_tolerance)
    ok = isinstance(dtype_tolerance, (tuple, list)) and len(dtype_tolerance) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in dtype_tolerance)
    if not ok:
        raise NapkinError(f"check_equivalent: dtype_tolerance must be (rtol, atol), one number >= 0 or "
                          f"{{dtype name: (rtol, atol)}}, got {dtype_tolerance!r}")
    rtol, atol = dtype_tolerance
    return float(rtol), float(atol)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _compare(problem: _Problem, ex: _Example, rtol: float, atol: float) -> _Outcome:
    inputs, params = problem.data(ex)
    sizes = problem.eval_sizes(ex)
    results, errors = [], []
    from .executor import evaluate
    for d in (problem.a, problem.b):
        try:
            with np.errstate(all="ignore"):   # adversarial data overflows on purpose
                results.append(_as_tuple(evaluate(d, *inputs, sizes=problem.sizes_for(d, sizes), params=params)))
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - a crash on one side is a difference
            results.append(None)
            errors.append(e)
    if errors[0] is not None and errors[1] is not None:
        raise errors[0]
    if any(e is not None for e in errors):
        side = "a" if errors[0] is not None else "b"
        err = errors[0] or errors[1]
        return _Outcome(math.inf, math.inf, {"kind": "error", "side": side,
                                             "error": f"{type(err).__name__}: {err}"})
    out = _Outcome()
    for i, (ra, rb) in enumerate(zip(*results)):
        ra, rb = np.asarray(ra, dtype=np.float64), np.asarray(rb, dtype=np.float64)
        fa, fb = np.isfinite(ra), np.isfinite(rb)
        both = fa & fb
        scale = max(1.0, float(np.max(np.abs(ra[fa]), initial=0.0)), float(np.max(np.abs(rb[fb]), initial=0.0)))
        diff = np.where(both, np.abs(ra - np.where(both, rb, 0.0)), 0.0)
        allowed = atol * scale + rtol * np.abs(np.where(both, ra, 0.0))
        nonfinite_bad = (fa != fb) | (~fa & ~fb & ~((ra == rb) | (np.isnan(ra) & np.isnan(rb))))
        bad = (both & (diff > allowed)) | nonfinite_bad
        note_difference(out, i, problem.a.cod[i], ra, rb, diff, both, bad, allowed, atol * scale)
    return out


def note_difference(out, i: int, arr, ra, rb, diff, both, bad, allowed, floor) -> None:
    """Fold output ``i``'s differences into ``out``: the largest errors, and the first entry
    that is not allowed (with its coordinates) unless a failure is already recorded."""
    if diff.size:
        out.abs_error = max(out.abs_error, float(diff.max()))
        rel_floor = np.maximum(np.abs(np.where(both, ra, 0.0)), floor)
        out.rel_error = max(out.rel_error, float((diff / rel_floor).max()))
    if bad.any() and out.failure is None:
        idx = tuple(int(j) for j in np.argwhere(bad)[0])
        out.failure = {"kind": "values", "output": i, "output_name": arr.name,
                       "index": idx, "coordinates": dict(zip(arr.axis_names, idx)),
                       "a_value": float(ra[idx]), "b_value": float(rb[idx]),
                       "allowed": float(allowed[idx]), "differing": int(bad.sum()), "total": int(bad.size)}


# --------------------------------------------------------------------------- the check

def check_equivalent(a, b, *, examples: int | None = None, time_budget: float | None = None,
                     sizes: dict | None = None, max_size: int = 12, max_chunks: int = 6, dtype_tolerance=None,
                     progress: bool | None = None, seed: int | None = None, lowered: bool = False,
                     lower_options: dict | None = None) -> EquivalenceReport:
    """Check that ``a`` and ``b`` compute the same function; a report, or an
    :class:`EquivalenceError` carrying the shrunk counterexample (with reproducing code).

    ``a``, ``b``: diagrams, or a diagram (the oracle) and a generated
    :class:`~napkin_cat.lowering.Kernel`, run at its bound sizes on drawn data.
    ``lowered=True``: also lower ``b`` at every drawn size and block, with ``lower`` options drawn
    from ``lower_options`` (``{option: candidates}``, default
    :data:`napkin_cat.verify.kernelcheck.DEFAULT_OPTIONS`), and check that kernel against ``a``.
    ``examples``: Hypothesis examples before shrinking (default 60, 20 when kernels run);
    ``time_budget``: seconds, after which the check stops (a failure found so far is still
    reported, shrunk as far as time allowed; no example at all raises :class:`UnverifiedError`);
    ``sizes``: fixed sizes (axis names, Axis values or symbol names); ``max_size``: largest drawn
    size; ``max_chunks``: axes with a concrete block go up to that many blocks (the last ragged);
    ``dtype_tolerance``: ``(rtol, atol)``, one number, or ``{dtype name: (rtol, atol)}``
    (default :data:`TOLERANCES` for float64, :data:`napkin_cat.verify.kernelcheck.KERNEL_TOLERANCES` for
    kernels); ``progress``: a tqdm bar on stderr (``None``: only on a terminal, after a second);
    ``seed``: a fixed Hypothesis seed (reproducible).
    """
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis import strategies as st

    from . import kernelcheck as kc

    kernel = None
    if kc.is_kernel(a) and not kc.is_kernel(b):
        a, b = b, a   # the oracle first
    if kc.is_kernel(b):
        if lowered or lower_options is not None:
            raise NapkinError("check_equivalent: lowered=True / lower_options lower a relabelled Diagram; "
                              f"b is already the Kernel {b.name}, so they would be ignored")
        if sizes:
            raise NapkinError(f"check_equivalent: sizes would be ignored: the kernel {b.name} runs at its bound "
                              f"sizes ({b.diagram.short()})")
        kernel = b
        a = kc.bind_oracle(a, kernel)
        b = kernel.diagram
    for d, side in ((a, "a"), (b, "b")):
        if not isinstance(d, Diagram):
            raise TypingError(f"check_equivalent: {side} must be a Diagram or a Kernel, got {type(d).__name__}")
    if kernel is None and (a.dom != b.dom or a.cod != b.cod):
        which = "dom" if a.dom != b.dom else "cod"
        raise TypingError(f"check_equivalent: the diagrams have different types ({which} differs), "
                          f"so they cannot be equivalent\n  a: {a.short()}\n  b: {b.short()}")
    if lower_options is not None and not lowered:
        raise NapkinError("check_equivalent: lower_options is only read with lowered=True; it would be ignored")
    if not isinstance(lowered, bool):
        raise NapkinError(f"check_equivalent: lowered must be True or False, got {lowered!r}")
    runs_kernels = kernel is not None or lowered
    if examples is None:
        examples = 20 if runs_kernels else 60
    for name, value, low in (("examples", examples, 1), ("max_size", max_size, 1), ("max_chunks", max_chunks, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise NapkinError(f"check_equivalent: {name} must be an int >= {low}, got {value!r}")
    if time_budget is not None and (isinstance(time_budget, bool) or not isinstance(time_budget, (int, float))
                                    or not time_budget >= 0):
        raise NapkinError(f"check_equivalent: time_budget must be a number of seconds >= 0, got {time_budget!r}")
    from ..relabel.loopnest import final_form
    for d in (a, b):
        if d.schedule:
            final_form(d)   # a schedule with no loop nest is refused here, with its reason
    problem = _Problem.build(a, b, sizes, max_size, max_chunks)
    rtol, atol = _tolerance(dtype_tolerance)
    options = {}
    if lowered:
        from .backend import backend
        options = kc.check_lower_options(lower_options,
                                         backend("simulator_active")() or not backend("driver_present")())
    krtol, katol = (kc.KERNEL_TOLERANCES["f32"] if dtype_tolerance is None else (rtol, atol))
    kernels: dict = {}   # (bound diagram, options) -> Kernel or the LoweringError text

    def kernel_for(ex: _Example):
        if kernel is not None:
            return kernel
        bound = b.bind(problem.eval_sizes(ex))
        key = (bound, tuple(sorted(ex.options.items(), key=str)))
        if key not in kernels:
            lower = backend("lower")
            try:
                kernels[key] = lower(bound, verify=False, **ex.options)
            except LoweringError as e:
                kernels[key] = f"{_size_str(ex)} {kc.lowering_call(ex.options)[2:]}: {e}"
        return kernels[key]

    def compare(ex: _Example) -> tuple[_Outcome, bool]:
        """The example's outcome, and whether a kernel ran."""
        outcome = _Outcome() if kernel is not None else _compare(problem, ex, rtol, atol)
        if not runs_kernels or outcome.failure is not None:
            return outcome, False
        k = kernel_for(ex)
        if isinstance(k, str):
            run["refused"].setdefault(k, None)
            return outcome, False
        inputs, _ = problem.data(ex)
        diff = kc.kernel_outcome(a, k, inputs, problem.sizes_for(a, problem.eval_sizes(ex)), rtol=krtol, atol=katol)
        if diff.failure is not None:
            diff.failure.update(kernel=k, options=dict(ex.options), mode="kernel" if kernel is not None else "lowered",
                                rtol=krtol, atol=katol)
        return _Outcome(max(outcome.abs_error, diff.abs_error), max(outcome.rel_error, diff.rel_error),
                        diff.failure), True

    from tqdm.auto import tqdm
    bar = tqdm(total=examples, desc="check_equivalent", unit="ex", file=sys.stderr, leave=False,
               disable=(None if progress is None else not progress), delay=1.0 if progress is None else 0.0)
    run = {"n": 0, "abs": 0.0, "rel": 0.0, "failures": set(), "failure": None, "sizes": {}, "regimes": {},
           "timed_out": False, "kernels": 0, "refused": {}}
    t0 = time.perf_counter()

    @given(st.data())
    def prop(data):
        ex = problem.draw(data, st, options)
        if time_budget is not None and time.perf_counter() - t0 >= time_budget:
            # after the draws: Hypothesis requires every run to draw consistently
            run["timed_out"] = True
            raise _OutOfTime()
        outcome, ran_kernel = compare(ex)
        if run["failure"] is None:
            run["n"] += 1
            run["kernels"] += ran_kernel
            bar.update(1)
            run["abs"] = max(run["abs"], outcome.abs_error)
            run["rel"] = max(run["rel"], outcome.rel_error)
            for sym, n in ex.sizes.items():
                lo, hi = run["sizes"].get(sym, (n, n))
                run["sizes"][sym] = (min(lo, n), max(hi, n))
            run["regimes"][ex.regime] = run["regimes"].get(ex.regime, 0) + 1
        if outcome.failure is not None:
            if run["failure"] is None:
                run["examples_before"] = run["n"]
                bar.set_description("check_equivalent: shrinking a counterexample")
            run["failures"].add((tuple(ex.sizes.items()), tuple(ex.blocks.items()), ex.regime, ex.seed,
                                 tuple(sorted(ex.options.items(), key=str))))
            run["failure"] = (ex, outcome.failure)
            bar.set_postfix_str(_size_str(ex))
            raise _Mismatch("the diagrams differ")

    settings_ = settings(settings.default, max_examples=examples, deadline=None, database=None,
                         derandomize=settings.default.derandomize if seed is None else False,
                         phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
                         verbosity=Verbosity.quiet, print_blob=False,
                         suppress_health_check=list(HealthCheck))
    test = settings_(prop)
    if seed is not None:
        test = hyp_seed(seed)(test)
    try:
        test()
    except (_OutOfTime, _Mismatch):
        pass
    except BaseExceptionGroup:  # several distinct failures (or a flaky one): report ours
        if run["failure"] is None:
            raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    if run["failure"] is not None:
        ex, failure = run["failure"]
        rerun = _rerun(compare, ex) if runs_kernels and failure.get("kernel") is not None else None
        raise EquivalenceError(*_counterexample(problem, ex, failure, run, seconds, rtol, atol, rerun))
    refused = tuple(run["refused"])
    if run["n"] == 0:
        raise UnverifiedError(f"check_equivalent ran no example in {seconds:.2f} s (time_budget={time_budget!r}): "
                              f"nothing was verified, so this is not a pass\n  a: {a.short()}\n  b: {b.short()}")
    if lowered and run["kernels"] == 0:
        raise LoweringError(f"check_equivalent(lowered=True): lower() refused every one of the {len(refused)} "
                               f"drawn configuration(s), so no kernel was checked; first: {refused[0]}")
    report = EquivalenceReport(run["n"], run["abs"], run["rel"], seconds,
                               tuple((s, lo, hi) for s, (lo, hi) in run["sizes"].items()),
                               tuple(sorted(run["regimes"].items())), run["timed_out"], run["kernels"], refused)
    if kernel is not None:   # the kernel carries what it was checked against
        kernel.notes += (f"Checked by nc.check_equivalent against {a.short()}: {report}.",)
    return report


def _rerun(compare, ex: _Example) -> tuple[int, int]:
    """(reproduced, tries): a kernel counterexample run again, since races make failures flaky."""
    from .kernelcheck import RERUNS
    hits = sum(compare(ex)[0].failure is not None for _ in range(RERUNS))
    return hits, RERUNS


# --------------------------------------------------------------------------- the counterexample

def _size_str(ex: _Example) -> str:
    return " ".join(f"{k}={v}" for k, v in {**ex.sizes, **ex.blocks}.items())


_NAMESPACE_CODE = ("from napkin_cat.core import *  # Diagram, Ty, Array, Axis, Box, Eqn, Relabel, dtypes\n"
                   "from napkin_cat.ops import AxisPower, IndexBias, Predicate")

SAVED: dict[str, Diagram] = {}   # diagrams whose repr does not evaluate back, by reproducer key


def saved(key: str) -> Diagram:
    """A diagram a reproducer could not print as code (a lambda inside), kept for this session."""
    try:
        return SAVED[key]
    except KeyError:
        raise NapkinError(f"no saved diagram {key!r} in this Python session: the reproducer that names it "
                          f"runs only in the session that printed it") from None


def _custom_functions(value) -> list:
    """The Python functions inside custom predicates and index biases of a diagram or box."""
    from ..ops.index import IndexBias, Predicate
    if isinstance(value, Diagram):
        return [f for e in value.eqns for f in _custom_functions(e.box)]
    if isinstance(value, Box):
        return [f for _, v in value.params for f in _custom_functions(v)]
    if isinstance(value, (Predicate, IndexBias)):
        return [value.fn] if value.fn is not None else []
    if isinstance(value, (tuple, list)):
        return [f for v in value for f in _custom_functions(v)]
    return []


def _diagram_code(d: Diagram, label: str) -> tuple[list[str], str]:
    """(import lines, ``label = ...``): the diagram as code that evaluates back to it; module
    functions in custom predicates are imported; what cannot be printed is kept in :data:`SAVED`."""
    ns: dict = {}
    exec(_NAMESPACE_CODE, ns)
    imports = []
    for fn in _custom_functions(d):
        mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if mod and mod != "__main__" and qual.isidentifier() and qual == getattr(fn, "__name__", None):
            line = f"from {mod} import {qual}"
            try:
                exec(line, ns)
            except Exception:  # noqa: BLE001 - not importable: the SAVED fallback below
                continue
            imports.append(line)
    text = repr(d)
    try:
        if eval(text, ns) == d:
            return imports, f"{label} = {text}"
    except Exception:  # noqa: BLE001 - a lambda's repr does not evaluate back
        pass
    key = f"{label}-{len(SAVED)}"
    SAVED[key] = d
    return (["from napkin_cat.verify.check import saved"],
            f"{label} = saved({key!r})  # the diagram passed as '{label}': its repr does not evaluate back "
            f"(a lambda in a predicate?), so it is kept for this Python session")


def _var_names(problem: _Problem) -> list[str]:
    taken = {"np", "nc", "a", "b", "rng", "sizes", "params", "out_a", "out_b", "masked_normal", "jumps",
             "kernel", "saved"}
    names = []
    for i, arr in enumerate(problem.a.dom):
        n = arr.name if arr.name.isidentifier() and arr.name != "_" else f"x{i}"
        while n in taken:
            n = f"{n}_{i}"
        taken.add(n)
        names.append(n)
    return names


def _kernel_line(failure: dict) -> str | None:
    """``kernel = nc.lower(...)``: the failing kernel rebuilt from its diagram and options."""
    k = failure.get("kernel")
    if k is None:
        return None
    from .kernelcheck import lowering_call
    opts = {**getattr(k, "options", {}), **failure.get("options", {})}
    imports, code = _diagram_code(k.diagram, "kd")
    return "\n".join(imports + [code, f"kernel = nc.lower(kd, verify=False{lowering_call(opts)})"])


def reproducer(problem: _Problem, ex: _Example, failure: dict) -> str:
    """Python code that rebuilds the inputs of ``ex`` and shows the difference."""
    names = _var_names(problem)
    lines = ["import numpy as np", "import napkin_cat as nc", _NAMESPACE_CODE]
    if ex.regime in ("masked", "jumps"):
        lines.append(f"from napkin_cat.verify.check import {'masked_normal' if ex.regime == 'masked' else 'jumps'}")
    kline = _kernel_line(failure)
    for d, label in ((problem.a, "a"), (problem.b, "b")):
        if label == "b" and kline is not None and failure.get("mode") == "kernel":
            continue
        imports, code = _diagram_code(d, label)
        lines += [ln for ln in imports if ln not in lines] + [code]
    sizes = problem.eval_sizes(ex)
    sizes_a, sizes_b = problem.sizes_for(problem.a, sizes), problem.sizes_for(problem.b, sizes)
    if sizes_a == sizes_b:
        lines.append(f"sizes = {sizes_a!r}")
    else:
        lines += [f"sizes_a = {sizes_a!r}", f"sizes_b = {sizes_b!r}  # with the block sizes"]
    lines.append(f"rng = np.random.default_rng({ex.seed})")
    pnames = []
    cast = ".astype(np.float32)" if kline is not None else ""
    for kind, key, arr, shape, (_, template) in problem.input_specs(ex):
        code = template.format(s=repr(shape))
        if kind == "in":
            lines.append(f"{names[key]} = ({code}){cast}" if cast else f"{names[key]} = {code}")
        else:
            pnames.append(key)
            lines.append(f"param_{key} = {code}")
    args = ", ".join(names)
    pkw = ", params=params" if pnames else ""
    kw_a, kw = (", sizes=sizes" + pkw,) * 2 if sizes_a == sizes_b else (", sizes=sizes_a" + pkw, ", sizes=sizes_b" + pkw)
    if pnames:
        lines.append("params = {" + ", ".join(f"{k!r}: param_{k}" for k in pnames) + "}")
    lines.append(f"out_a = nc.evaluate(a, {args}{kw_a})")
    if kline is not None:
        lines += kline.splitlines()
        lines.append(f"out_b = kernel({args})")
    elif failure["kind"] == "error":
        lines.append(f"out_b = nc.evaluate(b, {args}{kw})  # side {failure['side']} raises")
        return "\n".join(lines)
    else:
        lines.append(f"out_b = nc.evaluate(b, {args}{kw})")
    if failure["kind"] == "error":
        return "\n".join(lines[:-1] + [lines[-1] + "  # raises"])
    sel = "" if len(problem.a.cod) == 1 else f"[{failure['output']}]"
    idx = failure["index"]
    lines.append(f"print(out_a{sel}[{idx!r}], out_b{sel}[{idx!r}])  "
                 f"# {failure['a_value']!r} vs {failure['b_value']!r}")
    return "\n".join(lines)


def reproducer_for_kernel(oracle: Diagram, kernel, regime: str, seed: int, failure: dict) -> str:
    """The reproducer of a kernel's self-check (:func:`napkin_cat.verify.kernelcheck.self_check`)."""
    problem = _Problem.build(oracle, kernel.diagram, None, 1)
    ex = _Example({}, {}, regime, seed)
    return reproducer(problem, ex, {**failure, "kernel": kernel, "mode": "kernel"})


def _counterexample(problem, ex, failure, run, seconds, rtol, atol, rerun=None):
    code = reproducer(problem, ex, failure)
    before = run.get("examples_before", run["n"])
    what = "the kernel differs from the oracle" if failure.get("kernel") is not None else "the diagrams differ"
    head = (f"check_equivalent: {what} (found after {before} example(s), "
            f"shrunk through {len(run['failures']) - 1} smaller failing example(s), {seconds:.2f} s)")
    lines = [head, f"  a: {problem.a}", f"  b: {problem.b}",
             f"  sizes : {dict(ex.sizes)}" + (f"  fixed: {problem.fixed}" if problem.fixed else ""),
             f"  blocks: {dict(ex.blocks)}", f"  data  : regime {ex.regime!r}, seed {ex.seed}"]
    if failure.get("kernel") is not None:
        k = failure["kernel"]
        lines.append(f"  kernel: {k!r}" + (f", lower options {failure['options']}" if failure.get("options") else ""))
    if rerun is not None:
        hits, tries = rerun
        lines.append(f"  re-run: the counterexample failed again {hits} of {tries} time(s)"
                     + ("" if hits == tries else " (flaky: a race between threads is likely)"))
    if failure["kind"] == "error":
        lines.append(f"  {failure['side']} raises {failure['error']}")
    else:
        coords = ", ".join(f"{k}={v}" for k, v in failure["coordinates"].items())
        low = f", fp32 oracle {failure['low_value']!r}" if "low_value" in failure else ""
        lines.append(f"  first difference: output {failure['output_name']} at ({coords}): "
                     f"a = {failure['a_value']!r}, b = {failure['b_value']!r}{low} "
                     f"(allowed |a-b| <= {failure['allowed']:.3g}; rtol {failure.get('rtol', rtol):g}, "
                     f"atol {failure.get('atol', atol):g} x scale"
                     + (", plus twice the fp32 oracle's error)" if "low_value" in failure else ")"))
        lines.append(f"  {failure['differing']} of {failure['total']} entries differ")
    lines.append("reproduce with:")
    lines += ["    " + ln for ln in code.splitlines()]
    info = {"sizes": dict(ex.sizes), "blocks": dict(ex.blocks), "seed": ex.seed, "regime": ex.regime,
            "options": dict(ex.options), "axis_sizes": problem.axis_sizes(ex), "code": code, "examples": before,
            "shrink_steps": len(run["failures"]) - 1, "rerun": rerun,
            **{k: v for k, v in failure.items() if k != "options"}}
    return "\n".join(lines), info


__all__ = ["check_equivalent", "EquivalenceReport", "TOLERANCES", "REGIMES", "masked_normal", "jumps",
           "reproducer", "saved"]
