"""``nc.torch_op(d, backward=...)``: FlashAttention's backward as one kernel (dQ added across the
key tiles with fp32 atomics) or as two (FlashAttention-2's), or chosen by the cost model (``None``).

The option's values and refusals; the plans of both forms (the forward's other tilings kept,
dQ in fp32 in the one-kernel part for 16-bit inputs); the choice against the two predicted
times, recomputed here from ``nc.cost`` of the scheduled parts; and both forms' gradients
against torch autograd of the float64 oracle under numba's simulator (float32 and fp16, tiny
ragged sizes with several key tiles and query chunks, causal, a window, heads, an auxiliary
per-head scale)."""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core.errors import LoweringError, RelabelError, TypingError  # noqa: E402
from napkin_cat.core.types import Relabel  # noqa: E402
from napkin_cat.lowering import backward_forms  # noqa: E402
from napkin_cat.lowering.backward_forms import FORMS  # noqa: E402
from napkin_cat.lowering.devices import simulator_active  # noqa: E402
from napkin_cat.lowering.schedule import choose  # noqa: E402
from napkin_cat.lowering.torch_op import torch_op  # noqa: E402

q, x, d, h, g = nc.axes("q x d h g")
SIZES = {"q": 5, "x": 7, "d": 4, "h": 2, "g": 3}
TILES = {"g_x": 3, "s_q": 2, "g_q": 2, "s_x": 3}   # ragged: key tiles (3, 3, 1), query chunks (2, 2, 1)
SC = nc.aux("sc", nc.Axis("nh", 2))
VARIANTS = {
    "plain": {},
    "causal_heads": {"causal": True, "heads": h},
    "window": {"window_size": 2},
    "head_scale": {"heads": h, "score_mod": lambda s, b, h_, i, j: s * SC[h_]},
    "gqa": {"causal": True, "heads": h, "groups": g},   # 3 query heads per K, V head
}
needs_sim = pytest.mark.skipif(not simulator_active(), reason="numba.cuda is not its simulator here")


def attention(name="plain", **kw):
    att = nc.library.attention(q=q, x=x, d=d, **VARIANTS[name], **kw).stream(x, "s_x").tile(q, "g_q")
    return att.tile(h, 1) if "heads" in VARIANTS[name] else att


def inputs(diagram, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*(SIZES[a.name] if a.name in SIZES else a.size for a in arr.axes), generator=g)
            .to(dtype).requires_grad_() for arr in diagram.dom]


def check_grads(op, tensors, tol):
    """The op's output and gradients against torch autograd of ``nc.to_torch`` in float64."""
    out = op(*tensors)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    got = torch.autograd.grad(out, tensors, cot)
    wide = [t.detach().double().requires_grad_() for t in tensors]
    want = torch.autograd.grad(nc.to_torch(op.diagram)(*wide), wide, cot.double())
    for arr, g, w in zip(op.diagram.dom, got, want):
        assert g.dtype == tensors[0].dtype, arr
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.double(), w, rtol=0, atol=tol * scale, msg=lambda m: f"d{arr.name}: {m}")


def _sizes(**kw):
    return tuple(sorted(kw.items()))


# --------------------------------------------------------------------------- the option

@pytest.mark.parametrize("value", ["one", "fused", 2, True])
def test_backward_option_refuses_a_value_outside_the_forms(value):
    with pytest.raises(TypingError) as info:
        torch_op(attention(), backward=value)
    assert "backward must be None" in str(info.value) and "'one kernel' or 'two kernels'" in str(info.value)
    assert repr(value) in str(info.value)


def test_backward_option_refused_where_there_is_no_attention_backward():
    with pytest.raises(TypingError, match="backward='one kernel'.*no softmax-contraction"):
        torch_op(nc.library.mlp(), backward="one kernel")
    ring = nc.library.attention(q=q, x=x, d=d).tile(q, "devices").stream(x, "devices")
    split = torch_op(ring, backward="one kernel")        # each block pair's backward takes the form asked for
    assert split._backward.backward_op(nc.library.attention(q=q, x=x, d=d), {}, None, False, True).backward_form \
        == "one kernel"


