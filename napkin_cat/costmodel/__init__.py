"""Stage 3, the performance model: transfers, memory and FLOPs read off a final form.

Imports core, ops and relabel.
"""

from .model import COST_RULES, Cost, cost
