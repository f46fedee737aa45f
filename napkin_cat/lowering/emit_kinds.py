"""Per-box-kind emitters: :data:`CODEGEN_RULES`, keyed exactly like
:data:`napkin_cat.ops.kinds.SPECS` (and :data:`napkin_cat.ops.semantics.NUMPY_RULES`).

Elementwise expressions come from the function table (:data:`napkin_cat.ops.functions.FUNCTIONS`,
its ``cuda`` templates), masks and biases from the index rules (:mod:`napkin_cat.ops.index`);
nothing here re-derives a function or a predicate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..core.errors import LoweringError
from ..ops.functions import CUDA_CONSTANTS, FUNCTIONS
from ..ops.index import constant_value
from ..ops.index_expr import COMPARISONS, Ix
from ..ops.kinds import NORMALISATIONS
from . import reindex, unswitch


@dataclass(frozen=True)
class KindRule:
    """How one box kind lowers.  ``cls``: ``elementwise`` (an expression evaluated wherever the
    value is read), ``reduction`` (a phase with inner loops), ``normaliser`` (row statistics,
    then an expression) or ``unsupported``; ``check(box)`` gives the reason a particular box
    cannot lower (or None); ``expr(em, box, args, env)`` renders an elementwise value;
    ``contraction``: a reduction over the product of its inputs (run on a contraction engine);
    ``norm(box)``: a normaliser's ``(a1, a2, b, eps)``."""

    cls: str
    check: Callable | None = None
    expr: Callable | None = None
    contraction: bool = False
    norm: Callable | None = None
    # how many leading inputs are values at the element; the others reach ``expr`` as variable
    # ids (auxiliary tensors an index expression gathers from: :func:`index_code`)
    pointwise: Callable | None = None
    # the input axes a reindexing reads at other indices (:mod:`.reindex`: read through its map)
    remaps: Callable | None = None

    def n_pointwise(self, box) -> int:
        """How many leading inputs of ``box`` are read at the element (the rest are gathered)."""
        return len(box.dom) if self.pointwise is None else self.pointwise(box)

    def reads_remapped(self, box) -> bool:
        """``box`` reads its input at other indices, through its index map."""
        return self.remaps is not None and bool(self.remaps(box))


def fn_expr(consts, fn: str, args: list[str], c: str | None = None) -> str:
    """``fn`` applied to the argument expressions ``args`` (and the constant named ``c``), from its
    ``cuda`` template; the float32 constants it names are registered in order of appearance."""
    try:
        f = FUNCTIONS[fn]
    except KeyError:
        raise LoweringError(f"no numba.cuda expression for elementwise function {fn!r}") from None
    named = {n: consts.f(CUDA_CONSTANTS[n], n) for n in f.cuda_constants()}
    a = args[0] if args else ""
    b = args[1] if len(args) > 1 else ""
    return f.cuda.format(a=a, b=b, c=c, **named)


def compound(x: str) -> bool:
    return any(ch in x for ch in " +-*/") and not (x.startswith("(") and x.endswith(")"))


def _expr_map(em, box, args, env):
    fn = box.param("fn")
    c = None
    if fn in FUNCTIONS and FUNCTIONS[fn].constant:
        value = constant_value(box.param("c"), em.sizes)
        c = em.consts.f(value, f"C_{fn.upper()}", comment=f"{box.name} constant")
    return fn_expr(em.consts, fn, [f"({x})" if compound(x) else x for x in args], c)


def positive_scale(em, v: int):
    """``(c, x)`` when variable ``v`` is ``scale(x, c)`` with a constant ``c > 0``, else None.
    A softmax over such scores keeps its maximum over ``x`` and folds ``c`` into the exponent:
    ``exp(c x - m) = exp2(x (c log2 e) - m log2 e)``, one fused multiply-add and one ``ex2`` per
    score instead of a multiply, a subtraction, a multiply and ``ex2``."""
    if v < em.plan.n_in or em.plan.var_cls(v) != "elementwise":
        return None
    e = em.dd.eqns[em.st.eqn_of[v]]
    if e.box.kind != "map" or e.box.param("fn") != "scale":
        return None
    c = constant_value(e.box.param("c"), em.sizes)
    return (c, e.ins[0]) if math.isfinite(c) and c > 0 else None


