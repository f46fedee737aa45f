"""napkin_cat: derive IO-aware GPU algorithms from diagrams ("FlashAttention on a Napkin").

Pipeline: ``diagram -> relabel -> final form (loop nest) -> {NumPy check, cost, numba.cuda}``.
The package is a house of stages, each importing only the ones before it
(docs/ARCHITECTURE.md): core <- ops <- {library, relabel} <- {verify, costmodel} <-
{lowering, drawing} <- this face (``__init__``, ``cli``, ``imports``).
"""

from . import core, ops
from .core import hardware, hierarchy, registry as _registry
from .core.diagram import (DTYPES, Array, Axis, Box, Diagram, DType, Eqn, Relabel, Ty, axes, bf16, f16, f32,
                           f64, fp8_e4m3, fp8_e5m2, i8)
from .core.errors import (CostError, DrawingError, EmptyAxisError, EquivalenceError, LoweringError, NapkinError,
                          RelabelError, ShapeError, TypingError, UnknownKindError, UnverifiedError)
from .ops.grad import grad
from .ops import AxisPower, Builder, IndexBias, Predicate, alibi, block_diagonal, causal, predicate, window
from . import library, relabel
from .relabel import RULES
from .verify import check_equivalent, derive, evaluate
# functions named like their stage would shadow it; the stage folders are named differently
# (costmodel, lowering, drawing), so ``import napkin_cat.lowering.runtime`` always works
from .costmodel import cost
from .lowering import lower  # numba.cuda itself is imported on the first lowering, not here

__version__ = "0.1.0"


def to_torch(d):
    """A differentiable torch function computing ``d`` (see :mod:`napkin_cat.ops.torch_semantics`)."""
    from .ops.torch_semantics import to_torch as _to_torch
    return _to_torch(d)


def draw(d, path=None, **kwargs):
    """Draw ``d`` as a string diagram (see :func:`napkin_cat.drawing.diagram.draw`)."""
    from .drawing import draw as _draw  # matplotlib is imported on the first drawing
    return _draw(d, path, **kwargs)


def _to_svg(d):
    from .drawing import to_svg
    return to_svg(d)


# the drawing stage is heavy (matplotlib): its verbs are registered lazily
_registry.register("draw", draw)
_registry.register("to_svg", _to_svg)
