"""A request's packed tokens and walk, kept from its `match` for the `put` that follows.

A request matches, computes what the cache lacked, then puts the same tokens: packing
them and walking the tree again would repeat work whose answer cannot have changed,
unless the tokens or the tree's shape did. The memo holds the last walk and answers
only when both are provably the same: the tokens encode to the bytes packed at the match
(a list may be changed in place in between; the check reads it once, in C, allocating
nothing), and the tree's shape version (bumped by every attach, detach and split) is
unchanged. Pages placed or dropped in between do
not matter: a walk follows token runs, not pages. One entry: the put follows its match."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .keys import PageKeyer, packs_to
from .radix import TreeNode


@dataclass(slots=True)  # two are made per request: a slotted class is made fastest
class Walk:
    keyer: PageKeyer  # the namespace's: the walk starts at its root
    raw: bytes  # the tokens packed (encode_tokens)
    path: list[TreeNode]  # a copy for the caller: plans split it in place
    matched: int  # pages of `raw` the tree holds along `path`


class WalkMemo:
    """The last walk, kept in slots (no entry object made per request)."""

    __slots__ = ("_namespace", "_keyer", "_version", "_raw", "_path", "_matched")
    _namespace: str
    _keyer: PageKeyer | None
    _version: int
    _raw: bytes | None  # None: nothing remembered
    _path: tuple[TreeNode, ...]
    _matched: int

    def __init__(self) -> None:
        self.forget()

    def recall(self, tokens: Sequence[int], namespace: str, version: int) -> Walk | None:
        raw = self._raw
        if (
            raw is None
            or self._version != version
            or self._namespace != namespace
            or not packs_to(tokens, raw)
        ):
            return None
        assert self._keyer is not None  # remembered with the bytes
        return Walk(self._keyer, raw, list(self._path), self._matched)

    def remember(self, namespace: str, version: int, walk: Walk) -> None:
        self._namespace, self._keyer, self._version = namespace, walk.keyer, version
        self._raw, self._path, self._matched = walk.raw, tuple(walk.path), walk.matched

    def forget(self) -> None:
        self._namespace, self._keyer, self._version = "", None, -1
        self._raw, self._path, self._matched = None, (), 0
