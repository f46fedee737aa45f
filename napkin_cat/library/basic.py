"""The single-layer diagrams: matmul, linear, MLP, softmax, the norms and attention.

Re-exported by :mod:`napkin_cat.library`; :mod:`.networks` wires them into whole networks.
"""

from __future__ import annotations

from ..core import Axis, Diagram, DType, axes, f32
from ..core.errors import TypingError
from ..ops import AxisPower, Builder, IndexBias, Predicate, real_number
from ..ops import causal as causal_predicate, window as window_predicate
from .variants import Binding, ScoreMod, as_mask, aux, score_mod as make_score_mod


def _opt(value, name: str):
    return None if value is None else _ax(value, name)


def _ax(value: Axis | None, name: str) -> Axis:
    if value is None:
        return Axis(name, name)
    if isinstance(value, int) and not isinstance(value, bool):
        return Axis(name, value)
    if not isinstance(value, Axis):
        raise TypingError(f"axis argument {name} must be an Axis or an int, got {value!r}")
    return value


def matmul(a: Axis | None = None, b: Axis | None = None, c: Axis | None = None,
           dtype: DType = f32) -> Diagram:
    """``C[a c] = sum_b A[a b] B[b c]``."""
    a, b, c = _ax(a, "a"), _ax(b, "b"), _ax(c, "c")
    g = Builder(dtype)
    A, B = g.input("A", a, b), g.input("B", b, c)
    return g.diagram(g.contract(A, B, out=(a, c), name="C"))


def batched_matmul(batch: Axis | None = None, a: Axis | None = None, b: Axis | None = None,
                   c: Axis | None = None, dtype: DType = f32) -> Diagram:
    """``C[n a c] = sum_b A[n a b] B[n b c]``: matmul weaved over the batch axis."""
    return matmul(a, b, c, dtype).weave(_ax(batch, "n"))


def linear(t: Axis | None = None, i: Axis | None = None, o: Axis | None = None,
           bias: bool = True, activation: str | None = "gelu", dtype: DType = f32) -> Diagram:
    """``Y[t o] = act(X[t i] W[i o] + b[o])``; ``activation=None`` for none."""
    t, i, o = _ax(t, "t"), _ax(i, "i"), _ax(o, "o")
    g = Builder(dtype)
    X, W = g.input("X", t, i), g.input("W", i, o)
    Bv = g.input("bias", o) if bias else None
    Y = g.contract(X, W, out=(t, o), name="Y")
    if Bv is not None:
        Y = g.map("add", Y, Bv, out=(t, o))
    if activation:
        Y = g.map(activation, Y)
    return g.diagram(Y, names=["Y"])


def mlp(t: Axis | None = None, d: Axis | None = None, h: Axis | None = None,
        activation: str = "gelu", dtype: DType = f32) -> Diagram:
    """Two linear layers: ``Y = act(X W1 + b1) W2 + b2``."""
    t, d, h = _ax(t, "t"), _ax(d, "d"), _ax(h, "f")
    g = Builder(dtype)
    X, W1, b1 = g.input("X", t, d), g.input("W1", d, h), g.input("b1", h)
    W2, b2 = g.input("W2", h, d), g.input("b2", d)
    H = g.map(activation, g.map("add", g.contract(X, W1, out=(t, h), name="H"), b1, out=(t, h)))
    Y = g.map("add", g.contract(H, W2, out=(t, d), name="Y"), b2, out=(t, d))
    return g.diagram(Y, names=["Y"])


def softmax(r: Axis | None = None, c: Axis | None = None, dtype: DType = f32) -> Diagram:
    """Row softmax ``P[r c] = softmax_c(X[r c])``."""
    r, c = _ax(r, "r"), _ax(c, "c")
    g = Builder(dtype)
    return g.diagram(g.softmax(g.input("X", r, c), c, name="P"))


