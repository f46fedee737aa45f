"""Whole networks as diagrams: a transformer block, a residual block, a U-Net, a vision transformer.

Each is its parts wired together with :func:`~napkin_cat.library.compose.call`: layer norm,
attention (weaved over heads), the MLP and the convolutions (:mod:`.conv`) are the library's
own diagrams, so everything downstream (NumPy and torch semantics, drawing, cost, relabelling)
reads the network box by box.  Weights are inputs (``X`` first, then the weights, named
``<part>_<weight>``), in the layouts of the parts: linear maps ``W[in out]``, attention
projections ``Wq[d h e]`` and ``Wo[h e d]``, convolutions PyTorch's ``W[o c kh kw]``.
``batch`` weaves the input ``X`` over a batch axis with the weights shared.

>>> import napkin_cat as nc
>>> print(nc.library.resnet_block(8, None, 16, 16).cod)   # o = c: the identity shortcut
Y[c=8 h=16 w=16] f32
"""

from __future__ import annotations

from typing import Sequence

from ..core import Axis, Diagram, DType, f32
from ..core.errors import TypingError
from ..ops import Builder, merge_box, slice_box, split_box
from .basic import attention, layernorm, mlp
from .compose import call, weights
from .conv import _axis, conv


def _real(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TypingError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _batched(d: Diagram, batch, what: str) -> Diagram:
    return d if batch is None else d.weave(_axis(batch, "n", what), inputs=(0,))


def _named_once(d: Diagram, what: str) -> Diagram:
    """Every axis name has one size across the whole network (sizes are read by name)."""
    seen: dict[str, Axis] = {}
    for arr in d.var_types():
        for a in arr.axes:
            if seen.setdefault(a.name, a) != a:
                raise TypingError(f"{what}: axis name {a.name} is used with two sizes, "
                                  f"{seen[a.name].describe()} and {a.describe()}; pick another name")
    return d


def _key_axis(t: Axis) -> Axis:
    """The keys' name for the token axis (same size): self-attention reads ``t`` twice."""
    return Axis("x" if t.name != "x" else "x_k", t.size)


def batchnorm(c=None, *spatial: Axis, eps: float = 1e-5, dtype: DType = f32) -> Diagram:
    """Batch normalisation at inference: ``Y = (X - mean) / sqrt(var + eps) * gamma + beta`` per
    channel (``torch.nn.BatchNorm2d`` in ``eval()``)."""
    what = "batchnorm"
    c = _axis(c, "c", what)
    spatial = tuple(_axis(a, f"s{i}", what) for i, a in enumerate(spatial))
    eps = _real(eps, f"{what} eps")
    g = Builder(dtype)
    X = g.input("X", c, *spatial)
    mean, var, gamma, beta = (g.input(n, c) for n in ("mean", "var", "gamma", "beta"))
    inv = g.map("rsqrt", g.map("shift", var, c=eps))
    Y = g.map("mul", g.map("sub", X, mean, out=(c, *spatial)), g.map("mul", inv, gamma), out=(c, *spatial))
    return g.diagram(g.map("add", Y, beta, out=(c, *spatial)), names=["Y"])


def transformer_block(t=None, d=None, heads=None, e=None, f=None, *, causal: bool = False,
                      activation: str = "gelu", eps: float = 1e-5, batch: Axis | None = None,
                      dtype: DType = f32) -> Diagram:
    """A pre-norm transformer block: ``X1 = X + MHA(LN1(X))``, ``Y = X1 + MLP(LN2(X1))``
    (``torch.nn.TransformerEncoderLayer(norm_first=True)`` without dropout).

    Axes: tokens ``t``, model width ``d``, ``heads`` ``h`` of width ``e``, MLP width ``f``; the
    keys read the tokens under a second name (``x``, same size).  Inputs: ``X[t d]``,
    ``ln1_gamma``, ``ln1_beta``, ``attn_Wq[d h e]``, ``attn_bq[h e]`` (and ``Wk``, ``bk``, ``Wv``,
    ``bv``), ``attn_Wo[h e d]``, ``attn_bo[d]``, ``ln2_gamma``, ``ln2_beta``, ``mlp_W1[d f]``,
    ``mlp_b1[f]``, ``mlp_W2[f d]``, ``mlp_b2[d]``."""
    what = "transformer_block"
    t, d, h = _axis(t, "t", what), _axis(d, "d", what), _axis(heads, "h", what)
    e, f = _axis(e, "e", what), _axis(f, "f", what)
    names = [a.name for a in (t, d, h, e, f)]
    if len(set(names)) != 5 or _key_axis(t).name in names:
        raise TypingError(f"{what}: axes t, d, heads, e, f need distinct names, none of them "
                          f"{_key_axis(t).name} (the keys' token axis), got {names}")
    if not isinstance(causal, bool):
        raise TypingError(f"{what}: causal must be True or False, got {causal!r}")
    eps = _real(eps, f"{what} eps")
    x = _key_axis(t)
    ln = layernorm(t, d, eps=eps, dtype=dtype)
    att = attention(q=t, x=x, d=e, heads=h, causal=causal, dtype=dtype)
    ff = mlp(t, d, f, activation=activation, dtype=dtype)
    g = Builder(dtype)
    X = g.input("X", t, d)
    ln1 = weights(g, ln, "ln1")
    Wq, bq = g.input("attn_Wq", d, h, e), g.input("attn_bq", h, e)
    Wk, bk = g.input("attn_Wk", d, h, e), g.input("attn_bk", h, e)
    Wv, bv = g.input("attn_Wv", d, h, e), g.input("attn_bv", h, e)
    Wo, bo = g.input("attn_Wo", h, e, d), g.input("attn_bo", d)
    ln2 = weights(g, ln, "ln2")
    ffw = weights(g, ff, "mlp")
    (A,) = call(g, ln, X, *ln1)
    Ak = g.rename(A, t, x)
    Q = g.map("add", g.contract(A, Wq, out=(h, t, e), name="Q"), bq, out=(h, t, e))
    K = g.map("add", g.contract(Ak, Wk, out=(h, x, e), name="K"), bk, out=(h, x, e))
    V = g.map("add", g.contract(Ak, Wv, out=(h, x, e), name="V"), bv, out=(h, x, e))
    (O,) = call(g, att, Q, K, V)
    Z = g.map("add", g.contract(O, Wo, out=(t, d), name="Z"), bo, out=(t, d))
    X1 = g.map("add", X, Z, out=(t, d), name="X1")
    (B,) = call(g, ln, X1, *ln2)
    (M,) = call(g, ff, B, *ffw)
    return _batched(_named_once(g.diagram(g.map("add", X1, M, out=(t, d)), names=["Y"]), what), batch, what)


def resnet_block(c=None, o=None, h=None, w=None, *, stride: int = 1, eps: float = 1e-5,
                 batch: Axis | None = None, dtype: DType = f32) -> Diagram:
    """A residual block (ResNet's basic block): ``relu(BN(conv3x3(relu(BN(conv3x3(X))))) + S(X))``;
    the shortcut ``S`` is the identity when ``o`` is ``c`` and ``stride`` is 1, else a 1x1
    convolution with that stride and a batch norm (inference statistics).

    Inputs: ``X[c h w]``, then ``conv1_W[o c 3 3]``, ``bn1_mean``, ``bn1_var``, ``bn1_gamma``,
    ``bn1_beta``, ``conv2_W``, ``bn2_*`` and, with a projection, ``down_W[o c 1 1]``, ``down_bn_*``."""
    what = "resnet_block"
    c, h, w = _axis(c, "c", what), _axis(h, "h", what), _axis(w, "w", what)
    o = c if o is None else _axis(o, "o", what)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise TypingError(f"{what}: stride must be an int >= 1, got {stride!r}")
    eps = _real(eps, f"{what} eps")
    if o.name == c.name and o != c:
        raise TypingError(f"{what}: channel axes {c.describe()} and {o.describe()} share a name")
    if stride == 1:
        ho, wo = h, w
    else:
        ho, wo = (Axis(f"{a.name}o", f"{a.name}o" if a.symbolic else (a.size - 1) // stride + 1) for a in (h, w))
    k3 = (Axis("kh", 3), Axis("kw", 3))
    conv1 = conv(c, o, (h, w), k3, out=(ho, wo), stride=stride, padding=1, bias=False, dtype=dtype, what=what)
    conv2 = conv(o, o, (ho, wo), k3, out=(ho, wo), padding=1, bias=False, dtype=dtype, what=what)
    bn = batchnorm(o, ho, wo, eps=eps, dtype=dtype)
    project = stride != 1 or o != c
    down = conv(c, o, (h, w), (Axis("sh", 1), Axis("sw", 1)), out=(ho, wo), stride=stride, bias=False,
                dtype=dtype, what=what) if project else None
    g = Builder(dtype)
    X = g.input("X", c, h, w)
    w1, b1, w2, b2 = weights(g, conv1, "conv1"), weights(g, bn, "bn1"), weights(g, conv2, "conv2"), weights(g, bn, "bn2")
    wd, bd = (weights(g, down, "down"), weights(g, bn, "down_bn")) if project else ((), ())
    (Y,) = call(g, conv1, X, *w1)
    (Y,) = call(g, bn, Y, *b1)
    (Y,) = call(g, conv2, g.map("relu", Y), *w2)
    (Y,) = call(g, bn, Y, *b2)
    S = X
    if project:
        (S,) = call(g, down, X, *wd)
        (S,) = call(g, bn, S, *bd)
    Y = g.map("relu", g.map("add", Y, S, out=(o, ho, wo)))
    return _batched(_named_once(g.diagram(Y, names=["Y"]), what), batch, what)


def _maxpool(g: Builder, X, c: Axis, h: Axis, w: Axis, h2: Axis, w2: Axis):
    """2x2 max pooling: split each spatial axis into (half, 2) and take the max over the 2."""
    ph, pw = Axis("ph", 2), Axis("pw", 2)
    Y = g.box(split_box(g.ty(X), h, h2, ph), X)
    Y = g.box(split_box(g.ty(Y), w, w2, pw), Y)
    return g.reduce("max", g.reduce("max", Y, ph), pw, name="pool")


def _concat(g: Builder, A, B, a: Axis, b: Axis, ab: Axis):
    """Concatenation along channels, ``[A; B]``: each padded into ``ab`` with zeros, then added."""
    Ap = g.unfold(A, a, ab, offset=0)
    Bp = g.unfold(B, b, ab, offset=-a.size)
    return g.map("add", Ap, Bp, name="cat")


def unet(c=None, classes=None, h=None, w=None, widths: Sequence[int] = (8, 16), *, batch: Axis | None = None,
         dtype: DType = f32) -> Diagram:
    """A small U-Net: per level two 3x3 convolutions (padding 1, ReLU), 2x2 max pooling down, a
    2x2 stride-2 transposed convolution up, the skip concatenated before the up path's
    convolutions (``[skip; up]``), a final 1x1 convolution to ``classes``.

    ``widths`` (concrete ints) are the channels per level, ``len(widths) - 1`` poolings; ``h`` and
    ``w`` must be divisible by ``2**(len(widths) - 1)`` when concrete.  Inputs: ``X[c h w]``, then
    ``enc<l>a_W``, ``enc<l>a_bias``, ``enc<l>b_W``, ``enc<l>b_bias`` per level (the deepest is the
    bottleneck), ``up<l>_W``, ``up<l>_bias``, ``dec<l>a_*``, ``dec<l>b_*`` going up, ``out_W``,
    ``out_bias``."""
    what = "unet"
    c, k, h, w = _axis(c, "c", what), _axis(classes, "k", what), _axis(h, "h", what), _axis(w, "w", what)
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__len__") or len(widths) < 2 or \
            any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in widths):
        raise TypingError(f"{what}: widths must be at least 2 ints >= 1 (channels per level), got {widths!r}")
    depth = len(widths) - 1
    for a in (h, w):
        if not a.symbolic and a.size % 2 ** depth:
            raise TypingError(f"{what}: spatial axis {a.describe()} is not divisible by 2**{depth} "
                              f"({depth} poolings for widths {tuple(widths)})")
    if len({c.name, k.name, h.name, w.name}) != 4:
        raise TypingError(f"{what}: axes c, classes, h, w need distinct names, got {c.name, k.name, h.name, w.name}")
    hs = [h] + [Axis(f"{h.name}{l}", f"{h.name}{l}" if h.symbolic else h.size >> l) for l in range(1, depth + 1)]
    ws = [w] + [Axis(f"{w.name}{l}", f"{w.name}{l}" if w.symbolic else w.size >> l) for l in range(1, depth + 1)]
    ch = [Axis(f"c{l}", n) for l, n in enumerate(widths)]
    cat = [Axis(f"cat{l}", 2 * n) for l, n in enumerate(widths[:-1])]
    if c.name in {a.name for a in ch + cat} or k.name in {a.name for a in ch + cat}:
        raise TypingError(f"{what}: axis names c{{l}} and cat{{l}} are the levels' channels; "
                          f"rename c={c.name!r} or classes={k.name!r}")
    k3, k2, k1 = (Axis("kh", 3), Axis("kw", 3)), (Axis("uh", 2), Axis("uw", 2)), (Axis("oh", 1), Axis("ow", 1))

    def c3(ci, co, l):
        return conv(ci, co, (hs[l], ws[l]), k3, out=(hs[l], ws[l]), padding=1, dtype=dtype, what=what)

    enc = [(c3(c if l == 0 else ch[l - 1], ch[l], l), c3(ch[l], ch[l], l)) for l in range(depth + 1)]
    ups = [conv(ch[l + 1], ch[l], (hs[l + 1], ws[l + 1]), k2, out=(hs[l], ws[l]), stride=2, transposed=True,
                dtype=dtype, what=what) for l in range(depth)]
    dec = [(c3(cat[l], ch[l], l), c3(ch[l], ch[l], l)) for l in range(depth)]
    head = conv(ch[0], k, (h, w), k1, out=(h, w), dtype=dtype, what=what)
    g = Builder(dtype)
    X = g.input("X", c, h, w)
    we = [(weights(g, a, f"enc{l}a"), weights(g, b, f"enc{l}b")) for l, (a, b) in enumerate(enc)]
    wu, wd = {}, {}
    for l in reversed(range(depth)):
        wu[l] = weights(g, ups[l], f"up{l}")
        wd[l] = (weights(g, dec[l][0], f"dec{l}a"), weights(g, dec[l][1], f"dec{l}b"))
    wh = weights(g, head, "out")

    def double(Y, convs, ws_):
        for cv, wts in zip(convs, ws_):
            (Y,) = call(g, cv, Y, *wts)
            Y = g.map("relu", Y)
        return Y

    skips, Y = [], X
    for l in range(depth):
        Y = double(Y, enc[l], we[l])
        skips.append(Y)
        Y = _maxpool(g, Y, ch[l], hs[l], ws[l], hs[l + 1], ws[l + 1])
    Y = double(Y, enc[depth], we[depth])
    for l in reversed(range(depth)):
        (U,) = call(g, ups[l], Y, *wu[l])
        Y = double(_concat(g, skips[l], U, ch[l], ch[l], cat[l]), dec[l], wd[l])
    (Y,) = call(g, head, Y, *wh)
    return _batched(_named_once(g.diagram(Y, names=["Y"]), what), batch, what)


def vit(c=None, h=None, w=None, patch: int = 4, d=None, heads=None, e=None, f=None, classes=None, *,
        layers: int = 1, activation: str = "gelu", eps: float = 1e-6, batch: Axis | None = None,
        dtype: DType = f32) -> Diagram:
    """A vision transformer: patch embedding (the image split into ``patch x patch`` patches, a
    convolution with stride = kernel), a class token in front, a position embedding, ``layers``
    pre-norm transformer blocks, a final layer norm and a linear head on the class token.

    Tokens ``t`` are the ``n = (h/patch)(w/patch)`` patches plus the class token (symbols ``n``
    and ``t`` when ``h``, ``w`` are symbolic).  Inputs: ``X[c h w]``, ``embed_W[d c ph pw]``,
    ``embed_bias[d]``, ``cls[one d]``, ``pos[t d]``, then each block's weights
    (``block<i>_<name>``, as :func:`transformer_block`), ``ln_gamma``, ``ln_beta``,
    ``head_W[d k]``, ``head_b[k]``."""
    what = "vit"
    c, h, w = _axis(c, "c", what), _axis(h, "h", what), _axis(w, "w", what)
    d, k = _axis(d, "d", what), _axis(classes, "k", what)
    for value, name in ((patch, "patch"), (layers, "layers")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypingError(f"{what}: {name} must be an int >= 1, got {value!r}")
    for a in (h, w):
        if not a.symbolic and a.size % patch:
            raise TypingError(f"{what}: image axis {a.describe()} is not divisible by patch={patch}")
    eps = _real(eps, f"{what} eps")
    gh, gw = (Axis(f"g{a.name}", f"g{a.name}" if a.symbolic else a.size // patch) for a in (h, w))
    concrete = not (gh.symbolic or gw.symbolic)
    n = Axis("n", gh.size * gw.size if concrete else "n")
    t = Axis("t", n.size + 1 if concrete else "t")
    ph, pw, one = Axis("ph", patch), Axis("pw", patch), Axis("one", 1)
    heads = _axis(heads, "heads", what)   # "h" is the image's height
    block = transformer_block(t, d, heads, e, f, activation=activation, eps=eps, dtype=dtype)
    ln = layernorm(t, d, eps=eps, dtype=dtype)
    g = Builder(dtype)
    X = g.input("X", c, h, w)
    We, be = g.input("embed_W", d, c, ph, pw), g.input("embed_bias", d)
    cls, pos = g.input("cls", one, d), g.input("pos", t, d)
    wb = [weights(g, block, f"block{i}") for i in range(layers)]
    wl = weights(g, ln, "ln")
    Wh, bh = g.input("head_W", d, k), g.input("head_b", k)
    P = g.box(split_box(g.ty(X), h, gh, ph), X)
    P = g.box(split_box(g.ty(P), w, gw, pw), P)
    E = g.map("add", g.contract(P, We, out=(gh, gw, d), name="E"), be, out=(gh, gw, d))
    E = g.box(merge_box(g.ty(E), gh, gw, n), E)
    T = g.map("add", g.unfold(cls, one, t), g.unfold(E, n, t, offset=-1), name="tokens")
    Z = g.map("add", T, pos, out=(t, d))
    for wts in wb:
        (Z,) = call(g, block, Z, *wts)
    (Z,) = call(g, ln, Z, *wl)
    first = g.box(slice_box(g.ty(Z), t, 0, 1, one, name="class"), Z)
    L = g.map("add", g.contract(first, Wh, out=(k,), name="logits"), bh)
    return _batched(_named_once(g.diagram(L, names=["logits"]), what), batch, what)


__all__ = ["batchnorm", "transformer_block", "resnet_block", "unet", "vit"]
