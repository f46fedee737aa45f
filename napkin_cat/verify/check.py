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
from dataclasses import dataclass

import numpy as np

from ..core.diagram import Diagram
from ..core.errors import EquivalenceError, LoweringError, NapkinError, TypingError, UnverifiedError
from .compare import REFERENCE_DTYPE, TOLERANCES, _as_tuple, _tolerance, note_difference  # noqa: F401 (re-exported)
from .data import REGIMES, jumps, masked_normal
from .problem import _Example, _Problem
from .reproduce import (_NAMESPACE_CODE, SAVED, _diagram_code, _size_str, reproducer, reproducer_for_kernel,  # noqa: F401
                        saved)

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

    def _repr_html_(self) -> str:
        """The report as a small HTML table (Jupyter): verdict, errors, sizes, data regimes,
        kernels run; self-contained, every value escaped."""
        from html import escape
        budget = " (stopped by the time budget)" if self.stopped_by_time else ""
        rows = [("examples", f"{self.examples}{budget}"),
                ("max abs error", f"{self.max_abs_error:.3g}"),
                ("max rel error", f"{self.max_rel_error:.3g}"),
                ("time", f"{self.seconds:.2f} s"),
                ("sizes tried", ", ".join(f"{s} in {lo}..{hi}" for s, lo, hi in self.sizes_tried) or "fixed sizes"),
                ("data regimes", ", ".join(f"{r} ×{n}" for r, n in self.regimes_tried) or "-")]
        if self.kernels or self.refused:
            rows.append(("kernels run", str(self.kernels)))
        if self.refused:
            rows.append(("refused by lower()", "; ".join(self.refused)))
        body = "".join(f'<tr><th style="text-align:left;padding-right:1em">{escape(k)}</th>'
                       f'<td style="text-align:left">{escape(v)}</td></tr>' for k, v in rows)
        return (f'<div class="napkin-report"><b style="color:#2e7d32">✓ equivalent</b> '
                f'<span style="color:#555">(checked against the NumPy oracle, float64)</span>'
                f'<table style="border-collapse:collapse;font-size:90%">{body}</table></div>')


@dataclass
class _Outcome:
    abs_error: float = 0.0
    rel_error: float = 0.0
    failure: dict | None = None


class _Mismatch(AssertionError):
    """Raised inside the Hypothesis test so that it shrinks; never leaves this module."""


class _OutOfTime(BaseException):
    """Stops Hypothesis when the time budget is spent (not an ``Exception``: not a failure)."""


# --------------------------------------------------------------------------- comparing

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
    krtol, katol = (None, None) if dtype_tolerance is None else (rtol, atol)   # None: the kernel's dtype's
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
        kr, ka = kc.kernel_tolerances(k, krtol, katol)
        diff = kc.kernel_outcome(a, k, inputs, problem.sizes_for(a, problem.eval_sizes(ex)), rtol=kr, atol=ka)
        if diff.failure is not None:
            diff.failure.update(kernel=k, options=dict(ex.options), mode="kernel" if kernel is not None else "lowered",
                                rtol=kr, atol=ka)
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
    from .kernelcheck import known_gap
    gap = known_gap(failure.get("kernel"), ex.regime)
    if gap:
        lines.append(f"  known  : {gap}")
    if rerun is not None:
        hits, tries = rerun
        lines.append(f"  re-run: the counterexample failed again {hits} of {tries} time(s)"
                     + ("" if hits == tries else " (flaky: a race between threads is likely)"))
    if failure["kind"] == "error":
        lines.append(f"  {failure['side']} raises {failure['error']}")
    elif failure["kind"] == "norm":   # a 16-bit kernel off as a whole (kernelcheck's norm-wise condition)
        from .kernelcheck import describe_failure
        lines.append(f"  {describe_failure(failure)}")
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
