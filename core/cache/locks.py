"""Locks on the tree's nodes, which keep their pages from eviction: a PrefixLock held
between cache calls (named by page keys), and a TreeGuard held within one call
(TreeLocks takes and gives those up, and prunes what holds nothing once unlocked)."""

from __future__ import annotations

from dataclasses import dataclass

from .eviction import prune_unlocked
from .layout import PoolName
from .radix import RadixTree, TreeNode


@dataclass
class PrefixLock:
    """A lock held outside the cache's own calls. It names pages by key and
    position, not by node: a later split of a locked run copies the lock into
    both halves, and unlocking finds both."""

    keys: list[bytes]
    spans: dict[PoolName, range]
    released: bool = False


@dataclass
class TreeGuard:
    """A lock held within one cache call, during which no run is split."""

    nodes: dict[PoolName, list[TreeNode]]


class TreeLocks:
    def __init__(self, tree: RadixTree, pools: tuple[PoolName, ...]) -> None:
        self.tree = tree
        self.pools = pools

    def lock(self, held: dict[PoolName, list[TreeNode]]) -> TreeGuard:
        for pool, nodes in held.items():
            self.tree.lock(nodes, pool, +1)
        return TreeGuard(held)

    def unlock(self, guard: TreeGuard) -> None:
        for pool, nodes in guard.nodes.items():
            self.tree.lock(nodes, pool, -1)
            prune_unlocked(self.tree, self.pools, nodes)
