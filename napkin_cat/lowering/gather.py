"""A reindexing as a kernel of its own: one thread per output element, read from HBM.

Where a reindexing cannot be read by its consumer inside one fused kernel (the input does not
fit a block's shared memory whole along the reindexed axes, or a schedule tiles them), the
multi-kernel cut (:mod:`.multi`) gives the run of reindexing boxes a kernel of its own: each
thread decodes its output element's indices, maps them to the input's through the same index
maps the fused kernels use (:func:`.reindex.read`: windows, padding, strides, dilations,
transposed-convolution holes, split, merge, slice), reads the input from global memory where
the index is valid and writes the element (zero elsewhere).  It reads one input element per
valid output element and writes every output element: :func:`gather_bytes` counts exactly that.

>>> import napkin_cat as nc
>>> from napkin_cat.core import Axis
>>> from napkin_cat.ops import Builder
>>> g = Builder()
>>> x = g.input("X", Axis("h", 5))
>>> d = g.diagram(g.unfold(x, Axis("h", 5), Axis("ho", 5), Axis("k", 3), offset=-1))
>>> k = gather_kernel(d, "pad_windows")
>>> gather_bytes(d)   # 13 valid reads of 4 bytes, 15 writes of 4 bytes
112
"""

from __future__ import annotations

import math

from ..core.diagram import Diagram
from ..core.errors import LoweringError
from . import reindex
from .source import Constants, Names, Source

THREADS = 128


class _Axis:
    __slots__ = ("cap",)

    def __init__(self, cap: int):
        self.cap = cap


class _GatherEmitter:
    """What :func:`.reindex.read` needs of an emitter, for a kernel whose every index is global."""

    def __init__(self, d: Diagram):
        self.d = d
        self.types = d.var_types()
        self.sizes = {a.name: a.size for a in d.axes}
        self.ax = {a: _Axis(n) for a, n in self.sizes.items()}
        self.names = Names({"e", "tid", "cuda", "math", "float32", "uint32", "int16", "ZERO16", "X", "Y"})
        self.zero = None       # the zero a read outside the input gives (None: fp32's ZERO)
        self.consts = Constants(self.names)
        self.eqn_of = {v: k for k in range(len(d.eqns)) for v in d.eqn_outputs(k)}

    def gidx(self, axis: str, env: dict) -> str:
        return env.get(axis) or self.consts.u(0, "U0")

    def value(self, v: int, env: dict, src: Source, memo=None, regs=None, define=None) -> str:
        if v < len(self.d.dom):
            arr = self.types[v]
            idx = None
            for a in arr.axis_names:
                i = self.gidx(a, env)
                idx = i if idx is None else f"({idx}) * {self.consts.u(self.sizes[a])} + {i}"
            return f"X[{idx or self.consts.u(0, 'U0')}]"
        e = self.d.eqns[self.eqn_of[v]]
        val = reindex.read(self, e.box, e.ins[0], env, src) if reindex.remaps(e.box) else \
            self.value(e.ins[0], env, src)
        tmp = self.names.fresh(f"{self.types[v].name}_{v}")
        src(f"{tmp} = {val}")
        return tmp


def is_gather(d: Diagram) -> bool:
    """``d`` is a chain of reindexings (one input, one output, each box reading the last) with
    at least one read through an index map."""
    if len(d.dom) != 1 or len(d.cod) != 1 or not d.eqns:
        return False
    for k, e in enumerate(d.eqns):
        if e.box.kind != "reindex" or reindex.check(e.box) is not None or e.ins != (k,):
            return False
    return d.outs == (len(d.eqns),) and any(reindex.remaps(e.box) for e in d.eqns)


