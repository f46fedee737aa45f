"""Stage 0: axes, dtypes, array types, boxes and diagrams; errors, memory levels, hardware profiles.

Imports neither NumPy nor sympy, and nothing above it: the verbs that later stages give
:class:`Diagram` (``stream``, ``tile``, ``draw``...) are looked up in :mod:`.registry`.
"""

from . import errors, hardware, hierarchy, registry
from .diagram import (DTYPES, Array, Axis, Box, Diagram, DType, Eqn, Relabel, Size, Ty, axes, bf16,
                      check_size_keys, f16, f32, f64, fp8_e4m3, fp8_e5m2, i8)
