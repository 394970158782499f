"""The one transaction primitive for every multi-pool step.

Phase 1, reserve: take pages in each pool and tier the step needs, evicting
where allowed. Everything done so far (allocations, evictions, write-backs)
is journaled; a failure undoes it all, leaving tree and allocators exactly
as before. No page bytes are written in this phase: copies are deferred.

Phase 2, after `seal()`: deferred copies have run and evictions are final.
(A copy that fails inside `seal` is undone too: bytes it overwrote in pages
this transaction evicted are journaled first, so a rollback hands the tree
back its pages with their own bytes.)
The caller writes its pages and places them into tree nodes. `rollback()`
now undoes the placements and frees every reserved page; `commit()` keeps
them and frees reserved pages that were never placed.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

from .disk_records import PageMeta
from .layout import PoolName, Tier
from .page_bytes import PageCopier, keep_bytes, move_pages
from .pools import PoolRegistry
from .radix import Placement, RadixTree, TreeNode


class ReservationFailed(RuntimeError):
    pass


class TransactionClosed(RuntimeError):
    pass


class ReservationHook(Protocol):
    """Called at each reservation point before it takes pages; raising (any exception)
    fails that reservation, and the transaction rolls back whole. Tests and chaos runs
    give one to reach every failure path; production gives none."""

    def __call__(self, pool: PoolName, tier: Tier) -> None: ...


# make_room(tier, n_pages, txn) -> pages freed: a pool's eviction, given by the cache
# that owns the tree (in txn's journal, so that a rollback undoes it).
MakeRoom = Callable[[Tier, int, "Transaction"], int]


class Transaction:
    # One is made per put: slots, and lazily made page sets, keep that cheap.
    __slots__ = (
        "tree",
        "registry",
        "copier",
        "reserve_hook",
        "make_room",
        "owned",
        "sealed",
        "closed",
        "_journal",
        "_copies",
        "_on_close",
        "_dropped",
    )

    def __init__(
        self,
        tree: RadixTree,
        registry: PoolRegistry,
        copier: PageCopier,
        reserve_hook: ReservationHook | None,
        on_close: Callable[["Transaction"], None],
        make_room: Mapping[PoolName, MakeRoom],
    ) -> None:
        self.tree = tree
        self.registry = registry
        self.copier = copier
        self.reserve_hook = reserve_hook
        self.make_room = make_room
        # Reserved pages not yet placed, per (pool, tier) reserved in.
        self.owned: dict[tuple[PoolName, Tier], set[int]] = {}
        self.sealed = False
        self.closed = False
        self._journal: list[Callable[[], None]] = []
        self._copies: list[tuple[PoolName, Tier, list[int], Tier, list[int], Sequence[PageMeta]]]
        self._copies = []
        self._on_close = on_close
        # Pages evicted from the tree in phase 1, per (pool, tier): made lazily (most have none).
        self._dropped: dict[tuple[PoolName, Tier], set[int]] | None = None

    # --- phase 1 -------------------------------------------------------------------
    def record(self, undo: Callable[[], None]) -> None:
        self._journal.append(undo)

    def dropped(self, pool: PoolName, tier: Tier, pages: list[int]) -> None:
        """The tree freed these pages here; an undo gives them back, bytes and all."""
        if self._dropped is None:
            self._dropped = {}
        self._dropped.setdefault((pool, tier), set()).update(pages)

    def reserve(self, pool: PoolName, tier: Tier, n: int, evict: bool = True) -> list[int]:
        self._require_open()
        if self.sealed:
            raise TransactionClosed("reserve after seal: evictions could no longer be undone")
        if n <= 0:
            return []
        if self.reserve_hook is not None:
            self.reserve_hook(pool, tier)
        entry = self.registry[pool]
        allocator = entry.tier(tier).allocator
        free = allocator.free_count
        if n > free and evict and (make_room := self.make_room.get(pool)) is not None:
            make_room(tier, n - free, self)
            free = allocator.free_count
        if n > free:
            raise ReservationFailed(
                f"{pool.name}/{tier.name}: want {n} pages, {free} free after eviction"
            )
        pages = allocator.alloc(n)
        owned = self._owned(pool, tier)
        owned.update(pages)

        def undo() -> None:
            owned.difference_update(pages)
            allocator.free(pages)

        self.record(undo)
        return pages

    def reserve_all(
        self, plan: Mapping[tuple[PoolName, Tier], int], evict: bool = True
    ) -> dict[tuple[PoolName, Tier], list[int]]:
        """Reserve every (pool, tier) of `plan`, or nothing: on any failure (no room, or an
        error in an eviction), roll back and raise."""
        try:
            return {key: self.reserve(*key, n, evict=evict) for key, n in plan.items()}
        except BaseException:
            self.rollback()
            raise

    def adopt(self, pool: PoolName, tier: Tier, pages: Sequence[int]) -> None:
        """Own pages that are allocated already and hold bytes (a disk store's, found at
        start) as if reserved here: placed, they stay; otherwise they are freed."""
        self._require_open()
        self._owned(pool, tier).update(pages)

    def defer_copy(
        self,
        pool: PoolName,
        src_tier: Tier,
        src: list[int],
        dst_tier: Tier,
        dst: list[int],
        metas: Sequence[PageMeta] = (),
    ) -> None:
        """Copy pages at seal. `metas`: what names each page, for copies to the disk tier."""
        self._copies.append((pool, src_tier, src, dst_tier, dst, metas))

    # --- phase 2 -------------------------------------------------------------------
    def seal(self) -> None:
        self._require_open()
        if self.sealed:
            return
        for pool, src_tier, src, dst_tier, dst, metas in self._copies:
            entry = self.registry[pool]
            target = entry.tier(dst_tier)
            evicted = self._dropped and self._dropped.get((pool, dst_tier))
            if evicted:  # a copy into an evicted page: its bytes are needed if this seal fails
                reused = [d for d in dst if d in evicted]
                if reused:
                    self.record(keep_bytes(target, reused))
            move_pages(self.copier, entry.tier(src_tier), src, target, dst, metas)
        self._copies.clear()
        self._dropped = None
        self._journal.clear()
        self.sealed = True

    def place(
        self, node: TreeNode, tier: Tier, pool: PoolName, offsets: list[int], pages: Sequence[int]
    ) -> None:
        """Move reserved pages into `node` at `offsets` of its run."""
        owned = self._take_owned(pool, tier, pages)
        self.tree.set_pages(node, tier, pool, offsets, pages, None)

        def undo() -> None:
            self.tree.clear_pages(node, tier, pool, offsets)
            owned.update(pages)

        self.record(undo)

    def grow(
        self,
        path: list[TreeNode],
        parent: TreeNode | None,
        keys: list[bytes],
        tokens: bytes,
        tier: Tier,
        placements: Sequence[Placement],
    ) -> list[TreeNode]:
        """RadixTree.grow with reserved pages: the new run and every placement, one step."""
        taken: list[tuple[set[int], Sequence[int]]] = []

        def give_back() -> None:
            for owned, pages in taken:
                owned.update(pages)

        try:
            for pool, _, pages in placements:
                taken.append((self._take_owned(pool, tier, pages), pages))
            nodes = self.tree.grow(path, parent, keys, tokens, tier, placements, self)
        except BaseException:
            give_back()
            raise
        self.record(give_back)
        return nodes

    def commit(self) -> None:
        self.seal()
        self._free_owned()
        self._close()

    def rollback(
        self, quarantine: Callable[[dict[tuple[PoolName, Tier], list[int]]], None] | None = None
    ) -> None:
        """Undo everything. `quarantine` takes the reserved pages instead of the free
        list: for pages a failed transfer may still write into."""
        if self.closed:
            return
        for undo in reversed(self._journal):
            undo()
        self._journal.clear()
        self._copies.clear()
        if quarantine is not None:
            quarantine({k: sorted(v) for k, v in self.pages().items()})
            self.owned.clear()
        self._free_owned()
        self._close()

    # --- helpers -------------------------------------------------------------------
    def pages(self) -> dict[tuple[PoolName, Tier], set[int]]:
        return {key: set(pages) for key, pages in sorted(self.owned.items()) if pages}

    def _take_owned(self, pool: PoolName, tier: Tier, pages: Sequence[int]) -> set[int]:
        """Mark reserved `pages` placed: raises (nothing changed) unless this transaction
        reserved every one of them, once. Returns the (pool, tier)'s owned set."""
        owned = self._owned(pool, tier)
        if not owned.issuperset(pages):
            raise ValueError(
                f"pages {sorted(set(pages) - owned)[:8]} of {pool.name}/{tier.name} "
                f"are not reserved by this transaction"
            )
        before = len(owned)
        owned.difference_update(pages)
        if before - len(owned) != len(pages):  # a page listed twice (no set built to check first)
            owned.update(pages)
            raise ValueError(f"pages of {pool.name}/{tier.name} placed twice: {sorted(pages)[:8]}")
        return owned

    def _owned(self, pool: PoolName, tier: Tier) -> set[int]:
        owned = self.owned.get((pool, tier))
        if owned is None:
            owned = self.owned[(pool, tier)] = set()
        return owned

    def _free_owned(self) -> None:
        for (pool, tier), pages in self.owned.items():
            if pages:
                self.registry.pool(pool, tier).allocator.free(sorted(pages))
                pages.clear()

    def _require_open(self) -> None:
        if self.closed:
            raise TransactionClosed("transaction already committed or rolled back")

    def _close(self) -> None:
        self.closed = True
        # Undo closures of placements refer back to this transaction: dropping
        # them breaks the cycle, so a closed transaction is freed at once
        # instead of by the cyclic garbage collector.
        self._journal.clear()
        self._on_close(self)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback()
