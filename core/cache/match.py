"""A match: what a request's tokens (or a chain of page keys) find in the tree."""

from __future__ import annotations

from dataclasses import dataclass

from .radix import TreeNode


@dataclass(slots=True)  # one is made per request
class Match:
    """A request's cached prefix along `path` from the root: `present_pages` of it are in
    the tree, of which the first `usable_pages` can serve the request (every pool holds
    what a match of that length needs)."""

    path: list[TreeNode]  # nodes holding the request's matched pages (the last may hold more)
    present_pages: int  # pages present in the tree, on any tier, in any pool
    usable_pages: int  # usable length, either tier
    usable_device_pages: int  # usable length from the device tier alone
    request_pages: int  # whole pages in the request

    @property
    def keys(self) -> list[bytes]:
        return [k for n in self.path for k in n.keys][: self.usable_pages]
