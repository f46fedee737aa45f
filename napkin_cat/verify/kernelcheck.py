"""Generated kernels against the NumPy oracle: the kernel side of :func:`napkin_cat.check_equivalent`.

A kernel computes in fp32 (reading and writing fp32, or fp16 / bf16 arrays), the oracle in float64.  A kernel passes on an input when
every output entry satisfies

    |kernel - oracle64| <= atol * scale + rtol * |oracle64| + LOW_PRECISION_FACTOR * max |oracle_lo - oracle64|

where ``oracle_lo`` is the same diagram evaluated by NumPy in the kernel's dtype
(``evaluate(..., reference=False)``; for a 16-bit kernel, which computes in fp32, the float64
answer rounded to each output's dtype) on the same (dtype-rounded) inputs, ``scale`` the largest
finite output magnitude (at least 1) and ``(rtol, atol)`` :data:`KERNEL_TOLERANCES` of the
dtype.  The last term is FlashAttention's test rule: a kernel may be as far from the exact
answer as a plain implementation in its own precision (its largest error on that output; for a
16-bit kernel also fp32 arithmetic with the computed 16-bit operands of its contractions rounded,
as tensor cores take a backward's ``P`` and ``dS``), twice
over (:data:`FASTMATH_FACTOR` times for kernels compiled with approximate exp and division, the
default), and no further.  Where the
low-precision oracle itself leaves the dtype's range (a finite float64 answer whose fp32
evaluation is inf or NaN) the kernel must agree with the fp32 evaluation, or be finite and within
the tolerance of the float64 answer (a different order of summation may stay in range); where both are
non-finite (float64 inf where fp32 gives NaN: an ``exp`` that overflows before a product, as in
a backward pass fed a logsumexp its scores did not produce) it must agree with one of them
exactly; every other non-finite entry must agree with the float64 oracle exactly, except that
a 16-bit kernel may give NaN where the float64 answer is infinite (its 16-bit intermediates,
such as a backward's ``P`` and ``dS`` stored for the tensor cores, overflow at 65504, so terms of
both signs can be infinite in its sum: measured on an H200, the self-check of a causal block's
f16 backward, regime 'jumps'); see docs/NAN_POLICY.md.

That last term is one largest error for the whole output, and the 16-bit plain implementations
err most in the few entries where a sum cancels: a kernel off by ten times their typical error
everywhere stays inside it.  A kernel with 16-bit wires must therefore also meet a norm-wise
condition, output by output, over the entries where the float64 answer, the kernel and every
plain implementation are finite:

    rms(kernel - oracle64) <= atol32 * scale + rtol32 * rms(oracle64) + NORM_FACTOR * max rms(plain - oracle64)
                              + rms(ulp(oracle64))

with ``plain`` ranging over ``oracle_lo`` and the implementations with 16-bit operands,
``(rtol32, atol32)`` the fp32 kernels' tolerances (the arithmetic a 16-bit kernel does between its
roundings; tolerances given to :func:`kernel_outcome` loosen the elementwise rule only) and
``scale`` the largest magnitude among those entries (at least 1).  A correct kernel differs from
the plain implementations only in its order of summation and in which entries the rounding of its
16-bit operands lands; :data:`NORM_FACTOR` says what was measured.  ``ulp`` is one unit in the
last place of the output's dtype at each entry: a kernel rounds its own fp32 value to that dtype,
and where the exact answer is itself representable (a row whose softmax is one-hot, so ``O`` is a
row of ``V``) the plain implementations err by nothing while a kernel with approximate ``exp``
lands one unit off in some entries (measured on an H200: the f16 ALiBi forward's self-check,
regime 'jumps', rms 1.75e-3 against the plain implementations' 1.1e-7, every entry within one unit).

Two ways a kernel meets the oracle:

* ``check_equivalent(oracle, kernel)``: a :class:`~napkin_cat.lowering.Kernel` at its bound sizes,
  data drawn by Hypothesis (every regime of :mod:`napkin_cat.verify.check`);
* ``check_equivalent(oracle, relabelled, lowered=True)``: every example binds the relabelled
  diagram at drawn sizes and blocks, lowers it with drawn options (:data:`DEFAULT_OPTIONS`:
  threads, prefetch) and runs that kernel.  A configuration ``lower`` refuses with a
  :class:`~napkin_cat.core.errors.LoweringError` is counted, not failed; if every drawn
  configuration is refused the check raises.

``nc.lower`` itself calls :func:`self_check` before it returns a kernel (``verify=True``, the
default): no kernel leaves ``lower`` without having been compared with the oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.diagram import Diagram
from ..core.errors import EquivalenceError, NapkinError, TypingError
from .reproduce import lowering_call  # noqa: F401 (part of this module's interface)

# (rtol, atol) per kernel dtype, on top of the low-precision oracle's own error
# (16-bit kernels compute in fp32 and round their outputs and the operands of tensor-core
# products to the dtype: half an ulp each, 2**-11 for f16, 2**-8 for bf16, a few times over)
KERNEL_TOLERANCES: dict[str, tuple[float, float]] = {"f32": (2e-5, 2e-5), "f16": (2e-3, 2e-3),
                                                     "bf16": (1.6e-2, 1.6e-2)}
LOW_PRECISION_FACTOR = 2.0
# fastmath kernels (the default) use approximate exp and division (ex2.approx, rcp.approx): on
# ill-conditioned scores (|s| ~ 1e4, where fp32 itself loses digits) measured on an H100 at 3.4x
# the error of NumPy's fp32; the factor they get instead
FASTMATH_FACTOR = 8.0
# the norm-wise condition (module docstring) on 16-bit kernels, measured in the simulator over 345
# outputs of correct f16 / bf16 kernels (attention forward and backward parts, MLPs; the 16-bit
# kernel tests and the fuzzer's sixteen_bit and copying families): rms error at most 1.75x the plain
# implementations' on 16-bit outputs (median 1.1x; up to 3.3x on fp32 outputs such as D, far inside
# the fp32 terms), or, less the fp32 terms, 1.67x; the H200's GQA dK, dV run (tests/data) 1.0x; the
# staged dQ kernels missing a wait 10x and 14x (tests/test_staged_add.py)
NORM_FACTOR = 4.0
RERUNS = 3                       # re-runs of a shrunk kernel counterexample (races are flaky)

# lower() options drawn per example in lowered mode; the simulator runs every thread as a
# Python thread, so it draws smaller blocks
DEFAULT_OPTIONS = {
    "simulator": {"threads": (16, 32, 64), "prefetch": (False, True, "double")},
    "gpu": {"threads": (64, 128, 256), "prefetch": (False, True, "double")},
}
LOWER_OPTIONS = ("threads", "micro", "prefetch", "fastmath", "tiles", "fp32")


def is_kernel(x) -> bool:
    from .backend import BACKEND
    kinds = tuple(BACKEND[k] for k in ("Kernel", "MultiKernel", "TabledKernel", "TableChoice") if k in BACKEND)   # or several, or tabled
    return bool(kinds) and isinstance(x, kinds)


def kernel_dtype(kernel) -> str:
    """``f32``, or the 16-bit dtype a kernel reads and writes (it computes in fp32)."""
    d = kernel.diagram
    return next((a.dtype.name for a in (*d.dom, *d.cod) if a.dtype.name in ("f16", "bf16")), "f32")


def kernel_tolerances(kernel, rtol=None, atol=None) -> tuple[float, float]:
    dr, da = KERNEL_TOLERANCES[kernel_dtype(kernel)]
    return (dr if rtol is None else rtol), (da if atol is None else atol)


def bind_oracle(oracle: Diagram, kernel) -> Diagram:
    """``oracle`` at the kernel's sizes (by axis name), type-checked against the kernel."""
    if not isinstance(oracle, Diagram):
        raise TypingError(f"check_equivalent: the oracle must be a Diagram, got {type(oracle).__name__}")
    sizes = {ax.name: ax.size for ax in kernel.diagram.axes}
    missing = sorted({ax.name for ax in oracle.axes if ax.symbolic} - set(sizes))
    if missing:
        raise TypingError(f"check_equivalent: axes {missing} of the oracle {oracle.short()} do not occur "
                          f"in the kernel {kernel.name} ({kernel.diagram.short()})")
    bound = oracle.bind({ax: sizes[ax.name] for ax in oracle.axes if ax.symbolic})
    kd = kernel.diagram
    if bound.dom != kd.dom or bound.cod != kd.cod:
        which = "dom" if bound.dom != kd.dom else "cod"
        raise TypingError(f"check_equivalent: the oracle and the kernel have different types ({which} differs)\n"
                          f"  oracle at the kernel's sizes: {bound.short()}\n  kernel {kernel.name}: {kd.short()}")
    return bound


