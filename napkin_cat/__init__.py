"""napkin_cat: derive IO-aware GPU algorithms from diagrams ("FlashAttention on a Napkin").

Pipeline: ``diagram -> relabel -> final form (loop nest) -> {NumPy check, cost, numba.cuda}``.
"""

from . import library, ops
from .core import (DTYPES, Array, Axis, Box, Diagram, DType, Eqn, Relabel, Ty, axes, bf16, f16, f32,
                   f64, fp8_e4m3, fp8_e5m2, i8)
from .errors import (CostError, DrawingError, EmptyAxisError, EquivalenceError, LoweringError, NapkinError,
                     RelabelError, ShapeError, TypingError, UnknownKindError, UnverifiedError)
from .ops import AxisPower, Builder, IndexBias, Predicate, alibi, causal, predicate, window
from .semantics import evaluate
from . import hardware, hierarchy
from .relabel import RULES
from .check import check_equivalent
from .derive import derive
# functions bound after their submodules are imported: a later ``import napkin_cat.cost`` does
# not rebind the package attribute, so ``nc.cost`` stays the function
from .cost import cost
from .lower import lower  # numba.cuda itself is imported on the first lowering, not here

__version__ = "0.1.0"


def to_torch(d):
    """A differentiable torch function computing ``d`` (see :mod:`napkin_cat.torch_semantics`)."""
    from .torch_semantics import to_torch as _to_torch
    return _to_torch(d)


def __getattr__(name):  # heavy stages import lazily: ``import napkin_cat`` stays fast
    import importlib
    lazy = {"draw": ("drawing", "draw")}
    if name in lazy:
        mod, attr = lazy[name]
        m = importlib.import_module(f".{mod}", __name__)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'napkin_cat' has no attribute {name!r}")
