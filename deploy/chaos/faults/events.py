"""Event faults: what happens to the next KV event batches a node sends the index."""

from __future__ import annotations

from enum import Enum

from kvfabric.core.index.events import EventBatch


class EventFault(str, Enum):
    DROP = "drop"  # the next batches are lost: the shard sees a gap later
    DUPLICATE = "duplicate"  # sent twice: the shard must ignore the copy
    REORDER = "reorder"  # held back and sent after the following ones


class EventMangler:
    """Applies one armed EventFault to the next send of batches (a node's batch filter)."""

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
            self._held = batches  # after whatever comes next
            return held
        return batches + held  # a held-back send goes out after later ones
