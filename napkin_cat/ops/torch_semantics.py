"""PyTorch semantics: the same diagrams as :mod:`napkin_cat.ops.semantics`, as differentiable torch code.

``to_torch(d)`` returns ``fn(*tensors, sizes=None, params=None)``.  It runs ``d`` equation by
equation like :func:`napkin_cat.evaluate`, with one rule per box kind in :data:`TORCH_RULES`
(keyed exactly like :data:`napkin_cat.ops.semantics.NUMPY_RULES`).  Every rule is built from
differentiable torch ops without Python control flow on values, so the function works under
``torch.autograd`` and ``torch.vmap`` (weaving a diagram is vmapping its torch function).

Precision: every float wire is computed in one *working* dtype, the promotion of the float
input tensors (``torch.get_default_dtype()`` when there are none).  With float64 inputs this is
the reference semantics (``evaluate(..., reference=True)``); a ``cast`` to a float dtype keeps
the working dtype, a cast to ``i8`` really truncates to int8, as the NumPy reference does.

Inputs are never modified; outputs never alias inputs (they are fresh tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.diagram import Array, Box, Diagram, Ty
from ..core.errors import ShapeError, TypingError, UnknownKindError
from .arrays import torch_namespace
from .functions import FUNCTIONS
from .index import constant_value
from .kinds import NORMALISATIONS, REDUCTIONS
from .semantics import NUMPY_RULES, check_call_options, concrete_shape, resolve_sizes

# integer wires keep their width; float wires use the working dtype (see module docstring)
TORCH_INT_DTYPES = {"i8": torch.int8}


@dataclass
class TorchCtx:
    sizes: dict = field(default_factory=dict)    # axis name -> int
    dtype: torch.dtype = torch.float64           # working dtype of every float wire
    params: dict = field(default_factory=dict)   # param name -> tensor / array

    def wire_dtype(self, arr: Array) -> torch.dtype:
        return TORCH_INT_DTYPES.get(arr.dtype.name, self.dtype) if arr.dtype.kind == "int" else self.dtype


# --------------------------------------------------------------------------- elementwise table

def _fn(name: str):
    """The elementwise function ``name`` on torch tensors (its one definition: :mod:`.functions`)."""
    f = FUNCTIONS[name]
    return lambda *args, c=None: f(torch_namespace(), *args, c=c)


FUNCTION_IMPLS: dict[str, Callable] = {name: _fn(name) for name in FUNCTIONS}


# --------------------------------------------------------------------------- helpers on named tensors

def align(x: torch.Tensor, src: tuple[str, ...], dst: tuple[str, ...]) -> torch.Tensor:
    """Permute ``x`` (axes ``src``) and insert unit axes so it broadcasts against ``dst``."""
    x = x.permute([src.index(n) for n in dst if n in src])
    it = iter(x.shape)
    return x.reshape([next(it) if n in src else 1 for n in dst])


def index_grid(box_arr: Array, shape, row: str, col: str, dtype=torch.int64):
    """Global row / column index tensors shaped to broadcast against an array of ``shape``."""
    names = box_arr.axis_names
    ri, ci = names.index(row), names.index(col)
    ishape = [1] * len(shape); ishape[ri] = shape[ri]
    jshape = [1] * len(shape); jshape[ci] = shape[ci]
    return (torch.arange(shape[ri], dtype=dtype).reshape(ishape),
            torch.arange(shape[ci], dtype=dtype).reshape(jshape))


def safe_softmax(s: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax along ``dim`` (docs/NAN_POLICY.md): a fully masked row (every score -inf) gives
    zeros, not NaN; a row holding a NaN or a +inf gives NaN everywhere, as the NumPy oracle."""
    m = torch.amax(s, dim=dim, keepdim=True)
    # the shift is only for range: softmax is shift-invariant, so no gradient flows through it;
    # only a row with no score above -inf is shifted by 0 (NaN and +inf pass through)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    z = e.sum(dim=dim, keepdim=True)   # >= 1 unless fully masked (0), or NaN
    # both branches of where must be finite, or the backward pass turns 0 * inf into NaN
    full = z == 0
    return torch.where(full, torch.zeros_like(e), e / torch.where(full, torch.ones_like(z), z))


