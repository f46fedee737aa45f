"""The gallery of attention variants (``docs/variants.md``), each with an independent reference.

Every entry builds an attention diagram from a variant written as data (``nc.mask_mod``,
``nc.score_mod``, ``nc.bias_mod``, ``nc.aux`` gathers) and carries a *reference*: the same
variant written directly in NumPy on index grids, not through napkin_cat's index expressions.
``tests/test_variants.py`` checks the diagram's meaning, its tiled execution and (slow tier) its
generated kernel under the simulator against it; ``python -m napkin_cat.drawing.variants``
redraws the gallery.  ``kernels/variants.py`` times the same entries on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..core import Axis
from ..ops import bias_mod, block_table, blocked, ix, mask_mod
from . import attention
from .variants import aux, score_mod


@dataclass(frozen=True)
class Variant:
    """``build(q, x, d, heads, batch, groups, n) -> (attention keyword arguments)``;
    ``reference(s, b, h, i, j, aux) -> modified scores`` (``-inf`` where masked) on broadcast
    NumPy index grids (``h`` the query head); ``aux(n_tokens, heads, batch, rng)`` the
    auxiliary arrays by name; ``code``: the variant as a user writes it (shown in the docs)."""

    name: str
    doc: str
    code: str
    build: Callable
    reference: Callable
    aux: Callable = field(default=lambda n, heads, batch, rng: {})
    block_sparse: bool = False      # the derived support skips tiles (a block table's data: when it runs)


def _tok(n):
    return Axis("n", n)


def _ids(n):
    # three documents of uneven length
    return np.repeat(np.arange(3), [n // 3, n // 2, n - n // 3 - n // 2]).astype(np.float32)


def _batch_doc_mask(n, B):
    doc = aux("doc", Axis("nb", B), _tok(n))
    return mask_mod(lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (j <= i))


def _batch_doc_aux(n, batch, rng):
    """Each sequence its own documents (ids), and the block table of each."""
    ids = np.cumsum(rng.random((batch, n)) < np.linspace(0.15, 0.4, batch)[:, None], axis=1).astype(np.float32)
    return {"doc": ids, "bt": block_table(_batch_doc_mask(n, batch), n, n, BLK, BLK, {"doc": ids}, batch=batch)}


def _head_window_mask(H):
    w = aux("w", Axis("nh", H))
    return mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= w[h]))


def _head_window_aux(n, heads, rng):
    """A window width of each query head (0 to n), and the block table of each."""
    widths = rng.integers(0, n + 1, heads).astype(np.float32)
    return {"w": widths, "bt": block_table(_head_window_mask(heads), n, n, BLK, BLK, {"w": widths}, heads=heads)}


W, P, BLK, CAP = 3, 4, 4, 2.0   # window, prefix length, block, soft-cap (tiny shapes)
IMG, NB = 4, 1                  # NATTEN: image width, neighbourhood radius

GALLERY: tuple[Variant, ...] = (
    Variant("causal", "keys up to the query", "mask_mod(lambda b, h, i, j: j <= i)",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: j <= i)),
            lambda s, b, h, i, j, a: np.where(j <= i, s, -np.inf), block_sparse=True),
    Variant("sliding_window", f"causal, at most {W} keys back",
            f"mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= {W}))",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= W))),
            lambda s, b, h, i, j, a: np.where((j <= i) & (i - j <= W), s, -np.inf), block_sparse=True),
    Variant("window_0", "a window of size 0: each query sees only its own key (j == i)",
            "attention(..., window_size=0)",
            lambda n: dict(window_size=0),
            lambda s, b, h, i, j, a: np.where(j == i, s, -np.inf), block_sparse=True),
    Variant("prefix_lm", f"bidirectional over a prefix of {P} tokens, causal after",
            f"mask_mod(lambda b, h, i, j: (j <= i) | (j < {P}))",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: (j <= i) | (j < P))),
            lambda s, b, h, i, j, a: np.where((j <= i) | (j < P), s, -np.inf), block_sparse=True),
    Variant("block_diagonal", f"independent blocks of {BLK} tokens",
            f"mask_mod(lambda b, h, i, j: i // {BLK} == j // {BLK})",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: i // BLK == j // BLK)),
            lambda s, b, h, i, j, a: np.where(i // BLK == j // BLK, s, -np.inf), block_sparse=True),
    Variant("block_causal", f"causal over blocks of {BLK}: each block sees itself whole and every earlier block "
            "(chunked prefill)", f"mask_mod(lambda b, h, i, j: i // {BLK} >= j // {BLK})",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: i // BLK >= j // BLK)),
            lambda s, b, h, i, j, a: np.where(i // BLK >= j // BLK, s, -np.inf), block_sparse=True),
    Variant("natten", f"2-D neighbourhood attention (NATTEN): tokens are the pixels of an image {IMG} wide, "
            f"row by row; each sees the pixels at most {NB} away in both directions",
            f"mask_mod(lambda b, h, i, j: (abs(i // {IMG} - j // {IMG}) <= {NB}) & (abs(i % {IMG} - j % {IMG}) <= {NB}))",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: (abs(i // IMG - j // IMG) <= NB)
                                         & (abs(i % IMG - j % IMG) <= NB))),
            lambda s, b, h, i, j, a: np.where((np.abs(i // IMG - j // IMG) <= NB) & (np.abs(i % IMG - j % IMG) <= NB),
                                              s, -np.inf), block_sparse=True),
    Variant("document", "packed documents (ids in an auxiliary tensor), causal inside each",
            "doc = aux('doc', n)\nmask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))",
            lambda n: dict(mask=(lambda doc: mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)))(
                aux("doc", _tok(n)))),
            lambda s, b, h, i, j, a: np.where((a["doc"][i] == a["doc"][j]) & (j <= i), s, -np.inf),
            lambda n, heads, batch, rng: {"doc": _ids(n)}, block_sparse=True),
    Variant("batch_documents", "documents packed differently in each sequence of the batch, causal inside "
            f"each, a block table of {BLK} x {BLK} per sequence",
            "doc, bt = aux('doc', nb, n), aux('bt', nb, rb, cb)\n"
            "m = mask_mod(lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (j <= i))\n"
            f"blocked(m, bt, {BLK}, {BLK})  # bt = block_table(m, n, n, {BLK}, {BLK}, {{'doc': ids}}, batch=nb)",
            lambda n, B=2: dict(mask=blocked(_batch_doc_mask(n, B), aux("bt", Axis("nb", B), Axis("rb", -(-n // BLK)),
                                                                        Axis("cb", -(-n // BLK))), BLK, BLK)),
            lambda s, b, h, i, j, a: np.where((a["doc"][b, i] == a["doc"][b, j]) & (j <= i), s, -np.inf),
            lambda n, heads, batch, rng: _batch_doc_aux(n, batch, rng), block_sparse=True),
    Variant("head_windows", "each query head its own causal window (widths in an auxiliary tensor), a block "
            f"table of {BLK} x {BLK} per query head (under grouped-query heads the query head is h * G + g)",
            "w, bt = aux('w', nh), aux('bt', nh, rb, cb)\n"
            "m = mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= w[h]))\n"
            f"blocked(m, bt, {BLK}, {BLK})  # bt = block_table(m, n, n, {BLK}, {BLK}, {{'w': widths}}, heads=nh)",
            lambda n, H=4: dict(mask=blocked(_head_window_mask(H), aux("bt", Axis("nh", H), Axis("rb", -(-n // BLK)),
                                                                       Axis("cb", -(-n // BLK))), BLK, BLK)),
            lambda s, b, h, i, j, a: np.where((j <= i) & (i - j <= a["w"][h]), s, -np.inf),
            lambda n, heads, batch, rng: _head_window_aux(n, heads, rng), block_sparse=True),
    Variant("relative_bias", "score + (i - j) / 4", "score_mod(lambda s, b, h, i, j: s + (i - j) / 4)",
            lambda n: dict(score_mod=score_mod(lambda s, b, h, i, j: s + (i - j) / 4)),
            lambda s, b, h, i, j, a: s + (i - j) / 4),
    Variant("alibi_per_head", "ALiBi with the slope of each query head, 2^(-8 (h + 1) / H)",
            "score_mod(lambda s, b, h, i, j: s + ix.exp2(-(h + 1) * 8.0 / H) * (j - i))",
            lambda n, H=4: dict(score_mod=score_mod(lambda s, b, h, i, j: s + ix.exp2(-(h + 1) * 8.0 / H) * (j - i)),
                                causal=True),
            lambda s, b, h, i, j, a, H=4: np.where(j <= i, s + 2.0 ** (-(h + 1) * 8.0 / H) * (j - i), -np.inf),
            block_sparse=True),
    Variant("softcap", f"soft-capping tanh(s / {CAP}) * {CAP}, causal", f"attention(..., softcap={CAP}, causal=True)",
            lambda n: dict(softcap=CAP, causal=True),
            lambda s, b, h, i, j, a: np.where(j <= i, np.tanh(s / CAP) * CAP, -np.inf), block_sparse=True),
    Variant("gathered_biases", "per-batch, per-head and per-key biases from auxiliary tensors",
            "bb, hb, tb = aux('bb', nb), aux('hb', nh), aux('tb', n)\n"
            "bias_mod(lambda b, h, i, j: bb[b] + hb[h] + tb[j])",
            lambda n, H=4, B=2: dict(bias=(lambda bb, hb, tb: bias_mod(lambda b, h, i, j: bb[b] + hb[h] + tb[j]))(
                aux("bb", Axis("nb", B)), aux("hb", Axis("nh", H)), aux("tb", _tok(n)))),
            lambda s, b, h, i, j, a: s + a["bb"][b] + a["hb"][h] + a["tb"][j],
            lambda n, heads, batch, rng: {"bb": rng.standard_normal(batch).astype(np.float32),
                                          "hb": rng.standard_normal(heads).astype(np.float32),
                                          "tb": rng.standard_normal(n).astype(np.float32)}),
    Variant("dilated", "causal, every other key (bitwise: (i ^ j) & 1 == 0)",
            "mask_mod(lambda b, h, i, j: (j <= i) & (((i ^ j) & 1) == 0))",
            lambda n: dict(mask=mask_mod(lambda b, h, i, j: (j <= i) & (((i ^ j) & 1) == 0))),
            lambda s, b, h, i, j, a: np.where((j <= i) & (((i ^ j) & 1) == 0), s, -np.inf), block_sparse=True),
    Variant("block_mask", f"an explicit block mask over blocks of {BLK} x {BLK} (FlashAttention's block-sparse)",
            f"bm = aux('bm', rb, cb)\nmask_mod(lambda b, h, i, j: bm[i // {BLK}, j // {BLK}] > 0)",
            lambda n: dict(mask=(lambda bm: mask_mod(lambda b, h, i, j: bm[i // BLK, j // BLK] > 0))(
                aux("bm", Axis("rb", -(-n // BLK)), Axis("cb", -(-n // BLK))))),
            lambda s, b, h, i, j, a: np.where(a["bm"][i // BLK, j // BLK] > 0, s, -np.inf),
            lambda n, heads, batch, rng: {"bm": (rng.random((-(-n // BLK),) * 2) < 0.5).astype(np.float32)}),
)


def build(v: Variant, q, x, d, n: int, heads=None, batch=None, groups=None, **kw):
    return attention(q=q, x=x, d=d, heads=heads, batch=batch, groups=groups, **v.build(n), **kw)


def reference_attention(v: Variant, Q, K, V, aux_arrays: dict, scale: float):
    """Attention with the variant's reference scores: ``Q[b kvh g q d]``, ``K, V[b kvh x d]``
    (``g`` the groups of a key/value head; the query head is ``kvh * G + g``), in float64."""
    Bn, Hn, G, N, _ = Q.shape
    X = K.shape[2]
    s = np.einsum("bhgqd,bhxd->bhgqx", Q.astype(np.float64), K.astype(np.float64)) * scale
    b, hk, g, i, j = np.meshgrid(np.arange(Bn), np.arange(Hn), np.arange(G), np.arange(N), np.arange(X),
                                 indexing="ij")
    s = v.reference(s, b, hk * G + g, i, j, {k: np.asarray(a, np.float64) for k, a in aux_arrays.items()})
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    p = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    return np.einsum("bhgqx,bhxd->bhgqd", p, V.astype(np.float64))
