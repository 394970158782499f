"""ChaosAction: what a chaos node (NodeChaos) is told to suffer next, sent through the
node actor's `inject`."""

from __future__ import annotations

from dataclasses import dataclass

from .disk import DiskFault
from .events import EventFault
from .transfer import Fault


@dataclass(frozen=True)
class ChaosAction:
    transport: Fault | None = None  # the node's next read from a peer
    alloc_point: int = 0  # fail the k-th reservation point from now (0: none)
    events: EventFault | None = None  # what happens to the next batches it sends
    evict_after_get: bool = False  # evict all it can right after answering its next get
    exit_after_get: bool = False  # die (-9) once its next get or load has its answer
    disk: DiskFault | None = None  # what its disk tier suffers next (faults/disk.py)
