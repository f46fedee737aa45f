"""The norm-wise condition of :func:`napkin_cat.verify.kernelcheck.compare_outputs` for kernels with
16-bit wires, on synthetic arrays: the elementwise rule's slack is the plain implementations'
largest error over the whole output, so a kernel off by ten times their typical error everywhere
passes it; the root-mean-square error against the float64 answer refuses it, a kernel whose
rounding differs from the plain implementations' only where it lands passes, non-finite entries
stay out of the norms, and fp32 kernels are judged by the elementwise rule alone; a generated f16
kernel planted with a bias of 4 in 1000 is refused by ``kernel_outcome`` and ``check_equivalent``."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.ops.arrays import round_to_dtype  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from napkin_cat.verify.kernelcheck import FASTMATH_FACTOR, KERNEL_TOLERANCES, compare_outputs  # noqa: E402

ROWS, COLS = 64, 32
CANCELLING = ((3, 5), (17, 0), (40, 21))   # entries where a 16-bit operand's rounding cancels badly


def _output(dtype=nc.f16):
    return [nc.Array((nc.Axis("q", ROWS), nc.Axis("d", COLS)), dtype, "dQ")]


def _problem(seed=0):
    """(exact, the float64 answer rounded to f16, a plain implementation with 16-bit operands):
    rounding-level errors, and 0.05 at the few entries where the operands' rounding cancels."""
    rng = np.random.default_rng(seed)
    exact = 3.0 * rng.standard_normal((ROWS, COLS))
    low = np.asarray(round_to_dtype(exact, "f16"), np.float64)
    plain = low + 2e-4 * np.abs(exact) * rng.standard_normal(exact.shape)
    for idx in CANCELLING:
        plain[idx] += 0.05
    return exact, low, plain


def _compare(exact, low, got, packed, dtype=nc.f16, half=True):
    rtol, atol = KERNEL_TOLERANCES[dtype.name]
    return compare_outputs(_output(dtype), (exact,), (low,), (got,), rtol, atol, FASTMATH_FACTOR, half=half,
                           packed=packed)


def _rms_error(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)))


def test_a_uniform_error_the_largest_plain_error_hides_is_refused():
    exact, low, plain = _problem()
    typical = max(_rms_error(low, exact), _rms_error(plain, exact))
    signs = np.random.default_rng(1).choice((-1.0, 1.0), exact.shape)
    broken = exact + 10 * typical * signs
    # the elementwise rule alone admits it: ten times the typical error is below the largest
    assert 10 * typical < FASTMATH_FACTOR * 0.05
    failure = _compare(exact, low, broken, ((plain,),)).failure
    assert failure is not None and failure["kind"] == "norm", failure
    assert failure["output_name"] == "dQ" and failure["total"] == ROWS * COLS
    assert failure["kernel_rms"] == pytest.approx(10 * typical, rel=1e-6)
    assert failure["plain_rms"] == pytest.approx(typical, rel=1e-6)
    said = kernelcheck.describe_failure(failure)
    assert "output dQ" in said and f"rms error {failure['kernel_rms']:.3g}" in said
    assert f"allowed {failure['allowed']:.3g}" in said and f"{failure['plain_rms']:.3g}" in said


def test_a_kernel_whose_rounding_lands_elsewhere_passes():
    """Another order of summation in fp32 before the f16 rounding, and the operands' rounding
    cancelling at other entries than the plain implementation's, by as much."""
    exact, low, plain = _problem()
    rng = np.random.default_rng(2)
    got = np.asarray(round_to_dtype(exact * (1 + 1e-6 * rng.standard_normal(exact.shape)), "f16"), np.float64)
    got += 2e-4 * np.abs(exact) * rng.standard_normal(exact.shape)
    for r, c in CANCELLING:
        got[(r + 1) % ROWS, c] -= 0.05
    diff = _compare(exact, low, got, ((plain,),))
    assert diff.failure is None, kernelcheck.describe_failure(diff.failure)


