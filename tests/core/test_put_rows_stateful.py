"""Requests interleaved on one NodeCache: each gets with a lease, others put,
evict and let time pass, then it puts the rows it has (full KV from 0 or only
its new pages, SWA from its hit's window or later), or gives up.

Properties: a put never stores a page it was not given rows for; every page
in the cache, on every tier, holds exactly the bytes a caller gave for it (the
K/V of its own prefix); a lease keeps its match usable until released or
expired; check() holds after every step."""

import struct
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvfabric.core.cache.cached_kv import CachedKV
from kvfabric.core.cache.check import PageAudit
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.page_bytes import pack
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy

from tests.core.test_cache_stateful import NAMESPACES, family
from tests.kvgen import prefix_kv

LAYOUTS = {
    "mixed": KVLayout(layers=("full", "swa", "swa"), kv_heads=1, head_dim=2, page_size=2, window=3),
    "swa": KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=4),
}
TTL = 4.0


@dataclass
class Request:
    tokens: list[int]
    ns: str
    hit: CachedKV
    expires: float


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class PutRowsMachine(RuleBasedStateMachine):
    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        policy=st.sampled_from(list(WritePolicy)),
        seed=st.integers(0, 2**16),
        device=st.integers(4, 10),
        host=st.integers(0, 6),
    )
    def setup(self, layout, policy, seed, device, host):
        self.layout = LAYOUTS[layout]
        caps = {
            p: PoolCapacity(device if p == PoolName.FULL else max(3, device // 2), host)
            for p in self.layout.pools
        }
        self.clock = Clock()
        self.cache = NodeCache(
            self.layout,
            caps,
            tier=TierConfig(policy=policy, selective_hits=2),
            device="cpu",
            clock=self.clock,
        )
        self.seqs = family(seed)
        self.requests: list[Request] = []

    @property
    def ps(self) -> int:
        return self.layout.page_size

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), extra=st.integers(0, 5))
    def begin(self, i, ns, extra):
        tokens = self.seqs[i % len(self.seqs)] + list(range(100, 100 + extra))
        hit = self.cache.get(tokens, ns, lease_s=TTL)
        assert bool(hit.lease) == (hit.tokens > 0)
        want = prefix_kv(self.layout, tokens)
        for li, kind in enumerate(self.layout.layers):
            start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
            assert hit.tokens == 0 or torch.equal(hit.layers[li], want[li][:, start : hit.tokens])
        self.requests.append(Request(tokens, ns, hit, self.clock.now + TTL))

    @precondition(lambda self: self.requests)
    @rule(
        k=st.integers(0, 7),
        grow=st.integers(0, 3),
        swa_later=st.integers(0, 3),
        full_from=st.sampled_from(["zero", "hit", "past-hit"]),
    )
    def finish(self, k, grow, swa_later, full_from):
        """Put what the request computed: full KV from 0, or only the pages past
        its hit (or fewer); SWA from its hit's window start, or later."""
        r = self.requests.pop(k % len(self.requests))
        tokens = r.tokens + list(range(300, 300 + grow * self.ps))
        n = len(tokens) // self.ps
        hit_pages = r.hit.tokens // self.ps
        full = {"zero": 0, "hit": hit_pages, "past-hit": hit_pages + 1}[full_from]
        first = {
            PoolName.FULL: min(n, full),
            PoolName.SWA: min(n, r.hit.starts[PoolName.SWA] // self.ps + swa_later),
        }
        first = {p: first[p] for p in self.layout.pools}
        starts = {p: f * self.ps for p, f in first.items()}
        kv = prefix_kv(self.layout, tokens)
        kv = [t[:, starts[self._pool(kind)] :] for t, kind in zip(kv, self.layout.layers)]
        keys = self.cache.keys(tokens, r.ns)
        before, matched = self._on_device(keys), self.cache.match(tokens, r.ns).present_pages
        stored = self.cache.put(tokens, kv, r.ns, starts=starts, release=r.hit.lease)
        new = self._on_device(keys) - before
        for position, pool in new:
            assert position >= first[pool], f"{pool.name} page {position} stored without rows"
        assert self.cache.match(tokens, r.ns).present_pages == matched + stored

    @precondition(lambda self: self.requests)
    @rule(k=st.integers(0, 7))
    def give_up(self, k):
        r = self.requests.pop(k % len(self.requests))
        self.cache.release_lease(r.hit.lease)

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def put_whole(self, i, ns):
        t = self.seqs[i % len(self.seqs)]
        self.cache.put(t, prefix_kv(self.layout, t), ns)

    @rule(
        pool=st.sampled_from(list(PoolName)), tier=st.sampled_from(list(Tier)), n=st.integers(1, 8)
    )
    def evict(self, pool, tier, n):
        if pool in self.cache.registry:
            self.cache.evict(pool, tier, n)

    @rule(dt=st.sampled_from([0.5, 1.5, 3.0]))
    def time_passes(self, dt):
        self.clock.now += dt
        self.cache.leases.expire()  # as the node actor's heartbeat does

    def _pool(self, kind) -> PoolName:
        return PoolName.FULL if kind.value == "full" else PoolName.SWA

    def _on_device(self, keys: list[bytes]) -> set[tuple[int, PoolName]]:
        out = set()
        path, matched = self.cache.tree.walk_keys(keys)
        for node in path:
            for position in range(node.start, min(node.end, matched)):
                for pool in self.layout.pools:
                    if node.page_has(position - node.start, pool, (Tier.DEVICE,)):
                        out.add((position, pool))
        return out

    @invariant()
    def consistent(self):
        if hasattr(self, "cache"):
            self.cache.check()
            assert self.cache.audit() == PageAudit(0, 0, 0)

    @invariant()
    def every_page_holds_its_prefix_kv(self):
        if not hasattr(self, "cache"):
            return
        for node in self.cache.tree.nodes():
            raw, up = b"", node
            while not up.is_root:
                raw, up = up.tokens + raw, up.parent
            prefix = list(struct.unpack(f"{len(raw) // 4}i", raw))
            want = prefix_kv(self.layout, prefix)
            for tier in Tier:
                for pool in self.layout.pools:
                    pages = node.slots[tier][pool]
                    data = self.cache.registry.pool(pool, tier).data
                    for j, index in enumerate(pages or []):
                        if index >= 0:
                            expected = pack(self.layout, pool, want, [node.start + j])[0]
                            assert torch.equal(data[index], expected), (
                                f"{pool.name}/{tier.name} page {node.start + j} holds other bytes"
                            )

    @invariant()
    def holds_keep_their_match(self):
        if not hasattr(self, "cache"):
            return
        for r in self.requests:
            if r.hit.lease and self.clock.now < r.expires:
                assert self.cache.match(r.tokens, r.ns).usable_pages >= r.hit.tokens // self.ps

    def teardown(self):
        if hasattr(self, "cache"):
            for r in self.requests:
                self.cache.release_lease(r.hit.lease)
            assert len(self.cache.leases) == 0
            assert self.cache.tree.protected == [[0, 0], [0, 0], [0, 0]]
            for _ in range(4):  # with no leases, everything can go (a tier at a time)
                for pool in self.cache.registry.names:
                    for tier in Tier:
                        self.cache.evict(pool, tier, 10_000)
            self.cache.check()
            assert self.cache.tree.node_count == 0


TestPutRows = PutRowsMachine.TestCase
