"""ChangeLog: which pages of a radix tree changed since the event publisher last looked.

Each change is listed as the node that held the page then and the page's position,
which no later split changes (a split keeps a run's tail in the node and puts its head
in a new parent): the publisher resolves it to the page's holder when it looks
(`holder`), and a node that left the tree still names the pages it held.

Bounded: past `limit()` entries it stops listing and marks itself overflowed, and
the publisher restates everything the node holds instead (a cleared batch), which
costs no more than sending that many changes. It starts overflowed, as a
publisher's first batch states everything anyway: a node that does not publish
yet (no index attached) lists nothing however much it changes."""

from __future__ import annotations

from typing import Callable, Iterable

from .nodes import TreeNode

Change = tuple[TreeNode, int]  # (the node that held the page, its position)


class ChangeLog:
    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.changes: list[Change] = []  # may repeat a page
        self.overflowed = True

    def touched(self, node: TreeNode, offsets: Iterable[int]) -> None:
        """The pages at `offsets` in `node`'s run changed."""
        if self.overflowed:
            return
        start = node.start
        self.changes.extend((node, start + o) for o in offsets)
        if len(self.changes) > self.limit():
            self.changes, self.overflowed = [], True

    def left(self, node: TreeNode) -> None:
        """`node`'s pages left the tree (the detached node resolves them)."""
        self.touched(node, range(node.n))

    def take(self) -> tuple[list[Change], bool]:
        """(changes, whether to restate everything instead); starts afresh."""
        out = self.changes, self.overflowed
        self.changes, self.overflowed = [], False
        return out

    def __bool__(self) -> bool:
        return self.overflowed or bool(self.changes)


def holder(node: TreeNode, position: int) -> TreeNode:
    """The node holding page `position` now that `node` held when it changed: splits
    since then moved it into a head above."""
    while node.start > position:
        node = node.up
    return node
