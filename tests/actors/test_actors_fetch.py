"""Two NodeCacheActors on two nodes of a real Ray cluster: a prefix put on A
is fetched into B over NIXL with equal bytes; a dead peer degrades to a miss."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from kvfabric.actors.node.node_actor import NodeConfig
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.index.events import decode as decode_events

from tests.kvgen import prefix_kv
from tests.ray_cluster import node_actor_on, one_cpu_nodes

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=2, head_dim=32, page_size=16, window=32)
CONFIG = NodeConfig(
    LAYOUT, {PoolName.FULL: PoolCapacity(64, 64), PoolName.SWA: PoolCapacity(32, 32)}, device="cpu"
)
NS = "tenant"
T = 120.0


@pytest.fixture(scope="module")
def cluster():
    with one_cpu_nodes(2) as (c, nodes):
        yield c, nodes


def start(name: str, node) -> "ray.actor.ActorHandle":
    return node_actor_on(node, name, CONFIG, cpus=0.5)


def test_fetch_between_actors_on_two_nodes(cluster):
    _, (node_a, node_b) = cluster
    a, b = start("cache-a", node_a), start("cache-b", node_b)
    try:
        ray.get(b.connect.remote("cache-a", ray.get(a.metadata.remote(), timeout=T)), timeout=T)
        tokens = list(range(7, 7 + 6 * 16))
        assert ray.get(a.put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T) == 6
        assert ray.get(b.match.remote(tokens, NS), timeout=T) == 0
        assert ray.get(b.fetch.remote(a, "cache-a", tokens, NS), timeout=T) == "committed"
        hit = ray.get(b.get.remote(tokens, NS), timeout=T)
        want = prefix_kv(LAYOUT, tokens)
        assert hit.tokens == len(tokens)
        assert torch.equal(hit.layers[0], want[0]) and torch.equal(
            hit.layers[1], want[1][:, hit.starts[PoolName.SWA] :]
        )
        ray.get([a.check.remote(), b.check.remote()], timeout=T)
        batch = decode_events(ray.get(b.drain_events.remote(), timeout=T))
        assert batch.seq == 0 and batch.cleared and {p.depth for p in batch.pages} == set(range(6))
        assert set(decode_events(ray.get(b.snapshot.remote(), timeout=T)).pages) == set(batch.pages)
        assert ray.get(a.stats.remote(), timeout=T)["leases"] == 0
        # A dead peer is a miss, never an error on the request path.
        ray.kill(a)
        with pytest.raises(ray.exceptions.RayActorError):  # kill is asynchronous: wait for it
            for _ in range(100):
                ray.get(a.ping.remote(), timeout=T)
                time.sleep(0.1)
        other = list(range(900, 900 + 4 * 16))
        assert ray.get(b.fetch.remote(a, "cache-a", other, NS), timeout=T) == "transfer_failed"
        ray.get(b.check.remote(), timeout=T)
    finally:
        for actor in (a, b):
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass  # the peer was killed on purpose: already dead is fine
            ray.kill(actor)
