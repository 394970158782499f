"""The invariant checker any test can call, and a snapshot for equality checks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, NoReturn, Protocol

from .layout import PoolName, Tier
from .policies import AttentionPolicy
from .pools import PoolRegistry
from .quarantine import Quarantine
from .radix import ABSENT, TIERS, RadixTree, Reserved
from .txn import Transaction


class Checked(Protocol):
    """What the checks read of a cache: its tree and pools, and every other owner of
    pages (quarantines, open transactions, inserts filling pages)."""

    @property
    def tree(self) -> RadixTree: ...
    @property
    def registry(self) -> PoolRegistry: ...
    @property
    def policies(self) -> Mapping[PoolName, AttentionPolicy]: ...
    @property
    def quarantined(self) -> Iterable[Quarantine]: ...
    @property
    def open_txns(self) -> Iterable[Transaction]: ...
    @property
    def filling(self) -> Mapping[int, Reserved]: ...


class InvariantError(AssertionError):
    pass


def check_invariants(cache: Checked) -> None:
    """Raise InvariantError naming the first violated invariant."""
    tree, registry = cache.tree, cache.registry
    owners: dict[tuple, dict[int, str]] = {(p, t): {} for p in registry.names for t in TIERS}
    owned = [[0, 0] for _ in TIERS]
    protected = [[0, 0] for _ in TIERS]
    count = walked_pages = 0

    def claim(pool, tier, index, who) -> None:
        table = owners.get((pool, tier))
        if table is None:
            _fail(f"{who} holds a {pool.name}/{tier.name} page, but that pool does not exist")
        if index in table:
            _fail(f"{pool.name}/{tier.name} page {index} owned twice: by {table[index]} and {who}")
        table[index] = who

    for node in tree.nodes():
        count += 1
        who = f"node(start={node.start}, n={node.n}, key={node.keys[0].hex()[:12]})"
        step = tree.page_bytes
        if node.n == 0 or len(node.tokens) != node.n * step:
            _fail(f"{who} holds {len(node.tokens)} token bytes for {node.n} pages")
        if node.up.children.get(node.tokens[:step]) is not node:
            _fail(f"{who} is not its parent's child under its first page")
        if node.start != node.up.end:
            _fail(f"{who} starts at {node.start}, its parent ends at {node.up.end}")
        if node.end != node.start + node.n:
            _fail(f"{who} ends at {node.end}")
        if tree.by_first_key.get(node.keys[0]) is not node:
            _fail(f"{who} is not indexed by its first page's key")
        walked_pages += node.n
        for pool in PoolName:
            if node.locks[pool] < 0:
                _fail(f"{who} has negative {pool.name} lock count {node.locks[pool]}")
            for tier in TIERS:
                pages = node.slots[tier][pool]
                if pages is None:
                    continue
                if len(pages) != node.n or all(p == ABSENT for p in pages):
                    _fail(f"{who} {pool.name}/{tier.name} page list is malformed: {pages}")
                for j, index in enumerate(pages):
                    if index != ABSENT:
                        claim(pool, tier, index, f"{who} page {j}")
                        owned[tier][pool] += 1
                        protected[tier][pool] += bool(node.locks[pool])
        for policy in cache.policies.values():
            if (fault := policy.node_fault(node)) is not None:
                _fail(f"{who} {fault}")
        if not node.children and not any(node.has(p) for p in registry.names):
            _fail(f"{who} is a leaf with no pages")
    if count != tree.node_count:
        _fail(f"tree counts {tree.node_count} nodes, walked {count}")
    if len(tree.by_first_key) != count:
        _fail(f"tree indexes {len(tree.by_first_key)} first keys for {count} nodes")
    if walked_pages != tree.page_count:
        _fail(f"tree counts {tree.page_count} pages, walked {walked_pages}")

    for q in cache.quarantined:
        for (pool, tier), indices in q.pages.items():
            for index in indices:
                claim(pool, tier, index, f"quarantine (peer {q.peer}) since {q.since:.3f}")

    for txn in cache.open_txns:
        for (pool, tier), taken in txn.pages().items():
            for index in taken:
                claim(pool, tier, index, f"open transaction {id(txn):x}")

    for got in cache.filling.values():
        for (pool, tier), filled in got.items():
            for index in filled:
                claim(pool, tier, index, "an insert filling them")

    for entry in registry:
        for tier in TIERS:
            alloc = entry.tier(tier).allocator
            name = f"{entry.name.name}/{tier.name}"
            if alloc.free_count + alloc.used_count != alloc.capacity:
                _fail(
                    f"{name}: free {alloc.free_count} + used {alloc.used_count} != capacity "
                    f"{alloc.capacity}"
                )
            used = alloc.used_indices()
            held = set(owners[(entry.name, tier)])
            if used != held:
                leaked, unallocated = sorted(used - held)[:8], sorted(held - used)[:8]
                _fail(
                    f"{name}: pages used but owned by nobody {leaked}, owned but not allocated "
                    f"{unallocated}"
                )
            if tree.owned[tier][entry.name] != owned[tier][entry.name]:
                _fail(
                    f"{name}: tree counts {tree.owned[tier][entry.name]} owned pages, "
                    f"found {owned[tier][entry.name]}"
                )
            if tree.protected[tier][entry.name] != protected[tier][entry.name]:
                _fail(
                    f"{name}: tree counts {tree.protected[tier][entry.name]} protected pages, "
                    f"found {protected[tier][entry.name]}"
                )


@dataclass(frozen=True)
class PageAudit:
    """Page ownership counted over every pool and tier (all 0 when healthy)."""

    leaked: int  # allocated, but no tree slot, transaction or quarantine holds it
    double_owned: int  # held by two owners at once
    unallocated: int  # held, but free in its allocator


def page_audit(cache: Checked) -> PageAudit:
    """Counts, where `check_invariants` stops at the first problem: for chaos runs."""
    owners: dict[tuple, Counter] = {(e.name, t): Counter() for e in cache.registry for t in TIERS}
    for node in cache.tree.nodes():
        for tier in TIERS:
            for pool in cache.registry.names:
                pages = node.slots[tier][pool]
                if pages is not None:
                    owners[(pool, tier)].update(i for i in pages if i != ABSENT)
    for q in cache.quarantined:
        for key, indices in q.pages.items():
            owners[key].update(indices)
    for txn in cache.open_txns:
        for key, taken in txn.pages().items():
            owners[key].update(taken)
    for got in cache.filling.values():
        for key, filled in got.items():
            owners[key].update(filled)
    leaked = double = unallocated = 0
    for (pool, tier), held in owners.items():
        used = cache.registry.pool(pool, tier).allocator.used_indices()
        double += sum(1 for n in held.values() if n > 1)
        leaked += len(used - held.keys())
        unallocated += len(held.keys() - used)
    return PageAudit(leaked, double, unallocated)


def snapshot(cache: Checked) -> tuple:
    """Everything a failed step must leave unchanged, page by page (so splitting
    a run, which changes no page, changes no snapshot): keys, parents, slots,
    locks, allocators."""
    pages = []
    for node in cache.tree.nodes():
        for j, key in enumerate(node.keys):
            parent = node.keys[j - 1] if j else node.up.keys[-1]
            slots = tuple(tuple(_page_index(node, t, p, j) for p in PoolName) for t in TIERS)
            pages.append((key, parent, slots, tuple(node.locks)))
    held: dict[tuple[PoolName, Tier], set[int]] = {(p, t): set() for p in PoolName for t in TIERS}
    for q in cache.quarantined:
        for where, indices in q.pages.items():
            held[where].update(indices)
    # Quarantined pages are neither in the tree nor usable: free, for what a failed step left.
    allocs = tuple(
        (e.name, t, frozenset(e.tier(t).allocator.used_indices() - held[(e.name, t)]))
        for e in cache.registry
        for t in TIERS
    )
    return tuple(sorted(pages)), allocs, tuple(map(tuple, cache.tree.protected))


def _page_index(node, tier, pool, offset) -> int:
    pages = node.slots[tier][pool]
    return ABSENT if pages is None else pages[offset]


def _fail(message: str) -> NoReturn:
    raise InvariantError(message)
