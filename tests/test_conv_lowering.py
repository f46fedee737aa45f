"""Convolutions lower: the unfold (reindex) boxes are read through their index maps inside the
consumer kernel (:mod:`napkin_cat.lowering.reindex`), or, where the input does not fit a block,
by a gather kernel of their own in a multi-kernel cut (:mod:`napkin_cat.lowering.gather`).
Every result is compared with the NumPy oracle; a planted off-by-one in the index map is caught."""

from __future__ import annotations

import copy
import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core import Axis  # noqa: E402
from napkin_cat.lowering import _lower_one  # noqa: E402
from napkin_cat.lowering.gather import gather_bytes, gather_kernel, is_gather  # noqa: E402
from napkin_cat.lowering.multi import lower_split  # noqa: E402
from napkin_cat.relabel.cut import piece  # noqa: E402

L = nc.library


def _inputs(d, seed=0):
    rng = np.random.default_rng(seed)
    xs = []
    for arr in d.dom:
        x = rng.standard_normal(tuple(a.size for a in arr.axes))
        xs.append((np.abs(x) + 0.5 if "var" in arr.name else x).astype(np.float32))
    return xs


def _assert_matches(d, k, seed=0):
    xs = _inputs(d, seed)
    got = k(*xs)
    want = nc.evaluate(d, *[x.astype(np.float64) for x in xs])
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float64), w, rtol=1e-4, atol=1e-4)


