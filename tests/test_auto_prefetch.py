"""``prefetch="auto"`` (the default of ``nc.torch_op``): two cp.async shared buffers per streamed
16-bit input where the register estimate and the shared memory allow them, none otherwise.

Measured on an H100 (kernels/BENCHMARKS.md): the second buffers made the forward and the dQ kernel
3-22% faster, and made the dK, dV kernel at d = 128 spill (276 bytes) and run 2x slower; its
register estimate is past a thread's 255 registers, so "auto" leaves it single-buffered.
"""
from __future__ import annotations

import dataclasses
import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
import napkin_cat.lowering as lowering  # noqa: E402
from napkin_cat.lowering import planner  # noqa: E402
from napkin_cat.lowering.torch_op import torch_op  # noqa: E402

q, x, d, h = nc.axes("q x d h")


def _kernels(dim, dtype=torch.float16):
    attn = nc.library.attention(q=q, x=x, d=d, heads=h).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    plan = torch_op(attn, backward="two kernels").backward_plan((0, 1, 2), (("d", dim), ("h", 32), ("q", 4096), ("x", 4096)), dtype)
    return {name: lowering._lower_one(dia, prefetch="auto") for name, dia in
            (("forward", plan.forward), ("dK, dV", plan.parts[-2]), ("dQ", plan.parts[-1]))}


def _buffered(source: str) -> bool:
    """Whether a kernel stages its chunks in more than one buffer: two ("double-buffered"), or more
    for the forward's copying warpgroup (``producer.STAGES``: "(3 chunk buffers)")."""
    return "double-buffered" in source or re.search(r"\(\d chunk buffers\)", source) is not None


def test_auto_double_buffers_where_the_registers_allow(monkeypatch):
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    double = {dim: {n: _buffered(k.source) for n, k in _kernels(dim).items()} for dim in (64, 128)}
    assert double == {64: {"forward": True, "dK, dV": True, "dQ": True},
                      128: {"forward": True, "dK, dV": False, "dQ": True}}, double
    for dim in (64, 128):          # the rule: the launch-bounds estimate against a thread's registers
        src = _kernels(dim)["dK, dV"].source
        est = int(re.search(r"about (\d+) registers per thread estimated", src).group(1))
        assert (est <= planner.AUTO_PREFETCH_REGISTERS) == double[dim]["dK, dV"], (dim, est)


def test_auto_leaves_fp32_kernels_and_kernels_without_a_stream_alone(monkeypatch):
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    assert not any("double-buffered" in k.source for k in _kernels(64, torch.float32).values())
    mm = nc.library.matmul(q, d, x, dtype=nc.f16).tile(q, 64).bind({q: 128, x: 64, d: 64})
    assert "double-buffered" not in lowering._lower_one(mm, prefetch="auto").source


def test_auto_drops_the_second_buffers_where_shared_memory_does_not_hold_them(monkeypatch):
    """A 16-bit kernel whose second buffers would pass the per-block limit is lowered with one
    buffer per input rather than refused ("double" itself is refused there)."""
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    fl = nc.library.attention(q=q, x=x, d=d, dtype=nc.f16).stream(x, 64).tile(q, 64)
    fl = fl.bind({q: 128, x: 256, d: 64})
    single = lowering._lower_one(fl, prefetch=False)
    hw = dataclasses.replace(nc.hardware.H100, smem_per_block_optin=single.launch.dynamic_smem_bytes + 1024)
    auto = lowering._lower_one(fl, prefetch="auto", hw=hw)
    assert "double-buffered" not in auto.source
    assert auto.launch.dynamic_smem_bytes == single.launch.dynamic_smem_bytes
    assert "double-buffered with cp.async" in lowering._lower_one(fl, prefetch="auto").source
    with pytest.raises(nc.LoweringError, match="shared memory"):
        lowering._lower_one(fl, prefetch="double", hw=hw)


def test_auto_kernels_match_the_oracle_in_the_simulator():
    """The default op on 16-bit CPU tensors in the simulator: its double-buffered kernels' forward
    and gradients against float64 autograd (ragged sizes, several chunks)."""
    fl = nc.library.attention(q=q, x=x, d=d, causal=True).stream(x, 16).tile(q, 16)
    op = torch_op(fl, threads=32, simulate=True, verify=False, backward="two kernels")
    assert op.prefetch == "auto"
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(40, 16, generator=g).half().requires_grad_() for _ in range(3))
    O = op(Q, K, V)
    dO = torch.randn(O.shape, generator=g).half()
    grads = torch.autograd.grad(O, (Q, K, V), dO)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (Q, K, V))
    s = (q64 @ k64.T) / 4.0
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    o64 = torch.softmax(s, -1) @ v64
    want = torch.autograd.grad(o64, (q64, k64, v64), dO.double())
    assert op.last_path == "simulator" and op.last_backward_path == "simulator-fa2", op.notes
    fwd = next(k for key, k in op._cache.items() if key[0] == "kernel")
    assert "double-buffered with cp.async" in fwd.source
    for got, ref in zip((O, *grads), (o64, *want)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err
