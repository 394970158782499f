"""Faults a node actor can be told to suffer, for chaos runs (ours and users').

Only a node started with `NodeConfig(chaos=True)` accepts them: its transport
is a FaultyTransport and its cache counts reservation points, both idle until
told otherwise. Event faults act on what the node sends the index next.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvfabric.fabric import EventBatch
from kvfabric.transport import Fault


class EventFault(str, Enum):
    DROP = "drop"              # the next batches are lost: the shard sees a gap later
    DUPLICATE = "duplicate"    # sent twice: the shard must ignore the copy
    REORDER = "reorder"        # held back and sent after the following ones


@dataclass(frozen=True)
class ChaosAction:
    transport: Fault | None = None     # the node's next read from a peer
    alloc_point: int = 0               # fail the k-th reservation point from now (0: none)
    events: EventFault | None = None   # what happens to the next batches it sends
    evict_after_get: bool = False      # evict all it can right after answering its next get


class EventMangler:
    """Applies one armed EventFault to the next send of batches."""

    def __init__(self) -> None:
        self.armed: EventFault | None = None
        self._held: list[tuple[int, EventBatch]] = []
        self.applied = 0

    def arm(self, fault: EventFault) -> None:
        self.armed = EventFault(fault)

    def __call__(self, batches: list[tuple[int, EventBatch]]) -> list[tuple[int, EventBatch]]:
        """The (shard, batch) pairs to really send, in order."""
        fault, self.armed = self.armed, None
        held, self._held = self._held, []
        if fault is not None and batches:
            self.applied += 1
        if fault is EventFault.DROP:
            return held
        if fault is EventFault.DUPLICATE:
            return held + batches + batches
        if fault is EventFault.REORDER and batches:
            self._held = batches          # after whatever comes next
            return held
        return batches + held             # a held-back send goes out after later ones
