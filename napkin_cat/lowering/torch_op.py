"""``torch_op(d)``: a (relabelled) diagram as a differentiable torch operation.

>>> import torch, napkin_cat as nc
>>> from napkin_cat.lowering.torch_op import torch_op
>>> q, x, d = nc.axes("q x d")
>>> op = torch_op(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"), simulate=False)
>>> Q, K, V = (torch.randn(n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
>>> O = op(Q, K, V)
>>> O.sum().backward()
>>> op.last_path, op.last_backward_path, tuple(K.grad.shape)
('executor', 'executor-fa2', (7, 4))

**Forward.**  The diagram is bound at the tensors' sizes and run by one of three paths, which
``op.last_path`` names after every call (never silently):

* ``"gpu"``: float32 / float16 / bfloat16 CUDA tensors; a kernel from :func:`napkin_cat.lower`,
  launched on torch's current stream.
* ``"simulator"``: float32 / float16 / bfloat16 CPU tensors while numba.cuda is (or will be)
  its CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``; ``simulate=True`` requires it, ``False`` refuses it):
  the same generated kernel, run by the simulator.
* ``"executor"``: everything else (float64 anywhere, float32 CPU tensors without the simulator):
  the tiled NumPy executor (:func:`napkin_cat.evaluate`) runs the relabelled diagram's loop nest,
  its block sizes completed as the lowering would (:func:`.schedule.choose`); float64 in float64
  (the reference semantics, so ``torch.autograd.gradcheck`` can check the op), float32 in
  float32.  A CUDA tensor taking this path is copied to the host and back, and ``op.notes`` says why.

Kernels, schedules and backward diagrams are cached per (sizes, dtype, device).

**Backward.**  :func:`backward_plan` is the seam: given the diagram (and the inputs that need a
gradient) it returns the backward diagram and what the forward must save for it.

* The residual plan, when :func:`~napkin_cat.ops.residuals.with_logsumexp` finds a softmax feeding
  a contraction over its axis (attention): the forward runs the diagram with each row logsumexp
  ``L`` as an extra output (``d``'s relabelings re-applied to it), saves the inputs, ``O`` and
  ``L`` (``op.last_saves``), and the backward is FlashAttention-2's
  (:func:`~napkin_cat.ops.residuals.grad_with_residuals`) in one of two forms
  (:mod:`.backward_forms`), the ``backward=`` option: ``"two kernels"``, ``(dK, dV)`` relabelled
  ``tile(x, g_x).stream(q, s_q)`` and ``dQ`` relabelled ``tile(q, g_q).stream(x, s_x)``; or
  ``"one kernel"``, all of them relabelled ``tile(x, g_x, partial="sum").stream(q, s_q)``, each key
  tile adding its partial ``dQ`` into a zero-filled fp32 output with atomics (with 16-bit inputs
  that fp32 ``dQ`` is converted to their dtype after the kernel).  ``None`` (default): the form
  whose parts the cost model predicts faster at the call's sizes and dtype, on the hardware
  profile of the tensors' device (the H100's on the CPU and under the simulator);
  ``op.backward_choice`` holds both predicted times, and a one-kernel form that cannot be had is
  said in ``op.notes``.  A form asked for by name that cannot be had raises a
  :class:`~napkin_cat.core.errors.LoweringError` (never the other form in its place).  On the
  ``"gpu"`` and ``"simulator"`` paths each part is lowered (:func:`napkin_cat.lower` picks the
  block sizes) and ``op.last_backward_path`` is ``"gpu-fa2"`` / ``"simulator-fa2"``, with
  ``"-atomic"`` when ``dQ`` was added across key tiles; otherwise, or when a part refuses to
  lower (the refusal in ``op.notes``), the NumPy executor runs the whole backward (or that
  part) in float64: ``"executor-fa2"``.  A forward with ``L`` that does not lower is replaced by the
  kernel of ``d`` for its outputs and the executor for ``L`` (said in ``op.notes``).
  The auxiliary tensors of an attention variant (a learned bias table, a per-head scale) form a
  third part (:mod:`.backward_parts`): their gradient is a scatter-add that no kernel computes, so
  on the kernel paths it runs through the torch semantics of its diagram on the tensors' device
  (said in ``op.notes``) while the other parts run as kernels.
* Otherwise (an MLP; or the relabelings do not apply to the augmented diagram, said in
  ``op.notes``): :func:`napkin_cat.grad`, which recomputes the forward values it needs, so only
  the inputs are saved.  It runs through the NumPy executor (float64 inside, cast to the inputs'
  dtype); on float32 CUDA tensors it is first lowered, and a
  :class:`~napkin_cat.core.errors.LoweringError` is recorded in ``op.notes`` before falling back
  to the executor (``op.last_backward_path``: ``"gpu"`` or ``"executor"``).

**Dtypes.**  All inputs share one dtype and one device.  float64: the reference path (the
executor, in float64).  float32, float16, bfloat16: the kernel dtypes; the op runs the user's
diagram retyped to the inputs' dtype (:meth:`TorchOp.typed`, :func:`at_dtype`; the user's
diagram is not changed), so a kernel reads and writes 16-bit arrays and computes in fp32 between
them (tensor cores where the shapes fit).  With 16-bit inputs: the outputs and ``O`` are 16-bit,
the logsumexp residual ``L`` is fp32 (:meth:`BackwardPlan.at`; ``exp(S - L)`` needs ``L`` to the
scores' precision), ``dO`` is what autograd passes (the outputs' dtype), and every gradient comes
back in the inputs' dtype.  The executor runs 16-bit inputs in float64 and rounds the results
once, as the kernels round what they store.

**Parameters.**  A diagram with ``Builder.param`` boxes is refused: a parameter is a constant of
:func:`napkin_cat.grad` (no cotangent), so pass weights as inputs (``Builder.input``, as
``nc.library.mlp`` does: ``op(X, W1, b1, W2, b2)``) and their gradients flow.
"""

