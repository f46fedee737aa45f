"""Reference semantics: one rule per box kind, written once over an array namespace.

Each box kind has one rule in :data:`RULES`; a rule receives the box, its input arrays (axes
in the order of the box's ``dom``) and a context (:class:`Ctx` for NumPy, ``TorchCtx`` in
:mod:`.torch_semantics`), and returns arrays in the order of the box's ``cod``.  The context
carries the array namespace ``ctx.xp`` (:mod:`.arrays`), so the same rule is the NumPy oracle
every relabeling, cost claim and kernel is checked against, and the differentiable torch
function of :func:`napkin_cat.to_torch`.  Elementwise functions come from their one
definition in :mod:`.functions`, masks and biases from :mod:`.index`.

Rules use array shapes, not the declared sizes, so the tiled executor can run them on chunks;
masks and index biases add the chunk's global offset (``ctx.offsets``) to their indices.

NaN, +-inf and empty axes follow one policy at every level (this oracle, the tiled executor,
the torch function, generated kernels): see ``docs/NAN_POLICY.md``.  In short, a NaN
propagates to every output that depends on it; infinities follow IEEE arithmetic of the
max-shifted reference formulas; a fully masked softmax row (every score -inf) gives zeros; an
axis of size 0 is refused (:class:`~napkin_cat.core.errors.EmptyAxisError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..core.diagram import Array, Axis, Box, Diagram, DType, Ty
from ..core.errors import EmptyAxisError, ShapeError, TypingError, UnknownKindError
from .arrays import NUMPY
from .aux_grad import rule_index_map, rule_scatter_aux
from .functions import FUNCTIONS
from .index import constant_value
from .kinds import NORMALISATIONS

NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.float32, "fp8_e4m3": np.float32,
             "fp8_e5m2": np.float32, "i8": np.int8, "f64": np.float64}

NEG_INF = -math.inf


@dataclass
class Ctx:
    """The NumPy context: float64 everywhere (``reference``) or each wire's dtype."""

    sizes: dict = field(default_factory=dict)     # axis name -> int (global sizes)
    offsets: dict = field(default_factory=dict)   # axis name -> global index of position 0
    reference: bool = True                        # float64 everywhere
    params: dict = field(default_factory=dict)    # param name -> array
    xp = NUMPY

    def dtype(self, dt: DType):
        return np.float64 if self.reference and dt.kind == "float" else NP_DTYPES[dt.name]

    def convert(self, x, arr: Array):
        """``x`` as a value of wire ``arr`` (its dtype)."""
        return np.asarray(x, dtype=self.dtype(arr.dtype))

    def full(self, shape, value, arr: Array):
        return np.full(shape, value, dtype=self.dtype(arr.dtype))

    def param(self, value, arr: Array):
        return np.asarray(value)


# --------------------------------------------------------------------------- helpers on named arrays

def align(xp, x, src: tuple[str, ...], dst: tuple[str, ...]):
    """Permute ``x`` (axes ``src``) and insert unit axes so it broadcasts against ``dst``."""
    x = xp.permute(x, [src.index(n) for n in dst if n in src])
    sizes = iter(x.shape)
    return x.reshape([next(sizes) if n in src else 1 for n in dst])


def index_grid(xp, box_arr: Array, shape, row: str, col: str, offsets: dict, like=None, on=None):
    """Global row / column indices shaped to broadcast against an array of ``shape``
    (in ``like``'s float dtype where the namespace needs one for exact arithmetic)."""
    names = box_arr.axis_names
    ri, ci = names.index(row), names.index(col)
    ishape = [1] * len(shape); ishape[ri] = shape[ri]
    jshape = [1] * len(shape); jshape[ci] = shape[ci]
    i = xp.indices_(shape[ri], offsets.get(row, 0), like, on)
    j = xp.indices_(shape[ci], offsets.get(col, 0), like, on)
    return i.reshape(ishape), j.reshape(jshape)


def safe_softmax(xp, s, ax: int):
    """Softmax along ``ax`` (docs/NAN_POLICY.md): a fully masked row (every score -inf) gives
    zeros; a row holding a NaN or a +inf gives NaN everywhere (``exp(s - max s)`` in IEEE
    arithmetic: the max is NaN, or ``inf - inf``), never zeros."""
    m = xp.amax(s, ax, keepdims=True)
    # only a row with no score above -inf is shifted by 0 (NaN and +inf pass through); the
    # shift is only for range (softmax is shift-invariant), so no gradient flows through it
    m = xp.stop_gradient(xp.where(m == NEG_INF, 0.0, m))
    with xp.quiet():
        e = xp.exp(s - m)
        z = xp.sum(e, ax, keepdims=True)   # >= 1 unless fully masked (0), or NaN
        full = z == 0
        # both branches finite, or a backward pass turns 0 * inf into NaN
        return xp.where(full, 0.0, e / xp.where(full, 1.0, z))


