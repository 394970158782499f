"""The sharded index answers every lookup exactly as one unsharded index fed
the same events, while splits move subtrees between shards."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.index.events import EventBatch
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import PrefixIndex
from kvfabric.core.index.publisher import EventPublisher
from kvfabric.core.index.routes import RouteError, RouteTable
from kvfabric.core.index.sharded_index import ShardedIndex
from kvfabric.deploy.sim.trace import load_trace, request_tokens

from tests.examples import examples

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=1, page_size=2, window=3)
NS = "tenant"


class World:
    """Nodes with real caches (metadata only) publishing into both indexes."""

    def __init__(self, nodes: int, shards: int, layout: KVLayout = LAYOUT, pages: int = 24) -> None:
        caps = {
            p: PoolCapacity(pages if p == PoolName.FULL else pages // 2, pages)
            for p in layout.pools
        }
        self.caches = [
            NodeCache(layout, caps, store_bytes=False, device="cpu") for _ in range(nodes)
        ]
        self.pubs = [EventPublisher(c, f"node-{i}", epoch=1) for i, c in enumerate(self.caches)]
        self.sharded = ShardedIndex(shards, MatchRule.of(layout))
        self.reference = PrefixIndex(MatchRule.of(layout))
        self.ref_seq = [0] * nodes
        self.splits = 0

    def publish(self) -> None:
        for i, pub in enumerate(self.pubs):
            routed = pub.drain_routed(self.sharded.routes)
            self.sharded.apply(routed)
            merged = {p.key: p for b in routed.values() for p in b.pages}
            self.reference.apply(
                EventBatch(
                    pub.node,
                    1,
                    self.ref_seq[i],
                    tuple(merged.values()),
                    cleared=self.ref_seq[i] == 0,
                )
            )
            self.ref_seq[i] += 1

    def rebalance(self) -> None:
        if self.sharded.rebalance(target=1.0) is None:
            return
        self.splits += 1
        for pub in self.pubs:  # shard state is soft: resend under the new routes
            for shard, snap in pub.snapshots(self.sharded.routes).items():
                self.sharded.load_snapshot(shard, snap)

    def agree(self, tokens: list[int]) -> None:
        keys = self.caches[0].keys(tokens, NS)
        assert self.sharded.lookup(keys) == self.reference.lookup(keys)


def family(rng: random.Random) -> list[list[int]]:
    roots = [[rng.randrange(30) for _ in range(rng.randrange(2, 10))] for _ in range(3)]
    out = []
    for _ in range(12):
        base = rng.choice(roots + out)
        out.append(
            base[: rng.randrange(len(base) + 1)]
            + [rng.randrange(30) for _ in range(rng.randrange(1, 12))]
        )
    return out


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 5))
def test_random_streams_with_splits(seed, shards):
    rng = random.Random(seed)
    world, seqs = World(nodes=3, shards=shards), family(rng)
    for step in range(120):
        cache = rng.choice(world.caches)
        s = rng.choice(seqs)
        if rng.random() < 0.6:
            cache.put(s, None, NS)
        elif rng.random() < 0.5:
            cache.get(s, NS)
        else:
            cache.evict(rng.choice(list(cache.registry.names)), rng.choice(list(Tier)), 3)
        world.publish()
        for t in rng.sample(seqs, 4):
            world.agree(t)
        if step % 10 == 9:
            world.rebalance()
            for t in seqs:
                world.agree(t)


def test_trace_prefixes_spread_over_shards():
    world = World(
        nodes=3,
        shards=8,
        layout=KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=16),
        pages=4000,
    )
    reqs = [request_tokens(r, tokens_per_block=16) for r in load_trace(limit=300)]
    for i, tokens in enumerate(reqs):
        world.agree(tokens)
        world.caches[i % 3].put(tokens, None, NS)
        world.publish()
        if i % 25 == 24:
            world.rebalance()
    assert world.splits >= 2
    for tokens in reqs[::7]:
        world.agree(tokens)
    # every request shares block 0: by the first page alone one shard would take all
    assert world.sharded.load_max_over_mean() < 8.0
    assert any(r.spread for r in world.sharded.routes.routes)  # block 0's children spread


def test_route_table_wire_and_validation():
    t = RouteTable(4).split([b"a" * 16], [b"b" * 16, b"c" * 16], [1, 2])
    back = RouteTable.decode(t.encode())
    assert back.version == 1 and {r.shard for r in back.routes} == {1, 2}
    assert back.owner([b"a" * 16, b"b" * 16, b"z" * 16]) == 1
    assert back.shards_for([b"a" * 16]) == {
        back.default_shard(b"a" * 16),
        1,
        2,
    }  # ancestors replicate
    s = t.spread([b"a" * 16, b"b" * 16], 3)  # a route's children spread by hash
    assert RouteTable.decode(s.encode()).routes == s.routes
    child = s.locate([b"a" * 16, b"b" * 16, b"q" * 16, b"r" * 16])
    assert child == (s.hashed(b"q" * 16), 2)
    assert s.locate([b"a" * 16, b"b" * 16]) == (3, 1)
    assert s.shards_for([b"a" * 16, b"b" * 16]) == set(range(4))  # above every child: on all shards
    for bad in (b"", b"\x93\x01", RouteTable(2).encode()[:-1]):
        with pytest.raises(RouteError):
            RouteTable.decode(bad)
    with pytest.raises(RouteError):
        RouteTable(2).split([b"a" * 16], [b"b" * 16], [5])
    with pytest.raises(RouteError):
        t.split([b"a" * 16], [b"b" * 16], [0])  # that subtree already has a route


def test_entries_split_when_lookups_are_even():
    """Prompts stored but never looked up: by the first page alone one shard holds
    everything; splits by entries spread the keys, and answers stay exact."""
    world = World(
        nodes=2,
        shards=4,
        layout=KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=2),
        pages=4000,
    )
    rng = random.Random(7)
    prompts = [
        [1, 2] + [rng.randrange(50) for _ in range(rng.randrange(2, 12))] for _ in range(120)
    ]
    for i, p in enumerate(prompts):
        world.caches[i % 2].put(p, None, NS)
    world.publish()
    before = [len(s) for s in world.sharded.shards]
    assert sum(1 for n in before if n) == 1  # all under one first page
    for _ in range(6):
        world.rebalance()
    after = [len(s) for s in world.sharded.shards]
    assert world.splits >= 2 and max(after) < max(before) and sum(1 for n in after if n) >= 3
    for p in prompts[::5]:
        world.agree(p)


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(0, 2**32))
def test_entries_by_region_match_where_lookups_go(seed):
    """Each held key is counted under the region a lookup ending at it goes to,
    and under its child one level below that region's root."""
    from kvfabric.core.index.regions import entries_by_region

    rng = random.Random(seed)
    world = World(nodes=2, shards=3)
    seqs = family(rng)
    for step in range(40):
        world.caches[step % 2].put(rng.choice(seqs), None, NS)
        world.publish()
        if step % 8 == 7:
            world.rebalance()
    routes = world.sharded.routes
    for shard in world.sharded.shards:
        want: dict = {}
        for key in shard.held_keys():
            path, k = [key], key
            while (
                (meta := shard.page_meta(k)) is not None
                and meta[1] > 0
                and shard.page_meta(meta[0])
            ):
                path.append(meta[0])
                k = meta[0]
            path.reverse()
            if shard.page_meta(path[0])[1] != 0:
                continue  # the shard lacks this key's top: best effort
            _, root_depth = routes.locate(path)
            root = path[root_depth]
            child = path[root_depth + 1] if root_depth + 1 < len(path) else None
            counts = want.setdefault(root, {})
            if child is not None:
                counts[child] = counts.get(child, 0) + 1
        got = entries_by_region(shard, routes)
        for root, counts in want.items():
            assert dict(got[root].children) == counts and got[root].total == sum(counts.values())