def check_lower_options(options: dict | None, simulate: bool) -> dict:
    """``lower_options`` of lowered mode: ``{option: candidates}``, validated (``None``: the
    defaults; given options replace them, the rest keep lower()'s own defaults)."""
    if options is None:
        return {k: tuple(v) for k, v in DEFAULT_OPTIONS["simulator" if simulate else "gpu"].items()}
    out = {}
    if not isinstance(options, dict):
        raise NapkinError(f"check_equivalent: lower_options must be a dict {{option: candidate values}}, "
                          f"got {type(options).__name__}")
    for key, values in options.items():
        if key not in LOWER_OPTIONS:
            raise NapkinError(f"check_equivalent: lower_options has unknown option {key!r}; "
                              f"known: {list(LOWER_OPTIONS)}")
        values = tuple(values) if isinstance(values, (list, tuple)) else (values,)
        if not values:
            raise NapkinError(f"check_equivalent: lower_options[{key!r}] has no candidate values")
        out[key] = values
    return out


# --------------------------------------------------------------------------- running and comparing

def as_kernel_inputs(inputs, arrays=None) -> list[np.ndarray]:
    """The drawn float64 inputs rounded to each input's dtype (``arrays``: the input wires;
    fp32 without them), held in float32: what the kernel and, widened exactly, the oracle
    both see."""
    from ..ops.arrays import round_to_dtype
    names = [a.dtype.name for a in arrays] if arrays is not None else ["f32"] * len(inputs)
    return [np.ascontiguousarray(round_to_dtype(x, n if n in ("f16", "bf16") else "f32"), dtype=np.float32)
            for x, n in zip(inputs, names)]


