"""ChangeLog: which page keys of a radix tree changed since the event publisher last looked.

Bounded: past `limit()` entries it stops listing and marks itself overflowed, and
the publisher restates everything the node holds instead (a cleared batch), which
costs no more than sending that many changes. It starts overflowed, as a
publisher's first batch states everything anyway: a node that does not publish
yet (no index attached) lists nothing however much it changes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from .radix import TreeNode


class ChangeLog:
    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.keys: list[bytes] = []  # may repeat a key
        self.removed: dict[bytes, tuple["TreeNode", int]] = {}  # key -> (detached node, offset)
        self.overflowed = True

    def touched(self, keys: Iterable[bytes]) -> None:
        if self.overflowed:
            return
        self.keys.extend(keys)
        if len(self.keys) > self.limit():
            self.keys, self.removed, self.overflowed = [], {}, True

    def left(self, node: "TreeNode") -> None:
        """`node`'s pages left the tree (its keys resolve through the detached node)."""
        if not self.overflowed:
            self.removed.update((k, (node, i)) for i, k in enumerate(node.keys))
            self.touched(node.keys)

    def take(self) -> tuple[list[bytes], dict[bytes, tuple["TreeNode", int]], bool]:
        """(keys changed, removed ones, whether to restate everything instead); starts afresh."""
        out = self.keys, self.removed, self.overflowed
        self.keys, self.removed, self.overflowed = [], {}, False
        return out

    def __bool__(self) -> bool:
        return self.overflowed or bool(self.keys)