def normalise(x: torch.Tensor, dim: int, a1: str, a2: str, b: str, eps: float) -> torch.Tensor:
    if (a1, a2, b) == NORMALISATIONS["softmax"]:
        return safe_softmax(x, dim)
    f1, f2, fb = FUNCTION_IMPLS[a1], FUNCTION_IMPLS[a2], FUNCTION_IMPLS[b]
    z = fb(f2(x).sum(dim=dim, keepdim=True)) + eps
    nz = z != 0
    return torch.where(nz, f1(x) / torch.where(nz, z, torch.ones_like(z)), torch.zeros_like(x))


def _einsum(ins, dom: Ty, out_names: tuple[str, ...]) -> torch.Tensor:
    # one letter per axis name, in order of first appearance (torch.einsum takes a-z, A-Z)
    letters: dict[str, str] = {}
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for a in dom:
        for n in a.axis_names:
            if n not in letters:
                if len(letters) == len(alphabet):
                    raise TypingError(f"contraction over {len(letters) + 1}+ distinct axes: torch.einsum "
                                      f"has only {len(alphabet)} letters ({', '.join(map(str, dom))})")
                letters[n] = alphabet[len(letters)]
    spec = ",".join("".join(letters[n] for n in a.axis_names) for a in dom)
    spec += "->" + "".join(letters[n] for n in out_names)
    dtype = ins[0].dtype
    for t in ins[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.einsum(spec, *(t.to(dtype) for t in ins))


def _dim(box: Box, key: str = "axis") -> int:
    return box.dom[0].axis_names.index(box.param(key))


# --------------------------------------------------------------------------- rules

def rule_contract(box: Box, ins, ctx: TorchCtx):
    return (_einsum(ins, box.dom, box.cod[0].axis_names),)


def rule_map(box: Box, ins, ctx: TorchCtx):
    fn = box.param("fn")
    out_names = box.cod[0].axis_names
    args = [align(x, a.axis_names, out_names) for x, a in zip(ins, box.dom)]
    c = box.param("c", None)
    res = FUNCTION_IMPLS[fn](*args, c=None if c is None else constant_value(c, ctx.sizes))
    return (torch.broadcast_to(res, torch.broadcast_shapes(*(a.shape for a in args))),)


def rule_reduce(box: Box, ins, ctx: TorchCtx):
    op, x, dim = box.param("op"), ins[0], _dim(box)
    if op == "sum":
        return (x.sum(dim=dim),)
    if op == "max":
        return (torch.amax(x, dim=dim),)
    if op == "min":
        return (torch.amin(x, dim=dim),)
    if op == "mean":
        return (x.mean(dim=dim),)
    if op == "logsumexp":
        # torch.logsumexp gives -inf for an all -inf row, like the NumPy rule
        return (torch.logsumexp(x, dim=dim),)
    raise UnknownKindError(f"no torch rule for reduction {op!r} (box {box.name}); known: {list(REDUCTIONS)}")


def rule_softmax(box: Box, ins, ctx: TorchCtx):
    return (safe_softmax(ins[0], _dim(box)),)


def rule_normalize(box: Box, ins, ctx: TorchCtx):
    return (normalise(ins[0], _dim(box), box.param("a1"), box.param("a2"), box.param("b"), box.param("eps")),)


def _index_result(value, dtype) -> torch.Tensor:
    # a predicate written with NumPy functions may hand back an ndarray: accept it
    return value.to(dtype) if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=dtype)


def rule_mask(box: Box, ins, ctx: TorchCtx):
    x = ins[0]
    i, j = index_grid(box.dom[0], x.shape, box.param("row"), box.param("col"))
    keep = _index_result(box.param("pred")(i, j), torch.bool)
    return (torch.where(keep, x, torch.full_like(x, -math.inf)),)


def rule_index_bias(box: Box, ins, ctx: TorchCtx):
    x = ins[0]
    # indices in x's float dtype: ``slope * (j - i)`` must not round through float32
    fdt = x.dtype if x.dtype.is_floating_point else torch.float64
    i, j = index_grid(box.dom[0], x.shape, box.param("row"), box.param("col"), fdt)
    return (x + _index_result(box.param("bias")(i, j), fdt),)


