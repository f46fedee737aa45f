"""Hostile calls to the public API: each is refused with a NapkinError naming what is wrong.

Every case is ``(call, expected NapkinError subclass, substring of the message)``: the
substring names the offending axis, size, dtype, option or argument.  Nothing is accepted
silently (an option that would be ignored is an error; a relabeling that is not valid is
refused, never fixed), nothing leaks a bare ``ValueError``/``AttributeError``/``TypeError``,
and no input is mutated.
"""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # kernels run in numba's CUDA simulator

import numpy as np
import pytest
import torch

import napkin_cat as nc
from napkin_cat import Array, Axis, Diagram, Ty, f16, f32, ops
from napkin_cat.core.errors import (CostError, DrawingError, NapkinError, RelabelError, ShapeError,
                               TypingError)

a, b, c = Axis("a", 2), Axis("b", 3), Axis("c", 4)
MM = nc.library.matmul(a, b, c)             # A[a=2 b=3], B[b=3 c=4] -> C[a=2 c=4]
SYM = nc.library.matmul()                   # symbolic a, b, c
q, x, d = nc.axes("q x d")
ATT = nc.library.attention(q, x, d)
FLASH = ATT.stream(x, "s_x").tile(q, "g_q")
COST = nc.cost(FLASH)
SIZES = {q: 64, x: 64, d: 16}
H100 = nc.hardware.H100
A23, B34 = np.ones((2, 3)), np.ones((3, 4))


def _lse(r=Axis("r", 4), k=Axis("k", 6)) -> Diagram:
    g = nc.Builder()
    return g.diagram(g.reduce("logsumexp", g.input("X", r, k), k))


def _builder_call(fn):
    def call():
        g = nc.Builder()
        return fn(g, g.input("X", a, b))
    return call


