"""One policy per attention type: which pages a match needs, what to store,
what may be evicted. Full attention and sliding window are two small classes
behind one interface, so the rest of the cache has no `if swa:` branches."""
from __future__ import annotations

from abc import ABC, abstractmethod

from .layout import KVLayout, PoolName, Tier
from .radix import ABSENT, TIERS, Node, RadixTree


class AttentionPolicy(ABC):
    pool: PoolName

    @abstractmethod
    def needed(self, length: int) -> range:
        """Page positions whose KV this pool must hold for a match of `length` pages."""

    @abstractmethod
    def usable(self, path: list[Node], limit: int, tiers: tuple[Tier, ...] = TIERS) -> int:
        """Longest L <= limit such that every page in needed(L) is on one of `tiers`."""

    @abstractmethod
    def store_positions(self, length: int, branch: int) -> range | list[int]:
        """Positions to store when inserting `length` pages that leave the tree at `branch`."""

    @abstractmethod
    def is_evictable(self, node: Node, tier: Tier, keep_copy: bool = False) -> bool:
        """May `node`'s page on `tier` go? `keep_copy`: a copy will be kept on the other tier."""

    @abstractmethod
    def priority(self, node: Node) -> tuple:
        """Eviction order: lowest first; ends with a unique tiebreak."""

    def candidates(self, tree: RadixTree, tier: Tier, keep_copy: bool = False) -> list[tuple]:
        """(*priority, node) for every evictable node."""
        return [(*self.priority(n), n) for n in tree.nodes() if self.is_evictable(n, tier, keep_copy)]


class FullAttentionPolicy(AttentionPolicy):
    """Every page before L is needed; full KV obeys prefix closure, so only
    leaves (or pages with a copy on the other tier) may be dropped."""
    pool = PoolName.FULL

    def needed(self, length: int) -> range:
        return range(length)

    def usable(self, path: list[Node], limit: int, tiers: tuple[Tier, ...] = TIERS) -> int:
        if len(tiers) == len(TIERS):
            return limit  # every node in the tree holds full KV on some tier
        (tier,) = tiers
        for i in range(limit):
            if path[i].slots[tier][PoolName.FULL] == ABSENT:
                return i
        return limit

    def store_positions(self, length: int, branch: int) -> range:
        return range(length)

    def is_evictable(self, node: Node, tier: Tier, keep_copy: bool = False) -> bool:
        s = node.slots
        if s[tier][PoolName.FULL] == ABSENT or node.locks[PoolName.FULL]:
            return False
        if keep_copy or s[1 - tier][PoolName.FULL] != ABSENT:
            return True  # demotion: another copy keeps the chain closed
        return not node.children and not node.locks[PoolName.SWA]

    def priority(self, node: Node) -> tuple:
        return (node.last_access, -node.depth, node.key)


class SlidingWindowPolicy(AttentionPolicy):
    """Only the pages covering the last `window` tokens before L are needed.

    SWA pages away from every likely continuation point (a sequence end or a
    branch point, the "anchors") are tombstoned first: full KV stays."""
    pool = PoolName.SWA

    def __init__(self, layout: KVLayout) -> None:
        self.window_pages = layout.window_pages

    def needed(self, length: int) -> range:
        return range(max(0, length - self.window_pages), length)

    def usable(self, path: list[Node], limit: int, tiers: tuple[Tier, ...] = TIERS) -> int:
        length = limit
        while length > 0:
            gap = next((i for i in reversed(self.needed(length))
                        if all(path[i].slots[t][PoolName.SWA] == ABSENT for t in tiers)), None)
            if gap is None:
                return length
            length = gap
        return 0

    def store_positions(self, length: int, branch: int) -> list[int]:
        keep = set(self.needed(length))
        if 0 < branch < length:
            keep.update(self.needed(branch))
        return sorted(keep)

    def is_evictable(self, node: Node, tier: Tier, keep_copy: bool = False) -> bool:
        return node.slots[tier][PoolName.SWA] != ABSENT and not node.locks[PoolName.SWA]

    def priority(self, node: Node) -> tuple:
        below, steps = node, 0
        while len(below.children) == 1 and steps < self.window_pages:
            (below,) = below.children.values()
            steps += 1
        return (steps < self.window_pages, node.last_access, node.key)

    def candidates(self, tree: RadixTree, tier: Tier, keep_copy: bool = False) -> list[tuple]:
        # One bottom-up pass instead of a walk down per candidate.
        dist = _distance_to_anchor(tree)
        w = self.window_pages
        return [(dist[id(n)] < w, n.last_access, n.key, n)
                for n in tree.nodes() if self.is_evictable(n, tier)]


def _distance_to_anchor(tree: RadixTree) -> dict[int, int]:
    """Per node, how many single-child steps down to a leaf or branch point."""
    order = list(tree.nodes())
    dist: dict[int, int] = {}
    for node in reversed(order):  # children come after parents in `order`
        if len(node.children) == 1:
            (child,) = node.children.values()
            dist[id(node)] = dist[id(child)] + 1
        else:
            dist[id(node)] = 0
    return dist


def policies_for(layout: KVLayout) -> dict[PoolName, AttentionPolicy]:
    made = {PoolName.FULL: FullAttentionPolicy, PoolName.SWA: lambda: SlidingWindowPolicy(layout)}
    return {name: made[name]() for name in layout.pools}
