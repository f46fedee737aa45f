"""NumPy semantics: the oracle every relabeling, cost claim and kernel is checked against.

``evaluate(d, *arrays, sizes=...)`` runs a diagram equation by equation.  Each box kind has one
rule in :data:`NUMPY_RULES`; a rule receives the box, its input arrays (axes in the order of
the box's ``dom``) and a :class:`Ctx` (bound sizes, global index offsets of the axes, dtype
mode), and returns arrays in the order of the box's ``cod``.  Rules use array shapes, not the
declared sizes, so the tiled executor can run them on chunks; masks and index biases add the
chunk's global offset to their indices.

Contractions go through ``opt_einsum`` (good contraction paths for any number of operands).

NaN, +-inf and empty axes follow one policy at every level (this oracle, the tiled executor,
:mod:`napkin_cat.ops.torch_semantics`, generated kernels): see ``docs/NAN_POLICY.md``.  In short,
a NaN propagates to every output that depends on it; infinities follow IEEE arithmetic of the
max-shifted reference formulas; a fully masked softmax row (every score -inf) gives zeros; an
axis of size 0 is refused (:class:`~napkin_cat.core.errors.EmptyAxisError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import opt_einsum

from ..core.diagram import Array, Axis, Box, Diagram, DType, Ty
from ..core.errors import EmptyAxisError, ShapeError, TypingError, UnknownKindError
from .arrays import NUMPY
from .functions import FUNCTIONS
from .index import constant_value
from .kinds import NORMALISATIONS

NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.float32, "fp8_e4m3": np.float32,
             "fp8_e5m2": np.float32, "i8": np.int8, "f64": np.float64}


@dataclass
class Ctx:
    sizes: dict = field(default_factory=dict)     # axis name -> int (global sizes)
    offsets: dict = field(default_factory=dict)   # axis name -> global index of position 0
    reference: bool = True                        # float64 everywhere
    params: dict = field(default_factory=dict)    # param name -> array

    def dtype(self, dt: DType):
        return np.float64 if self.reference and dt.kind == "float" else NP_DTYPES[dt.name]


# --------------------------------------------------------------------------- elementwise table

def _fn(name: str):
    """The elementwise function ``name`` on NumPy arrays (its one definition: :mod:`.functions`)."""
    f = FUNCTIONS[name]
    return lambda *args, c=None: f(NUMPY, *args, c=c)


FUNCTION_IMPLS: dict[str, Callable] = {name: _fn(name) for name in FUNCTIONS}


# --------------------------------------------------------------------------- helpers on named arrays

def align(x: np.ndarray, src: tuple[str, ...], dst: tuple[str, ...]) -> np.ndarray:
    """Transpose ``x`` (axes ``src``) and insert unit axes so it broadcasts against ``dst``."""
    x = np.transpose(x, [src.index(n) for n in dst if n in src])
    sizes = iter(x.shape)
    return x.reshape([next(sizes) if n in src else 1 for n in dst])


def index_grid(box_arr: Array, shape, row: str, col: str, ctx: Ctx):
    names = box_arr.axis_names
    ri, ci = names.index(row), names.index(col)
    i = np.arange(shape[ri]) + ctx.offsets.get(row, 0)
    j = np.arange(shape[ci]) + ctx.offsets.get(col, 0)
    ishape = [1] * len(shape); ishape[ri] = shape[ri]
    jshape = [1] * len(shape); jshape[ci] = shape[ci]
    return i.reshape(ishape), j.reshape(jshape)


def safe_softmax(s: np.ndarray, ax: int) -> np.ndarray:
    """Softmax along ``ax`` (docs/NAN_POLICY.md): a fully masked row (every score -inf) gives
    zeros; a row holding a NaN or a +inf gives NaN everywhere (``exp(s - max s)`` in IEEE
    arithmetic: the max is NaN, or ``inf - inf``), never zeros."""
    m = np.max(s, axis=ax, keepdims=True)
    m = np.where(m == -np.inf, 0.0, m)  # only a row with no score above -inf is shifted by 0
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(s - m)
    z = np.sum(e, axis=ax, keepdims=True)  # >= 1 unless fully masked (0), or NaN
    with np.errstate(invalid="ignore"):
        return np.where(z == 0, 0.0, e / np.where(z == 0, 1, z))


def normalise(x: np.ndarray, ax: int, a1: str, a2: str, b: str, eps: float) -> np.ndarray:
    if (a1, a2, b) == NORMALISATIONS["softmax"]:
        return safe_softmax(x, ax)
    f1, f2, fb = FUNCTION_IMPLS[a1], FUNCTION_IMPLS[a2], FUNCTION_IMPLS[b]
    z = fb(np.sum(f2(x), axis=ax, keepdims=True)) + eps
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(z != 0, f1(x) / np.where(z != 0, z, 1), 0.0)


# --------------------------------------------------------------------------- rules

def _einsum(ins: list[np.ndarray], dom: Ty, out_names: tuple[str, ...]) -> np.ndarray:
    letters: dict[str, str] = {}
    for a in dom:
        for n in a.axis_names:
            letters.setdefault(n, opt_einsum.get_symbol(len(letters)))
    spec = ",".join("".join(letters[n] for n in a.axis_names) for a in dom)
    spec += "->" + "".join(letters[n] for n in out_names)
    return opt_einsum.contract(spec, *ins, optimize="auto") if len(ins) > 1 else np.einsum(spec, ins[0])


def rule_contract(box: Box, ins, ctx):
    return (_einsum(ins, box.dom, box.cod[0].axis_names),)


def rule_map(box: Box, ins, ctx):
    fn = box.param("fn")
    out_names = box.cod[0].axis_names
    args = [align(x, a.axis_names, out_names) for x, a in zip(ins, box.dom)]
    c = box.param("c", None)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        res = FUNCTION_IMPLS[fn](*args, c=None if c is None else constant_value(c, ctx.sizes))
    shape = np.broadcast_shapes(*(a.shape for a in args))
    return (np.broadcast_to(res, shape).copy(),)


def rule_reduce(box: Box, ins, ctx):
    op, axis = box.param("op"), box.param("axis")
    x = ins[0]
    ax = box.dom[0].axis_names.index(axis)
    if op == "sum":
        return (np.sum(x, axis=ax),)
    if op == "max":
        return (np.max(x, axis=ax),)
    if op == "min":
        return (np.min(x, axis=ax),)
    if op == "mean":
        return (np.mean(x, axis=ax),)
    if op == "logsumexp":
        m = np.max(x, axis=ax, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return (np.squeeze(m, ax) + np.log(np.sum(np.exp(x - m), axis=ax)),)
    raise UnknownKindError(f"no NumPy rule for reduction {op!r}")


def rule_softmax(box: Box, ins, ctx):
    return (safe_softmax(ins[0], box.dom[0].axis_names.index(box.param("axis"))),)


def rule_normalize(box: Box, ins, ctx):
    ax = box.dom[0].axis_names.index(box.param("axis"))
    return (normalise(ins[0], ax, box.param("a1"), box.param("a2"), box.param("b"), box.param("eps")),)


def rule_mask(box: Box, ins, ctx):
    x = ins[0]
    i, j = index_grid(box.dom[0], x.shape, box.param("row"), box.param("col"), ctx)
    keep = np.broadcast_to(box.param("pred")(i, j), x.shape)
    return (np.where(keep, x, -np.inf).astype(x.dtype),)


def rule_index_bias(box: Box, ins, ctx):
    x = ins[0]
    i, j = index_grid(box.dom[0], x.shape, box.param("row"), box.param("col"), ctx)
    return ((x + box.param("bias")(i, j)).astype(x.dtype),)


def rule_reindex(box: Box, ins, ctx):
    x, src, dst = ins[0], box.dom[0], box.cod[0]
    op = box.param("op")
    names = src.axis_names
    if op == "transpose":
        return (np.transpose(x, [names.index(n) for n in dst.axis_names]),)
    if op == "split":
        k = names.index(box.param("axis"))
        inner = dst.axes[k + 1]
        n_in = ctx.sizes.get(inner.name, inner.size)
        return (x.reshape(x.shape[:k] + (-1, int(n_in)) + x.shape[k + 1:]),)
    if op == "merge":
        k = names.index(box.param("outer"))
        return (x.reshape(x.shape[:k] + (-1,) + x.shape[k + 2:]),)
    if op == "slice":
        k = names.index(box.param("axis"))
        sl = [slice(None)] * x.ndim
        sl[k] = slice(box.param("start"), box.param("stop"))
        return (x[tuple(sl)],)
    if op == "diagonal":
        a, b = names.index(box.param("keep")), names.index(box.param("drop"))
        d = np.diagonal(x, axis1=a, axis2=b)  # diagonal axis goes last
        rest = [n for n in names if n not in (box.param("keep"), box.param("drop"))] + [box.param("keep")]
        return (np.transpose(d, [rest.index(n) for n in dst.axis_names]),)
    raise UnknownKindError(f"no NumPy rule for reindex op {op!r}")


def rule_param(box: Box, ins, ctx):
    name = box.param("pname")
    if name not in ctx.params:
        raise ShapeError(f"parameter {box.cod[0]} has no value: pass params={{'{name}': array}}")
    arr = np.asarray(ctx.params[name])
    shape = concrete_shape(box.cod[0], ctx.sizes)
    if arr.shape != shape:
        raise ShapeError(f"parameter {box.cod[0]}: expected shape {shape}, got {arr.shape}")
    return (arr.astype(ctx.dtype(box.cod[0].dtype)),)


def rule_const(box: Box, ins, ctx):
    shape = concrete_shape(box.cod[0], ctx.sizes)
    return (np.full(shape, box.param("value"), dtype=ctx.dtype(box.cod[0].dtype)),)


def rule_cast(box: Box, ins, ctx):
    return (ins[0].astype(ctx.dtype(box.cod[0].dtype)),)


def rule_softmax_contract(box: Box, ins, ctx):
    s, v = ins
    ax = box.dom[0].axis_names.index(box.param("axis"))
    p = safe_softmax(s, ax)
    return (_einsum([p, v], box.dom, box.cod[0].axis_names),)


def rule_norm_contract(box: Box, ins, ctx):
    s, v = ins
    ax = box.dom[0].axis_names.index(box.param("axis"))
    p = normalise(s, ax, box.param("a1"), box.param("a2"), box.param("b"), box.param("eps"))
    return (_einsum([p, v], box.dom, box.cod[0].axis_names),)


NUMPY_RULES: dict[str, Callable] = {
    "contract": rule_contract, "map": rule_map, "reduce": rule_reduce, "softmax": rule_softmax,
    "normalize": rule_normalize, "mask": rule_mask, "index_bias": rule_index_bias,
    "reindex": rule_reindex, "param": rule_param, "const": rule_const, "cast": rule_cast,
    "softmax_contract": rule_softmax_contract, "norm_contract": rule_norm_contract,
}


def apply_box(box: Box, ins: list[np.ndarray], ctx: Ctx) -> tuple[np.ndarray, ...]:
    try:
        rule = NUMPY_RULES[box.kind]
    except KeyError:
        raise UnknownKindError(f"no NumPy rule for box kind {box.kind!r} (box {box.name})") from None
    outs = rule(box, ins, ctx)
    return tuple(np.asarray(o, dtype=ctx.dtype(a.dtype)) for o, a in zip(outs, box.cod))


# --------------------------------------------------------------------------- evaluate

def concrete_shape(arr: Array, sizes: dict) -> tuple[int, ...]:
    shape = []
    for ax in arr.axes:
        n = sizes.get(ax.name, ax.size)
        if isinstance(n, str):
            raise ShapeError(f"size of axis {ax.name} (wire {arr}) is unknown: pass sizes={{{ax.name}: n}}")
        shape.append(int(n))
    return tuple(shape)


def resolve_sizes(d: Diagram, arrays, sizes: dict | None) -> dict[str, int]:
    """Axis name -> int, from ``sizes`` (keys Axis, names or symbol names) and the arrays."""
    out: dict[str, int] = {}
    sizes = dict(sizes or {})
    axis_names = {a.name for a in d.axes}
    for key, n in sizes.items():  # block-size symbols (``g_q``, ``s_x``) pass through
        if isinstance(key, str) and key not in axis_names:
            out[key] = int(n)
    for ax in d.axes:
        for key in (ax, ax.name, ax.size if ax.symbolic else None):
            if key is not None and key in sizes:
                out[ax.name] = int(sizes[key])
                if out[ax.name] == 0:
                    raise EmptyAxisError(f"sizes: axis {ax.name} has size 0; every axis needs at least one "
                                         f"element (docs/NAN_POLICY.md)")
                break
        else:
            if not ax.symbolic:
                out[ax.name] = ax.size
    for arr, x in zip(d.dom, arrays):
        shape = np.shape(x)
        if len(shape) != len(arr.axes):
            raise ShapeError(f"input {arr}: expected {len(arr.axes)} axes "
                             f"({' '.join(arr.axis_names)}), got an array of shape {shape}")
        for ax, n in zip(arr.axes, shape):
            if n == 0:
                raise EmptyAxisError(f"input {arr}: axis {ax.name} has size 0 (array shape {tuple(shape)}); "
                                     f"every axis needs at least one element (docs/NAN_POLICY.md)")
            if ax.name in out and out[ax.name] != n:
                raise ShapeError(f"input {arr}: axis {ax.name} should have size {out[ax.name]}, "
                                 f"got {n} (array shape {shape})")
            out[ax.name] = n
    return out


def check_inputs(d: Diagram, arrays) -> None:
    if len(arrays) != len(d.dom):
        raise ShapeError(f"{d.short()} takes {len(d.dom)} arrays "
                         f"({', '.join(a.name for a in d.dom)}), got {len(arrays)}")
    for arr, x in zip(d.dom, arrays):
        kind, dtype = _dtype_kind(x)
        if arr.dtype.kind == "float" and kind not in "fiu":
            raise ShapeError(f"input {arr}: expected a real array for dtype {arr.dtype.name}, got dtype {dtype}")
        if arr.dtype.kind == "int" and kind not in "iu":
            raise ShapeError(f"input {arr}: expected an integer array for dtype {arr.dtype.name}, got dtype {dtype}")


def check_call_options(d: Diagram, sizes, params, what: str) -> None:
    """``sizes`` values are positive ints and every key names something in ``d``; ``params`` is a
    mapping whose names are parameters of ``d``."""
    from ..core.diagram import check_size_keys
    if sizes is not None:
        if not hasattr(sizes, "items"):
            raise TypingError(f"{what}: sizes must be a dict {{axis or symbol: int}}, got {sizes!r}")
        check_size_keys(d, sizes, what)
        for key, n in sizes.items():
            name = key.name if isinstance(key, Axis) else key
            if isinstance(n, bool) or not hasattr(n, "__index__"):
                raise ShapeError(f"{what}: size of {name} must be a positive integer, got {n!r}")
            if int(n) < 0:  # zero-size axes are decided by resolve_sizes / the loop nest
                raise ShapeError(f"{what}: size of {name} must be a positive integer, got {int(n)}")
    if params is not None:
        if not hasattr(params, "items"):
            raise TypingError(f"{what}: params must be a dict {{parameter name: array}}, got {params!r}")
        known = sorted(e.box.param("pname") for e in d.eqns if e.box.kind == "param")
        for name in params:
            if name not in known:
                raise ShapeError(f"{what}: params names {name!r}, which is not a parameter of "
                                 f"{d.short()}; its parameters are {known}")


def _as_numpy(x, arr: Array | None = None) -> np.ndarray:
    """NumPy view of an input; torch tensors (any device, bf16/fp8 widened) are copied over."""
    if arr is not None and (x is None or isinstance(x, (str, bytes, dict, set))):
        raise ShapeError(f"input {arr}: expected an array, got {type(x).__name__} {x!r}"[:200])
    if arr is not None and not type(x).__module__.startswith("torch"):
        try:
            return np.asarray(x)
        except (ValueError, TypeError) as e:
            raise ShapeError(f"input {arr}: cannot be read as an array ({e})"[:300]) from None
    if type(x).__module__.startswith("torch"):
        t = x.detach().cpu()
        if t.is_floating_point() and t.element_size() < 2 or str(t.dtype) == "torch.bfloat16":
            t = t.float()  # NumPy has no bf16 / fp8: widen exactly
        return t.numpy()
    return np.asarray(x)


def _dtype_kind(x) -> tuple[str, object]:
    """NumPy kind letter and dtype of an array-like (a list has no ``.dtype``: read NumPy's)."""
    if not hasattr(x, "dtype"):
        dtype = np.asarray(x).dtype
        return dtype.kind, dtype
    return np.dtype(str(x.dtype).replace("torch.", "")).kind, x.dtype


def run_eqns(d: Diagram, env: list[np.ndarray], ctx: Ctx, eqn_ids=None) -> list:
    """Evaluate the equations ``eqn_ids`` (default: all) in place on ``env`` (var id -> array)."""
    ids = range(len(d.eqns)) if eqn_ids is None else eqn_ids
    for k in ids:
        e = d.eqns[k]
        outs = apply_box(e.box, [env[v] for v in e.ins], ctx)
        for v, o in zip(d.eqn_outputs(k), outs):
            env[v] = o
    return env