CASES = {
    "1d": lambda: L.conv1d(2, 3, 7, 3),
    "1d_stride_padding": lambda: L.conv1d(2, 3, 9, 3, stride=2, padding=1),
    "1d_dilation_ragged": lambda: L.conv1d(3, 5, 11, 3, dilation=2, padding=2),
    "1d_groups": lambda: L.conv1d(4, 6, 7, 3, groups=2, padding=1),
    "1d_transposed": lambda: L.conv1d(3, 2, 5, 3, stride=2, padding=1, transposed=True),
    "1d_transposed_output_padding": lambda: L.conv1d(3, 2, 5, 3, stride=2, padding=1, transposed=True,
                                                     output_padding=1),
    "1d_transposed_dilation": lambda: L.conv1d(3, 2, 5, 3, stride=2, dilation=2, transposed=True),
    "2d_same": lambda: L.conv2d(2, 3, 5, 6, 3, padding=1),
    "2d_stride_rect_kernel": lambda: L.conv2d(2, 3, 7, 6, (3, 2), stride=(2, 1), padding=(1, 0)),
    "2d_groups_no_bias": lambda: L.conv2d(4, 4, 5, 5, 3, groups=2, padding=1, bias=False),
    "2d_transposed": lambda: L.conv2d(2, 3, 3, 4, 2, stride=2, transposed=True),
    "2d_batch": lambda: L.conv2d(2, 3, 5, 5, 3, padding=1, batch=Axis("n", 2)),
    "2d_valid": lambda: L.conv2d(2, 3, 5, 5, 3, bias=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_conv_lowers_to_one_kernel_matching_numpy(name):
    d = CASES[name]()
    k = nc.lower(d, verify=False)
    # fused: no unfolded copy in HBM (groups: the weights' split and the result's merge are views)
    assert len(getattr(k, "kernels", (k,))) == 1, f"{name}: {k!r}"
    _assert_matches(d, k)


def test_conv_self_check_and_check_equivalent_accept_it():
    d = L.conv2d(2, 3, 6, 5, 3, padding=1, stride=2)
    k = nc.lower(d)                                   # verify=True: run against the oracle
    assert k.verified
    report = nc.check_equivalent(d, k, examples=4, progress=False)
    assert report.examples == 4


def test_no_padding_reads_without_predicates():
    """A convolution whose windows stay inside the input reads with unsigned indices, no select."""
    k = nc.lower(L.conv1d(2, 3, 9, 3, stride=2), verify=False)
    assert "pos_" not in k.source and "i_l_at" not in k.source
    padded = nc.lower(L.conv1d(2, 3, 9, 3, stride=2, padding=1), verify=False)
    assert "pos_l >= 0 and pos_l < 9" in padded.source


@pytest.mark.parametrize("net", ["resnet", "resnet_projection", "unet", "vit"])
def test_networks_lower_and_match_numpy(net):
    d = {"resnet": lambda: L.resnet_block(2, 2, 4, 4),
         "resnet_projection": lambda: L.resnet_block(2, 3, 6, 6, stride=2),
         "unet": lambda: L.unet(1, 2, 4, 4, widths=(2, 3)),
         "vit": lambda: L.vit(1, 4, 4, patch=2, d=4, heads=2, e=2, f=4, classes=2)}[net]()
    k = nc.lower(d, verify=False)
    _assert_matches(d, k)


@pytest.mark.slow
@pytest.mark.parametrize("net", ["resnet", "unet"])
def test_networks_pass_check_equivalent(net):
    d = L.resnet_block(2, 3, 5, 5) if net == "resnet" else L.unet(1, 2, 4, 6, widths=(2, 3))
    k = nc.lower(d)
    nc.check_equivalent(d, k, progress=False)


def test_gather_kernel_matches_numpy_and_counts_its_bytes():
    d = L.conv2d(2, 3, 5, 4, 3, padding=1, stride=(2, 1), dilation=(1, 2))
    p = piece(d, 0, 2)                                 # the two unfolds
    assert is_gather(p.diagram)
    k = gather_kernel(p.diagram, "unfold_hw")
    (x,) = _inputs(p.diagram)
    want = nc.evaluate(p.diagram, x.astype(np.float64))
    np.testing.assert_array_equal(k(x), want.astype(np.float32))
    valid = int(np.count_nonzero(nc.evaluate(p.diagram, np.ones_like(x, dtype=np.float64))))
    assert gather_bytes(p.diagram) == 4 * valid + 4 * want.size
    assert valid < want.size                           # the padding is not read


@pytest.mark.parametrize("name", ["2d_same", "1d_transposed_output_padding", "2d_groups_no_bias"])
def test_cut_into_gather_and_contraction_matches_numpy(name):
    """Where one kernel is refused, the unfolds become a gather kernel and the contraction reads
    its output from HBM; the whole is one callable that the checks accept."""
    def refuse_fused(dd, **opts):   # as if the input did not fit a block's shared memory
        kinds = {e.box.param("op", None) for e in dd.eqns} | {e.box.kind for e in dd.eqns}
        if "unfold" in kinds and "contract" in kinds:
            raise nc.LoweringError("the input does not fit shared memory (test)")
        return _lower_one(dd, **opts)

    d = CASES[name]()
    mk = lower_split(d, {}, refuse_fused, nc.LoweringError("one kernel does not fit (test)"))
    assert len(mk.kernels) >= 2
    if name != "2d_groups_no_bias":   # there the cheapest cut also splits W in the first kernel
        assert any(is_gather(k.diagram) for k in mk.kernels)
    _assert_matches(d, mk, seed=1)
    nc.check_equivalent(d, mk, examples=2, progress=False)


def test_reindexed_axis_that_is_tiled_is_refused_by_name():
    from napkin_cat.lowering.plan import AxisPlan
    from napkin_cat.lowering.reindex import check_axes
    from napkin_cat.relabel.loopnest import final_form
    d = L.conv1d(2, 3, 8, 3, padding=1)
    ax = {a.name: AxisPlan(a.name, a.size, "full", a.size) for a in d.axes}
    check_axes(final_form(d), ax)                        # l whole in the block: fine
    ax["l"] = AxisPlan("l", 8, "grid", 4)
    with pytest.raises(nc.LoweringError, match=r"unfold l reads axis l .*tiles l by 4"):
        check_axes(final_form(d), ax)


def _mutant(kernel, pattern, replacement):
    source, n = re.subn(pattern, replacement, kernel.source)
    assert n >= 1, f"pattern {pattern!r} not in the generated source:\n{kernel.source}"
    mutant = copy.copy(kernel)
    mutant.source, mutant._dispatcher, mutant._launchers = source, None, {}
    return mutant


@pytest.mark.parametrize("pattern, replacement", [
    (r"(pos_\w+ = [^\n]*) - 1\n", r"\1 - 2\n"),         # window offset off by one
    (r"(pos_\w+) < (\d+)", r"\1 <= \2"),                 # padding bound off by one
])
def test_planted_index_map_bug_is_caught(pattern, replacement):
    d = L.conv1d(2, 3, 7, 3, padding=1)
    k = nc.lower(d, verify=False)
    nc.check_equivalent(d, k, examples=1, progress=False)
    with pytest.raises(nc.EquivalenceError):
        nc.check_equivalent(d, _mutant(k, pattern, replacement), examples=3, progress=False)


@st.composite
def _conv(draw):
    dim = draw(st.sampled_from([1, 2]))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2]))
    c, o = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    k = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    padding = draw(st.integers(0, 1 if transposed else 2))
    op = draw(st.integers(0, max(stride, dilation) - 1)) if transposed else 0
    sizes = [draw(st.integers(max(1, dilation * (k - 1) + 1 - 2 * padding), 7)) for _ in range(dim)]
    kw = dict(stride=stride, dilation=dilation, padding=padding, groups=groups, transposed=transposed,
              output_padding=op, bias=draw(st.booleans()))
    try:
        return (L.conv1d(c, o, sizes[0], k, **kw) if dim == 1 else L.conv2d(c, o, *sizes, k, **kw)), kw
    except nc.NapkinError:
        return None


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(_conv(), st.integers(0, 2 ** 16))
def test_random_convolutions_lower_and_match_numpy(case, seed):
    if case is None:
        return
    d, kw = case
    k = nc.lower(d, verify=False)
    _assert_matches(d, k, seed)


