"""``torch_op`` on float16 and bfloat16 tensors, against torch autograd of the float64 oracle.

The op runs the user's diagram retyped to the tensors' dtype (``retype``, the relabelings
re-applied; the user's diagram is left alone): 16-bit inputs, outputs and gradients, the
logsumexp residual in fp32.  The oracle is ``nc.to_torch`` in float64 on the 16-bit inputs and
cotangent widened exactly, so the only differences are the op's own roundings.

Tolerance, per dtype (``eps``: 2**-10 for fp16, 2**-7 for bf16): ``|got - want| <= 4 eps
max(1, max|want|)``.  Each output is rounded once when it is stored (half an ulp), and the
backward reads the stored 16-bit ``O`` in ``D = rowsum(dO * O)``: an error of an ulp of ``O``,
carried through ``dS = P (dP - D)`` and the contractions with ``K`` and ``Q`` (their rows
weighted by ``P``, which sums to 1), so a few ulps of the gradients' scale; 4 is that with a
margin.  Reading the 16-bit bit patterns as numbers, or a gradient left in fp32, fails by far.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

import pytest
import torch

import napkin_cat as nc
from napkin_cat.lowering.devices import simulator_active
from napkin_cat.lowering.torch_op import torch_op
from napkin_cat.ops.boxes import retype

q, x, d = nc.axes("q x d")
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
HALVES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
needs_sim = pytest.mark.skipif(not simulator_active(), reason="numba.cuda is not its simulator here")


def flash(causal=False, chunk="s_x", tile="g_q"):
    return nc.library.attention(q=q, x=x, d=d, causal=causal).stream(x, chunk).tile(q, tile)


def inputs(diagram, sizes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*(sizes[a.name] for a in arr.axes), generator=g).to(dtype).requires_grad_()
            for arr in diagram.dom]


def check_16bit(op, tensors):
    """Output and gradients in the inputs' dtype, within the tolerance of the module docstring."""
    dtype = tensors[0].dtype
    out = op(*tensors)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, tensors, cot)
    wide = [t.detach().double().requires_grad_() for t in tensors]
    want_out = nc.to_torch(op.diagram)(*wide)
    want = torch.autograd.grad(want_out, wide, cot.double())
    assert out.dtype == dtype
    for name, g, w in [("out", out, want_out), *((f"d{a.name}", g, w) for a, g, w in zip(op.diagram.dom, got, want))]:
        assert g.dtype == dtype, name
        tol = 4 * EPS[dtype] * max(1.0, w.abs().max().item())
        err = (g.double() - w.detach()).abs().max().item()
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


@HALVES
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_op_16bit_attention_executor_matches_fp64_autograd(dtype, causal):
    op = torch_op(flash(causal), simulate=False)
    check_16bit(op, inputs(op.diagram, {"q": 5, "x": 7, "d": 4}, dtype))
    assert (op.last_path, op.last_backward_path) == ("executor", "executor-fa2")
    assert op.last_saves == ("Q", "K", "V", "O", "L") and op.notes == []


@HALVES
def test_torch_op_16bit_mlp_recomputes_in_its_dtype(dtype):
    op = torch_op(nc.library.mlp().tile("t", "g_t"), simulate=False)
    check_16bit(op, inputs(op.diagram, {"t": 6, "d": 4, "f": 8}, dtype))
    assert (op.last_path, op.last_backward_path) == ("executor", "executor")


def test_torch_op_16bit_plan_keeps_the_logsumexp_in_fp32_and_leaves_the_diagram_alone():
    user = flash(chunk=16, tile=16)
    op = torch_op(user, simulate=False)
    Q, K, V = inputs(user, {"q": 5, "x": 7, "d": 4}, torch.bfloat16)
    op(Q, K, V).sum().backward()
    assert op.diagram is user and str(user.dom) == str(flash(chunk=16, tile=16).dom)   # still f32
    plan = op.backward_plan((0, 1, 2), (), torch.bfloat16)
    assert str(plan.forward) == ("Q[q d] bf16, K[x d] bf16, V[x d] bf16 -> O[q d] bf16, L[q] f32  "
                                 "| stream(x, 16), tile(q, 16)")
    rows, *parts = plan.parts    # D = rowsum(dO O) in fp32 from bf16 dO and O
    assert [a.dtype.name for a in rows.dom] == ["bf16"] * 2 and [a.dtype.name for a in rows.cod] == ["f32"]
    for part in parts:   # dO in bf16, L and D in fp32, the gradients in the inputs' dtype
        assert [a.dtype.name for a in part.dom] == ["bf16"] * 3 + ["f32", "bf16", "f32"], part
        assert {a.dtype.name for a in part.cod} == {"bf16"}
    assert op.typed(torch.float32) is user and op.typed(torch.float64) is user
    assert retype(user, nc.f16).schedule == ()   # retype returns the unrelabelled diagram


@needs_sim
def test_torch_op_fp16_simulator_on_cuda_cores_matches_fp64_autograd():
    """d = 2 fits no fragment: CUDA-core kernels with fp16 inputs and outputs, ragged tiles."""
    op = torch_op(flash(), simulate=True, verify=False, backward="two kernels")
    check_16bit(op, inputs(op.diagram, {"q": 3, "x": 5, "d": 2}, torch.float16))
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2"), op.notes


@pytest.mark.slow
@needs_sim
@HALVES
def test_torch_op_16bit_simulator_on_tensor_cores_matches_fp64_autograd(dtype):
    """Tiles of 16 and d = 16: the forward on mma fragments (the backward parts where they fit)."""
    op = torch_op(flash(chunk=16, tile=16), threads=32, simulate=True, verify=False, backward="two kernels")
    check_16bit(op, inputs(op.diagram, {"q": 16, "x": 16, "d": 16}, dtype))
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2"), op.notes
    fwd = op._cache[("kernel", f"residuals {dtype}", (("d", 16), ("q", 16), ("x", 16)), "cpu")]
    assert "mma_" in fwd.source


def test_torch_op_refuses_a_prefetch_outside_the_options():
    for bad in (1, "triple", None):
        with pytest.raises(nc.TypingError, match=r"prefetch must be False, True, 'double' or 'auto', got"):
            torch_op(flash(), prefetch=bad)


@pytest.mark.slow
@needs_sim
@HALVES
def test_torch_op_16bit_double_buffered_kernels_match_fp64_autograd(dtype):
    """``prefetch="double"`` reaches every kernel of the op (the forward with its logsumexp and
    both backward parts), each verified against the oracle before use: three ragged chunks of 16
    on mma fragments, the next chunk's cp.async in flight while this one is computed."""
    op = torch_op(flash(causal=True, chunk=16, tile=16), threads=32, simulate=True, verify=True,
                  backward="two kernels", prefetch="double")
    check_16bit(op, inputs(op.diagram, {"q": 40, "x": 37, "d": 16}, dtype))
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2"), op.notes
    kernels = [k for key, k in op._cache.items() if key[0] in ("kernel", "backward kernel")]
    streamed = [k for k in kernels if [a.name for a in k.diagram.cod] != ["D"]]   # D = rowsum(dO O): no stream
    assert len(kernels) == 4 and len(streamed) == 3
    assert all("double-buffered" in k.source and "mma_" in k.source for k in streamed)
