"""Every per-request, per-tenant and per-node structure stays bounded (issue 11, defect 4).

Each structure is driven with 100k distinct prompts or namespaces, in process (they are
plain Python), and what it holds afterwards is measured with tracemalloc: it must stay
under a bound that does not depend on how many requests went through. (Puts are 10k: each
evicts from full pools, at a millisecond apiece here.) The workloads are the shapes a
region tracker sees (distinct first pages, one shared first page with distinct
continuations, regions below a split) and the ones a tenant map sees (a new namespace per
request). The FabricClient's keyers are checked on a real fabric in
tests/actors/fabric_cluster/ (test_fabric_index.py)."""

from __future__ import annotations

import gc
import struct
import tracemalloc
from typing import Callable

import pytest
from kvfabric.actors.index_shard import IndexShardActor
from kvfabric.core.cache.keys import KeyerCache
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.index.balance import MAX_CHILDREN, MAX_REGIONS, LoadTracker
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.publisher import EventPublisher
from kvfabric.core.index.routes import RouteTable
from kvfabric.core.index.sharded_index import ShardedIndex

N = 100_000
WARM = 2_000  # requests before measuring: pools fill, caches reach their size
BOUND = 2 * 2**20  # bytes a structure may grow by over the N requests after WARM
LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=1, page_size=2, window=3)


def grown(step: Callable[[int], object], n: int = N, warm: int = WARM) -> int:
    """Bytes still allocated after requests warm..n than before them. Traced from
    the start, so that what the warm-up allocated and later freed counts too."""
    tracemalloc.start()
    try:
        for i in range(warm):
            step(i)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(warm, n):
            step(i)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def key(*parts: int) -> bytes:
    return struct.pack(">QQ", *parts) if len(parts) == 2 else struct.pack(">QQ", 0, *parts)


# Lookups as (concatenated keys, depth of the region root): three shapes of traffic.
SHAPES: dict[str, Callable[[int], tuple[bytes, int]]] = {
    "distinct_first_pages": lambda i: (key(1, i) + key(2, i) + key(3, i), 0),
    "one_shared_first_page": lambda i: (key(7) + key(4, i) + key(5, i), 0),
    "below_a_split": lambda i: (key(7) + key(8) + key(6, i) + key(9, i), 1 + i % 2),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_index_shard_lookups_keep_bounded_load(shape):
    """The shard records each lookup's region for rebalancing: bounded however many
    distinct prompts it answers, and the report still names the hot region."""
    shard = IndexShardActor.__ray_actor_class__(0, 4, MatchRule.of(LAYOUT), LAYOUT.fingerprint)
    make = SHAPES[shape]

    def look(i: int) -> None:
        keys, depth = make(i)
        shard.lookup(keys, 0, depth)

    assert grown(look) < BOUND
    report = shard.load_report()
    assert report.lookups[0] == N
    assert len(report.regions) <= 2 * MAX_REGIONS
    assert all(len(r.children) <= 2 * MAX_CHILDREN for r in report.regions.values())
    if shape == "one_shared_first_page":  # every lookup hit one region: it is counted whole
        (region,) = report.regions.values()
        assert region.total == N and region.lone_child() is None


def test_hot_region_survives_pruning():
    """A region with a real share of lookups is still the one a plan splits, among
    100k regions hit once each (what the bound must not cost)."""
    routes, load = RouteTable(2), LoadTracker(2)
    hot = [key(7), key(8)]

    def record(keys: list[bytes]) -> None:
        load.record(keys, *routes.locate(keys))

    for i in range(N):
        record([key(1, i), key(2, i)])
        if i % 50 == 0:
            record(hot + [key(3, i)])
    planned = load.plan(routes, target=1.01)
    assert planned is not None and planned[1].path == (key(7), key(8))  # where its lookups part


def test_sharded_index_lookups_stay_bounded():
    """The in-process sharded index (replay, simulation) counts load until a split,
    which even load never brings."""
    index = ShardedIndex(4, MatchRule.of(LAYOUT))
    assert grown(lambda i: index.lookup([key(1, i), key(2, i)])) < BOUND
    assert sum(index.load.lookups) == N and len(index.load.regions) <= 2 * MAX_REGIONS


PUTS = 10_000  # puts evict on full pools: each costs far more than a lookup
FULL_ONLY = KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=2)


def small_cache(layout: KVLayout = FULL_ONLY) -> NodeCache:
    caps = {p: PoolCapacity(64 if p == PoolName.FULL else 32, 64) for p in layout.pools}
    return NodeCache(layout, caps, store_bytes=False, device="cpu")


def test_unattached_publisher_keeps_no_change_list():
    """A node not yet attached to the index publishes nothing: its change list must not
    grow with every put and eviction meanwhile; its first batch states what it holds."""
    cache = small_cache()
    publisher = EventPublisher(cache, "node-a", epoch=1)
    assert grown(lambda i: cache.put([i, i + 1, 7, i % 5], None, f"ns-{i % 3}"), n=PUTS) < BOUND
    first = publisher.drain()
    held = {p.key for p in publisher.snapshot().pages}
    assert first.cleared and {p.key for p in first.pages} == held and held


def test_publisher_between_drains_stays_bounded():
    """Attached but slow to drain (a long gap between publishes): the pending changes
    are capped, and the next batch restates everything instead."""
    cache = small_cache()
    publisher = EventPublisher(cache, "node-a", epoch=1, pending_floor=64)
    publisher.drain()
    assert grown(lambda i: cache.put([i, i + 1, 9, i % 7], None, "ns"), n=PUTS) < BOUND
    assert len(cache.tree.changes.changes) <= 64 + 2 * cache.tree.page_count
    batch = publisher.drain()
    assert batch.cleared and {p.key for p in batch.pages} == {
        p.key for p in publisher.snapshot().pages
    }


def test_node_cache_keyers_stay_bounded():
    cache = small_cache(LAYOUT)
    assert grown(lambda i: cache.keys([1, 2, 3, 4], f"tenant-{i}"), warm=5_000) < BOUND


def test_keyer_cache_is_lru():
    keyers = KeyerCache(LAYOUT.fingerprint, LAYOUT.page_size, size=2)
    a = keyers.get("a")
    keyers.get("b")
    assert keyers.get("a") is a  # used last: "b" goes first
    keyers.get("c")
    assert len(keyers) == 2 and keyers.get("a") is a
    assert keyers.get("a").keys([1, 2]) == KeyerCache(LAYOUT.fingerprint, LAYOUT.page_size).get(
        "a"
    ).keys([1, 2])
    with pytest.raises(ValueError):
        KeyerCache(LAYOUT.fingerprint, LAYOUT.page_size, size=0)
