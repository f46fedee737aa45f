"""torch's functions on traced index expressions, as FlexAttention's examples write them.

A ``score_mod`` or ``mask_mod`` written for FlexAttention calls torch on its arguments:
``torch.where(q_idx >= kv_idx, score, -float("inf"))``, ``softcap * torch.tanh(score / softcap)``,
``torch.clamp(q_idx - kv_idx, -R, R)``.  While it is traced those arguments are
:class:`~.index_expr.Ix` nodes, which torch treats as tensor-like objects: it hands each such call
to ``Ix.__torch_function__``, and :func:`torch_call` maps it onto the index vocabulary (``nc.ix``
and the operators), so the traced definition is the one every interpretation reads.  A torch
function outside that vocabulary, a captured tensor meeting a traced index (``alibi_bias[h]``:
declare it with ``nc.aux``) and an argument whose meaning differs (``rounding_mode="trunc"``,
``torch.fmod``) are refused by name.

>>> import torch
>>> from napkin_cat.ops.index_expr import Ix
>>> s, i, j = (Ix("idx", (), n) for n in ("score", "i", "j"))
>>> print(torch.where(i >= j, s, -float("inf")))
where(i >= j, score, -inf)
>>> print(20.0 * torch.tanh(s / 20.0))
20.0 * tanh(score / 20.0)
>>> print(torch.clamp(i - j, -4, 4))
min(max(i - j, -4), 4)
>>> print(s.tanh() + (i - j).remainder(4))
tanh(score) + ((i - j) % 4)
"""

from __future__ import annotations

import operator

from ..core.errors import TraceError

_UNARY = {"exp": "exp", "log": "log", "relu": "relu", "rsqrt": "rsqrt", "sigmoid": "sigmoid", "sign": "sign",
          "sqrt": "sqrt", "square": "square", "tanh": "tanh", "reciprocal": "recip"}
"""torch's name -> the elementwise function (:data:`~.functions.FUNCTIONS`) of the same meaning."""


def _refused(why: str):
    raise TraceError(why)


def _where(V, condition, input=None, other=None):  # noqa: A002 (torch's names)
    if input is None or other is None:
        _refused("torch.where(condition) with one argument gives indices, not values: "
                 "write torch.where(condition, input, other)")
    return V.ix.where(condition, input, other)


def _two(name):
    """A binary min or max: torch.min / torch.max of one tensor reduce it, which a trace cannot."""
    def rule(V, input, other=None, *rest, **kw):  # noqa: A002
        if rest or kw or not isinstance(other, type(V.lift(0))):   # torch.max(x, 1): along dim 1
            _refused(f"torch.{name} of one tensor (or along a dim) reduces it; a trace takes the "
                     f"elementwise form torch.{name}(a, b) or torch.{name}imum(a, b)")
        return getattr(V.ix, f"{name}imum")(input, other)
    return rule


def _div(V, input, other, rounding_mode=None):  # noqa: A002
    if rounding_mode is None:
        return V.lift(input) / other
    if rounding_mode == "floor":
        return V.lift(input) // other
    _refused(f"torch.div(..., rounding_mode={rounding_mode!r}) rounds toward zero, which the index "
             f"vocabulary does not: write // (floor division, as torch.div(..., rounding_mode='floor'))")


def _scaled(sign: int):
    def rule(V, input, other, alpha=1):  # noqa: A002
        b = V.lift(other) if alpha == 1 else V.lift(other) * alpha
        return V.lift(input) + b if sign > 0 else V.lift(input) - b
    return rule


