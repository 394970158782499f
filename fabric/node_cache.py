"""NodeCache: one node's SWA-aware tiered prefix cache, the facade other layers use."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .eviction import Evictor
from .faults import AllocationFaults
from .keys import PageKeyer, encode_tokens
from .layout import KVLayout, PoolName, Tier
from .pages import PageCopier, TorchCopier, pack, unpack
from .policies import AttentionPolicy, policies_for
from .pools import PoolCapacity, PoolRegistry
from .radix import ABSENT, TIERS, Node, RadixTree
from .tiers import TierConfig, TierController
from .txn import ReservationFailed, Transaction


@dataclass
class Match:
    """A usable cached prefix: `pages` whole pages along `path`."""
    path: list[Node]        # nodes present for the request's pages (may exceed `pages`)
    pages: int              # usable length, either tier
    device_pages: int       # usable length from the device tier alone
    request_pages: int      # whole pages in the request

    @property
    def keys(self) -> list[bytes]:
        return [n.key for n in self.path[: self.pages]]


@dataclass
class PrefixLock:
    nodes: dict[PoolName, list[Node]]
    released: bool = False


@dataclass
class CachedKV:
    """K/V of a cached prefix. Full layers cover tokens [0, tokens); SWA layers
    cover [swa_start, tokens). `layers[i]` is [2, n_tokens, kv_heads, head_dim]."""
    tokens: int
    swa_start: int
    layers: list[torch.Tensor | None]


@dataclass
class CacheStats:
    lookups: int = 0
    hit_pages_device: int = 0
    hit_pages_host: int = 0
    lookup_pages: int = 0
    inserted_pages: int = 0
    put_failures: int = 0
    load_back_failures: int = 0
    rollbacks: int = 0
    nodes: int = 0
    pools: dict[str, dict[str, int]] = field(default_factory=dict)


class NodeCache:
    def __init__(self, layout: KVLayout, capacities: Mapping[PoolName, PoolCapacity], *,
                 tier: TierConfig = TierConfig(), device: torch.device | str | None = None,
                 store_bytes: bool = True, copier: PageCopier | None = None,
                 faults: AllocationFaults | None = None) -> None:
        self.layout = layout
        self.registry = PoolRegistry.build(layout, capacities, device, store_bytes)
        self.tree = RadixTree(self.registry, layout.page_size * 4)
        self.policies: dict[PoolName, AttentionPolicy] = policies_for(layout)
        self.copier = copier or TorchCopier()
        self.faults = faults
        self.open_txns: set[Transaction] = set()
        self.tiers = TierController(self.registry, tier, self.transaction)
        self.evictors = {p: Evictor(self.tree, pol, self.tiers.write_back) for p, pol in self.policies.items()}
        for entry in self.registry:
            entry.evict = self.evictors[entry.name].make_room
        self._keyers: dict[str, PageKeyer] = {}
        self._stats = CacheStats()

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
        return self._match(self.tree.walk(self.keyer(namespace).root, raw),
                           len(raw) // self.tree.page_bytes)

    def match_keys(self, keys: list[bytes]) -> Match:
        """The same, for a chain of page keys (as peers and the index name prefixes)."""
        return self._match(self.tree.walk_keys(keys), len(keys))

    def _match(self, path: list[Node], request_pages: int) -> Match:
        return Match(path, self._usable(path, len(path), TIERS),
                     self._usable(path, len(path), (Tier.DEVICE,)), request_pages)

    def _usable(self, path: list[Node], limit: int, tiers: tuple[Tier, ...]) -> int:
        # Policies are visited in pool order, FULL first. Full usability is
        # prefix-closed, so the SWA policy's answer is usable for FULL too.
        for policy in self.policies.values():
            limit = policy.usable(path, limit, tiers)
        return limit

    # --- locks ---------------------------------------------------------------------
    def lock(self, match: Match, pages: int | None = None) -> PrefixLock:
        """Protect what a match of `pages` (default: all usable) needs from eviction."""
        n = match.pages if pages is None else pages
        return self._lock_nodes({p: [match.path[i] for i in pol.needed(n)]
                                 for p, pol in self.policies.items()})

    def unlock(self, lock: PrefixLock) -> None:
        if lock.released:
            raise RuntimeError("prefix lock released twice")
        lock.released = True
        for pool, nodes in lock.nodes.items():
            self.tree.lock(nodes, pool, -1)

    def _lock_nodes(self, held: dict[PoolName, list[Node]]) -> PrefixLock:
        for pool, nodes in held.items():
            self.tree.lock(nodes, pool, +1)
        return PrefixLock(held)

    # --- transactions --------------------------------------------------------------
    def transaction(self) -> Transaction:
        txn = Transaction(self.tree, self.registry, self.copier, self.faults, self._txn_closed)
        self.open_txns.add(txn)
        return txn

    def _txn_closed(self, txn: Transaction) -> None:
        self.open_txns.discard(txn)

    # --- put / get -----------------------------------------------------------------
    def put(self, tokens: Sequence[int], kv: Sequence[torch.Tensor] | None, namespace: str) -> int:
        """Store the whole pages of `tokens`; returns pages newly stored (0 if no room)."""
        keyer = self.keyer(namespace)
        raw = encode_tokens(tokens)
        step = self.tree.page_bytes
        n = len(raw) // step
        self._check_kv(kv, n)
        path = self.tree.walk(keyer.root, raw)
        m = len(path)
        # Leaving the tree below a node that has other children makes a branch
        # point: a likely continuation, so SWA keeps its window too.
        branch = m if path and path[-1].children and m < n else 0
        keep = {p: list(pol.store_positions(n, branch)) for p, pol in self.policies.items()}
        todo = {p: [i for i in pos if i >= m or path[i].slots[Tier.DEVICE][p] == ABSENT]
                for p, pos in keep.items()}
        if not any(todo.values()):
            self.tree.touch(path)
            return 0
        held = {p: [path[i] for i in pos if i < m] for p, pos in keep.items()}
        primary = held[self.layout.pools[0]]   # the pool whose pages keep a node alive
        if path and path[-1] not in primary[-1:]:
            primary.append(path[-1])   # new nodes hang below it: eviction must not prune it
        guard = self._lock_nodes(held)
        txn = self.transaction()
        try:
            got = txn.reserve_all({(p, Tier.DEVICE): len(pos) for p, pos in todo.items()})
        except ReservationFailed:
            self.unlock(guard)
            self._stats.put_failures += 1
            return 0
        txn.seal()
        parent = path[-1] if path else self.tree.root(keyer.root)
        new_keys = keyer.chain(raw, parent.key, m)
        nodes = path + txn.attach_chain(parent, new_keys, [raw[i * step:(i + 1) * step] for i in range(m, n)])
        for pool, positions in todo.items():
            pages = got[(pool, Tier.DEVICE)]
            self._write(pool, pages, kv, positions)
            txn.place_many([nodes[i] for i in positions], Tier.DEVICE, pool, pages)
        txn.commit()
        self.unlock(guard)
        self.tree.touch(nodes)
        self._stats.inserted_pages += n - m
        self.tiers.after_insert(nodes[m:])
        return n - m

    def _write(self, pool: PoolName, pages: list[int], kv, positions: list[int]) -> None:
        dst = self.registry.pool(pool, Tier.DEVICE)
        if dst.data is None or kv is None or not pages:
            return
        dst.data.index_copy_(0, dst.index_tensor(pages), pack(self.layout, pool, kv, positions).to(dst.data.device))

    def get(self, tokens: Sequence[int], namespace: str) -> CachedKV:
        """The usable cached prefix of `tokens` and its K/V, loaded to device first."""
        match = self.match(tokens, namespace)
        self._stats.lookups += 1
        self._stats.lookup_pages += match.request_pages
        n = match.pages
        if n == 0:
            return self._empty()
        guard = self.lock(match)
        try:
            needs = {p: [match.path[i] for i in pol.needed(n)] for p, pol in self.policies.items()}
            host_only = {id(x) for p, nodes in needs.items() for x in nodes
                         if x.slots[Tier.DEVICE][p] == ABSENT}
            if not self.tiers.load_back(needs):
                self._stats.load_back_failures += 1
                n, host_only = match.device_pages, set()
            self._stats.hit_pages_host += len(host_only)
            self._stats.hit_pages_device += n - len(host_only)
            out = self._gather(match.path, n)
        finally:
            self.unlock(guard)
        self.tree.touch(match.path[:n], hit=True)
        self.tiers.after_hit(match.path[:n])
        return out

    def _gather(self, path: list[Node], n: int) -> CachedKV:
        ps = self.layout.page_size
        layers: list[torch.Tensor | None] = [None] * len(self.layout.layers)
        for pool, policy in self.policies.items():
            src = self.registry.pool(pool, Tier.DEVICE)
            if src.data is None:
                continue
            index = src.index_tensor([path[i].slots[Tier.DEVICE][pool] for i in policy.needed(n)])
            for li, t in zip(self.layout.layers_of(pool), unpack(src.data.index_select(0, index))):
                layers[li] = t
        swa = self.policies.get(PoolName.SWA)
        return CachedKV(n * ps, swa.needed(n).start * ps if swa else 0, layers)

    def _empty(self) -> CachedKV:
        return CachedKV(0, 0, [None] * len(self.layout.layers))

    def _check_kv(self, kv: Sequence[torch.Tensor] | None, pages: int) -> None:
        if kv is None:
            if self.registry.pool(self.layout.pools[0], Tier.DEVICE).data is not None and pages:
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

    def check(self) -> None:
        from .check import check_invariants
        check_invariants(self)

    def snapshot(self) -> tuple:
        from .check import snapshot
        return snapshot(self)