def scaled_exponent(em, v: int):
    """``(c, s, m)`` when variable ``v`` is ``exp(scale(s, c) - m)`` with a constant ``c > 0`` and
    the difference and the scaled scores computed inline for ``v`` alone (the backward's
    ``P = exp(S / sqrt(d) - L)``), else None.  Then ``P = exp2(s (c log2 e) - m log2 e)``: one
    fused multiply-add and one ``ex2`` per score, as the forward's softmax folds it
    (:func:`positive_scale`); ``m log2 e`` is a value of the row, computed once per row."""
    def inline_once(u):
        return (u >= em.plan.n_in and em.plan.storage(u) == "inline" and em.plan.var_cls(u) == "elementwise"
                and len(em.st.consumers[u]) == 1)

    def map_of(u, fn):
        e = em.dd.eqns[em.st.eqn_of[u]]
        return e if e.box.kind == "map" and e.box.param("fn") == fn else None
    if v < em.plan.n_in or em.plan.var_cls(v) != "elementwise" or map_of(v, "exp") is None:
        return None
    (u,) = map_of(v, "exp").ins
    if not inline_once(u) or map_of(u, "sub") is None:
        return None
    a, m = map_of(u, "sub").ins
    scaled = positive_scale(em, a) if inline_once(a) else None
    return None if scaled is None else (*scaled, m)


def aux_read(em, v: int, idx: dict) -> str:
    """Auxiliary tensor ``v`` at ``idx`` (``{axis: index code}``; its axes are never tiled) as
    an fp32 value: from its shared buffer, or from global memory where the final form keeps it
    there (:meth:`~napkin_cat.relabel.loopnest.FinalForm.in_place`)."""
    return em.sread(("var", v), idx) if ("var", v) in em.bufs else em.gread(v, idx)


