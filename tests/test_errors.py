"""Errors are NapkinErrors whose messages carry everything needed to fix the call.

A typing error names both sides' arrays with their axes, sizes and dtypes, and says where
they first differ; a shape error names the wire (array name and axes) and the size it
expected.  Evaluation never writes into the caller's arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import napkin_cat as nc
from napkin_cat import Array, Axis, Box, Diagram, Ty, f16, f32, i8, ops

a, b, c = Axis("a", 2), Axis("b", 3), Axis("c", 4)
MATMUL = nc.library.matmul(a, b, c)  # A[a=2 b=3], B[b=3 c=4] -> C[a=2 c=4], all f32


def exp_on(*axes_: Axis, dtype=f32, name="Z") -> Diagram:
    return ops.op("exp", Array(axes_, dtype, name))


# --------------------------------------------------------------------------- composition

def compose_error(f: Diagram, g: Diagram) -> str:
    with pytest.raises(nc.TypingError) as info:
        f >> g
    assert isinstance(info.value, nc.NapkinError)
    return str(info.value)


def test_compose_dtype_mismatch_names_both_sides():
    msg = compose_error(MATMUL, exp_on(a, c, dtype=f16))
    assert "cod of left : C[a=2 c=4] f32" in msg
    assert "dom of right: Z[a=2 c=4] f16" in msg
    assert "first mismatch at position 0" in msg and "dtype f32 vs f16" in msg


def test_compose_axis_name_mismatch_names_both_axis_lists():
    msg = compose_error(MATMUL, exp_on(a, Axis("e", 4)))
    assert "C[a=2 c=4] f32" in msg and "Z[a=2 e=4] f32" in msg
    assert "axes ['a', 'c'] vs ['a', 'e']" in msg


def test_compose_axis_order_mismatch_is_an_axis_mismatch():
    msg = compose_error(MATMUL, exp_on(c, a))
    assert "axes ['a', 'c'] vs ['c', 'a']" in msg


def test_compose_size_mismatch_names_both_sizes():
    msg = compose_error(MATMUL, exp_on(a, Axis("c", 5)))
    assert "C[a=2 c=4] f32" in msg and "Z[a=2 c=5] f32" in msg
    assert "sizes [2, 4] vs [2, 5]" in msg


def test_compose_symbolic_size_mismatch_names_the_symbol():
    msg = compose_error(MATMUL, exp_on(a, Axis("c")))
    assert "Z[a=2 c] f32" in msg and "sizes [2, 4] vs [2, 'c']" in msg


def test_compose_arity_mismatch_counts_both_sides():
    g = ops.op("add", Array((a, c), f32, "L"), Array((a, c), f32, "R"))
    msg = compose_error(MATMUL, g)
    assert "dom of right: L[a=2 c=4] f32, R[a=2 c=4] f32" in msg
    assert "left produces 1 array(s), right expects 2" in msg


def test_compose_reports_first_mismatch_position():
    two = MATMUL @ MATMUL
    g = exp_on(a, c) @ exp_on(a, c, dtype=f16, name="W")
    msg = compose_error(two, g)
    assert "first mismatch at position 1: C[a=2 c=4] f32 vs W[a=2 c=4] f16" in msg


# --------------------------------------------------------------------------- evaluation inputs

def shape_error(d: Diagram, *arrays, **kw) -> str:
    with pytest.raises(nc.ShapeError) as info:
        nc.evaluate(d, *arrays, **kw)
    assert isinstance(info.value, nc.NapkinError)
    return str(info.value)


def test_evaluate_wrong_size_names_wire_and_expected_size():
    msg = shape_error(MATMUL, np.ones((2, 3)), np.ones((5, 4)))
    assert "B[b=3 c=4] f32" in msg and "axis b should have size 3, got 5" in msg


def test_evaluate_inconsistent_symbolic_sizes_name_the_second_wire():
    # b is symbolic: the first array fixes it to 3, the second disagrees
    msg = shape_error(nc.library.matmul(), np.ones((2, 3)), np.ones((5, 4)))
    assert "B[b c] f32" in msg and "axis b should have size 3, got 5" in msg


def test_evaluate_size_contradicting_sizes_argument_is_refused():
    msg = shape_error(nc.library.matmul(), np.ones((2, 3)), np.ones((3, 4)), sizes={"a": 7})
    assert "A[a b] f32" in msg and "axis a should have size 7, got 2" in msg


def test_evaluate_wrong_number_of_axes_names_expected_axes():
    msg = shape_error(MATMUL, np.ones((2, 3, 1)), np.ones((3, 4)))
    assert "A[a=2 b=3] f32" in msg and "expected 2 axes (a b)" in msg and "(2, 3, 1)" in msg


@pytest.mark.parametrize("bad", [np.array([["x"] * 3] * 2), [["x"] * 3] * 2, np.ones((2, 3), dtype=complex),
                                 np.ones((2, 3), dtype=bool)], ids=["str-array", "str-list", "complex", "bool"])
def test_evaluate_non_numeric_dtype_names_wire(bad):
    msg = shape_error(MATMUL, bad, np.ones((3, 4)))
    assert "A[a=2 b=3] f32" in msg and "expected a real array" in msg


def test_evaluate_float_for_integer_wire_is_refused():
    d = Diagram.id(Ty(Array((a,), i8, "I")))
    msg = shape_error(d, np.ones(2))
    assert "I[a=2] i8" in msg and "expected an integer array" in msg


@pytest.mark.parametrize("n", [0, 1, 3])
def test_evaluate_wrong_number_of_arrays_names_the_inputs(n):
    msg = shape_error(MATMUL, *[np.ones((2, 3))] * n)
    assert f"takes 2 arrays (A, B), got {n}" in msg and "A[a=2 b=3] f32, B[b=3 c=4] f32" in msg


def test_evaluate_unbound_symbolic_size_asks_for_it():
    g = nc.Builder()
    d = g.diagram(g.const(1.0, Axis("k"), name="K"))
    msg = shape_error(d)
    assert "axis k" in msg and "K[k] f32" in msg and "sizes=" in msg


def test_evaluate_missing_param_names_it():
    g = nc.Builder()
    d = g.diagram(g.param("W", a))
    msg = shape_error(d)
    assert "W[a=2] f32" in msg and "params={'W'" in msg


def test_evaluate_param_of_wrong_shape_names_expected_shape():
    g = nc.Builder()
    d = g.diagram(g.param("W", a, b))
    msg = shape_error(d, params={"W": np.ones((3, 2))})
    assert "W[a=2 b=3] f32" in msg and "expected shape (2, 3), got (3, 2)" in msg


def test_to_torch_wrong_shape_and_arity_are_shape_errors():
    f = nc.to_torch(MATMUL)
    with pytest.raises(nc.ShapeError, match=r"B\[b=3 c=4\] f32: axis b should have size 3, got 5"):
        f(torch.ones(2, 3), torch.ones(5, 4))
    with pytest.raises(nc.ShapeError, match=r"takes 2 tensors \(A, B\), got 1"):
        f(torch.ones(2, 3))
    with pytest.raises(nc.ShapeError, match=r"A\[a=2 b=3\] f32: expected a torch.Tensor"):
        f(np.ones((2, 3)), torch.ones(3, 4))


# --------------------------------------------------------------------------- inputs are not mutated

@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_evaluate_does_not_mutate_inputs(dtype):
    d = nc.library.layernorm(Axis("t", 3), Axis("d", 4))
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal(s) * 10).astype(dtype) for s in ((3, 4), (4,), (4,))]
    copies = [x.copy() for x in xs]
    nc.evaluate(d, *xs)
    for x, x0 in zip(xs, copies):
        assert x.dtype == x0.dtype and np.array_equal(x, x0)


def test_evaluate_outputs_do_not_alias_inputs():
    # an identity wire hands back a fresh array: writing to it leaves the input alone
    x = np.arange(6.0).reshape(2, 3)
    out = nc.evaluate(Diagram.id(Ty(Array((a, b), f32, "X"))), x)
    out += 1
    assert np.array_equal(x, np.arange(6.0).reshape(2, 3))


def test_to_torch_does_not_mutate_inputs():
    d = nc.library.attention(Axis("q", 3), Axis("x", 4), Axis("d", 2), causal=True)
    ts = [torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64),
          torch.randn(4, 2, dtype=torch.float64, requires_grad=True)]
    copies = [t.detach().clone() for t in ts]
    nc.to_torch(d)(*ts).sum().backward()
    for t, t0 in zip(ts, copies):
        assert torch.equal(t.detach(), t0)


# --------------------------------------------------------------------------- unknown names

def test_unknown_elementwise_function_is_named():
    with pytest.raises(nc.TypingError, match="unknown elementwise function 'frobnicate'"):
        ops.op("frobnicate", Array((a,), f32, "X"))


def test_unknown_reduction_is_named():
    with pytest.raises(nc.TypingError, match="unknown reduction 'median'"):
        ops.reduce_box("median", Array((a,), f32, "X"), a)


UNKNOWN = Box("frobnicate", Ty(Array((a,), f32, "X")), Ty(Array((a,), f32, "Y"))).diagram()


def test_unknown_kind_is_named_by_evaluate():
    with pytest.raises(nc.UnknownKindError, match="box kind 'frobnicate'"):
        nc.evaluate(UNKNOWN, np.ones(2))


def test_unknown_kind_is_named_by_to_torch():
    with pytest.raises(nc.UnknownKindError, match="box kind 'frobnicate'"):
        nc.to_torch(UNKNOWN)


def test_unknown_kind_is_named_by_weave():
    with pytest.raises(nc.UnknownKindError, match="unknown kind 'frobnicate'"):
        UNKNOWN.weave(Axis("w", 2))


def test_unknown_kind_message_is_not_quoted():
    # UnknownKindError is also a KeyError, whose str() would wrap the text in quotes
    err = nc.UnknownKindError("no rule for 'x'")
    assert str(err) == "no rule for 'x'"


# --------------------------------------------------------------------------- weaving

def test_weave_over_input_axis_is_refused():
    with pytest.raises(nc.TypingError, match=r"cannot weave over b=3: wire A\[a=2 b=3\] f32 already has an axis named b"):
        MATMUL.weave(Axis("b", 3))


def test_weave_over_internal_axis_is_refused():
    # k lives only on an internal wire (a parameter): weaving over it would still clash
    g = nc.Builder()
    X = g.input("X", a)
    d = g.diagram(g.contract(X, g.param("W", a, Axis("k", 2)), out=(a,)))
    with pytest.raises(nc.TypingError, match="already has an axis named k"):
        d.weave(Axis("k", 5))


def test_weave_same_name_other_size_is_refused():
    with pytest.raises(nc.TypingError, match="already has an axis named a"):
        MATMUL.weave(Axis("a", 7))


def test_weave_input_index_out_of_range_is_refused():
    with pytest.raises(nc.TypingError, match="input index 2 out of range"):
        MATMUL.weave(Axis("w", 2), inputs=(2,))


# --------------------------------------------------------------------------- every error is a NapkinError

FAILURES = {
    "axis name": lambda: Axis("not an identifier"),
    "axis size": lambda: Axis("a", 0),
    "repeated axis": lambda: Array((a, a)),
    "compose": lambda: MATMUL >> MATMUL,
    "permute": lambda: Diagram.permute(Ty(Array((a,))), [1]),
    "weave": lambda: MATMUL.weave(a),
    "unknown fn": lambda: ops.op("frobnicate", Array((a,))),
    "arity": lambda: ops.op("add", Array((a,))),
    "scale without c": lambda: ops.op("scale", Array((a,))),
    "contract axis": lambda: ops.contract("a b -> c", Array((a, b))),
    "evaluate shape": lambda: nc.evaluate(MATMUL, np.ones((2, 2)), np.ones((3, 4))),
    "evaluate non-diagram": lambda: nc.evaluate("C = A @ B", np.ones(2)),
    "unknown kind": lambda: nc.evaluate(UNKNOWN, np.ones(2)),
    "to_torch kind": lambda: nc.to_torch(UNKNOWN),
    "normalisation": lambda: nc.library.normalized_attention(kind="l7"),
    "attention bias": lambda: nc.library.attention(bias="alibi"),
    "bind size": lambda: MATMUL.bind({"a": 0}),
    "rename arity": lambda: MATMUL.rename("X", "Y"),
}


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_every_error_is_a_napkin_error(name):
    with pytest.raises(nc.NapkinError) as info:
        FAILURES[name]()
    assert str(info.value)  # never an empty message


def test_error_classes_are_napkin_errors_and_builtin_errors():
    # callers can catch NapkinError for everything, or the matching builtin
    assert issubclass(nc.TypingError, TypeError) and issubclass(nc.ShapeError, ValueError)
    assert issubclass(nc.UnknownKindError, KeyError)
    for cls in (nc.TypingError, nc.ShapeError, nc.UnknownKindError, nc.RelabelError,
                nc.EquivalenceError, nc.CostError, nc.LoweringError):
        assert issubclass(cls, nc.NapkinError)
