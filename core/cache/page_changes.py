"""Page by page, what a node cache holds and what changed since last asked: the view
its event publisher (core/index/publisher.py) turns into KV events, so that the
publisher never walks the tree itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .changes import ChangeLog, holder
from .layout import PoolName, Tier
from .radix import ABSENT, TIERS, RadixTree, TreeNode

# A page and the keys of its path from depth 0 (itself last): what routing needs.
PageWithPath = tuple["PageView", list[bytes]]


@dataclass(frozen=True, slots=True)
class PageView:
    key: bytes
    parent: bytes  # the key before it (a namespace root's for page 0)
    position: int
    held: tuple[tuple[PoolName, Tier], ...]  # where its KV is; () for a page that left


class PageChanges:
    """A tree's pages as its cache's event publisher sees them."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree

    def track_changes(self, pending_floor: int) -> None:
        """List changed pages from now on, at most `pending_floor` plus twice the keys
        held; past that, `take_changes` says to restate everything instead."""
        tree = self.tree
        tree.changes = ChangeLog(lambda: pending_floor + 2 * tree.page_count)

    def has_changes(self) -> bool:
        return bool(self.tree.changes)

    def take_changes(self) -> tuple[list[PageWithPath], bool]:
        """(pages changed since the last call, each once; whether to restate everything
        instead: then the list is empty). Starts afresh."""
        tree = self.tree
        if tree.changes is None:
            raise RuntimeError("track_changes first")
        changes, restate = tree.changes.take()
        latest: dict[bytes, tuple[TreeNode, int]] = {}  # first change's order, last holder
        for node, position in changes:
            node = holder(node, position)
            j = position - node.start
            latest[node.keys[j]] = node, j
        # A node that left the tree holds no pages: its view says the page left.
        paths = _Paths()
        out = [(_view(node, j), paths.of(node, j)) for node, j in latest.values()]
        return out, restate

    def held_pages(self) -> Iterator[PageView]:
        """Every page in the tree, with where its KV is (possibly nowhere)."""
        return (_view(node, j) for node in self.tree.nodes() for j in range(node.n))

    def held_pages_with_paths(self) -> Iterator[PageWithPath]:
        """The same, each with its key path (what routing the pages to shards needs)."""
        paths = _Paths()
        return (
            (_view(node, j), paths.of(node, j)) for node in self.tree.nodes() for j in range(node.n)
        )


class _Paths:
    """Page-key paths from depth 0, memoized per node for one call."""

    def __init__(self) -> None:
        self._memo: dict[int, list[bytes]] = {}

    def of(self, node: TreeNode, offset: int) -> list[bytes]:
        return self._upto(node.parent) + node.keys[: offset + 1]

    def _upto(self, node: TreeNode | None) -> list[bytes]:
        if node is None or node.is_root:
            return []
        path = self._memo.get(id(node))
        if path is None:
            path = self._memo[id(node)] = self._upto(node.parent) + node.keys
        return path


def _parent(node: TreeNode, offset: int) -> bytes:
    if offset:
        return node.keys[offset - 1]
    assert node.parent is not None, "a root holds no pages"
    return node.parent.keys[-1]


def _view(node: TreeNode, offset: int) -> PageView:
    held = tuple(
        (pool, tier)
        for tier in TIERS
        for pool in PoolName
        if (pages := node.slots[tier][pool]) is not None and pages[offset] != ABSENT
    )
    return PageView(node.keys[offset], _parent(node, offset), node.start + offset, held)