def index_code(em, box, fn, args, env, as_float: bool = False) -> str:
    """An index expression (:mod:`napkin_cat.ops.index_expr`) as numba.cuda code, from its tree:
    axis indices as signed ints (``int64(q0 + i_q)``: differences may be negative; numba's
    ``int()`` keeps a uint32 unsigned, and ``i - j`` then wraps on the GPU), sizes as
    literals, gathers as reads of the auxiliary tensors' shared buffers (a whole tensor per
    block: its axes are neither tiled nor streamed, so a local index is the global one), or of
    global memory where the final form keeps the tensor there, at indices clamped into it; the
    score as ``args[0]``.  Integer arithmetic that meets a float, or that is compared, is
    computed in float32 where that is exact
    (:func:`exact_floats`); ``as_float``: the whole expression is converted to float32."""
    aux_vars = dict(zip((a.name for a in fn.auxes), args[1:]))
    row = env.get("_hoist")    # a micro-tile's row slot: reads without its column axis go there

    def in_range(k, size: int) -> bool:
        # an axis index of a tile or chunk that is never ragged stays inside an axis this long
        if k.op != "idx" or not isinstance(k.value, str) or k.value not in em.ax:
            return False
        a = em.ax[k.value]
        return not a.ragged and em.sizes[k.value] <= size

    def leaf(n):
        if n.op == "idx":
            if n.value == "score":
                return args[0]
            if isinstance(n.value, tuple):   # ("block", axis): the block's first index
                return f"int64({em.ax[n.value[1]].start})"
            return reindex.signed_index(em, n.value, env)
        if n.op == "size":
            return str(em.sizes[n.value])
        # a gather: indices clamped into the tensor, as the NumPy meaning reads it (the padding
        # rows and columns of a ragged tile read a valid entry; their scores are discarded)
        v = aux_vars[n.value.name]
        axes_ = em.types[v].axis_names
        # uint32: a shared offset (uint32) plus an int64 index is a float64 in numba's typing;
        # an index that cannot leave the tensor needs no clamp
        idx = {a: (f"uint32({em.gidx(k.value, env)})" if in_range(k, em.sizes[a]) else
                   f"uint32(min(max({k.to_code(leaf, fconst, fn_code)}, 0), {em.sizes[a] - 1}))")
               for a, k in zip(axes_, n.args)}
        read = aux_read(em, v, idx)
        if row is None or any(_reads(k, row.col) for k in n.args):
            return read
        key = ("gather", read)          # the same entry for every column of the row: read once
        if key not in row.memo:
            row.memo[key] = em.names.fresh(f"{n.value.name}_row")
            row.src(f"{row.memo[key]} = {read}")
        return row.memo[key]

    def float_leaf(k):
        # an exact float32 image of int subtree k; a subtree without the column axis once per row
        if row is not None and k.op != "const" and not _reads(k, row.col):
            key = ("float", k.key())
            if key not in row.memo:
                row.memo[key] = em.names.fresh("f_row")
                row.src(f"{row.memo[key]} = {float_code(k)}")
            return row.memo[key]
        return float_code(k)

    def float_code(k):
        if k.op == "idx":
            start = em.ax[k.value[1]].start if isinstance(k.value, tuple) else em.gidx(k.value, env)
            return f"float32(uint32{start})" if start.startswith("(") and start.endswith(")") else f"float32(uint32({start}))"
        if k.op in ("size", "const"):
            return fconst(float(em.sizes[k.value] if k.op == "size" else k.value))
        parts = [float_leaf(a) for a in k.args]
        if k.op in _FLOAT_OPS:
            return f"({parts[0]} {_FLOAT_OPS[k.op]} {parts[1]})"
        return f"(-{parts[0]})" if k.op == "neg" else f"{k.op}({', '.join(parts)})"

    def any_leaf(n):
        k = _float_image(n)
        return leaf(n) if k is None else float_leaf(k)

    fconst = lambda value: em.consts.f(value, comment=f"{box.name} constant")
    fn_code = lambda name, x: fn_expr(em.consts, name, [f"({x})" if compound(x) else x])
    # a block table's comparisons the code is written for are constants there (.unswitch)
    expr = block_quotients(em, unswitch.assumed(em, box, fn, fn.expr) if box.kind == "mask" else fn.expr)
    if as_float and expr.dtype == "int" and EXACT_FLOATS and _int_bounds(em, expr) is not None:
        return float_leaf(expr)
    code = exact_floats(em, expr).to_code(any_leaf, fconst, fn_code)
    return f"float32({code})" if as_float and expr.dtype == "int" else code


EXACT_F32 = 1 << 24
"""Integers of at most this magnitude are exact in float32: arithmetic on them that stays inside
is exact too, and cheaper on a GPU than 64-bit integers and a conversion per score."""

EXACT_FLOATS = True
"""Compute exact integer index arithmetic in float32 (:func:`exact_floats`); False keeps it in
int64 (a switch for measuring the rule: ``kernels/probes/index_floats.py``)."""

_FLOAT_OPS = {"add": "+", "sub": "-", "mul": "*"}
_EXACT_OPS = (*_FLOAT_OPS, "neg", "abs", "min", "max")


def _int_bounds(em, e: Ix):
    """``(lo, hi)`` of int expression ``e`` over the kernel's indices when it is built of axis
    indices, sizes, int constants and ``+ - * neg abs min max`` and every node stays within
    ``EXACT_F32``; else None."""
    op = e.op
    if op == "idx":
        a = e.value[1] if isinstance(e.value, tuple) else e.value
        if a == "score" or a not in em.ax:
            return None
        return 0, em.sizes[a] + em.ax[a].cap       # a ragged tile's padding indices run past its axis
    if op in ("size", "const"):
        v = em.sizes[e.value] if op == "size" else e.value
        if type(v) is not int:
            return None
        lo = hi = v
    elif op in _EXACT_OPS:
        kids = [_int_bounds(em, k) for k in e.args]
        if any(k is None for k in kids):
            return None
        if op == "neg":
            lo, hi = -kids[0][1], -kids[0][0]
        elif op == "abs":
            a, b = kids[0]
            lo, hi = (a, b) if a >= 0 else (-b, -a) if b <= 0 else (0, max(-a, b))
        elif op in ("min", "max"):
            f = min if op == "min" else max
            lo, hi = f(kids[0][0], kids[1][0]), f(kids[0][1], kids[1][1])
        elif op == "mul":
            ends = [x * y for x in kids[0] for y in kids[1]]
            lo, hi = min(ends), max(ends)
        else:
            (a, b), (c, d) = kids
            lo, hi = (a + c, b + d) if op == "add" else (a - d, b - c)
    else:
        return None
    return (lo, hi) if -EXACT_F32 <= lo and hi <= EXACT_F32 else None