from __future__ import annotations

from functools import partial

import torch

from ..core.diagram import Diagram
from ..core.errors import LoweringError, ShapeError, TypingError
from ..core.types import DTYPES, Ty
from ..ops.boxes import exact_inputs
from ..ops.residuals import with_logsumexp
from ..relabel.split import split_axes
from .backward_forms import (FORMS, BackwardChoice, BackwardPlan, at_dtype, backward_plan, check_form,
                             choose_form, hardware_for)
from .backward_parts import has_scatter, relabel_like, run_torch_part
from .distributed import DistributedOp, device_plan
from .plan import FP32_ENGINES, kernel_dtype
from .unpad import to_dtype
from .torch_dtypes import (HALF_DTYPES, KERNEL_DTYPE, REFERENCE_DTYPE, TORCH_DTYPES, _host, _io_name, _launch,
                           _out_dtypes, _to_torch, kernel_path)

__all__ = ["torch_op", "TorchOp", "BackwardPlan", "backward_plan", "relabel_like", "FORMS"]

PATHS = ("gpu", "simulator", "executor")
BACKWARD_PATHS = (*PATHS, "gpu-fa2", "simulator-fa2", "executor-fa2", "gpu-fa2-atomic", "simulator-fa2-atomic")


# --------------------------------------------------------------------------- the op

