"""The torch dtypes the kernels take, and how a kernel meets torch tensors: shared by
:mod:`.torch_op` (one device) and :mod:`.distributed` / :mod:`.distributed_backward` (several)."""

from __future__ import annotations

import numpy as np
import torch

from ..core.diagram import Diagram
from ..core.errors import LoweringError

KERNEL_DTYPE = torch.float32       # what the generated kernels compute in
REFERENCE_DTYPE = torch.float64    # the executor's reference path (gradcheck)
HALF_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}   # kernels with 16-bit inputs and outputs
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are added or folded in: fp32 for 16-bit tensors, theirs otherwise."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def _io_name(dtype: torch.dtype) -> str:
    return HALF_DTYPES.get(dtype, "f32")


def _host(tensors) -> list[np.ndarray]:
    """Host copies; bfloat16 (numpy has none) as the float32 numbers it holds, exactly."""
    return [t.detach().cpu().float().numpy() if t.dtype == torch.bfloat16 else t.detach().cpu().numpy()
            for t in tensors]


def _out_dtypes(d: Diagram, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The torch dtype of each output of ``d`` for inputs of ``dtype``: float64 throughout on the
    reference path, else each wire's (16-bit outputs and gradients, fp32 logsumexps)."""
    return tuple(dtype if dtype == REFERENCE_DTYPE else TORCH_DTYPES.get(a.dtype.name, dtype) for a in d.cod)


def _to_torch(outs, dtypes, device: torch.device) -> tuple[torch.Tensor, ...]:
    outs = outs if isinstance(outs, tuple) else (outs,)
    return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(device=device, dtype=t) for o, t in zip(outs, dtypes))


def _launch(kernel, tensors, d: Diagram) -> tuple[torch.Tensor, ...]:
    """``kernel`` on ``tensors`` (``d``: the diagram it was lowered from).  16-bit CPU tensors go
    as numpy arrays (float16, or bfloat16's values in float32), and the outputs come back as
    tensors of their wires' dtypes: the kernel's own conversion of a 16-bit CPU tensor reads its
    bit patterns as numbers."""
    if tensors[0].device.type == "cpu" and any(t.dtype in HALF_DTYPES for t in tensors):
        return _to_torch(kernel(*_host(tensors)), _out_dtypes(d, torch.float32), tensors[0].device)
    outs = kernel(*(t.detach() for t in tensors))
    return outs if isinstance(outs, tuple) else (outs,)


def kernel_path(who, dtype: torch.dtype, device: torch.device, simulate: bool | None) -> str:
    """Where tensors of ``dtype`` on ``device`` run: ``gpu`` (CUDA tensors of a kernel dtype),
    ``simulator`` (CPU tensors of a kernel dtype while numba.cuda is its simulator, unless
    ``simulate`` is False) or ``executor``; ``simulate=True`` without the simulator is refused,
    naming ``who``."""
    from .devices import simulator_active
    sim = simulator_active()
    if simulate is True and not sim:
        raise LoweringError(f"{who!r}: simulate=True, but numba.cuda is not its simulator in this "
                            f"process (set NUMBA_ENABLE_CUDASIM=1 before numba.cuda is first imported)")
    if dtype != KERNEL_DTYPE and dtype not in HALF_DTYPES:
        return "executor"
    if device.type == "cuda":
        return "executor" if sim else "gpu"
    return "simulator" if device.type == "cpu" and sim and simulate is not False else "executor"
