"""The backward of a ring over the devices, timed like the forward (:mod:`.links`).

The runtime (:mod:`napkin_cat.lowering.distributed_backward`) runs FlashAttention-2's backward
block by block against each row's saved ``(O, L)``: per step a device differentiates its queries
against the key block it holds while the next key block arrives and so does the accumulator of
the held block's gradients (``dK``, ``dV``: the blocks' sizes again), and after the last step each
accumulator travels once more, to the device that holds its block.  The work is the backward
diagram's (:func:`~napkin_cat.ops.residuals.grad_with_residuals` of the diagram with its row
logsumexp; :func:`~napkin_cat.ops.grad.grad` where there is none), split over the devices and
their kept tiles as the forward's.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> ring = nc.library.attention(q=q, x=x, d=d).tile(q, "devices").stream(x, "devices")
>>> sizes = {q: 2 ** 16, x: 2 ** 16, d: 64, "devices": 2}
>>> fwd, bwd = nc.cost(ring).devices(nc.hardware.H200, sizes), backward_device_time(ring, nc.hardware.H200, sizes)
>>> round(bwd.compute_step / fwd.compute_step, 2), bwd.link_bytes_per_device / fwd.link_bytes_per_device
(2.5, 3.0)
"""

from __future__ import annotations

from ..core.diagram import Diagram
from ..core.errors import CostError
from ..ops.grad import grad
from ..ops.residuals import grad_with_residuals, with_logsumexp
from .links import DeviceTiming, device_time
from .model import cost


def backward_diagram(d: Diagram) -> Diagram:
    """The unrelabelled backward of ``d``'s block: every float input's gradient, from the saved
    ``(O, L)`` when ``d`` has a softmax-contraction, recomputed from the inputs otherwise."""
    plain = d.unrelabelled()
    wrt = [i for i, a in enumerate(plain.dom) if a.dtype.kind == "float"]
    aug = with_logsumexp(plain)
    return grad(plain, wrt) if aug is None else grad_with_residuals(aug, wrt)


def backward_device_time(d: Diagram, hw, sizes: dict, dtype=None) -> DeviceTiming:
    """Per-device timing of the backward of ring ``d`` (``tile(q, devices).stream(x, devices)``):
    see the module docstring; the fields as :func:`~.links.device_time`'s."""
    if not isinstance(d, Diagram):
        raise CostError(f"backward_device_time needs the ring's Diagram, got {type(d).__name__}")
    return device_time(cost(d), hw, sizes, dtype, ops=cost(backward_diagram(d)).ops, accumulators=True)
