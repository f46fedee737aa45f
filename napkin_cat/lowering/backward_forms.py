"""The backward plan of ``nc.torch_op`` (:func:`backward_plan`, :class:`BackwardPlan`: what the
backward runs and what the forward saves for it), and the form of an attention's backward, one
kernel or two, with the cost model's choice between them (:func:`choose_form`).

``nc.torch_op(d, backward=...)`` runs the residual backward of an attention in one of two forms
(:func:`~.backward_parts.fa2_parts`), both from :func:`~napkin_cat.ops.residuals.grad_with_residuals`:

* ``"two kernels"`` (FlashAttention-2): ``(dK, dV)`` on key tiles streaming the queries, then
  ``dQ`` on query tiles streaming the keys; ``S = Q K^T`` and ``dP = dO V^T`` are computed in
  both (14 tensor FLOPs per ``d q x``).
* ``"one kernel"``: ``dQ, dK, dV`` on key tiles streaming the queries,
  ``tile(x, g_x, partial="sum")``: each key tile adds its partial ``dQ`` into a zero-filled fp32
  output with atomics (10 tensor FLOPs per ``d q x``, plus an fp32 read and write of ``dQ``
  per key tile).  With 16-bit inputs ``dQ`` is that fp32 buffer, converted to the inputs'
  dtype after the kernel (FlashAttention-2's ``dq_accum``), since the atomics add fp32 values.
* ``None`` (the default): :func:`choose_form`.  Each form's parts are bound at the call's sizes
  and dtype, given the block sizes the lowering picks for a GPU (:func:`~.schedule.choose`,
  the op's ``tiles`` and ``threads``), and timed by the roofline of :func:`napkin_cat.cost` on
  the hardware profile of the tensors' device (:func:`hardware_for`) with fp32 on the op's engine
  (``fp32=``, :meth:`~napkin_cat.core.hardware.Hardware.fp32_on`); the 16-bit conversion of
  the fp32 ``dQ`` adds its HBM traffic.  The faster prediction runs; a tie keeps two kernels,
  and so do fp32 kernels on CUDA cores, measured (:data:`CUDA_CORE_ONE_KERNEL`).
  The one-kernel form is not eligible where its relabeling is refused (the reason in the
  choice and ``op.notes``); where no gradient sums over the keys (only dK, dV are needed) the
  forms are the same kernel, and two kernels is the name kept.

An auxiliary tensor's gradient (a scatter-add, run through torch) is the same in both forms and
left out of both predictions.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> att = nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
>>> sizes = {"q": 1024, "x": 1024, "d": 64}
>>> two, one = (backward_plan(att, form=f).bind(sizes) for f in FORMS[::-1])
>>> c = choose_form(two, one, nc.hardware.H100, lambda p: None, None, fp32="3xtf32")
>>> c.form, round(c.seconds("one kernel") * 1e6), round(c.seconds("two kernels") * 1e6)
('one kernel', 67, 94)
>>> c = choose_form(two, one, nc.hardware.H100, lambda p: None, None)   # fp32 on CUDA cores
>>> c.form, round(c.seconds("one kernel") * 1e6), round(c.seconds("two kernels") * 1e6)
('two kernels', 83, 116)
>>> c.why.split("; but ")[1][:42]
"on CUDA cores (fp32='fma') two kernels are"
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from math import prod

import numpy as np

from ..core.diagram import Diagram
from ..core.errors import LoweringError, NapkinError, TypingError
from ..core.hardware import A100_SXM4, H100, H200, Hardware
from ..core.types import DTYPES
from ..ops.boxes import retype
from ..ops.grad import grad
from ..ops.residuals import grad_with_residuals, saved_softmaxes, with_logsumexp
from ..relabel.split import split_axes
from .backward_parts import fa2_parts, has_scatter, read_only, relabel_like
from .plan import kernel_dtype

__all__ = ["FORMS", "BackwardPlan", "backward_plan", "at_dtype", "BackwardChoice", "check_form", "choose_form",
           "hardware_for"]

FORMS = ("one kernel", "two kernels")

# a CUDA device's name -> the profile whose numbers predict it (the first key in the name)
_PROFILES = (("H200", H200), ("H100", H100), ("A100", A100_SXM4))


def check_form(value, where: str):
    """``value`` if it is a value of the ``backward=`` option, else a TypingError naming them."""
    if value is None or (isinstance(value, str) and value in FORMS):
        return value
    raise TypingError(f"{where}: backward must be None (chosen by the cost model), "
                      f"{' or '.join(repr(f) for f in FORMS)}, got {value!r}")


def hardware_for(device=None) -> Hardware:
    """The profile the prediction uses for tensors on ``device``: a CUDA device's by its name
    (H200, H100, A100; another GPU gets the H100's numbers), and the H100, the GPU the kernels
    are written for, on the CPU and under the simulator (as :data:`~.devices.H100_DEFAULTS`).

    >>> import torch
    >>> hardware_for(torch.device("cpu")).name
    'H100 SXM5 80GB'
    """
    if device is not None and getattr(device, "type", None) == "cuda":
        return _cuda_profile(device.index)
    return H100


@functools.lru_cache(maxsize=None)
def _cuda_profile(index: int | None) -> Hardware:
    """The profile of CUDA device ``index`` (None: the current one), looked up once per device:
    the name query cost tens of microseconds of host time on every forward and backward."""
    import torch
    name = torch.cuda.get_device_name(index)
    return next((hw for key, hw in _PROFILES if key in name), H100)


@dataclass(frozen=True)
class BackwardChoice:
    """Which form ran and why: ``form`` (one of :data:`FORMS`); ``predicted``: ``(form, seconds)``
    for each form the cost model timed; ``hardware``: the profile's name; ``why``: the rule that
    decided (the predictions compared, the form asked for, or why one form was not eligible)."""

    form: str
    predicted: tuple[tuple[str, float], ...]
    hardware: str
    why: str

    def seconds(self, form: str) -> float | None:
        """The predicted time of ``form``, or None when it was not timed."""
        return dict(self.predicted).get(form)


def predict(plan, hw: Hardware, tiles_of, threads, fp32: str = "fma") -> float:
    """Predicted seconds of ``plan``'s (bound, typed) parts on ``hw``: each part at the block sizes
    the lowering picks for a GPU (``tiles_of(part)``: the op's ``tiles`` for it), plus the
    conversion of an fp32 output added across blocks to its gradient's dtype (read + write).
    ``fp32``: the engine the fp32 kernels are lowered with (``lower(..., fp32=...)``), which
    picks both their blocks and the rate their contractions are priced at
    (:meth:`~napkin_cat.core.hardware.Hardware.fp32_on`)."""
    from ..costmodel import cost
    from .planner import tf32x3
    from .schedule import choose
    final = {a.name: a.dtype for a in plan.diagram.cod}
    total = 0.0
    for part in plan.parts:
        if has_scatter(part):
            continue
        engine = fp32 if kernel_dtype(part) == "f32" else "fma"
        with tf32x3(engine == "3xtf32"):
            scheduled = choose(part, tiles_of(part), threads, simulate=False, hw=hw).diagram
        total += float(cost(scheduled).time(hw.fp32_on(engine), {}).seconds)
        if split_axes(part):
            moved = sum(prod(ax.size for ax in a.axes) * (a.dtype.bytes + final[a.name].bytes)
                        for a in part.cod if a.name in final and final[a.name] != a.dtype)
            total += moved / hw.bandwidth("HBM")
    return total


def choose_form(two, one, hw: Hardware, tiles_of, threads, fp32: str = "fma") -> BackwardChoice:
    """The form whose parts :func:`predict` times faster (its kernels' fp32 engine ``fp32``):
    ``two`` is the two-kernel plan, ``one`` the one-kernel plan or the reason it cannot be had
    (a string)."""
    if isinstance(one, str):
        return BackwardChoice("two kernels", (), hw.name, f"one kernel is not eligible: {one}")
    if not any(split_axes(p) for p in one.parts):
        return BackwardChoice("two kernels", (), hw.name, "no gradient sums over the keys (no dQ): "
                              "the two forms are the same kernel")
    unbound = sorted({a.name for p in two.parts for a in p.axes if a.symbolic})
    if unbound:
        return BackwardChoice("two kernels", (), hw.name, f"no sizes for {', '.join(unbound)}: nothing to predict")
    try:
        t_two = predict(two, hw, tiles_of, threads, fp32)
    except NapkinError as e:   # a part the schedule or the cost model refuses: nothing to compare
        return BackwardChoice("two kernels", (), hw.name, f"the two kernels were not costed, so they are "
                              f"kept: {type(e).__name__}: {e}")
    try:
        t_one = predict(one, hw, tiles_of, threads, fp32)
    except NapkinError as e:
        return BackwardChoice("two kernels", (), hw.name, f"one kernel is not eligible: it was not "
                              f"scheduled or costed: {type(e).__name__}: {e}")
    form = "one kernel" if t_one < t_two else "two kernels"
    fp32_parts = any(kernel_dtype(p) == "f32" for p in two.parts)
    on = hw.fp32_on(fp32).name if fp32_parts else hw.name
    why = f"predicted on {on}: one kernel {t_one * 1e3:.4g} ms, two kernels {t_two * 1e3:.4g} ms"
    if fp32_parts and fp32 == "fma" and form == "one kernel":
        form, why = "two kernels", f"{why}; but {CUDA_CORE_ONE_KERNEL}"
    if not fp32_parts and form == "two kernels" and warpgroup_one_kernel(hw):
        form, why = "one kernel", f"{why}; but {WARPGROUP_ONE_KERNEL}"
    return BackwardChoice(form, (("one kernel", t_one), ("two kernels", t_two)), hw.name, why)


WARPGROUP_ONE_KERNEL = (
    "16-bit kernels on warpgroup tensor cores take the one kernel: measured on an H100 (fp16, N = 4096, "
    "B*H = 32, forward + backward of one call), one kernel 2.064 against two 2.222 ms at d = 64, 1.552 / 1.659 "
    "causal, 4.166 / 4.529 at d = 128, 2.599 / 2.732 causal, and on an H200 1.205 / 1.536 ms at d = 64 causal, "
    "3.486 / 4.339 at d = 128, where the model predicts the two faster: it charges dQ's fp32 atomic adds "
    "(read and written once per key tile) at HBM's rate (kernels/BENCHMARKS.md, \"Fourth session of "
    "2026-11-25\" and \"Session of 2026-11-28 (H200), second\")")
"""Why the cost model's choice of two kernels is overruled for 16-bit kernels with warpgroup MMAs."""


def warpgroup_one_kernel(hw: Hardware) -> bool:
    """Whether :data:`WARPGROUP_ONE_KERNEL` applies: ``hw`` has warpgroup MMAs and they are on
    (``planner.WGMMA``)."""
    from . import planner
    from .wgmma import MIN_CC
    return bool(planner.WGMMA) and tuple(hw.compute_capability) >= MIN_CC


CUDA_CORE_ONE_KERNEL = ("on CUDA cores (fp32='fma') two kernels are kept: the one kernel measured 1.4x slower "
                        "on an H100 (N = 4096, d = 64: 63.0 against 44.1 ms forward + backward), for a cause "
                        "the roofline does not see: its dQ contraction's shared-memory reads conflict (65% of the "
                        "shared-load wavefronts are bank-conflict replays, shared memory 99% busy; its atomics "
                        "keep L2 4.5% busy; kernels/BENCHMARKS.md)")
"""Why the cost model's choice of one kernel is overruled for CUDA-core fp32: measured, not modelled."""


# --------------------------------------------------------------------------- the backward seam

@dataclass(frozen=True)
class BackwardPlan:
    """What the backward pass runs and what the forward keeps for it.

    ``diagram``: ``(saved arrays in the order of saves, one cotangent per output of d) ->
    (one cotangent per input in wrt)``, unrelabelled (the executor's reference).  ``saves``:
    names of the forward's arrays saved for it.  ``wrt``: indices of the inputs of ``d`` that
    get a cotangent.  The residual plan adds ``forward``: the diagram the forward runs instead
    of ``d`` (``d``'s outputs first, then the logsumexps; relabelled like ``d``), and ``parts``:
    the backward split FlashAttention-2's way, each part relabelled and reading its inputs by
    name from ``diagram.dom``; ``form``: theirs, ``"two kernels"`` or ``"one kernel"``
    (:mod:`.backward_forms`).  ``notes``: why the residual plan was not taken, or was cut."""

    diagram: Diagram
    saves: tuple[str, ...]
    wrt: tuple[int, ...]
    forward: Diagram | None = None
    parts: tuple[Diagram, ...] = ()
    notes: tuple[str, ...] = ()
    form: str | None = None

    @property
    def residual(self) -> bool:
        return self.forward is not None

    def bind(self, sizes: dict) -> "BackwardPlan":
        def b(dg):
            names = {a.name for a in dg.axes}
            got = {k: n for k, n in sizes.items() if k in names}
            return dg.bind(got) if got else dg
        return replace(self, diagram=b(self.diagram), forward=None if self.forward is None else b(self.forward),
                       parts=tuple(b(p) for p in self.parts))

    def at(self, dtype) -> "BackwardPlan":
        """The plan for inputs of ``dtype`` (a napkin_cat DType): every wire of every diagram
        in ``dtype`` (:func:`~napkin_cat.ops.boxes.retype`, the relabelings re-applied), except
        the logsumexps, which stay fp32 (as FlashAttention keeps them: ``P = exp(S - L)`` needs
        ``L`` to the scores' precision, and one fp32 per row is O(N) memory), the arrays a part
        computes for the others (``D = rowsum(dO O)``, the same reasons), and a part's
        outputs added across blocks (the one-kernel form's ``dQ``: fp32 atomics), converted to
        ``dtype`` after the kernel."""
        fixed = {}
        if self.forward is not None:
            fw = self.forward.unrelabelled()
            fixed = {fw.var_types()[sv.l].name: DTYPES["f32"] for sv in saved_softmaxes(fw)}

        # arrays one part computes for others (row terms: D = rowsum(dO O)) stay fp32 too
        passed = {a.name for p in self.parts for a in p.cod} & {a.name for p in self.parts for a in p.dom}
        fixed.update({n: DTYPES["f32"] for n in passed})

        def part_at(p):
            added = {a.name: DTYPES["f32"] for a in p.cod if any(not a.has(ax) for ax in split_axes(p))}
            return at_dtype(p, dtype, {**fixed, **added})
        return replace(self, diagram=at_dtype(self.diagram, dtype, fixed),
                       forward=None if self.forward is None else at_dtype(self.forward, dtype, fixed),
                       parts=tuple(part_at(p) for p in self.parts))


def backward_plan(d: Diagram, wrt: tuple[int, ...] | None = None, form: str = "two kernels") -> BackwardPlan:
    """The backward diagram of ``d`` and what the forward must save.

    When :func:`~napkin_cat.ops.residuals.with_logsumexp` finds a softmax-contraction in ``d``
    (attention), the residual plan: the forward also computes each row logsumexp ``L`` (``d``'s
    relabelings re-applied to the augmented diagram), saves the inputs, ``O`` and ``L`` (what the
    backward reads), and the backward is :func:`~napkin_cat.ops.residuals.grad_with_residuals`,
    split into ``(dK, dV)`` relabelled ``tile(x, g_x).stream(q, s_q)`` and ``dQ`` relabelled
    ``tile(q, g_q).stream(x, s_x)`` (``form="two kernels"``), or all in one part relabelled
    ``tile(x, g_x, partial="sum").stream(q, s_q)`` (``form="one kernel"``: dQ added across the key
    tiles; a :class:`~napkin_cat.core.errors.LoweringError` says why where that form cannot be had).
    Otherwise ``nc.grad(d, wrt)``, which recomputes what it needs from the inputs, so the inputs
    are all that is saved.

    >>> import napkin_cat as nc
    >>> plan = backward_plan(nc.library.matmul(*nc.axes("a b c")), wrt=(1,))
    >>> plan.saves, plan.wrt, [a.name for a in plan.diagram.cod], plan.residual
    (('A', 'B'), (1,), ['dB'], False)
    >>> flash = nc.library.attention().stream("x", "s_x").tile("q", "g_q")
    >>> plan = backward_plan(flash)
    >>> plan.saves, str(plan.forward)
    (('Q', 'K', 'V', 'O', 'L'), 'Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32, L[q] f32  | stream(x, s_x), tile(q, g_q)')
    >>> for part in plan.parts:
    ...     print([a.name for a in part.dom], [a.name for a in part.cod], part._sched_str())
    ['dO', 'O'] ['D'] tile(q, 64)
    ['Q', 'K', 'V', 'L', 'dO', 'D'] ['dK', 'dV'] tile(x, g_x), stream(q, s_q)
    ['Q', 'K', 'V', 'L', 'dO', 'D'] ['dQ'] tile(q, g_q), stream(x, s_x)
    >>> [part._sched_str() for part in backward_plan(flash, form="one kernel").parts]
    ['tile(q, 64)', 'tile(x, g_x, partial=sum), stream(q, s_q)']
    """
    check_form(form, "backward_plan")
    wrt = tuple(i for i, a in enumerate(d.dom) if a.dtype.kind == "float") if wrt is None else tuple(wrt)
    recompute = BackwardPlan(grad(d, wrt), tuple(a.name for a in d.dom), wrt)
    aug = with_logsumexp(d)
    refused = f"backward='one kernel' for {d.short()} cannot be honoured"
    if aug is None or not wrt:
        if form == "one kernel" and aug is None:
            raise LoweringError(f"{refused}: it has no softmax-contraction (attention), so its backward "
                                f"is nc.grad's, recomputed from the inputs; use backward=None")
        return recompute
    try:
        forward = relabel_like(aug, d.schedule)
    except NapkinError as e:
        note = (f"the forward with its logsumexp could not be relabelled like {d.short()} ({d._sched_str()}), "
                f"so the backward recomputes from the inputs: {e}")
        if form == "one kernel":
            raise LoweringError(f"{refused}: {note}") from None
        return replace(recompute, notes=(note,))
    cts = [a.name for a in d.cod]
    whole = grad_with_residuals(aug, wrt, cotangents=cts)
    whole = read_only(whole, keep=cts)
    saves = tuple(a.name for a in whole.dom)[: len(whole.dom) - len(cts)]
    try:
        parts, notes = fa2_parts(aug, wrt, cts, d.schedule, form)
    except NapkinError as e:   # only the one-kernel form raises
        raise LoweringError(f"{refused}: {e}") from None
    return BackwardPlan(whole, saves, wrt, forward, parts, notes, form if parts else None)


def at_dtype(d: Diagram, dtype, fixed: dict | None = None) -> Diagram:
    """``d`` with its float wires in ``dtype`` (those named in ``fixed`` in theirs), relabelled
    like ``d``; ``d`` itself when its wires already have those dtypes."""
    typed = retype(d, dtype, fixed)
    if (typed.dom, typed.cod, typed.eqns) == (d.dom, d.cod, d.eqns):
        return d
    return relabel_like(typed, d.schedule)


def residual_inputs(plan: BackwardPlan, part: Diagram):
    """For ``lower(part, check_inputs=...)``: the self-check's inputs of backward part ``part`` as
    the forward gives them.  The inputs of the forward and the cotangents are drawn (each rounded
    to its dtype), the forward's oracle computes its outputs (``O`` and the logsumexp ``L``) from
    them, and the parts before ``part`` their row terms (``D = rowsum(dO O)``).  Drawn alone, ``L``
    is no logsumexp of ``Q K^T``: ``P = exp(S - L)`` then reaches 1e83 where the forward keeps
    ``P <= 1``, and a 16-bit kernel packing ``P`` for its tensor cores overflows on inputs it never
    gets (kernels/BENCHMARKS.md, "Third session of 2026-11-25")."""
    from ..verify.executor import evaluate
    from ..verify.kernelcheck import as_kernel_inputs
    forward = plan.forward.unrelabelled()
    known = {a.name for a in (*forward.dom, *forward.cod)}
    drawn = [*forward.dom, *(a for a in plan.diagram.dom if a.name not in known)]   # inputs, cotangents
    before = plan.parts[:[id(p) for p in plan.parts].index(id(part))]

    def make(rng, draw):
        values = as_kernel_inputs([draw(rng, tuple(ax.size for ax in a.axes)) for a in drawn], drawn)
        have = {a.name: np.asarray(x, dtype=np.float64) for a, x in zip(drawn, values)}
        for dg in (forward, *(p.unrelabelled() for p in before)):   # O, L; then row terms such as D
            outs = evaluate(dg, *(have[a.name] for a in dg.dom), reference=True)
            have.update({a.name: np.asarray(o, dtype=np.float64)
                         for a, o in zip(dg.cod, outs if isinstance(outs, tuple) else (outs,))})
        return [have[a.name] for a in part.dom]
    return make
