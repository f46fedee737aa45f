"""Whole networks as library diagrams (issue 12): convolutions from unfolding + contraction, a
pre-norm transformer block, a residual block, a U-Net and a vision transformer, each checked in
NumPy and torch semantics against torch.nn with the same weights, refusing bad input by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F

import napkin_cat as nc
from napkin_cat.library.compose import call
from napkin_cat.ops.grad import grad

L = nc.library
DT = torch.float64


def _run(d, X, W, sizes=None):
    """NumPy and torch semantics of ``d`` on ``X`` and the weights ``W`` (by input name)."""
    args = [X] + [W[a.name] for a in d.dom[1:]]
    got = nc.evaluate(d, *(np.asarray(a) for a in args), sizes=sizes)
    got_torch = nc.to_torch(d)(*(torch.as_tensor(a) for a in args), sizes=sizes)
    return got, got_torch.detach().numpy()


def _agree(d, X, W, ref, sizes=None, tol=1e-11):
    got, got_torch = _run(d, X, W, sizes)
    ref = ref.detach().numpy()
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=tol, rtol=0)
    np.testing.assert_allclose(got_torch, ref, atol=tol, rtol=0)


# --------------------------------------------------------------------------- convolutions

CONV1D = [dict(), dict(stride=2, padding=1), dict(stride=3, padding=2, dilation=2), dict(groups=2),
          dict(transposed=True), dict(transposed=True, stride=2, padding=1, output_padding=1),
          dict(transposed=True, stride=3, dilation=2, padding=2, groups=2)]


@pytest.mark.parametrize("how", CONV1D, ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()) or "plain")
def test_conv1d_matches_torch(how):
    torch.manual_seed(0)
    c, o, n, k = 4, 6, 11, 3
    tr, groups = how.get("transposed", False), how.get("groups", 1)
    X = torch.randn(c, n, dtype=DT)
    W = torch.randn(*((c, o // groups) if tr else (o, c // groups)), k, dtype=DT)
    b = torch.randn(o, dtype=DT)
    kw = {key: v for key, v in how.items() if key != "transposed"}
    ref = (F.conv_transpose1d if tr else F.conv1d)(X[None], W, b, **kw)[0]
    d = L.conv1d(c, o, n, k, **how)
    _agree(d, X, {"W": W, "bias": b}, ref)


def test_conv2d_matches_torch_grouped_strided_and_batched():
    torch.manual_seed(1)
    conv = tnn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2, dtype=DT)
    X = torch.randn(3, 4, 7, 9, dtype=DT)
    d = L.conv2d(4, 6, 7, 9, kernel=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2,
                 batch=nc.Axis("n", 3))
    with torch.no_grad():
        _agree(d, X, {"W": conv.weight, "bias": conv.bias}, conv(X))


def test_conv_transpose2d_matches_torch():
    torch.manual_seed(2)
    conv = tnn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1, bias=False, dtype=DT)
    X = torch.randn(3, 5, 4, dtype=DT)
    d = L.conv2d(3, 4, 5, 4, kernel=3, stride=2, padding=1, output_padding=1, transposed=True, bias=False)
    with torch.no_grad():
        _agree(d, X, {"W": conv.weight}, conv(X[None])[0])


def test_conv_with_symbolic_sizes_evaluates_at_bound_sizes():
    torch.manual_seed(3)
    d = L.conv1d(kernel=nc.Axis("k", "k"), padding=1)
    X, W, b = torch.randn(2, 8, dtype=DT), torch.randn(5, 2, 3, dtype=DT), torch.randn(5, dtype=DT)
    _agree(d, X, {"W": W, "bias": b}, F.conv1d(X[None], W, b, padding=1)[0], sizes={"lo": 8})


def test_conv_gradient_matches_autograd():
    """The adjoint of an unfolding is an unfolding back, a diagonal and a sum: nc.grad works."""
    torch.manual_seed(4)
    d = L.conv1d(3, 2, 9, 3, stride=2, padding=1, dilation=2)
    X, W, b = (torch.randn(*s, dtype=DT, requires_grad=True) for s in ((3, 9), (2, 3, 3), (2,)))
    Y = F.conv1d(X[None], W, b, stride=2, padding=1, dilation=2)[0]
    G = torch.randn_like(Y)
    (Y * G).sum().backward()
    dX, dW, db = nc.evaluate(grad(d), *(t.detach().numpy() for t in (X, W, b, G)))
    for got, want in ((dX, X.grad), (dW, W.grad), (db, b.grad)):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-12)


def test_conv_lowers():   # the unfolds are read through their index maps (tests/test_conv_lowering.py)
    assert nc.lower(L.conv1d(2, 2, 8, 3, bias=False)).verified


# --------------------------------------------------------------------------- networks

def block_weights(layer: tnn.TransformerEncoderLayer, h: int, prefix: str = "") -> dict:
    """A torch encoder layer's tensors under the diagram's input names and layouts."""
    d = layer.linear1.in_features
    e = d // h
    ipw, ipb = layer.self_attn.in_proj_weight.detach(), layer.self_attn.in_proj_bias.detach()
    W = {}
    for i, n in enumerate("qkv"):
        W[f"attn_W{n}"] = ipw[i * d:(i + 1) * d].T.reshape(d, h, e)
        W[f"attn_b{n}"] = ipb[i * d:(i + 1) * d].reshape(h, e)
    W["attn_Wo"] = layer.self_attn.out_proj.weight.detach().T.reshape(h, e, d)
    W["attn_bo"] = layer.self_attn.out_proj.bias.detach()
    for k, norm in (("ln1", layer.norm1), ("ln2", layer.norm2)):
        W[f"{k}_gamma"], W[f"{k}_beta"] = norm.weight.detach(), norm.bias.detach()
    W["mlp_W1"], W["mlp_b1"] = layer.linear1.weight.detach().T, layer.linear1.bias.detach()
    W["mlp_W2"], W["mlp_b2"] = layer.linear2.weight.detach().T, layer.linear2.bias.detach()
    return {prefix + k: v for k, v in W.items()}


def _encoder_layer(d, h, f, eps=1e-5):
    return tnn.TransformerEncoderLayer(d, h, f, dropout=0.0, activation="gelu", layer_norm_eps=eps,
                                       batch_first=True, norm_first=True, dtype=DT).eval()


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_block_matches_torch(causal):
    torch.manual_seed(5)
    t, d, h, f = 5, 8, 2, 12
    layer = _encoder_layer(d, h, f)
    X = torch.randn(t, d, dtype=DT)
    mask = tnn.Transformer.generate_square_subsequent_mask(t, dtype=DT) if causal else None
    with torch.no_grad():
        ref = layer(X[None], src_mask=mask, is_causal=causal)[0]
    _agree(L.transformer_block(t, d, h, d // h, f, causal=causal), X, block_weights(layer, h), ref)


def _bn(c):
    b = tnn.BatchNorm2d(c, dtype=DT).eval()
    with torch.no_grad():
        b.running_mean.normal_(), b.running_var.uniform_(0.5, 2), b.weight.normal_(), b.bias.normal_()
    return b


def _bn_weights(b, prefix):
    return {f"{prefix}_mean": b.running_mean, f"{prefix}_var": b.running_var,
            f"{prefix}_gamma": b.weight.detach(), f"{prefix}_beta": b.bias.detach()}


@pytest.mark.parametrize("c, o, stride", [(4, None, 1), (4, 6, 2)])
def test_resnet_block_matches_torch(c, o, stride):
    torch.manual_seed(6)
    co = o or c
    c1, c2 = tnn.Conv2d(c, co, 3, stride, 1, bias=False, dtype=DT), tnn.Conv2d(co, co, 3, 1, 1, bias=False, dtype=DT)
    b1, b2, bd = _bn(co), _bn(co), _bn(co)
    down = tnn.Conv2d(c, co, 1, stride, bias=False, dtype=DT)
    X = torch.randn(c, 9, 9, dtype=DT)
    project = o is not None
    with torch.no_grad():
        s = bd(down(X[None])) if project else X[None]
        ref = torch.relu(b2(c2(torch.relu(b1(c1(X[None]))))) + s)[0]
    W = {"conv1_W": c1.weight.detach(), "conv2_W": c2.weight.detach(), "down_W": down.weight.detach(),
         **_bn_weights(b1, "bn1"), **_bn_weights(b2, "bn2"), **_bn_weights(bd, "down_bn")}
    _agree(L.resnet_block(c, o, 9, 9, stride=stride), X, W, ref)


def test_unet_matches_torch():
    torch.manual_seed(7)
    widths, c, k, n = (4, 6, 8), 3, 2, 8
    depth = len(widths) - 1
    m = {}
    for lv in range(depth + 1):
        m[f"enc{lv}a"] = tnn.Conv2d(c if lv == 0 else widths[lv - 1], widths[lv], 3, padding=1, dtype=DT)
        m[f"enc{lv}b"] = tnn.Conv2d(widths[lv], widths[lv], 3, padding=1, dtype=DT)
    for lv in range(depth):
        m[f"up{lv}"] = tnn.ConvTranspose2d(widths[lv + 1], widths[lv], 2, 2, dtype=DT)
        m[f"dec{lv}a"] = tnn.Conv2d(2 * widths[lv], widths[lv], 3, padding=1, dtype=DT)
        m[f"dec{lv}b"] = tnn.Conv2d(widths[lv], widths[lv], 3, padding=1, dtype=DT)
    m["out"] = tnn.Conv2d(widths[0], k, 1, dtype=DT)

    def double(x, name):
        return torch.relu(m[f"{name}b"](torch.relu(m[f"{name}a"](x))))

    X = torch.randn(c, n, n, dtype=DT)
    with torch.no_grad():
        x, skips = X[None], []
        for lv in range(depth):
            x = double(x, f"enc{lv}")
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = double(x, f"enc{depth}")
        for lv in reversed(range(depth)):
            x = double(torch.cat([skips[lv], m[f"up{lv}"](x)], 1), f"dec{lv}")
        ref = m["out"](x)[0]
    W = {f"{name}_{w}": getattr(mod, "weight" if w == "W" else "bias").detach() for name, mod in m.items()
         for w in ("W", "bias")}
    _agree(L.unet(c, k, n, n, widths), X, W, ref)


def test_vit_matches_torch():
    torch.manual_seed(8)
    c, hh, ww, p, d, h, f, k, layers = 3, 8, 12, 4, 8, 2, 16, 5, 2
    conv = tnn.Conv2d(c, d, p, p, dtype=DT)
    n = (hh // p) * (ww // p)
    cls, pos = torch.randn(1, 1, d, dtype=DT), torch.randn(1, n + 1, d, dtype=DT)
    blocks = [_encoder_layer(d, h, f, eps=1e-6) for _ in range(layers)]
    ln, head = tnn.LayerNorm(d, 1e-6, dtype=DT), tnn.Linear(d, k, dtype=DT)
    X = torch.randn(c, hh, ww, dtype=DT)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
        z = torch.cat([cls, conv(X[None]).flatten(2).transpose(1, 2)], 1) + pos
        for b in blocks:
            z = b(z)
        ref = head(ln(z)[:, 0])[0]
    W = {"embed_W": conv.weight.detach(), "embed_bias": conv.bias.detach(), "cls": cls[0], "pos": pos[0],
         "ln_gamma": ln.weight.detach(), "ln_beta": ln.bias.detach(), "head_W": head.weight.detach().T,
         "head_b": head.bias.detach()}
    for i, b in enumerate(blocks):
        W.update(block_weights(b, h, f"block{i}_"))
    _agree(L.vit(c, hh, ww, p, d, h, d // h, f, k, layers=layers), X, W, ref)


def test_networks_are_their_parts_composed():
    """A network inlines library diagrams: the block's layer norm is the library's, box for box."""
    t, d = nc.axes("t d")
    g = nc.Builder()
    X, gamma, beta = g.input("X", t, d), g.input("gamma", d), g.input("beta", d)
    ln = L.layernorm(t, d)
    (Y,) = call(g, ln, X, gamma, beta)
    assert g.diagram(Y).boxes() == ln.boxes()
    block = L.transformer_block()
    assert all(b in block.boxes() for b in ln.boxes())


# --------------------------------------------------------------------------- refusals

BAD = [
    (lambda: L.conv1d(4, 6, 8, 3, groups=4), "groups=4"),
    (lambda: L.conv1d(4, 6, 8, 3, stride=0), "stride"),
    (lambda: L.conv1d(4, 6, 8, 3, padding=-1), "padding"),
    (lambda: L.conv1d(4, 6, 8, 3, output_padding=1), "output_padding"),
    (lambda: L.conv1d(4, 6, 8, 3, transposed=True, output_padding=2, stride=2), "output_padding 2"),
    (lambda: L.conv1d(4, 6, 2, 5), "leaves no output"),
    (lambda: L.conv1d(4, 6, 8, 3, out=nc.Axis("lo", 7)), "should have size 6"),
    (lambda: L.conv1d(4, 6, 8, "3"), "kernel size"),
    (lambda: L.conv2d(4, 6, 8, 8, kernel=(3, 3, 3)), "kernel"),
    (lambda: L.conv2d(4, 6, 8, 8, stride=(1, 2, 3)), "stride"),
    (lambda: L.conv1d(4, 6, 8, 3, bias="yes"), "bias"),
    (lambda: L.conv1d(nc.Axis("c", 4), nc.Axis("k", 6), 8, 3), "used twice"),
    (lambda: L.transformer_block(causal=1), "causal"),
    (lambda: L.transformer_block(nc.Axis("t"), nc.Axis("x")), "distinct names"),
    (lambda: L.transformer_block(eps=0), "eps"),
    (lambda: L.resnet_block(4, 4, 8, 8, stride=0), "stride"),
    (lambda: L.unet(3, 2, 9, 8, (4, 8)), "h=9"),
    (lambda: L.unet(3, 2, 8, 8, (4,)), "widths"),
    (lambda: L.unet(3, 2, 8, 8, (4, 8.0)), "widths"),
    (lambda: L.vit(3, 10, 8, patch=4), "h=10"),
    (lambda: L.vit(3, 8, 8, patch=4, layers=0), "layers"),
    (lambda: L.vit(3, 8, 8, patch=4, d=nc.Axis("e", 4)), "distinct names"),
    (lambda: L.vit(3, 8, 8, patch=4, classes=nc.Axis("n", 3)), "axis name n"),
    (lambda: L.batchnorm(4, nc.Axis("h", 3), eps=-1.0), "eps"),
    (lambda: nc.ops.unfold_box(nc.Array((nc.Axis("a", 4),)), "a", nc.Axis("b", 4), nc.Axis("k", 2), dilation=0),
     "dilation"),
    (lambda: nc.ops.rename_box(nc.Array((nc.Axis("a", 4),)), "a", nc.Axis("b", 5)), "sizes differ"),
    (lambda: call(nc.Builder(), L.layernorm(), ), "takes 3 wires"),
]


@pytest.mark.parametrize("make, text", BAD, ids=[t for _, t in BAD])
def test_bad_input_is_refused_by_name(make, text):
    with pytest.raises(nc.NapkinError) as err:
        make()
    assert text in str(err.value)


def test_builders_mutate_nothing():
    widths, stride = [4, 8], [2, 1]
    L.unet(3, 2, 8, 8, widths)
    L.conv2d(4, 6, 8, 8, stride=stride)
    assert widths == [4, 8] and stride == [2, 1]


# --------------------------------------------------------------------------- drawing, cost, lowering

@pytest.mark.slow
@pytest.mark.parametrize("name", ["conv", "transformer_block", "resnet_block", "unet", "vit"])
def test_network_draws_costs_and_lowering_answers(name, tmp_path):
    d = {"conv": lambda: L.conv2d(padding=1), "transformer_block": L.transformer_block,
         "resnet_block": L.resnet_block, "unet": L.unet, "vit": L.vit}[name]()
    nc.draw(d, str(tmp_path / f"{name}.svg"))
    assert (tmp_path / f"{name}.svg").stat().st_size > 1000
    assert nc.cost(d).flops["tensor"] != 0
    with pytest.raises(nc.LoweringError):   # multi-kernel lowering is not there yet
        nc.lower(d, verify=False)