def gather_kernel(d: Diagram, name: str):
    """A :class:`~napkin_cat.lowering.Kernel` computing the reindexing chain ``d`` (every size
    bound; fp32, or f16 / bf16 moved as their bit patterns) with one thread per output element."""
    from ..verify.backend import backend   # the Kernel class, without importing this stage's package
    Kernel, Launch = backend("Kernel"), backend("Launch")
    if not is_gather(d):
        raise LoweringError(f"{d.short()} is not a chain of reindexings with one input")
    kinds = {arr.dtype.name for arr in (*d.dom, *d.cod)}
    if len(kinds) != 1 or not kinds <= {"f32", "f16", "bf16"}:
        raise LoweringError(f"gather kernel {name}: {d.dom[0]} -> {d.cod[0]}; gather kernels move one float "
                            f"dtype, f32 or 16-bit patterns (f16, bf16)")
    (dtype,) = kinds
    for arr in (*d.dom, *d.cod):
        if any(not isinstance(a.size, int) for a in arr.axes):
            raise LoweringError(f"gather kernel {name}: {arr} has unbound sizes")
    em = _GatherEmitter(d)
    if dtype != "f32":     # 16-bit inputs travel as int16 patterns (.io): copied as they are
        em.zero = "ZERO16"
    out = d.cod[0]
    n = math.prod(a.size for a in out.axes)
    if n >= 2 ** 32 or math.prod(a.size for a in d.dom[0].axes) >= 2 ** 32:
        raise LoweringError(f"gather kernel {name}: more than 2**32 elements")
    body = Source(2)
    env, rest = {}, "e"
    for pos, a in enumerate(reversed(out.axes)):
        idx = em.names.fresh(f"i_{a.name}")
        last = pos == len(out.axes) - 1
        size = em.consts.u(a.size, f"N_{a.name}")
        body(f"{idx} = {rest}" if last else f"{idx} = {rest} % {size}")
        if not last:
            nxt = em.names.fresh(f"e_{a.name}")
            body(f"{nxt} = {rest} // {size}")
            rest = nxt
        env[a.name] = idx
    val = em.value(d.outs[0], env, body)
    total = em.consts.u(n, "N_OUT", comment=f"elements of {out}")
    sixteen = dtype != "f32"
    lines = [f'"""{name}: generated by napkin_cat.lower (numba.cuda gather, {dtype}); do not edit.', "",
             f"Diagram: {d}", "One thread per output element; the input is read through the index maps "
             "of the reindexings (zero where they leave it)"
             + ("; 16-bit values are copied as their bit patterns (int16)." if sixteen else "."), '"""', "",
             "from numba import cuda, float32, int64, uint32" + (", int16" if sixteen else ""), "",
             *(["ZERO16 = int16(0)"] if sixteen else []), *em.consts.header(), "", "",
             "@cuda.jit", f"def {name}(X, Y):", "    e = uint32(cuda.grid(1))", f"    if e < {total}:",
             *body.lines, f"        Y[e] = {val}", ""]
    source = "\n".join(lines)
    launch = Launch((-(-n // THREADS), 1, 1), (THREADS, 1, 1), 0)
    kernel = Kernel(d, source, name, launch, None, _Gen(d, n))
    kernel.options = {"threads": THREADS, "name": name}
    return kernel


class _Gen:
    """What :class:`~napkin_cat.lowering.Kernel` reads of a generated kernel."""

    def __init__(self, d: Diagram, n: int):
        from types import SimpleNamespace
        from ..relabel.loopnest import final_form
        self.plan = SimpleNamespace(ff=final_form(d))   # its loop nest: one element at a time
        self.notes = (f"Gather kernel: {n} threads, one per element of {d.cod[0]}; reads {d.dom[0]} "
                      f"through the reindexings' index maps.",)

    def mappings(self) -> dict:
        return {}


def gather_bytes(d: Diagram) -> int:
    """HBM bytes a gather kernel for ``d`` moves: one input read per valid output element, one
    write per output element (the valid elements counted per unfolded axis, or found by the
    NumPy meaning on an array of ones)."""
    valid = _valid_unfolds(d)
    if valid is None:
        import numpy as np
        from ..verify.executor import evaluate
        x = np.ones(tuple(a.size for a in d.dom[0].axes))
        valid = int(np.count_nonzero(evaluate(d, x)))
    out = math.prod(a.size for a in d.cod[0].axes)
    return d.dom[0].dtype.bytes * valid + d.cod[0].dtype.bytes * out


def _valid_unfolds(d: Diagram) -> int | None:
    """Valid output elements of a chain of unfolds of distinct input axes (a convolution's
    windows): per unfold, the ``(y, k)`` pairs whose position is an index of the axis, times
    the other output axes; None for any other chain.

    >>> from napkin_cat.core import Axis
    >>> from napkin_cat.ops import Builder
    >>> g = Builder()
    >>> x = g.input("X", Axis("c", 2), Axis("h", 5))
    >>> d = g.diagram(g.unfold(x, Axis("h", 5), Axis("ho", 5), Axis("k", 3), offset=-1))
    >>> _valid_unfolds(d)   # 13 valid windows positions per channel
    26
    """
    inputs = set(d.dom[0].axis_names)
    sizes = {a.name: a.size for a in d.axes}
    made: set[str] = set()
    valid = 1
    for e in d.eqns:
        p = e.box.param
        if e.box.kind != "reindex" or p("op") != "unfold" or p("axis") not in inputs or p("axis") in made:
            return None
        made.add(p("axis"))
        ny, nk = sizes[p("new")], sizes[p("window")] if p("window", None) else 1
        n, div = sizes[p("axis")], p("divisor")
        s, dl, off = p("stride"), p("dilation"), p("offset")
        valid *= sum(1 for y in range(ny) for k in range(nk)
                     if (pos := s * y + dl * k + off) % div == 0 and 0 <= pos // div < n)
    out = d.cod[0].axis_names
    for e in d.eqns:
        out = [a for a in out if a not in (e.box.param("new"), e.box.param("window", None))]
    return valid * math.prod(sizes[a] for a in out)


__all__ = ["gather_bytes", "gather_kernel", "is_gather"]
