"""The scheduler side's staging slots: taken per pool for a load or a save, given back
when it is done, and kept out of use while a node call the engine gave up on may still
write or read them."""

from __future__ import annotations

from typing import Any, Iterable

from kvfabric.core.cache.allocator import OutOfPages, PageAllocator
from kvfabric.core.cache.layout import PoolName
from kvfabric.transport.staging import StagingSpec

from .node_link import NodeLink


class StagingSlots:
    def __init__(self, spec: StagingSpec, pools: Iterable[PoolName]) -> None:
        self.allocators = {p: PageAllocator(spec.pages) for p in pools}
        # Slots a node call the engine gave up on may still use: (the call, its slots).
        self.quarantined: list[tuple[Any, dict[PoolName, list[int]]]] = []

    def alloc(self, want: dict[PoolName, int]) -> dict[PoolName, list[int]] | None:
        got: dict[PoolName, list[int]] = {}
        try:
            for pool, n in want.items():
                got[pool] = self.allocators[pool].alloc(n)
        except OutOfPages:
            self.free(got)
            return None
        return got

    def free(self, slots: dict[PoolName, list[int]]) -> None:
        for pool, indices in slots.items():
            if indices:
                self.allocators[pool].free(indices)

    def quarantine(self, slots: dict[PoolName, list[int]], call: Any) -> None:
        """Slots of a node call the engine gave up on (`call`: None if it was never sent):
        the node actor may still write or read them, however late. They come back when the
        call has ended (answered, failed, or its actor died: Ray ends it either way), never
        after a fixed time; a node that never answers keeps them (the engine then skips
        loads and saves it has no slots for, and computes)."""
        if call is None:
            self.free(slots)
        else:
            self.quarantined.append((call, slots))

    def release(self, node: NodeLink) -> None:
        """Give back the quarantined slots whose calls have ended."""
        if not self.quarantined:
            return
        ended = set(node.finished([call for call, _ in self.quarantined]))
        for call, slots in self.quarantined:
            if call in ended:
                self.free(slots)
        self.quarantined = [q for q in self.quarantined if q[0] not in ended]

    def quarantined_count(self) -> int:
        return sum(len(s) for _, q in self.quarantined for s in q.values())
