"""LRU eviction of one pool on one tier, inside a transaction.

Candidates come from the pool's policy (locked nodes are never candidates).
A device page may be written back to the host tier instead of dropped. A node
left without the pages that keep it meaningful is pruned from the tree."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable

from .layout import PoolName, Tier
from .policies import AttentionPolicy
from .radix import ABSENT, TIERS, Node, RadixTree

if TYPE_CHECKING:
    from .txn import Transaction


class Evictor:
    def __init__(self, tree: RadixTree, policy: AttentionPolicy,
                 write_back: Callable[[], bool]) -> None:
        self.tree = tree
        self.policy = policy
        self.write_back = write_back
        self.evicted = 0
        self.written_back = 0

    def make_room(self, tier: Tier, n: int, txn: "Transaction") -> int:
        """Free at least `n` pages of this pool on `tier` if possible; return how many."""
        pool, policy = self.policy.pool, self.policy
        demote = tier == Tier.DEVICE and self.write_back()
        heap = policy.candidates(self.tree, tier, demote)
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            node = heapq.heappop(heap)[-1]
            if not policy.is_evictable(node, tier, demote):
                continue
            if demote and node.slots[Tier.HOST][pool] == ABSENT and not self._write_back(node, txn):
                if not policy.is_evictable(node, tier):
                    continue  # no host room, and dropping would break prefix closure
            parent = node.parent
            self.tree.drop_slot(node, tier, pool, txn)
            self.evicted += 1
            freed += 1 + prune(self.tree, node, txn, count=(tier, pool))
            if not parent.is_root and policy.is_evictable(parent, tier, demote):
                heapq.heappush(heap, (*policy.priority(parent), parent))
        return freed

    def _write_back(self, node: Node, txn: "Transaction") -> bool:
        from .txn import ReservationFailed
        pool = self.policy.pool
        try:
            (host_index,) = txn.reserve(pool, Tier.HOST, 1)
        except ReservationFailed:
            return False
        txn.defer_copy(pool, Tier.DEVICE, [node.slots[Tier.DEVICE][pool]], Tier.HOST, [host_index])
        txn.place(node, Tier.HOST, pool, host_index)
        self.written_back += 1
        return True


def is_dead(tree: RadixTree, node: Node) -> bool:
    """A node is dead once it lacks full KV (if the layout has full layers) or any KV."""
    if PoolName.FULL in tree.registry:
        return not node.has(PoolName.FULL)
    return not any(node.has(p) for p in tree.registry.names)


def prune(tree: RadixTree, node: Node, txn: "Transaction", count: tuple[Tier, PoolName]) -> int:
    """Drop dead nodes' remaining pages and detach dead leaves, walking up.

    Returns how many pages of `count` (tier, pool) this freed."""
    freed = 0
    while not node.is_root and is_dead(tree, node) and not any(node.locks):
        for pool in tree.registry.names:
            for t in TIERS:
                if node.slots[t][pool] != ABSENT:
                    tree.drop_slot(node, t, pool, txn)
                    freed += (t, pool) == count
        if node.children:
            break
        parent = node.parent
        tree.detach(node, txn)
        node = parent
    return freed
