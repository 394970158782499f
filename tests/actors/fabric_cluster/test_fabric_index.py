"""The index on a Ray cluster (conftest.py's, shared with test_fabric_nodes.py): hot
subtrees and crowded shards split across shard actors, by a call or by the directory's
watcher; a killed directory or shard restarts and is refilled; shards refuse bad input;
a directory killed mid-rebalance converges; stale routes that cannot be refreshed miss."""

from __future__ import annotations

import pytest
import ray
from kvfabric.actors.client import FabricClient

from tests.actors.fabric_cluster.cluster_kit import (
    CONFIG,
    LAYOUT,
    NS,
    T,
    eventually,
    flush,
    heartbeat_of,
    routes_version,
    until_available,
)
from tests.kvgen import prefix_kv


def test_hot_subtrees_split_across_shard_actors(fabric):
    """Every request shares its first pages (as in the conversation trace): by the first
    page alone one shard takes every lookup; splits spread them and answers stay right."""
    node = sorted(fabric.nodes)[0]
    shared = list(range(5000, 5000 + 2 * 16))
    prompts = [shared + list(range(10_000 + 64 * i, 10_000 + 64 * i + 2 * 16)) for i in range(24)]
    for p in prompts:
        ray.get(fabric.nodes[node].put.remote(p, prefix_kv(LAYOUT, p), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    before = routes_version(fabric)
    for _ in range(4):
        for p in prompts:
            assert [(m.node, m.pages) for m in client.lookup(p, NS)] == [(node, 4)]
        ray.get(fabric.directory.rebalance.remote(1.05), timeout=T)
        flush(fabric)
    # One split at the pages every prompt shares spreads them (the watcher may add more).
    assert routes_version(fabric) > before
    for p in prompts:
        assert [(m.node, m.pages) for m in client.lookup(p, NS)] == [(node, 4)]
    served = [ray.get(s.stats.remote(), timeout=T)["lookups"] for s in fabric.shards]
    assert sum(1 for n in served if n) >= 2  # more than one shard answers now


def test_a_shard_holding_too_many_entries_is_split(fabric):
    """Stored but not yet looked up: one first page puts every key on one shard;
    the directory splits by entries and the nodes' snapshots spread the keys."""
    node = sorted(fabric.nodes)[0]
    shared = list(range(40_000, 40_000 + 16))
    prompts = [shared + list(range(41_000 + 64 * i, 41_000 + 64 * i + 2 * 16)) for i in range(30)]
    # Taken before the puts: the watcher may make the split itself before our calls do.
    before = routes_version(fabric)
    for p in prompts:
        ray.get(fabric.nodes[node].put.remote(p, prefix_kv(LAYOUT, p), "entries-tenant"), timeout=T)
    flush(fabric)
    for shard in fabric.shards:
        until_available(shard)
    ray.get([s.load_report.remote() for s in fabric.shards], timeout=T)  # forget earlier lookups
    for _ in range(3):
        ray.get(fabric.directory.rebalance.remote(1.2), timeout=T)
        flush(fabric)
    assert routes_version(fabric) > before
    client = FabricClient.connect(timeout_s=10.0)
    for p in prompts[::3]:
        assert [(m.node, m.pages) for m in client.lookup(p, "entries-tenant")] == [(node, 3)]


def test_the_directory_rebalances_on_its_own(fabric):
    """Lookups piled on one subtree split it with nobody calling rebalance: the
    directory's watcher does, and answers stay right under the new routes."""
    node = sorted(fabric.nodes)[0]
    shared = list(range(60_000, 60_000 + 16))
    prompts = [shared + list(range(61_000 + 64 * i, 61_000 + 64 * i + 16)) for i in range(16)]
    for p in prompts:
        ray.get(fabric.nodes[node].put.remote(p, prefix_kv(LAYOUT, p), "auto-tenant"), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    before = routes_version(fabric)

    def split() -> bool:
        for p in prompts:
            client.lookup(p, "auto-tenant")
        return routes_version(fabric) > before

    eventually(split, every_s=0.1)
    flush(fabric)
    eventually(
        lambda: all(
            [(m.node, m.pages) for m in client.lookup(p, "auto-tenant")] == [(node, 2)]
            for p in prompts
        )
    )


def test_client_keyers_stay_bounded(fabric):
    """A router's or model server's client sees every tenant over its life (100k here)."""
    from tests.actors.test_bounded_memory import BOUND, grown

    client = FabricClient.connect(timeout_s=10.0)
    tokens = list(range(32))
    assert grown(lambda i: client.keys(tokens, f"tenant-{i}")) < BOUND


def test_a_killed_directory_restarts_with_its_routes_and_nodes(fabric):
    """The route table and the node list survive a restart of the directory: it
    rebuilds them from the node actors."""
    from kvfabric.core.index.routes import RouteTable

    before_routes = ray.get(fabric.directory.get_routes.remote(), timeout=T)
    before_nodes = ray.get(fabric.directory.node_names.remote(), timeout=T)
    assert RouteTable.decode(before_routes).version > 0  # earlier tests split
    _restart_directory(fabric)
    after_routes = ray.get(fabric.directory.get_routes.remote(), timeout=T)
    assert RouteTable.decode(after_routes).version == RouteTable.decode(before_routes).version
    assert after_routes == before_routes
    assert ray.get(fabric.directory.node_names.remote(), timeout=T) == before_nodes
    client = FabricClient.connect(timeout_s=10.0)
    node = sorted(fabric.nodes)[0]
    tokens = list(range(50_000, 50_000 + 2 * 16))
    ray.get(fabric.nodes[node].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    assert [m.node for m in client.lookup(tokens, NS)] == [node]


def _kill_the_shard_of(fabric, node: str, tokens: list[int]) -> FabricClient:
    """`node` stores `tokens`, the index says so, then the shard owning them is killed
    (Ray restarts it empty)."""
    ray.get(fabric.nodes[node].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [node]
    shard = fabric.shards[client.routes.owner(client.keys(tokens, NS))]
    looked_up = ray.get(shard.stats.remote(), timeout=T)["lookups"]
    ray.kill(shard, no_restart=False)

    def restarted() -> bool:  # ray.kill lands later: until then the old process answers
        try:
            return ray.get(shard.stats.remote(), timeout=T)["lookups"] < looked_up
        except ray.exceptions.RayActorError:
            return False

    eventually(restarted)
    return client


def test_a_killed_shard_restarts_and_is_refilled_by_the_nodes(fabric):
    import time

    node = sorted(fabric.nodes)[0]
    tokens = list(range(20_000, 20_000 + 3 * 16))
    client = _kill_the_shard_of(fabric, node, tokens)
    deadline = time.monotonic() + T
    found = []
    while not found and time.monotonic() < deadline:  # partial answers while it refills
        found = client.lookup(tokens, NS)
        other = list(range(30_000, 30_000 + 16))
        ray.get(fabric.nodes[node].put.remote(other, prefix_kv(LAYOUT, other), NS), timeout=T)
        flush(fabric)
    assert [m.node for m in found] == [node]
    for shard in fabric.shards:
        until_available(shard)


def test_a_killed_shard_is_refilled_by_nodes_that_have_no_news(fabric):
    """The nodes stay idle after the kill: the directory's heartbeat has each tell every
    shard where its sequence is, the restarted shard sees a gap and gets their snapshots."""
    node = sorted(fabric.nodes)[-1]
    tokens = list(range(40_000, 40_000 + 3 * 16))
    client = _kill_the_shard_of(fabric, node, tokens)
    eventually(lambda: [m.node for m in client.lookup(tokens, NS)] == [node])
    for shard in fabric.shards:  # the next test finds every shard answering
        until_available(shard)


def test_shards_reject_bad_input_without_change(fabric):
    shard = fabric.shards[0]
    until_available(shard)
    before = _settled(fabric, shard)  # a restarted shard's refill may still be landing
    for junk in (b"", b"\x93\x01\x02", b"x" * 64):
        assert ray.get(shard.apply.remote(junk), timeout=T) == "rejected"
        assert ray.get(shard.load_snapshot.remote(junk), timeout=T) == "rejected"
    from kvfabric.core.index.events import EventBatch, PageState

    foreign = EventBatch(
        "intruder",
        1,
        0,
        (PageState(b"k" * 16, b"p" * 16, 0, 1),),
        cleared=True,
        fingerprint=b"g" * 16,
    )  # another model's layout
    assert ray.get(shard.apply.remote(foreign.encode()), timeout=T) == "rejected"
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(shard.lookup.remote(b"short", 10**6), timeout=T)
    after = ray.get(shard.stats.remote(), timeout=T)
    assert after["rejected"] == before["rejected"] + 7 and after["keys"] == before["keys"]
    assert "intruder" not in ray.get(shard.stats.remote(), timeout=T)["out_of_sync"]


def _settled(fabric, shard) -> dict:
    """The shard's stats once its key count holds across a flush of every node."""
    import time

    deadline = time.monotonic() + T
    stats = ray.get(shard.stats.remote(), timeout=T)
    while True:
        flush(fabric)
        again = ray.get(shard.stats.remote(), timeout=T)
        if again["keys"] == stats["keys"]:
            return again
        assert time.monotonic() < deadline, "the shard's keys never settled"
        stats = again


def _restart_directory(fabric) -> None:
    import time

    first = ray.get(fabric.directory.incarnation.remote(), timeout=T)
    ray.kill(fabric.directory, no_restart=False)
    deadline = time.monotonic() + T
    while True:  # kill is asynchronous: wait for the new process
        try:
            if ray.get(fabric.directory.incarnation.remote(), timeout=T) != first:
                return
        except ray.exceptions.RayActorError:
            pass  # restarting
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _node_actors(fabric) -> dict:
    return {
        n: ray.get_actor(n, namespace="kvfabric")
        for n in ray.get(fabric.directory.node_names.remote(), timeout=T)
    }


def _converged(fabric) -> bool:
    """Every shard and every attached node on the directory's route table."""
    from kvfabric.core.index.routes import RouteTable

    version = RouteTable.decode(ray.get(fabric.directory.get_routes.remote(), timeout=T)).version
    shards = ray.get([s.get_route_version.remote() for s in fabric.shards], timeout=T)
    beats = [heartbeat_of(a) for a in _node_actors(fabric).values()]
    return all(v == version for v in shards) and all(
        b is not None and b.route_version == version for b in beats
    )


@pytest.mark.parametrize("cut", ["after_the_shards", "after_one_node"])
def test_a_directory_killed_mid_rebalance_converges(fabric, cut):
    """A rebalance is: shards take the new version, the directory the new table, nodes
    reroute. Killed after the first step (or partway through the last), the restarted
    directory brings every shard and node onto one table, and lookups find puts again."""
    from kvfabric.core.index.routes import RouteTable

    actors = _node_actors(fabric)
    names = sorted(actors)
    node = names[0]
    base = 70_000 if cut == "after_the_shards" else 75_000
    tokens = list(range(base, base + 3 * 16))
    ray.get(actors[node].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    # The watcher may be rebalancing on its own right now: wait for the index, bounded.
    eventually(lambda: [m.node for m in client.lookup(tokens, NS)] == [node])
    current = RouteTable.decode(ray.get(fabric.directory.get_routes.remote(), timeout=T))
    keys = client.keys(tokens, NS)
    # The rebalance's plan: the prompt's subtree moves to another shard.
    planned = current.split(keys[:1], [keys[1]], [(current.owner(keys) + 1) % current.shards])
    ray.get([s.set_route_version.remote(planned.version) for s in fabric.shards], timeout=T)
    if cut == "after_one_node":
        ray.get(actors[names[-1]].reroute.remote(planned.encode()), timeout=T)
    _restart_directory(fabric)
    eventually(lambda: [m.node for m in client.lookup(tokens, NS)] == [node])
    eventually(lambda: _converged(fabric))
    again = list(range(base + 1000, base + 1000 + 2 * 16))
    ray.get(actors[node].put.remote(again, prefix_kv(LAYOUT, again), NS), timeout=T)
    ray.get(actors[node].flush.remote(), timeout=T)
    assert [m.node for m in FabricClient.connect(timeout_s=10.0).lookup(again, NS)] == [node]


def test_a_lookup_misses_when_stale_routes_cannot_be_refreshed(fabric):
    """The shard says the client's routes are stale and the directory is down: a miss."""
    import asyncio

    from kvfabric.actors.directory import FabricDirectory
    from kvfabric.core.index.routes import RouteTable

    client = FabricClient.connect(timeout_s=10.0)
    tokens = list(range(90_000, 90_000 + 2 * 16))
    current = client.routes
    assert current.version > 0  # earlier tests split
    client.routes = RouteTable(current.shards, current.routes, current.version - 1)
    gone = FabricDirectory.options(namespace="kvfabric", num_cpus=0).remote(CONFIG, current.shards)
    ray.get(gone.get_routes.remote(), timeout=T)
    ray.kill(gone)
    client.directory = gone
    assert client.lookup(tokens, NS) == []
    client.routes = RouteTable(current.shards, current.routes, current.version - 1)
    assert asyncio.run(client.lookup_async(tokens, NS)) == []
