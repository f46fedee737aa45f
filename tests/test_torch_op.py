"""``torch_op``: a relabelled diagram as a torch.autograd operation, against ``nc.to_torch`` autograd.

The oracle is torch's gradient of the reference semantics (``nc.to_torch`` in float64).  Paths:
the tiled NumPy executor (float64: gradcheck; float32 on the CPU with ``simulate=False``), the
generated kernel under numba's CUDA simulator (float32 CPU tensors, tiny sizes), and a real GPU
(skipped without one; ``NUMBA_ENABLE_CUDASIM=0 pytest tests/test_torch_op.py`` on a GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

import numpy as np
import pytest
import torch

import napkin_cat as nc
from napkin_cat import Builder
from napkin_cat.core.errors import NapkinError, ShapeError, TypingError
from napkin_cat.lowering.devices import simulator_active
from napkin_cat.lowering.torch_op import backward_plan, torch_op
from napkin_cat.ops.residuals import saved_softmaxes, with_logsumexp

q, x, d = nc.axes("q x d")
SIZES = {"q": 5, "x": 7, "d": 4}   # ragged against the simulator's tiles (4) and chunks (3)


def flash(causal: bool = False):
    return nc.library.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")


def mlp():
    return nc.library.mlp().tile("t", "g_t")


def inputs(diagram, sizes, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*(sizes[a.name] for a in arr.axes), generator=g, dtype=dtype).requires_grad_()
            for arr in diagram.dom]


def reference(diagram, tensors, cot):
    """Output and input gradients of the oracle, in float64 on the CPU."""
    ts = [t.detach().cpu().double().requires_grad_() for t in tensors]
    out = nc.to_torch(diagram)(*ts)
    grads = torch.autograd.grad(out, ts, cot.cpu().double())
    return out.detach(), grads


def check_against_reference(op, tensors, tol):
    out = op(*tensors)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype).to(out.device)
    got = torch.autograd.grad(out, tensors, cot)
    want_out, want = reference(op.diagram, tensors, cot)
    assert (out.dtype, out.device) == (tensors[0].dtype, tensors[0].device)
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=tol, atol=tol)
    for g, w, arr in zip(got, want, op.diagram.dom):
        assert (g.dtype, g.device) == (tensors[0].dtype, tensors[0].device), arr
        torch.testing.assert_close(g.cpu().double(), w, rtol=tol, atol=tol, msg=lambda m: f"d{arr.name}: {m}")


# --------------------------------------------------------------------------- executor path

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_torch_op_attention_executor_matches_to_torch(causal, dtype, tol):
    op = torch_op(flash(causal), simulate=False)
    check_against_reference(op, inputs(op.diagram, SIZES, dtype), tol)
    assert (op.last_path, op.last_backward_path) == ("executor", "executor-fa2")
    assert op.notes == []


def test_torch_op_mlp_gradients_flow_into_weights():
    op = torch_op(mlp(), simulate=False)
    sizes = {"t": 6, "d": 4, "f": 8}
    tensors = inputs(op.diagram, sizes)
    check_against_reference(op, tensors, 1e-10)
    op(*tensors).pow(2).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in tensors)   # X, W1, b1, W2, b2


@pytest.mark.parametrize("diagram,sizes", [(flash(causal=True), {"q": 3, "x": 4, "d": 2}),
                                           (mlp(), {"t": 3, "d": 2, "f": 3})], ids=["causal_attention", "mlp"])
def test_torch_op_gradcheck_float64(diagram, sizes):
    op = torch_op(diagram, simulate=False)
    assert torch.autograd.gradcheck(op, inputs(diagram, sizes))
    assert op.last_path == "executor"


def test_torch_op_several_outputs_and_an_unused_one():
    r, c = nc.axes("r c")
    g = Builder()
    X = g.input("X", r, c)
    two = g.diagram(g.softmax(X, c), g.reduce("sum", g.map("exp", X), c), names=["P", "S"])
    op = torch_op(two, simulate=False)
    X = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    P, S = op(X)
    assert (P.shape, S.shape) == ((3, 5), (3,))
    P[:, 0].sum().backward()   # S unused: its cotangent is zero
    want = torch.autograd.grad(nc.to_torch(two)(X)[0][:, 0].sum(), X)[0]
    torch.testing.assert_close(X.grad, want)
    assert torch.autograd.gradcheck(op, [X.detach().requires_grad_()])


def test_torch_op_bound_diagram_and_sizes_cache():
    op = torch_op(flash().bind(SIZES), simulate=False)
    op(*inputs(op.diagram, SIZES)).sum().backward()
    op(*inputs(op.diagram, SIZES, seed=2))
    assert sum(k[0] == "schedule" for k in op._cache) == 1
    grow = torch_op(flash(), simulate=False)
    grow(*inputs(grow.diagram, SIZES))
    grow(*inputs(grow.diagram, {"q": 3, "x": 5, "d": 4}))
    assert sum(k[0] == "schedule" for k in grow._cache) == 2


def test_torch_op_backward_only_for_inputs_that_need_it():
    op = torch_op(flash(), simulate=False)
    Q, K, V = inputs(op.diagram, SIZES)
    Q.requires_grad_(False)
    V.requires_grad_(False)
    op(Q, K, V).sum().backward()
    assert Q.grad is None and V.grad is None and K.grad is not None
    assert any(k[:2] == ("plan", (1,)) for k in op._cache)


def test_backward_plan_recomputing_saves_the_inputs():
    plan = backward_plan(mlp())
    assert not plan.residual and plan.parts == ()
    assert plan.saves == ("X", "W1", "b1", "W2", "b2") and plan.wrt == (0, 1, 2, 3, 4)
    assert [a.name for a in plan.diagram.dom] == ["X", "W1", "b1", "W2", "b2", "dY"]   # saved, then cotangents
    assert [a.name for a in plan.diagram.cod] == ["dX", "dW1", "db1", "dW2", "db2"]


def test_backward_plan_residuals_save_inputs_output_and_logsumexp():
    plan = backward_plan(flash())
    assert plan.residual and plan.notes == ()
    assert plan.saves == ("Q", "K", "V", "O", "L") and plan.wrt == (0, 1, 2)
    assert [a.name for a in plan.diagram.dom] == ["Q", "K", "V", "O", "L", "dO"]
    assert plan.forward.schedule == flash().schedule   # relabelled like the user's diagram
    # D = rowsum(dO O) first (FlashAttention-2's preprocessing: lowering/backward_parts.row_terms),
    # then the key-tile and query-tile parts, which read D instead of O
    assert [[a.name for a in p.cod] for p in plan.parts] == [["D"], ["dK", "dV"], ["dQ"]]
    assert [p._sched_str() for p in plan.parts] == ["tile(q, 64)", "tile(x, g_x), stream(q, s_q)",
                                                   "tile(q, g_q), stream(x, s_x)"]
    assert [[a.name for a in p.dom] for p in plan.parts] == [["dO", "O"], *[["Q", "K", "V", "L", "dO", "D"]] * 2]
    only_k = backward_plan(flash(), wrt=(1,))
    assert [[a.name for a in p.cod] for p in only_k.parts] == [["D"], ["dK"]]


def test_backward_plan_falls_back_when_the_relabelings_do_not_apply():
    from dataclasses import replace
    from napkin_cat.core.types import Relabel
    forged = replace(nc.library.attention(q=q, x=x, d=d), schedule=(Relabel("tile", "x", "g_x", "SMEM"),))
    plan = backward_plan(forged)
    assert not plan.residual and plan.saves == ("Q", "K", "V")
    assert len(plan.notes) == 1 and "cannot tile x: softmax[x] normalises along x" in plan.notes[0], plan.notes


# --------------------------------------------------------------------------- residuals: with_logsumexp

VARIANTS = {"plain": {}, "causal": {"causal": True}, "heads": {"heads": nc.Axis("h")}}
RSIZES = {**SIZES, "h": 2}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_with_logsumexp_is_the_library_logsumexp_forward(name):
    kw = VARIANTS[name]
    lib = nc.library.attention(q=q, x=x, d=d, logsumexp=True, **kw)
    user = nc.library.attention(q=q, x=x, d=d, **kw)
    assert with_logsumexp(user) == lib
    relabelled = user.stream(x, "s_x").tile(q, "g_q")
    aug = with_logsumexp(relabelled)
    assert aug == lib.stream(x, "s_x").tile(q, "g_q").unrelabelled() and not aug.schedule
    assert len(saved_softmaxes(aug)) == 1
    ins = [t.detach().numpy() for t in inputs(user, RSIZES)]
    for got, want in zip(nc.evaluate(aug, *ins), nc.evaluate(lib, *ins)):
        np.testing.assert_array_equal(got, want)


def test_with_logsumexp_nothing_to_save():
    assert with_logsumexp(mlp()) is None
    lib = nc.library.attention(q=q, x=x, d=d, logsumexp=True)
    assert with_logsumexp(lib) == lib   # the logsumexp is there already: nothing added


# --------------------------------------------------------------------------- residuals: torch_op

def _saved_names_and_values(op, tensors):
    out = op(*tensors)
    outs = out if isinstance(out, tuple) else (out,)
    return out, [t for t in outs[0].grad_fn.saved_tensors]


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_torch_op_residual_plan_executor(name, dtype, tol):
    user = nc.library.attention(q=q, x=x, d=d, **VARIANTS[name]).stream(x, "s_x").tile(q, "g_q")
    op = torch_op(user, simulate=False)
    tensors = inputs(user, RSIZES, dtype)
    check_against_reference(op, tensors, tol)
    assert (op.last_path, op.last_backward_path) == ("executor", "executor-fa2") and op.notes == []
    out, saved = _saved_names_and_values(op, tensors)
    assert op.last_saves == ("Q", "K", "V", "O", "L")
    O, L = nc.evaluate(with_logsumexp(user), *(t.detach().double().numpy() for t in tensors))
    assert [tuple(t.shape) for t in saved] == [*(tuple(t.shape) for t in tensors), O.shape, L.shape]
    for t, want in zip(saved, (*tensors, out)):
        assert torch.equal(t, want)
    torch.testing.assert_close(saved[4].double(), torch.from_numpy(L), rtol=tol, atol=tol)


def test_torch_op_user_logsumexp_output_gets_its_cotangent():
    lib = nc.library.attention(q=q, x=x, d=d, logsumexp=True, causal=True).stream(x, "s_x").tile(q, "g_q")
    op = torch_op(lib, simulate=False)
    tensors = inputs(lib, SIZES)
    O, L = op(*tensors)
    (O.sum() + L.pow(2).sum()).backward()
    ts = [t.detach().requires_grad_() for t in tensors]
    rO, rL = nc.to_torch(lib)(*ts)
    (rO.sum() + rL.pow(2).sum()).backward()
    for t, r in zip(tensors, ts):
        torch.testing.assert_close(t.grad, r.grad, rtol=1e-10, atol=1e-10)
    assert op.last_saves == ("Q", "K", "V", "O", "L") and op.last_backward_path == "executor-fa2"


def test_torch_op_mlp_keeps_the_recomputing_plan():
    op = torch_op(mlp(), simulate=False)
    tensors = inputs(op.diagram, {"t": 3, "d": 2, "f": 3})
    out, saved = _saved_names_and_values(op, tensors)
    assert op.last_saves == ("X", "W1", "b1", "W2", "b2") and len(saved) == 5
    out.sum().backward()
    assert op.last_backward_path == "executor"


def test_torch_op_two_optimisation_steps_lower_the_loss():
    """A tiny attention layer: projections in torch, attention through the op (float32 executor)."""
    torch.manual_seed(0)
    X = torch.randn(6, 4)
    target = torch.randn(6, 4)
    W = [torch.nn.Parameter(torch.randn(4, 4) * 0.5) for _ in range(3)]
    op = torch_op(flash(causal=True), simulate=False)
    opt = torch.optim.SGD(W, lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = (op(X @ W[0], X @ W[1], X @ W[2]) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]


# --------------------------------------------------------------------------- simulator path

needs_sim = pytest.mark.skipif(not simulator_active(), reason="numba.cuda is not its simulator in this process")


@pytest.mark.slow   # 9 s: a forward and two verified backward kernels in the simulator
@needs_sim
def test_torch_op_simulator_path_attention():
    op = torch_op(flash(causal=True), simulate=True, backward="two kernels")
    check_against_reference(op, inputs(op.diagram, SIZES, torch.float32), 1e-4)
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2"), op.notes
    assert op.last_saves == ("Q", "K", "V", "O", "L") and op.notes == []
    assert sum(k[0] == "kernel" for k in op._cache) == 1   # the forward with L: one kernel, two outputs
    assert sum(k[0] == "backward kernel" for k in op._cache) == 3   # D = rowsum(dO O), (dK, dV) and dQ
    op(*inputs(op.diagram, SIZES, torch.float32, seed=3))   # the cached kernel
    assert sum(k[0] == "kernel" for k in op._cache) == 1


@needs_sim
def test_a_repeated_call_prints_no_diagram(monkeypatch):
    """After the first call, forward + backward find their kernels without printing a diagram
    (a part printed per call as a cache key cost 25-45 us of host time each, three per
    backward); the launches are stubbed, only the call path runs."""
    import napkin_cat.lowering.torch_op as top
    op = torch_op(flash(), simulate=True, verify=False, backward="two kernels")
    ts = inputs(op.diagram, SIZES, torch.float32)
    torch.autograd.grad(op(*ts), ts, torch.ones(SIZES["q"], SIZES["d"]))
    monkeypatch.setattr(top, "_launch", lambda kernel, tensors, d: tuple(
        torch.zeros(tuple(a.size for a in arr.axes)) for arr in d.cod))

    def printed(self):
        raise AssertionError("a diagram was printed on the call path")
    monkeypatch.setattr(nc.Diagram, "__str__", printed)
    grads = torch.autograd.grad(op(*ts), ts, torch.ones(SIZES["q"], SIZES["d"]))
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in ts]


@needs_sim
@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "heads"])
def test_torch_op_simulator_residual_plan(name):
    user = nc.library.attention(q=q, x=x, d=d, **VARIANTS[name]).stream(x, "s_x").tile(q, "g_q")
    op = torch_op(user, simulate=True, backward="two kernels")
    check_against_reference(op, inputs(user, RSIZES, torch.float32), 1e-4)
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2"), op.notes


@needs_sim
def test_torch_op_simulator_forward_without_two_outputs_falls_back(monkeypatch):
    from napkin_cat.core.errors import LoweringError
    op = torch_op(flash(), simulate=True, verify=False)
    real = type(op)._kernel

    def refuse(self, sizes, device, d=None, tag="forward"):
        if tag.startswith("residuals"):   # the tag names the dtype too: "residuals torch.float32"
            raise LoweringError("refused for the test")
        return real(self, sizes, device, d, tag)
    monkeypatch.setattr(type(op), "_kernel", refuse)
    check_against_reference(op, inputs(op.diagram, SIZES, torch.float32), 1e-4)
    assert op.last_path == "simulator" and op.last_saves == ("Q", "K", "V", "O", "L")
    assert any("kernel of" in n and "the NumPy executor the logsumexp" in n and "refused for the test" in n
               for n in op.notes), op.notes


@needs_sim
def test_torch_op_simulator_path_mlp():
    op = torch_op(mlp(), simulate=True)
    check_against_reference(op, inputs(op.diagram, {"t": 5, "d": 3, "f": 4}, torch.float32), 1e-4)
    assert op.last_path == "simulator"


@needs_sim
def test_torch_op_float64_takes_the_reference_path_under_the_simulator():
    op = torch_op(flash())
    op(*inputs(op.diagram, SIZES))
    assert op.last_path == "executor"


# --------------------------------------------------------------------------- GPU path

needs_gpu = pytest.mark.skipif(simulator_active() or not torch.cuda.is_available(),
                               reason="needs a CUDA GPU with NUMBA_ENABLE_CUDASIM=0")


@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_torch_op_gpu_path(causal):
    op = torch_op(flash(causal))
    sizes = {"q": 70, "x": 90, "d": 16}
    tensors = [t.detach().cuda().requires_grad_() for t in inputs(op.diagram, sizes, torch.float32)]
    check_against_reference(op, tensors, 1e-4)
    assert op.last_path == "gpu"
    assert op.last_backward_path.startswith("gpu-fa2") or any("not lowered" in n for n in op.notes), op.notes


@needs_gpu
def test_torch_op_gpu_backward_refused_is_noted_and_float64_runs_the_executor():
    op = torch_op(flash())
    tensors = [t.detach().cuda().requires_grad_() for t in inputs(op.diagram, {"q": 1024, "x": 1024, "d": 64},
                                                                  torch.float32)]
    op(*tensors).sum().backward()
    assert op.last_path == "gpu" and op.last_saves == ("Q", "K", "V", "O", "L")
    # FlashAttention-2's parts lower where nc.grad's backward did not (shared memory); a refusal is noted
    assert op.last_backward_path.startswith("gpu-fa2") or any("not lowered" in n for n in op.notes), op.notes
    assert all(t.grad.is_cuda for t in tensors)
    ref = torch_op(flash())
    check_against_reference(ref, [t.detach().cuda().requires_grad_() for t in inputs(ref.diagram, SIZES)], 1e-10)
    assert (ref.last_path, ref.last_backward_path) == ("executor", "executor-fa2")
    assert any("float64 CUDA tensors" in n for n in ref.notes)


# --------------------------------------------------------------------------- refusals

def _refused(op, tensors, err, *words):
    before = [t.detach().clone() for t in tensors if isinstance(t, torch.Tensor)]
    with pytest.raises(err) as info:
        op(*tensors)
    assert isinstance(info.value, NapkinError)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert op._cache == {} and op.last_path is None and op.notes == []
    for b, t in zip(before, [t for t in tensors if isinstance(t, torch.Tensor)]):
        assert torch.equal(b, t)


def test_torch_op_refuses_wrong_inputs_and_mutates_nothing():
    op = torch_op(flash(), simulate=False)
    Q, K, V = inputs(op.diagram, SIZES)
    _refused(op, (Q, K), ShapeError, "takes 3 tensors", "got 2")
    _refused(op, (Q, K, V.detach().numpy()), ShapeError, "V[x d]", "ndarray")
    _refused(op, (Q, K, V[None]), ShapeError, "V[x d]", "expected 2 axes")
    _refused(op, (Q, K[:, :3], V), ShapeError, "axis d has size 3", "Q gave d = 4")
    _refused(op, (Q, K, V[:6]), ShapeError, "axis x has size 6")
    bound = torch_op(flash().bind(SIZES), simulate=False)
    _refused(bound, (Q[:4], K, V), ShapeError, "axis q is bound to 5")
    _refused(op, (Q.half(), K.half(), V.float()), TypingError, "torch.float32", "one dtype")
    _refused(op, (Q, K.float(), V), TypingError, "torch.float32", "one dtype")
    _refused(op, (Q, K, V.long()), TypingError, "torch.int64")
    assert Q.grad is None and K.grad is None and V.grad is None


def test_torch_op_refuses_params_and_bad_options():
    t, i, o = nc.axes("t i o")
    g = Builder()
    X, W = g.input("X", t, i), g.param("W", i, o)
    with_param = g.diagram(g.contract(X, W, out=(t, o)), names=["Y"])
    with pytest.raises(TypingError, match="W.*Builder.param.*make them inputs"):
        torch_op(with_param)
    with pytest.raises(TypingError, match="simulate"):
        torch_op(flash(), simulate="yes")
    with pytest.raises(TypingError, match="needs a Diagram"):
        torch_op("attention")


# --------------------------------------------------------------------------- self-check inputs of backward parts

def test_backward_parts_are_self_checked_on_inputs_the_forward_gives_them():
    """``residual_inputs``: L is the logsumexp of the (rounded) scaled scores and D = rowsum(dO O),
    so P = exp(S - L) <= 1 even in the 'jumps' regime, where L drawn alone gave P ~ 1e83 and a
    16-bit kernel's packed P overflowed (kernels/BENCHMARKS.md, "Third session of 2026-11-25")."""
    from napkin_cat.lowering.backward_forms import residual_inputs
    from napkin_cat.verify.data import REGIMES
    plan = backward_plan(flash(causal=True), form="two kernels").bind({"q": 80, "x": 72, "d": 8}).at(nc.f16)
    dkdv = plan.parts[1]
    assert [a.name for a in dkdv.dom] == ["Q", "K", "V", "L", "dO", "D"]
    for regime in ("normal", "jumps", "huge_one_sign"):
        Q, K, V, L, dO, D = residual_inputs(plan, dkdv)(np.random.default_rng(1), REGIMES[regime][0])
        assert Q.dtype == np.float64 and np.array_equal(Q, Q.astype(np.float16).astype(np.float64))
        S = Q @ K.T / np.sqrt(8)
        S = np.where(np.arange(72)[None, :] <= np.arange(80)[:, None], S, -np.inf)
        np.testing.assert_allclose(L, np.log(np.exp(S - S.max(1, keepdims=True)).sum(1)) + S.max(1), rtol=1e-9)
        assert np.nanmax(np.exp(S - L[:, None])) <= 1 + 1e-6     # float64 rounding of scores ~ 1e8
        O = nc.evaluate(nc.library.attention(causal=True), Q, K, V)
        np.testing.assert_allclose(D, (dO * O).sum(1), rtol=1e-9, atol=1e-9 * np.abs(dO * O).sum())


