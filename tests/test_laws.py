"""The laws of the diagram category, checked on random small diagrams (NAPKIN.md section 1).

Random diagrams come from *recipes*: plain data (input axis names, a list of steps, output
variables) that :func:`build` turns into a :class:`~napkin_cat.Diagram` for any choice of
axes.  Building one recipe with symbolic axes and with integer axes is how ``bind`` is
checked; building it twice is how structural equality and hashing are checked.

Hypothesis settings come from the profile loaded in ``tests/conftest.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import napkin_cat as nc
from napkin_cat import Axis, Builder, Diagram, Ty, ops

AXIS_NAMES = ("a", "b", "c", "d", "e")
WEAVE_AXIS = "w"  # never among AXIS_NAMES, so weaving over it is always allowed

# elementwise functions whose values stay finite on any real input and through a few
# compositions (exp, log, sqrt, recip, div can overflow or leave the domain: they are covered
# rule by rule in test_library.py instead)
SAFE_UNARY = ("neg", "abs", "square", "relu", "gelu", "silu", "sigmoid", "tanh", "identity",
              "sign", "scale", "shift")
SAFE_BINARY = ("add", "sub", "mul", "maximum")


# --------------------------------------------------------------------------- recipes

@dataclasses.dataclass(frozen=True)
class Recipe:
    inputs: tuple[tuple[str, ...], ...]   # axis names of each input array
    steps: tuple[tuple, ...]              # (kind, ...) with variable ids and axis names
    outs: tuple[int, ...]                 # variable ids of the outputs


def build(recipe: Recipe, axes: dict[str, Axis]) -> Diagram:
    g = Builder(nc.f32)
    wires = [g.input(f"X{i}", *(axes[n] for n in names)) for i, names in enumerate(recipe.inputs)]
    for step in recipe.steps:
        kind = step[0]
        if kind == "unary":
            _, fn, c, v = step
            wires.append(g.map(fn, wires[v], c=c))
        elif kind == "binary":
            _, fn, v, u = step
            wires.append(g.map(fn, wires[v], wires[u]))
        elif kind == "contract":
            _, vs, out = step
            wires.append(g.contract(*(wires[v] for v in vs), out=tuple(axes[n] for n in out)))
        elif kind == "reduce":
            _, op, v, ax = step
            wires.append(g.reduce(op, wires[v], axes[ax]))
        elif kind == "softmax":
            _, v, ax = step
            wires.append(g.softmax(wires[v], axes[ax]))
        else:  # pragma: no cover - the strategy only emits the kinds above
            raise AssertionError(kind)
    return g.diagram(*(wires[v] for v in recipe.outs))


def _subsequence(draw, names, min_size=0, max_size=None):
    """A random ordered selection (a permutation of a subset) of ``names``."""
    return tuple(draw(st.permutations(names))[: draw(st.integers(min_size, max_size or len(names)))])


@st.composite
def recipes(draw, inputs: tuple[tuple[str, ...], ...] | None = None, max_steps: int = 4) -> Recipe:
    """A random chain of maps, contractions, reductions and softmaxes over named axes.

    ``inputs`` fixes the input types (to build a diagram composable after another one)."""
    if inputs is None:
        n_in = draw(st.integers(1, 3))
        inputs = tuple(_subsequence(draw, AXIS_NAMES, 0, 3) for _ in range(n_in))
    types = [tuple(t) for t in inputs]
    steps = []
    for _ in range(draw(st.integers(0, max_steps))):
        v = draw(st.integers(0, len(types) - 1))
        kinds = ["unary", "binary", "contract"] + (["reduce", "softmax"] if types[v] else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "unary":
            fn = draw(st.sampled_from(SAFE_UNARY))
            c = draw(st.sampled_from((0.5, -1.25, 2.0))) if fn in ("scale", "shift") else None
            steps.append(("unary", fn, c, v))
            types.append(types[v])
        elif kind == "binary":
            u = draw(st.integers(0, len(types) - 1))
            steps.append(("binary", draw(st.sampled_from(SAFE_BINARY)), v, u))
            types.append(types[v] + tuple(n for n in types[u] if n not in types[v]))
        elif kind == "contract":
            vs = (v,) + tuple(draw(st.lists(st.integers(0, len(types) - 1), max_size=1)))
            union = tuple(dict.fromkeys(n for w in vs for n in types[w]))
            out = _subsequence(draw, union) if union else ()
            steps.append(("contract", vs, out))
            types.append(out)
        else:
            ax = draw(st.sampled_from(types[v]))
            if kind == "reduce":
                op = draw(st.sampled_from(ops.REDUCTIONS))
                steps.append(("reduce", op, v, ax))
                types.append(tuple(n for n in types[v] if n != ax))
            else:
                steps.append(("softmax", v, ax))
                types.append(types[v])
    # outputs: the last variable (so the steps matter) plus any others, repeats allowed (copy)
    extra = draw(st.lists(st.integers(0, len(types) - 1), max_size=2))
    return Recipe(tuple(inputs), tuple(steps), (len(types) - 1, *extra))


sizes_st = st.fixed_dictionaries({n: st.integers(1, 5) for n in AXIS_NAMES})


def int_axes(sizes: dict[str, int]) -> dict[str, Axis]:
    return {n: Axis(n, s) for n, s in sizes.items()}


@st.composite
def diagrams(draw, inputs=None, sizes=None) -> Diagram:
    sizes = sizes if sizes is not None else draw(sizes_st)
    return build(draw(recipes(inputs)), int_axes(sizes))


@st.composite
def diagram_sets(draw, n: int):
    """``n`` random diagrams sharing one choice of axis sizes (so they may compose)."""
    sizes = draw(sizes_st)
    return sizes, [draw(diagrams(sizes=sizes)) for _ in range(n)]


def input_names(d: Diagram) -> tuple[tuple[str, ...], ...]:
    return tuple(a.axis_names for a in d.cod)


# --------------------------------------------------------------------------- numerics helpers

def random_inputs(ty: Ty, seed: int, lead: dict[int, int] | None = None) -> list[np.ndarray]:
    """Float64 arrays for ``ty``; ``lead[i] = n`` prepends an axis of size n to input i."""
    rng = np.random.default_rng(seed)
    lead = lead or {}
    out = []
    for i, arr in enumerate(ty):
        shape = tuple(int(ax.size) for ax in arr.axes)
        out.append(rng.standard_normal(((lead[i],) if i in lead else ()) + shape))
    return out


def as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def assert_close(actual, expected, rtol=1e-10):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    # the absolute tolerance follows the magnitude: sums taken in another order may cancel
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0, where=np.isfinite(expected))))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, equal_nan=True)


def assert_all_close(actual: tuple, expected: tuple):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_close(a, e)


seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- associativity
#
# ``>>`` and ``@`` normalise, so ``(f >> g) >> h`` and ``f >> (g >> h)`` build the same
# diagram: evaluating both would compare a value with itself.  The semantic half therefore
# evaluates the two bracketings as two different computations, each composite evaluated as
# one diagram and the rest applied to its results (F((f >> g) >> h) = F(h) . F(f >> g) and
# F(f >> (g >> h)) = F(g >> h) . F(f)), and checks both against the whole composite.


def _run(d: Diagram, *xs) -> tuple:
    return as_tuple(nc.evaluate(d, *xs))


def check_then_associative(f: Diagram, g: Diagram, h: Diagram, seed: int) -> None:
    xs = random_inputs(f.dom, seed)
    left = _run(h, *_run(f >> g, *xs))        # (f >> g) >> h
    right = _run(g >> h, *_run(f, *xs))       # f >> (g >> h)
    assert_all_close(left, right)
    assert_all_close(_run((f >> g) >> h, *xs), left)
    assert (f >> g) >> h == f >> (g >> h)


def check_tensor_associative(f: Diagram, g: Diagram, h: Diagram, seed: int) -> None:
    xs = random_inputs(f.dom @ g.dom @ h.dom, seed)
    nf, ng = len(f.dom), len(g.dom)
    left = _run(f @ g, *xs[:nf + ng]) + _run(h, *xs[nf + ng:])      # (f @ g) @ h
    right = _run(f, *xs[:nf]) + _run(g @ h, *xs[nf:])              # f @ (g @ h)
    assert_all_close(left, right)
    assert_all_close(_run((f @ g) @ h, *xs), left)
    assert (f @ g) @ h == f @ (g @ h)
    assert ((f @ g) @ h).dom == f.dom @ g.dom @ h.dom and ((f @ g) @ h).cod == f.cod @ g.cod @ h.cod


@given(diagram_sets(1), st.data(), seeds)
def test_then_associative_semantically_and_structurally(fs, data, seed):
    sizes, (f,) = fs
    g = data.draw(diagrams(input_names(f), sizes))
    h = data.draw(diagrams(input_names(g), sizes))
    check_then_associative(f, g, h, seed)


@given(diagram_sets(3), seeds)
def test_tensor_associative_semantically_and_structurally(fs, seed):
    _, (f, g, h) = fs
    check_tensor_associative(f, g, h, seed)


def _swap_same_typed() -> Diagram:
    """Two inputs of one type, output in the other order: wiring bugs that only permute
    same-typed wires type-check, so only values can show them."""
    g = Builder(nc.f32)
    a = Axis("a", 3)
    x, y = g.input("X", a), g.input("Y", a)
    return g.diagram(y, g.map("scale", x, c=2.0))


def _difference() -> Diagram:
    g = Builder(nc.f32)
    a = Axis("a", 3)
    return g.diagram(g.map("sub", g.input("P", a), g.input("Q", a)))


def _negation() -> Diagram:
    g = Builder(nc.f32)
    return g.diagram(g.map("neg", g.input("D", Axis("a", 3))))


def test_associativity_sees_wires_of_one_type_permuted():
    f, sub, neg = _swap_same_typed(), _difference(), _negation()
    check_then_associative(f, sub, neg, seed=1)
    check_tensor_associative(f, sub, f, seed=2)


# --------------------------------------------------------------------------- units

@given(diagrams())
def test_identity_is_unit_of_then(f):
    assert Diagram.id(f.dom) >> f == f
    assert f >> Diagram.id(f.cod) == f


@given(diagrams())
def test_empty_identity_is_unit_of_tensor(f):
    unit = Diagram.id(Ty())
    assert f @ unit == f
    assert unit @ f == f


@given(diagram_sets(2))
def test_identity_of_tensor_is_tensor_of_identities(fs):
    _, (f, g) = fs
    assert Diagram.id(f.dom @ g.dom) == Diagram.id(f.dom) @ Diagram.id(g.dom)


# --------------------------------------------------------------------------- interchange, symmetry

@given(diagram_sets(2), st.data(), seeds)
def test_interchange_law_holds_semantically(fs, data, seed):
    sizes, (f, g) = fs
    h = data.draw(diagrams(input_names(f), sizes))
    k = data.draw(diagrams(input_names(g), sizes))
    left, right = (f @ g) >> (h @ k), (f >> h) @ (g >> k)
    assert left.dom == right.dom and left.cod == right.cod
    xs = random_inputs(left.dom, seed)
    assert_all_close(as_tuple(nc.evaluate(left, *xs)), as_tuple(nc.evaluate(right, *xs)))


@given(diagram_sets(2), seeds)
def test_swap_is_natural(fs, seed):
    # (f @ g) >> swap == swap >> (g @ f): wires can cross boxes
    _, (f, g) = fs
    left = (f @ g) >> Diagram.swap(f.cod, g.cod)
    right = Diagram.swap(f.dom, g.dom) >> (g @ f)
    xs = random_inputs(left.dom, seed)
    assert_all_close(as_tuple(nc.evaluate(left, *xs)), as_tuple(nc.evaluate(right, *xs)))


@given(diagrams(), seeds)
def test_copy_then_discard_is_identity(f, seed):
    arr = f.cod[0]
    round_trip = Diagram.copy(arr) >> (Diagram.id(arr) @ Diagram.discard(Ty(arr)))
    assert round_trip.dom == round_trip.cod == Ty(arr)
    (x,) = random_inputs(Ty(arr), seed)
    assert_close(nc.evaluate(round_trip, x), x)


# --------------------------------------------------------------------------- evaluation is a functor

@given(diagram_sets(1), st.data(), seeds)
def test_evaluate_preserves_then(fs, data, seed):
    sizes, (f,) = fs
    g = data.draw(diagrams(input_names(f), sizes))
    xs = random_inputs(f.dom, seed)
    staged = nc.evaluate(g, *as_tuple(nc.evaluate(f, *xs)))
    assert_all_close(as_tuple(nc.evaluate(f >> g, *xs)), as_tuple(staged))


@given(diagram_sets(2), seeds)
def test_evaluate_preserves_tensor(fs, seed):
    _, (f, g) = fs
    xs = random_inputs(f.dom @ g.dom, seed)
    n = len(f.dom)
    side_by_side = as_tuple(nc.evaluate(f, *xs[:n])) + as_tuple(nc.evaluate(g, *xs[n:]))
    assert_all_close(as_tuple(nc.evaluate(f @ g, *xs)), side_by_side)


# --------------------------------------------------------------------------- weave = loop = vmap

@st.composite
def weavings(draw):
    """A random diagram, a size for the new axis and a non-empty set of mapped inputs."""
    f = draw(diagrams())
    n = draw(st.integers(1, 4))
    mapped = tuple(sorted(draw(st.sets(st.integers(0, len(f.dom) - 1), min_size=1))))
    return f, n, mapped


@given(weavings(), seeds)
def test_weave_equals_loop_over_new_axis(case, seed):
    f, n, mapped = case
    w = Axis(WEAVE_AXIS, n)
    woven = f.weave(w, inputs=mapped)
    for i, (before, after) in enumerate(zip(f.dom, woven.dom)):
        assert after.axes == ((w,) + before.axes if i in mapped else before.axes)
    xs = random_inputs(f.dom, seed, lead={i: n for i in mapped})
    result = as_tuple(nc.evaluate(woven, *xs))
    for j in range(n):
        # inputs not mapped are shared by every j (inner broadcasting)
        expected = as_tuple(nc.evaluate(f, *(x[j] if i in mapped else x for i, x in enumerate(xs))))
        for arr, got, want in zip(woven.cod, result, expected):
            assert_close(got[j] if arr.has(w) else got, want)


@given(weavings(), seeds)
def test_weave_equals_torch_vmap(case, seed):
    f, n, mapped = case
    woven = f.weave(Axis(WEAVE_AXIS, n), inputs=mapped)
    xs = random_inputs(f.dom, seed, lead={i: n for i in mapped})
    in_dims = tuple(0 if i in mapped else None for i in range(len(f.dom)))
    out_dims = tuple(0 if a.has(WEAVE_AXIS) else None for a in woven.cod)
    vmapped = torch.vmap(nc.to_torch(f), in_dims=in_dims,
                         out_dims=out_dims if len(out_dims) > 1 else out_dims[0])
    got = as_tuple(vmapped(*map(torch.from_numpy, xs)))
    want = as_tuple(nc.evaluate(woven, *xs))
    assert_all_close(tuple(t.detach().numpy() for t in got), want)


@given(diagrams())
def test_weave_refuses_axis_already_present(f):
    present = f.axes[0] if f.axes else None
    if present is None:
        return  # a diagram of scalars has no axis to repeat
    with pytest.raises(nc.TypingError, match=f"already has an axis named {present.name}"):
        f.weave(present)


# --------------------------------------------------------------------------- repr, bind, hashing

def repr_namespace() -> dict:
    return vars(nc) | {"Predicate": ops.Predicate, "IndexBias": ops.IndexBias}


@given(recipes(), sizes_st, st.booleans())
def test_repr_round_trips(recipe, sizes, symbolic):
    axes = {n: Axis(n) for n in AXIS_NAMES} if symbolic else int_axes(sizes)
    d = build(recipe, axes)
    assert eval(repr(d), repr_namespace()) == d


@pytest.mark.parametrize("d", [
    nc.library.attention(causal=True, window_size=3, bias=nc.alibi(0.5), heads=Axis("h", 2)),
    nc.library.attention(groups=Axis("g"), heads=Axis("h"), batch=Axis("b"), bias="input", scale=0.25),
    nc.library.normalized_attention(kind="l1"),
    nc.library.layernorm(eps=1e-3),
    ops.const_box(nc.Array((Axis("a", 3),), nc.f32, "m"), float("-inf")).diagram(),
], ids=["alibi-causal-window", "gqa-bias", "l1-attention", "layernorm", "const-minus-inf"])
def test_repr_round_trips_for_every_param_type(d):
    assert eval(repr(d), repr_namespace()) == d


@st.composite
def symbolic_cases(draw):
    """A recipe, integer sizes, and for each axis how its size is named in the bind dict."""
    recipe, sizes = draw(recipes()), draw(sizes_st)
    key_kind = {n: draw(st.sampled_from(("axis", "name", "symbol"))) for n in AXIS_NAMES}
    return recipe, sizes, key_kind


@given(symbolic_cases(), seeds)
def test_bind_substitutes_sizes(case, seed):
    recipe, sizes, key_kind = case
    # axis n has the symbolic size N_n, so a key can be the Axis, its name or its symbol
    sym = {n: Axis(n, f"N_{n}") for n in AXIS_NAMES}
    key = {"axis": lambda n: sym[n], "name": lambda n: n, "symbol": lambda n: f"N_{n}"}
    d = build(recipe, sym)
    used = {ax.name for ax in d.axes}   # a name the diagram lacks is refused, not ignored
    bound = d.bind({key[key_kind[n]](n): sizes[n] for n in AXIS_NAMES if n in used})
    assert bound == build(recipe, int_axes(sizes))
    assert all(not ax.symbolic for ax in bound.axes)
    xs = random_inputs(bound.dom, seed)
    assert_all_close(as_tuple(nc.evaluate(d, *xs, sizes={sym[n]: s for n, s in sizes.items() if n in used})),
                     as_tuple(nc.evaluate(bound, *xs)))


@given(recipes(), sizes_st)
def test_bind_leaves_unnamed_axes_symbolic(recipe, sizes):
    d = build(recipe, {n: Axis(n) for n in AXIS_NAMES})
    if "a" not in {ax.name for ax in d.axes}:   # binding an axis the diagram lacks is refused
        with pytest.raises(nc.TypingError, match="sizes names 'a'"):
            d.bind({"a": sizes["a"]})
        return
    bound = d.bind({"a": sizes["a"]})
    assert {ax.name: ax.size for ax in bound.axes} == {
        ax.name: (sizes["a"] if ax.name == "a" else ax.name) for ax in d.axes}


def test_bind_reaches_size_dependent_constants():
    # attention scales by AxisPower(d) = 1/sqrt(d): binding must reach that parameter too
    q, x, d = nc.axes("q x d")
    bound = nc.library.attention(q, x, d).bind({"q": 4, "x": 5, "d": 3})
    assert bound == nc.library.attention(Axis("q", 4), Axis("x", 5), Axis("d", 3))


@given(recipes(), sizes_st)
def test_frozen_values_hash_and_compare_structurally(recipe, sizes):
    axes = int_axes(sizes)
    d1, d2 = build(recipe, axes), build(recipe, axes)
    assert d1 is not d2 and d1 == d2 and hash(d1) == hash(d2)
    assert {d1: "cached"}[d2] == "cached"
    # wire and box names label the drawing only: they take no part in equality
    renamed = d1.rename(*(f"Y{i}" for i in range(len(d1.cod))))
    assert renamed == d1 and hash(renamed) == hash(d1)
    box = d1.eqns[0].box if d1.eqns else nc.ops.param_box(d1.dom[0])
    for value, field in ((d1, "outs"), (d1.dom, "arrays"), (d1.dom[0], "axes"), (box, "params"),
                         (axes["a"], "size")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)


def test_array_equality_ignores_wire_name():
    a, b = nc.axes("a b")
    assert nc.Array((a, b), nc.f32, "A") == nc.Array((a, b), nc.f32, "B")
    assert hash(nc.Array((a, b), nc.f32, "A")) == hash(nc.Array((a, b), nc.f32, "B"))
    assert nc.Array((a, b), nc.f32) != nc.Array((b, a), nc.f32) != nc.Array((a, b), nc.f16)
