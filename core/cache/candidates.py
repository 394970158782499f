"""Eviction candidates kept across evictions, instead of a walk over the tree per batch.

A `CandidateHeap` holds, for one pool's policy on one tier (and whether device pages
are demoted), the eviction groups of every node, in the order the walk's heap pops
them (`AttentionPolicy.groups`, kept as the reference: `WalkedGroups`). The tree marks
each node it changes in `RadixTree.dirty`; `Candidates` hands those to every heap, which
re-examines them before its next eviction: it gives each a new stamp and pushes its
current groups. A heap entry whose stamp is no longer its node's is stale and skipped,
so a node that changed, left the tree or came back through a rollback is never evicted
from what it was. Within one eviction, stamps stay put: entries behave as the walk's
list does (made at the start, pages already gone filtered out when popped), and every
node popped or pushed is looked at again before the next eviction."""

from __future__ import annotations

import contextlib
import heapq
import itertools
from typing import Iterator, Protocol

from .layout import PoolName, Tier
from .policies import AttentionPolicy, EvictionGroup, pages_to_anchor
from .radix import RadixTree, TreeNode

# (rank, key, offsets, stamp, node): ordered as EvictionGroup orders (rank, key, node,
# offsets). Two live entries with the same rank and key are one node's (keys name one
# node at a time), whose stamp they share, so offsets decide between them in both. The
# offsets are a tuple, which the collector stops tracking, unlike a list.
Entry = tuple[tuple[float, float], bytes, tuple[int, ...], int, TreeNode]


class GroupSource(Protocol):
    """Where one eviction takes its groups from, lowest first."""

    def pop(self) -> EvictionGroup | None: ...

    def push(self, group: EvictionGroup) -> None: ...


class WalkedGroups:
    """The reference: every group from one walk over the tree, for one eviction."""

    def __init__(self, policy: AttentionPolicy, tree: RadixTree, tier: Tier, keep_copy: bool):
        self.heap = policy.groups(tree, tier, keep_copy)
        heapq.heapify(self.heap)

    def pop(self) -> EvictionGroup | None:
        return heapq.heappop(self.heap) if self.heap else None

    def push(self, group: EvictionGroup) -> None:
        heapq.heappush(self.heap, group)


class CandidateHeap:
    """One policy's groups on one tier, kept up to date from the nodes the tree marks."""

    def __init__(
        self, tree: RadixTree, policy: AttentionPolicy, tier: Tier, keep_copy: bool
    ) -> None:
        self.tree, self.policy, self.tier, self.keep_copy = tree, policy, tier, keep_copy
        self.entries: list[Entry] = []
        self.stamps: dict[TreeNode, int] = {}  # live stamp per node with groups in `entries`
        self.pending: set[TreeNode] = set()  # nodes to look at again before the next pop
        self.stale = True  # rebuild from a walk: new, or changes were lost
        self.busy = False  # inside an eviction, whose stamps must stay put
        self.walks = 0  # rebuilds from a walk over the tree (tests, benches)
        self._stamp = itertools.count(1)

    # --- one eviction ------------------------------------------------------------------
    def pop(self) -> EvictionGroup | None:
        entries, stamps = self.entries, self.stamps
        while entries:
            rank, key, offsets, stamp, node = heapq.heappop(entries)
            if stamps.get(node) == stamp:
                self.pending.add(node)  # its entry is gone: the next eviction looks again
                return EvictionGroup(rank, key, node, list(offsets))
        return None

    def push(self, group: EvictionGroup) -> None:
        node = group.node
        stamp = self.stamps.get(node)
        if stamp is None:
            stamp = self.stamps[node] = next(self._stamp)
        self.pending.add(node)  # the walk would not have this entry next time
        heapq.heappush(self.entries, (group.rank, group.key, tuple(group.offsets), stamp, node))

    # --- between evictions ---------------------------------------------------------------
    def update(self, walk_share: float) -> None:
        """Bring the entries to the tree as it is: a walk when over `walk_share` of the
        nodes changed (or the changes were lost), else a look at each changed node. Any
        failure on the way leaves the heap to be rebuilt."""
        try:
            if self.stale or len(self.pending) > walk_share * self.tree.node_count:
                self._rebuild()
            elif self.pending:
                self._refresh()
        except BaseException:
            self.stale = True
            raise

    def _rebuild(self) -> None:
        self.walks += 1
        self.entries, self.stamps, self.pending = [], {}, set()
        stamps = self.stamps
        for g in self.policy.groups(self.tree, self.tier, self.keep_copy):
            stamp = stamps.get(g.node)
            if stamp is None:
                stamp = stamps[g.node] = next(self._stamp)
            self.entries.append((g.rank, g.key, tuple(g.offsets), stamp, g.node))
        heapq.heapify(self.entries)
        self.stale = False

    def _refresh(self) -> None:
        nodes, self.pending = self.pending, set()
        if self.policy.reads_chain:
            nodes = with_chain_ancestors(self.tree, nodes)
        by_first_key, stamps, entries = self.tree.by_first_key, self.stamps, self.entries
        policy, tier, keep_copy = self.policy, self.tier, self.keep_copy
        memo: dict[int, int] = {}
        for node in nodes:
            groups: list[EvictionGroup] = []
            if node.parent is not None and by_first_key.get(node.keys[0]) is node:  # in the tree
                below = pages_to_anchor(node, memo) if policy.reads_chain else 0
                groups = policy.node_groups(node, tier, keep_copy, below)
            if not groups:
                stamps.pop(node, None)
                continue
            stamp = stamps[node] = next(self._stamp)
            for g in groups:
                heapq.heappush(entries, (g.rank, g.key, tuple(g.offsets), stamp, node))
        if len(entries) > 4 * len(stamps) + 64:  # mostly stale: keep the live ones
            self.entries = [e for e in entries if stamps.get(e[4]) == e[3]]
            heapq.heapify(self.entries)