def torch_op(d: Diagram, *, tiles: dict | None = None, threads: int | None = None,
             simulate: bool | None = None, verify: bool | int = True, backward: str | None = None,
             prefetch: bool | str = "auto", fp32: str = "fma") -> "TorchOp":
    """``d`` as a differentiable torch callable ``op(*tensors)`` (see the module docstring).

    ``tiles``, ``threads``, ``verify``: passed to :func:`napkin_cat.lower` (and ``tiles`` to the
    executor's schedule); a ``tiles`` entry applies to the diagrams that have its block symbol or
    axis, the backward parts' symbols included.  ``simulate``: for float32 CPU tensors, ``None`` runs the generated
    kernel under numba's simulator when it is active and the executor otherwise; ``True``
    requires the simulator; ``False`` always takes the executor.  ``backward``: the form of an
    attention's backward (:mod:`.backward_forms`): ``None`` chooses by the cost model's prediction
    at each call's sizes, ``"one kernel"`` (dQ added across key tiles with fp32 atomics) or
    ``"two kernels"`` (FlashAttention-2's); a form asked for that cannot be had raises.
    ``prefetch``: passed to every :func:`napkin_cat.lower` of the op (forward, backward parts, the
    blocks of a split over the devices): ``False``, ``True`` (the next chunk into registers),
    ``"double"`` (two shared-memory buffers per chunked input) or ``"auto"`` (the default:
    ``"double"`` for each 16-bit kernel whose registers and shared memory allow it, else none;
    fp32 kernels none on CUDA cores, ``"double"`` on tensor cores); the executor paths have no chunks to prefetch, so there it changes
    nothing but the kernels it would build.  ``fp32``: how the kernels of float32 calls multiply,
    ``"fma"`` (CUDA cores) or ``"3xtf32"`` (tensor cores, fp32-level error: the attention forward
    + backward 4x faster on an H100 and 1.12-1.40x SDPA fp32, kernels/BENCHMARKS.md); 16-bit calls use tensor cores."""
    if not isinstance(d, Diagram):
        raise TypingError(f"torch_op needs a Diagram, got {type(d).__name__}")
    check_form(backward, "torch_op")
    if not (prefetch is False or prefetch is True or prefetch in ("double", "auto")):
        raise TypingError(f"torch_op: prefetch must be False, True, 'double' or 'auto', got {prefetch!r}")
    if fp32 not in FP32_ENGINES:
        raise TypingError(f"torch_op: fp32 must be one of {FP32_ENGINES} (fp32 FMAs on CUDA cores, or tensor "
                          f"cores by 3xTF32), got {fp32!r}")
    if simulate not in (None, True, False):
        raise TypingError(f"torch_op: simulate must be None, True or False, got {simulate!r}")
    if tiles is not None and not isinstance(tiles, dict):
        raise TypingError(f"torch_op: tiles must be a dict {{axis or symbol: size}}, got {tiles!r}")
    if len(d.params):
        names = ", ".join(a.name for a in d.params)
        raise TypingError(f"torch_op({d.short()}): parameters ({names}) are Builder.param boxes, constants "
                          f"to nc.grad, so no gradient could reach them; make them inputs (Builder.input) "
                          f"and pass their tensors after the others")
    ints = [str(a) for a in d.dom if a.dtype.kind != "float"]
    if ints:
        raise TypingError(f"torch_op({d.short()}): inputs {', '.join(ints)} are integer arrays; torch_op "
                          f"takes float inputs only (every input is differentiable)")
    if not len(d.cod):
        raise TypingError(f"torch_op({d.short()}): the diagram has no output")
    if backward is not None and with_logsumexp(d) is None:
        raise TypingError(f"torch_op({d.short()}): backward={backward!r} chooses the form of an attention's "
                          f"backward, and this diagram has no softmax-contraction (its backward is nc.grad's)")
    if device_plan(d) is not None and fp32 != "fma":
        raise TypingError(f"torch_op({d.short()}): fp32={fp32!r} is not passed to the kernels of a split over "
                          f"the devices (they run fp32 on CUDA cores); leave it 'fma'")
    if device_plan(d) is not None:   # split over the devices: one process per GPU (distributed.py)
        # each block pair's backward is a single-device op in the form asked for
        block_op = partial(TorchOp, backward=backward, prefetch=prefetch)
        return DistributedOp(d, dict(tiles or {}), threads, verify, backward_op=block_op, prefetch=prefetch,
                             simulate=simulate)
    return TorchOp(d, dict(tiles or {}), threads, simulate, verify, backward, prefetch=prefetch, fp32=fp32)