def layernorm(t: Axis | None = None, d: Axis | None = None, eps: float = 1e-5,
              dtype: DType = f32) -> Diagram:
    """``Y = (X - mean_d X) / sqrt(var_d X + eps) * gamma + beta``."""
    t, d = _ax(t, "t"), _ax(d, "d")
    g = Builder(dtype)
    X, gamma, beta = g.input("X", t, d), g.input("gamma", d), g.input("beta", d)
    mu = g.reduce("mean", X, d, name="mu")
    xc = g.map("sub", X, mu, out=(t, d), name="xc")
    var = g.reduce("mean", g.map("square", xc), d, name="var")
    inv = g.map("rsqrt", g.map("shift", var, c=eps))
    Y = g.map("add", g.map("mul", g.map("mul", xc, inv, out=(t, d)), gamma, out=(t, d)), beta, out=(t, d))
    return g.diagram(Y, names=["Y"])


def rmsnorm(t: Axis | None = None, d: Axis | None = None, eps: float = 1e-6,
            dtype: DType = f32) -> Diagram:
    """``Y = X / sqrt(mean_d X^2 + eps) * gamma``."""
    t, d = _ax(t, "t"), _ax(d, "d")
    g = Builder(dtype)
    X, gamma = g.input("X", t, d), g.input("gamma", d)
    inv = g.map("rsqrt", g.map("shift", g.reduce("mean", g.map("square", X), d, name="ms"), c=eps))
    Y = g.map("mul", g.map("mul", X, inv, out=(t, d)), gamma, out=(t, d))
    return g.diagram(Y, names=["Y"])


def attention(q: Axis | None = None, x: Axis | None = None, d: Axis | None = None, *,
              dv: Axis | None = None, heads: Axis | None = None, batch: Axis | None = None,
              groups: Axis | None = None, causal: bool = False, window_size: int | None = None,
              mask=None, bias: str | IndexBias | None = None, score_mod=None,
              softcap: float | None = None, scale: float | None = None, logsumexp: bool = False,
              dtype: DType = f32) -> Diagram:
    """``O = softmax(Q K^T * scale + bias, masked) V``, one head, then weaved.

    ``scale`` defaults to ``1/sqrt(d)``.  ``heads`` weaves every input over a head axis;
    ``groups`` (GQA/MQA) weaves only Q over a group axis inside each key/value head, so K and V
    are shared by the group (inner broadcasting); ``batch`` weaves everything.  ``causal`` /
    ``window_size`` / ``mask`` add an index-predicate mask; ``bias="input"`` adds an input
    ``B[q x]`` (shared by heads and batch), an :class:`IndexBias` (e.g. ``alibi(0.5)``) adds a
    bias computed from indices.  ``window_size=w`` keeps keys ``i - w <= j <= i``: ``0`` keeps
    only the diagonal ``j == i``; ``None`` (default) is no window.

    Variants as data (:mod:`napkin_cat.library.variants`, the gallery in ``docs/variants.md``):
    ``mask`` may be ``nc.mask_mod(fn)`` or a function ``fn(b, h, i, j)``, ``bias`` may be
    ``nc.bias_mod(fn)``, ``score_mod`` a function ``fn(score, b, h, i, j)`` (or
    ``nc.score_mod(fn)``), ``softcap=c`` applies ``tanh(s / c) * c``.  The order is: scale, bias,
    score_mod, softcap, masks.  ``i`` / ``j`` are the query / key indices, ``b`` the batch, ``h``
    the query head (``h * size(g) + g`` with ``groups``); the :func:`~.variants.aux` tensors
    they gather from are inputs after Q, K, V (and B), in order of first use.  ``logsumexp=True`` also
    returns ``L[q] = logsumexp_x`` of the scaled, biased, masked scores (``-inf`` on a fully
    masked row): the residual FlashAttention saves for its backward
    (:func:`napkin_cat.ops.residuals.grad_with_residuals`).
    """
    if not isinstance(causal, bool):
        raise TypingError(f"attention causal must be True or False, got {causal!r}")
    if not isinstance(logsumexp, bool):
        raise TypingError(f"attention logsumexp must be True or False, got {logsumexp!r}")
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 0:
            raise TypingError(f"attention window_size must be an int >= 0 (0 keeps only the diagonal "
                              f"j == i) or None for no window, got {window_size!r}")
    if mask is not None:
        mask = as_mask(mask)
    if score_mod is not None:
        score_mod = make_score_mod(score_mod)
    if softcap is not None:
        softcap = real_number("attention softcap", softcap)
        if softcap <= 0:
            raise TypingError(f"attention softcap must be > 0 (tanh(s / c) * c), got {softcap!r}")
    if scale is not None:
        scale = real_number("attention scale", scale)
    q, x, d = _ax(q, "q"), _ax(x, "x"), _ax(d, "d")
    dv = d if dv is None else _ax(dv, "e")
    g = Builder(dtype)
    Q, K, V = g.input("Q", q, d), g.input("K", x, d), g.input("V", x, dv)
    B = g.input("B", q, x) if bias == "input" else None
    roles = Binding(g, q, x, _opt(heads, "h"), _opt(batch, "b"), _opt(groups, "g"),
                    {a.name for a in (q, x, d, dv)} | {_opt(a, n).name for a, n in
                                                       ((heads, "h"), (batch, "b"), (groups, "g")) if a is not None})
    roles.declare(bias, score_mod, mask)
    S = g.contract(Q, K, out=(q, x), name="S")
    S = g.map("scale", S, c=AxisPower(d) if scale is None else scale)
    if B is not None:
        S = g.map("add", S, B, out=(q, x))
    elif isinstance(bias, IndexBias):
        S = roles.bias(S, bias)
    elif bias is not None:
        raise TypingError(f"attention bias must be 'input' or an IndexBias (nc.alibi, nc.bias_mod), got {bias!r}")
    if score_mod is not None:
        S = roles.score_mod(S, score_mod)
    if softcap is not None:
        S = g.map("scale", g.map("tanh", g.map("scale", S, c=1.0 / softcap)), c=softcap)
    for pred in ([causal_predicate()] if causal else []) + ([window_predicate(window_size)] if window_size is not None else []) + \
            ([mask] if mask is not None else []):
        S = roles.mask(S, pred)
    P = g.softmax(S, x, name="P")
    O = g.contract(P, V, out=(q, dv), name="O")
    out = g.diagram(O, g.reduce("logsumexp", S, x, name="L"), names=["O", "L"]) if logsumexp else \
        g.diagram(O, names=["O"])
    shared = (0, 1, 2)  # the bias input, if any, is shared by groups, heads and batch
    if groups is not None:
        out = out.weave(_ax(groups, "g"), inputs=(0,))
    if heads is not None:
        out = out.weave(_ax(heads, "h"), inputs=shared)
    if batch is not None:
        out = out.weave(_ax(batch, "b"), inputs=shared)
    return out


