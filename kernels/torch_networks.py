"""The networks of ``kernels/bench_networks.py`` in torch, on the tensors the diagrams take.

Each is written once, with ``torch.nn.functional``, and serves three times: in float64 it is
the reference the generated kernels are checked against, in the kernels' dtype it is the eager
peer they are timed against, and under ``torch.compile`` the compiled one.  The tensors come
by the diagrams' input names and layouts (``nc.library``: linear maps ``W[in out]``, attention
``Wq[d h e]`` and ``Wo[h e d]``, convolutions ``W[o c kh kw]``, transposed ones
``W[c_in c_out kh kw]``, images batched ``[b c h w]``); :func:`torch_form` puts them in
torch's layouts once, outside any timing.  ``--tiny`` checks every one of them against the
NumPy oracle (``nc.evaluate``) of its diagram.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def fan_in(name: str, shape: tuple) -> int:
    """Inputs summed into one output of the weight ``name`` (layouts of the library's diagrams)."""
    if name.endswith("attn_Wo"):         # W[h e d]
        return shape[0] * shape[1]
    if name.startswith("up"):            # the U-Net's transposed convolutions, stride = kernel
        return shape[0]                  # W[c_in c_out kh kw]: one tap per input channel
    if len(shape) == 4:                  # convolutions W[o c kh kw]
        return math.prod(shape[1:])
    return shape[0]                      # attn_W{q,k,v}[d h e], mlp_W1[d f], mlp_W2[f d], head_W[d k]


# ------------------------------------------------------------------------------ transformer block

def torch_params(W: dict, prefix: str = "") -> dict:
    """A block's weights (``prefix`` + the block's names) in torch's layouts (``F.linear``'s
    ``[out, in]``, QKV fused)."""
    W = {k[len(prefix):]: v for k, v in W.items() if k.startswith(prefix)}
    d = W["attn_Wq"].shape[0]
    proj = [W[f"attn_W{n}"].reshape(d, -1).T for n in "qkv"]
    return {"ln1_w": W["ln1_gamma"], "ln1_b": W["ln1_beta"], "ln2_w": W["ln2_gamma"], "ln2_b": W["ln2_beta"],
            "in_w": torch.cat(proj).contiguous(), "in_b": torch.cat([W[f"attn_b{n}"].reshape(-1) for n in "qkv"]),
            "out_w": W["attn_Wo"].reshape(-1, d).T.contiguous(), "out_b": W["attn_bo"],
            "w1": W["mlp_W1"].T.contiguous(), "b1": W["mlp_b1"], "w2": W["mlp_W2"].T.contiguous(), "b2": W["mlp_b2"]}


def block_forward(X, P: dict, heads: int, causal: bool, eps: float = 1e-5):
    """The pre-norm block in torch: ``X1 = X + MHA(LN1(X))``, ``Y = X1 + MLP(LN2(X1))``, GELU (erf)."""
    dm = X.shape[-1]
    A = F.layer_norm(X, (dm,), P["ln1_w"], P["ln1_b"], eps)
    qkv = F.linear(A, P["in_w"], P["in_b"]).unflatten(-1, (3, heads, -1))     # [.. t 3 h e]
    q, k, v = (z.transpose(-3, -2) for z in qkv.movedim(-3, 0))               # [.. h t e]
    O = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(-3, -2).flatten(-2)
    X1 = X + F.linear(O, P["out_w"], P["out_b"])
    B = F.layer_norm(X1, (dm,), P["ln2_w"], P["ln2_b"], eps)
    return X1 + F.linear(F.gelu(F.linear(B, P["w1"], P["b1"])), P["w2"], P["b2"])


def encoder_layer(P: dict, heads: int):
    """``torch.nn.TransformerEncoderLayer`` holding ``P`` (batch first; inputs ``[b t d]``)."""
    dm, ff = P["in_w"].shape[1], P["w1"].shape[0]
    layer = torch.nn.TransformerEncoderLayer(dm, heads, ff, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True, device=P["w1"].device, dtype=P["w1"].dtype).eval()
    with torch.no_grad():
        for mod, w, b in ((layer.self_attn, "in_w", "in_b"), (layer.self_attn.out_proj, "out_w", "out_b"),
                          (layer.linear1, "w1", "b1"), (layer.linear2, "w2", "b2"),
                          (layer.norm1, "ln1_w", "ln1_b"), (layer.norm2, "ln2_w", "ln2_b")):
            if mod is layer.self_attn:
                mod.in_proj_weight.copy_(P[w]), mod.in_proj_bias.copy_(P[b])
            else:
                mod.weight.copy_(P[w]), mod.bias.copy_(P[b])
    return layer


# ------------------------------------------------------------------------------ convolutional networks

def conv_forward(X, W, bias):
    """``nc.library.conv2d(..., kernel=3, padding=1)``: cuDNN's convolution."""
    return F.conv2d(X, W, bias, padding=1)


def resnet_forward(X, W: dict, eps: float = 1e-5):
    """``nc.library.resnet_block`` with the identity shortcut:
    ``relu(BN2(conv2(relu(BN1(conv1(X))))) + X)``, batch norms with inference statistics."""
    def bn(Y, p):
        return F.batch_norm(Y, W[f"{p}_mean"], W[f"{p}_var"], W[f"{p}_gamma"], W[f"{p}_beta"], False, 0.0, eps)

    Y = torch.relu(bn(F.conv2d(X, W["conv1_W"], padding=1), "bn1"))
    return torch.relu(bn(F.conv2d(Y, W["conv2_W"], padding=1), "bn2") + X)


def unet_forward(X, W: dict, depth: int):
    """``nc.library.unet`` with ``depth`` poolings: two 3x3 convolutions and ReLUs per level,
    2x2 max pooling down, a 2x2 stride-2 transposed convolution up, ``[skip; up]`` concatenated
    before the up path's convolutions, a 1x1 convolution last."""
    def double(Y, name):
        for half in "ab":
            Y = torch.relu(F.conv2d(Y, W[f"{name}{half}_W"], W[f"{name}{half}_bias"], padding=1))
        return Y

    skips = []
    for lv in range(depth):
        X = double(X, f"enc{lv}")
        skips.append(X)
        X = F.max_pool2d(X, 2)
    X = double(X, f"enc{depth}")
    for lv in reversed(range(depth)):
        up = F.conv_transpose2d(X, W[f"up{lv}_W"], W[f"up{lv}_bias"], stride=2)
        X = double(torch.cat([skips[lv], up], 1), f"dec{lv}")
    return F.conv2d(X, W["out_W"], W["out_bias"])


def vit_params(W: dict, layers: int) -> dict:
    """The ViT's weights in torch's layouts (each block's as :func:`torch_params`)."""
    return {"embed_w": W["embed_W"], "embed_b": W["embed_bias"], "cls": W["cls"], "pos": W["pos"],
            "blocks": [torch_params(W, f"block{i}_") for i in range(layers)], "ln_w": W["ln_gamma"],
            "ln_b": W["ln_beta"], "head_w": W["head_W"].T.contiguous(), "head_b": W["head_b"]}


def vit_forward(X, P: dict, heads: int, patch: int, eps: float = 1e-6):
    """``nc.library.vit``: patches embedded by a stride-``patch`` convolution, the class token in
    front, the position embedding added, the blocks, a layer norm, the head on the class token."""
    E = F.conv2d(X, P["embed_w"], P["embed_b"], stride=patch).flatten(2).transpose(1, 2)    # [b n d]
    Z = torch.cat([P["cls"].expand(X.shape[0], -1, -1), E], 1) + P["pos"]
    for B in P["blocks"]:
        Z = block_forward(Z, B, heads, False, eps)
    Z = F.layer_norm(Z, (Z.shape[-1],), P["ln_w"], P["ln_b"], eps)
    return F.linear(Z[:, 0], P["head_w"], P["head_b"])


# ------------------------------------------------------------------------------ by kind

def torch_form(kind: str, s: dict, W: dict, causal: bool = False) -> tuple:
    """``(fn, args)``: the network of ``kind`` at sizes ``s`` as a torch function and its
    arguments, the tensors ``W`` (by the diagram's input names) in torch's layouts;
    ``fn(*args)`` is what the diagram computes."""
    X = W["X"]
    if kind == "block":
        return block_forward, (X, torch_params(W), s["h"], causal)
    if kind == "conv":
        return conv_forward, (X, W["W"], W["bias"])
    if kind == "resnet":
        return resnet_forward, (X, W)
    if kind == "unet":
        return unet_forward, (X, W, len(s["widths"]) - 1)
    if kind == "vit":
        return vit_forward, (X, vit_params(W, s["layers"]), s["h"], s["patch"])
    raise ValueError(f"torch_form: unknown kind {kind!r}")


def conv_flops(n: int, c: int, o: int, taps: int, pixels: int) -> float:
    """A convolution's multiply-adds, twice: ``n`` images, ``c`` to ``o`` channels, ``taps``
    kernel taps read per output pixel and input channel, ``pixels`` output pixels."""
    return 2.0 * n * c * o * taps * pixels


def block_flops(t: int, d: int, he: int, f: int, causal: bool = False) -> float:
    """A transformer block's matmul FLOPs on ``t`` tokens (QKV, scores and PV, output, MLP)."""
    return 2.0 * t * d * 3 * he + 4.0 * t * t * he * (0.5 if causal else 1.0) + 2.0 * t * he * d + 4.0 * t * d * f


def flops(kind: str, s: dict, causal: bool = False) -> float:
    """The matmul and convolution FLOPs of the network (a transposed convolution counts the taps
    that land on an output pixel, one per input channel at stride = kernel)."""
    if kind == "conv":
        return conv_flops(s["n"], s["c"], s["o"], 9, s["hw"] ** 2)
    if kind == "block":
        return s["batch"] * block_flops(s["t"], s["d"], s["h"] * s["e"], s["f"], causal)
    if kind == "resnet":
        return 2 * conv_flops(s["n"], s["c"], s["c"], 9, s["hw"] ** 2)
    if kind == "unet":
        ws, n, total = s["widths"], s["n"], 0.0
        for lv, w in enumerate(ws):
            px = (s["hw"] >> lv) ** 2
            total += conv_flops(n, s["c"] if lv == 0 else ws[lv - 1], w, 9, px) + conv_flops(n, w, w, 9, px)
            if lv + 1 < len(ws):   # up from the level below, then the two convolutions of [skip; up]
                total += conv_flops(n, ws[lv + 1], w, 1, px) + conv_flops(n, 2 * w, w, 9, px) + \
                    conv_flops(n, w, w, 9, px)
        return total + conv_flops(n, ws[0], s["k"], 1, s["hw"] ** 2)
    if kind == "vit":
        patches = (s["hw"] // s["patch"]) ** 2
        embed = conv_flops(s["n"], s["c"], s["d"], s["patch"] ** 2, patches)
        blocks = s["layers"] * s["n"] * block_flops(patches + 1, s["d"], s["h"] * s["e"], s["f"])
        return embed + blocks + 2.0 * s["n"] * s["d"] * s["k"]
    raise ValueError(f"flops: unknown kind {kind!r}")