def exact_floats(em, e: Ix) -> Ix:
    """``e`` with each int subtree that is converted to float32 (an operand of a float operation)
    or compared with another such subtree replaced by the leaf ``("float", subtree)``: computed in
    float32 from float32 indices, exact because every value stays within :data:`EXACT_F32`
    (:func:`_int_bounds`).  Indices of gathers stay ints."""
    if not e.args or e.op == "gather" or not EXACT_FLOATS:
        return e
    exact = [a.dtype == "int" and _int_bounds(em, a) is not None for a in e.args]
    floats = e.dtype == "float" or (e.op in COMPARISONS and (all(exact) or any(a.dtype == "float" for a in e.args)))
    args = tuple(Ix("idx", (), ("float", a)) if floats and ok else exact_floats(em, a)
                 for a, ok in zip(e.args, exact))
    return Ix(e.op, args, e.value)


def _float_image(n: Ix) -> Ix | None:
    """The int subtree that leaf ``n`` stands for in float32 (:func:`exact_floats`), else None."""
    v = n.value
    return v[1] if n.op == "idx" and isinstance(v, tuple) and v[0] == "float" else None


def _reads(e: Ix, axis: str) -> bool:
    """Whether index expression ``e`` varies along ``axis`` inside a block (reads its index, the
    score, or a gather that does; a block's first index, ``("block", axis)``, does not vary)."""
    if e.op == "idx":
        k = _float_image(e)
        return e.value in ("score", axis) if k is None else _reads(k, axis)
    return any(_reads(a, axis) for a in e.args if isinstance(a, Ix))


def block_quotients(em, e: Ix) -> Ix:
    """``e`` with each ``i // B`` (``i`` an axis index, ``B`` a positive int) whose block lies
    inside one B-block read at the block's first index: a tile or chunk of ``s`` elements starts at
    a multiple of ``s``, so when ``s`` divides ``B`` every index of it has the same quotient.  A
    block table ``bt[i // B, j // B]`` is then one read per chunk (the compiler hoists it), not one
    per score."""
    if e.op == "floordiv":
        i, b = e.args
        if i.op == "idx" and isinstance(i.value, str) and i.value in em.ax and b.op == "const" \
                and type(b.value) is int and b.value > 0:
            a = em.ax[i.value]
            if a.role in ("grid", "stream") and a.start is not None and a.cap > 1 and b.value % a.cap == 0:
                return Ix("floordiv", (Ix("idx", (), ("block", a.name)), b))
    if not e.args:
        return e
    return Ix(e.op, tuple(block_quotients(em, x) for x in e.args), e.value)


def _pointwise(box) -> int:
    return 1


def _check_mask(box):
    if box.param("pred").kind == "expr":
        return None
    if box.param("pred").rule.cuda is None:
        return (f"{box.name}: a custom predicate is a Python function on index arrays; only "
                f"causal(offset) and window(left, right) lower to numba.cuda")
    return None


def _expr_mask(em, box, args, env):
    """``score if keep else -inf``; inside a chunk that the mask keeps whole (the flag of
    :meth:`.emit_loads.Loads._chunk_flags`) the condition is not evaluated: ``full or keep``; in
    the code written for the chunks it keeps whole (:mod:`.unswitch`) the score alone."""
    pred = box.param("pred")
    full = em.full_flags.get((box.param("row"), box.param("col"), pred))
    if full is not None and full in em.assumed_full:   # written for the chunks it keeps whole (.unswitch)
        return args[0]
    if pred.kind == "expr":
        cond = index_code(em, box, pred, args, env)
    else:
        i = em.gidx(box.param("row"), env)
        j = em.gidx(box.param("col"), env)
        conds = pred.cuda(i, j, em.consts.u)
        if conds is None:
            raise LoweringError(f"{box.name}: its predicate has no numba.cuda code (a custom predicate)")
        cond = " and ".join(conds)
    if full is not None and ("not", full) not in em.assumed_full:
        cond = f"({full} or {cond if ' ' not in cond or cond.startswith('(') and cond.endswith(')') else f'({cond})'})"
    return f"{args[0]} if {cond} else {em.consts.f(-math.inf, 'NEG_INF')}"


