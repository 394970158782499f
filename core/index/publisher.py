"""EventPublisher: turns a NodeCache's page changes into numbered event batches."""

from __future__ import annotations

from typing import Protocol

from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.page_changes import PageView

from .events import EventBatch, PageMask, PageState, Snapshot
from .routes import RouteTable
from .shard_batches import ShardBatches

_BITS = {
    (PoolName.FULL, Tier.DEVICE): PageMask.FULL_DEVICE,
    (PoolName.FULL, Tier.HOST): PageMask.FULL_HOST,
    (PoolName.SWA, Tier.DEVICE): PageMask.SWA_DEVICE,
    (PoolName.SWA, Tier.HOST): PageMask.SWA_HOST,
    (PoolName.FULL, Tier.DISK): PageMask.FULL_DISK,
    (PoolName.SWA, Tier.DISK): PageMask.SWA_DISK,
}


class ShardPublisher(Protocol):
    """What sends a node's pages to index shards needs of their source: batches per shard
    and snapshots per shard (EventPublisher for a NodeCache; an engine's own pages too)."""

    def drain_routed(
        self, routes: RouteTable, every_shard: bool = False
    ) -> dict[int, EventBatch]: ...
    def snapshots(self, routes: RouteTable) -> dict[int, Snapshot]: ...


class EventPublisher:
    """Batches are numbered 0, 1, 2... within an epoch; batch 0 says `cleared`,
    so an index that saw an older epoch of this node drops it first.

    Changes wait in the cache until drained, at most `pending_floor` plus twice the
    keys held; past that, and for the first batch, the next batch restates
    everything held instead (`cleared`: an index takes it after any gap)."""

    def __init__(self, cache: NodeCache, node: str, epoch: int, pending_floor: int = 1024) -> None:
        self.cache, self.node, self.epoch = cache, node, epoch
        self.fingerprint = cache.layout.fingerprint
        self.next_seq = 0
        self.shards = ShardBatches(node, epoch, self.fingerprint)
        cache.track_changes(pending_floor)

    def drain(self) -> EventBatch | None:
        """The states of every page changed since the last drain, as the next batch."""
        if not self.cache.has_changes() and self.next_seq > 0:
            return None
        changes, restate = self.cache.take_changes()
        pages = self._all_held() if restate else tuple(_state(view) for view, _ in changes)
        batch = EventBatch(
            self.node,
            self.epoch,
            self.next_seq,
            pages,
            cleared=restate or self.next_seq == 0,
            fingerprint=self.fingerprint,
        )
        self.next_seq += 1
        return batch

    def drain_routed(self, routes: RouteTable, every_shard: bool = False) -> dict[int, EventBatch]:
        """The same, split into one batch per shard that must hear of each page
        (each shard has its own sequence of batches from this node); with
        `every_shard`, shards with no news get an empty batch (a heartbeat)."""
        changes, restate = self.cache.take_changes()
        if restate:
            return self.shards.restatement(routes, self._held_paths())
        return self.shards.changes(
            routes, ((_state(view), path) for view, path in changes), every_shard
        )

    def snapshots(self, routes: RouteTable) -> dict[int, Snapshot]:
        """What each shard should hold of this node under `routes`, each as of
        the last batch that shard got (drain_routed first)."""
        return self.shards.snapshots(routes, self._held_paths())

    def snapshot(self) -> Snapshot:
        """Everything held now, as of the last drained batch (drain first)."""
        return Snapshot(
            self.node, self.epoch, self.next_seq - 1, self._all_held(), self.fingerprint
        )

    def _held_paths(self):
        return ((_state(view), path) for view, path in self.cache.held_pages_with_paths())

    def _all_held(self) -> tuple[PageState, ...]:
        return tuple(p for view in self.cache.held_pages() if (p := _state(view)).mask)


def _state(view: PageView) -> PageState:
    mask = 0
    for where in view.held:
        mask |= _BITS[where]
    return PageState(view.key, view.parent, view.position, mask)
