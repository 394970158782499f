"""The primitives a radix tree is built from, as both implementations export them: the
pure-Python reference (nodes.py) and the C extension `_radix`. RadixTree (radix.py) calls
whichever it was given through this interface; and the journal, keyer and allocator it is
handed."""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

from . import nodes
from .layout import PoolName, Tier
from .nodes import Counters


class TreeOps(Protocol):
    """What nodes.py and the C extension `_radix` both export (see nodes.py)."""

    TreeNode: Callable[[list[bytes], bytes, nodes.TreeNode | None, int], nodes.TreeNode]

    def walk(
        self, roots: dict[bytes, nodes.TreeNode], root_key: bytes, raw: bytes, step: int, /
    ) -> tuple[list[nodes.TreeNode], int]: ...

    def walk_keys(
        self, by_first_key: dict[bytes, nodes.TreeNode], keys: list[bytes], /
    ) -> tuple[list[nodes.TreeNode], int]: ...

    def touch(self, nodes: Sequence[nodes.TreeNode], now: int, hit: bool, /) -> None: ...

    def attach(
        self,
        parent: nodes.TreeNode,
        keys: list[bytes],
        tokens: bytes,
        step: int,
        by_first_key: dict[bytes, nodes.TreeNode],
        clock: int,
        /,
    ) -> nodes.TreeNode: ...

    def split(
        self,
        node: nodes.TreeNode,
        k: int,
        step: int,
        by_first_key: dict[bytes, nodes.TreeNode],
        /,
    ) -> nodes.TreeNode: ...

    def set_pages(
        self,
        node: nodes.TreeNode,
        tier: Tier,
        pool: PoolName,
        offsets: Sequence[int],
        pages: Sequence[int],
        owned: Counters,
        protected: Counters,
        /,
    ) -> None: ...

    def clear_pages(
        self,
        node: nodes.TreeNode,
        tier: Tier,
        pool: PoolName,
        offsets: Sequence[int],
        owned: Counters,
        protected: Counters,
        /,
    ) -> list[int]: ...

    def lock(
        self, nodes: Sequence[nodes.TreeNode], pool: PoolName, delta: int, protected: Counters, /
    ) -> None: ...

    def missing(
        self,
        path: Sequence[nodes.TreeNode],
        positions: Sequence[int],
        pool: PoolName,
        tiers: Sequence[Tier],
        /,
    ) -> list[int]: ...

    def place_runs(
        self,
        nodes: Sequence[nodes.TreeNode],
        tier: Tier,
        placements: Sequence[nodes.Placement],
        owned: Counters,
        protected: Counters,
        /,
    ) -> list[tuple[nodes.TreeNode, PoolName, list[int]]]: ...

    def grow(
        self,
        path: list[nodes.TreeNode],
        parent: nodes.TreeNode | None,
        keys: list[bytes],
        tokens: bytes,
        step: int,
        tier: Tier,
        placements: Sequence[nodes.Placement],
        by_first_key: dict[bytes, nodes.TreeNode],
        owned: Counters,
        protected: Counters,
        clock: int,
        /,
    ) -> tuple[list[nodes.TreeNode], list[tuple[nodes.TreeNode, PoolName, list[int]]]]: ...


class Journal(Protocol):
    def record(self, undo: Callable[[], None]) -> None: ...

    def dropped(self, pool: PoolName, tier: Tier, pages: list[int]) -> None: ...


class Keyer(Protocol):
    """What insert_free asks of a namespace's PageKeyer."""

    root: bytes

    def chain(self, raw: bytes, prev: bytes | None = None) -> list[bytes]: ...


class Allocator(Protocol):
    """What insert_free asks of a pool's allocator (allocator.py, or the C one)."""

    @property
    def free_count(self) -> int: ...

    def alloc(self, n: int) -> list[int]: ...

    def free(self, pages: list[int]) -> None: ...


def free_all(
    got: Mapping[tuple[PoolName, Tier], list[int]], allocators: Mapping[PoolName, Allocator]
) -> None:
    """Each pool's pages in `got` back to its allocator. A free that raises keeps no other
    pool's pages from theirs: the first error is raised once every free was tried."""
    error: BaseException | None = None
    for (pool, _), pages in got.items():
        try:
            allocators[pool].free(pages)
        except BaseException as e:
            if error is None:
                error = e
    if error is not None:
        raise error
