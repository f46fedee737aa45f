"""Stage 3, verification: the tiled executor and ``evaluate``, ``check_equivalent``, ``derive``,
and the kernel checks (:mod:`.kernelcheck`).

Imports core, ops and relabel.  Kernels reach it through :mod:`.backend`, which the lowering
stage fills when it is imported, so nothing here imports the lowering stage.
"""

from .executor import evaluate, execute
from .check import check_equivalent
from .derive import derive
