"""EventPublisher: turns a NodeCache's page changes into numbered event batches."""
from __future__ import annotations

from .events import EventBatch, PageMask, PageState, Snapshot
from .layout import PoolName, Tier
from .node_cache import NodeCache
from .radix import ABSENT, Node

_BITS = {(PoolName.FULL, Tier.DEVICE): PageMask.FULL_DEVICE, (PoolName.FULL, Tier.HOST): PageMask.FULL_HOST,
         (PoolName.SWA, Tier.DEVICE): PageMask.SWA_DEVICE, (PoolName.SWA, Tier.HOST): PageMask.SWA_HOST}


class EventPublisher:
    """Batches are numbered 0, 1, 2... within an epoch; batch 0 says `cleared`,
    so an index that saw an older epoch of this node drops it first."""

    def __init__(self, cache: NodeCache, node: str, epoch: int) -> None:
        self.cache, self.node, self.epoch = cache, node, epoch
        self.next_seq = 0
        tree = cache.tree
        tree.track_changes = True
        tree.changed = [k for n in tree.nodes() for k in n.keys]   # what this epoch must announce
        tree.removed = {}

    def drain(self) -> EventBatch | None:
        """The states of every page changed since the last drain, as the next batch."""
        tree = self.cache.tree
        if not tree.changed and self.next_seq > 0:
            return None
        keys = dict.fromkeys(tree.changed)
        tree.changed = []
        pages = tuple(self._state(k) for k in keys)
        tree.removed = {}
        batch = EventBatch(self.node, self.epoch, self.next_seq, pages, cleared=self.next_seq == 0)
        self.next_seq += 1
        return batch

    def snapshot(self) -> Snapshot:
        """Everything held now, as of the last drained batch (drain first)."""
        tree = self.cache.tree
        pages = tuple(p for node in tree.nodes() for j in range(node.n) if (p := _held(node, j)).mask)
        return Snapshot(self.node, self.epoch, self.next_seq - 1, pages)

    def _state(self, key: bytes) -> PageState:
        node = self.cache.tree.by_key.get(key)
        if node is None:
            parent, depth = self.cache.tree.removed[key]
            return PageState(key, parent, depth, 0)
        return _held(node, node.keys.index(key))


def _held(node: Node, offset: int) -> PageState:
    mask = 0
    for (pool, tier), bit in _BITS.items():
        pages = node.slots[tier][pool]
        if pages is not None and pages[offset] != ABSENT:
            mask |= bit
    parent = node.keys[offset - 1] if offset else node.parent.keys[-1]
    return PageState(node.keys[offset], parent, node.start + offset, mask)
