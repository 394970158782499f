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

from typing import NamedTuple, Sequence

from .keys import packs_to
from .radix import TreeNode


class Walk(NamedTuple):  # two are made per request: a tuple is made fastest
    raw: bytes  # the tokens packed (encode_tokens)
    path: list[TreeNode]  # a copy for the caller: plans split it in place
    matched: int  # pages of `raw` the tree holds along `path`


class _Entry(NamedTuple):
    namespace: str
    version: int
    raw: bytes
    path: tuple[TreeNode, ...]
    matched: int


class WalkMemo:
    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: _Entry | None = None

    def recall(self, tokens: Sequence[int], namespace: str, version: int) -> Walk | None:
        e = self._entry
        if (
            e is None
            or e.version != version
            or e.namespace != namespace
            or not packs_to(tokens, e.raw)
        ):
            return None
        return Walk(e.raw, list(e.path), e.matched)

    def remember(
        self,
        namespace: str,
        version: int,
        raw: bytes,
        path: list[TreeNode],
        matched: int,
    ) -> None:
        self._entry = _Entry(namespace, version, raw, tuple(path), matched)

    def forget(self) -> None:
        self._entry = None
