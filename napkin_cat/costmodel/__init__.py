"""Stage 3, the performance model: transfers, memory and FLOPs read off a final form.

Imports core, ops and relabel.  Modules: :mod:`.rules` (the work of each box kind),
:mod:`.skips` (chunks a mask skips), :mod:`.model` (:func:`cost`: the walk over the final
form), :mod:`.report` (:class:`Cost`: bytes, closed forms, optima, time), :mod:`.search` (the
integer search of an optimum), :mod:`.usable` (the tiles a kernel can use, the register level),
:mod:`.display` (the notebook tables), :mod:`.links` / :mod:`.backward_links` (a split over the
devices, forward and backward) and :mod:`.records`.
"""

from .backward_links import backward_device_time
from .model import concurrent_groups, cost
from .records import ClosedForm, Move, MultiLevel, Occupancy, Op, Optimum, Resident, Timing
from .report import Cost
from .rules import COST_RULES, UNITS, Work, box_work
from .skips import SympyAlgebra

__all__ = ["backward_device_time", "COST_RULES", "UNITS", "ClosedForm", "Cost", "Move", "MultiLevel", "Occupancy", "Op", "Optimum",
           "Resident", "SympyAlgebra", "Timing", "Work", "box_work", "concurrent_groups", "cost"]
