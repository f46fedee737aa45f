"""Stage 1, the vocabulary: box kinds and their traits, elementwise functions, index functions,
box constructors, the :class:`Builder`, and the reference semantics (NumPy and torch).

Imports only :mod:`napkin_cat.core`.
"""

from .functions import BINARY, FUNCTIONS, UNARY, Function
from .index import (AxisPower, IndexBias, IndexRule, Predicate, alibi, bias_mod, block_diagonal, causal, constant_value,
                    mask_mod, predicate, real_number, window)
from .index_expr import Aux, Ix, TraceError, ix
from .block_table import block_table, blocked
from .kinds import KINDS, NORMALISATIONS, REDUCTIONS, SPECS, KindSpec, spec
from .boxes import (cast_box, const_box, contract_box, diagonal_box, index_bias_box, map_box, mask_box,
                    merge_box, norm_contract_box, normalize_box, param_box, reduce_box, rename_box, slice_box,
                    softmax_box, softmax_contract_box, split_box, transpose_box, unfold_box, weave_box)
from .builder import Builder, Wire, contract, op
from .grad import VJP_RULES, Tracer, grad
from ..core import registry as _registry

_registry.register("weave_box", weave_box)
