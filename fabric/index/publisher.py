"""EventPublisher: turns a NodeCache's page changes into numbered event batches."""
from __future__ import annotations

from kvfabric.fabric.cache.changes import ChangeLog
from .events import EventBatch, PageMask, PageState, Snapshot
from kvfabric.fabric.cache.layout import PoolName, Tier
from kvfabric.fabric.cache.node_cache import NodeCache
from kvfabric.fabric.cache.radix import ABSENT, TreeNode
from .routes import RouteTable
from .shard_batches import ShardBatches

_BITS = {(PoolName.FULL, Tier.DEVICE): PageMask.FULL_DEVICE, (PoolName.FULL, Tier.HOST): PageMask.FULL_HOST,
         (PoolName.SWA, Tier.DEVICE): PageMask.SWA_DEVICE, (PoolName.SWA, Tier.HOST): PageMask.SWA_HOST}


class EventPublisher:
    """Batches are numbered 0, 1, 2... within an epoch; batch 0 says `cleared`,
    so an index that saw an older epoch of this node drops it first.

    Changes wait in the tree's ChangeLog until drained, at most `pending_floor` plus
    twice the keys held; past that, and for the first batch, the next batch restates
    everything held instead (`cleared`: an index takes it after any gap)."""

    def __init__(self, cache: NodeCache, node: str, epoch: int, pending_floor: int = 1024) -> None:
        self.cache, self.node, self.epoch = cache, node, epoch
        self.fingerprint = cache.layout.fingerprint
        self.next_seq = 0
        self.shards = ShardBatches(node, epoch, self.fingerprint)
        tree = cache.tree
        tree.changes = ChangeLog(lambda: pending_floor + 2 * len(tree.by_key))

    def drain(self) -> EventBatch | None:
        """The states of every page changed since the last drain, as the next batch."""
        if not self.cache.tree.changes and self.next_seq > 0:
            return None
        changes, restate = self._take_changes()
        pages = self._all_held() if restate else tuple(self._state(node, j) for node, j in changes)
        batch = EventBatch(self.node, self.epoch, self.next_seq, pages, cleared=restate or self.next_seq == 0,
                           fingerprint=self.fingerprint)
        self.next_seq += 1
        return batch

    def drain_routed(self, routes: RouteTable, every_shard: bool = False) -> dict[int, EventBatch]:
        """The same, split into one batch per shard that must hear of each page
        (each shard has its own sequence of batches from this node); with
        `every_shard`, shards with no news get an empty batch (a heartbeat)."""
        changes, restate = self._take_changes()
        if restate:
            return self.shards.restatement(routes, self._held_paths())
        paths = _Paths()
        return self.shards.changes(routes, ((self._state(node, j), paths.of(node, j)) for node, j in changes),
                                   every_shard)

    def snapshots(self, routes: RouteTable) -> dict[int, Snapshot]:
        """What each shard should hold of this node under `routes`, each as of
        the last batch that shard got (drain_routed first)."""
        return self.shards.snapshots(routes, self._held_paths())

    def _held_paths(self):
        paths = _Paths()
        return ((_held(node, j), paths.of(node, j)) for node in self.cache.tree.nodes() for j in range(node.n))

    def _take_changes(self) -> tuple[list[tuple[TreeNode, int]], bool]:
        """(changed pages, each once; whether to restate everything instead)."""
        tree = self.cache.tree
        keys, removed, restate = tree.changes.take()
        out = []
        for key in dict.fromkeys(keys):
            node = tree.by_key.get(key)
            out.append((node, node.keys.index(key)) if node is not None else removed[key])
        return out, restate

    def snapshot(self) -> Snapshot:
        """Everything held now, as of the last drained batch (drain first)."""
        return Snapshot(self.node, self.epoch, self.next_seq - 1, self._all_held(), self.fingerprint)

    def _all_held(self) -> tuple[PageState, ...]:
        tree = self.cache.tree
        return tuple(p for node in tree.nodes() for j in range(node.n) if (p := _held(node, j)).mask)

    def _state(self, node: TreeNode, offset: int) -> PageState:
        if self.cache.tree.by_key.get(node.keys[offset]) is not node:
            return _gone(node, offset)
        return _held(node, offset)


class _Paths:
    """Page-key paths from depth 0, memoized per node for one drain."""

    def __init__(self) -> None:
        self._memo: dict[int, list[bytes]] = {}

    def of(self, node: TreeNode, offset: int) -> list[bytes]:
        return self._upto(node.parent) + node.keys[: offset + 1]

    def _upto(self, node: TreeNode) -> list[bytes]:
        if node.is_root:
            return []
        path = self._memo.get(id(node))
        if path is None:
            path = self._memo[id(node)] = self._upto(node.parent) + node.keys
        return path


def _gone(node: TreeNode, offset: int) -> PageState:
    parent = node.keys[offset - 1] if offset else node.parent.keys[-1]
    return PageState(node.keys[offset], parent, node.start + offset, 0)


def _held(node: TreeNode, offset: int) -> PageState:
    mask = 0
    for (pool, tier), bit in _BITS.items():
        pages = node.slots[tier][pool]
        if pages is not None and pages[offset] != ABSENT:
            mask |= bit
    parent = node.keys[offset - 1] if offset else node.parent.keys[-1]
    return PageState(node.keys[offset], parent, node.start + offset, mask)
