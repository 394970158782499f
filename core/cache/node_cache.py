"""NodeCache: one node's SWA-aware tiered prefix cache, the facade other layers use."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from .cached_kv import CachedKV
from .candidates import Candidates
from .check import PageAudit, check_invariants, page_audit
from .check import snapshot as cache_snapshot
from .disk_store import DiskStore
from .disk_tier import Adopted, adopt
from .eviction import Evictor, drop_cut_leaf
from .insert import Fill, InsertPlan, Inserts, T, Unlocked
from .keys import KeyerCache, PageKeyer, encode_tokens
from .layout import KVLayout, PoolName, Tier
from .leases import LeaseTable
from .locks import PrefixLock, TreeGuard, TreeLocks
from .lost_pages import LostPages
from .match import Match
from .page_bytes import LayerKV, PageCopier, TorchCopier, copy_rows
from .page_changes import PageChanges, PageView, PageWithPath
from .paths import groups, within
from .policies import AttentionPolicy, policies_for, usable_length
from .pools import PoolCapacity, PoolEntry, PoolRegistry
from .put_rows import PagedKV, check_kv, first_pages, write_rows
from .quarantine import Quarantine, Quarantines
from .radix import DEVICE, DEVICE_ONLY, TIERS, RadixTree, Reserved, TreeNode
from .shared_pages import MEMORY, Loaded, SharedPages
from .tiers import TierConfig, TierController
from .txn import MakeRoom, ReservationFailed, ReservationHook, Transaction
from .walk_memo import Walk, WalkMemo

# Evicting for a reservation also frees 1/EVICTION_BATCH of the pool, so that bringing the
# candidates up to date (candidates.py) is paid once per that many pages, not once per insert.
EVICTION_BATCH = 64


@dataclass
class CacheStats:
    lookups: int = 0
    hit_pages_device: int = 0
    hit_pages_host: int = 0
    lookup_pages: int = 0
    inserted_pages: int = 0
    put_failures: int = 0
    load_back_failures: int = 0
    disk_corrupt_pages: int = 0  # read back from disk not matching their checksum: not served
    disk_lost_pages: int = 0  # dropped from the tree for it (with those after them)
    evicted_pages: int = 0  # dropped from a tier by eviction (written back or not)
    written_back_pages: int = 0  # copied from device to host as they were evicted
    nodes: int = 0
    pools: dict[str, dict[str, int]] = field(default_factory=dict)


class NodeCache:
    """One node's cache: the tree and pools, and the collaborators that work on them
    (inserts, quarantines, leases, what the exchange and the event publisher read),
    behind the calls other layers make."""

    def __init__(
        self,
        layout: KVLayout,
        capacities: Mapping[PoolName, PoolCapacity],
        *,
        tier: TierConfig = TierConfig(),
        device: torch.device | str | None = None,
        store_bytes: bool = True,
        copier: PageCopier | None = None,
        reserve_hook: ReservationHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        incremental_eviction: bool = True,
        disk: DiskStore | None = None,
    ) -> None:
        """`incremental_eviction=False`: evictions walk the tree for their candidates, the
        reference the kept candidates must agree with (tests, benches). `disk`: an open
        store for the disk tier (its opener closes it); the pages it held are adopted."""
        self.layout = layout
        # The pool whose pages keep a node alive (layout.pools builds a new tuple per call).
        self.primary_pool = layout.pools[0]
        self.registry = PoolRegistry.build(layout, capacities, device, store_bytes, disk)
        self.stores_bytes = self.registry.pool(self.primary_pool, DEVICE).data is not None
        reg = self.registry
        self.tree = RadixTree(
            layout.page_size * 4,
            free_page=lambda p, t, pages: reg.pool(p, t).allocator.free(pages),
            take_page=lambda p, t, pages: reg.pool(p, t).allocator.take(pages),
        )
        self.policies: dict[PoolName, AttentionPolicy] = policies_for(layout)
        self.copier = copier or TorchCopier()
        self.reserve_hook = reserve_hook  # tests and chaos fail reservations through it
        self.open_txns: set[Transaction] = set()
        # Pages whose disk copy failed its checksum on a read, dropped once unlocked.
        self.lost = LostPages(self.tree, layout.pools)
        self.tiers = TierController(
            self.registry, tier, self.transaction, layout.page_size * 4, self.lost
        )
        candidates = Candidates(self.tree) if incremental_eviction else None
        self.evictors = {
            p: Evictor(
                self.tree,
                pol,
                layout.pools,
                functools.partial(self.tiers.write_back, p),
                candidates,
            )
            for p, pol in self.policies.items()
        }
        # Each pool's eviction, for the transactions that reserve in it.
        self.make_room = {entry.name: self._eviction_hook(entry) for entry in self.registry}
        self._keyers = KeyerCache(layout.fingerprint, layout.page_size, size=4096)
        self._walks = WalkMemo()
        self._stats = CacheStats()
        self.clock = clock
        # Rows from page 0 in every pool: a put's usual `first` (read only), built once.
        self._from_zero = first_pages(layout, None)
        self._quarantines = Quarantines(self.registry, clock)
        # Prefix locks with a time to live: leases, for peers' exports and requests' get to put.
        self.leases = LeaseTable(self, clock)
        self._locks = TreeLocks(self.tree, layout.pools)
        self._inserts = Inserts(
            self.tree,
            layout,
            self.registry,
            self.policies,
            self.tiers,
            self._keyers,
            self.walk,
            self.transaction,
            self._locks,
            self._quarantines,
        )
        self._shared = SharedPages(self.registry, self.policies, self.tiers)
        self._changes = PageChanges(self.tree)
        self.adopted = Adopted(0, 0)
        if disk is not None:
            found = disk.adopt()
            self.adopted = adopt(self.tree, disk, layout.pools, found.trusted, self.transaction)

    def _eviction_hook(self, entry: PoolEntry) -> MakeRoom:
        """What a reservation calls when a pool is short: evict what it needs plus a
        slice of the pool (none for pools under EVICTION_BATCH pages)."""
        evictor = self.evictors[entry.name]

        def make_room(tier: Tier, n: int, txn: Transaction) -> int:
            capacity = entry.tier(tier).capacity
            if n > capacity:
                return 0  # no eviction can make that much room: spare the walk
            return evictor.make_room(tier, n, txn, extra=capacity // EVICTION_BATCH)

        return make_room

    # --- keys and matching ---------------------------------------------------------
    def keyer(self, namespace: str) -> PageKeyer:
        return self._keyers.get(namespace)

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self.keyer(namespace).keys(tokens)

    def match(self, tokens: Sequence[int], namespace: str) -> Match:
        """The longest usable cached prefix of `tokens`; changes nothing."""
        w = self.walk(tokens, namespace)
        return self._match(w.path, w.matched, len(w.raw) // self.tree.page_bytes)

    def walk(self, tokens: Sequence[int], namespace: str) -> Walk:
        """`tokens` packed and the tree's nodes along them; kept for the put that follows."""
        version = self.tree.version
        known = self._walks.recall(tokens, namespace, version)
        if known is not None:
            return known
        keyer, raw = self._keyers.get(namespace), encode_tokens(tokens)
        walk = Walk(keyer, raw, *self.tree.walk(keyer.root, raw))
        self._walks.remember(namespace, version, walk)
        return walk

    def match_keys(self, keys: list[bytes]) -> Match:
        """The same, for a chain of page keys (as peers and the index name prefixes)."""
        path, matched = self.tree.walk_keys(keys)
        return self._match(path, matched, len(keys))

    def _match(self, path: list[TreeNode], matched: int, request_pages: int) -> Match:
        anywhere = on_device = matched
        for policy in self.policies.values():  # `usable` for both tier sets, in one pass
            anywhere = policy.usable(path, anywhere, TIERS)
            on_device = policy.usable(path, on_device, DEVICE_ONLY)
        return Match(path, matched, anywhere, on_device, request_pages)

    def usable(self, path: list[TreeNode], limit: int, tiers: tuple[Tier, ...]) -> int:
        return usable_length(self.policies, path, limit, tiers)

    def presence(self, match: Match, pool: PoolName, tiers: tuple[Tier, ...] = TIERS) -> list[bool]:
        """Per matched page, whether `pool` KV is held on one of `tiers`."""
        return [n.page_has(j, pool, tiers) for n in match.path for j in range(n.n)][
            : match.present_pages
        ]

    # --- locks ---------------------------------------------------------------------
    def lock(self, match: Match, pages: int | None = None) -> PrefixLock:
        """Protect what a match of `pages` (default: all usable) needs from eviction."""
        n = match.usable_pages if pages is None else pages
        if not 0 <= n <= match.present_pages:
            raise ValueError(f"cannot lock {n} pages of a match of {match.present_pages}")
        # Only a usable length (SWA usability is not prefix-closed): at another, a pool
        # lacks pages the match would need (tombstoned), and the lock would pin nodes that
        # hold nothing, which eviction could leave as locked leaves without pages.
        if n not in (0, match.usable_pages) and self.usable(match.path, n, TIERS) != n:
            raise ValueError(f"cannot lock {n} pages: a match of that length is not usable")
        guard, spans = self._guard_match(match, n)
        return PrefixLock([k for x in match.path if x.start < n for k in x.keys], spans)

    def _guard_match(self, match: Match, n: int) -> tuple[TreeGuard, dict[PoolName, range]]:
        spans = {p: pol.needed(n) for p, pol in self.policies.items()}
        for span in spans.values():  # locks are per node: make span ends node boundaries
            for edge in (span.start, span.stop):
                self.tree.split_at(match.path, edge)
        # Past the span's end (n for every pool), the match's path is not used: a leaf cut
        # off there holding nothing goes, and leaves the match.
        beyond = next((x for x in match.path if x.start == n), None)
        if beyond is not None and drop_cut_leaf(self.tree, self.layout.pools, beyond):
            match.path.remove(beyond)
        return self.lock_nodes(within(match.path, spans)), spans

    def lease(self, match: Match, pages: int, ttl_s: float) -> int:
        """Pin what a match of `pages` needs until `release_lease`, or for `ttl_s`
        seconds if that never comes (a crashed request); returns the lease id."""
        lock = self.lock(match, pages)
        try:
            return self.leases.grant(lock, ttl_s).lease_id
        except BaseException:
            self.unlock(lock)
            raise

    def release_lease(self, lease_id: int) -> bool:
        """Release a lease; False if it is unknown (released already, or expired)."""
        return self.leases.release(lease_id)

    def unlock(self, lock: PrefixLock) -> None:
        if lock.released:
            raise RuntimeError("prefix lock released twice")
        path, matched = self.tree.walk_keys(lock.keys)
        if matched != len(lock.keys):
            raise RuntimeError("a locked prefix left the tree")  # locks forbid eviction: a bug
        lock.released = True
        self.unlock_nodes(TreeGuard(within(path, lock.spans)))

    def lock_nodes(self, held: dict[PoolName, list[TreeNode]]) -> TreeGuard:
        return self._locks.lock(held)

    def unlock_nodes(self, guard: TreeGuard) -> None:
        self._locks.unlock(guard)

    # --- transactions --------------------------------------------------------------
    def transaction(self) -> Transaction:
        txn = Transaction(
            self.tree,
            self.registry,
            self.copier,
            self.reserve_hook,
            self._txn_closed,
            self.make_room,
        )
        self.open_txns.add(txn)
        return txn

    def _txn_closed(self, txn: Transaction) -> None:
        self.open_txns.discard(txn)

    # --- inserts -------------------------------------------------------------------
    @property
    def filling(self) -> dict[int, Reserved]:
        """Pages inserts took off the free lists and fill now (Inserts.filling)."""
        return self._inserts.filling

    def plan_store(
        self, tokens: Sequence[int], namespace: str, first: dict[PoolName, int]
    ) -> InsertPlan:
        return self._inserts.plan_store(tokens, namespace, first)

    def plan_fetch(self, tokens: Sequence[int], namespace: str, pages: int) -> InsertPlan:
        return self._inserts.plan_fetch(tokens, namespace, pages)

    def insert(self, plan: InsertPlan, fill: Fill | None, writer: str | None = None) -> T | None:
        """Commit `plan`, its pages written by `fill` (see Inserts.insert)."""
        return self._inserts.insert(plan, fill, writer, self.reserve_hook)

    # --- put -------------------------------------------------------------------------
    def put(
        self,
        tokens: Sequence[int],
        kv: LayerKV | PagedKV | None,
        namespace: str,
        *,
        starts: Mapping[PoolName, int] | None = None,
        release: int = 0,
        unlocked: Unlocked | None = None,
    ) -> int:
        """Store the whole pages of `tokens`; returns pages newly stored (0 if no room).

        `kv[i]` holds layer i's rows from the token position `starts` gives for
        its pool (default 0) to the end of the sequence (or a PagedKV: each pool's
        pages from there, copied in one pass). Pages before a pool's
        start are never written: SWA pages stay tombstoned, and full KV, which
        must be whole, grows the tree only where it has rows for every new page.
        `release`: a lease from `get`, released once the put is done, whatever happens.
        `unlocked`: wraps the copy of the bytes, for a caller that gives up its lock
        meanwhile (the node actor: CacheGate.released); the pages are reserved and the
        path locked, so other prefixes' calls may run then."""
        try:
            first = self._from_zero if starts is None else first_pages(self.layout, starts)
            if kv is not None or self.stores_bytes:  # else there is nothing to check
                self._check_kv(kv, len(tokens) // self.layout.page_size, first)
            plan = self.plan_store(tokens, namespace, first)
            if plan.empty:
                self.tree.touch(plan.path)
                return 0
            fill = None if kv is None else self._writer(plan, kv, first, unlocked)
            try:
                self.insert(plan, fill)
            except ReservationFailed:
                self._stats.put_failures += 1
                return 0
            return plan.pages - plan.present_pages
        finally:
            if release:
                self.release_lease(release)

    def _writer(
        self,
        plan: InsertPlan,
        kv: LayerKV | PagedKV,
        first: dict[PoolName, int],
        unlocked: Unlocked | None,
    ) -> Fill:
        """The insert's fill for a put: each pool's rows into its reserved device pages."""

        def write(got: dict[tuple[PoolName, Tier], list[int]], hold: Callable[[], None]) -> None:
            copy = functools.partial(self._write_all, plan, got, kv, first)
            (copy if unlocked is None else unlocked(copy))()

        return write

    def _write_all(
        self,
        plan: InsertPlan,
        got: dict[tuple[PoolName, Tier], list[int]],
        kv: LayerKV | PagedKV,
        first: dict[PoolName, int],
    ) -> None:
        for pool, positions in plan.todo.items():
            self._write(pool, got[(pool, DEVICE)], kv, positions, first[pool])

    def _write(
        self,
        pool: PoolName,
        pages: list[int],
        kv: LayerKV | PagedKV,
        positions: list[int],
        first: int,
    ) -> None:
        if not pages:
            return
        dst = self.registry.pool(pool, DEVICE)
        if dst.data is None:
            return
        write_rows(self.layout, pool, kv, positions, first, dst.data, pages)

    # --- get -------------------------------------------------------------------------
    def get(
        self,
        tokens: Sequence[int],
        namespace: str,
        lease_s: float | None = None,
        *,
        first_page: int = 0,
        into: Mapping[PoolName, tuple[torch.Tensor, Sequence[int]]] | None = None,
    ) -> CachedKV:
        """The usable cached prefix of `tokens` and its K/V, loaded to device first.

        With `lease_s`, what the hit needs stays leased (`CachedKV.lease`) until the
        caller's put releases it, or `release_lease`, or `lease_s` seconds pass (the
        parameter keeps the name actors/ and deploy/ pass it by):
        eviction between a request's get and its put cannot take its prefix.
        `first_page`: the caller holds the pages before it: their K/V is not copied
        (`starts` say where each pool's rows begin). `into[pool]`: page-shaped memory of
        the caller's (staging) and its rows, that pool's i-th page copied into the i-th
        row, in one pass, where there are rows enough: the hit's `sinks` say so, and no
        other copy is made. A page `into` takes whole from the host tier is copied from
        there: only the hit's disk pages are loaded to device first."""
        match = self.match(tokens, namespace)
        self._stats.lookups += 1
        self._stats.lookup_pages += match.request_pages
        n = match.usable_pages
        if n == 0:
            return self._empty()
        guard, _ = self._guard_match(match, n)
        path = [x for x in match.path if x.start < n]
        try:
            # Host pages go straight to sinks that take them as they are (host memory on
            # a CPU node): a load back to device would copy them twice and need room there.
            tiers = MEMORY if self._sinks_take_host(n, first_page, into) else DEVICE_ONLY
            loaded = self.load_to_device(match, n, tiers)
            if loaded.pages < n:
                self._stats.load_back_failures += 1
            n = loaded.pages
            out = self._gather(path, n, first_page, into or {}, tiers)
            host_pages = loaded.from_host + out.host_tokens // self.layout.page_size
            self._stats.hit_pages_host += host_pages
            self._stats.hit_pages_device += n - host_pages
            out.host_tokens = host_pages * self.layout.page_size
            if lease_s is not None and n:
                out.lease = self.lease(match, n, lease_s)
        finally:
            self.unlock_nodes(guard)
        used = [x for x in path if x.start < n]
        self.tree.touch(used, hit=True)
        self.tiers.after_hit(used)
        if self.lost.pending:  # this load's own, now unlocked, or older ones
            self.lost.drop()
        return out

    def _gather(
        self,
        path: list[TreeNode],
        n: int,
        first: int,
        into: Mapping[PoolName, tuple[torch.Tensor, Sequence[int]]],
        tiers: tuple[Tier, ...] = DEVICE_ONLY,
    ) -> CachedKV:
        """The hit's pages from device; with `tiers` MEMORY (get's, where every sink takes
        host pages) a page the device lacks from the host."""
        ps = self.layout.page_size
        pages: dict[PoolName, torch.Tensor] = {}
        sinks: dict[PoolName, tuple[torch.Tensor, list[int]]] = {}
        starts: dict[PoolName, int] = {}
        from_host: set[int] = set()  # positions copied from the host tier (into sinks: get)
        for pool, policy in self.policies.items():
            rows = self._rows(policy, n, first)
            starts[pool] = rows.start * ps
            src = self.registry.pool(pool, Tier.DEVICE)
            if src.data is None or n == 0:
                continue
            # Row i of the hit reads at[tier][1][k] into the sink's row at[tier][0][k].
            at: dict[Tier, tuple[list[int], list[int]]] = {DEVICE: ([], [])}
            i = 0
            for x, offs in groups(path, rows):
                if tiers is DEVICE_ONLY:  # load_to_device put every page there
                    positions, held = at[DEVICE]
                    device = x.pages_of(DEVICE, pool)
                    positions.extend(range(i, i + len(offs)))
                    held.extend(device[j] for j in offs)
                    i += len(offs)
                    continue
                for j in offs:
                    tier = DEVICE if x.page_has(j, pool, DEVICE_ONLY) else Tier.HOST
                    positions, held = at.setdefault(tier, ([], []))
                    positions.append(i)
                    held.append(x.pages_of(tier, pool)[j])
                    if tier is Tier.HOST:
                        from_host.add(x.start + j)
                    i += 1
            sink = into.get(pool)
            if sink is not None and _fits(sink, src.data, i):
                slots = list(sink[1][:i])
                for tier, (positions, held) in at.items():
                    data = self.registry.pool(pool, tier).data
                    if positions and data is not None:  # (data: it holds these pages)
                        copy_rows(data, held, sink[0], [slots[k] for k in positions])
                sinks[pool] = (sink[0], slots)
            else:  # _sinks_take_host checked the sinks: a host page never comes here
                pages[pool] = src.data.index_select(0, src.index_tensor(at[DEVICE][1]))
        out = self._cached(n * ps, starts, pages, sinks)
        out.host_tokens = len(from_host) * ps
        return out

    @staticmethod
    def _rows(policy: AttentionPolicy, n: int, first: int) -> range:
        """The positions of a hit of `n` pages a pool copies, the caller holding `first`."""
        return range(min(max(policy.needed(n).start, first), n), n)

    def _sinks_take_host(
        self, n: int, first: int, into: Mapping[PoolName, tuple[torch.Tensor, Sequence[int]]] | None
    ) -> bool:
        """Whether every pool's sink takes its rows of an `n`-page hit from either memory
        tier as they are (_fits): then no page needs a load to device."""
        if not into:
            return False
        for pool, policy in self.policies.items():
            rows = len(self._rows(policy, n, first))
            for tier in MEMORY:
                data = self.registry.pool(pool, tier).data
                if data is not None and (pool not in into or not _fits(into[pool], data, rows)):
                    return False
        return True

    def _empty(self) -> CachedKV:
        return self._cached(0, dict.fromkeys(self.policies, 0), {})

    def _cached(
        self,
        tokens: int,
        starts: dict[PoolName, int],
        pages: dict[PoolName, torch.Tensor],
        sinks: dict[PoolName, tuple[torch.Tensor, list[int]]] | None = None,
    ) -> CachedKV:
        pools = {p: self.layout.layers_of(p) for p in self.policies}
        return CachedKV(tokens, starts, pages, pools, len(self.layout.layers), sinks=sinks or {})

    def _check_kv(
        self, kv: LayerKV | PagedKV | None, pages: int, first: dict[PoolName, int]
    ) -> None:
        if kv is None:
            if pages and self.stores_bytes:
                raise ValueError("this cache stores bytes: put needs kv tensors")
            return
        check_kv(self.layout, kv, pages, first)

    # --- quarantines ----------------------------------------------------------------
    @property
    def quarantined(self) -> list[Quarantine]:
        return self._quarantines.held

    def quarantine(
        self, pages: dict[tuple[PoolName, Tier], list[int]], peer: str | None = None
    ) -> None:
        """Keep pages out of use: an abandoned transfer from `peer` may still write them
        (see Quarantines.add)."""
        self._quarantines.add(pages, peer)

    def quarantines(self, peer: str) -> bool:
        """Whether pages an abandoned transfer from `peer` may still write are held."""
        return self._quarantines.holds(peer)

    def quarantined_peers(self) -> set[str]:
        return self._quarantines.peers()

    def release_quarantine(self, peer: str | None = None, force: bool = False) -> int:
        """Free the pages quarantined for `peer` (all with `force`); returns pages freed."""
        return self._quarantines.release(peer, force)

    # --- what the exchange reads (see shared_pages.py) -----------------------------
    def load_to_device(self, match: Match, n: int, tiers: tuple[Tier, ...] = DEVICE_ONLY) -> Loaded:
        return self._shared.load_to_device(match, n, tiers)

    def back_up(self, match: Match) -> bool:
        return self._shared.back_up(match)

    def export_spans(self, n: int, skip: int) -> dict[PoolName, range]:
        return self._shared.export_spans(n, skip)

    def locate(self, match: Match, pool: PoolName, span: range) -> list[tuple[Tier, int]]:
        return self._shared.locate(match, pool, span)

    def checksums(self, pool: PoolName, pages: Sequence[tuple[Tier, int]]) -> list[int]:
        return self._shared.checksums(pool, pages)

    def device_pools(self) -> dict[PoolName, torch.Tensor | None]:
        return self._shared.device_pools()

    # --- what the event publisher reads (see page_changes.py) ----------------------
    def track_changes(self, pending_floor: int) -> None:
        self._changes.track_changes(pending_floor)

    def has_changes(self) -> bool:
        return self._changes.has_changes()

    def take_changes(self) -> tuple[list[PageWithPath], bool]:
        return self._changes.take_changes()

    def held_pages(self) -> Iterator[PageView]:
        return self._changes.held_pages()

    def held_pages_with_paths(self) -> Iterator[PageWithPath]:
        return self._changes.held_pages_with_paths()

    # --- maintenance ---------------------------------------------------------------
    def evict(self, pool: PoolName, tier: Tier, n: int) -> int:
        with self.transaction() as txn:
            return self.evictors[pool].make_room(tier, n, txn)

    def stats(self) -> CacheStats:
        s = self._stats
        s.inserted_pages = self._inserts.inserted_pages
        s.nodes = self.tree.node_count
        s.evicted_pages = sum(e.evicted for e in self.evictors.values())
        s.written_back_pages = sum(e.written_back for e in self.evictors.values())
        s.disk_corrupt_pages, s.disk_lost_pages = self.lost.found, self.lost.dropped
        s.pools = {
            f"{e.name.name}/{t.name}": {
                "capacity": e.tier(t).capacity,
                "used": e.tier(t).allocator.used_count,
                "protected": self.tree.protected[t][e.name],
            }
            for e in self.registry
            for t in TIERS
        }
        return s

    def audit(self) -> PageAudit:
        """Leaked and doubly owned pages, counted (see `check` for the first violation)."""
        return page_audit(self)

    def check(self) -> None:
        check_invariants(self)

    def snapshot(self) -> tuple:
        return cache_snapshot(self)


def _fits(sink: tuple[torch.Tensor, Sequence[int]], pool: torch.Tensor, pages: int) -> bool:
    """Whether the sink's rows can take `pages` pages of `pool` as they are."""
    data, rows = sink
    return (
        len(rows) >= pages
        and data.shape[1:] == pool.shape[1:]
        and data.dtype == pool.dtype
        and data.device == pool.device
        and data.is_contiguous()
        and all(0 <= r < data.shape[0] for r in rows[:pages])
    )