def normalized_attention(q: Axis | None = None, x: Axis | None = None, d: Axis | None = None, *,
                         kind: str = "l2", heads: Axis | None = None, eps: float = 1e-6,
                         dtype: DType = f32) -> Diagram:
    """Attention with softmax replaced by a streamable normalisation ``a1(s)/b(sum a2(s))``.

    ``kind="l2"`` is spherical attention (``s_i / sqrt(sum s_j^2)``); see
    :data:`napkin_cat.ops.NORMALISATIONS` for the others."""
    from ..ops import NORMALISATIONS
    if kind not in NORMALISATIONS:
        raise TypingError(f"unknown normalisation {kind!r}; known: {sorted(NORMALISATIONS)}")
    q, x, d = _ax(q, "q"), _ax(x, "x"), _ax(d, "d")
    g = Builder(dtype)
    Q, K, V = g.input("Q", q, d), g.input("K", x, d), g.input("V", x, d)
    S = g.map("scale", g.contract(Q, K, out=(q, x), name="S"), c=AxisPower(d))
    a1, a2, b = NORMALISATIONS[kind]
    P = g.normalize(S, x, a1, a2, b, name="P", eps=eps)
    out = g.diagram(g.contract(P, V, out=(q, d), name="O"), names=["O"])
    return out.weave(_ax(heads, "h")) if heads is not None else out


def multihead_attention(q=None, x=None, d=None, h=None, **kw) -> Diagram:
    return attention(q, x, d, heads=_ax(h, "h"), **kw)


__all__ = ["matmul", "batched_matmul", "linear", "mlp", "softmax", "layernorm", "rmsnorm",
           "attention", "multihead_attention", "normalized_attention"]
