"""Probe: NaN and infinity through 3xTF32 kernels on the GPU (``nc.lower(..., fp32="3xtf32")``),
against what the simulated twins promise (``tests/test_tf32x3.py``): the split by bit operations
has no NaN guard, so a NaN operand must still reach every product through its small part.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/tf32x3_nan.py

An attention forward (q = x = 64, d = 64) is run on finite inputs (checked against float64), then
with one NaN in Q (the GPU's canonical 0x7fffffff and the quiet 0x7fc00000), one NaN in K, and one
infinity in V; the rows that read the bad value must be NaN and the others equal to the finite run's.
Prints one line per case and ``ok`` or the first row that broke the rule.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402


def main() -> int:
    q, x, d = nc.axes("q x d")
    att = nc.library.attention(q=q, x=x, d=d).stream(x, 16).tile(q, 16).place("O", "registers")
    k = nc.lower(att.bind({q: 64, x: 64, d: 64}), fp32="3xtf32", verify=False, threads=32)
    assert "mma_tf32x3" in k.source
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    base = np.asarray(k(Q, K, V))
    s = Q.astype(np.float64) @ K.T.astype(np.float64) / 8.0
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ V
    err = np.abs(base - ref).max() / np.abs(ref).max()
    print(f"finite inputs: max error / max |ref| {err:.1e}")
    bad = 0 if err < 1e-5 else 1
    canonical, quiet = np.uint32(0x7FFFFFFF).view(np.float32), np.uint32(0x7FC00000).view(np.float32)
    cases = [("NaN 0x7fffffff in Q[3, 5]", "Q", (3, 5), canonical, lambda o: [3]),
             ("NaN 0x7fc00000 in Q[3, 5]", "Q", (3, 5), quiet, lambda o: [3]),
             ("NaN 0x7fffffff in K[7, 1]", "K", (7, 1), canonical, lambda o: list(range(64))),
             ("inf in V[9, 2] (column 2 of every row)", "V", (9, 2), np.float32(np.inf), None)]
    for name, which, at, value, nan_rows in cases:
        ins = {"Q": Q.copy(), "K": K.copy(), "V": V.copy()}
        ins[which][at] = value
        out = np.asarray(k(ins["Q"], ins["K"], ins["V"]))
        if nan_rows is None:     # an infinite value: column 2 is inf or NaN, the others as before
            ok = (~np.isfinite(out[:, 2])).all() and np.allclose(np.delete(out, 2, 1), np.delete(base, 2, 1))
        else:
            rows = nan_rows(out)
            rest = [r for r in range(64) if r not in rows]
            ok = np.isnan(out[rows]).all() and np.array_equal(out[rest], base[rest])
        print(f"{name}: {'ok' if ok else 'BROKEN'}")
        bad += not ok
    return bad


if __name__ == "__main__":
    sys.exit(main())
