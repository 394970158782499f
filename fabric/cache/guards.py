"""Node locks taken and given up within one cache call (NodeGuard): what keeps the nodes
a call works on from eviction meanwhile, and prunes them once unlocked if they hold nothing."""

from __future__ import annotations

from .eviction import prune_unlocked
from .layout import PoolName
from .radix import RadixTree, TreeNode
from .records import NodeGuard


class NodeLocks:
    def __init__(self, tree: RadixTree, pools: tuple[PoolName, ...]) -> None:
        self.tree = tree
        self.pools = pools

    def lock(self, held: dict[PoolName, list[TreeNode]]) -> NodeGuard:
        for pool, nodes in held.items():
            self.tree.lock(nodes, pool, +1)
        return NodeGuard(held)

    def unlock(self, guard: NodeGuard) -> None:
        for pool, nodes in guard.nodes.items():
            self.tree.lock(nodes, pool, -1)
            prune_unlocked(self.tree, self.pools, nodes)
