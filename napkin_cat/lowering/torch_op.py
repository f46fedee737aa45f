"""``torch_op(d)``: a (relabelled) diagram as a differentiable torch operation.

>>> import torch, napkin_cat as nc
>>> from napkin_cat.lowering.torch_op import torch_op
>>> q, x, d = nc.axes("q x d")
>>> op = torch_op(nc.library.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q"), simulate=False)
>>> Q, K, V = (torch.randn(n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
>>> O = op(Q, K, V)
>>> O.sum().backward()
>>> op.last_path, op.last_backward_path, tuple(K.grad.shape)
('executor', 'executor', (7, 4))

**Forward.**  The diagram is bound at the tensors' sizes and run by one of three paths, which
``op.last_path`` names after every call (never silently):

* ``"gpu"``: float32 CUDA tensors; a kernel from :func:`napkin_cat.lower`, launched on torch's
  current stream.
* ``"simulator"``: float32 CPU tensors while numba.cuda is (or will be) its CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``; ``simulate=True`` requires it, ``simulate=False`` refuses it):
  the same generated kernel, run by the simulator.
* ``"executor"``: everything else (float64 anywhere, float32 CPU tensors without the simulator):
  the tiled NumPy executor (:func:`napkin_cat.evaluate`) runs the relabelled diagram's loop nest,
  its block sizes completed as the lowering would (:func:`.schedule.choose`); float64 in float64
  (the reference semantics, so ``torch.autograd.gradcheck`` can check the op), float32 in
  float32.  A CUDA tensor taking this path is copied to the host and back, and ``op.notes`` says why.

Kernels, schedules and backward diagrams are cached per (sizes, dtype, device).

**Backward.**  :func:`backward_plan` is the seam: given the diagram (and the inputs that need a
gradient) it returns the backward diagram and what the forward must save for it.  Today that is
:func:`napkin_cat.grad` (which recomputes the forward values it needs) and the inputs only;
saving residuals (the output and the softmax's logsumexp) is a change to that one function and
to the diagram it returns.  The backward diagram runs through the NumPy executor (float64
inside, cast to the inputs' dtype); on float32 CUDA tensors it is first lowered with
:func:`napkin_cat.lower`, and a :class:`~napkin_cat.core.errors.LoweringError` is recorded in
``op.notes`` before falling back to the executor (``op.last_backward_path``: ``"gpu"`` or
``"executor"``).

**Dtypes.**  float32 (what the kernels compute in) and float64 (the reference path).  bfloat16
and float16 are refused: the kernels run on CUDA cores in float32, and bf16/fp16 inputs belong to
the tensor-core (``mma``) engine that is not written yet; cast explicitly (``.float()``) to use
the float32 kernels.  All inputs share one dtype and one device.

**Parameters.**  A diagram with ``Builder.param`` boxes is refused: a parameter is a constant of
:func:`napkin_cat.grad` (no cotangent), so pass weights as inputs (``Builder.input``, as
``nc.library.mlp`` does: ``op(X, W1, b1, W2, b2)``) and their gradients flow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.diagram import Diagram
from ..core.errors import LoweringError, ShapeError, TypingError
from ..ops.grad import grad

__all__ = ["torch_op", "TorchOp", "BackwardPlan", "backward_plan"]

KERNEL_DTYPE = torch.float32       # what the generated kernels compute in
REFERENCE_DTYPE = torch.float64    # the executor's reference path (gradcheck)
PATHS = ("gpu", "simulator", "executor")


# --------------------------------------------------------------------------- the backward seam

@dataclass(frozen=True)
class BackwardPlan:
    """What the backward pass runs and what the forward keeps for it.

    ``diagram``: ``(saved arrays in the order of saves, one cotangent per output of d) ->
    (one cotangent per input in wrt)``.  ``saves``: names of the forward's arrays saved for it
    (inputs of ``d`` today; residuals such as ``O`` and a logsumexp later).  ``wrt``: indices of
    the inputs of ``d`` that get a cotangent."""

    diagram: Diagram
    saves: tuple[str, ...]
    wrt: tuple[int, ...]


def backward_plan(d: Diagram, wrt: tuple[int, ...] | None = None) -> BackwardPlan:
    """The backward diagram of ``d`` and what the forward must save: today ``nc.grad(d, wrt)``,
    which recomputes what it needs from the inputs, so the inputs are all that is saved.

    >>> import napkin_cat as nc
    >>> plan = backward_plan(nc.library.matmul(*nc.axes("a b c")), wrt=(1,))
    >>> plan.saves, plan.wrt, [a.name for a in plan.diagram.cod]
    (('A', 'B'), (1,), ['dB'])
    """
    wrt = tuple(i for i, a in enumerate(d.dom) if a.dtype.kind == "float") if wrt is None else tuple(wrt)
    return BackwardPlan(grad(d, wrt), tuple(a.name for a in d.dom), wrt)


# --------------------------------------------------------------------------- the op

def torch_op(d: Diagram, *, tiles: dict | None = None, threads: int | None = None,
             simulate: bool | None = None, verify: bool | int = True) -> "TorchOp":
    """``d`` as a differentiable torch callable ``op(*tensors)`` (see the module docstring).

    ``tiles``, ``threads``, ``verify``: passed to :func:`napkin_cat.lower` (and ``tiles`` to the
    executor's schedule).  ``simulate``: for float32 CPU tensors, ``None`` runs the generated
    kernel under numba's simulator when it is active and the executor otherwise; ``True``
    requires the simulator; ``False`` always takes the executor."""
    if not isinstance(d, Diagram):
        raise TypingError(f"torch_op needs a Diagram, got {type(d).__name__}")
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
    return TorchOp(d, dict(tiles or {}), threads, simulate, verify)


class TorchOp:
    """A diagram as a torch operation: ``op(*tensors)`` returns one tensor (or a tuple, one per
    output) that autograd differentiates.  ``last_path`` / ``last_backward_path``: the path the
    last forward / backward took (:data:`PATHS`); ``notes``: why a path was not the fast one
    (a refused lowering, a copy to the host), each said once."""

    def __init__(self, d: Diagram, tiles: dict, threads, simulate, verify):
        self.diagram = d
        self.tiles, self.threads, self.simulate, self.verify = tiles, threads, simulate, verify
        self.last_path: str | None = None
        self.last_backward_path: str | None = None
        self.notes: list[str] = []
        self._cache: dict = {}   # (what, sizes, ...) -> kernel, schedule, bound plan, or an error text

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
        names = ", ".join(str(a) for a in d.dom)
        if len(tensors) != len(d.dom):
            raise ShapeError(f"{self!r} takes {len(d.dom)} tensors ({names}), got {len(tensors)}")
        for arr, t in zip(d.dom, tensors):
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{self!r}: input {arr}: expected a torch.Tensor, got {type(t).__name__}")
        for arr, t in zip(d.dom, tensors):
            if t.dtype in (torch.bfloat16, torch.float16):
                raise TypingError(f"{self!r}: input {arr} is {t.dtype}; the generated kernels compute in float32 "
                                  f"on CUDA cores, and bf16/fp16 inputs need the tensor-core (mma) engine, "
                                  f"which is not written yet; cast with .float() for the float32 kernels "
                                  f"or .double() for the reference executor")
            if t.dtype not in (KERNEL_DTYPE, REFERENCE_DTYPE):
                raise TypingError(f"{self!r}: input {arr} is {t.dtype}; torch_op takes torch.float32 "
                                  f"(kernels) or torch.float64 (reference executor)")
        first = tensors[0]
        for arr, t in zip(d.dom, tensors):
            if t.dtype != first.dtype:
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

    def _bound(self, sizes: tuple) -> Diagram:
        return self._cached(("bound", sizes), lambda: self.diagram.bind(dict(sizes)) if sizes else self.diagram)

    def _kernel(self, sizes: tuple, device: torch.device):
        from . import lower
        return self._cached(("kernel", sizes, str(device)), lambda: lower(
            self._bound(sizes), tiles=self.tiles or None, threads=self.threads, verify=self.verify))

    def _scheduled(self, sizes: tuple) -> Diagram:
        """The bound diagram with every block size an int, as the lowering would choose them."""
        from .schedule import choose
        return self._cached(("schedule", sizes), lambda: choose(
            self._bound(sizes), self.tiles or None, self.threads, simulate=False).diagram)

    def backward_plan(self, wrt: tuple[int, ...], sizes: tuple = ()) -> BackwardPlan:
        """:func:`backward_plan` of this op's diagram, bound at ``sizes`` (cached)."""
        def make():
            plan = self._cached(("plan", wrt), lambda: backward_plan(self.diagram, wrt))
            names = {a.name for a in plan.diagram.axes}
            bind = {k: n for k, n in sizes if k in names}
            return BackwardPlan(plan.diagram.bind(bind) if bind else plan.diagram, plan.saves, plan.wrt)
        return self._cached(("plan", wrt, sizes), make)

    # ---- forward
    def _forward_path(self, dtype: torch.dtype, device: torch.device) -> str:
        from .devices import simulator_active
        sim = simulator_active()
        if self.simulate is True and not sim:
            raise LoweringError(f"{self!r}: simulate=True, but numba.cuda is not its simulator in this "
                                f"process (set NUMBA_ENABLE_CUDASIM=1 before numba.cuda is first imported)")
        if dtype == REFERENCE_DTYPE:
            if device.type == "cuda":
                self._note("float64 CUDA tensors run the reference executor on the host (copied there and "
                           "back); the kernels compute in float32")
            return "executor"
        if device.type == "cuda":
            if sim:
                self._note("CUDA tensors while numba.cuda is its simulator: the simulator cannot read them, "
                           "so the executor ran on host copies")
                return "executor"
            return "gpu"
        if device.type != "cpu":
            self._note(f"tensors on {device.type}: the executor ran on host copies")
            return "executor"
        return "simulator" if sim and self.simulate is not False else "executor"

    def forward(self, sizes: tuple, tensors) -> tuple[torch.Tensor, ...]:
        first = tensors[0]
        path = self._forward_path(first.dtype, first.device)
        if path == "executor":
            from ..verify.executor import evaluate
            outs = evaluate(self._scheduled(sizes), *_host(tensors), reference=first.dtype == REFERENCE_DTYPE)
            outs = _to_torch(outs, first.dtype, first.device)
        else:
            kernel = self._kernel(sizes, first.device)
            outs = kernel(*(t.detach() for t in tensors))
            outs = outs if isinstance(outs, tuple) else (outs,)
        self.last_path = path
        return outs

    # ---- backward
    def backward(self, sizes: tuple, wrt: tuple[int, ...], saved, cotangents) -> tuple[torch.Tensor, ...]:
        plan = self.backward_plan(wrt, sizes)
        first = saved[0]
        cts = tuple(torch.zeros(_shape(a), dtype=first.dtype, device=first.device) if g is None else g
                    for g, a in zip(cotangents, self._bound(sizes).cod))
        args = (*saved, *cts)
        if self._forward_path(first.dtype, first.device) == "gpu":
            kernel = self._backward_kernel(plan, wrt, sizes, first.device)
            if kernel is not None:
                outs = kernel(*(t.detach() for t in args))
                self.last_backward_path = "gpu"
                return outs if isinstance(outs, tuple) else (outs,)
        from ..verify.executor import evaluate
        outs = evaluate(plan.diagram, *_host(args), reference=True)
        self.last_backward_path = "executor"
        return _to_torch(outs, first.dtype, first.device)

    def _backward_kernel(self, plan: BackwardPlan, wrt, sizes, device):
        """The lowered backward diagram, or None (the refusal recorded in ``notes``)."""
        from . import lower

        def make():
            try:
                return lower(plan.diagram, threads=self.threads, verify=self.verify)
            except LoweringError as e:
                self._note(f"backward of {self.diagram.short()} at {dict(sizes)} was not lowered, so it ran "
                           f"in the NumPy executor on host copies: {e}")
                return None
        return self._cached(("backward kernel", wrt, sizes, str(device)), make)


class _DiagramFunction(torch.autograd.Function):
    """``apply(op, sizes, *tensors)``: saves the inputs (the backward recomputes from them)."""

    @staticmethod
    def forward(ctx, op: TorchOp, sizes: tuple, *tensors):
        outs = op.forward(sizes, tensors)
        ctx.op, ctx.sizes = op, sizes
        ctx.save_for_backward(*tensors)
        return outs

    @staticmethod
    def backward(ctx, *cotangents):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        wrt = tuple(i for i, n in enumerate(need) if n)
        got = ctx.op.backward(ctx.sizes, wrt, saved, cotangents) if wrt else ()
        grads: list = [None] * len(saved)
        for i, g in zip(wrt, got):
            grads[i] = g
        return (None, None, *grads)


# --------------------------------------------------------------------------- conversions

def _host(tensors) -> list[np.ndarray]:
    return [t.detach().cpu().numpy() for t in tensors]


def _to_torch(outs, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    outs = outs if isinstance(outs, tuple) else (outs,)
    return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(device=device, dtype=dtype) for o in outs)


def _shape(arr) -> tuple[int, ...]:
    return tuple(a.size for a in arr.axes)