def run_kernel(kernel, inputs32) -> tuple:
    import warnings
    # adversarial data overflows on purpose; the simulator's threads do not see np.errstate
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = kernel(*[x.copy() for x in inputs32])
    return tuple(np.asarray(o, dtype=np.float64) for o in (out if isinstance(out, tuple) else (out,)))


def oracle_outputs(oracle: Diagram, inputs32, sizes: dict, dtype: str = "f32") -> tuple[tuple, tuple]:
    """(float64 oracle, oracle in the kernel's dtype) on the rounded inputs.  A 16-bit kernel
    computes in fp32 and rounds what it stores: its low-precision oracle is the float64 answer
    rounded to each output's dtype (a plain 16-bit evaluation would overflow where the kernel
    does not)."""
    from ..ops.arrays import round_to_dtype
    from .executor import evaluate
    wrap = (lambda o: tuple(np.asarray(x, np.float64) for x in (o if isinstance(o, tuple) else (o,))))
    with np.errstate(all="ignore"):
        exact = wrap(evaluate(oracle, *inputs32, sizes=sizes))
        if dtype == "f32":
            low = wrap(evaluate(oracle, *inputs32, sizes=sizes, reference=False))
        else:
            low = tuple(np.asarray(round_to_dtype(x, arr.dtype.name if arr.dtype.name in ("f16", "bf16") else "f32"),
                                   np.float64) for x, arr in zip(exact, oracle.cod))
    return exact, low


def packed_operand_outputs(oracle: Diagram, inputs32, sizes: dict) -> tuple[tuple, ...]:
    """A 16-bit kernel's plain implementation in its own precision: fp32 arithmetic with every
    computed 16-bit operand of a contraction rounded to its dtype, as tensor cores take them
    (:func:`~.executor.evaluate_operands_rounded`).  A kernel that
    packs ``P`` or ``dS`` into 16 bits for its tensor cores differs from the float64 answer by at
    least that rounding, which a sum that cancels (``dQ = sum_x dS K`` with ``sum_x dS = 0``)
    magnifies: measured on an H100, the bf16 dQ kernel's self-check at N = 320, regime 'jumps'
    (kernels/BENCHMARKS.md, "Third session of 2026-11-25").

    Two implementations: rounding every fp32 result to nearest, and with the tensor cores'
    products truncated toward zero (:func:`~.executor.evaluate_operands_rounded`): measured on an
    H200, GQA's f16 dK, dV kernel at N = 320, regime 'jumps', is 64 off an exact 414 where
    ``dP - D`` cancels from 8.7e5 in every row; rounded to nearest the plain implementation is
    within 1 of it, truncated 92 off (kernels/BENCHMARKS.md, "Session of 2026-11-28 (H200)")."""
    from .executor import evaluate_operands_rounded
    with np.errstate(all="ignore"):
        return tuple(evaluate_operands_rounded(oracle, *inputs32, sizes=sizes, toward_zero=tz) for tz in (False, True))


@dataclass
class KernelDiff:
    abs_error: float = 0.0
    rel_error: float = 0.0
    failure: dict | None = None


def compare_outputs(arrays, exact, low, got, rtol: float, atol: float,
                    factor: float = LOW_PRECISION_FACTOR, half: bool = False, packed=None) -> KernelDiff:
    """The kernel rule of the module docstring, output by output; the first failing entry.
    ``arrays``: the output types (names and axes for the report); ``half``: a kernel with 16-bit
    wires, which may give NaN where the float64 answer is infinite (module docstring); ``packed``:
    a 16-bit kernel's plain implementations with its contractions' operands rounded
    (:func:`packed_operand_outputs`), whose largest finite error joins ``low``'s in the slack.
    With ``half`` or ``packed`` the norm-wise condition follows too (:func:`norm_failure`)."""
    from .compare import note_difference
    out = KernelDiff()
    for i, (arr, r, lo, k) in enumerate(zip(arrays, exact, low, got)):
        fr, fl, fk = np.isfinite(r), np.isfinite(lo), np.isfinite(k)
        scale = max(1.0, float(np.max(np.abs(r[fr]), initial=0.0)))
        both = fr & fk
        diff = np.where(both, np.abs(np.where(both, r, 0.0) - np.where(both, k, 0.0)), 0.0)
        with np.errstate(invalid="ignore", over="ignore"):   # lo - r where either is not finite: masked
            slack = float(np.max(np.abs(np.where(fr & fl, lo - r, 0.0)), initial=0.0))   # fp32's own error
            for impl in packed or ():   # ... and the plain implementations' with 16-bit operands
                w = impl[i]
                slack = max(slack, float(np.max(np.abs(np.where(fr & np.isfinite(w), w - r, 0.0)), initial=0.0)))
        allowed = atol * scale + rtol * np.abs(np.where(fr, r, 0.0)) + factor * slack
        same = (k == r) | (np.isnan(k) & np.isnan(r))
        out_of_range = fr & ~fl                      # fp32 itself overflows here: follow it
        same_low = (k == lo) | (np.isnan(k) & np.isnan(lo)) | ~fk
        # both oracles non-finite: the kernel follows one of them exactly
        follows_low = ~fr & ~fl & ((k == lo) | (np.isnan(k) & np.isnan(lo)))
        # a 16-bit kernel stores 16-bit intermediates (P, dS for the tensor cores): they overflow
        # (65504 in f16) long before float64 does, so more of the terms summed into an entry whose
        # exact answer is already infinite may be infinite, of both signs: NaN there
        follows_low |= half & np.isinf(r) & np.isnan(k)
        # where fp32 overflows, a finite kernel entry within the tolerance of the exact answer is
        # fine too (its order of summation stayed in range: 2.19e38 against fp32's inf, measured
        # on an H100 in a dQ kernel's self-check, regime 'jumps')
        close = fk & (diff <= allowed)
        bad = np.where(out_of_range, ~(same_low | close), np.where(fr & fk, diff > allowed, ~(same | follows_low)))
        note_difference(out, i, arr, r, k, diff, both, bad, allowed, atol * scale)
        if out.failure is not None and out.failure["output"] == i:
            out.failure["low_value"] = float(lo[out.failure["index"]])
        if out.failure is None and (half or packed is not None):
            out.failure = norm_failure(i, arr, r, lo, k, [impl[i] for impl in packed or ()])
    return out


def rms(v) -> float:
    return float(np.sqrt(np.mean(np.square(v)))) if v.size else 0.0


# (mantissa bits, smallest normal exponent) of the dtypes a kernel's outputs take
_FORMATS = {"f16": (10, -14), "bf16": (7, -126), "f32": (23, -126)}


def ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """One unit in the last place of ``dtype`` at each of ``x`` (finite), subnormals included."""
    bits, emin = _FORMATS.get(dtype, _FORMATS["f32"])
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(x)))
    return np.exp2(np.maximum(np.where(np.isfinite(e), e, emin), emin) - bits)


def norm_errors(r, lo, k, plains) -> tuple[float, float, float, np.ndarray]:
    """(the kernel's rms error, the largest rms error of the plain implementations ``lo`` and
    ``plains``, the rms of the exact answer ``r``, the mask they are taken over): over the entries
    where every one of them is finite."""
    mask = np.isfinite(r) & np.isfinite(lo) & np.isfinite(k)
    for w in plains:
        mask &= np.isfinite(w)
    r_ = r[mask]
    plain = max(rms(w[mask] - r_) for w in (lo, *plains))
    return rms(k[mask] - r_), plain, rms(r_), mask


def norm_failure(i: int, arr, r, lo, k, plains) -> dict | None:
    """The norm-wise condition of the module docstring on output ``i``, or ``None`` where it holds.
    The failure names the entry with the kernel's largest error too (the reproducer prints it)."""
    kernel_rms, plain_rms, exact_rms, mask = norm_errors(r, lo, k, plains)
    rtol, atol = KERNEL_TOLERANCES["f32"]
    scale = max(1.0, float(np.max(np.abs(r[mask]), initial=0.0)))
    allowed = atol * scale + rtol * exact_rms + NORM_FACTOR * plain_rms + rms(ulp(r[mask], arr.dtype.name))
    if kernel_rms <= allowed:
        return None
    err = np.where(mask, np.abs(np.where(mask, k, 0.0) - np.where(mask, r, 0.0)), -1.0)
    idx = tuple(int(j) for j in np.unravel_index(int(np.argmax(err)), err.shape))
    return {"kind": "norm", "output": i, "output_name": arr.name, "index": idx,
            "coordinates": dict(zip(arr.axis_names, idx)), "a_value": float(r[idx]), "b_value": float(k[idx]),
            "low_value": float(lo[idx]), "kernel_rms": kernel_rms, "plain_rms": plain_rms,
            "exact_rms": exact_rms, "allowed": allowed, "total": int(mask.sum())}


def kernel_outcome(oracle: Diagram, kernel, inputs, sizes: dict | None = None, rtol: float | None = None,
                   atol: float | None = None, memo: dict | None = None, key=None) -> KernelDiff:
    """Run ``kernel`` on ``inputs`` (rounded to its input dtypes) and compare with ``oracle``.
    ``memo``: the oracle's answers kept under ``key`` (and the kernel's dtypes) for the next kernel
    compared on the same oracle and inputs (the forms of one diagram, :func:`self_check`)."""
    rtol, atol = kernel_tolerances(kernel, rtol, atol)
    x32 = as_kernel_inputs(inputs, kernel.diagram.dom)
    key = None if memo is None else (key, oracle.short(), kernel_dtype(kernel),
                                     tuple((a.dtype.name, tuple(ax.size for ax in a.axes)) for a in kernel.diagram.dom))
    if key is not None and key in memo:
        exact, low, packed = memo[key]
    else:
        exact, low = oracle_outputs(oracle, x32, sizes or {}, kernel_dtype(kernel))
        packed = packed_operand_outputs(oracle, x32, sizes or {}) if kernel_dtype(kernel) != "f32" else None
        if key is not None:
            memo[key] = exact, low, packed
    try:
        got = run_kernel(kernel, x32)
    except NapkinError:   # the call itself refused (shapes, dtypes): a misuse, not a kernel difference
        raise
    except Exception as e:  # noqa: BLE001 - a crashing kernel is a difference, reported with its error
        return KernelDiff(math.inf, math.inf, {"kind": "error", "side": "kernel",
                                               "error": f"{type(e).__name__}: {e}"})
    factor = FASTMATH_FACTOR if getattr(kernel, "options", {}).get("fastmath", True) else LOW_PRECISION_FACTOR
    return compare_outputs(oracle.cod, exact, low, got, rtol, atol, factor, half=kernel_dtype(kernel) != "f32",
                           packed=packed)


# --------------------------------------------------------------------------- lower's own check

SELF_CHECK_REGIMES = ("normal", "jumps", "huge_one_sign")


def check_self_check_inputs(make_inputs, verify, runs: int) -> None:
    """``lower(check_inputs=...)``: a callable, and a self-check that uses it."""
    from ..core.errors import LoweringError
    if not callable(make_inputs):
        raise LoweringError(f"lower: check_inputs must be a callable (rng, draw) -> input arrays, got {make_inputs!r}")
    if not runs:
        raise LoweringError(f"lower: check_inputs makes the self-check's inputs, and verify={verify!r} runs none, "
                            f"so it would be ignored; drop it or verify")