def with_chain_ancestors(tree: RadixTree, nodes: set[TreeNode]) -> set[TreeNode]:
    """`nodes` and every ancestor whose single-child chain reaches one of them in the tree:
    a change of shape at a node changes the pages to the anchor of each of those."""
    out = set(nodes)
    by_first_key = tree.by_first_key
    for node in nodes:
        if node.parent is None or by_first_key.get(node.keys[0]) is not node:
            continue  # a root, or out of the tree: its parent was marked when it left
        parent = node.up
        while not parent.is_root and len(parent.children) == 1 and parent not in out:
            out.add(parent)
            parent = parent.up
    return out


class Candidates:
    """One tree's heaps, one per (pool, tier, keep_copy): hands each the nodes the tree
    marked before an eviction uses it."""

    def __init__(self, tree: RadixTree, walk_share: float = 0.5) -> None:
        self.tree = tree
        # Past this share of the nodes changed, a walk beats looking at each (tests set
        # it high, to take the incremental path wherever it can be taken).
        self.walk_share = walk_share
        self.heaps: dict[tuple[PoolName, Tier, bool], CandidateHeap] = {}

    @contextlib.contextmanager
    def source(self, policy: AttentionPolicy, tier: Tier, keep_copy: bool) -> Iterator[GroupSource]:
        """The groups for one eviction of `policy`'s pool on `tier`."""
        key = (policy.pool, tier, keep_copy)
        heap = self.heaps.get(key)
        if heap is None:
            heap = self.heaps[key] = CandidateHeap(self.tree, policy, tier, keep_copy)
        if heap.busy:  # an eviction inside one of the same heap (none today): its own walk
            yield WalkedGroups(policy, self.tree, tier, keep_copy)
            return
        self._take_changes()
        heap.update(self.walk_share)
        heap.busy = True
        try:
            yield heap
        finally:
            heap.busy = False

    def _take_changes(self) -> None:
        tree = self.tree
        dirty, tree.dirty = tree.dirty, set()  # tracking starts with the first eviction
        for heap in self.heaps.values():
            if dirty is None or len(heap.pending) + len(dirty) > tree.node_count + 1024:
                # changes lost, or a heap long unused: a walk is cheaper than the backlog
                heap.stale, heap.pending = True, set()
            elif not heap.stale:
                heap.pending |= dirty
