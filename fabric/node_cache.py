"""NodeCache: one node's SWA-aware tiered prefix cache, the facade other layers use."""
from __future__ import annotations

from bisect import bisect_left
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from .check import PageAudit, check_invariants, page_audit, snapshot as cache_snapshot
from .eviction import Evictor
from .faults import AllocationFaults
from .keys import PageKeyer, encode_tokens
from .layout import KVLayout, PoolName, Tier
from .pages import PageCopier, TorchCopier, pack, unpack
from .policies import AttentionPolicy, policies_for
from .pools import PoolCapacity, PoolEntry, PoolRegistry
from .paths import by_node, groups, missing_on_device, within
from .radix import TIERS, Node, RadixTree
from .tiers import TierConfig, TierController
from .txn import ReservationFailed, Transaction

# Enum members read once: each `Tier.DEVICE` on a hot path is a Python-level lookup.
DEVICE = Tier.DEVICE
DEVICE_ONLY = (Tier.DEVICE,)
# Evicting for a reservation also frees 1/EVICTION_BATCH of the pool, so that the walk over
# the tree that finds candidates is paid once per that many pages, not once per insert.
EVICTION_BATCH = 64


@dataclass
class Match:
    """A usable cached prefix of `pages` whole pages, along `path` from the root."""
    path: list[Node]        # nodes holding the request's matched pages (the last may hold more)
    matched: int            # pages present in the tree, on any tier, in any pool
    pages: int              # usable length, either tier
    device_pages: int       # usable length from the device tier alone
    request_pages: int      # whole pages in the request

    @property
    def keys(self) -> list[bytes]:
        return [k for n in self.path for k in n.keys][: self.pages]


@dataclass
class PrefixLock:
    """A lock held outside the cache's own calls. It names pages by key and
    position, not by node: a later split of a locked run copies the lock into
    both halves, and unlocking finds both."""
    keys: list[bytes]
    spans: dict[PoolName, range]
    released: bool = False


@dataclass
class NodeGuard:
    """A lock held within one cache call, during which no run is split."""
    nodes: dict[PoolName, list[Node]]


@dataclass
class CachedKV:
    """K/V of a cached prefix. Full layers cover tokens [0, tokens); SWA layers
    cover [swa_start, tokens). `layers[i]` is [2, n_tokens, kv_heads, head_dim].
    `host_tokens`: how many of the tokens were loaded back from the host tier."""
    tokens: int
    swa_start: int
    layers: list[torch.Tensor | None]
    host_tokens: int = 0


@dataclass
class Quarantine:
    until: float
    peer: str | None
    pages: dict[tuple[PoolName, Tier], list[int]]


@dataclass
class CacheStats:
    lookups: int = 0
    hit_pages_device: int = 0
    hit_pages_host: int = 0
    lookup_pages: int = 0
    inserted_pages: int = 0
    put_failures: int = 0
    load_back_failures: int = 0
    nodes: int = 0
    pools: dict[str, dict[str, int]] = field(default_factory=dict)