def rule_reindex(box: Box, ins, ctx: TorchCtx):
    x, src, dst = ins[0], box.dom[0], box.cod[0]
    op, names = box.param("op"), src.axis_names
    shape = tuple(x.shape)
    if op == "transpose":
        return (x.permute([names.index(n) for n in dst.axis_names]),)
    if op == "split":
        k = names.index(box.param("axis"))
        inner = dst.axes[k + 1]
        n_in = int(ctx.sizes.get(inner.name, inner.size))
        return (x.reshape(shape[:k] + (-1, n_in) + shape[k + 1:]),)
    if op == "merge":
        k = names.index(box.param("outer"))
        return (x.reshape(shape[:k] + (-1,) + shape[k + 2:]),)
    if op == "slice":
        k = names.index(box.param("axis"))
        start, stop = box.param("start"), box.param("stop")
        return (x.narrow(k, start, stop - start),)
    if op == "diagonal":
        keep, drop = box.param("keep"), box.param("drop")
        dg = torch.diagonal(x, dim1=names.index(keep), dim2=names.index(drop))  # diagonal goes last
        rest = [n for n in names if n not in (keep, drop)] + [keep]
        return (dg.permute([rest.index(n) for n in dst.axis_names]),)
    raise UnknownKindError(f"no torch rule for reindex op {op!r} (box {box.name})")


def rule_param(box: Box, ins, ctx: TorchCtx):
    name, arr = box.param("pname"), box.cod[0]
    if name not in ctx.params:
        raise ShapeError(f"parameter {arr} has no value: pass params={{'{name}': tensor}}")
    value = ctx.params[name]
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    shape = concrete_shape(arr, ctx.sizes)
    if tuple(t.shape) != shape:
        raise ShapeError(f"parameter {arr}: expected shape {shape}, got {tuple(t.shape)}")
    return (t,)


def rule_const(box: Box, ins, ctx: TorchCtx):
    arr = box.cod[0]
    return (torch.full(concrete_shape(arr, ctx.sizes), box.param("value"), dtype=ctx.wire_dtype(arr)),)


def rule_cast(box: Box, ins, ctx: TorchCtx):
    # float -> float keeps the working dtype; float -> i8 truncates toward zero, as NumPy's astype
    return (ins[0].to(ctx.wire_dtype(box.cod[0])),)


def rule_softmax_contract(box: Box, ins, ctx: TorchCtx):
    s, v = ins
    return (_einsum([safe_softmax(s, _dim(box)), v], box.dom, box.cod[0].axis_names),)


def rule_norm_contract(box: Box, ins, ctx: TorchCtx):
    s, v = ins
    p = normalise(s, _dim(box), box.param("a1"), box.param("a2"), box.param("b"), box.param("eps"))
    return (_einsum([p, v], box.dom, box.cod[0].axis_names),)


TORCH_RULES: dict[str, Callable] = {
    "contract": rule_contract, "map": rule_map, "reduce": rule_reduce, "softmax": rule_softmax,
    "normalize": rule_normalize, "mask": rule_mask, "index_bias": rule_index_bias,
    "reindex": rule_reindex, "param": rule_param, "const": rule_const, "cast": rule_cast,
    "softmax_contract": rule_softmax_contract, "norm_contract": rule_norm_contract,
}
assert set(TORCH_RULES) == set(NUMPY_RULES)


def apply_box(box: Box, ins: list, ctx: TorchCtx) -> tuple:
    try:
        rule = TORCH_RULES[box.kind]
    except KeyError:
        raise UnknownKindError(f"no torch rule for box kind {box.kind!r} (box {box.name}); "
                               f"known kinds: {sorted(TORCH_RULES)}") from None
    outs = rule(box, ins, ctx)
    # every wire leaves in its dtype, as in the NumPy semantics' apply_box
    return tuple(o.to(ctx.wire_dtype(a)) for o, a in zip(outs, box.cod))


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
