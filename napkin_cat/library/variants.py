"""Attention variants as data: index functions bound to an attention diagram's axes.

A variant is written over the roles ``score, b, h, i, j`` (FlexAttention's ``score_mod`` /
``mask_mod`` signature) and traced once (:mod:`napkin_cat.ops.index_expr`).  Here the roles
become the diagram's axes (``i`` the query axis, ``j`` the key axis, ``b`` the batch axis, ``h``
the query head: ``h * size(g) + g`` under grouped-query attention), the auxiliary tensors become
inputs of the diagram, and a score modification becomes boxes the rest of the pipeline already
knows: a score-free term added to the score is an ``index_bias`` box, ``where(cond, s, -inf)``
a ``mask`` box, a unary function or a constant scale a ``map`` box.  What has no such form (the
score times an index-dependent value, say) is one ``index_map`` box (:mod:`napkin_cat.ops.aux_grad`),
which evaluates, lowers and differentiates (its auxiliary tensors included) from the expression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core import Axis
from ..core.types import DType, f32
from ..core.errors import TypingError
from ..ops import IndexBias, Predicate
from ..ops.aux_grad import index_map_box
from ..ops.index_expr import Aux, Ix, TraceError, lift, trace


@dataclass(frozen=True)
class ScoreMod:
    """A score modification ``fn(score, b, h, i, j)``, traced: :func:`score_mod`."""

    expr: Ix

    def __repr__(self) -> str:
        return f"score_mod({str(self.expr)!r})"


def score_mod(fn) -> ScoreMod:
    """Trace ``fn(score, b, h, i, j) -> new score`` (FlexAttention's ``score_mod``).

    >>> import napkin_cat as nc
    >>> nc.score_mod(lambda s, b, h, i, j: nc.ix.tanh(s / 30.0) * 30.0)
    score_mod('tanh(score / 30.0) * 30.0')
    """
    if isinstance(fn, ScoreMod):
        return fn
    e = trace(fn, "score")
    if not e.uses_score():
        raise TraceError(f"a score_mod that ignores the score ({e}) replaces every score; add it "
                         f"to the score (a bias) or mask with nc.mask_mod")
    return ScoreMod(e)


def aux(name: str, *axes_: Axis, dtype: DType | None = None) -> Aux:
    """An auxiliary tensor over ``axes`` that index functions gather from (``doc[i]``,
    ``slope[h]``); it becomes an input of the attention diagram named ``name``, after Q, K, V
    (and B), in order of first use.  Its axes must differ from the attention's own axes.

    ``dtype``: its element type in the diagram (and the kernel).  Left out, it is the
    attention's, except for a tensor whose values meet a comparison (document ids in
    ``doc[i] == doc[j]``): that one is ``f32``, exact for integers up to 2**24, where a 16-bit
    copy would merge ids above 2048 (f16) or 256 (bf16) and attend across documents.

    >>> import napkin_cat as nc
    >>> q, x, d, n = nc.axes("q x d n")
    >>> doc = nc.aux("doc", n)
    >>> m = nc.mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))
    >>> att = nc.library.attention(q=q, x=x, d=d, mask=m, dtype=nc.bf16)
    >>> [(a.name, a.dtype.name) for a in att.dom]
    [('Q', 'bf16'), ('K', 'bf16'), ('V', 'bf16'), ('doc', 'f32')]
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise TypingError(f"aux name must be an identifier, got {name!r}")
    if not axes_:
        raise TypingError(f"aux {name}: needs at least one axis")
    for a in axes_:
        if not isinstance(a, Axis):
            raise TypingError(f"aux {name}: axes must be nc.Axis values, got {a!r}")
    if dtype is not None and not isinstance(dtype, DType):
        raise TypingError(f"aux {name}: dtype must be one of nc.f32, nc.f16, nc.bf16, ..., got {dtype!r}")
    return Aux(name, tuple(axes_), dtype)