# --------------------------------------------------------------------------- the plans

def test_one_kernel_plan_is_one_part_keeping_the_heads_tiling():
    one = torch_op(attention("causal_heads"), backward="one kernel")
    two = torch_op(attention("causal_heads"), backward="two kernels")
    sizes = _sizes(**SIZES)
    p1, p2 = (op.backward_plan((0, 1, 2), sizes, torch.float32) for op in (one, two))
    # both first compute D = rowsum(dO O) once (lowering/backward_parts.row_terms)
    assert [p._sched_str() for p in p1.parts] == ["tile(q, 64), tile(h, 1)",
                                                  "tile(x, g_x, partial=sum), stream(q, s_q), tile(h, 1)"]
    assert [a.name for a in p1.parts[1].cod] == ["dQ", "dK", "dV"]
    assert [p._sched_str() for p in p2.parts] == ["tile(q, 64), tile(h, 1)", "tile(x, g_x), stream(q, s_q), tile(h, 1)",
                                                  "tile(q, g_q), stream(x, s_x), tile(h, 1)"]
    assert (p1.form, p2.form) == FORMS
    # the same backward and the same saves: only the kernels differ
    assert (p1.diagram, p1.saves, p1.forward) == (p2.diagram, p2.saves, p2.forward)
    # without dQ the one-kernel form has nothing to add across key tiles: dK, dV's kernel
    only_kv = one.backward_plan((1, 2), sizes, torch.float32)
    assert [p._sched_str() for p in only_kv.parts] == ["tile(q, 64), tile(h, 1)", "tile(x, g_x), stream(q, s_q), tile(h, 1)"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_one_kernel_plan_adds_dq_in_fp32_for_16_bit_inputs(dtype):
    op = torch_op(attention(), backward="one kernel")
    plan = op.backward_plan((0, 1, 2), _sizes(q=5, x=7, d=4), dtype)
    half = "f16" if dtype == torch.float16 else "bf16"
    rows, part = plan.parts
    assert {a.name: a.dtype.name for a in part.cod} == {"dQ": "f32", "dK": half, "dV": half}
    assert {a.name: a.dtype.name for a in part.dom}["L"] == "f32"
    assert [(a.name, a.dtype.name) for a in rows.cod] == [("D", "f32")]   # passed between parts in fp32
    assert {a.name: a.dtype.name for a in part.dom}["D"] == "f32"
    assert {a.dtype.name for a in plan.diagram.cod} == {half}   # the gradients op returns


def _forged():
    """An attention whose forward relabeling does not apply to the forward with its logsumexp."""
    return replace(nc.library.attention(q=q, x=x, d=d), schedule=(Relabel("tile", "x", "g_x", "SMEM"),))


def test_forced_one_kernel_that_cannot_be_had_raises_and_none_takes_the_other_plan():
    tensors = inputs(nc.library.attention(q=q, x=x, d=d), torch.float64)
    with pytest.raises(LoweringError) as info:
        torch_op(_forged(), backward="one kernel", simulate=False)(*tensors)
    assert "backward='one kernel'" in str(info.value) and "cannot be honoured" in str(info.value)
    assert "recomputes from the inputs" in str(info.value)
    op = torch_op(_forged(), simulate=False)
    op(*tensors).sum().backward()
    assert op.last_backward_path == "executor" and op.backward_choice is None


def test_none_notes_why_the_one_kernel_form_was_not_eligible(monkeypatch):
    real = backward_forms.fa2_parts

    def refuse(aug, wrt, cts, schedule=(), form="two kernels"):
        if form == "one kernel":
            raise RelabelError("refused for the test")
        return real(aug, wrt, cts, schedule, form)
    monkeypatch.setattr(backward_forms, "fa2_parts", refuse)
    op = torch_op(attention())
    plan = op.backward_plan((0, 1, 2), _sizes(q=5, x=7, d=4), torch.float32)
    assert plan.form == "two kernels" and op.backward_choice.form == "two kernels"
    assert op.backward_choice.predicted == () and "refused for the test" in op.backward_choice.why
    assert any("one kernel is not eligible" in n and "refused for the test" in n for n in op.notes), op.notes
    with pytest.raises(LoweringError, match="cannot be honoured: refused for the test"):
        torch_op(attention(), backward="one kernel").backward_plan((0, 1, 2), _sizes(q=5, x=7, d=4), torch.float32)


# --------------------------------------------------------------------------- the choice

def _predicted(op, form, wrt, sizes, dtype):
    """The roofline of ``form``'s parts at the blocks the lowering picks for a GPU, from nc.cost."""
    forced = torch_op(op.diagram, backward=form)
    plan = forced.backward_plan(wrt, sizes, dtype)
    hw = nc.hardware.H100
    return sum(float(nc.cost(choose(p, None, None, hw=hw).diagram).time(hw, {}).seconds) for p in plan.parts)


@pytest.mark.parametrize("n_q, n_x, dtype", [(4096, 4096, torch.float32), (4096, 64, torch.float32),
                                             (4096, 4096, torch.float16)])
def test_none_chooses_the_form_with_the_smaller_prediction(n_q, n_x, dtype):
    op = torch_op(attention("causal_heads"))
    sizes = _sizes(q=n_q, x=n_x, d=64, h=16)
    plan = op.backward_plan((0, 1, 2), sizes, dtype)
    c = op.backward_choice
    t_one, t_two = c.seconds("one kernel"), c.seconds("two kernels")
    want = "one kernel" if t_one < t_two else "two kernels"
    if dtype == torch.float32 and want == "one kernel":   # CUDA cores: measured, the roofline overruled
        want = "two kernels"
        assert backward_forms.CUDA_CORE_ONE_KERNEL in c.why
    if dtype != torch.float32 and want == "two kernels":  # warpgroup MMAs: measured, the roofline overruled
        want = "one kernel"
        assert backward_forms.WARPGROUP_ONE_KERNEL in c.why
    assert c.form == want == plan.form
    assert c.hardware == nc.hardware.H100.name and f"{t_one * 1e3:.4g} ms" in c.why
    assert t_two == pytest.approx(_predicted(op, "two kernels", (0, 1, 2), sizes, dtype), rel=1e-9)
    # 16-bit: the fp32 dQ's conversion (read 4 bytes, write 2 per value) comes on top of the kernel
    convert = 0 if dtype == torch.float32 else n_q * 64 * 16 * 6 / nc.hardware.H100.bandwidth("HBM")
    assert t_one == pytest.approx(_predicted(op, "one kernel", (0, 1, 2), sizes, dtype) + convert, rel=1e-9)
    print(f"N_q={n_q} N_x={n_x} {dtype}: {c.why} -> {c.form}")


def test_16_bit_keeps_the_predicted_form_without_warpgroup_mmas(monkeypatch):
    """The measured one-kernel rule needs warpgroup MMAs: with ``planner.WGMMA`` off, or on a
    GPU without them (an A100), the prediction stands."""
    from napkin_cat.lowering import planner
    sizes = _sizes(q=4096, x=4096, d=64, h=16)
    assert backward_forms.warpgroup_one_kernel(nc.hardware.H100)
    assert not backward_forms.warpgroup_one_kernel(backward_forms.A100_SXM4)
    monkeypatch.setattr(planner, "WGMMA", False)
    op = torch_op(attention("causal_heads"))
    op.backward_plan((0, 1, 2), sizes, torch.float16)
    c = op.backward_choice
    want = "one kernel" if c.seconds("one kernel") < c.seconds("two kernels") else "two kernels"
    assert c.form == want and backward_forms.WARPGROUP_ONE_KERNEL not in c.why


def test_the_prediction_prices_fp32_on_the_engine_the_kernels_use():
    """``fp32="3xtf32"``: the fp32 parts are scheduled as that lowering schedules them and their
    contractions priced at a third of the tf32 tensor rate (``Hardware.fp32_on``), not at the
    CUDA cores' FMA rate; 16-bit parts ignore the option."""
    from napkin_cat.lowering.planner import tf32x3
    sizes = _sizes(q=4096, x=4096, d=64, h=16)
    hw = nc.hardware.H100
    fast = hw.fp32_on("3xtf32")
    assert fast.tensor_rate("f32") == pytest.approx(hw.tensor_rate("tf32") / 3)
    assert fast.tensor_rate("f32") > 2 * hw.tensor_rate("f32")
    for dtype, changes in ((torch.float32, True), (torch.float16, False)):
        fma, tc = (torch_op(attention("causal_heads"), fp32=e) for e in ("fma", "3xtf32"))
        for op in (fma, tc):
            op.backward_plan((0, 1, 2), sizes, dtype)
        a, b = fma.backward_choice, tc.backward_choice
        for form in FORMS:
            assert (b.seconds(form) < a.seconds(form)) is changes, (dtype, form)
        assert ("fp32 by 3xtf32" in b.why) is changes and "fp32 by" not in a.why
    tc = torch_op(attention("causal_heads"), fp32="3xtf32")
    tc.backward_plan((0, 1, 2), sizes, torch.float32)
    plan = torch_op(attention("causal_heads"), backward="two kernels").backward_plan((0, 1, 2), sizes, torch.float32)
    with tf32x3(True):
        want = sum(float(nc.cost(choose(p, None, None, hw=hw).diagram).time(fast, {}).seconds) for p in plan.parts)
    assert tc.backward_choice.seconds("two kernels") == pytest.approx(want, rel=1e-9)
    with pytest.raises(nc.NapkinError, match="fp32 engine must be one of"):
        hw.fp32_on("tf32")


def test_none_without_a_choice_to_make():
    op = torch_op(attention())
    op.backward_plan((1, 2), _sizes(q=64, x=64, d=16), torch.float32)
    assert op.backward_choice.form == "two kernels" and "same kernel" in op.backward_choice.why
    op.backward_plan((0, 1, 2), _sizes(q=64, x=64, d=16), torch.float64)
    assert op.backward_choice.form == "two kernels" and "float64" in op.backward_choice.why
    op.backward_plan((0, 1, 2), (), torch.float32)   # unbound: the seam distributed.py calls
    assert op.backward_choice.form == "two kernels" and "no sizes for d, q, x" in op.backward_choice.why


def test_grouped_query_backward_streams_the_groups_in_key_tiles_and_tiles_them_elsewhere():
    """GQA's scores ``S[h g q x]`` have two row axes the values lack; the parts tile and stream
    ``q`` (the innermost).  The key-tile part streams the groups ``g`` one at a time around the
    query chunks, so dK, dV are summed over both in registers (no ``dK[h g x d]`` summed
    afterwards); the query-tile parts take a block per group."""
    for form, scheds in (("two kernels", ["tile(q, 64), tile(g, 1), tile(h, 1)",
                                          "tile(x, g_x), stream(g, 1), stream(q, s_q), tile(h, 1)",
                                          "tile(q, g_q), tile(g, 1), stream(x, s_x), tile(h, 1)"]),
                         ("one kernel", ["tile(q, 64), tile(g, 1), tile(h, 1)",
                                         "tile(x, g_x, partial=sum), stream(g, 1), stream(q, s_q), tile(h, 1)"])):
        plan = torch_op(attention("gqa"), backward=form).backward_plan((0, 1, 2), _sizes(**SIZES), torch.float32)
        assert [p._sched_str() for p in plan.parts] == scheds, form
        key_part = plan.parts[1]
        assert [a.axis_names for a in key_part.cod if a.name in ("dK", "dV")] == [("h", "x", "d")] * 2
        text = key_part.loop_nest().pseudocode(memory=False)
        # one dK accumulator, initialised before both loops and updated in the inner one
        assert text.index("init dK") < text.index("for g in chunks of 1") < text.index("for q in chunks of s_q") \
            < text.index("update dK") < text.index("finalise dK")


# --------------------------------------------------------------------------- kernels (simulator)

def _run(name, form, dtype=torch.float32, tol=1e-5):
    op = torch_op(attention(name), simulate=True, verify=False, tiles=TILES, backward=form)
    tensors = inputs(op.diagram, dtype)
    check_grads(op, tensors, tol)
    return op


@needs_sim
@pytest.mark.parametrize("name", ["plain", "causal_heads"])
def test_one_kernel_gradients_match_fp64_autograd(name):
    op = _run(name, "one kernel")
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2-atomic"), op.notes
    _, kernel = [k for key, k in op._cache.items() if key[0] == "backward kernel"]   # D, then the one kernel
    assert "cuda.atomic.add(dQ, " in kernel.source and kernel.launch.grid[0] == 3 * SIZES["h"] ** ("h" in name)


@needs_sim
def test_a_chosen_one_kernel_that_does_not_lower_gives_way_to_the_two(monkeypatch):
    """16-bit picks the one kernel (``WARPGROUP_ONE_KERNEL``); where it does not lower, the op
    runs the two kernels (noted), not the one kernel's part in the NumPy executor."""
    from napkin_cat.lowering.torch_op import TorchOp
    from napkin_cat.relabel.split import split_axes
    real = TorchOp._backward_kernel

    def refuse_split(self, diagram, *args, **kw):
        return None if split_axes(diagram) else real(self, diagram, *args, **kw)

    monkeypatch.setattr(TorchOp, "_backward_kernel", refuse_split)
    op = torch_op(attention("plain"), simulate=True, verify=False, tiles=TILES)
    check_grads(op, inputs(op.diagram, torch.float16), 4 * 2.0 ** -10)
    assert op.backward_choice.form == "one kernel"
    assert op.last_backward_path == "simulator-fa2", op.notes
    assert any("the one kernel chosen did not lower, so the two kernels run" in n for n in op.notes), op.notes


@needs_sim
@pytest.mark.parametrize("form", FORMS)
def test_grouped_query_gradients_are_kernels_summed_over_the_groups(form):
    op = _run("gqa", form)
    suffix = "-atomic" if form == "one kernel" else ""
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2" + suffix), op.notes
    assert not any("not split" in n for n in op.notes), op.notes


@needs_sim
def test_grouped_query_fp16_backward_on_tensor_cores():
    op = _run("gqa", "one kernel", torch.float16, tol=4 * 2.0 ** -10)
    assert op.last_backward_path == "simulator-fa2-atomic", op.notes
    _, kernel = [k for key, k in op._cache.items() if key[0] == "backward kernel"]
    assert "mma" in kernel.source and "cuda.atomic.add(dQ, " in kernel.source


@needs_sim
def test_one_kernel_fp16_adds_dq_in_fp32_and_returns_fp16():
    op = _run("plain", "one kernel", torch.float16, tol=4 * 2.0 ** -10)
    assert op.last_backward_path == "simulator-fa2-atomic", op.notes


@needs_sim
def test_none_runs_the_form_it_predicted_faster():
    op = _run("plain", None)
    c = op.backward_choice
    faster = "one kernel" if c.seconds("one kernel") < c.seconds("two kernels") else "two kernels"
    # fp32 on CUDA cores keeps two kernels whatever the roofline says (measured, CUDA_CORE_ONE_KERNEL)
    assert c.form == "two kernels" and (backward_forms.CUDA_CORE_ONE_KERNEL in c.why) is (faster == "one kernel")
    assert op.last_backward_path == {"one kernel": "simulator-fa2-atomic", "two kernels": "simulator-fa2"}[c.form]


@pytest.mark.slow   # about 30 s: a forward and one or two backward kernels per case in the simulator
@needs_sim
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["plain", "causal_heads", "window", "head_scale", "gqa"])
def test_both_forms_match_fp64_autograd(name, form):
    op = _run(name, form)
    suffix = "-atomic" if form == "one kernel" else ""
    assert (op.last_path, op.last_backward_path) == ("simulator", "simulator-fa2" + suffix), op.notes
    n_kernels = sum(key[0] == "backward kernel" for key in op._cache)
    assert n_kernels == (1 if form == "one kernel" else 2) + 1   # + D = rowsum(dO O), before them
    if name == "head_scale":   # the auxiliary tensor's gradient: the same torch part in both forms
        assert any("dsc" in n and "torch semantics" in n for n in op.notes), op.notes
