"""Elementwise functions: one entry each, read by every interpretation.

A :class:`Function` says everything any stage needs to know about ``exp`` or ``silu``:

``arity``     1 or 2 (``scale`` and ``shift`` are unary and take a constant ``c``);
``array``     its meaning, written once over an array namespace ``xp`` (:mod:`.arrays`): the
              NumPy oracle and the torch function both call it;
``unit``      what it costs (:mod:`napkin_cat.costmodel`): ``"fma"`` (one CUDA-core op),
              ``"exp"`` (the special-function unit) or ``"free"``;
``cuda``      its numba.cuda expression (:mod:`napkin_cat.lowering`): ``{a}``, ``{b}`` are the
              arguments, ``{c}`` the constant, ``{ONE}`` etc. named float32 constants
              (:data:`CUDA_CONSTANTS`), registered in order of appearance;
``keeps_neg_inf``  ``f(-inf, ...) == -inf`` and ``f`` is increasing in its first argument, so a
              masked score stays masked through it (read by the chunk-skipping analysis);
              a callable of the constant ``c`` (``scale`` keeps it only for ``c > 0``);
``zero_at_neg_inf``  ``f(-inf) == 0`` exactly (``exp``): a masked score becomes a weight of 0;
``keeps_zero``  the arguments at which an exact 0 gives an exact 0, the others finite (``mul``:
              both, ``scale``: its one): a zero weight stays zero through it.  With
              ``zero_at_neg_inf`` this lets a sum over a streamed axis skip the chunks a mask
              removes (:mod:`napkin_cat.relabel.skipping`);
``derivative``  its vector-Jacobian product, read by :mod:`.grad`:
              ``derivative(t, g, y, *args, c)`` returns one cotangent per argument (None: zero),
              given the output cotangent ``g``, the output ``y = f(*args)`` and the arguments,
              as wires of the tracer ``t``; ``t(name, *wires, c=None)`` applies another entry of
              this table, so ``f'`` is a small composition of functions (``exp``: ``g * y``).
              The cotangents may carry more axes than their argument (a broadcast argument):
              the map rule sums them out.  Subgradients are torch's (``relu'(0) = 0``, ``sign' = 0``,
              ``abs'(0) = 0``, ties of ``maximum`` share the cotangent equally).

Adding a function is one entry in :data:`FUNCTIONS`; ``tests/test_kinds.py`` fails by name
when an interpretation cannot render it.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Callable


def _never(c=None) -> bool:
    return False


def _always(c=None) -> bool:
    return True


@dataclass(frozen=True)
class Function:
    name: str
    arity: int
    unit: str
    array: Callable
    cuda: str
    constant: bool = False
    keeps_neg_inf: Callable = _never
    derivative: Callable | None = None
    zero_at_neg_inf: bool = False
    keeps_zero: tuple = ()

    def __post_init__(self):
        if self.unit not in ("fma", "exp", "free"):
            raise ValueError(f"function {self.name}: unit must be fma, exp or free, got {self.unit!r}")
        fields = {f for _, f, _, _ in string.Formatter().parse(self.cuda) if f}
        allowed = {"a", "b", "c"} | set(CUDA_CONSTANTS)
        if not fields <= allowed:
            raise ValueError(f"function {self.name}: unknown fields {sorted(fields - allowed)} in {self.cuda!r}")

    def __call__(self, xp, *args, c=None):
        """The function on arrays of namespace ``xp`` (NumPy or torch)."""
        return self.array(xp, *args, c) if self.constant else self.array(xp, *args)

    def cuda_constants(self) -> list[str]:
        """Names of the float32 constants the CUDA template reads, in order of appearance."""
        out: list[str] = []
        for _, f, _, _ in string.Formatter().parse(self.cuda):
            if f in CUDA_CONSTANTS and f not in out:
                out.append(f)
        return out


CUDA_CONSTANTS = {"ONE": 1.0, "ZERO": 0.0, "HALF": 0.5, "INV_SQRT2": 1 / math.sqrt(2.0),
                  "INV_SQRT_2PI": 1 / math.sqrt(2.0 * math.pi)}

# sigmoid / silu: exp of a non-positive argument only, so no overflow (the simulator's math.exp
# raises where a GPU gives inf); NaN propagates (docs/NAN_POLICY.md)
_SIGMOID = "({ONE} / ({ONE} + math.exp(-{a})) if {a} >= {ZERO} else math.exp({a}) / ({ONE} + math.exp({a})))"
_SILU = "({a} / ({ONE} + math.exp(-{a})) if {a} >= {ZERO} else {a} * math.exp({a}) / ({ONE} + math.exp({a})))"

# --------------------------------------------------------------------------- derivatives
# ``(t, g, y, *args, c) -> cotangents``: see ``derivative`` in the module docstring

def _one_minus(t, w):
    return t("shift", t("neg", w), c=1.0)


def _d_rsqrt(t, g, y, x, c):     # -x^(-3/2) / 2 = -y^3 / 2
    return (t("mul", g, t("scale", t("mul", y, t("square", y)), c=-0.5)),)


def _d_silu(t, g, y, x, c):      # sigmoid(x) (1 + x (1 - sigmoid(x))) = s + y (1 - s)
    s = t("sigmoid", x)
    return (t("mul", g, t("add", s, t("mul", y, _one_minus(t, s)))),)


def _d_gelu_grad(t, g, y, x, c):  # phi(x) (2 - x^2), phi the standard normal density
    phi = t("scale", t("exp", t("scale", t("square", x), c=-0.5)), c=CUDA_CONSTANTS["INV_SQRT_2PI"])
    return (t("mul", g, t("mul", phi, t("shift", t("neg", t("square", x)), c=2.0))),)


def _d_div(t, g, y, a, b, c):    # (g / b, -g a / b^2), as torch
    return t("div", g, b), t("neg", t("div", t("mul", g, a), t("square", b)))


def _d_maximum(t, g, y, a, b, c):
    # torch's rule: the larger argument takes the cotangent, a tie shares it equally (through
    # ``equal``, not ``sign(a - b)``: a tie of two infinities is a tie, not NaN)
    share = t("mul", g, t("shift", t("scale", t("equal", a, b), c=-0.5), c=1.0))
    return t("mul", share, t("equal", y, a)), t("mul", share, t("equal", y, b))


_ENTRIES = (
    Function("exp", 1, "exp", lambda xp, x: xp.exp(x), "math.exp({a})", zero_at_neg_inf=True,
             derivative=lambda t, g, y, x, c: (t("mul", g, y),)),
    Function("log", 1, "exp", lambda xp, x: xp.log(x), "math.log({a})",
             derivative=lambda t, g, y, x, c: (t("div", g, x),)),
    Function("neg", 1, "fma", lambda xp, x: xp.negative(x), "-{a}",
             derivative=lambda t, g, y, x, c: (t("neg", g),)),
    Function("abs", 1, "fma", lambda xp, x: xp.abs(x), "abs({a})",
             derivative=lambda t, g, y, x, c: (t("mul", g, t("sign", x)),)),
    Function("square", 1, "fma", lambda xp, x: xp.square(x), "{a} * {a}",
             derivative=lambda t, g, y, x, c: (t("mul", g, t("scale", x, c=2.0)),)),
    Function("sqrt", 1, "exp", lambda xp, x: xp.sqrt(x), "math.sqrt({a})",
             derivative=lambda t, g, y, x, c: (t("div", g, t("scale", y, c=2.0)),)),
    Function("rsqrt", 1, "exp", lambda xp, x: 1 / xp.sqrt(x), "{ONE} / math.sqrt({a})", derivative=_d_rsqrt),
    # relu'(x) = sign(relu(x)): 1 above 0, else 0 (torch's subgradient at 0)
    Function("relu", 1, "fma", lambda xp, x: xp.relu(x), "max({a}, {ZERO})",
             derivative=lambda t, g, y, x, c: (t("mul", g, t("sign", y)),)),
    Function("gelu", 1, "exp", lambda xp, x: 0.5 * x * (1 + xp.erf(x / math.sqrt(2.0))),
             "{HALF} * {a} * ({ONE} + math.erf({a} * {INV_SQRT2}))",   # exact (erf) GELU
             derivative=lambda t, g, y, x, c: (t("mul", g, t("gelu_grad", x)),)),
    # gelu'(x) = Phi(x) + x phi(x): the one derivative that is no composition of the others
    Function("gelu_grad", 1, "exp",
             lambda xp, x: 0.5 * (1 + xp.erf(x / math.sqrt(2.0))) + x * xp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi),
             "{HALF} * ({ONE} + math.erf({a} * {INV_SQRT2})) + {a} * math.exp(-{HALF} * {a} * {a}) * {INV_SQRT_2PI}",
             derivative=_d_gelu_grad),
    Function("silu", 1, "exp", lambda xp, x: x * xp.sigmoid(x), _SILU, derivative=_d_silu),
    Function("sigmoid", 1, "exp", lambda xp, x: xp.sigmoid(x), _SIGMOID,
             derivative=lambda t, g, y, x, c: (t("mul", g, t("mul", y, _one_minus(t, y))),)),
    # softplus(x) = log(1 + e^x), written so that e^x never overflows; softplus' = sigmoid
    Function("softplus", 1, "exp", lambda xp, x: xp.relu(x) + xp.log1p(xp.exp(-xp.abs(x))),
             "max({a}, {ZERO}) + math.log1p(math.exp(-abs({a})))",
             derivative=lambda t, g, y, x, c: (t("mul", g, t("sigmoid", x)),)),
    Function("tanh", 1, "exp", lambda xp, x: xp.tanh(x), "math.tanh({a})",
             derivative=lambda t, g, y, x, c: (t("mul", g, _one_minus(t, t("square", y))),)),
    Function("scale", 1, "fma", lambda xp, x, c: x * c, "{a} * {c}", constant=True,
             keeps_neg_inf=lambda c: c > 0, derivative=lambda t, g, y, x, c: (t("scale", g, c=c),), keeps_zero=(0,)),
    Function("shift", 1, "fma", lambda xp, x, c: x + c, "{a} + {c}", constant=True, keeps_neg_inf=_always,
             derivative=lambda t, g, y, x, c: (g,)),
    Function("recip", 1, "exp", lambda xp, x: 1 / x, "{ONE} / {a}",
             derivative=lambda t, g, y, x, c: (t("neg", t("mul", g, t("square", y))),)),
    Function("identity", 1, "free", lambda xp, x: x, "{a}", derivative=lambda t, g, y, x, c: (g,)),
    Function("sign", 1, "fma", lambda xp, x: xp.sign(x),
             "({ONE} if {a} > {ZERO} else (-{ONE} if {a} < {ZERO} else {a}))",   # 0 or NaN stays
             derivative=lambda t, g, y, x, c: (None,)),
    Function("add", 2, "fma", lambda xp, x, y: xp.add(x, y), "{a} + {b}", keeps_neg_inf=_always,
             derivative=lambda t, g, y, a, b, c: (g, g)),
    Function("sub", 2, "fma", lambda xp, x, y: xp.subtract(x, y), "{a} - {b}", keeps_neg_inf=_always,
             derivative=lambda t, g, y, a, b, c: (g, t("neg", g))),
    Function("mul", 2, "fma", lambda xp, x, y: xp.multiply(x, y), "{a} * {b}", keeps_zero=(0, 1),
             derivative=lambda t, g, y, a, b, c: (t("mul", g, b), t("mul", g, a))),
    Function("div", 2, "fma", lambda xp, x, y: xp.divide(x, y), "{a} / {b}", derivative=_d_div),
    # 1 where the arguments are equal, else 0 (NaN equals nothing): the indicator the
    # derivatives of max, min and maximum share the cotangent by
    Function("equal", 2, "fma", lambda xp, x, y: xp.where(x == y, 1.0, 0.0), "({ONE} if {a} == {b} else {ZERO})",
             derivative=lambda t, g, y, a, b, c: (None, None)),
    # NaN in either argument propagates, as np.maximum / torch.maximum
    Function("maximum", 2, "fma", lambda xp, x, y: xp.maximum(x, y), "(max({a}, {b}) if {b} == {b} else {b})",
             derivative=_d_maximum),
)

FUNCTIONS: dict[str, Function] = {f.name: f for f in _ENTRIES}
UNARY = tuple(n for n, f in FUNCTIONS.items() if f.arity == 1)
BINARY = tuple(n for n, f in FUNCTIONS.items() if f.arity == 2)
