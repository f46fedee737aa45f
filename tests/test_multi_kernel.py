"""Multi-kernel lowering (issue 12): cuts chosen by the cost model or by place(wire, "HBM"),
softmax in two passes, reshapes as views; every result checked against the oracle."""

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import napkin_cat as nc  # noqa: E402
from napkin_cat.core import Axis  # noqa: E402
from napkin_cat.core.errors import LoweringError  # noqa: E402
from napkin_cat.lowering.multi import MultiKernel  # noqa: E402
from napkin_cat.ops import Builder, merge_box, split_box  # noqa: E402
from napkin_cat.relabel.cut import pieces, softmax_two_pass  # noqa: E402
from napkin_cat.verify.executor import evaluate  # noqa: E402

L = nc.library
TINY_SMEM = dataclasses.replace(nc.hardware.H100, smem_per_block_optin=256)   # a softmax row of 48 does not fit


def _chain(n: int, k: int = 3):
    t, axs = Axis("t", n), [Axis(f"a{i}", n) for i in range(k + 1)]
    g = Builder()
    X = g.input("X", t, axs[0])
    Ws = [g.input(f"W{i}", axs[i], axs[i + 1]) for i in range(k)]
    for i, W in enumerate(Ws):
        X = g.contract(X, W, out=(t, axs[i + 1]), name=f"H{i}")
    return g.diagram(X)


def _flat_gqa():
    q, x, d, kh, g_, hq = Axis("q", 2), Axis("x", 3), Axis("d", 2), Axis("kh", 2), Axis("g", 2), Axis("hq", 4)
    att = L.attention(q=q, x=x, d=d, heads=kh, groups=g_)
    from napkin_cat.library.compose import call
    b = Builder()
    Q, K, V = b.input("Q", hq, q, d), b.input("K", kh, x, d), b.input("V", kh, x, d)
    (O,) = call(b, att, b.box(split_box(b.ty(Q), hq, kh, g_), Q), K, V)
    return b.diagram(b.box(merge_box(b.ty(O), kh, g_, hq), O), names=["O"])


def _inputs(d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([a.size for a in arr.axes]).astype(np.float32) for arr in d.dom]


def test_pieces_compose_to_the_diagram():
    d = L.mlp(Axis("t", 3), Axis("d", 2), Axis("f", 4))
    xs = [x.astype(np.float64) for x in _inputs(d)]
    env = dict(enumerate(xs))
    for p in pieces(d, (3,)):
        got = evaluate(p.diagram, *[env[v] for v in p.ins])
        env.update(zip(p.outs, got if isinstance(got, tuple) else (got,)))
    np.testing.assert_allclose(env[d.outs[0]], evaluate(d, *xs), rtol=1e-12)


def test_softmax_two_pass_is_softmax():
    d = L.softmax(Axis("r", 3), Axis("c", 7))
    x = np.random.default_rng(1).standard_normal((3, 7)) * 30
    np.testing.assert_allclose(evaluate(softmax_two_pass(d, 0), x), evaluate(d, x), rtol=1e-12)


def test_place_hbm_cuts_and_calls_like_a_kernel():
    torch = pytest.importorskip("torch")
    d = L.mlp(Axis("t", 2), Axis("d", 2), Axis("f", 3), activation="relu")
    k = nc.lower(d.place("H", "HBM"), verify=1)
    assert isinstance(k, MultiKernel) and k.verified and len(k.kernels) == 2
    assert any("place(H, 'HBM')" in n for n in k.notes) and "# HBM between kernels: H" in k.pseudocode()
    xs = _inputs(d)
    got = k(*[torch.from_numpy(x) for x in xs])
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), evaluate(d, *xs), rtol=1e-5, atol=1e-5)


def test_matmul_chain_lowers_without_relabelling():
    d = _chain(2)
    k = nc.lower(d, verify=1)
    assert isinstance(k, MultiKernel) and len(k.kernels) >= 2
    assert k.notes[0].startswith("One kernel does not do")
    assert any("Cut after equation" in n for n in k.notes)


def test_softmax_row_over_shared_memory_gets_two_passes():
    d = L.softmax(Axis("r", 1), Axis("c", 48))
    k = nc.lower(d, hw=TINY_SMEM, verify=1)
    assert [kk.diagram.cod[0].name for kk in k.kernels] == ["P_lse", "P"]
    assert any("two passes" in n for n in k.notes)


def test_wide_softmax_generates_statistics_then_normalise():
    d = L.softmax(Axis("r", 4), Axis("c", 131072))
    k = nc.lower(d, verify=False)   # one row is 512 KB: over the device's shared memory
    assert len(k.kernels) == 2 and "logsumexp" in k.pseudocode()


def test_flat_gqa_head_axis_lowers_with_views():
    # where the whole fits a block, the split and merge are read through their index maps in one
    # kernel (napkin_cat.lowering.reindex); over the shared memory they are views between kernels
    k = nc.lower(_flat_gqa(), verify=False, hw=TINY_SMEM)
    assert len(k.kernels) == 1 and [s.name for s in k.steps] == ["view_split", k.kernels[0].name, "view_merge"]


def test_refusals_name_the_reason():
    d = L.mlp(Axis("t", 2), Axis("d", 2), Axis("f", 3))
    with pytest.raises(LoweringError, match="schedules one kernel"):
        nc.lower(d.tile("t", 2).place("H", "HBM"), verify=False)


@pytest.mark.slow
def test_check_equivalent_accepts_multi_kernels():
    for d, kw in ((_flat_gqa(), {}), (L.softmax(Axis("r", 2), Axis("c", 40)), {"hw": TINY_SMEM})):
        k = nc.lower(d, verify=False, **kw)
        assert nc.check_equivalent(d, k, examples=4, seed=0)


@pytest.mark.slow
def test_prepare_and_out_write_the_final_outputs():
    d = _chain(2, k=2)
    k = nc.lower(d, verify=False)
    xs = _inputs(d)
    out = np.zeros(k.out_shapes[0], np.float32)
    k.prepare(*xs, out=out)()
    np.testing.assert_allclose(out, evaluate(d, *xs), rtol=1e-5, atol=1e-5)
    out2 = np.zeros_like(out)
    assert k(*xs, out=out2) is out2
    np.testing.assert_allclose(out2, out, rtol=1e-6)
