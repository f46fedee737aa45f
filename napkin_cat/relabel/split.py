"""Split reductions: a *summed* axis tiled across blocks, the partial sums added at the output.

``tile(axis, size, partial="sum")`` partitions an axis that the diagram sums over (split-K of a
matmul, FlashAttention-2's ``dQ = dS K`` over the keys of a key tile).  Each block computes the
sum over its own group of ``axis`` and *adds* it into the output, which the launcher has filled
with zeros; the outputs that keep ``axis`` are tiled as by a plain ``tile``.  The relabelling
is allowed when

* every box that removes ``axis`` is a sum (``contract`` or ``reduce`` with ``op="sum"``): a
  sum over the whole axis is the sum of the sums over its groups, which is not true of a max,
  a mean (divided by the group's length), a logsumexp or an online softmax;
* each such sum is an output of the diagram and read by nothing else, so that nothing is
  applied to a partial sum before the partial sums meet;
* nothing acts along ``axis`` (a softmax or normalisation along it: the groups would not be
  independent), and every output either keeps ``axis`` or is one of those sums.

In the final form an output summed across blocks leaves its block through an
:class:`AddStore` (``add dQ[...] -> HBM``: a read-modify-write, fp32 atomics at the HBM level)
instead of a :class:`~.nodes.Store`; the executor, the cost model and the code generator read
that node.

>>> import napkin_cat as nc
>>> a, b, c = nc.axes("a b c")
>>> mm = nc.library.matmul(a=a, b=b, c=c).tile(b, 16, partial="sum").tile(a, 32)
>>> print(mm)
A[a b] f32, B[b c] f32 -> C[a c] f32  | tile(b, 16, partial=sum), tile(a, 32)
>>> print(mm.loop_nest().pseudocode(memory=False))
for b in tiles of 16  (grid, SMEM; partial sums of C added across the blocks)
  for a in tiles of 32  (grid, SMEM)
    load A[32 16] -> SMEM
    load B[16 c] -> SMEM
    C[32 c] = contract(A, B)  @SMEM
    add C[32 c] -> HBM  (atomic: partial sum over this block's b)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.diagram import Diagram
from ..core.errors import RelabelError
from .nodes import Loop, Store

COMBINES = ("sum",)
"""How partial results of the blocks of a split axis combine (``tile(..., partial=...)``)."""

_NOT_A_SUM = {
    "softmax_contract": "an online softmax (its row maximum and normaliser span the whole axis)",
    "norm_contract": "a normalised contraction (its normaliser spans the whole axis)",
}


@dataclass(frozen=True)
class AddStore(Store):
    """Add ``var`` (this block's partial sum over ``axes``) into ``dst``: a read-modify-write of
    the output, which starts at zero.  ``axes``: the summed axes tiled across blocks."""

    axes: tuple[str, ...] = ()

    def describe(self, buffer) -> str:
        return (f"add {buffer.describe()} -> {self.dst}  (atomic: partial sum over this block's "
                f"{', '.join(self.axes)})")


def check_partial(partial) -> str | None:
    if partial is None or partial in COMBINES:
        return partial
    raise RelabelError(f"tile(..., partial={partial!r}): the partial results of the blocks are combined by "
                       f"addition only; partial must be one of {list(COMBINES)} or None")


def _summing(box, axis: str) -> str | None:
    """None when ``box`` removes ``axis`` by a sum, else what it is instead."""
    if box.kind == "contract":
        return None
    if box.kind == "reduce":
        op = box.param("op")
        if op == "sum":
            return None
        if op == "mean":
            return f"a mean (a sum divided by the length of {axis}: each block would divide by its own)"
        return f"a {op} reduction, not a sum"
    return _NOT_A_SUM.get(box.kind, f"a {box.kind} box, not a sum")


def split_problem(d: Diagram, axis: str, acts_along) -> str | None:
    """None when the unrelabelled ``d`` may tile its summed ``axis`` with partial sums combined
    by addition (see the module docstring), else why not.  ``acts_along(box, axis)``: why a box
    that keeps ``axis`` is not weaved over it (:func:`.rules.acts_along`), or None."""
    types = d.var_types()
    uses: dict[int, list[int]] = {}
    for k, e in enumerate(d.eqns):
        for v in e.ins:
            uses.setdefault(v, []).append(k)
    summed = []
    for k, e in enumerate(d.eqns):
        if not any(types[v].has(axis) for v in e.ins):
            continue
        outs = d.eqn_outputs(k)
        if all(types[v].has(axis) for v in outs):
            why = acts_along(e.box, axis)
            if why:
                return why + "; groups along it would not be independent"
            continue
        what = _summing(e.box, axis)
        if what:
            return (f"{e.box.name} removes axis {axis} with {what}: the partial results of the blocks of "
                    f"{axis} do not combine by addition; stream {axis} instead")
        for v in outs:
            if v not in d.outs:
                return (f"{e.box.name} sums over {axis} into {types[v]}, which is not an output: each block "
                        f"would go on with its partial sum; only an output may be summed across blocks")
            if uses.get(v):
                readers = ", ".join(d.eqns[j].box.name for j in uses[v])
                return (f"{e.box.name} sums over {axis} into the output {types[v]}, which {readers} also "
                        f"reads: each block would read its partial sum, not the total")
        summed.extend(outs)
    for v in dict.fromkeys(d.outs):
        if not types[v].has(axis) and v not in summed:
            return (f"output {types[v]} has no axis {axis} and is not a sum over it: every block would "
                    f"add all of it")
    if not summed:
        return f"nothing in {d.short()} sums over {axis}: tile it without partial="
    return None


def split_axes(d: Diagram) -> tuple[str, ...]:
    """The axes ``d`` tiles with partial sums (``tile(axis, size, partial="sum")``)."""
    return tuple(r.axis for r in d.schedule if r.op == "tile" and r.extra[:1] == ("sum",))


def add_stores(d: Diagram, body: tuple) -> tuple:
    """``body`` with the stores of the outputs summed across blocks made :class:`AddStore`."""
    axes_ = split_axes(d)
    if not axes_:
        return body
    types = d.var_types()
    summed = {v: tuple(a for a in axes_ if not types[v].has(a)) for v in d.outs}

    def go(nodes):
        out = []
        for n in nodes:
            if isinstance(n, Loop):
                n = Loop(n.axis, n.step, n.kind, n.level, go(n.body))
            elif type(n) is Store and not n.flush and summed.get(n.var):   # a flush writes back what was added
                n = AddStore(n.var, n.level, n.dst, n.flush, summed[n.var])
            out.append(n)
        return tuple(out)
    return go(body)


def added_outputs(ff) -> dict[int, tuple[str, ...]]:
    """``{output variable: summed axes}`` of the outputs ``ff`` adds across blocks."""
    return {n.var: n.axes for n, _ in ff.walk() if isinstance(n, AddStore)}


def loop_note(ff, loop: Loop) -> str:
    """``; partial sums of dQ added across the blocks`` for a grid loop over a split axis."""
    if loop.kind != "grid":
        return ""
    names = [ff.diagram.var_types()[v].name for v, axes_ in added_outputs(ff).items() if loop.axis in axes_]
    return f"; partial sums of {', '.join(names)} added across the blocks" if names else ""
