"""Array namespaces: the operations the reference rules use, for NumPy and for torch.

A rule written once over ``xp`` (``xp.exp``, ``xp.where``, ``xp.einsum``...) is the NumPy
oracle with :data:`NUMPY` and a differentiable torch function with :func:`torch_namespace`.
Each namespace is the library's own module plus the few operations the two spell
differently (``erf``, ``sigmoid``, ``relu``, ``amax``, ``permute``, ``stop_gradient``...).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import opt_einsum


class _Namespace:
    """``module`` plus overrides: attribute lookup falls through to the module."""

    def __init__(self, name: str, module, **overrides):
        self.name = name
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, attr):
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<array namespace {self.name}>"


def _np_erf(x):
    # erf through math.erf vectorised: exact to double precision, no scipy dependency
    return np.vectorize(math.erf, otypes=[x.dtype if x.dtype.kind == "f" else np.float64])(x)


def _np_sigmoid(x):
    with np.errstate(over="ignore"):
        return np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))


def _np_einsum(spec: str, *ins):
    return opt_einsum.contract(spec, *ins, optimize="auto") if len(ins) > 1 else np.einsum(spec, ins[0])


def _np_quiet():
    return np.errstate(divide="ignore", invalid="ignore", over="ignore")


NUMPY = _Namespace(
    "numpy", np,
    erf=_np_erf, sigmoid=_np_sigmoid, relu=lambda x: np.maximum(x, 0),
    amax=lambda x, axis, keepdims=False: np.max(x, axis=axis, keepdims=keepdims),
    amin=lambda x, axis, keepdims=False: np.min(x, axis=axis, keepdims=keepdims),
    permute=np.transpose, stop_gradient=lambda x: x, quiet=_np_quiet,
    einsum=_np_einsum, letter=opt_einsum.get_symbol,
    narrow=lambda x, axis, start, length: x[(slice(None),) * axis + (slice(start, start + length),)],
)

_TORCH = None
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def torch_namespace():
    """The torch namespace (torch is imported on first use: ``import napkin_cat`` stays light)."""
    global _TORCH
    if _TORCH is None:
        import torch

        def einsum(spec, *ins):
            dtype = ins[0].dtype
            for t in ins[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
            return torch.einsum(spec, *(t.to(dtype) for t in ins))

        def letter(k: int) -> str:
            if k >= len(_LETTERS):
                from ..core.errors import TypingError
                raise TypingError(f"contraction over {k + 1}+ distinct axes: torch.einsum has only "
                                  f"{len(_LETTERS)} letters")
            return _LETTERS[k]

        _TORCH = _Namespace(
            "torch", torch,
            erf=torch.erf, sigmoid=torch.sigmoid, relu=torch.relu,
            amax=lambda x, axis, keepdims=False: torch.amax(x, dim=axis, keepdim=keepdims),
            amin=lambda x, axis, keepdims=False: torch.amin(x, dim=axis, keepdim=keepdims),
            permute=lambda x, perm: x.permute(perm), stop_gradient=lambda x: x.detach(),
            quiet=nullcontext, einsum=einsum, letter=letter,
            narrow=lambda x, axis, start, length: x.narrow(axis, start, length),
        )
    return _TORCH
