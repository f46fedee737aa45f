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


def _np_logsumexp(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def _np_as_index_result(value, like, on=None):
    return np.asarray(value)


NUMPY = _Namespace(
    "numpy", np,
    erf=_np_erf, sigmoid=_np_sigmoid, relu=lambda x: np.maximum(x, 0),
    amax=lambda x, axis, keepdims=False: np.max(x, axis=axis, keepdims=keepdims),
    amin=lambda x, axis, keepdims=False: np.min(x, axis=axis, keepdims=keepdims),
    permute=np.transpose, stop_gradient=lambda x: x, quiet=_np_quiet,
    einsum=_np_einsum, letter=opt_einsum.get_symbol,
    narrow=lambda x, axis, start, length: x[(slice(None),) * axis + (slice(start, start + length),)],
    indices_=lambda n, offset, like=None, on=None: np.arange(n) + offset,
    broadcast_=lambda x, shape: np.broadcast_to(x, shape).copy(),
    logsumexp_=_np_logsumexp, diagonal_=lambda x, a, b: np.diagonal(x, axis1=a, axis2=b),
    as_index_result=_np_as_index_result, take_=lambda x, idx, axis: np.take(x, idx, axis=axis),
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

        def indices(n, offset, like=None, on=None):
            # a bias reads indices in the float dtype of its input: slope * (j - i) must not
            # round through a narrower type; a mask reads int64
            if like is not None:
                dtype = like.dtype if like.dtype.is_floating_point else torch.float64
            else:
                dtype = torch.int64
            # on the device of the array the indices are compared with (``on``)
            return torch.arange(n, dtype=dtype, device=None if on is None else on.device) + offset

        def as_index_result(value, like, on=None):
            # a predicate written with NumPy functions may hand back an ndarray: accept it; the
            # result lives on the device of the array it is combined with (``on``)
            dtype = torch.bool if like is None else (like.dtype if like.dtype.is_floating_point else torch.float64)
            device = None if on is None else on.device
            if isinstance(value, torch.Tensor):
                return value.to(dtype=dtype, device=device)
            return torch.as_tensor(value, dtype=dtype, device=device)

        _TORCH = _Namespace(
            "torch", torch,
            erf=torch.erf, sigmoid=torch.sigmoid, relu=torch.relu,
            amax=lambda x, axis, keepdims=False: torch.amax(x, dim=axis, keepdim=keepdims),
            amin=lambda x, axis, keepdims=False: torch.amin(x, dim=axis, keepdim=keepdims),
            permute=lambda x, perm: x.permute(perm), stop_gradient=lambda x: x.detach(),
            quiet=nullcontext, einsum=einsum, letter=letter,
            narrow=lambda x, axis, start, length: x.narrow(axis, start, length),
            sum=lambda x, axis, keepdims=False: torch.sum(x, dim=axis, keepdim=keepdims),
            mean=lambda x, axis: torch.mean(x, dim=axis),
            indices_=indices, broadcast_=torch.broadcast_to, as_index_result=as_index_result,
            logsumexp_=lambda x, axis: torch.logsumexp(x, dim=axis),
            diagonal_=lambda x, a, b: torch.diagonal(x, dim1=a, dim2=b),
            take_=lambda x, idx, axis: torch.index_select(x, axis, idx),
        )
    return _TORCH


# --------------------------------------------------------------------------- 16-bit floats

def bf16_bits(x) -> np.ndarray:
    """float values -> bf16 bit patterns (int16), rounded to nearest even; NaN stays NaN.

    >>> bf16_values(bf16_bits(np.array([1.0, 1.00390625, 1.01171875, -2.5], np.float32))).tolist()
    [1.0, 1.0, 1.015625, -2.5]
    """
    x = np.asarray(x, dtype=np.float32)
    b = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
    rounded = np.where(np.isnan(x), (b >> 16) | 0x40, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
    return (rounded & 0xFFFF).astype(np.uint16).view(np.int16)


def bf16_values(bits) -> np.ndarray:
    """bf16 bit patterns -> float32 values."""
    return (np.asarray(bits).astype(np.int16).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_dtype(x, name: str) -> np.ndarray:
    """``x`` rounded to dtype ``name`` (``f32``, ``f16``, ``bf16``) and held in float32: the
    values a kernel reading that dtype sees."""
    x = np.asarray(x)
    if name == "f16":
        return x.astype(np.float16).astype(np.float32)
    if name == "bf16":
        return bf16_values(bf16_bits(x))
    return x.astype(np.float32)