def self_check(kernel, examples: int, make_inputs=None, memo: dict | None = None) -> str:
    """Compare a freshly generated kernel with the oracle on ``examples`` inputs (regimes
    :data:`SELF_CHECK_REGIMES` in turn, seeds 0, 1, ...); raise :class:`EquivalenceError`
    with reproducing code on a difference, else return the note that says what was checked.
    ``make_inputs(rng, draw)``: the inputs of each run made from the regime's ``draw(rng, shape)``
    by the caller (related inputs, ``lower(check_inputs=...)``), instead of each drawn alone.
    ``memo``: a dict shared by the kernels of one diagram (the forms ``nc.lower`` chooses among at
    each launch): the oracle's answers on each run's inputs are computed for the first and kept
    for the others (the same oracle, the same seeds and shapes)."""
    from .data import REGIMES
    from .reproduce import reproducer_for_kernel
    oracle = kernel.diagram.unrelabelled()
    worst = 0.0
    regimes = []
    for k in range(examples):
        regime = SELF_CHECK_REGIMES[k % len(SELF_CHECK_REGIMES)]
        rng = np.random.default_rng(k)
        gen = REGIMES[regime][0]
        if make_inputs is None:
            inputs = [gen(rng, tuple(ax.size for ax in arr.axes)) for arr in oracle.dom]
        else:
            inputs = [np.asarray(v, dtype=np.float64) for v in make_inputs(rng, gen)]
            shapes = [tuple(ax.size for ax in arr.axes) for arr in oracle.dom]
            if [v.shape for v in inputs] != shapes:
                raise EquivalenceError(f"lower: check_inputs gave arrays of shapes {[v.shape for v in inputs]}, "
                                       f"the kernel {kernel.name} takes {shapes}")
        diff = kernel_outcome(oracle, kernel, inputs, memo=memo, key=k)
        if diff.failure is not None:
            code = (reproducer_for_kernel(oracle, kernel, regime, k, diff.failure) if make_inputs is None else
                    f"# inputs made by lower(check_inputs=...) from regime {regime!r}, "
                    f"np.random.default_rng({k}): call it the same way")
            gap = known_gap(kernel, regime)
            raise EquivalenceError(
                f"lower: the generated kernel {kernel.name} differs from the NumPy oracle on its own "
                f"self-check (regime {regime!r}, seed {k}); "
                + (f"a known gap: {gap}.\n" if gap else "this is a code generation bug, please report it.\n")
                + f"  kernel: {kernel!r}\n  {describe_failure(diff.failure)}\nreproduce with:\n"
                + "\n".join("    " + ln for ln in code.splitlines()),
                {"regime": regime, "seed": k, "code": code, **diff.failure})
        worst = max(worst, diff.abs_error)
        regimes.append(regime)
    return (f"Verified by lower(): {examples} run(s) against the NumPy float64 oracle at the bound sizes "
            f"(regimes {', '.join(regimes)}), max abs error {worst:.2g}; "
            f"nc.check_equivalent(oracle, kernel) draws more.")


def known_gap(kernel, regime: str) -> str | None:
    """What docs/NAN_POLICY.md says of a 16-bit kernel's difference on data of ``regime`` on a
    GPU, where it names it: past |s| ~ 1e8 (the regimes ``huge`` and ``huge_one_sign``) the
    16-bit forwards' weights overflow there (kernels/verify_huge_gpu.py); None otherwise."""
    from .backend import BACKEND
    active = BACKEND.get("simulator_active")
    if kernel is None or regime not in ("huge", "huge_one_sign") or active is None or active():
        return None
    if kernel_dtype(kernel) == "f32":
        return None
    return ("a 16-bit kernel on a GPU on scores past ~1e8: its weights' fused multiply-add overflows them "
            "(docs/NAN_POLICY.md, \"Known gap on the GPU\"; kernels/verify_huge_gpu.py)")


def describe_failure(failure: dict) -> str:
    if failure["kind"] == "error":
        return f"{failure['side']} raises {failure['error']}"
    coords = ", ".join(f"{k}={v}" for k, v in failure["coordinates"].items())
    if failure["kind"] == "norm":
        return (f"output {failure['output_name']} is off as a whole: rms error {failure['kernel_rms']:.3g} over "
                f"{failure['total']} finite entries, allowed {failure['allowed']:.3g} (the plain implementations' "
                f"rms error {failure['plain_rms']:.3g}, the exact answer's rms {failure['exact_rms']:.3g}); "
                f"largest at ({coords}): oracle {failure['a_value']!r}, kernel {failure['b_value']!r}")
    low = f", fp32 oracle {failure['low_value']!r}" if "low_value" in failure else ""
    return (f"first difference: output {failure['output_name']} at ({coords}): oracle {failure['a_value']!r}, "
            f"kernel {failure['b_value']!r}{low} (allowed |a-b| <= {failure['allowed']:.3g}); "
            f"{failure['differing']} of {failure['total']} entries differ")


__all__ = ["KERNEL_TOLERANCES", "kernel_outcome", "self_check", "bind_oracle", "is_kernel", "known_gap",
           "check_lower_options", "compare_outputs", "describe_failure"]
