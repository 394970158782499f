"""One policy per attention type: which pages a match needs, what to store,
what may be evicted. Full attention and sliding window are two small classes
behind one interface, so the rest of the cache has no `if swa:` branches.

A path is the list of nodes from the namespace root; page position p lies in
the node with start <= p < end."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, NamedTuple

from .layout import KVLayout, PoolName, Tier
from .radix import ABSENT, TIERS, RadixTree, TreeNode

FULL = PoolName.FULL  # read once: enum member lookups are Python-level


class EvictionGroup(NamedTuple):
    """Pages of one node that eviction takes together; groups compare (as tuples) by
    `rank` (the policy's: lowest goes first), then by the node's first key."""

    rank: tuple[float, float]
    key: bytes
    node: TreeNode
    offsets: list[int]  # in the node's run


class AttentionPolicy(ABC):
    pool: PoolName
    # How far back from a match's end `needed` reaches: None for every page before it
    # (full attention), w for the last w pages (a window). The index packs this rule.
    window_pages: int | None

    @abstractmethod
    def needed(self, length: int) -> range:
        """Page positions whose KV this pool must hold for a match of `length` pages."""

    @abstractmethod
    def usable(self, path: list[TreeNode], limit: int, tiers: tuple[Tier, ...] = TIERS) -> int:
        """Longest L <= limit such that every page in needed(L) is on one of `tiers`."""

    def node_fault(self, node: TreeNode) -> str | None:
        """What is wrong with `node` by this pool's own rules (the invariant checker's
        question), or None."""
        return None

    @abstractmethod
    def exported(self, length: int, skip: int) -> range:
        """Page positions a peer's fetch of `length` pages reads from this pool, when it
        holds full KV for the first `skip` pages already."""

    @abstractmethod
    def store_positions(
        self, length: int, branch: int, first_row: int = 0, on_page_end: bool = False
    ) -> range | list[int]:
        """Positions to store when inserting `length` pages that branch off at `branch`
        (0: none), of those the caller has rows for (page `first_row` on): a put
        never stores bytes the caller did not compute. `on_page_end`: the tokens end
        where page `length` does, so the same tokens asked again match `length - 1`
        pages (an engine computes a request's last token itself)."""

    @abstractmethod
    def extent(self, matched: int, length: int, first_row: int) -> int:
        """How far a put may grow a path matched for `matched` pages toward `length`
        when this pool keeps nodes alive (the layout's first pool) and its rows
        start at page `first_row`: a new node must hold this pool's pages."""

    @abstractmethod
    def is_evictable(self, node: TreeNode, tier: Tier, keep_copy: bool = False) -> bool:
        """May `node`'s pages on `tier` go? `keep_copy`: a copy will be kept on a tier below."""

    # Whether a node's groups depend on the pages below it to the nearest anchor
    # (`pages_to_anchor`): then a change of shape below a node changes its groups.
    reads_chain = False

    @abstractmethod
    def node_groups(
        self, node: TreeNode, tier: Tier, keep_copy: bool, below: int
    ) -> list[EvictionGroup]:
        """`node`'s eviction groups on `tier` (none if it may not be evicted); `below`:
        its pages to the nearest anchor, where the policy reads_chain."""

    def groups(self, tree: RadixTree, tier: Tier, keep_copy: bool) -> list[EvictionGroup]:
        """Every node's eviction groups, lowest priority evicted first: the walk over the
        tree that incremental eviction (candidates.py) must agree with."""
        memo: dict[int, int] = {}
        return [
            g
            for n in tree.nodes()
            for g in self.node_groups(
                n, tier, keep_copy, pages_to_anchor(n, memo) if self.reads_chain else 0
            )
        ]

    def group(self, node: TreeNode, tier: Tier) -> EvictionGroup:
        """The group a node becomes once its children are gone (FULL cascades)."""
        return EvictionGroup(
            (node.last_access, -node.start), node.keys[0], node, list(range(node.n))
        )


class FullAttentionPolicy(AttentionPolicy):
    """Every page before L is needed. Full KV obeys prefix closure and moves a
    whole node at a time, so only leaves (or nodes keeping a copy on the other
    tier) may drop it."""

    pool = PoolName.FULL
    window_pages = None

    def needed(self, length: int) -> range:
        return range(length)

    def exported(self, length: int, skip: int) -> range:
        return range(skip, length)

    def usable(self, path: list[TreeNode], limit: int, tiers: tuple[Tier, ...] = TIERS) -> int:
        if len(tiers) == len(TIERS):
            return limit  # every node in the tree holds full KV on some tier
        for node in path:
            if node.start >= limit:
                break
            slots = node.slots
            for t in tiers:  # a loop, not all(): a generator costs a frame a node, twice a match
                if slots[t][FULL] is not None:
                    break
            else:
                return node.start
        return limit

    def store_positions(
        self, length: int, branch: int, first_row: int = 0, on_page_end: bool = False
    ) -> range:
        return range(first_row, length)

    def extent(self, matched: int, length: int, first_row: int) -> int:
        # Prefix closure: a page without full KV cannot be stored, nor any after it.
        return length if first_row <= matched else matched

    def node_fault(self, node: TreeNode) -> str | None:
        if any(
            pages is not None and ABSENT in pages for pages in (node.slots[t][FULL] for t in TIERS)
        ):
            return "holds full KV on a tier for only part of its run"
        if not node.has(FULL):
            return "has no full KV on any tier (prefix closure)"
        parent = node.parent
        if parent is not None and not parent.is_root and parent.locks[FULL] < node.locks[FULL]:
            return "holds more full locks than its parent"
        return None

    def is_evictable(self, node: TreeNode, tier: Tier, keep_copy: bool = False) -> bool:
        s = node.slots
        if s[tier][FULL] is None or node.locks[FULL]:
            return False
        if keep_copy or any(s[t][FULL] is not None for t in TIERS if t != tier):
            return True  # demotion: another copy keeps the chain closed
        # The last copy of a leaf's full KV takes the whole node: no lock of any pool may be on it.
        return not node.children and not any(node.locks)

    def node_groups(
        self, node: TreeNode, tier: Tier, keep_copy: bool, below: int
    ) -> list[EvictionGroup]:
        return [self.group(node, tier)] if self.is_evictable(node, tier, keep_copy) else []


class SlidingWindowPolicy(AttentionPolicy):
    """Only the pages covering the last `window` tokens before L are needed.

    SWA pages away from every likely continuation point (a sequence end or a
    branch point, the "anchors") are tombstoned first; full KV stays."""

    pool = PoolName.SWA
    reads_chain = True

    window_pages: int

    def __init__(self, layout: KVLayout) -> None:
        self.window_pages = layout.window_pages

    def needed(self, length: int) -> range:
        return range(max(0, length - self.window_pages), length)

    def exported(self, length: int, skip: int) -> range:
        return self.needed(length)  # the window before `length`, whatever is held below it

    def usable(self, path: list[TreeNode], limit: int, tiers: tuple[Tier, ...] = TIERS) -> int:
        length = limit
        while length > 0:
            gap = _last_gap(path, self.needed(length), tiers)
            if gap is None:
                return length
            length = gap
        return 0

    def store_positions(
        self, length: int, branch: int, first_row: int = 0, on_page_end: bool = False
    ) -> list[int]:
        keep = set(self.needed(length))
        if 0 < branch < length:
            keep.update(self.needed(branch))
        if on_page_end and length > 1:  # the window a match one page shorter needs: one page
            keep.update(self.needed(length - 1))
        # The branch's window may lie before the caller's rows (its cached tail was
        # evicted since it matched): those pages stay tombstoned.
        return sorted(p for p in keep if p >= first_row)

    def extent(self, matched: int, length: int, first_row: int) -> int:
        # Every put keeps the last page's window, so rows for the last page suffice.
        return length if first_row < length else matched

    def is_evictable(self, node: TreeNode, tier: Tier, keep_copy: bool = False) -> bool:
        return node.slots[tier][PoolName.SWA] is not None and not node.locks[PoolName.SWA]

    def group(self, node: TreeNode, tier: Tier) -> EvictionGroup:
        pages = node.slots[tier][PoolName.SWA]
        assert pages is not None, node
        return EvictionGroup(
            (True, node.last_access), node.keys[0], node, [j for j, p in enumerate(pages) if p >= 0]
        )

    def node_groups(
        self, node: TreeNode, tier: Tier, keep_copy: bool, below: int
    ) -> list[EvictionGroup]:
        if not self.is_evictable(node, tier):
            return []
        pages = node.slots[tier][PoolName.SWA]
        assert pages is not None, node  # is_evictable said so
        # Page j is (n-1-j) + below pages above the nearest anchor: within a
        # window of it, the page serves a likely continuation.
        cut = node.n - max(0, self.window_pages - below)
        present = [j for j, p in enumerate(pages) if p >= 0]
        far = [j for j in present if j < cut]
        near = [j for j in present if j >= cut]
        return [
            EvictionGroup((anchored, node.last_access), node.keys[0], node, offsets)
            for anchored, offsets in ((False, far), (True, near))
            if offsets
        ]


def _last_gap(path: list[TreeNode], positions: range, tiers: tuple[Tier, ...]) -> int | None:
    """The last position in `positions` whose SWA page is on none of `tiers`."""
    lo, hi = positions.start, positions.stop
    for node in reversed(path):
        if node.start >= hi:
            continue
        if node.end <= lo:
            break
        for p in range(min(hi, node.end) - 1, max(lo, node.start) - 1, -1):
            if not node.page_has(p - node.start, PoolName.SWA, tiers):
                return p
    return None


def pages_to_anchor(node: TreeNode, memo: dict[int, int]) -> int:
    """Pages between `node`'s run's end and the nearest leaf or branch point below, down
    its single-child chain; `memo` (by id, for nodes alive while it is) shares the chain's
    sums between calls."""
    chain = []
    while (known := memo.get(id(node))) is None and len(node.children) == 1:
        chain.append(node)
        (node,) = node.children.values()
    below = 0 if known is None else known
    memo[id(node)] = below
    for up in reversed(chain):  # `node` is `up`'s only child
        below += node.n
        memo[id(up)] = below
        node = up
    return below


def policies_for(layout: KVLayout) -> dict[PoolName, AttentionPolicy]:
    made = {PoolName.FULL: FullAttentionPolicy, PoolName.SWA: lambda: SlidingWindowPolicy(layout)}
    return {name: made[name]() for name in layout.pools}


def usable_length(
    policies: Mapping[PoolName, AttentionPolicy],
    path: list[TreeNode],
    limit: int,
    tiers: tuple[Tier, ...],
) -> int:
    """The longest length up to `limit` every pool's policy finds usable on `tiers`.
    Policies are visited in pool order, FULL first: full usability is prefix-closed,
    so the SWA policy's answer is usable for FULL too."""
    for policy in policies.values():
        limit = policy.usable(path, limit, tiers)
    return limit
