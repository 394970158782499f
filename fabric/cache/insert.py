"""The one insert path of a node's cache.

A put of rows the caller computed and a fetch of a peer's pages differ only in which
pages they plan to fill (a put stores what its policies keep and the device lacks; a
fetch, what a usable match needs and no tier holds) and in where the bytes come from.
Both then commit the same way, whole or not at all: reserve pages, fill them, grow the
tree by the new run and place every page in one step (RadixTree.grow). Where free pages
cover the plan, as they mostly do, they come straight off the free lists and the grow is
the only step to undo; where eviction must make room, one transaction does it all, the
path locked against the eviction it runs."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeVar

from .keys import PageKeyer, encode_tokens
from .layout import PoolName, Tier
from .radix import DEVICE, DEVICE_ONLY, TIERS, Placement, TreeNode
from .records import NodeGuard

if TYPE_CHECKING:
    from .node_cache import CacheStats
    from .policies import AttentionPolicy
    from .pools import PoolRegistry
    from .radix import RadixTree
    from .tiers import TierController
    from .txn import ReservationHook, Transaction
    from .walks import Walk

T = TypeVar("T")
Reserved = dict[tuple[PoolName, Tier], list[int]]
# fill(reserved, hold) writes every planned page into its reserved device page. It returns
# None once written, or a failure, which the insert returns after rolling back. It calls
# hold() first when a transfer may still write the pages: they are quarantined, not freed.
Fill = Callable[[Reserved, Callable[[], None]], "T | None"]


@dataclass(slots=True)  # one is made per put
class InsertPlan:
    keyer: PageKeyer
    raw: bytes  # the packed tokens: the stored pages are its first `pages`
    path: list[TreeNode]  # what the tree has of them, split at `present_pages`
    present_pages: int  # pages already in the tree
    pages: int  # pages stored once the insert commits
    keep: Mapping[PoolName, Sequence[int]]  # positions the insert keeps: locked while it makes room
    todo: dict[PoolName, list[int]]  # of those, the pages to fill
    empty: bool  # no page to fill


class Undo(list):
    """The journal of a step that evicts nothing (RadixTree.grow's undo): undone newest first."""

    record = list.append  # (undo: Callable[[], None]); no Python frame per insert

    def dropped(self, pool: PoolName, tier: Tier, pages: list[int]) -> None:
        raise AssertionError("a step on free pages freed tree pages")

    def rollback(self) -> None:
        while self:
            self.pop()()


class Inserts:
    """NodeCache's insert path (a mixin). What it uses of the cache:"""

    tree: RadixTree
    registry: PoolRegistry
    policies: dict[PoolName, AttentionPolicy]
    primary_pool: PoolName
    tiers: TierController
    _stats: CacheStats
    keyer: Callable[[str], PageKeyer]
    walk: Callable[[Sequence[int], str], Walk]
    transaction: Callable[[], Transaction]
    lock_nodes: Callable[[dict[PoolName, list[TreeNode]]], NodeGuard]
    unlock_nodes: Callable[[NodeGuard], None]
    quarantine: Callable[[Reserved, str | None], None]
    reserve_hook: ReservationHook | None

    def plan_store(
        self, tokens: Sequence[int], namespace: str, first: dict[PoolName, int]
    ) -> InsertPlan:
        """A put's plan: the pages each policy keeps of `tokens` (rows from `first[pool]`
        on) that lack a device copy."""
        walked = self.walk(tokens, namespace)
        keyer, raw = walked.keyer, walked.raw
        n = len(raw) // self.tree.page_bytes
        path, m = self._cut(walked.path, walked.matched, first.values())
        n = self.policies[self.primary_pool].extent(m, n, first[self.primary_pool])
        # Leaving the tree below a node that has other children makes a branch
        # point: a likely continuation, so SWA keeps its window too.
        branch = m if path and path[-1].children and m < n else 0
        keep = {}
        for p, pol in self.policies.items():  # loops: a comprehension costs a frame a put
            keep[p] = pol.store_positions(n, branch, first[p])
        return self._plan(keyer, raw, path, m, n, keep, DEVICE_ONLY)

    def plan_fetch(self, tokens: Sequence[int], namespace: str, pages: int) -> InsertPlan:
        """A fetch's plan: the pages a usable match of `pages` pages needs that no tier holds."""
        keyer, raw = self.keyer(namespace), encode_tokens(tokens)
        path, m = self.tree.walk(keyer.root, raw[: pages * self.tree.page_bytes])
        path, m = self._cut(path, m, ())
        keep = {p: pol.needed(pages) for p, pol in self.policies.items()}
        return self._plan(keyer, raw, path, m, pages, keep, TIERS)

    def _cut(self, path: list[TreeNode], m: int, splits) -> tuple[list[TreeNode], int]:
        """A walk's path made to end at the `m` pages it matched, with node boundaries
        at `splits`."""
        tree = self.tree
        if path and m < path[-1].end:
            tree.split_at(path, m)
            path.pop()
        for f in splits:  # full KV moves whole nodes: rows start at a node boundary
            if f:  # position 0 is one already
                tree.split_at(path, f)
        return path, m

    def _plan(
        self,
        keyer: PageKeyer,
        raw: bytes,
        path: list[TreeNode],
        m: int,
        n: int,
        keep: Mapping[PoolName, Sequence[int]],
        present: tuple[Tier, ...],
    ) -> InsertPlan:
        tree, todo, empty = self.tree, {}, True
        for p, pos in keep.items():
            todo[p] = lacking = tree.missing(path, pos, p, present)
            empty = empty and not lacking
        return InsertPlan(keyer, raw, path, m, n, keep, todo, empty)

    def insert(self, plan: InsertPlan, fill: Fill, writer: str | None = None) -> "T | None":
        """Commit `plan`, its pages written by `fill`: None once committed, or fill's
        failure with nothing changed. Raises ReservationFailed (nothing changed) when
        eviction cannot make room. `writer`: the peer whose transfer may still write
        pages that fill holds."""
        if self._fits(plan.todo):
            nodes, failed = self._insert_free(plan, fill, writer)
        else:
            nodes, failed = self._insert_evicting(plan, fill, writer)
        if failed is not None:
            return failed  # the reserved pages may be half written: freed (or held), never read
        self.tree.touch(nodes)
        self._stats.inserted_pages += plan.pages - plan.present_pages
        self.tiers.after_insert(nodes[len(plan.path) :])
        return None

    def _insert_free(
        self, plan: InsertPlan, fill: Fill, writer: str | None
    ) -> tuple[list[TreeNode], "T | None"]:
        """The insert when free pages cover it, the common case: nothing is evicted, so
        pages come straight off the free lists and the tree grows in one step; a failure
        has only that step (its own undo) and the pages to give back. No transaction."""
        registry, hook, undo = self.registry, self.reserve_hook, Undo()
        allocators = registry.device_allocators
        got: Reserved = {}

        def hold() -> None:
            self.quarantine({k: sorted(v) for k, v in got.items() if v}, writer)
            got.clear()

        try:
            for pool, positions in plan.todo.items():
                if hook is not None and positions:  # as Transaction.reserve calls it
                    hook(pool, DEVICE)
                got[(pool, DEVICE)] = allocators[pool].alloc(len(positions))
            failed = fill(got, hold)
            if failed is not None:
                return [], failed
            nodes = self.tree.grow(plan.path, *self._grown(plan, got), undo)
            got.clear()  # placed: the tree owns them now
            return nodes, None
        except BaseException:
            undo.rollback()
            raise
        finally:
            for (pool, tier), pages in got.items():
                registry[pool].tier(tier).allocator.free(pages)

    def _insert_evicting(
        self, plan: InsertPlan, fill: Fill, writer: str | None
    ) -> tuple[list[TreeNode], "T | None"]:
        """The insert that must make room: one transaction reserves (evicting, its path
        locked against that), fills and grows, whole or not at all."""
        txn = self.transaction()
        guard = self._guard(plan.path, plan.keep)
        try:
            got = txn.reserve_all({(p, Tier.DEVICE): len(pos) for p, pos in plan.todo.items()})
            txn.seal()
            failed = fill(
                got, lambda: txn.rollback(hold=lambda pages: self.quarantine(pages, writer))
            )
            if failed is not None:
                return [], failed
            nodes = txn.grow(plan.path, *self._grown(plan, got))
            txn.commit()
        finally:
            txn.rollback()  # a no-op once committed: whatever failed, nothing stays half done
            self.unlock_nodes(guard)
        return nodes, None

    def _grown(
        self, plan: InsertPlan, got: Reserved
    ) -> tuple[TreeNode | None, list[bytes], bytes, Tier, list[Placement]]:
        """RadixTree.grow's arguments after the path: the new run (parent, keys, tokens)
        and where the reserved device pages go."""
        tree, path, m = self.tree, plan.path, plan.present_pages
        pb = tree.page_bytes
        parent, keys, tokens = None, [], plan.raw[m * pb : plan.pages * pb]
        if tokens:  # keys chain from the parent's last key, whatever position it ends at
            parent = path[-1] if path else tree.root(plan.keyer.root)
            keys = plan.keyer.chain(tokens, parent.keys[-1])
        placements: list[Placement] = []
        for p, pos in plan.todo.items():
            placements.append((p, pos, got[(p, DEVICE)]))
        return parent, keys, tokens, DEVICE, placements

    def _fits(self, todo: dict[PoolName, list[int]]) -> bool:
        """Whether every pool has the free device pages `todo` asks for (no eviction needed)."""
        allocators = self.registry.device_allocators
        for pool, positions in todo.items():  # a loop: a generator costs a frame per put
            if allocators[pool].free_count < len(positions):
                return False
        return True

    def _guard(self, path: list[TreeNode], keep: Mapping[PoolName, Sequence[int]]) -> NodeGuard:
        """Lock what an insert keeps of the existing path while it makes room."""
        held = {
            pool: [
                x for x in path if bisect_left(positions, x.start) < bisect_left(positions, x.end)
            ]
            for pool, positions in keep.items()
        }
        primary = held[self.primary_pool]
        if path and path[-1] not in primary[-1:]:
            primary.append(path[-1])  # new nodes hang below it: eviction must not prune it
        return self.lock_nodes(held)