def test_bind_derives_output_lengths_and_refuses_a_wrong_one():
    c, o, h, w = nc.axes("c o h w")
    d = L.conv2d(c, o, h, w, 3, padding=1, stride=(2, 1))
    b = d.bind({c: 2, o: 3, h: 7, w: 5})
    assert [a.size for a in b.cod[0].axes] == [3, 4, 5]          # ho, wo from PyTorch's formula
    _assert_matches(b, nc.lower(b, verify=False))
    t = L.conv1d(c, o, h, 3, stride=2, padding=1, transposed=True, output_padding=1).bind({c: 2, o: 2, h: 4})
    assert t.cod[0].axes[-1].size == 8
    with pytest.raises(nc.TypingError, match=r"axis ho has size 5, but unfold h needs 4: .*bind ho to 4"):
        d.bind({c: 2, o: 3, h: 7, w: 5, "ho": 5})
    assert eval(repr(d), vars(nc)) == d                          # the rule is a parameter like any other
    r = L.resnet_block(c, o, h, w, stride=2).bind({"c": 2, "o": 3, h: 6, w: 5})
    assert not [a for a in r.axes if a.symbolic]


def _reshapes():
    """slice, pad (an unfold without window), rename, split and merge in front of a contraction."""
    from napkin_cat.ops import merge_box, slice_box, split_box
    a, b, c, a2, b2, bb, hi, lo = (Axis("a", 7), Axis("b", 3), Axis("c", 5), Axis("a2", 4), Axis("b2", 6),
                                   Axis("bb", 6), Axis("hi", 2), Axis("lo", 3))
    g = nc.Builder()
    X, W = g.input("X", a, b), g.input("W", bb, c)
    S = g.box(slice_box(g.ty(X), a, 2, 6, a2), X)                        # rows 2..5
    P = g.unfold(S, b, b2, offset=-2)                                   # b padded by 2 zeros in front, 1 after
    R = g.rename(P, b2, bb)
    T = g.box(split_box(g.ty(R), bb, hi, lo), R)
    M = g.box(merge_box(g.ty(T), hi, lo, bb), T)
    Y = g.contract(M, W, out=(a2, c), name="Y")
    return g.diagram(Y)


def test_slice_pad_rename_split_merge_read_through_their_maps():
    d = _reshapes()
    k = nc.lower(d, verify=False)
    assert len(getattr(k, "kernels", (k,))) == 1
    _assert_matches(d, k)
    p = piece(d, 0, 5)                                                  # the reshapes alone: a gather kernel
    assert is_gather(p.diagram)
    (x,) = _inputs(p.diagram)
    np.testing.assert_array_equal(gather_kernel(p.diagram, "reshapes")(x),
                                  nc.evaluate(p.diagram, x.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sixteen_bit_gather_kernel_copies_bit_patterns(dtype):
    """A 16-bit convolution's unfolds as a gather kernel (kernels/bench_networks.py found the
    fp16 convolution at 56 x 56 refused: gather kernels moved fp32 only): the values are copied
    exactly, zero where the windows leave the input."""
    import torch
    d = L.conv2d(2, 3, 5, 4, 3, padding=1, stride=(2, 1), dilation=(1, 2), dtype=nc.DTYPES[dtype])
    p = piece(d, 0, 2)
    assert is_gather(p.diagram) and p.diagram.dom[0].dtype.name == dtype
    k = gather_kernel(p.diagram, "unfold_hw")
    assert "ZERO16 = int16(0)" in k.source
    x = torch.randn(*(a.size for a in p.diagram.dom[0].axes), generator=torch.Generator().manual_seed(3))
    x = x.to({"f16": torch.float16, "bf16": torch.bfloat16}[dtype])
    want = nc.evaluate(p.diagram, x.double().numpy())
    got = k(x)
    assert got.dtype == x.dtype and np.array_equal(got.double().numpy(), want)
    from napkin_cat.lowering.typecheck import typecheck_kernel
    try:       # numba's GPU front end types the int16 copies (the simulator types nothing)
        typecheck_kernel(k.source, k.name, "void(int16[::1], int16[::1])")
    except nc.LoweringError as e:
        if "TypingError" in str(e) or not any(w in str(e) for w in ("NVVM", "nvvm", "libdevice")):
            raise