def test_lower_refuses_check_inputs_it_would_ignore_or_cannot_call():
    d = nc.library.matmul(*nc.axes("a b c")).bind({"a": 4, "b": 4, "c": 4})
    with pytest.raises(nc.LoweringError, match="would be ignored"):
        nc.lower(d, verify=False, check_inputs=lambda rng, draw: [])
    with pytest.raises(nc.LoweringError, match="must be a callable"):
        nc.lower(d, check_inputs=3)
    with pytest.raises(nc.EquivalenceError, match="check_inputs gave arrays of shapes"):
        nc.lower(d, verify=1, check_inputs=lambda rng, draw: [np.zeros((4, 4))])


@needs_sim
def test_torch_op_checks_each_backward_kernel_on_its_forwards_inputs(monkeypatch):
    """Every backward part of the residual plan is lowered with ``check_inputs`` (its forward's
    L and D, ``residual_inputs``); the forward itself draws its inputs alone."""
    import napkin_cat.lowering as lowering
    seen = []
    real = lowering.lower

    def spy(diagram, *args, **kw):
        seen.append(([a.name for a in diagram.cod], kw.get("check_inputs")))
        return real(diagram, *args, **kw)
    monkeypatch.setattr(lowering, "lower", spy)
    user = nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
    op = torch_op(user, simulate=True, backward="two kernels")
    ts = inputs(user, {"q": 6, "x": 7, "d": 4}, torch.float32)
    torch.autograd.grad(op(*ts), ts, torch.ones(6, 4))
    assert op.last_backward_path == "simulator-fa2", op.notes
    by_output = {tuple(names): fn for names, fn in seen}
    assert by_output[("O", "L")] is None
    for part in (("D",), ("dK", "dV"), ("dQ",)):
        assert callable(by_output[part]), (part, seen)
