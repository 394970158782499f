"""The one insert path of a node's cache.

A put of rows the caller computed and a fetch of a peer's pages differ only in which
pages they plan to fill (a put stores what its policies keep and the device lacks; a
fetch, what a usable match needs and no tier holds) and in where the bytes come from.
Both then commit the same way, whole or not at all: reserve pages, fill them, grow the
tree by the new run and place every page in one step (RadixTree.grow). Where free pages
cover the plan, as they mostly do, RadixTree.insert_free does all of it, straight off the
free lists: on the native tree one C call, its journal the grow alone. Where eviction must
make room, one transaction does it, the path locked against the eviction it runs."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar

from .eviction import drop_cut_leaf
from .keys import KeyerCache, PageKeyer, encode_tokens
from .layout import KVLayout, PoolName, Tier
from .locks import TreeGuard, TreeLocks
from .policies import AttentionPolicy
from .pools import PoolRegistry
from .quarantine import Quarantines
from .radix import (
    DEVICE,
    DEVICE_ONLY,
    TIERS,
    Placement,
    RadixTree,
    Reserved,
    TreeNode,
    placements,
)
from .tiers import TierController
from .txn import ReservationHook, Transaction
from .walk_memo import Walk

T = TypeVar("T")
# fill(reserved, quarantine) writes every planned page into its reserved device page. It returns
# None once written, or a failure, which the insert returns after rolling back. It calls
# quarantine() first when a transfer may still write the pages: they are quarantined, not freed.
Fill = Callable[[Reserved, Callable[[], None]], "T | None"]
# unlocked(copy) is `copy` run with the caller's lock given up (the node actor's gate).
Unlocked = Callable[[Callable[[], None]], Callable[[], None]]


@dataclass(slots=True)  # one is made per put
class InsertPlan:
    keyer: PageKeyer
    tokens: bytes  # the new run's token bytes: pages present_pages to pages, packed
    path: list[TreeNode]  # what the tree has of them, split at `present_pages`
    present_pages: int  # pages already in the tree
    pages: int  # pages stored once the insert commits
    keep: Mapping[PoolName, Sequence[int]]  # positions the insert keeps: locked while it makes room
    todo: dict[PoolName, list[int]]  # of those, the pages to fill
    empty: bool  # no page to fill


class Inserts:
    """One cache's insert path: plans over its tree, commits through its pools."""

    def __init__(
        self,
        tree: RadixTree,
        layout: KVLayout,
        registry: PoolRegistry,
        policies: dict[PoolName, AttentionPolicy],
        tiers: TierController,
        keyers: KeyerCache,
        walk: Callable[[Sequence[int], str], Walk],
        transaction: Callable[[], Transaction],
        locks: TreeLocks,
        quarantines: Quarantines,
    ) -> None:
        self.tree = tree
        self.layout = layout
        self.registry = registry
        self.policies = policies
        # The pool whose pages keep a node alive (layout.pools builds a new tuple per call).
        self.primary_pool = layout.pools[0]
        self.tiers = tiers
        self.keyers = keyers
        self.walk = walk  # the cache's: its memo answers a put after its match
        self.transaction = transaction
        self.locks = locks
        self.quarantines = quarantines
        # Pages an insert took off the free lists and fills, its caller's lock perhaps
        # given up meanwhile: owned by that insert (check.py counts them).
        self.filling: dict[int, Reserved] = {}
        self.inserted_pages = 0

    def plan_store(
        self, tokens: Sequence[int], namespace: str, first: dict[PoolName, int]
    ) -> InsertPlan:
        """A put's plan: the pages each policy keeps of `tokens` (rows from `first[pool]`
        on) that lack a device copy."""
        walked = self.walk(tokens, namespace)
        keyer, raw = walked.keyer, walked.raw
        whole = len(raw) // self.tree.page_bytes
        path, m = self._cut(walked.path, walked.matched, first.values())
        n = self.policies[self.primary_pool].extent(m, whole, first[self.primary_pool])
        # Leaving the tree below a node that has other children makes a branch
        # point: a likely continuation, so SWA keeps its window too.
        branch = m if path and path[-1].children and m < n else 0
        # Tokens that end on a page boundary, asked again, match a page less (the
        # engine computes the last token itself): SWA keeps that match's window too.
        on_page_end = n == whole and len(raw) == n * self.tree.page_bytes
        keep = {}
        for p, pol in self.policies.items():  # loops: a comprehension costs a frame a put
            keep[p] = pol.store_positions(n, branch, first[p], on_page_end)
        return self._plan(keyer, raw, path, m, n, keep, DEVICE_ONLY)

    def plan_fetch(self, tokens: Sequence[int], namespace: str, pages: int) -> InsertPlan:
        """A fetch's plan: the pages a usable match of `pages` pages needs that no tier holds."""
        keyer, raw = self.keyers.get(namespace), encode_tokens(tokens)
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
            drop_cut_leaf(tree, self.layout.pools, path.pop())
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
        pb = tree.page_bytes
        return InsertPlan(keyer, raw[m * pb : n * pb], path, m, n, keep, todo, empty)

    def insert(
        self,
        plan: InsertPlan,
        fill: Fill | None,
        writer: str | None,
        reserve_hook: ReservationHook | None,
    ) -> "T | None":
        """Commit `plan`, its pages written by `fill` (None: nothing to write): None once
        committed, or fill's failure with nothing changed. Raises ReservationFailed (nothing
        changed) when eviction cannot make room. `writer`: the peer whose transfer may still
        write pages that fill holds. `reserve_hook`: the cache's (NodeCache.reserve_hook)."""
        tree, quarantine, guard = self.tree, None, None
        got: Reserved = {}
        if fill is not None:

            def quarantine() -> None:
                self.quarantines.add({k: sorted(v) for k, v in got.items() if v}, writer)
                got.clear()

            # A fill may give up the caller's lock while bytes move (an import's read, a
            # save's copy): an eviction for another prefix then must not prune the path.
            guard = self._guard(plan.path, plan.keep)
            self.filling[id(got)] = got  # so check() counts them meanwhile
        try:
            done = tree.insert_free(  # the common case: free pages cover it, so one step
                plan.path,
                plan.tokens,
                plan.keyer,
                plan.todo,
                DEVICE,
                self.registry.device_allocators,
                reserve_hook,
                fill,
                quarantine,
                got,
            )
            if done is None:
                done = self._insert_evicting(plan, fill, writer)
        finally:
            if guard is not None:
                del self.filling[id(got)]
                self.locks.unlock(guard)
        nodes, failed = done
        if failed is not None:
            return failed  # the reserved pages may be half written: freed (or held), never read
        self.inserted_pages += plan.pages - plan.present_pages
        # Copies written through for the nodes that took pages: the new ones, and old ones
        # given pages they lacked (an SWA window at a branch point).
        self.tiers.after_insert(nodes, plan.todo)
        return None

    def _insert_evicting(
        self, plan: InsertPlan, fill: Fill | None, writer: str | None
    ) -> tuple[list[TreeNode], "T | None"]:
        """The insert that must make room: one transaction reserves (evicting, its path
        locked against that), fills and grows, whole or not at all; then touches the nodes
        (as insert_free does)."""
        txn = self.transaction()
        guard = self._guard(plan.path, plan.keep)
        try:
            got = txn.reserve_all({(p, Tier.DEVICE): len(pos) for p, pos in plan.todo.items()})
            txn.seal()
            if fill is not None:
                failed = fill(
                    got,
                    lambda: txn.rollback(
                        quarantine=lambda pages: self.quarantines.add(pages, writer)
                    ),
                )
                if failed is not None:
                    return [], failed
            nodes = txn.grow(plan.path, *self._grown(plan, got))
            txn.commit()
        finally:
            txn.rollback()  # a no-op once committed: whatever failed, nothing stays half done
            self.locks.unlock(guard)
        self.tree.touch(nodes)
        return nodes, None

    def _grown(
        self, plan: InsertPlan, got: Reserved
    ) -> tuple[TreeNode | None, list[bytes], bytes, Tier, list[Placement]]:
        """RadixTree.grow's arguments after the path: the new run (parent, keys, tokens)
        and where the reserved device pages go."""
        parent, keys = self.tree.new_run(plan.path, plan.tokens, plan.keyer)
        return parent, keys, plan.tokens, DEVICE, placements(plan.todo, DEVICE, got)

    def _guard(self, path: list[TreeNode], keep: Mapping[PoolName, Sequence[int]]) -> TreeGuard:
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
        return self.locks.lock(held)
