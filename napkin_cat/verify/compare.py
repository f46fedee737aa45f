"""Comparing outputs: tolerances per dtype and the one difference rule diagrams and kernels share."""

from __future__ import annotations

import numpy as np

from ..core.errors import NapkinError

# (rtol, atol) per dtype the comparison runs in; evaluation is float64 (the reference)
TOLERANCES: dict[str, tuple[float, float]] = {
    "f64": (1e-9, 1e-9), "f32": (1e-5, 1e-6), "f16": (1e-2, 1e-3), "bf16": (2e-2, 1e-2),
    "fp8_e4m3": (1.5e-1, 5e-2), "fp8_e5m2": (2.5e-1, 1e-1), "i8": (0.0, 0.0),
}
REFERENCE_DTYPE = "f64"


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


