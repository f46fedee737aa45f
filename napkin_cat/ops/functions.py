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
              a callable of the constant ``c`` (``scale`` keeps it only for ``c > 0``).

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


CUDA_CONSTANTS = {"ONE": 1.0, "ZERO": 0.0, "HALF": 0.5, "INV_SQRT2": 1 / math.sqrt(2.0)}

# sigmoid / silu: exp of a non-positive argument only, so no overflow (the simulator's math.exp
# raises where a GPU gives inf); NaN propagates (docs/NAN_POLICY.md)
_SIGMOID = "({ONE} / ({ONE} + math.exp(-{a})) if {a} >= {ZERO} else math.exp({a}) / ({ONE} + math.exp({a})))"
_SILU = "({a} / ({ONE} + math.exp(-{a})) if {a} >= {ZERO} else {a} * math.exp({a}) / ({ONE} + math.exp({a})))"

_ENTRIES = (
    Function("exp", 1, "exp", lambda xp, x: xp.exp(x), "math.exp({a})"),
    Function("log", 1, "exp", lambda xp, x: xp.log(x), "math.log({a})"),
    Function("neg", 1, "fma", lambda xp, x: xp.negative(x), "-{a}"),
    Function("abs", 1, "fma", lambda xp, x: xp.abs(x), "abs({a})"),
    Function("square", 1, "fma", lambda xp, x: xp.square(x), "{a} * {a}"),
    Function("sqrt", 1, "exp", lambda xp, x: xp.sqrt(x), "math.sqrt({a})"),
    Function("rsqrt", 1, "exp", lambda xp, x: 1 / xp.sqrt(x), "{ONE} / math.sqrt({a})"),
    Function("relu", 1, "fma", lambda xp, x: xp.relu(x), "max({a}, {ZERO})"),
    Function("gelu", 1, "exp", lambda xp, x: 0.5 * x * (1 + xp.erf(x / math.sqrt(2.0))),
             "{HALF} * {a} * ({ONE} + math.erf({a} * {INV_SQRT2}))"),   # exact (erf) GELU
    Function("silu", 1, "exp", lambda xp, x: x * xp.sigmoid(x), _SILU),
    Function("sigmoid", 1, "exp", lambda xp, x: xp.sigmoid(x), _SIGMOID),
    Function("tanh", 1, "exp", lambda xp, x: xp.tanh(x), "math.tanh({a})"),
    Function("scale", 1, "fma", lambda xp, x, c: x * c, "{a} * {c}", constant=True,
             keeps_neg_inf=lambda c: c > 0),
    Function("shift", 1, "fma", lambda xp, x, c: x + c, "{a} + {c}", constant=True, keeps_neg_inf=_always),
    Function("recip", 1, "exp", lambda xp, x: 1 / x, "{ONE} / {a}"),
    Function("identity", 1, "free", lambda xp, x: x, "{a}"),
    Function("sign", 1, "fma", lambda xp, x: xp.sign(x),
             "({ONE} if {a} > {ZERO} else (-{ONE} if {a} < {ZERO} else {a}))"),   # 0 or NaN stays
    Function("add", 2, "fma", lambda xp, x, y: xp.add(x, y), "{a} + {b}", keeps_neg_inf=_always),
    Function("sub", 2, "fma", lambda xp, x, y: xp.subtract(x, y), "{a} - {b}"),
    Function("mul", 2, "fma", lambda xp, x, y: xp.multiply(x, y), "{a} * {b}"),
    Function("div", 2, "fma", lambda xp, x, y: xp.divide(x, y), "{a} / {b}"),
    # NaN in either argument propagates, as np.maximum / torch.maximum
    Function("maximum", 2, "fma", lambda xp, x, y: xp.maximum(x, y), "(max({a}, {b}) if {b} == {b} else {b})"),
)

FUNCTIONS: dict[str, Function] = {f.name: f for f in _ENTRIES}
UNARY = tuple(n for n, f in FUNCTIONS.items() if f.arity == 1)
BINARY = tuple(n for n, f in FUNCTIONS.items() if f.arity == 2)