CASES = {
    # ---- strings or wrong types where numbers, dtypes, predicates, hardware or diagrams go
    "attention scale str": (lambda: nc.library.attention(scale="abc"), TypingError, "'abc'"),
    "attention scale list": (lambda: nc.library.attention(scale=[1]), TypingError, "attention scale"),
    "attention scale nan": (lambda: nc.library.attention(scale=float("nan")), TypingError, "finite"),
    "attention mask str": (lambda: nc.library.attention(mask="causal"), TypingError, "'causal'"),
    "attention mask int": (lambda: nc.library.attention(mask=3), TypingError, "mask must be a Predicate"),
    "attention causal str": (lambda: nc.library.attention(causal="yes"), TypingError, "'yes'"),
    "attention window -1": (lambda: nc.library.attention(window_size=-1), TypingError, "window_size"),
    "attention window 2.5": (lambda: nc.library.attention(window_size=2.5), TypingError, "2.5"),
    "attention window str": (lambda: nc.library.attention(window_size="w"), TypingError, "'w'"),
    "attention bias": (lambda: nc.library.attention(bias="alibi"), TypingError, "'alibi'"),
    "attention heads str": (lambda: nc.library.attention(heads="h"), TypingError, "'h'"),
    "attention dtype str": (lambda: nc.library.attention(dtype="f16"), TypingError, "'f16'"),
    "matmul dtype str": (lambda: nc.library.matmul(dtype="f16"), TypingError, "'f16'"),
    "linear dtype str": (lambda: nc.library.linear(dtype="f16"), TypingError, "'f16'"),
    "layernorm dtype str": (lambda: nc.library.layernorm(dtype="f16"), TypingError, "'f16'"),
    "softmax numpy dtype": (lambda: nc.library.softmax(dtype=np.float16), TypingError, "float16"),
    "layernorm eps str": (lambda: nc.library.layernorm(eps="x"), TypingError, "'x'"),
    "normalized eps str": (lambda: nc.library.normalized_attention(eps="x"), TypingError, "'x'"),
    "normalized kind": (lambda: nc.library.normalized_attention(kind="l7"), TypingError, "'l7'"),
    "linear activation": (lambda: nc.library.linear(activation="frob"), TypingError, "'frob'"),
    "matmul axis str": (lambda: nc.library.matmul("a"), TypingError, "'a'"),
    "matmul axis float": (lambda: nc.library.matmul(2.5), TypingError, "2.5"),
    "matmul axis bool": (lambda: nc.library.matmul(True), TypingError, "True"),
    "Builder dtype str": (lambda: nc.Builder("f16"), TypingError, "'f16'"),
    "Builder input dtype str": (lambda: nc.Builder().input("X", a, dtype="f16"), TypingError, "'f16'"),
    "Builder param dtype str": (lambda: nc.Builder().param("W", a, dtype="f16"), TypingError, "'f16'"),
    "Builder cast dtype str": (_builder_call(lambda g, X: g.cast(X, "f16")), TypingError, "'f16'"),
    "Builder const str": (_builder_call(lambda g, X: g.const("x", a)), TypingError, "'x'"),
    "Builder mask pred str": (_builder_call(lambda g, X: g.mask(X, a, b, "causal")), TypingError, "'causal'"),
    "Builder scale by str": (_builder_call(lambda g, X: X * "2"), TypingError, "'2'"),
    "Builder foreign wire": (lambda: nc.Builder().contract("X", out=(a,)), TypingError, "'X'"),
    "Builder diagram non-wire": (lambda: nc.Builder().diagram("X"), TypingError, "'X'"),
    "Builder names count": (_builder_call(lambda g, X: g.diagram(X, names=["A", "B"])), TypingError,
                            "['A', 'B']"),
    "Array dtype str": (lambda: Array((a,), "f16"), TypingError, "'f16'"),
    "Array axes str": (lambda: Array("ab"), TypingError, "'ab'"),
    "Array name int": (lambda: Array((a,), f32, 3), TypingError, "3"),
    "Ty of int": (lambda: Ty(3), TypingError, "got 3"),
    "cast_box dtype str": (lambda: ops.cast_box(Array((a,)), "f16"), TypingError, "'f16'"),
    "op on str": (lambda: ops.op("exp", "X"), TypingError, "'X'"),
    "op scale c str": (lambda: ops.op("scale", Array((a,)), c="x"), TypingError, "'x'"),
    "op c ignored": (lambda: ops.op("exp", Array((a,)), c=2.0), TypingError, "c=2.0"),
    "op fn int": (lambda: ops.op(3, Array((a,))), TypingError, "3"),
    "contract spec no arrow": (lambda: ops.contract("a b", Array((a, b))), TypingError, "'a b'"),
    "contract spec int": (lambda: ops.contract(3, Array((a, b))), TypingError, "3"),
    "reduce axis int": (lambda: ops.reduce_box("sum", Array((a,)), 3), TypingError, "got 3"),
    "mask_box pred str": (lambda: ops.mask_box(Array((a, b)), a, b, "causal"), TypingError, "'causal'"),
    "normalize eps str": (lambda: ops.normalize_box(Array((a,)), a, "exp", "exp", "identity", eps="x"),
                          TypingError, "'x'"),
    "alibi str": (lambda: nc.alibi("x"), TypingError, "'x'"),
    "causal str": (lambda: nc.causal("x"), TypingError, "'x'"),
    "causal float": (lambda: nc.causal(1.5), TypingError, "1.5"),
    "window str": (lambda: nc.window("x"), TypingError, "'x'"),
    "window -1": (lambda: nc.window(-1), TypingError, "window left size"),
    "window right -2": (lambda: nc.window(0, -2), TypingError, "window right size"),
    "window 2.5": (lambda: nc.window(2.5), TypingError, "2.5"),
    "predicate not callable": (lambda: nc.predicate(3), TypingError, "got 3"),
    "diagram >> 3": (lambda: MM >> 3, TypingError, "int"),
    "3 >> diagram": (lambda: 3 >> MM, TypingError, "int >>"),
    "diagram @ str": (lambda: MM @ "x", TypingError, "'x'"),
    "str @ diagram": (lambda: "x" @ MM, TypingError, "str @"),
    "diagram >> None": (lambda: MM >> None, TypingError, "None"),
    "then list": (lambda: MM.then([1]), TypingError, "list"),
    "evaluate int": (lambda: nc.evaluate(3, np.ones(2)), TypingError, "int"),
    "to_torch int": (lambda: nc.to_torch(3), TypingError, "int"),
    "cost int": (lambda: nc.cost(3), CostError, "int"),
    "cost hierarchy str": (lambda: nc.cost(FLASH, hierarchy="x"), CostError, "'x'"),
    "optimize hw str": (lambda: COST.optimize(SIZES, hw="H100"), CostError, "nc.hardware.H100"),
    "time hw str": (lambda: COST.time("H100", SIZES), CostError, "'H100'"),
    "occupancy hw str": (lambda: COST.occupancy("H100", {**SIZES, "g_q": 16, "s_x": 16}), CostError, "'H100'"),
    "multilevel hw str": (lambda: COST.multilevel(SIZES, "H100", dtype=f16), CostError, "'H100'"),
    "optimize dtype str": (lambda: COST.optimize(SIZES, hw=H100, dtype="f16"), CostError, "'f16'"),
    "time dtype str": (lambda: COST.time(H100, SIZES, dtype="f16"), CostError, "'f16'"),
    "bytes dtype str": (lambda: COST.bytes("HBM", "f16"), CostError, "'f16'"),
    "closed_form dtype str": (lambda: COST.closed_form("SMEM", True, "f16"), CostError, "'f16'"),
    "optimize memory str": (lambda: COST.optimize(SIZES, memory="big"), CostError, "'big'"),
    "optimize sizes int": (lambda: COST.optimize(3, memory=4096), CostError, "got 3"),
    "evaluate sizes int": (lambda: nc.evaluate(SYM, A23, B34, sizes=3), TypingError, "got 3"),
    "evaluate params int": (lambda: nc.evaluate(MM, A23, B34, params=3), TypingError, "got 3"),
    "evaluate reference str": (lambda: nc.evaluate(MM, A23, B34, reference="no"), TypingError, "'no'"),
    "evaluate None input": (lambda: nc.evaluate(MM, None, B34), ShapeError, "A[a=2 b=3] f32"),
    "evaluate ragged list": (lambda: nc.evaluate(MM, [[1, 2, 3], [1, 2]], B34), ShapeError, "A[a=2 b=3] f32"),
    "evaluate object array": (lambda: nc.evaluate(MM, np.array([[object()] * 3] * 2), B34), ShapeError,
                              "A[a=2 b=3] f32"),
    "evaluate complex tensor": (lambda: nc.evaluate(MM, torch.ones(2, 3, dtype=torch.complex64), B34),
                                ShapeError, "complex64"),
    "to_torch complex": (lambda: nc.to_torch(MM)(torch.ones(2, 3, dtype=torch.complex64), torch.ones(3, 4)),
                         ShapeError, "complex64"),
    "to_torch bool": (lambda: nc.to_torch(MM)(torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 4)),
                      ShapeError, "torch.bool"),

    # ---- duplicate or empty axis names
    "axes duplicate": (lambda: nc.axes("q q"), TypingError, "['q']"),
    "axes empty": (lambda: nc.axes(""), TypingError, "no axis names"),
    "axes int": (lambda: nc.axes(3), TypingError, "got 3"),
    "axes size for other name": (lambda: nc.axes("q", z=3), TypingError, "['z']"),
    "axes size 0": (lambda: nc.axes("q", q=0), TypingError, "axis q"),
    "Axis empty name": (lambda: Axis("", 3), TypingError, "''"),
    "Axis name with space": (lambda: Axis("not an identifier"), TypingError, "'not an identifier'"),
    "Array same axis twice": (lambda: Array((a, a)), TypingError, "['a', 'a']"),
    "Array same name two sizes": (lambda: Array((a, Axis("a", 5))), TypingError, "repeated axis"),

    # ---- zero, negative, non-integer, NaN, bool or symbolic sizes where numbers are needed
    "Axis 0": (lambda: Axis("a", 0), TypingError, "axis a"),
    "Axis -3": (lambda: Axis("a", -3), TypingError, "-3"),
    "Axis 2.5": (lambda: Axis("a", 2.5), TypingError, "2.5"),
    "Axis nan": (lambda: Axis("a", float("nan")), TypingError, "nan"),
    "Axis bool": (lambda: Axis("a", True), TypingError, "True"),
    "Axis bad symbol": (lambda: Axis("a", "n m"), TypingError, "'n m'"),
    "Axis empty symbol": (lambda: Axis("a", ""), TypingError, "''"),
    "bind 0": (lambda: SYM.bind({"a": 0}), TypingError, "axis a"),
    "bind -2": (lambda: SYM.bind({"a": -2}), TypingError, "-2"),
    "bind 2.5": (lambda: SYM.bind({"a": 2.5}), TypingError, "2.5"),
    "bind nan": (lambda: SYM.bind({"a": float("nan")}), TypingError, "nan"),
    "bind bool": (lambda: SYM.bind({"a": True}), TypingError, "True"),
    "bind bad symbol": (lambda: SYM.bind({"a": "n m"}), TypingError, "'n m'"),
    "bind block 0": (lambda: FLASH.bind({"s_x": 0}), TypingError, "s_x"),
    "bind concrete to other size": (lambda: MM.bind({"a": 5}), TypingError, "axis a has size 2"),
    "evaluate sizes 0": (lambda: nc.evaluate(SYM, A23, B34, sizes={"a": 0}), ShapeError, "a"),
    "evaluate sizes -1": (lambda: nc.evaluate(SYM, A23, B34, sizes={"a": -1}), ShapeError, "-1"),
    "evaluate sizes 2.5": (lambda: nc.evaluate(SYM, A23, B34, sizes={"a": 2.5}), ShapeError, "2.5"),
    "evaluate sizes nan": (lambda: nc.evaluate(SYM, A23, B34, sizes={"a": float("nan")}), ShapeError, "nan"),
    "evaluate sizes bool": (lambda: nc.evaluate(SYM, A23, B34, sizes={"a": True}), ShapeError, "True"),
    "evaluate sizes symbol": (lambda: nc.evaluate(SYM, A23, B34, sizes={"a": "n"}), ShapeError, "'n'"),
    "evaluate block 2.5": (lambda: nc.evaluate(FLASH, np.ones((4, 2)), np.ones((5, 2)), np.ones((5, 2)),
                                               sizes={"g_q": 2.5, "s_x": 2}), ShapeError, "g_q"),
    "evaluate unbound block": (lambda: nc.evaluate(FLASH, np.ones((4, 2)), np.ones((5, 2)), np.ones((5, 2))),
                               ShapeError, "g_q"),
    "to_torch sizes 0": (lambda: nc.to_torch(SYM)(torch.ones(2, 3), torch.ones(3, 4), sizes={"a": 0}),
                         ShapeError, "a"),
    "stream 2.5": (lambda: ATT.stream(x, 2.5), RelabelError, "2.5"),
    "stream 0": (lambda: ATT.stream(x, 0), RelabelError, "axis x"),
    "stream -3": (lambda: ATT.stream(x, -3), RelabelError, "-3"),
    "stream nan": (lambda: ATT.stream(x, float("nan")), RelabelError, "nan"),
    "stream bool": (lambda: ATT.stream(x, True), RelabelError, "True"),
    "stream bad symbol": (lambda: ATT.stream(x, "s x"), RelabelError, "'s x'"),
    "tile 0": (lambda: ATT.tile(q, 0), RelabelError, "axis q"),
    "tile -3": (lambda: ATT.tile(q, -3), RelabelError, "-3"),
    "tile 2.5": (lambda: ATT.tile(q, 2.5), RelabelError, "2.5"),
    "require 0": (lambda: ATT.require(q, 0), RelabelError, "require(q)"),
    "require 2.5": (lambda: ATT.require(q, 2.5), RelabelError, "2.5"),
    "optimize sizes 0": (lambda: COST.optimize({**SIZES, q: 0}, memory=4096), CostError, "q"),
    "optimize sizes 2.5": (lambda: COST.optimize({**SIZES, q: 2.5}, memory=4096), CostError, "2.5"),
    "optimize memory 0": (lambda: COST.optimize(SIZES, memory=0), CostError, "memory"),
    "optimize memory 2.5": (lambda: COST.optimize(SIZES, memory=4096.5), CostError, "4096.5"),
    "optimize fixed 0": (lambda: COST.optimize(SIZES, memory=4096, fixed={"s_x": 0}), CostError, "s_x"),
    "optimize fixed 2.5": (lambda: COST.optimize(SIZES, memory=4096, fixed={"s_x": 2.5}), CostError, "2.5"),
    "time sizes 0": (lambda: COST.time(H100, {**SIZES, q: 0}), CostError, "q"),
    "subs 0": (lambda: COST.subs({q: 0}), CostError, "q"),
    "occupancy stages 0": (lambda: COST.occupancy(H100, {**SIZES, "g_q": 16, "s_x": 16}, stages=0),
                           CostError, "stages"),
    "cross_transfer N 0": (lambda: COST.cross_transfer(1024, 0, 1, 1), CostError, "N"),
    "copy -1": (lambda: Diagram.copy(Array((a,)), -1), TypingError, "-1"),

    # ---- unknown names
    "evaluate sizes unknown": (lambda: nc.evaluate(SYM, A23, B34, sizes={"zz": 3}), TypingError, "'zz'"),
    "evaluate params unknown": (lambda: nc.evaluate(MM, A23, B34, params={"W": np.ones(2)}), ShapeError, "'W'"),
    "to_torch sizes unknown": (lambda: nc.to_torch(SYM)(torch.ones(2, 3), torch.ones(3, 4), sizes={"zz": 3}),
                               TypingError, "'zz'"),
    "bind unknown name": (lambda: SYM.bind({"zz": 3}), TypingError, "'zz'"),
    "bind unknown Axis": (lambda: SYM.bind({Axis("zz", 3): 3}), TypingError, "'zz'"),
    "bind int key": (lambda: SYM.bind({3: 3}), TypingError, "3"),
    "bind not a dict": (lambda: SYM.bind(3), TypingError, "got 3"),
    "stream unknown axis": (lambda: ATT.stream("zz", 4), RelabelError, "'zz'"),
    "stream axis int": (lambda: ATT.stream(3, 4), RelabelError, "got 3"),
    "stream unknown level": (lambda: ATT.stream(x, 4, "L9"), RelabelError, "'L9'"),
    "stream level int": (lambda: ATT.stream(x, 4, 3), RelabelError, "got 3"),
    "tile unknown axis": (lambda: ATT.tile("zz", 4), RelabelError, "'zz'"),
    "tile into top level": (lambda: ATT.tile(q, 4, "HBM"), RelabelError, "HBM"),
    "tile other-size Axis": (lambda: ATT.tile(Axis("q", 7), 2), RelabelError, "q=7"),
    "place unknown array": (lambda: ATT.place("ZZ", "SMEM"), RelabelError, "'ZZ'"),
    "place unknown level": (lambda: ATT.place("Q", "L9"), RelabelError, "'L9'"),
    "require unknown axis": (lambda: ATT.require("zz", 2), RelabelError, "'zz'"),
    "order unknown axis": (lambda: FLASH.order("zz"), RelabelError, "'zz'"),
    "weave str": (lambda: MM.weave("w"), TypingError, "'w'"),
    "weave inputs int": (lambda: MM.weave(Axis("w", 2), inputs=0), TypingError, "got 0"),
    "weave inputs str": (lambda: MM.weave(Axis("w", 2), inputs=("A",)), TypingError, "'A'"),
    "weave inputs repeated": (lambda: MM.weave(Axis("w", 2), inputs=(0, 0)), TypingError, "[0, 0]"),
    "permute str index": (lambda: Diagram.permute(Ty(Array((a,))), ["x"]), TypingError, "'x'"),
    "id of int": (lambda: Diagram.id(3), TypingError, "got 3"),
    "rename int": (lambda: MM.rename(3), TypingError, "got 3"),
    "rename empty": (lambda: MM.rename(""), TypingError, "''"),
    "optimize sizes unknown": (lambda: COST.optimize({**SIZES, "zz": 64}, memory=4096), CostError, "'zz'"),
    "optimize fixed unknown": (lambda: COST.optimize(SIZES, memory=4096, fixed={"zz": 4}), CostError, "'zz'"),
    "optimize unknown level": (lambda: COST.optimize(SIZES, memory=4096, level="L9"), CostError, "'L9'"),
    "closed_form unknown level": (lambda: COST.closed_form("L9"), CostError, "'L9'"),
    "closed_form level int": (lambda: COST.closed_form(3), CostError, "3"),
    "bytes unknown level": (lambda: COST.bytes("L9"), CostError, "'L9'"),
    "memory_bytes unknown level": (lambda: COST.memory_bytes("L9"), CostError, "'L9'"),
    "objective unknown level": (lambda: COST.objective("L9"), CostError, "'L9'"),
    "time sizes unknown": (lambda: COST.time(H100, {**SIZES, "zz": 3}), CostError, "'zz'"),
    "subs unknown": (lambda: COST.subs({"zz": 3}), CostError, "'zz'"),
    "hardware unknown level": (lambda: H100.capacity("L9"), CostError, "'L9'"),
    "hardware unknown dtype": (lambda: H100.rate("fma", "f99"), CostError, "f99"),

    # ---- options that would be ignored, relabelings that are not valid
    "optimize memory and hw": (lambda: COST.optimize(SIZES, memory=4096, hw=H100), CostError, "not both"),
    "sub-tile larger than tile": (lambda: ATT.tile(q, 4).tile(q, 8), RelabelError, "enclosing tile(q, 4)"),
    "sub-stream larger than stream": (lambda: ATT.stream(x, 4).stream(x, 8), RelabelError,
                                      "enclosing stream(x, 4)"),
    "order repeats an axis": (lambda: FLASH.order(x, x), RelabelError, "['x', 'x']"),
    "order unstreamed axis": (lambda: FLASH.order(q), RelabelError, "axis q is not streamed"),
    "weave after relabel": (lambda: FLASH.weave(Axis("w", 2)), RelabelError, "stream(x, s_x)"),
    "compose after relabel": (lambda: FLASH >> nc.Diagram.id(FLASH.cod), RelabelError, "stream(x, s_x)"),
    "tile a reduced axis": (lambda: ATT.tile(x, 4), RelabelError, "cannot tile x"),
    "stream a softmax output": (lambda: nc.library.softmax().stream("c", 4), RelabelError, "cannot stream c"),

    # ---- drawing
    "draw unknown extension": (lambda p: MM.draw(str(p / "pic.xyz")), DrawingError, "'.xyz'"),
    "draw unknown extension lists formats": (lambda p: MM.draw(str(p / "pic.foo")), DrawingError, ".svg"),
    "draw unwritable path": (lambda p: MM.draw(str(p / "missing" / "pic.png")), DrawingError, "pic.png"),
    "draw path int": (lambda: MM.draw(3), DrawingError, "got 3"),
    "draw levels not a dict": (lambda: MM.draw(levels=3), TypingError, "got 3"),
    "draw level int": (lambda: MM.draw(levels={"A": 3}), TypingError, "'A'"),
    "draw weaved unknown": (lambda: MM.draw(weaved=("zz",)), TypingError, "['zz']"),
    "draw weaved str": (lambda: MM.draw(weaved="a"), TypingError, "'a'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_is_a_napkin_error_naming_the_culprit(name, tmp_path):
    call, cls, text = CASES[name]
    args = (tmp_path,) if inspect.signature(call).parameters else ()
    with pytest.raises(NapkinError) as info:
        call(*args)
    assert isinstance(info.value, cls), f"{type(info.value).__name__}: {info.value}"
    assert text in str(info.value), str(info.value)
    assert not list(tmp_path.iterdir())  # a refused draw writes nothing


def test_draw_refuses_before_writing(tmp_path):
    with pytest.raises(DrawingError):
        MM.draw(str(tmp_path / "pic.xyz"))
    assert not (tmp_path / "pic.xyz").exists()


# --------------------------------------------------------------------------- windows

def test_window_zero_is_the_diagonal():
    i, j = np.arange(4)[:, None], np.arange(4)[None, :]
    assert np.array_equal(nc.window(0)(i, j), i == j)
    assert np.array_equal(nc.window(1)(i, j), (j <= i) & (j >= i - 1))


def test_attention_window_size_zero_keeps_only_the_diagonal():
    n = Axis("q", 4), Axis("x", 4), Axis("d", 2)
    d0 = nc.library.attention(*n, window_size=0)
    assert sum(e.box.kind == "mask" for e in d0.eqns) == 1
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((4, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    np.testing.assert_allclose(nc.evaluate(d0, Q, K, V), V)   # each query sees only its own key
    assert not any(e.box.kind == "mask" for e in nc.library.attention(*n, window_size=None).eqns)


# --------------------------------------------------------------------------- streamed logsumexp

@pytest.mark.parametrize("size", [2, "s_k"])
def test_streamed_logsumexp_has_a_cost(size):
    r, k = nc.axes("r k")
    c = nc.cost(_lse(r, k).stream(k, size))
    assert c.transfers["HBM"] == nc.cost(_lse(r, k)).transfers["HBM"]   # X read once, out written once
    assert c.flops["exp"] != 0


def test_streamed_logsumexp_evaluates_like_unstreamed():
    d = _lse()
    X = np.random.default_rng(1).standard_normal((4, 6))
    np.testing.assert_allclose(nc.evaluate(d.stream("k", 4), X), nc.evaluate(d, X))


# --------------------------------------------------------------------------- kernels

@pytest.fixture(scope="module")
def kernel():
    flash = nc.library.attention(Axis("q", 4), Axis("x", 5), Axis("d", 2)).stream("x", 3).tile("q", 4)
    kw = {"verify": False} if "verify" in inspect.signature(nc.lower).parameters else {}
    return nc.lower(flash, threads=16, **kw)


def _qkv(dtype=np.float32):
    rng = np.random.default_rng(2)
    return [rng.standard_normal(s).astype(dtype) for s in ((4, 2), (5, 2), (5, 2))]


KERNEL_MISUSE = {
    "complex": (lambda k: k(np.ones((4, 2), complex), *_qkv()[1:]), "complex128"),
    "bool": (lambda k: k(np.ones((4, 2), bool), *_qkv()[1:]), "bool"),
    "object": (lambda k: k(np.ones((4, 2), object), *_qkv()[1:]), "object"),
    "string array": (lambda k: k(np.full((4, 2), "x"), *_qkv()[1:]), "<U1"),
    "list": (lambda k: k([[1.0, 2.0]] * 4, *_qkv()[1:]), "got list"),
    "str": (lambda k: k("Q", *_qkv()[1:]), "got str"),
    "None": (lambda k: k(None, *_qkv()[1:]), "got NoneType"),
    "torch complex": (lambda k: k(torch.ones(4, 2, dtype=torch.complex64), *_qkv()[1:]), "complex64"),
    "torch bool": (lambda k: k(torch.ones(4, 2, dtype=torch.bool), *_qkv()[1:]), "torch.bool"),
    "too few": (lambda k: k(*_qkv()[:2]), "takes 3 arrays (Q, K, V), got 2"),
    "too many": (lambda k: k(*_qkv(), _qkv()[0]), "takes 3 arrays (Q, K, V), got 4"),
    "wrong shape": (lambda k: k(np.ones((3, 2), np.float32), *_qkv()[1:]), "expected shape (4, 2), got (3, 2)"),
    "out shape": (lambda k: k(*_qkv(), out=np.empty((3, 2), np.float32)), "out= for O[q=4 d=2] f32"),
    "out dtype": (lambda k: k(*_qkv(), out=np.empty((4, 2), np.float64)), "float64"),
    "out torch dtype": (lambda k: k(*_qkv(), out=torch.empty(4, 2, dtype=torch.float64)), "torch.float64"),
    "out list": (lambda k: k(*_qkv(), out=[[0.0] * 2] * 4), "out= for O"),
    "out str": (lambda k: k(*_qkv(), out="O"), "out= for O"),
    "out not contiguous": (lambda k: k(*_qkv(), out=np.empty((2, 4), np.float32).T), "C-contiguous"),
    "out read-only": (lambda k: k(*_qkv(), out=np.broadcast_to(np.empty(2, np.float32), (4, 2))), "writeable"),
    "out requires grad": (lambda k: k(*_qkv(), out=torch.empty(4, 2, requires_grad=True)), "grad"),
    "out count": (lambda k: k(*_qkv(), out=(np.empty((4, 2), np.float32),) * 2), "has 1 outputs, out= gave 2"),
    "stream str": (lambda k: k(*_qkv(), stream="s"), "'s'"),
    "prepare complex": (lambda k: k.prepare(np.ones((4, 2), complex), *_qkv()[1:]), "complex128"),
    "prepare too few": (lambda k: k.prepare(*_qkv()[:2]), "got 2"),
    "prepare wrong shape": (lambda k: k.prepare(np.ones((3, 2), np.float32), *_qkv()[1:]), "(3, 2)"),
}


@pytest.mark.parametrize("name", list(KERNEL_MISUSE))
def test_kernel_misuse_is_a_shape_error(kernel, name):
    call, text = KERNEL_MISUSE[name]
    with pytest.raises(ShapeError) as info:
        call(kernel)
    assert text in str(info.value), str(info.value)


def test_kernel_reads_real_numpy_inputs_of_any_width(kernel):
    ref = kernel(*_qkv())
    np.testing.assert_allclose(kernel(*_qkv(np.float64)), ref, rtol=1e-5, atol=1e-6)
    assert kernel(*[np.ones(s, np.int64) for s in ((4, 2), (5, 2), (5, 2))]).shape == (4, 2)


# --------------------------------------------------------------------------- inputs are never mutated

def _torch_inputs():
    rng = torch.Generator().manual_seed(3)
    return [torch.randn(4, 2, generator=rng, requires_grad=True), torch.randn(5, 2, generator=rng),
            torch.randn(5, 2, generator=rng, dtype=torch.float64)]


def _unchanged_numpy(xs, copies):
    for x, x0 in zip(xs, copies):
        assert x.dtype == x0.dtype and x.flags.writeable == x0.flags.writeable and np.array_equal(x, x0)


def _unchanged_torch(ts, copies, grads):
    for t, t0, g in zip(ts, copies, grads):
        assert t.dtype == t0.dtype and t.requires_grad == g and t.grad is None
        assert torch.equal(t.detach(), t0)


def test_kernel_leaves_numpy_inputs_alone(kernel):
    xs = _qkv(np.float32) [:1] + _qkv(np.float64)[1:]
    copies = [x.copy() for x in xs]
    kernel(*xs)
    kernel(*xs, out=np.empty((4, 2), np.float32))
    _unchanged_numpy(xs, copies)


def test_kernel_detaches_torch_inputs_and_leaves_them_alone(kernel):
    ts = _torch_inputs()
    copies, grads = [t.detach().clone() for t in ts], [t.requires_grad for t in ts]
    out = kernel(*ts)
    assert not out.requires_grad if isinstance(out, torch.Tensor) else True
    _unchanged_torch(ts, copies, grads)
    np.testing.assert_allclose(np.asarray(out), kernel(*[t.detach().numpy().astype(np.float32) for t in ts]),
                               rtol=1e-6)


def test_evaluate_and_to_torch_leave_inputs_alone():
    d = nc.library.attention(Axis("q", 4), Axis("x", 5), Axis("d", 2), causal=True)
    xs = _qkv(np.float32)
    copies = [x.copy() for x in xs]
    nc.evaluate(d, *xs)
    nc.evaluate(d.stream("x", 2).tile("q", 2), *xs)
    _unchanged_numpy(xs, copies)
    ts = _torch_inputs()
    tcopies, grads = [t.detach().clone() for t in ts], [t.requires_grad for t in ts]
    nc.evaluate(d, *ts)
    nc.to_torch(d)(*[t.float() for t in ts])
    _unchanged_torch(ts, tcopies, grads)


def test_check_equivalent_leaves_inputs_alone():
    # the checker draws its own inputs; the diagrams (frozen) and their relabelings are unchanged
    d = nc.library.attention(Axis("q", 4), Axis("x", 5), Axis("d", 2))
    flash = d.stream("x", 2).tile("q", 2)
    before = (repr(d), repr(flash))
    nc.check_equivalent(d, flash, examples=3)
    assert (repr(d), repr(flash)) == before


# --------------------------------------------------------------------------- refusals mutate nothing

def test_refused_relabeling_leaves_the_diagram_alone():
    before = repr(FLASH)
    for bad in (lambda: FLASH.stream(x, 0), lambda: FLASH.tile("zz", 2), lambda: FLASH.bind({"zz": 1}),
                lambda: FLASH.order(x, x)):
        with pytest.raises(NapkinError):
            bad()
    assert repr(FLASH) == before


def test_refused_optimize_leaves_the_cost_alone():
    before = dict(COST.transfers)
    sizes = {**SIZES, "zz": 3}
    with pytest.raises(CostError):
        COST.optimize(sizes, memory=4096)
    assert dict(COST.transfers) == before and sizes == {**SIZES, "zz": 3}


# --------------------------------------------------------------------------- CLI

def test_cli_unwritable_path_is_one_line_without_traceback(capsys):
    from napkin_cat.cli import main
    assert main(["demo", "--out", "/proc/napkin/not/here"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "/proc/napkin" in err and err.startswith("napkin: error:")


def test_cli_napkin_error_is_one_line_and_debug_shows_it(monkeypatch, capsys):
    from napkin_cat import cli

    def boom(out):
        raise nc.RelabelError("cannot stream c: softmax normalises along c\n  second line")
    from napkin_cat import cli_demo
    monkeypatch.setattr(cli_demo, "demo", boom)
    assert cli.main(["demo"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot stream c" in err and "second line" in err
    with pytest.raises(nc.RelabelError):
        cli.main(["--debug", "demo"])


def test_cli_subprocess_exit_status_and_stderr(tmp_path):
    import subprocess
    import sys
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = subprocess.run([sys.executable, "-m", "napkin_cat.cli", "demo", "--out", str(blocker / "pics")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and str(blocker) in res.stderr
