"""Pages whose disk copy failed its checksum on a read, dropped from the tree as if lost.

A read from the disk tier checks each page (disk_store.py); a page that fails is never
served: the load that met it fails (its caller misses, and recomputes), and the page is
recorded here. It leaves the tree once no lock holds its node (the load's caller holds
the match locked while it runs): its disk copy is dropped; where that was the page's only
copy of the pool that keeps nodes alive (full attention's), the page and every page
after it go, as eviction would have taken them. Until then each read of it fails again.
"""

from __future__ import annotations

from dataclasses import dataclass

from .eviction import prune
from .layout import PoolName, Tier
from .radix import ABSENT, TIERS, RadixTree, TreeNode

DISK = Tier.DISK
MEMORY = (Tier.DEVICE, Tier.HOST)


@dataclass(frozen=True)
class LostPage:
    node: TreeNode  # the node that held it when the read failed (a split puts it above)
    pool: PoolName
    key: bytes
    slot: int  # its disk slot


class LostPages:
    def __init__(self, tree: RadixTree, pools: tuple[PoolName, ...]) -> None:
        self.tree = tree
        self.pools = pools
        self.pending: list[LostPage] = []
        self.found = 0  # pages whose disk copy failed its checksum on a read
        self.dropped = 0  # pages the tree lost for it (those after a lost one included)

    def add(self, node: TreeNode, pool: PoolName, offset: int, slot: int) -> None:
        """Page `offset` of `node`'s run, read from disk slot `slot`, failed its checksum."""
        self.found += 1
        self.pending.append(LostPage(node, pool, node.keys[offset], slot))

    def drop(self) -> None:
        """Drop the pages found bad from the tree, where no lock holds them now (no
        transaction may be open: the drops are final)."""
        self.pending = [lost for lost in self.pending if not self._drop(lost)]

    def _drop(self, lost: LostPage) -> bool:
        """Whether `lost` is done with: dropped now, or gone already."""
        node = self._find(lost)
        if node is None:
            return True  # evicted since, its disk copy freed
        j = node.keys.index(lost.key)
        held = node.slots[DISK][lost.pool]
        if held is None or held[j] != lost.slot:
            return True  # its disk copy went already
        if any(node.locks):
            return False
        last_copy = lost.pool is self.pools[0] and not node.page_has(j, lost.pool, MEMORY)
        if last_copy and any(any(x.locks) for x in _subtree(node)):
            return False
        # A page of its own node: full KV is held on a tier for a whole run or not at all.
        if j:
            self.tree.split(node, j)  # `node` keeps the pages from the lost one on
        if node.n > 1:
            node = self.tree.split(node, 1)
        if last_copy:
            self._drop_subtree(node)
        else:
            self.tree.drop_pages(node, DISK, lost.pool, [0], None)
            self.dropped += 1
            prune(self.tree, self.pools, node, None, count=(DISK, lost.pool))
        return True

    def _find(self, lost: LostPage) -> TreeNode | None:
        """The live node holding `lost`'s page now, if any."""
        x: TreeNode | None = lost.node
        while x is not None and not x.is_root:
            if lost.key in x.keys:
                return x if self.tree.by_first_key.get(x.keys[0]) is x else None
            x = x.parent
        return None

    def _drop_subtree(self, top: TreeNode) -> None:
        parent = top.up
        for x in reversed(_subtree(top)):  # children first: a node detached is a leaf
            for pool in self.pools:
                for tier in TIERS:
                    pages = x.slots[tier][pool]
                    if pages is not None:
                        offsets = [k for k, p in enumerate(pages) if p != ABSENT]
                        self.tree.drop_pages(x, tier, pool, offsets, None)
            self.dropped += x.n
            self.tree.detach(x, None)
        if not parent.is_root:
            prune(self.tree, self.pools, parent, None, count=(DISK, self.pools[0]))


def _subtree(top: TreeNode) -> list[TreeNode]:
    """`top` and the nodes below it, parents before children."""
    out, stack = [], [top]
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out