def normalise(xp, x, ax: int, a1: str, a2: str, b: str, eps: float):
    if (a1, a2, b) == NORMALISATIONS["softmax"]:
        return safe_softmax(xp, x, ax)
    f1, f2, fb = FUNCTIONS[a1], FUNCTIONS[a2], FUNCTIONS[b]
    with xp.quiet():
        z = fb(xp, xp.sum(f2(xp, x), ax, keepdims=True)) + eps
        nz = z != 0
        return xp.where(nz, f1(xp, x) / xp.where(nz, z, 1.0), 0.0)


def einsum(xp, ins: list, dom: Ty, out_names: tuple[str, ...]):
    """Contract named arrays: one letter per axis name, in order of first appearance."""
    letters: dict[str, str] = {}
    for a in dom:
        for n in a.axis_names:
            if n not in letters:
                letters[n] = xp.letter(len(letters))
    spec = ",".join("".join(letters[n] for n in a.axis_names) for a in dom)
    return xp.einsum(spec + "->" + "".join(letters[n] for n in out_names), *ins)


def _dim(box: Box, key: str = "axis") -> int:
    return box.dom[0].axis_names.index(box.param(key))


# --------------------------------------------------------------------------- rules

def rule_contract(box: Box, ins, ctx):
    return (einsum(ctx.xp, ins, box.dom, box.cod[0].axis_names),)


def rule_map(box: Box, ins, ctx):
    xp, f = ctx.xp, FUNCTIONS[box.param("fn")]
    out_names = box.cod[0].axis_names
    args = [align(xp, x, a.axis_names, out_names) for x, a in zip(ins, box.dom)]
    c = box.param("c", None)
    with xp.quiet():
        res = f(xp, *args, c=None if c is None else constant_value(c, ctx.sizes))
    return (xp.broadcast_(res, xp.broadcast_shapes(*(a.shape for a in args))),)


def rule_reduce(box: Box, ins, ctx):
    xp, op, x, ax = ctx.xp, box.param("op"), ins[0], _dim(box)
    if op == "sum":
        return (xp.sum(x, ax),)
    if op == "max":
        return (xp.amax(x, ax),)
    if op == "min":
        return (xp.amin(x, ax),)
    if op == "mean":
        return (xp.mean(x, ax),)
    if op == "logsumexp":   # an all -inf row gives -inf
        return (xp.logsumexp_(x, ax),)
    raise UnknownKindError(f"no rule for reduction {op!r} (box {box.name})")


def rule_softmax(box: Box, ins, ctx):
    return (safe_softmax(ctx.xp, ins[0], _dim(box)),)


def rule_normalize(box: Box, ins, ctx):
    return (normalise(ctx.xp, ins[0], _dim(box), box.param("a1"), box.param("a2"), box.param("b"),
                      box.param("eps")),)


def index_env(xp, box: Box, fn, ins, ctx, like=None) -> dict:
    """What an index function reads: the global indices of its axes shaped to broadcast
    against the box's first input (``i`` / ``j``: its row and column), the sizes it names and
    its auxiliary arrays (the box's other inputs, whole)."""
    x, arr = ins[0], box.dom[0]
    if fn.kind != "expr":
        i, j = index_grid(xp, arr, x.shape, box.param("row"), box.param("col"), ctx.offsets, like, on=x)
        return {"i": i, "j": j}
    env = {}
    names = arr.axis_names
    for n in fn.index_axes():
        if n not in names:
            raise TypingError(f"{box.name}: its index function reads the index of axis {n}, which "
                              f"{arr} does not have")
        k = names.index(n)
        shape = [1] * len(x.shape)
        shape[k] = x.shape[k]
        env[n] = xp.indices_(x.shape[k], ctx.offsets.get(n, 0), None, x).reshape(shape)
    for n in fn.expr.leaves("size"):
        env[("size", n)] = int(ctx.sizes[n])
    for a, v in zip(fn.auxes, ins[1:]):
        env[a.name] = v
    return env


def rule_mask(box: Box, ins, ctx):
    xp, x, pred = ctx.xp, ins[0], box.param("pred")
    keep = xp.as_index_result(pred.values(xp, index_env(xp, box, pred, ins, ctx)), None, on=x)
    return (xp.where(keep, x, NEG_INF),)


def rule_index_bias(box: Box, ins, ctx):
    xp, x, bias = ctx.xp, ins[0], box.param("bias")
    env = index_env(xp, box, bias, ins, ctx, like=x)
    return (x + xp.as_index_result(bias.values(xp, env), x, on=x),)