def _check_index_bias(box):
    if box.param("bias").kind == "expr":
        return None
    if box.param("bias").rule.cuda is None:
        return f"{box.name}: a custom index bias is a Python function; only alibi(slope) lowers"
    return None


def _expr_index_bias(em, box, args, env):
    bias = box.param("bias")
    if bias.kind == "expr":
        return f"{args[0]} + {index_code(em, box, bias, args, env, as_float=True)}"
    i = em.gidx(box.param("row"), env)
    j = em.gidx(box.param("col"), env)
    bias = box.param("bias").cuda(i, j, lambda value, name: em.consts.f(
        value, name, comment=f"{box.name} {name.lower()}"))
    if bias is None:
        raise LoweringError(f"{box.name}: its bias has no numba.cuda code (a custom bias)")
    return f"{args[0]} + {bias}"


def _expr_index_map(em, box, args, env):
    return index_code(em, box, box.param("fn"), args, env)


def _check_scatter_aux(box):
    return (f"{box.name}: scatter-add into aux {box.param('at').aux.name} (the adjoint of a gather: "
            f"many positions add into one entry) is not lowered; it runs in the NumPy executor or "
            f"through its torch semantics")


def _expr_identity(em, box, args, env):
    return args[0]


def _check_cast(box):
    if box.cod[0].dtype.name not in ("f32", "f64"):
        return (f"{box.name}: cast to {box.cod[0].dtype.name}; the numba.cuda target computes "
                f"and stores fp32 only")
    return None


def _expr_const(em, box, args, env):
    return em.consts.f(box.param("value"), comment=f"{box.name}")


def _streamed_only(then: str):
    return lambda box: (f"{box.name} is only lowered as a streamed accumulator: stream axis "
                        f"{box.param('axis')} (or write {then} followed by contract)")


CODEGEN_RULES: dict[str, KindRule] = {
    "contract": KindRule("reduction", contraction=True),
    "map": KindRule("elementwise", None, _expr_map),
    "reduce": KindRule("reduction"),
    "softmax": KindRule("normaliser", norm=lambda box: (*NORMALISATIONS["softmax"], 0.0)),
    "normalize": KindRule("normaliser", norm=lambda box: (box.param("a1"), box.param("a2"), box.param("b"),
                                                          box.param("eps"))),
    "mask": KindRule("elementwise", _check_mask, _expr_mask, pointwise=_pointwise),
    "index_bias": KindRule("elementwise", _check_index_bias, _expr_index_bias, pointwise=_pointwise),
    "reindex": KindRule("elementwise", reindex.check, _expr_identity, remaps=reindex.remapped),
    "param": KindRule("unsupported", lambda box: (
        f"parameter {box.param('pname')!r} is a value bound at evaluation time; pass it to the "
        f"kernel as an input of the diagram instead")),
    "const": KindRule("elementwise", None, _expr_const),
    "cast": KindRule("elementwise", _check_cast, _expr_identity),
    "softmax_contract": KindRule("unsupported", _streamed_only("softmax")),
    "norm_contract": KindRule("unsupported", _streamed_only("normalize")),
    "index_map": KindRule("elementwise", None, _expr_index_map, pointwise=_pointwise),
    "scatter_aux": KindRule("unsupported", _check_scatter_aux),
}

# reductions: identity, binary combine, group (cross-thread) helper
REDUCE_OPS = {
    "sum": (0.0, "{a} + {b}", "_group_sum"),
    "mean": (0.0, "{a} + {b}", "_group_sum"),
    "max": (-math.inf, "max({a}, {b})", "_group_max"),
    "min": (math.inf, "min({a}, {b})", "_group_min"),
}
