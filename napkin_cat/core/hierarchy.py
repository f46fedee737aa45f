"""Memory hierarchies: levels as a graph, top (slow, large) to bottom (fast, small).

A wire's colour is the level it lives at; a colour change is a transfer.  The default
hierarchy is ``HBM -> SMEM -> registers``; :func:`hierarchy` adds the optional L2,
thread-block cluster (a cross-transfer level) and tensor-core fragment levels.

>>> from napkin_cat.core.hierarchy import DEFAULT, hierarchy
>>> DEFAULT.names
('HBM', 'SMEM', 'registers')
>>> hierarchy(l2=True, cluster=True).names
('HBM', 'L2', 'cluster', 'SMEM', 'registers')
>>> DEFAULT.below("SMEM")
'registers'

Beyond one GPU, the devices form a level of their own: ``tile(q, DEVICES)`` / ``stream(x,
DEVICES)`` split an axis into one block per device, each block living in one GPU's ``HBM``.
The count of devices is the size symbol ``devices``; a block moving between GPUs crosses the
link (:data:`LINK`, the level above ``HBM`` in :data:`DEVICE_HIERARCHY`), which the cost model
reports as ``transfers["NVLink"]``.

>>> DEVICE_HIERARCHY.names
('NVLink', 'HBM', 'SMEM', 'registers')
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RelabelError


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    kind: str = "memory"       # "memory", or "cross" for cluster-style sibling exchange
    description: str = ""


@dataclass(frozen=True, slots=True)
class Hierarchy:
    levels: tuple[Level, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(lv.name for lv in self.levels)

    @property
    def top(self) -> str:
        return self.levels[0].name

    def index(self, name: str) -> int:
        if name not in self.names:
            raise RelabelError(f"unknown memory level {name!r}; this hierarchy has {list(self.names)}")
        return self.names.index(name)

    def below(self, name: str) -> str:
        i = self.index(name)
        if i + 1 >= len(self.levels):
            raise RelabelError(f"level {name} is the bottom of {list(self.names)}")
        return self.names[i + 1]

    def above(self, name: str) -> str:
        i = self.index(name)
        if i == 0:
            raise RelabelError(f"level {name} is the top of {list(self.names)}")
        return self.names[i - 1]

    def path(self, upper: str, lower: str) -> tuple[str, ...]:
        """Levels crossed moving data from ``upper`` down to ``lower`` (both included)."""
        i, j = self.index(upper), self.index(lower)
        if i > j:
            raise RelabelError(f"{upper} is below {lower} in {list(self.names)}")
        return self.names[i:j + 1]


def hierarchy(l2: bool = False, cluster: bool = False, tensor: bool = False) -> Hierarchy:
    levels = [Level("HBM", description="device memory (global)")]
    if l2:
        levels.append(Level("L2", description="L2 cache shared by all SMs"))
    if cluster:
        levels.append(Level("cluster", "cross", "distributed shared memory of a thread-block cluster"))
    levels.append(Level("SMEM", description="shared memory of one thread block"))
    levels.append(Level("registers", description="register file of the threads"))
    if tensor:
        levels.append(Level("tensor", description="tensor-core fragments"))
    return Hierarchy(tuple(levels))


DEFAULT = hierarchy()

DEVICES = "devices"
"""The reserved block size of a device split: ``tile(q, DEVICES)`` gives each device ``q/devices``
rows; ``devices`` is also the size symbol of the number of devices (``sizes={"devices": 2}``)."""
LINK = "NVLink"
"""The level of data reachable over the GPU-to-GPU link: a block moving between devices."""
DEVICE_HIERARCHY = Hierarchy((Level(LINK, "link", "GPUs joined by a link (NVLink, or the network)"),
                              *DEFAULT.levels))
FULL = hierarchy(l2=True, cluster=True, tensor=True)
