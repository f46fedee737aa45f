"""PyTorch semantics: the same diagrams as :mod:`napkin_cat.ops.semantics`, as differentiable torch code.

``to_torch(d)`` returns ``fn(*tensors, sizes=None, params=None)``.  It runs ``d`` equation by
equation like :func:`napkin_cat.evaluate`, through the *same* rules (:data:`.semantics.RULES`)
read through the torch array namespace (:func:`.arrays.torch_namespace`).  Every rule is built
from differentiable operations without Python control flow on values, so the function works
under ``torch.autograd`` and ``torch.vmap`` (weaving a diagram is vmapping its torch function).

Precision: every float wire is computed in one *working* dtype, the promotion of the float
input tensors (``torch.get_default_dtype()`` when there are none).  With float64 inputs this is
the reference semantics (``evaluate(..., reference=True)``); a ``cast`` to a float dtype keeps
the working dtype, a cast to ``i8`` really truncates to int8, as the NumPy reference does.

Inputs are never modified; outputs never alias inputs (they are fresh tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.diagram import Array, Diagram
from ..core.errors import ShapeError, TypingError, UnknownKindError
from .arrays import torch_namespace
from .semantics import RULES, apply_box, check_call_options, concrete_shape, resolve_sizes

# integer wires keep their width; float wires use the working dtype (see module docstring)
TORCH_INT_DTYPES = {"i8": torch.int8}
TORCH_RULES = RULES   # the rules are the reference rules, read through the torch namespace


@dataclass
class TorchCtx:
    sizes: dict = field(default_factory=dict)    # axis name -> int
    dtype: torch.dtype = torch.float64           # working dtype of every float wire
    params: dict = field(default_factory=dict)   # param name -> tensor / array
    offsets: dict = field(default_factory=dict)  # whole arrays: every index starts at 0

    @property
    def xp(self):
        return torch_namespace()

    def wire_dtype(self, arr: Array) -> torch.dtype:
        return TORCH_INT_DTYPES.get(arr.dtype.name, self.dtype) if arr.dtype.kind == "int" else self.dtype

    def convert(self, x, arr: Array) -> torch.Tensor:
        # float -> float keeps the working dtype; float -> i8 truncates toward zero, as NumPy's astype
        return x.to(self.wire_dtype(arr))

    def full(self, shape, value, arr: Array) -> torch.Tensor:
        return torch.full(shape, value, dtype=self.wire_dtype(arr))

    def param(self, value, arr: Array) -> torch.Tensor:
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


# --------------------------------------------------------------------------- to_torch

def _check_inputs(d: Diagram, tensors) -> None:
    if len(tensors) != len(d.dom):
        raise ShapeError(f"{d.short()} takes {len(d.dom)} tensors "
                         f"({', '.join(a.name for a in d.dom)}), got {len(tensors)}")
    for arr, t in zip(d.dom, tensors):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"input {arr}: expected a torch.Tensor, got {type(t).__name__}")
        if t.is_complex() or t.dtype == torch.bool:
            raise ShapeError(f"input {arr}: expected a real tensor for dtype {arr.dtype.name}, got {t.dtype}")
        if arr.dtype.kind == "int" and t.is_floating_point():
            raise ShapeError(f"input {arr}: expected an integer tensor for dtype {arr.dtype.name}, got {t.dtype}")


def _working_dtype(tensors) -> torch.dtype:
    dtype = None
    for t in tensors:
        if t.is_floating_point():
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype or torch.get_default_dtype()


def to_torch(d: Diagram) -> Callable:
    """A differentiable torch function ``fn(*tensors, sizes=None, params=None)`` computing ``d``.

    Returns one tensor, or a tuple when ``cod`` has several arrays.  ``sizes`` binds symbolic
    axes (keys: Axis, axis name or symbol name, as for :func:`napkin_cat.evaluate`); ``params``
    maps parameter names to tensors (gradients flow into them).

    >>> import torch, napkin_cat as nc
    >>> a, b, c = nc.axes("a b c")
    >>> f = nc.to_torch(nc.library.matmul(a, b, c))
    >>> f(torch.ones(2, 3), torch.ones(3, 4)).shape
    torch.Size([2, 4])
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"to_torch needs a Diagram, got {type(d).__name__}")
    if d.schedule:
        # relabelings never change the function: the torch function is the unrelabelled one
        d = d.unrelabelled()
    for e in d.eqns:  # refuse unknown kinds now, not at the first call
        if e.box.kind not in TORCH_RULES:
            raise UnknownKindError(f"no torch rule for box kind {e.box.kind!r} (box {e.box.name}); "
                                   f"known kinds: {sorted(TORCH_RULES)}")
    nvars = len(d.var_types())

    def fn(*tensors, sizes: dict | None = None, params: dict | None = None):
        check_call_options(d, sizes, params, fn.__name__)
        _check_inputs(d, tensors)
        bound = resolve_sizes(d, tensors, sizes)
        for arr in d.dom:
            concrete_shape(arr, bound)
        ctx = TorchCtx(bound, _working_dtype(tensors), dict(params or {}))
        env: list = [t.to(ctx.wire_dtype(a)) for t, a in zip(tensors, d.dom)] + [None] * (nvars - len(d.dom))
        for k, e in enumerate(d.eqns):
            for v, o in zip(d.eqn_outputs(k), apply_box(e.box, [env[v] for v in e.ins], ctx)):
                env[v] = o
        # fresh outputs: an identity wire or a view must not alias the caller's tensor
        outs = tuple(env[v].clone() for v in d.outs)
        return outs[0] if len(outs) == 1 else outs

    fn.__name__ = f"torch_{'_'.join(a.name for a in d.cod) or 'diagram'}"
    fn.__doc__ = f"torch function of {d}"
    fn.diagram = d  # type: ignore[attr-defined]
    return fn