class TorchOp:
    """A diagram as a torch operation: ``op(*tensors)`` returns one tensor (or a tuple, one per
    output) that autograd differentiates.  ``last_path`` / ``last_backward_path``: the path the
    last forward / backward took (:data:`PATHS`, :data:`BACKWARD_PATHS`); ``last_saves``: the
    names of the arrays the last forward saved for the backward; ``backward_choice``: the
    :class:`~.backward_forms.BackwardChoice` of the last plan (its form, both predicted times;
    None for a plan with no FlashAttention-2 parts); ``notes``: why a path was not the fast one
    (a refused lowering, a copy to the host), each said once; ``rewrites``: how the diagram was
    rewritten before anything was derived from it (:func:`~napkin_cat.relabel.row_terms.drop_row_terms`)."""

    def __init__(self, d: Diagram, tiles: dict, threads, simulate, verify, backward: str | None = None, *,
                 prefetch: bool | str = "auto", fp32: str = "fma"):
        from ..relabel import row_terms
        # a bias's terms that the softmax divides out, where TORCH_OP says: dropped before the forward
        # and backward are derived, so the logsumexp both see is that of the scores the kernels compute
        self.diagram, self.rewrites = row_terms.drop_row_terms(d) if row_terms.TORCH_OP else (d, ())
        self.tiles, self.threads, self.simulate, self.verify = tiles, threads, simulate, verify
        self.prefetch, self.fp32 = prefetch, fp32
        self.backward_form = backward   # the option: None (the cost model chooses) or one of FORMS
        self.backward_choice: BackwardChoice | None = None
        self.last_path: str | None = None
        self.last_backward_path: str | None = None
        self.last_saves: tuple[str, ...] = ()
        self.notes: list[str] = []
        self._cache: dict = {}   # (what, sizes, ...) -> kernel, schedule, bound plan, or an error text
        self._alive: dict = {}   # id -> backward part keyed by identity in _cache (kept alive)
        # the inputs a mask compares (ops.boxes.exact_inputs): f32 in every dtype of the op,
        # given as any float or integer tensor
        self._exact = exact_inputs(self.diagram.unrelabelled())

    def __repr__(self) -> str:
        return f"torch_op({self.diagram})"

    def __call__(self, *tensors):
        sizes = self._check(tensors)
        out = _DiagramFunction.apply(self, sizes, *tensors)
        return out[0] if len(out) == 1 else out

    # ---- checks: before anything is computed or cached
    def _check(self, tensors) -> tuple:
        """The symbolic axes' sizes, ``((name, n), ...)``; refuses a wrong count, a non-tensor, a
        dtype outside the policy, mixed dtypes or devices, and shapes that do not fit."""
        d = self.diagram
        if len(tensors) != len(d.dom):
            names = ", ".join(str(a) for a in d.dom)
            raise ShapeError(f"{self!r} takes {len(d.dom)} tensors ({names}), got {len(tensors)}")
        for arr, t in zip(d.dom, tensors):
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{self!r}: input {arr}: expected a torch.Tensor, got {type(t).__name__}")
        exact = self._exact
        for arr, t in zip(d.dom, tensors):
            if arr.name in exact and (t.dtype in (KERNEL_DTYPE, REFERENCE_DTYPE, *HALF_DTYPES) or _integer(t)):
                continue   # values a mask compares (ids): read as f32 whatever the op's dtype
            if t.dtype not in (KERNEL_DTYPE, REFERENCE_DTYPE, *HALF_DTYPES):
                raise TypingError(f"{self!r}: input {arr} is {t.dtype}; torch_op takes torch.float32, "
                                  f"torch.float16 or torch.bfloat16 (kernels) or torch.float64 (reference executor)"
                                  + (f"; the values a mask compares ({', '.join(exact)}) may also be integers"
                                     if exact else ""))
        first = tensors[0]
        for arr, t in zip(d.dom, tensors):
            if t.dtype != first.dtype and arr.name not in exact:
                raise TypingError(f"{self!r}: input {arr} is {t.dtype} but {d.dom[0]} is {first.dtype}; "
                                  f"every input must have one dtype")
            if t.device != first.device:
                raise ShapeError(f"{self!r}: input {arr} is on {t.device} but {d.dom[0]} is on "
                                 f"{first.device}; every input must be on one device")
        sizes: dict[str, int] = {}
        seen: dict[str, str] = {}
        for arr, t in zip(d.dom, tensors):
            if t.dim() != len(arr.axes):
                raise ShapeError(f"{self!r}: input {arr}: expected {len(arr.axes)} axes "
                                 f"({' '.join(arr.axis_names)}), got a tensor of shape {tuple(t.shape)}")
            for ax, n in zip(arr.axes, t.shape):
                n = int(n)
                if n == 0:
                    raise ShapeError(f"{self!r}: input {arr}: axis {ax.name} has size 0; every axis needs "
                                     f"at least one element")
                if not ax.symbolic and n != ax.size:
                    raise ShapeError(f"{self!r}: input {arr}: axis {ax.name} is bound to {ax.size}, got a "
                                     f"tensor of shape {tuple(t.shape)}")
                if ax.name in sizes and sizes[ax.name] != n:
                    raise ShapeError(f"{self!r}: input {arr}: axis {ax.name} has size {n}, but input "
                                     f"{seen[ax.name]} gave {ax.name} = {sizes[ax.name]}")
                if ax.symbolic:
                    sizes.setdefault(ax.name, n)
                    seen.setdefault(ax.name, arr.name)
        return tuple(sorted(sizes.items()))

    # ---- caches
    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _bound(self, sizes: tuple, d: Diagram | None = None, tag: str = "forward") -> Diagram:
        d = self.diagram if d is None else d
        return self._cached(("bound", tag, sizes), lambda: d.bind(dict(sizes)) if sizes else d)

    def _kernel(self, sizes: tuple, device: torch.device, d: Diagram | None = None, tag: str = "forward"):
        from . import lower
        return self._cached(("kernel", tag, sizes, str(device)), lambda: lower(
            self._bound(sizes, d, tag), tiles=self._tiles(d), threads=self.threads, verify=self.verify,
            prefetch=self.prefetch, fp32=self._fp32(d)))

    def _fp32(self, d: Diagram) -> str:
        """The ``fp32`` option for lowering ``d``: the op's, for an fp32 kernel (16-bit ones take none)."""
        return self.fp32 if kernel_dtype(d) == "f32" else "fma"

    def _tiles(self, d: Diagram) -> dict | None:
        """The ``tiles`` entries naming a block symbol or an axis of ``d``: one dict serves the
        forward (``s_x``, ``g_q``) and the backward parts (``g_x``, ``s_q``; ``g_q``, ``s_x``)."""
        mine = {r.size for r in d.schedule if isinstance(r.size, str)} | {a.name for a in d.axes}
        return {k: v for k, v in self.tiles.items() if getattr(k, "name", k) in mine} or None

    def _scheduled(self, sizes: tuple, d: Diagram | None = None, tag: str = "forward") -> Diagram:
        """The bound diagram with every block size an int, as the lowering would choose them."""
        from .schedule import choose
        return self._cached(("schedule", tag, sizes), lambda: choose(
            self._bound(sizes, d, tag), self._tiles(d), self.threads, simulate=False).diagram)

    def typed(self, dtype: torch.dtype) -> Diagram:
        """This op's diagram at the inputs' dtype: every float wire retyped (:func:`at_dtype`) for
        a kernel dtype (float32, float16, bfloat16); as given for float64 (the executor computes
        the reference in float64 whatever the wires say)."""
        if dtype == REFERENCE_DTYPE:
            return self.diagram
        return self._cached(("typed", dtype), lambda: at_dtype(self.diagram, DTYPES[_io_name(dtype)]))

    def backward_plan(self, wrt: tuple[int, ...], sizes: tuple = (), dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> BackwardPlan:
        """:func:`backward_plan` of this op's diagram in the form of the ``backward`` option (None:
        the one :func:`~.backward_forms.choose_form` predicts faster on the profile of ``device``,
        :func:`~.backward_forms.hardware_for`; float64 keeps two kernels, the executor runs it),
        bound at ``sizes``, its diagrams at the inputs' ``dtype`` for a kernel dtype
        (:meth:`BackwardPlan.at`; None or float64: as derived) (cached; sets ``backward_choice``)."""
        hw = hardware_for(device)
        plan, choice = self._cached(("chosen", wrt, sizes, dtype, hw.name),
                                    lambda: self._chosen(wrt, sizes, dtype, hw))
        self.backward_choice = choice
        return plan

    def _form_plan(self, wrt, sizes, dtype, form: str) -> BackwardPlan:
        def make():
            plan = self._cached(("plan", wrt, form), lambda: backward_plan(self.diagram, wrt, form))
            for n in plan.notes:
                self._note(n)
            if dtype is not None and dtype != REFERENCE_DTYPE:
                plan = self._cached(("plan", wrt, form, dtype), lambda: plan.at(DTYPES[_io_name(dtype)]))
            return plan.bind(dict(sizes))
        return self._cached(("plan", wrt, form, sizes, dtype), make)

    def _chosen(self, wrt, sizes, dtype, hw) -> tuple[BackwardPlan, BackwardChoice | None]:
        if self.backward_form is not None:
            try:
                plan = self._form_plan(wrt, sizes, dtype, self.backward_form)
            except LoweringError as e:
                raise LoweringError(f"{self!r}: {e}") from None
            asked = BackwardChoice(self.backward_form, (), hw.name, f"backward={self.backward_form!r}")
            return plan, asked if plan.parts else None
        two = self._form_plan(wrt, sizes, dtype, "two kernels")
        if not two.parts:
            return two, None
        if dtype in (None, REFERENCE_DTYPE):
            return two, BackwardChoice("two kernels", (), hw.name, "float64 (or no dtype given): the NumPy "
                                       "executor runs the backward, no kernels to choose between")
        try:
            one = self._form_plan(wrt, sizes, dtype, "one kernel")
        except LoweringError as e:
            one = str(e)
        choice = choose_form(two, one, hw, self._tiles, self.threads, self.fp32)
        if choice.why.startswith("one kernel is not eligible"):
            self._note(f"backward of {self.diagram.short()} at {dict(sizes)}: {choice.why}")
        return (one if choice.form == "one kernel" else two), choice

    # ---- forward
    def _forward_path(self, dtype: torch.dtype, device: torch.device) -> str:
        """:func:`~.torch_dtypes.kernel_path`, with a note where the executor stands in."""
        path = kernel_path(self, dtype, device, self.simulate)
        if dtype == REFERENCE_DTYPE and device.type == "cuda":
            self._note("float64 CUDA tensors run the reference executor on the host (copied there and "
                       "back); the kernels compute in float32")
        elif device.type == "cuda" and path == "executor":
            self._note("CUDA tensors while numba.cuda is its simulator: the simulator cannot read them, "
                       "so the executor ran on host copies")
        elif device.type not in ("cpu", "cuda"):
            self._note(f"tensors on {device.type}: the executor ran on host copies")
        return path

    def forward(self, sizes: tuple, tensors, plan: BackwardPlan | None = None) -> tuple[torch.Tensor, ...]:
        """The outputs of ``d``, then (with a residual ``plan``) the logsumexps its backward reads."""
        first = tensors[0]
        path = self._forward_path(first.dtype, first.device)
        d, tag = ((self.typed(first.dtype), f"forward {first.dtype}") if plan is None or not plan.residual
                  else (plan.forward, f"residuals {first.dtype}"))
        if path == "executor":
            from ..verify.executor import evaluate
            # float32 in float32; float64 and 16-bit in float64, the 16-bit outputs rounded once at
            # the end (as the kernels round what they store)
            outs = evaluate(self._scheduled(sizes, d, tag), *_host(tensors), reference=first.dtype != KERNEL_DTYPE)
            outs = _to_torch(outs, _out_dtypes(d, first.dtype), first.device)
        else:
            outs = self._kernel_forward(sizes, tensors, d, tag)
        self.last_path = path
        return outs

    def _kernel_forward(self, sizes, tensors, d: Diagram, tag: str) -> tuple[torch.Tensor, ...]:
        first = tensors[0]
        try:
            kernel = self._kernel(sizes, first.device, d, tag)
        except LoweringError as e:
            if not tag.startswith("residuals"):
                raise
            self._note(f"the forward with its logsumexp ({d.short()}) was not lowered, so the kernel of "
                       f"{self.diagram.short()} computed its outputs and the NumPy executor the logsumexp "
                       f"(on host copies): {e}")
            outs = self._kernel_forward(sizes, tensors, self.typed(first.dtype), f"forward {first.dtype}")
            extra = Diagram(d.dom, Ty(*d.cod[len(outs):]), d.eqns, d.outs[len(outs):])
            from ..ops.grad import prune
            from ..verify.executor import evaluate
            rest = evaluate(prune(extra.unrelabelled()).bind(dict(sizes)) if sizes else prune(extra.unrelabelled()),
                            *_host(tensors), reference=True)
            return (*outs, *_to_torch(rest, _out_dtypes(extra, first.dtype), first.device))
        return _launch(kernel, tensors, d)

    # ---- backward
    def backward(self, sizes: tuple, wrt: tuple[int, ...], saved, cotangents,
                 dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The cotangents of the inputs in ``wrt``, in the inputs' ``dtype``."""
        device = saved[0].device
        plan = self.backward_plan(wrt, sizes, dtype, device)
        typed = self._bound(sizes, self.typed(dtype), f"forward {dtype}")
        cts = tuple(torch.zeros(_shape(a), dtype=t, device=device) if g is None else g
                    for g, a, t in zip(cotangents, typed.cod, _out_dtypes(typed, dtype)))
        args = (*saved, *cts)
        path = self._forward_path(dtype, device)
        if plan.residual:
            return self._residual_backward(plan, wrt, sizes, args, path, dtype)
        if path == "gpu":
            kernel = self._backward_kernel(plan.diagram, wrt, sizes, device)
            if kernel is not None:
                self.last_backward_path = "gpu"
                return _launch(kernel, args, plan.diagram)
        from ..verify.executor import evaluate
        outs = evaluate(plan.diagram, *_host(args), reference=True)
        self.last_backward_path = "executor"
        return _to_torch(outs, _out_dtypes(plan.diagram, dtype), device)

    def _residual_backward(self, plan: BackwardPlan, wrt, sizes, args, path: str, dtype: torch.dtype):
        """The FlashAttention-2 parts as kernels on the kernel paths (a part that does not lower
        runs in the executor, noted), the whole residual backward in the executor otherwise."""
        from ..verify.executor import evaluate
        device = args[0].device
        named = dict(zip((a.name for a in plan.diagram.dom), args))
        if path == "executor" or not plan.parts:
            outs = evaluate(plan.diagram, *_host(args), reference=True)
            self.last_backward_path = "executor-fa2"
            return _to_torch(outs, _out_dtypes(plan.diagram, dtype), device)
        plan = self._lowerable_form(plan, wrt, sizes, dtype, device)
        got, fell = {}, False
        for part in plan.parts:
            # an earlier part's output (a row term, lowering/backward_parts.row_terms) or a saved array
            ins = [(got[a.name] if a.name in got else named[a.name]).detach().contiguous() for a in part.dom]
            if has_scatter(part):   # auxiliary tensors' gradients: a scatter-add, not lowered
                self._note(f"the gradients {', '.join(a.name for a in part.cod)} (scatter-adds into auxiliary "
                           f"tensors, not lowered) ran through their torch semantics on {device}")
                got.update(zip((a.name for a in part.cod), run_torch_part(part, ins, _out_dtypes(part, dtype))))
                continue
            kernel = self._backward_kernel(part, wrt, sizes, device, plan)
            if kernel is None:
                outs, fell = _to_torch(evaluate(part.unrelabelled(), *_host(ins), reference=True),
                                       _out_dtypes(part, dtype), device), True
            else:
                outs = _launch(kernel, ins, part)
            got.update(zip((a.name for a in part.cod), outs))
        atomic = "-atomic" if any(map(split_axes, plan.parts)) else ""   # dQ added across key tiles
        self.last_backward_path = "executor-fa2" if fell else f"{path}-fa2{atomic}"
        # the one-kernel form's fp32 dQ, converted to the inputs' dtype
        # (a padded one, lowering/staged_add.py, by the conversion kernel of lowering/unpad.py)
        return tuple(to_dtype(got[a.name], t) for a, t in zip(plan.diagram.cod, _out_dtypes(plan.diagram, dtype)))

    def _lowerable_form(self, plan: BackwardPlan, wrt, sizes, dtype, device) -> BackwardPlan:
        """``plan``, or the two kernels where ``plan`` is the one kernel this op chose (not one
        the caller asked for) and a part of it does not lower: two kernels that lower beat one
        in the executor (noted)."""
        if plan.form != "one kernel" or self.backward_form is not None:
            return plan
        if all(has_scatter(p) or self._backward_kernel(p, wrt, sizes, device, plan) is not None for p in plan.parts):
            return plan
        two = self._form_plan(wrt, sizes, dtype, "two kernels")
        if [a.name for a in two.diagram.dom] != [a.name for a in plan.diagram.dom]:
            return plan
        self._note(f"backward of {self.diagram.short()} at {dict(sizes)}: the one kernel chosen did not lower, "
                   f"so the two kernels run")
        return two

    def _backward_kernel(self, diagram: Diagram, wrt, sizes, device, plan: BackwardPlan | None = None):
        """The lowered backward diagram, or None (the refusal recorded in ``notes``).  ``tiles``
        entries that name one of its block symbols (``g_x``, ``s_q``, ...) or axes apply to it.
        A part of residual ``plan`` is self-checked on inputs its forward would give it
        (:func:`~.backward_forms.residual_inputs`)."""
        from . import lower
        from .backward_forms import residual_inputs

        def make():
            related = residual_inputs(plan, diagram) if plan is not None and self.verify else None
            try:
                return lower(diagram, tiles=self._tiles(diagram), threads=self.threads, verify=self.verify,
                             prefetch=self.prefetch, fp32=self._fp32(diagram), check_inputs=related)
            except LoweringError as e:
                self._note(f"backward {diagram.short()} of {self.diagram.short()} at {dict(sizes)} was not "
                           f"lowered, so it ran in the NumPy executor on host copies: {e}")
                return None
        # keyed by the part itself (its identity: printing it per call cost 25-45 us of host time);
        # the plans that hold the parts are cached, and _alive keeps each keyed part alive
        self._alive.setdefault(id(diagram), diagram)
        return self._cached(("backward kernel", id(diagram), wrt, sizes, str(device)), make)


class _DiagramFunction(torch.autograd.Function):
    """``apply(op, sizes, *tensors)``: saves what the backward plan reads (the inputs, and with
    a residual plan the outputs and logsumexps too); ``op.last_saves`` names them."""

    @staticmethod
    def forward(ctx, op: TorchOp, sizes: tuple, *tensors):
        wrt = tuple(i for i, n in enumerate(ctx.needs_input_grad[2:]) if n)
        plan = op.backward_plan(wrt, sizes, tensors[0].dtype, tensors[0].device) if wrt else None
        outs = op.forward(sizes, tensors, plan)
        ctx.op, ctx.sizes, ctx.n_in, ctx.dtype = op, sizes, len(tensors), tensors[0].dtype
        names = [a.name for a in op.diagram.dom] + ([a.name for a in plan.forward.cod] if plan and plan.residual else [])
        by_name = dict(zip(names, (*tensors, *outs)))
        saves = plan.saves if plan is not None else tuple(names[: len(tensors)])
        ctx.save_for_backward(*(by_name[n] for n in saves))
        op.last_saves = saves
        return outs[: len(op.diagram.cod)]

    @staticmethod
    def backward(ctx, *cotangents):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        wrt = tuple(i for i, n in enumerate(need) if n)
        got = ctx.op.backward(ctx.sizes, wrt, saved, cotangents, ctx.dtype) if wrt else ()
        grads: list = [None] * ctx.n_in
        for i, g in zip(wrt, got):
            grads[i] = g
        return (None, None, *grads)


# --------------------------------------------------------------------------- conversions

def _shape(arr) -> tuple[int, ...]:
    return tuple(a.size for a in arr.axes)


def _integer(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool
