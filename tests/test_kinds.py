"""One definition per box kind, elementwise function and index function, read by every
interpretation.  Each test is parametrised by name, so a missing or wrong entry fails by name:

* every kind of :data:`napkin_cat.ops.kinds.SPECS` has a reference rule (NumPy and torch read
  the same one), a cost rule, a code generator rule and a drawing style;
* every elementwise function of :data:`napkin_cat.ops.functions.FUNCTIONS` means the same in
  NumPy, torch and the generated code (its CUDA expression, rendered by the code generator and
  run as Python), and its cost unit is what the cost model counts;
* every predicate and index bias means the same in NumPy, torch and generated code, and its
  *support* contains every entry it keeps (what the executor, cost model and kernels skip).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import sympy as sp  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.costmodel import SympyAlgebra  # noqa: E402  (the cost model's algebra)
from napkin_cat.ops import index  # noqa: E402
from napkin_cat.ops.arrays import NUMPY, torch_namespace  # noqa: E402
from napkin_cat.ops.functions import FUNCTIONS  # noqa: E402
from napkin_cat.ops.kinds import SPECS  # noqa: E402

# points where every function is defined (positive: log, sqrt, rsqrt, recip) and signed points
POSITIVE = np.array([0.125, 0.5, 1.0, 1.5, 2.75, 7.0])
SIGNED = np.array([-6.0, -2.5, -1.0, -0.25, 0.0, 0.3, 1.0, 2.0, 5.5])
C = 0.75   # the constant of scale / shift


def _inputs(f):
    xs = [POSITIVE, SIGNED]
    if f.arity == 2:
        return [(a.reshape(-1, 1), b.reshape(1, -1)) for a in xs for b in xs]
    return [(a,) for a in xs]


# --------------------------------------------------------------------------- kinds

def _interpretations():
    from napkin_cat.costmodel import COST_RULES
    from napkin_cat.drawing import KIND_STYLES
    from napkin_cat.lowering.emit_kinds import CODEGEN_RULES
    from napkin_cat.ops.semantics import RULES
    from napkin_cat.ops.torch_semantics import TORCH_RULES
    return {"reference (NumPy)": RULES, "torch": TORCH_RULES, "cost": COST_RULES, "codegen": CODEGEN_RULES,
            "drawing": KIND_STYLES}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_interpretation_knows_the_kind(kind):
    missing = [name for name, table in _interpretations().items() if kind not in table]
    assert not missing, f"box kind {kind!r} has no entry in: {', '.join(missing)}"


def test_no_interpretation_knows_a_kind_without_a_spec():
    for name, table in _interpretations().items():
        assert set(table) <= set(SPECS), f"{name} has rules for unknown kinds {set(table) - set(SPECS)}"


# --------------------------------------------------------------------------- elementwise functions

@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_function_means_the_same_in_numpy_and_torch(fn):
    f = FUNCTIONS[fn]
    c = C if f.constant else None
    for args in _inputs(f):
        with np.errstate(all="ignore"):
            want = f(NUMPY, *args, c=c)
        got = f(torch_namespace(), *(torch.tensor(a) for a in args), c=c).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{fn} on {args}")


def _cuda_value(fn: str, args, c):
    """The function's expression as the code generator renders it, run as Python on floats."""
    from napkin_cat.lowering.emit_kinds import fn_expr as function_expression
    from napkin_cat.lowering.source import Constants, Names
    consts = Constants(Names())
    names = [f"a{k}" for k in range(len(args))]
    expr = function_expression(consts, fn, names, None if c is None else consts.f(c, "C_TEST"))
    ns = {"math": math, "float32": float, "max": max, "min": min, "abs": abs}
    ns.update({**consts.ints, **consts.floats})
    out = []
    for point in zip(*(np.ravel(a) for a in args)):
        ns.update(dict(zip(names, map(float, point))))
        try:
            out.append(eval(expr, ns))
        except (OverflowError, ValueError, ZeroDivisionError):
            out.append(math.nan)
    return np.array(out), expr


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_function_means_the_same_in_generated_code(fn):
    f = FUNCTIONS[fn]
    c = C if f.constant else None
    for args in _inputs(f):
        with np.errstate(all="ignore"):
            want = np.broadcast_to(f(NUMPY, *args, c=c), np.broadcast_shapes(*(a.shape for a in args)))
        got, expr = _cuda_value(fn, np.broadcast_arrays(*args), c)
        want = np.ravel(want)
        ok = np.isfinite(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-6, atol=1e-7, err_msg=f"{fn}: {expr}")


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_function_cost_unit_is_what_the_cost_model_counts(fn):
    f = FUNCTIONS[fn]
    r, k = nc.axes("r k", r=4, k=8)
    arrays = [nc.Array((r, k), nc.f32, n) for n in "XY"[: f.arity]]
    d = nc.ops.op(fn, *arrays, c=C if f.constant else None)
    flops = nc.cost(d).flops
    counted = {u for u, n in flops.items() if n != 0}
    assert counted == (set() if f.unit == "free" else {f.unit}), (fn, f.unit, flops)


# --------------------------------------------------------------------------- index functions

# every rule with code, at each of its example arguments: a new predicate is tested by adding it
PREDICATES = [index.Predicate(name, args) for name, rule in index.PREDICATES.items() if rule.cuda
              for args in rule.examples]
BIASES = [index.IndexBias(name, args) for name, rule in index.BIASES.items() if rule.cuda for args in rule.examples]


def test_every_index_function_with_code_has_examples():
    for table in (index.PREDICATES, index.BIASES):
        for name, rule in table.items():
            assert rule.cuda is None or rule.examples, f"index function {name!r} has no example arguments"


def _grid(n_rows, n_cols):
    return np.arange(n_rows).reshape(-1, 1), np.arange(n_cols).reshape(1, -1)


def _cuda_keep(pred, i, j):
    from napkin_cat.lowering.source import Constants, Names
    consts = Constants(Names())
    conds = pred.cuda("i", "j", consts.u)
    ns = {**consts.ints, **consts.floats}
    return np.vectorize(lambda a, b: eval(" and ".join(conds), {**ns, "i": int(a), "j": int(b)}))(i, j)


@pytest.mark.parametrize("pred", PREDICATES, ids=repr)
def test_predicate_means_the_same_in_numpy_torch_and_generated_code(pred):
    i, j = _grid(11, 13)
    want = np.broadcast_to(pred(i, j), (11, 13))
    got_torch = pred(torch.tensor(i), torch.tensor(j)).numpy()
    np.testing.assert_array_equal(np.broadcast_to(got_torch, (11, 13)), want)
    np.testing.assert_array_equal(_cuda_keep(pred, *np.broadcast_arrays(i, j)), want)


@pytest.mark.parametrize("pred", PREDICATES, ids=repr)
def test_support_holds_every_kept_entry(pred):
    """For rows [r0, r1), every kept column j has lo <= j < hi (ints), and the sympy algebra
    gives the same bounds: what the executor skips, the cost model counts as skipped."""
    n = 17
    i, j = _grid(n, n)
    keep = np.broadcast_to(pred(i, j), (n, n))
    r0s, r1s = sp.symbols("r0 r1", integer=True, nonnegative=True)
    lo_s, hi_s = pred.support(r0s, r1s, SympyAlgebra)
    for r0 in range(n):
        for r1 in range(r0 + 1, n + 1):
            lo, hi = pred.support(r0, r1, index.IntAlgebra)
            cols = np.nonzero(keep[r0:r1].any(axis=0))[0]
            if cols.size:
                assert lo <= cols.min() and cols.max() < hi, (pred, r0, r1, lo, hi, cols)
            assert (int(sp.sympify(lo_s).subs({r0s: r0, r1s: r1})), int(sp.sympify(hi_s).subs({r0s: r0, r1s: r1}))) \
                == (lo, hi)


def test_custom_predicate_has_no_support_and_no_code():
    p = nc.predicate(lambda i, j: (i + j) % 2 == 0, "parity")
    assert p.support(0, 4, index.IntAlgebra) is None and p.cuda("i", "j", str) is None


@pytest.mark.parametrize("bias", BIASES, ids=repr)
def test_index_bias_means_the_same_in_numpy_torch_and_generated_code(bias):
    from napkin_cat.lowering.source import Constants, Names
    i, j = np.broadcast_arrays(*_grid(7, 9))
    want = bias(i, j)
    np.testing.assert_allclose(bias(torch.tensor(i, dtype=torch.float64), torch.tensor(j, dtype=torch.float64)).numpy(),
                               want)
    consts = Constants(Names())
    expr = bias.cuda("i", "j", lambda v, name: consts.f(v, name))
    ns = {**consts.ints, **consts.floats, "float32": float}
    got = np.vectorize(lambda a, b: eval(expr, {**ns, "i": int(a), "j": int(b)}))(i, j)
    np.testing.assert_allclose(got, want, rtol=1e-6)


SUPPORTED = [index.Predicate(name, rule.examples[-1]) for name, rule in index.PREDICATES.items()
             if rule.cuda and rule.support]


@pytest.mark.parametrize("pred", SUPPORTED, ids=repr)
def test_a_predicate_rule_is_all_a_new_mask_needs(pred):
    """One rule in ops/index.py: the executor skips its chunks (checked against the oracle), the
    kernel skips them and passes its self-check, the cost model counts fewer tensor FLOPs."""
    q, x, d = nc.axes("q x d")
    att = nc.library.attention(q=q, x=x, d=d, mask=pred)
    flash = att.stream(x, "s_x").tile(q, "g_q")
    nc.check_equivalent(att, flash, examples=12)
    sizes = {q: 24, x: 24, d: 4}
    kernel = nc.lower(att.bind(sizes), tiles={"q": 8, "x": 4}, threads=32)   # verify=True: self-checked
    assert kernel.verified and "_end = min(" in kernel.source
    bound = {**sizes, "s_x": 4, "g_q": 8}
    dense = nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q").bind(bound)
    assert nc.cost(flash.bind(bound)).flops["tensor"] < nc.cost(dense).flops["tensor"]


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_a_function_calling_math_is_costed_on_the_special_function_unit(fn):
    """exp, log, erf, tanh, sqrt run on the SFU: a function whose code calls one of them has
    unit ``exp`` (dropping ``silu`` to ``fma`` would under-cost every SiLU MLP)."""
    f = FUNCTIONS[fn]
    if "math." in f.cuda:
        assert f.unit == "exp", f"{fn} calls {f.cuda!r} but is costed as {f.unit}"