def test_non_finite_entries_stay_out_of_the_norms():
    """Infinite and NaN answers the kernel follows, and an entry out of fp32's range the kernel
    follows fp32 in, are left out: the norms are finite, the count says how many were compared."""
    exact, low, plain = _problem()
    got = low.copy()
    exact[0, 0], low[0, 0], plain[0, 0], got[0, 0] = np.inf, np.inf, np.inf, np.inf
    exact[1, 1], low[1, 1], plain[1, 1], got[1, 1] = (np.nan,) * 4
    exact[2, 2], low[2, 2], plain[2, 2], got[2, 2] = 1e39, np.inf, np.inf, np.inf
    exact[3, 3], low[3, 3], plain[3, 3], got[3, 3] = -np.inf, -np.inf, -np.inf, np.nan   # a 16-bit NaN
    assert _compare(exact, low, got, ((plain,),)).failure is None
    typical = max(_rms_error(w[np.isfinite(w)], exact[np.isfinite(w)]) for w in (low, plain))
    broken = np.where(np.isfinite(got), exact + 10 * typical, got)
    failure = _compare(exact, low, broken, ((plain,),)).failure
    assert failure is not None and failure["kind"] == "norm", failure
    assert failure["total"] == ROWS * COLS - 4
    assert all(np.isfinite(failure[k]) for k in ("kernel_rms", "plain_rms", "exact_rms", "allowed"))
    assert failure["kernel_rms"] == pytest.approx(10 * typical, rel=1e-6)


def test_fp32_kernels_are_judged_elementwise_only():
    """An fp32 kernel (no 16-bit wires, no plain implementation with 16-bit operands) is held to
    the elementwise rule alone: where NumPy's fp32 evaluation cancels badly in one entry, an error
    of half that everywhere passes.  As a 16-bit kernel's, an error of a few f16 units everywhere
    (still inside the elementwise rule) is refused."""
    exact, _, _ = _problem()
    low = np.asarray(exact.astype(np.float32), np.float64)
    low[CANCELLING[0]] += 1e-3
    got = exact + 5e-4
    assert _compare(exact, low, got, None, dtype=nc.f32, half=False).failure is None
    assert _compare(exact, low, exact + 6e-3, None, half=True).failure["kind"] == "norm"


def test_a_biased_f16_kernel_is_refused_as_a_whole():
    """Every output entry 0.4% too large (about four f16 units in the last place): within the
    elementwise rule (2e-3 relative, 2e-3 x scale, and its slack) everywhere, refused as a whole."""
    q, x, d = nc.axes("q x d")
    att = nc.library.attention(q=q, x=x, d=d, dtype=nc.f16)
    bound = att.stream(x, 16).tile(q, 16).place("O", "registers").bind({q: 16, x: 16, d: 16})
    kernel = nc.lower(bound, threads=32, verify=False)
    biased = copy.copy(kernel)
    biased.source = kernel.source.replace("O_o[i, j] / z if", "O_o[i, j] / z * 1.004 if")
    assert biased.source != kernel.source
    biased._dispatcher, biased._launchers = None, {}
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((16, 16)) for _ in range(3)]
    assert kernelcheck.kernel_outcome(bound.unrelabelled(), kernel, inputs).failure is None
    failure = kernelcheck.kernel_outcome(bound.unrelabelled(), biased, inputs).failure
    assert failure is not None and failure["kind"] == "norm", failure
    assert failure["kernel_rms"] > 2 * failure["allowed"]
    with pytest.raises(nc.EquivalenceError, match="output O is off as a whole: rms error"):
        nc.check_equivalent(att, biased, examples=3)


def test_one_unit_off_where_the_answer_is_representable_passes():
    """A row whose softmax is one-hot makes ``O`` a row of ``V``, exactly representable: the plain
    implementations then err by nothing, while a kernel with approximate ``exp`` rounds its fp32
    value one f16 unit away in some entries (the H200's f16 ALiBi self-check, regime 'jumps').
    One unit of the output's dtype per entry is allowed; two units everywhere are not."""
    rng = np.random.default_rng(3)
    exact = np.asarray(round_to_dtype(12.0 * rng.standard_normal((ROWS, COLS)), "f16"), np.float64)
    unit = kernelcheck.ulp(exact, "f16")
    assert np.array_equal(unit, np.abs(np.spacing(exact.astype(np.float16)).astype(np.float64)))
    flips = rng.random(exact.shape) < 0.05
    got = exact + np.where(flips, unit, 0.0)
    assert _compare(exact, exact.copy(), got, ((exact.copy(),),)).failure is None
    failure = _compare(exact, exact.copy(), exact + 2 * unit, ((exact.copy(),),)).failure
    assert failure is not None and failure["kind"] == "norm", failure