class NodeCache:
    def __init__(self, layout: KVLayout, capacities: Mapping[PoolName, PoolCapacity], *,
                 tier: TierConfig = TierConfig(), device: torch.device | str | None = None,
                 store_bytes: bool = True, copier: PageCopier | None = None,
                 faults: AllocationFaults | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        # The pool whose pages keep a node alive (layout.pools builds a new tuple per call).
        self.primary_pool = layout.pools[0]
        self.registry = PoolRegistry.build(layout, capacities, device, store_bytes)
        reg = self.registry
        self.tree = RadixTree(layout.page_size * 4,
                              free_page=lambda p, t, pages: reg.pool(p, t).allocator.free(pages),
                              take_page=lambda p, t, pages: reg.pool(p, t).allocator.take(pages))
        self.policies: dict[PoolName, AttentionPolicy] = policies_for(layout)
        self.copier = copier or TorchCopier()
        self.faults = faults
        self.open_txns: set[Transaction] = set()
        self.tiers = TierController(self.registry, tier, self.transaction)
        self.evictors = {p: Evictor(self.tree, pol, layout.pools, self.tiers.write_back)
                         for p, pol in self.policies.items()}
        for entry in self.registry:
            entry.evict = self._eviction_hook(entry)
        self._keyers: dict[str, PageKeyer] = {}
        self._stats = CacheStats()
        self.clock = clock
        self.quarantined: list[Quarantine] = []

    def _eviction_hook(self, entry: PoolEntry) -> Callable[[Tier, int, Transaction], int]:
        """What a reservation calls when a pool is short: evict what it needs plus a
        slice of the pool (none for pools under EVICTION_BATCH pages)."""
        evictor = self.evictors[entry.name]

        def make_room(tier: Tier, n: int, txn: Transaction) -> int:
            capacity = entry.tier(tier).capacity
            if n > capacity:
                return 0          # no eviction can make that much room: spare the walk
            return evictor.make_room(tier, n, txn, extra=capacity // EVICTION_BATCH)
        return make_room

    # --- keys and matching ---------------------------------------------------------
    def keyer(self, namespace: str) -> PageKeyer:
        keyer = self._keyers.get(namespace)
        if keyer is None:
            keyer = PageKeyer(namespace, self.layout.fingerprint, self.layout.page_size)
            if len(self._keyers) >= 4096:    # bound the cache of per-tenant hashers
                self._keyers.pop(next(iter(self._keyers)))
            self._keyers[namespace] = keyer
        return keyer

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self.keyer(namespace).keys(tokens)

    def match(self, tokens: Sequence[int], namespace: str) -> Match:
        """The longest usable cached prefix of `tokens`; changes nothing."""
        raw = encode_tokens(tokens)
        path, matched = self.tree.walk(self.keyer(namespace).root, raw)
        return self._match(path, matched, len(raw) // self.tree.page_bytes)

    def match_keys(self, keys: list[bytes]) -> Match:
        """The same, for a chain of page keys (as peers and the index name prefixes)."""
        path, matched = self.tree.walk_keys(keys)
        return self._match(path, matched, len(keys))

    def _match(self, path: list[Node], matched: int, request_pages: int) -> Match:
        return Match(path, matched, self.usable(path, matched, TIERS),
                     self.usable(path, matched, DEVICE_ONLY), request_pages)

    def usable(self, path: list[Node], limit: int, tiers: tuple[Tier, ...]) -> int:
        # Policies are visited in pool order, FULL first. Full usability is
        # prefix-closed, so the SWA policy's answer is usable for FULL too.
        for policy in self.policies.values():
            limit = policy.usable(path, limit, tiers)
        return limit

    def presence(self, match: Match, pool: PoolName, tiers: tuple[Tier, ...] = TIERS) -> list[bool]:
        """Per matched page, whether `pool` KV is held on one of `tiers`."""
        return [n.page_has(j, pool, tiers) for n in match.path for j in range(n.n)][: match.matched]

    # --- locks ---------------------------------------------------------------------
    def lock(self, match: Match, pages: int | None = None) -> PrefixLock:
        """Protect what a match of `pages` (default: all usable) needs from eviction."""
        n = match.pages if pages is None else pages
        if not 0 <= n <= match.matched:
            raise ValueError(f"cannot lock {n} pages of a match of {match.matched}")
        guard, spans = self._guard_match(match, n)
        return PrefixLock([k for x in match.path if x.start < n for k in x.keys], spans)

    def _guard_match(self, match: Match, n: int) -> tuple[NodeGuard, dict[PoolName, range]]:
        spans = {p: pol.needed(n) for p, pol in self.policies.items()}
        for span in spans.values():   # locks are per node: make span ends node boundaries
            for edge in (span.start, span.stop):
                self.tree.split_at(match.path, edge)
        return self.lock_nodes(within(match.path, spans)), spans

    def unlock(self, lock: PrefixLock) -> None:
        if lock.released:
            raise RuntimeError("prefix lock released twice")
        path, matched = self.tree.walk_keys(lock.keys)
        if matched != len(lock.keys):
            raise RuntimeError("a locked prefix left the tree")   # locks forbid eviction: a bug
        lock.released = True
        self.unlock_nodes(NodeGuard(within(path, lock.spans)))

    def lock_nodes(self, held: dict[PoolName, list[Node]]) -> NodeGuard:
        for pool, nodes in held.items():
            self.tree.lock(nodes, pool, +1)
        return NodeGuard(held)

    def unlock_nodes(self, guard: NodeGuard) -> None:
        for pool, nodes in guard.nodes.items():
            self.tree.lock(nodes, pool, -1)

    # --- transactions --------------------------------------------------------------
    def transaction(self) -> Transaction:
        if self.quarantined:
            self.release_quarantine()
        txn = Transaction(self.tree, self.registry, self.copier, self.faults, self._txn_closed)
        self.open_txns.add(txn)
        return txn

    def _txn_closed(self, txn: Transaction) -> None:
        self.open_txns.discard(txn)

    def quarantine(self, pages: dict[tuple[PoolName, Tier], list[int]], hold_s: float,
                   peer: str | None = None) -> None:
        """Keep pages out of use: an abandoned transfer from `peer` may still write them."""
        self.quarantined.append(Quarantine(self.clock() + hold_s, peer, pages))

    def release_quarantine(self, force: bool = False, peer: str | None = None) -> int:
        """Free quarantined pages whose hold has passed, or that came from `peer`
        (which has died, or whose later transfers completed, so earlier ones
        drained); `force` frees all. Returns how many pages were freed."""
        now, keep, freed = self.clock(), [], 0
        for q in self.quarantined:
            if force or q.until <= now or (peer is not None and q.peer == peer):
                for (pool, tier), indices in q.pages.items():
                    self.registry.pool(pool, tier).allocator.free(indices)
                    freed += len(indices)
            else:
                keep.append(q)
        self.quarantined = keep
        return freed

    # --- put -------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], kv: Sequence[torch.Tensor] | None, namespace: str,
            available: Mapping[PoolName, range] | None = None) -> int:
        """Store the whole pages of `tokens`; returns pages newly stored (0 if no room).
        `available`: per pool, the page positions whose K/V `kv` really holds (default:
        all); a pool's pages elsewhere are not stored (an engine that has dropped the
        sliding-window KV before its window hands over only the window)."""
        keyer = self.keyer(namespace)
        raw = encode_tokens(tokens)
        tree = self.tree
        step = tree.page_bytes
        n = len(raw) // step
        self._check_kv(kv, n)
        path, m = tree.walk(keyer.root, raw)
        if path and m < path[-1].end:
            tree.split_at(path, m)
            path.pop()
        # Leaving the tree below a node that has other children makes a branch
        # point: a likely continuation, so SWA keeps its window too.
        branch = m if path and path[-1].children and m < n else 0
        keep = {p: pol.store_positions(n, branch) for p, pol in self.policies.items()}
        if available is not None:
            keep = {p: [i for i in pos if i in available.get(p, range(n))] for p, pos in keep.items()}
        todo = {p: missing_on_device(path, pos, m, p) for p, pos in keep.items()}
        if not any(todo.values()):
            tree.touch(path)
            return 0
        txn = self.transaction()
        # The lock only keeps eviction off the path; when free pages cover the
        # whole reservation nothing is evicted, so the common case skips it.
        guard = None if self._fits(todo) else self._guard(path, keep, m)
        try:
            got = txn.reserve_all({(p, DEVICE): len(pos) for p, pos in todo.items()})
        except ReservationFailed:
            self._release(guard)
            self._stats.put_failures += 1
            return 0
        txn.seal()
        nodes = list(path)
        if m < n:
            parent = path[-1] if path else tree.root(keyer.root)
            prev = parent.keys[-1]
            nodes.append(txn.attach(parent, keyer.chain(raw, prev, m), raw[m * step:n * step]))
        for pool, positions in todo.items():
            pages = got[(pool, DEVICE)]
            self._write(pool, pages, kv, positions)
            for node, offsets, chunk in by_node(nodes, positions, pages):
                txn.place(node, DEVICE, pool, offsets, chunk)
        txn.commit()
        self._release(guard)
        tree.touch(nodes)
        self._stats.inserted_pages += n - m
        self.tiers.after_insert(nodes[len(path):])
        return n - m

    def _fits(self, todo: dict[PoolName, list[int]]) -> bool:
        """Whether every pool has the free device pages `todo` asks for (no eviction needed)."""
        registry = self.registry
        return all(registry[p].device.allocator.free_count >= len(pos) for p, pos in todo.items())

    def _release(self, guard: NodeGuard | None) -> None:
        """Unlock what `_guard` locked, if the put needed it."""
        if guard is not None:
            self.unlock_nodes(guard)

    def _guard(self, path: list[Node], keep: dict[PoolName, Sequence[int]], m: int) -> NodeGuard:
        """Lock what a put keeps of the existing path while it makes room."""
        held = {pool: [x for x in path if bisect_left(positions, x.start) < bisect_left(positions, x.end)]
                for pool, positions in keep.items()}
        primary = held[self.primary_pool]
        if path and path[-1] not in primary[-1:]:
            primary.append(path[-1])   # new nodes hang below it: eviction must not prune it
        return self.lock_nodes(held)

    def _write(self, pool: PoolName, pages: list[int], kv, positions: list[int]) -> None:
        if kv is None or not pages:
            return
        dst = self.registry.pool(pool, DEVICE)
        if dst.data is None:
            return
        dst.data.index_copy_(0, dst.index_tensor(pages), pack(self.layout, pool, kv, positions).to(dst.data.device))

    # --- get -------------------------------------------------------------------------
    def get(self, tokens: Sequence[int], namespace: str) -> CachedKV:
        """The usable cached prefix of `tokens` and its K/V, loaded to device first."""
        match = self.match(tokens, namespace)
        self._stats.lookups += 1
        self._stats.lookup_pages += match.request_pages
        n = match.pages
        if n == 0:
            return self._empty()
        guard, _ = self._guard_match(match, n)
        path = [x for x in match.path if x.start < n]
        try:
            needs = {p: groups(path, pol.needed(n)) for p, pol in self.policies.items()}
            host_only = {(p, x.start + j) for p, groups in needs.items() for x, offs in groups
                         for j in offs if not x.page_has(j, p, (Tier.DEVICE,))}
            if not self.tiers.load_back(needs):
                self._stats.load_back_failures += 1
                n, host_only = self.usable(path, n, (Tier.DEVICE,)), set()
            host_pages = len({pos for _, pos in host_only})
            self._stats.hit_pages_host += host_pages
            self._stats.hit_pages_device += n - host_pages
            out = self._gather(path, n)
            out.host_tokens = host_pages * self.layout.page_size
        finally:
            self.unlock_nodes(guard)
        used = [x for x in path if x.start < n]
        self.tree.touch(used, hit=True)
        self.tiers.after_hit(used)
        return out

    def _gather(self, path: list[Node], n: int) -> CachedKV:
        ps = self.layout.page_size
        layers: list[torch.Tensor | None] = [None] * len(self.layout.layers)
        for pool, policy in self.policies.items():
            src = self.registry.pool(pool, Tier.DEVICE)
            if src.data is None or n == 0:
                continue
            indices = [x.slots[Tier.DEVICE][pool][j] for x, offs in groups(path, policy.needed(n)) for j in offs]
            pages = src.data.index_select(0, src.index_tensor(indices))
            for li, t in zip(self.layout.layers_of(pool), unpack(pages)):
                layers[li] = t
        swa = self.policies.get(PoolName.SWA)
        return CachedKV(n * ps, swa.needed(n).start * ps if swa else 0, layers)

    def _empty(self) -> CachedKV:
        return CachedKV(0, 0, [None] * len(self.layout.layers))

    def _check_kv(self, kv: Sequence[torch.Tensor] | None, pages: int) -> None:
        if kv is None:
            if pages and self.registry.pool(self.primary_pool, DEVICE).data is not None:
                raise ValueError("this cache stores bytes: put needs kv tensors")
            return
        lay = self.layout
        if len(kv) != len(lay.layers):
            raise ValueError(f"kv has {len(kv)} layers, layout has {len(lay.layers)}")
        want = (2, pages * lay.page_size, lay.kv_heads, lay.head_dim)
        for i, t in enumerate(kv):
            if not isinstance(t, torch.Tensor) or t.dtype != lay.torch_dtype or t.dim() != 4 \
                    or t.shape[0] != 2 or t.shape[1] < want[1] or tuple(t.shape[2:]) != want[2:]:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"kv[{i}] must be {lay.dtype} of shape [2, >={want[1]}, "
                                 f"{lay.kv_heads}, {lay.head_dim}], got {got}")

    # --- maintenance ---------------------------------------------------------------
    def evict(self, pool: PoolName, tier: Tier, n: int) -> int:
        with self.transaction() as txn:
            return self.evictors[pool].make_room(tier, n, txn)

    def stats(self) -> CacheStats:
        s = self._stats
        s.nodes = self.tree.node_count
        s.pools = {f"{e.name.name}/{t.name}": {
            "capacity": e.tier(t).capacity, "used": e.tier(t).allocator.used_count,
            "protected": self.tree.protected[t][e.name]} for e in self.registry for t in TIERS}
        return s

    def audit(self) -> PageAudit:
        """Leaked and doubly owned pages, counted (see `check` for the first violation)."""
        return page_audit(self)

    def check(self) -> None:
        check_invariants(self)

    def snapshot(self) -> tuple:
        return cache_snapshot(self)