def rule_reindex(box: Box, ins, ctx):
    xp, x, src, dst = ctx.xp, ins[0], box.dom[0], box.cod[0]
    op, names, shape = box.param("op"), src.axis_names, tuple(x.shape)
    if op == "transpose":
        return (xp.permute(x, [names.index(n) for n in dst.axis_names]),)
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
        return (xp.narrow(x, k, start, stop - start),)
    if op == "diagonal":
        keep, drop = box.param("keep"), box.param("drop")
        dg = xp.diagonal_(x, names.index(keep), names.index(drop))  # the diagonal axis goes last
        rest = [n for n in names if n not in (keep, drop)] + [keep]
        return (xp.permute(dg, [rest.index(n) for n in dst.axis_names]),)
    if op == "rename":
        return (x,)
    if op == "unfold":
        return (_unfold(xp, x, box, ctx),)
    raise UnknownKindError(f"no rule for reindex op {op!r} (box {box.name})")


def _unfold(xp, x, box: Box, ctx):
    """Gather ``x`` at ``(stride*y + dilation*k + offset) / divisor`` (zero where that is no
    index of the axis): one index array, one take, one where."""
    src, dst, p = box.dom[0], box.cod[0], box.param
    k = src.axis_names.index(p("axis"))
    names = [p("new")] + ([p("window")] if p("window", None) else [])
    n_out = [int(ctx.sizes.get(n, dst.axes[dst.axis_names.index(n)].size)) for n in names]
    y = xp.indices_(n_out[0], 0, on=x).reshape(-1, 1)
    w = xp.indices_(n_out[1], 0, on=x).reshape(1, -1) if len(names) == 2 else 0
    pos = y * p("stride") + w * p("dilation") + p("offset")
    pos = pos + 0 * y + 0 * w                     # the full (y, k) grid, even where it is constant
    n_in = x.shape[k]
    ok = (pos % p("divisor") == 0) & (pos >= 0) & (pos < n_in * p("divisor"))
    idx = xp.where(ok, pos // p("divisor"), 0)
    out_shape = tuple(x.shape[:k]) + tuple(n_out) + tuple(x.shape[k + 1:])
    got = xp.take_(x, idx.reshape(-1), k).reshape(out_shape)
    keep = ok.reshape([1] * k + n_out + [1] * (len(x.shape) - k - 1))
    return xp.where(keep, got, 0.0)


def rule_param(box: Box, ins, ctx):
    name, arr = box.param("pname"), box.cod[0]
    if name not in ctx.params:
        raise ShapeError(f"parameter {arr} has no value: pass params={{'{name}': array}}")
    value = ctx.param(ctx.params[name], arr)
    shape = concrete_shape(arr, ctx.sizes)
    if tuple(value.shape) != shape:
        raise ShapeError(f"parameter {arr}: expected shape {shape}, got {tuple(value.shape)}")
    return (value,)


def rule_const(box: Box, ins, ctx):
    arr = box.cod[0]
    return (ctx.full(concrete_shape(arr, ctx.sizes), box.param("value"), arr),)


def rule_cast(box: Box, ins, ctx):
    # float -> float keeps the working precision; float -> i8 truncates toward zero
    return (ctx.convert(ins[0], box.cod[0]),)


def rule_softmax_contract(box: Box, ins, ctx):
    s, v = ins
    return (einsum(ctx.xp, [safe_softmax(ctx.xp, s, _dim(box)), v], box.dom, box.cod[0].axis_names),)


def rule_norm_contract(box: Box, ins, ctx):
    s, v = ins
    p = normalise(ctx.xp, s, _dim(box), box.param("a1"), box.param("a2"), box.param("b"), box.param("eps"))
    return (einsum(ctx.xp, [p, v], box.dom, box.cod[0].axis_names),)


RULES: dict[str, Callable] = {
    "contract": rule_contract, "map": rule_map, "reduce": rule_reduce, "softmax": rule_softmax,
    "normalize": rule_normalize, "mask": rule_mask, "index_bias": rule_index_bias,
    "reindex": rule_reindex, "param": rule_param, "const": rule_const, "cast": rule_cast,
    "softmax_contract": rule_softmax_contract, "norm_contract": rule_norm_contract,
    "index_map": rule_index_map, "scatter_aux": rule_scatter_aux,
}
NUMPY_RULES = RULES   # NumPy and torch read the same rules (through their namespaces)


def apply_box(box: Box, ins: list, ctx) -> tuple:
    """Run one box: its kind's rule, then every output converted to its wire's dtype."""
    try:
        rule = RULES[box.kind]
    except KeyError:
        raise UnknownKindError(f"no rule for box kind {box.kind!r} (box {box.name}); "
                               f"known kinds: {sorted(RULES)}") from None
    return tuple(ctx.convert(o, a) for o, a in zip(rule(box, ins, ctx), box.cod))


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
