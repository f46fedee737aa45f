"""Index functions as numba code, typed as numba types them on the GPU.

The CUDA simulator runs generated kernels as Python, where integers never wrap; on the GPU numba
types ``int(uint32)`` as uint32, so ``i - j`` with ``j > i`` wrapped to 2**64 - k and a relative
bias became 1.8e17 (measured on an H100: fp16 ``relative_bias`` and ``alibi_per_head`` gave a
relative error of 1.0).  The simulator cannot see that, so these tests compile the code that
:func:`napkin_cat.lowering.emit_kinds.index_code` writes with numba's CPU target (the same typing
rules for integer arithmetic as numba.cuda) on uint32 indices, as the kernels hold them, and
compare it with the expression's NumPy meaning on every pair of indices, both signs of i - j.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering.emit_kinds import index_code  # noqa: E402
from napkin_cat.lowering.source import Constants, Names  # noqa: E402

ix = nc.ix
BIASES = {
    "relative": lambda s, b, h, i, j: s + (i - j) * 0.01,
    "abs distance": lambda s, b, h, i, j: s - abs(i - j) * 0.5,
    "floor div, mod": lambda s, b, h, i, j: s + ((j - i) // 3 % 5) * 1.0,
    "min / max": lambda s, b, h, i, j: s + ix.minimum(i - j, 2) * 0.25 - ix.maximum(j - i, 1) * 0.125,
    "xor": lambda s, b, h, i, j: s + ((i ^ j) & 7) * 0.5,
}
MASKS = {
    "sliding, signed": lambda b, h, i, j: (i - j >= -2) & (i - j <= 3),
    "prefix or causal": lambda b, h, i, j: (j < 4) | (j <= i),
    "block diagonal": lambda b, h, i, j: (i // 3) == (j // 3),
    # FlexAttention's spellings: a neighbourhood clamped to a 3 x 3 canvas, Morton-order bits
    "clamped neighbourhood": lambda b, h, i, j: ((i // 3).clamp(1, 1) - j // 3).abs() + ((i % 3) - (j % 3)).abs() <= 1,
    "shifts and bit masks": lambda b, h, i, j: ((i >> 1) & 0x55) == (((j << 2) | 1) >> 3),
}


class _Em:
    """What :func:`index_code` reads of an emitter: global indices of tiled axes are
    ``tile start + thread offset``, both uint32, as in the kernels.  ``axes``: the axes known
    with their tiles (their bounds: integer arithmetic that stays exact runs in float32,
    :func:`~napkin_cat.lowering.emit_kinds.exact_floats`); without, every index stays an int."""

    def __init__(self, axes=False, size=9):
        from types import SimpleNamespace
        self.consts = Constants(Names())
        self.sizes = {"q": size, "x": size}
        # cap 1: no i // B is read at a block's start (emit_kinds.block_quotients)
        self.ax = {a: SimpleNamespace(name=a, role="grid", start=f"{a}0", cap=1, ragged=False)
                   for a in ("q", "x")} if axes else {}
        self.full_flags, self.assumed_full = {}, frozenset()   # no chunk flags (lowering/unswitch.py)

    def gidx(self, axis, env):
        return f"({axis}0 + {axis}1)"


def _compiled(expr_fn, kind, em=None):
    q, x, d = nc.axes("q x d")
    kw = {"score_mod": expr_fn} if kind == "score" else {"mask": nc.mask_mod(expr_fn)}
    att = nc.library.attention(q=q, x=x, d=d, **kw)
    box, fn = next((e.box, x) for e in att.eqns for _, x in e.box.params if getattr(x, "expr", None) is not None)
    em = em or _Em()
    code = index_code(em, box, fn, ["score"], {})
    g = {"float32": np.float32, "int64": np.int64, "uint32": np.uint32, "math": math}
    g.update({n: np.float32(v) for n, v in em.consts.floats.items()})
    g.update({n: np.uint32(v) for n, v in em.consts.ints.items()})
    src = f"def f(q0, q1, x0, x1, score):\n    return {code}\n"
    exec(compile(src, "<index_code>", "exec"), g)   # noqa: S102 - the generated line under test
    jit = numba.njit("(uint32, uint32, uint32, uint32, float32)")(g["f"])
    return fn, code, jit


def _meaning(fn, i, j, score):
    env = {"i": i, "j": j, "q": i, "x": j, "b": 0, "h": 0, "score": score,
           ("size", "q"): 9, ("size", "x"): 9}
    return fn.expr.evaluate(np, env)


@pytest.mark.parametrize("name", sorted(BIASES))
def test_index_bias_code_is_signed_on_numba_integers(name):
    fn, code, jit = _compiled(BIASES[name], "score")
    assert "int64(" in code, code
    for i in range(9):
        for j in range(9):
            got = jit(np.uint32(i // 2), np.uint32(i - i // 2), np.uint32(j // 2), np.uint32(j - j // 2),
                      np.float32(1.5))
            want = float(_meaning(fn, i, j, 1.5))
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, code, i, j, got, want)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_code_is_signed_on_numba_integers(name):
    fn, code, jit = _compiled(MASKS[name], "mask")
    for i in range(9):
        for j in range(9):
            got = jit(np.uint32(i), np.uint32(0), np.uint32(j), np.uint32(0), np.float32(0))
            assert bool(got) == bool(_meaning(fn, i, j, 0.0)), (name, code, i, j)


def test_a_quotient_constant_over_a_block_is_read_at_the_block_start():
    """``i // B`` is the same for every index of a tile or chunk of ``s`` elements when ``s``
    divides ``B`` (blocks start at multiples of ``s``): it is read at the block's first index, so
    a block table ``bt[i // B, j // B]`` is one read per chunk; otherwise, and for an index that
    is not an axis's plain index, the expression is kept."""
    from types import SimpleNamespace

    from napkin_cat.lowering.emit_kinds import block_quotients
    from napkin_cat.ops import index_expr as ixe
    em = SimpleNamespace(ax={"q": SimpleNamespace(name="q", role="grid", start="q0", cap=16),
                             "x": SimpleNamespace(name="x", role="stream", start="x0", cap=48)})
    i, j = ixe.Ix("idx", (), "q"), ixe.Ix("idx", (), "x")
    kept = lambda e: block_quotients(em, e).same(e)    # noqa: E731
    assert not kept(i // 64) and block_quotients(em, i // 64).args[0].value == ("block", "q")
    assert kept(i // 24) and kept(j // 64) and kept((i + 1) // 64) and kept(i % 64)
    assert block_quotients(em, j // 96).args[0].value == ("block", "x")
    for start in range(0, 96, 16):          # the meaning: every index of the block, one quotient
        assert len({(start + r) // 64 for r in range(16)}) == 1


EXACT = {"relative", "abs distance", "min / max"}


@pytest.mark.parametrize("name", sorted(BIASES) + sorted(MASKS))
def test_exact_integer_arithmetic_runs_in_float32_and_means_the_same(name):
    """With the axes' sizes known, ``i - j``, ``abs``, ``min`` / ``max`` and comparisons of them
    run in float32 (exact: every value within 2**24), no int64 left; floor division, modulo and
    bit operations stay ints.  Either way the code means what the expression means."""
    kind = "score" if name in BIASES else "mask"
    fn, code, jit = _compiled({**BIASES, **MASKS}[name], kind, _Em(axes=True))
    assert ("int64(" in code) == (name not in EXACT and name != "sliding, signed"
                                  and name != "prefix or causal"), code
    for i in range(9):
        for j in range(9):
            got = jit(np.uint32(i // 2), np.uint32(i - i // 2), np.uint32(j // 2), np.uint32(j - j // 2),
                      np.float32(1.5))
            want = _meaning(fn, i, j, 1.5)
            if kind == "mask":
                assert bool(got) == bool(want), (name, code, i, j)
            else:
                assert abs(got - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (name, code, i, j, got, want)


def test_integer_arithmetic_that_could_leave_float32s_exact_range_stays_integer():
    """``i * j`` over 8192 x 8192 indices reaches 2**26: not exact in float32, so it stays int64
    (and is right at the largest indices); ``i - j`` over the same axes is exact and runs in
    float32."""
    big = 8192
    fn, code, jit = _compiled(lambda s, b, h, i, j: s + (i * j) * 1.0, "score", _Em(axes=True, size=big))
    assert "int64(" in code and "float32(uint32" not in code, code
    for i, j in ((big - 1, big - 1), (big - 1, big - 2), (4097, 4099)):
        assert jit(np.uint32(i), np.uint32(0), np.uint32(j), np.uint32(0), np.float32(0)) == np.float32(i * j)
    _, code, _ = _compiled(lambda s, b, h, i, j: s + (i - j) * 1.0, "score", _Em(axes=True, size=big))
    assert "int64(" not in code and "float32(uint32" in code, code
