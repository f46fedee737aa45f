"""napkin_cat: derive IO-aware GPU algorithms from diagrams ("FlashAttention on a Napkin").

Pipeline: ``diagram -> relabel -> final form (loop nest) -> {NumPy check, cost, numba.cuda}``.
The package is a house of stages, each importing only the ones before it
(docs/ARCHITECTURE.md): core <- ops <- {library, relabel} <- {verify, costmodel} <-
{lowering, drawing} <- this face (``__init__``, ``cli``, ``imports``).

``import napkin_cat`` is light: it imports core, ops and library (no NumPy, no sympy), so
``napkin --help`` answers at once.  The later stages are imported on first use of one of their
names (``nc.cost``, ``nc.lower``, ``nc.check_equivalent``, ``nc.RULES``, ...: module
``__getattr__``, PEP 562) or of a verb (``d.stream(...)``, ``d.draw()``: stubs installed in the
registry below, replaced by the stage's own functions when it is imported).

>>> import napkin_cat as nc
>>> callable(nc.cost) and callable(nc.lower) and "check_equivalent" in dir(nc)
True
"""

import importlib as _importlib

from . import core, ops
from .core import hardware, hierarchy, registry as _registry
from .core.diagram import (DTYPES, Array, Axis, Box, Diagram, DType, Eqn, Relabel, Ty, axes, bf16, f16, f32,
                           f64, fp8_e4m3, fp8_e5m2, i8)
from .core.errors import (CostError, DrawingError, EmptyAxisError, EquivalenceError, LoweringError, NapkinError,
                          RelabelError, ShapeError, TypingError, UnknownKindError, UnverifiedError)
from .ops.grad import grad
from .ops.residuals import grad_with_residuals
from .ops import AxisPower, Builder, IndexBias, Predicate, alibi, block_diagonal, causal, predicate, window
from .ops import bias_mod, block_table, blocked, ix, mask_mod
from . import library
from .library.variants import aux, score_mod

__version__ = "0.1.0"

# name -> (stage module, attribute or None for the module itself).  Functions named like their
# stage would shadow it, so the stage folders are named differently (costmodel, lowering,
# drawing): ``import napkin_cat.lowering.runtime`` always works.
_LAZY = {
    "relabel": ("relabel", None), "RULES": ("relabel", "RULES"),
    "verify": ("verify", None), "check_equivalent": ("verify", "check_equivalent"),
    "derive": ("verify", "derive"), "evaluate": ("verify", "evaluate"),
    "costmodel": ("costmodel", None), "cost": ("costmodel", "cost"),
    "lowering": ("lowering", None), "lower": ("lowering", "lower"),
    "torch_op": ("lowering.torch_op", "torch_op"),
}
# the verification stage reads kernels through a table the lowering stage fills when imported
# (verify/backend.py); numba.cuda itself is imported on the first lowering, not here
_WITH = {"verify": ("lowering",)}


def _stage(name: str):
    module = _importlib.import_module(f"{__name__}.{name}")
    for other in _WITH.get(name, ()):
        _importlib.import_module(f"{__name__}.{other}")
    return module


def __getattr__(name: str):
    try:
        stage, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = _stage(stage)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


_HELPERS = {"_importlib", "_LAZY", "_WITH", "_HELPERS", "_stage", "_lazy_verb", "__getattr__", "__dir__"}


def __dir__():
    """The public names, the lazy ones included (they appear before their stage is imported)."""
    return sorted((set(globals()) - _HELPERS) | set(_LAZY))


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


def _lazy_verb(name: str, stage: str):
    """A stand-in for verb ``name`` until ``stage`` is imported: the first call imports the stage
    (which registers the real function in its place) and calls it."""
    def stub(*args, **kwargs):
        _stage(stage)
        fn = _registry.VERBS.get(name)
        if fn is None or fn is stub:
            raise NapkinError(f"{name}: importing napkin_cat.{stage} did not register it")
        return fn(*args, **kwargs)
    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = f"``Diagram.{name}``: imports :mod:`napkin_cat.{stage}` on first use, then calls its {name}."
    return stub


# the verbs of the later stages (core/registry.py); ``weave_box`` is registered by ops, above
for _name in ("tile", "stream", "place", "require", "order", "loop_nest"):
    _registry.VERBS.setdefault(_name, _lazy_verb(_name, "relabel"))
_registry.register("draw", draw)
_registry.register("to_svg", _to_svg)
_registry.VERBS.setdefault("final_form_html", _lazy_verb("final_form_html", "drawing"))  # FinalForm in notebooks
del _name
