"""Data regimes: how ``check_equivalent`` draws inputs, adversarial ones included.

Each regime is ``(draw(rng, shape), code template)``; the template is what a reproducer prints.
"""

from __future__ import annotations

import numpy as np

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


