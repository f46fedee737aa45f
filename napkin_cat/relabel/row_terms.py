"""Terms of a score's bias that a softmax cannot see, dropped before lowering.

``softmax_j(s_ij + r_i) = softmax_j(s_ij)``: a term of the bias that is constant along the
softmax's axis shifts every score of a row by the same amount, and the softmax divides it out.
A relative-position bias ``(i - j) c`` is ``i c - j c``; its row term ``i c`` changes nothing the
attention's output depends on, yet a kernel computing ``(i - j) c`` pays for it on every score.
:func:`drop_row_terms` rewrites such a bias to the terms that vary along the softmax's axis
(``-j c``), where the bias's value reaches the softmax and nothing else: through masks, other
biases and constant scales (each keeps a row's shift a row's shift), with no logsumexp or score
output that would see the shift.  O and its gradients are unchanged; a logsumexp computed from
the rewritten scores would lack the dropped terms, which is why one that is an output stops it.
:func:`napkin_cat.lower` applies it to 16-bit kernels (:data:`SWITCH`, which says why not to fp32
ones); :func:`napkin_cat.torch_op` only under :data:`TORCH_OP`, before it derives the forward with
its logsumexp and the backward.

Only the bias's additive structure is read: sums, differences, negation, products and quotients by
factors constant along the axis (``slope[h] * (j - i)`` is ``slope[h] j - slope[h] i``).  A bias
that is not such a sum (``abs(i - j)``, ``where``...), that reads the score, or whose kept terms
gather from fewer auxiliary tensors than it does, is left as it is.
"""

from __future__ import annotations

from ..core.diagram import Diagram, Eqn
from ..ops.boxes import index_bias_box
from ..ops.index import IndexBias

SWITCH = True
"""Drop the row terms of a bias before a softmax in :func:`napkin_cat.lower`'s 16-bit kernels
(False: compute the bias as written).  Measured on an H200 (fp16, N = 4096, d = 64, B*H = 32;
kernels/BENCHMARKS.md, "Sixth session of 2026-11-30"): ``s + (i - j) * 0.01``, the forward kernel
0.375 ms against 0.407 (FlexAttention 0.365); a per-head ALiBi written as a ``score_mod``, causal,
0.248 (0.260 in an earlier session).  Not in fp32 kernels: the kept term grows with the key index
(``slope[h] * j`` up to ``slope * N``) where the bias as written stays near 0 on the diagonal, and
fp32 carries an absolute error of about its size times 2**-24 into the exponent: the fp32 per-head
ALiBi (slopes up to 0.25, N = 4096) matched float64 to 6e-5 with it on the H200, 2e-7 to 4e-7
without it in earlier runs on an H100.  16-bit inputs round at 2**-8 to 2**-11, far above that."""

TORCH_OP = False
"""Drop them in :func:`napkin_cat.torch_op` too, before its forward and backward are derived (both
then read the rewritten bias and the logsumexp of the rewritten scores).  Off: measured in the same
runs, the backward kernel ran 0.997 and 0.974 ms against 0.969 and 0.959 with the bias as written,
the forward (with its logsumexp) 0.405 and 0.395 against 0.414 and 0.410: forward + backward level
or slower (1.458 against 1.442 ms steady); the backward's cause is not known."""

_PASSES = ("mask", "index_bias")      # boxes that keep a row's constant shift a constant shift


def _along(e, axis: str) -> bool:
    return axis in e.leaves("idx")


def _terms(e, axis: str) -> list[tuple[int, object]]:
    """``e`` as a signed sum ``[(+1 or -1, term)]``, distributing products and quotients by
    factors constant along ``axis`` over sums."""
    from ..ops.index_expr import Ix
    a = e.args
    if e.op == "add":
        return _terms(a[0], axis) + _terms(a[1], axis)
    if e.op == "sub":
        return _terms(a[0], axis) + [(-s, t) for s, t in _terms(a[1], axis)]
    if e.op == "neg":
        return [(-s, t) for s, t in _terms(a[0], axis)]
    if e.op in ("mul", "truediv") and _along(a[0], axis) and not _along(a[1], axis):
        return [(s, Ix(e.op, (t, a[1]))) for s, t in _terms(a[0], axis)]
    if e.op == "mul" and _along(a[1], axis) and not _along(a[0], axis):
        return [(s, Ix("mul", (a[0], t))) for s, t in _terms(a[1], axis)]
    return [(1, e)]