def _logical(op: str):
    def as_bool(V, v):
        v = V.lift(v)
        return v if v.dtype == "bool" else v != 0
    if op == "not":
        return lambda V, input: ~as_bool(V, input)  # noqa: A002
    ops = {"and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b}
    return lambda V, input, other: ops[op](as_bool(V, input), as_bool(V, other))  # noqa: A002


def _like(fill):
    """``torch.zeros_like`` / ``ones_like`` / ``full_like``: a constant, in the operand's kind."""
    def rule(V, input, *value, **kw):  # noqa: A002
        v = value[0] if value else kw.pop("fill_value", fill)
        if kw:
            _refused(f"torch.*_like's {sorted(kw)}: a traced constant takes its kind from the operand")
        kind = V.lift(input).dtype
        return V.lift(bool(v) if kind == "bool" else int(v) if kind == "int" and float(v).is_integer() else float(v))
    return rule


def _captured(name: str):
    def rule(V, *args, **kw):
        _refused(f"a captured torch tensor meets a traced index ({name}): declare the tensor with "
                 f"nc.aux(name, *axes), index that (alibi[h], doc[i]), and pass its values as an "
                 f"input of the diagram")
    return rule


def _binary(fn):
    return lambda V, input, other: fn(V.lift(input), other)  # noqa: A002


def _new(value):
    """``b.new_ones((), dtype=torch.bool)`` / ``new_zeros``, as FlexAttention's ``and_masks`` /
    ``or_masks`` start: a scalar constant (:func:`new_constant`)."""
    return lambda V, like, size=(), dtype=None, **kw: new_constant(like, value, size, dtype, kw, V.lift)


_RULES = {
    **{t: (lambda f: lambda V, input: getattr(V.ix, f)(input))(f) for t, f in _UNARY.items()},  # noqa: A002
    "abs": lambda V, input: abs(V.lift(input)), "neg": lambda V, input: -V.lift(input),  # noqa: A002
    "exp2": lambda V, input: V.ix.exp2(input), "log2": lambda V, input: V.ix.log2(input),  # noqa: A002
    "where": _where,
    "clamp": lambda V, input, min=None, max=None: V.lift(input).clamp(min, max),  # noqa: A002
    "minimum": lambda V, input, other: V.ix.minimum(input, other),  # noqa: A002
    "maximum": lambda V, input, other: V.ix.maximum(input, other),  # noqa: A002
    "min": _two("min"), "max": _two("max"),
    "add": _scaled(1), "sub": _scaled(-1), "div": _div,
    **{name: _binary(fn) for name, fn in (
        ("mul", operator.mul), ("true_divide", operator.truediv), ("floor_divide", operator.floordiv),
        ("remainder", operator.mod), ("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt),
        ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge), ("bitwise_and", operator.and_),
        ("bitwise_or", operator.or_), ("bitwise_xor", operator.xor))},
    "bitwise_not": lambda V, input: ~V.lift(input),  # noqa: A002
    "fmod": lambda V, *a, **k: _refused("torch.fmod takes the dividend's sign, % (torch.remainder) the "
                                        "divisor's, as the index vocabulary does: write % or torch.remainder"),
    "logical_and": _logical("and"), "logical_or": _logical("or"), "logical_xor": _logical("xor"),
    "logical_not": _logical("not"),
    "zeros_like": _like(0), "ones_like": _like(1), "full_like": _like(None),
    "new_ones": _new(1), "new_zeros": _new(0),
    "__getitem__": _captured("indexing"),
    **{f"__{op}__": _captured(f"__{op}__") for op in (
        "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod",
        "rmod", "and", "rand", "or", "ror", "xor", "rxor", "lt", "le", "gt", "ge", "eq", "ne", "pow", "rpow")},
}
_RULES.update({alias: _RULES[name] for alias, name in (
    ("absolute", "abs"), ("negative", "neg"), ("clip", "clamp"), ("subtract", "sub"), ("multiply", "mul"),
    ("divide", "div"), ("not_equal", "ne"), ("less", "lt"), ("less_equal", "le"), ("greater", "gt"),
    ("greater_equal", "ge"))})
"""torch's function name -> ``rule(V, *args, **kwargs)``, the traced expression it builds from the
vocabulary ``V`` (``V.lift``, ``V.ix``); ``Tensor`` methods and operators meeting a traced index
are a captured tensor (:func:`_captured`)."""


def new_constant(like, value, size, dtype, kw: dict, lift):
    """``like.new_ones(size, dtype=...)`` / ``new_zeros``: a scalar constant, a condition where
    ``dtype`` is ``torch.bool``, else of ``like``'s kind (``dtype`` a floating type: a float)."""
    if kw or tuple(size) != ():
        _refused(f"new_ones / new_zeros of size {tuple(size)} {sorted(kw) or ''}: a traced value is a scalar "
                 f"(size ()), its device and layout the kernel's")
    if dtype is not None and str(dtype) == "torch.bool":
        return lift(bool(value))
    if dtype is not None and getattr(dtype, "is_floating_point", False) or lift(like).dtype == "float":
        return lift(float(value))
    return lift(int(value)) if lift(like).dtype == "int" else lift(bool(value))


def tensor_method(self, name: str, lift, ix):
    """``self.<name>``, a ``torch.Tensor`` method of the vocabulary (``score.tanh()``,
    ``(q_idx - kv_idx).remainder(4)``, ``score.where(cond, other)``), as a bound function; an
    ``AttributeError`` for any other name."""
    rule = None if name.startswith("_") or name in _NOT_METHODS else _RULES.get(name)
    if name == "where":
        return lambda condition, other: ix.where(condition, self, other)
    if rule is None:
        raise AttributeError(name if name.startswith("_") else
                             f"a traced index expression has no method {name!r}; torch's methods it follows: "
                             f"{', '.join(sorted(n for n in _RULES if not n.startswith('_') and n not in _NOT_METHODS))}")
    return lambda *args, **kwargs: rule(_Vocabulary(lift, ix), self, *args, **kwargs)


_NOT_METHODS = frozenset({"zeros_like", "ones_like", "full_like", "fmod"})


class _Vocabulary:
    def __init__(self, lift, ix):
        self.lift, self.ix = lift, ix


def torch_call(func, args: tuple, kwargs: dict, lift, ix):
    """What ``func(*args, **kwargs)`` means on traced index expressions (module docstring), built
    with ``lift`` (a number as an expression) and ``ix`` (the vocabulary, ``nc.ix``)."""
    name = getattr(func, "__name__", repr(func))
    rule = _RULES.get(name)
    if rule is None:
        names = sorted(n for n in _RULES if not n.startswith("__"))
        _refused(f"torch.{name} is not in the index vocabulary a trace follows; it follows "
                 f"{', '.join(names)} (and nc.ix.<fn>)")
    try:
        return rule(_Vocabulary(lift, ix), *args, **kwargs)
    except TypeError as e:
        raise TraceError(f"torch.{name} with arguments {args} {kwargs or ''}: {e}") from None
