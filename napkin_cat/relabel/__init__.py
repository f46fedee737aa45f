"""Stage 2, relabelling: tile, stream, place, require and order; accumulators (as definitions);
the final form (loop nest) every later stage reads.

Imports :mod:`napkin_cat.core` and :mod:`napkin_cat.ops`.  Registers the fluent verbs
``Diagram.tile/stream/place/require/order/loop_nest``.
"""

from ..core import registry as _registry
from .accumulators import ACC_RULES, Accumulator, derive_accumulator
from .loopnest import FinalForm, final_form
from .rules import (RULES, StreamPlan, check_blocks, fuse_norm_contract, fuse_softmax_contract, order, place, require,
                    requirements, stream, stream_plan, tile)

for _name, _fn in (("tile", tile), ("stream", stream), ("place", place), ("require", require),
                   ("order", order), ("loop_nest", final_form)):
    _registry.register(_name, _fn)