class Binding:
    """The roles of one attention diagram: role -> index expression over its axes, and the
    wires of the auxiliary tensors (created on first use)."""

    def __init__(self, g, q: Axis, x: Axis, heads, batch, groups, taken: set[str]):
        self.g, self.q, self.x = g, q, x
        idx = lambda a: Ix("idx", (), a.name)
        self.roles = {"i": idx(q), "j": idx(x)}
        if batch is not None:
            self.roles["b"] = idx(batch)
        if heads is not None and groups is not None:
            self.roles["h"] = idx(heads) * Ix("size", (), groups.name) + idx(groups)
        elif heads is not None or groups is not None:
            self.roles["h"] = idx(heads if heads is not None else groups)
        self.taken = taken
        self.exact: set[str] = set()   # auxes compared: read as f32 (:func:`aux`)
        self.aux: dict[str, tuple[Aux, object]] = {}

    def declare(self, *fns) -> None:
        """Declare the auxiliary inputs of the variants ``fns`` (a Builder takes its inputs
        before its first operation)."""
        exprs = [e for e in (getattr(f, "expr", None) for f in fns) if isinstance(e, Ix)]
        self.exact = {n for e in exprs for n in e.compared_auxes()}
        for e in exprs:
            self.wires(e)

    def bind(self, e: Ix, what: str) -> Ix:
        for role in e.leaves("idx"):
            if role != "score" and role not in self.roles:
                axis = {"b": "batch", "h": "heads (or groups)"}.get(role, role)
                raise TypingError(f"attention {what} reads the index {role}, but the attention has no "
                                  f"{axis} axis: pass {axis.split(' ')[0]}=...")
        return e.subst({k: v for k, v in self.roles.items()})

    def wires(self, e: Ix) -> list:
        out = []
        for a in e.auxes():
            if a.name in self.aux:
                if self.aux[a.name][0] != a:
                    raise TypingError(f"attention: two auxiliary tensors are named {a.name!r} "
                                      f"({self.aux[a.name][0]!r} and {a!r})")
            else:
                for ax in a.axes:
                    if ax.name in self.taken:
                        raise TypingError(f"attention: auxiliary tensor {a!r} uses axis {ax.name}, an axis "
                                          f"of the attention itself; give it its own axis (its values are "
                                          f"gathered by index, never tiled or streamed)")
                dtype = a.dtype or (f32 if a.name in self.exact else None)
                self.aux[a.name] = (a, self.g.input(a.name, *a.axes, dtype=dtype))
            out.append(self.aux[a.name][1])
        return out

    # ---- the three kinds of variant
    def mask(self, S, pred: Predicate):
        if pred.kind != "expr":
            return self.g.mask(S, self.q, self.x, pred)
        e = self.bind(pred.expr, "mask")
        return self.g.mask(S, self.q, self.x, Predicate("expr", (e, self.q.name, self.x.name)), *self.wires(e))

    def bias(self, S, bias: IndexBias):
        if bias.kind != "expr":
            return self.g.index_bias(S, self.q, self.x, bias)
        e = self.bind(bias.expr, "bias")
        return self._add(S, e)

    def _add(self, S, e: Ix):
        if e.op == "const":
            return self.g.map("shift", S, c=float(e.value))
        return self.g.index_bias(S, self.q, self.x, IndexBias("expr", (e, self.q.name, self.x.name)),
                                 *self.wires(e))

    def score_mod(self, S, mod: ScoreMod):
        return self._build(S, self.bind(mod.expr, "score_mod"), mod.expr)

    def _build(self, S, e: Ix, whole: Ix):
        g, op, a = self.g, e.op, e.args
        if op == "idx" and e.value == "score":
            return S
        if op in ("add", "sub"):
            x, y = a
            if op == "add" and not x.uses_score():
                x, y = y, x
            if not y.uses_score():
                return self._add(self._build(S, x, whole), y if op == "add" else -y)
            if not x.uses_score():          # c - f(score)
                return self._add(g.map("neg", self._build(S, y, whole)), x)
            return g.map(op, self._build(S, x, whole), self._build(S, y, whole))
        if op in ("mul", "truediv"):
            x, y = a
            if op == "mul" and not x.uses_score():
                x, y = y, x
            if y.op == "const" and y.dtype != "bool":
                c = float(y.value)
                if op == "truediv":
                    if c == 0:
                        raise TypingError(f"score_mod {whole}: division by the constant 0")
                    c = 1.0 / c
                return g.map("scale", self._build(S, x, whole), c=c)
            if x.uses_score() and y.uses_score():
                return g.map("mul" if op == "mul" else "div", self._build(S, x, whole), self._build(S, y, whole))
            return self._index_map(S, e)   # the score times an index-dependent value
        if op == "neg":
            return g.map("neg", self._build(S, a[0], whole))
        if op == "fn":
            return g.map(e.value, self._build(S, a[0], whole))
        if op == "exp2":
            return g.map("exp", g.map("scale", self._build(S, a[0], whole), c=math.log(2.0)))
        if op == "log2":
            return g.map("scale", g.map("log", self._build(S, a[0], whole)), c=1.0 / math.log(2.0))
        if op == "where":
            cond, x, y = a
            if not cond.uses_score():
                if _neg_inf(y):
                    return self._mask_expr(self._build(S, x, whole), cond)
                if _neg_inf(x):
                    return self._mask_expr(self._build(S, y, whole), ~cond)
        return self._index_map(S, e)

    def _index_map(self, S, e: Ix):
        """``e`` (its score leaf ``S``) as one ``index_map`` box: a score modification that is
        no chain of known boxes (``score * s[h]``, ``cap[h] * tanh(score / cap[h])``)."""
        aux = self.wires(e)
        box = index_map_box(self.g.ty(S), self.q, self.x, e, [self.g.ty(w) for w in aux])
        return self.g.box(box, S, *aux)

    def _mask_expr(self, S, cond: Ix):
        return self.g.mask(S, self.q, self.x, Predicate("expr", (cond, self.q.name, self.x.name)), *self.wires(cond))


def _neg_inf(e: Ix) -> bool:
    return e.op == "const" and isinstance(e.value, float) and e.value == -math.inf


def as_mask(mask) -> Predicate:
    """``mask`` as a Predicate: a Predicate, or a callable ``fn(b, h, i, j)`` traced."""
    if isinstance(mask, Predicate):
        return mask
    if callable(mask) and not isinstance(mask, (Ix, Aux)):
        from ..ops.index import mask_mod
        return mask_mod(mask)
    raise TypingError(f"attention mask must be a Predicate (nc.causal(), nc.window(n), nc.mask_mod(fn), "
                      f"nc.predicate(fn)) or a function fn(b, h, i, j), got {mask!r}; for a causal mask "
                      f"pass causal=True")


__all__ = ["ScoreMod", "score_mod", "aux", "Binding", "as_mask", "lift"]