def _negated(t):
    """``-t`` without negating an integer (the kernels compute indices unsigned)."""
    from ..ops.index_expr import Ix
    for k in (1, 0):
        if t.op == "mul" and t.args[k].op == "const" and isinstance(t.args[k].value, float):
            args = list(t.args)
            args[k] = Ix("const", (), -t.args[k].value)
            return Ix("mul", tuple(args))
    return Ix("neg", (t,)) if t.dtype == "float" else Ix("mul", (t, Ix("const", (), -1.0)))


def along_terms(e, axis: str):
    """The terms of ``e`` that vary along ``axis`` (None where every term does, or none does)."""
    from ..ops.index_expr import Ix
    terms = _terms(e, axis)
    kept = [(s, t) for s, t in terms if _along(t, axis)]
    if len(kept) == len(terms) or not kept:
        return None
    s0, out = kept[0]
    out = out if s0 > 0 else _negated(out)
    for s, t in kept[1:]:
        out = Ix("add" if s > 0 else "sub", (out, t))
    return out


def _reaches_softmax_only(d: Diagram, var: int, axis: str, uses: dict) -> bool:
    """Whether ``var`` flows, as the score operand, through masks, biases and constant scales
    into one softmax along ``axis`` and nowhere else (not an output of ``d``)."""
    while True:
        if var in d.outs or len(uses[var]) != 1:
            return False
        e = d.eqns[uses[var][0]]
        if e.ins[0] != var or var in e.ins[1:]:
            return False
        kind = e.box.kind
        if kind in ("softmax", "softmax_contract"):
            return e.box.param("axis") == axis
        scale = kind == "map" and e.box.param("fn", None) == "scale" and len(e.ins) == 1
        if kind not in _PASSES and not scale:
            return False
        var = d.eqn_outputs(uses[var][0])[0]


def drop_row_terms(d: Diagram) -> tuple[Diagram, tuple[str, ...]]:
    """``d`` with each index bias that reaches a softmax alone (:func:`_reaches_softmax_only`)
    reduced to its terms along the softmax's axis, and a note per bias changed; ``d`` itself
    where none changes (or :data:`SWITCH` is off)."""
    from .rules import consumers
    if not SWITCH:
        return d, ()
    uses, eqns, notes = consumers(d), list(d.eqns), []
    for k, e in enumerate(d.eqns):
        bias = e.box.param("bias", None) if e.box.kind == "index_bias" else None
        if bias is None or bias.kind != "expr" or bias.expr.uses_score():
            continue
        axis = e.box.param("col")
        if not _reaches_softmax_only(d, d.eqn_outputs(k)[0], axis, uses):
            continue
        kept = along_terms(bias.expr, axis)
        if kept is None or [a.name for a in kept.auxes()] != [a.name for a in bias.expr.auxes()]:
            continue
        new = IndexBias("expr", (kept, bias.args[1], bias.args[2]))
        arr = d.var_types()[e.ins[0]]
        row = next(a for a in arr.axes if a.name == e.box.param("row"))
        col = next(a for a in arr.axes if a.name == axis)
        box = index_bias_box(arr, row, col, new, name=e.box.cod[0].name,
                             aux=[d.var_types()[v] for v in e.ins[1:]])
        eqns[k] = Eqn(box, e.ins)
        notes.append(f"{e.box.name}: its terms constant along {axis} dropped before the softmax over {axis} "
                     f"(a row's shift, which the softmax divides out): bias {kept}")
    if not notes:
        return d, ()
    return Diagram(d.dom, d.cod, tuple(eqns), d.outs, d.schedule), tuple(notes)
