"""LRU eviction of one pool on one tier, inside a transaction.

Groups of pages come from the pool's policy (locked nodes are never
candidates), kept across evictions (candidates.py) or, for the reference, from a
walk over the tree per eviction. Device pages may be written back to the host
tier instead of dropped. A node left without the pages that keep it meaningful
is pruned."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Callable

from .candidates import Candidates, GroupSource, WalkedGroups
from .disk_tier import page_metas
from .layout import PoolName, Tier
from .policies import AttentionPolicy
from .radix import ABSENT, TIERS, RadixTree, TreeNode

if TYPE_CHECKING:
    from .txn import Transaction


class Evictor:
    def __init__(
        self,
        tree: RadixTree,
        policy: AttentionPolicy,
        pools: tuple[PoolName, ...],
        write_back: Callable[[Tier], bool],
        candidates: Candidates | None = None,
    ) -> None:
        """`write_back(tier)`: whether pages evicted from `tier` go to the tier below it
        (instead of being dropped). `candidates`: the tree's kept heaps; None walks the
        tree per eviction (the reference, which makes the same choices)."""
        self.tree = tree
        self.candidates = candidates
        self.policy = policy
        self.pools = pools
        self.write_back = write_back
        self.evicted = 0
        self.written_back = 0

    def make_room(self, tier: Tier, n: int, txn: "Transaction", extra: int = 0) -> int:
        """Free at least `n` pages of this pool on `tier` if possible, and up to `extra`
        more while candidates last; return how many.

        Each eviction first brings its candidates up to date (or, for the reference,
        walks the tree), so callers under steady pressure ask for `extra` too."""
        demote = self.write_back(tier)
        with self._source(tier, demote) as source:
            return self._evict(source, tier, demote, n + max(0, extra), txn)

    def _source(self, tier: Tier, demote: bool) -> AbstractContextManager[GroupSource]:
        if self.candidates is None:
            return nullcontext(WalkedGroups(self.policy, self.tree, tier, demote))
        return self.candidates.source(self.policy, tier, demote)

    def _evict(
        self, source: GroupSource, tier: Tier, demote: bool, want: int, txn: "Transaction"
    ) -> int:
        pool, policy = self.policy.pool, self.policy
        freed = 0
        while freed < want and (group := source.pop()) is not None:
            _, _, node, offsets = group
            pages = node.slots[tier][pool]
            offsets = [j for j in offsets if pages is not None and pages[j] != ABSENT]
            if not offsets or not policy.is_evictable(node, tier, demote):
                continue
            if (
                demote
                and not self._write_back(node, tier, offsets, txn)
                and not policy.is_evictable(node, tier)
            ):
                continue  # no room below, and dropping would break prefix closure
            parent = node.up  # a node with pages is never a namespace root
            self.tree.drop_pages(node, tier, pool, offsets, txn)
            self.evicted += len(offsets)
            freed += len(offsets) + prune(self.tree, self.pools, node, txn, count=(tier, pool))
            if not parent.is_root and policy.is_evictable(parent, tier, demote):
                source.push(policy.group(parent, tier))
        return freed

    def _write_back(
        self, node: TreeNode, tier: Tier, offsets: list[int], txn: "Transaction"
    ) -> bool:
        """Copy the pages at `offsets` to the tier below `tier` where it has no copy yet."""
        from .txn import ReservationFailed

        pool, below = self.policy.pool, Tier(tier + 1)
        there = node.slots[below][pool]
        todo = [j for j in offsets if there is None or there[j] == ABSENT]
        if not todo:
            return True
        try:
            got = txn.reserve(pool, below, len(todo))
        except ReservationFailed:
            return False
        # The reservation may have evicted below (never this tier): the pages are still here.
        pages = node.pages_of(tier, pool)
        metas = page_metas(node, todo, self.tree.page_bytes) if below is Tier.DISK else ()
        txn.defer_copy(pool, tier, [pages[j] for j in todo], below, got, metas)
        txn.place(node, below, pool, todo, got)
        self.written_back += len(todo)
        return True


def is_dead(pools: tuple[PoolName, ...], node: TreeNode) -> bool:
    """A node is dead once it holds no KV of the pool that keeps nodes alive: the first
    of the layout's `pools` (full attention's, which sorts first, when there is one)."""
    return not node.has(pools[0])


def prune(
    tree: RadixTree,
    pools: tuple[PoolName, ...],
    node: TreeNode,
    txn: "Transaction | None",
    count: tuple[Tier, PoolName],
) -> int:
    """Drop dead nodes' remaining pages and detach dead leaves, walking up
    (journaled in `txn`; with None, final).

    Returns how many pages of `count` (tier, pool) this freed."""
    freed = 0
    while not node.is_root and is_dead(pools, node) and not any(node.locks):
        for pool in pools:
            for t in TIERS:
                pages = node.slots[t][pool]
                if pages is not None:
                    offsets = [j for j, p in enumerate(pages) if p != ABSENT]
                    tree.drop_pages(node, t, pool, offsets, txn)
                    freed += len(offsets) if (t, pool) == count else 0
        if node.children:
            break
        parent = node.up
        tree.detach(node, txn)
        node = parent
    return freed


def drop_cut_leaf(tree: RadixTree, pools: tuple[PoolName, ...], node: TreeNode) -> bool:
    """`node`, cut off a path's end (RadixTree.split_at), goes if it is an unlocked leaf
    holding nothing: an SWA-only tree may hold a node's early pages only, and it keeps
    no leaf without pages (check.py). Never for a node the caller goes on using.
    Returns whether it went."""
    if node.children or any(node.locks) or not is_dead(pools, node) or node.is_root:
        return False
    if node.up.children.get(node.tokens[: tree.page_bytes]) is not node:
        return False  # gone already (eviction pruned it since the path was walked)
    prune(tree, pools, node, None, count=(Tier.DEVICE, pools[0]))
    return True


def prune_unlocked(tree: RadixTree, pools: tuple[PoolName, ...], nodes: list[TreeNode]) -> None:
    """Finish the pruning eviction stopped at a lock: a node that lost its only child
    while locked (and holds no pages of its own) goes once its last lock is gone."""
    step = tree.page_bytes
    for node in reversed(nodes):
        if (
            not node.children
            and not any(node.locks)
            and is_dead(pools, node)
            and node.up.children.get(node.tokens[:step]) is node
        ):  # not pruned already
            prune(tree, pools, node, None, count=(Tier.DEVICE, pools[0]))
