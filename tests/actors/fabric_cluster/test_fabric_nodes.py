"""The fabric on a Ray cluster of four nodes: node actors publish to index
shards; a client finds a prefix put on one node from anywhere, fetches it
into another with equal bytes, and a removed node leaves the index."""
from __future__ import annotations

from functools import partial
import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from kvfabric.actors import FabricClient, NodeConfig, start, stop
from kvfabric.fabric import KVLayout, PoolCapacity, PoolName
from tests.kvgen import prefix_kv
from tests.waiting import eventually as wait_for

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=2, head_dim=16, page_size=16, window=32)
CONFIG = NodeConfig(LAYOUT, {PoolName.FULL: PoolCapacity(64, 64), PoolName.SWA: PoolCapacity(32, 32)}, device="cpu")
NS = "tenant"
T = 120.0


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(3):
        c.add_node(num_cpus=1)
    ray.init(address=c.address)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def fabric(cluster):
    f = start(CONFIG, shards=3, cpus_per_actor=0.25, watch_s=0.5)
    yield f
    stop(f)


eventually = partial(wait_for, deadline_s=T, every_s=0.2)


def flush(f):
    ray.get([n.flush.remote() for n in f.nodes.values()], timeout=T)


def routes_version(f) -> int:
    from kvfabric.fabric import RouteTable
    return RouteTable.decode(ray.get(f.directory.get_routes.remote(), timeout=T)).version


def until_available(actor, deadline_s: float = T) -> None:
    """Wait out an actor's restart (calls fail with ActorUnavailableError meanwhile)."""
    import time
    end = time.monotonic() + deadline_s
    while True:
        try:
            ray.get(actor.noop.remote(), timeout=T)
            return
        except ray.exceptions.RayActorError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def test_index_finds_a_prefix_and_fetch_moves_it(fabric):
    names = sorted(fabric.nodes)
    a, b = names[0], names[1]
    tokens = list(range(50, 50 + 5 * 16))
    assert ray.get(fabric.nodes[a].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T) == 5
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    found = client.lookup(tokens, NS)
    assert [(m.node, m.pages) for m in found] == [(a, 5)]
    assert client.lookup(tokens, "another-tenant") == []           # tenants never see each other
    assert client.fetch(tokens, NS, into=b) == 5
    hit = ray.get(fabric.nodes[b].get.remote(tokens, NS), timeout=T)
    want = prefix_kv(LAYOUT, tokens)
    assert torch.equal(hit.layers[0], want[0]) and torch.equal(hit.layers[1], want[1][:, hit.starts[PoolName.SWA]:])
    flush(fabric)
    assert {m.node for m in client.lookup(tokens, NS)} == {a, b}
    ray.get([n.check.remote() for n in fabric.nodes.values()], timeout=T)


def test_source_killed_mid_fetch_leaves_the_destination_clean(fabric):
    """The abandoned read's pages stay quarantined (no time frees them, and the dead
    source's probe fails) until the directory drops the source and tells every node
    to forget it: then they are freed."""
    import dataclasses
    import time

    from kvfabric.actors import NodeCacheActor, join
    from kvfabric.deploy.chaos.faults import Fault, FaultKind, NodeChaos
    source_name = sorted(fabric.nodes)[0]
    tokens = list(range(300, 300 + 4 * 16))
    ray.get(fabric.nodes[source_name].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    hanging = dataclasses.replace(CONFIG, hooks=partial(NodeChaos, script=[Fault(FaultKind.HANG)]))
    dest = NodeCacheActor.options(name="kvf-node-chaos", namespace="kvfabric", num_cpus=0.1).remote(
        "kvf-node-chaos", hanging)
    join(fabric.directory, "kvf-node-chaos", timeout_s=T)
    # The drop below happens when the test says (the watcher would race the checks before it).
    assert ray.get(fabric.directory.stop_watching.remote(wait_s=T / 2), timeout=T)
    source = fabric.nodes.pop(source_name)
    pending = dest.fetch.remote(source, source_name, tokens, NS)
    time.sleep(0.5)
    ray.kill(source)                                   # dies while the read is in flight
    assert ray.get(pending, timeout=T) == "transfer_failed"
    assert ray.get(dest.match.remote(tokens, NS), timeout=T) == 0   # nothing half-inserted
    ray.get(dest.check.remote(), timeout=T)
    assert ray.get(dest.probe_quarantine.remote(), timeout=T) == []  # the dead source answers no probe
    stats = ray.get(dest.stats.remote(), timeout=T)
    assert stats["quarantined"] > 0 and source_name in stats["peers"]
    assert ray.get(dest.fetch.remote(source, source_name, tokens, NS), timeout=T) == "peer_quarantined"
    changed = ray.get(fabric.directory.reconcile.remote(add=False), timeout=T)
    assert source_name in changed.dropped
    stats = ray.get(dest.stats.remote(), timeout=T)
    assert stats["quarantined"] == 0 and stats["pools"]["FULL/DEVICE"]["used"] == 0
    assert source_name not in stats["peers"]            # forgotten: disconnected too
    ray.kill(dest)
    ray.get(fabric.directory.watch.remote(0.5), timeout=T)
    # The directory's watcher drops the dead dest from the directory and the index (and
    # gives the source's Ray node, still alive, a fresh node actor of the same name).
    client = FabricClient.connect(timeout_s=10.0)
    eventually(lambda: "kvf-node-chaos" not in ray.get(fabric.directory.node_names.remote(), timeout=T)
               and client.lookup(tokens, NS) == [])


def test_a_killed_node_actor_leaves_the_index(fabric):
    names = sorted(fabric.nodes)
    victim = names[2]
    tokens = list(range(700, 700 + 3 * 16))
    ray.get(fabric.nodes[victim].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [victim]
    ray.kill(fabric.nodes.pop(victim))
    client.purge_dead_nodes()           # at once, rather than at the watcher's next pass
    assert client.lookup(tokens, NS) == []
    assert client.fetch(tokens, NS, into=names[0]) == 0             # nothing to fetch: recompute


def test_a_node_actor_ray_restarts_rejoins_with_a_new_epoch(fabric):
    names = sorted(fabric.nodes)
    victim, other = names[0], names[1]
    actor = fabric.nodes[victim]
    tokens = list(range(60_000, 60_000 + 3 * 16))
    ray.get(actor.put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [victim]
    epoch = ray.get(actor.heartbeat.remote(), timeout=T).epoch
    ray.kill(actor, no_restart=False)
    # The old epoch's pages leave the index; the new actor is attached and connected again.
    eventually(lambda: (beat := _beat(actor)) is not None and beat.epoch > epoch and beat.attached)
    eventually(lambda: client.lookup(tokens, NS) == [])
    again = list(range(61_000, 61_000 + 2 * 16))
    ray.get(actor.put.remote(again, prefix_kv(LAYOUT, again), NS), timeout=T)
    flush(fabric)
    assert [m.node for m in client.lookup(again, NS)] == [victim]
    assert client.fetch(again, NS, into=other) == 2
    ray.get([fabric.nodes[n].check.remote() for n in (victim, other)], timeout=T)


def _beat(actor):
    try:
        return ray.get(actor.heartbeat.remote(), timeout=T)
    except ray.exceptions.RayActorError:
        return None


def test_a_node_added_to_the_cluster_joins_and_its_removal_purges_it(fabric, cluster):
    from kvfabric.actors.directory import node_actor_name
    added = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    name = node_actor_name(added.node_id)
    eventually(lambda: name in ray.get(fabric.directory.node_names.remote(), timeout=T))
    actor = ray.get_actor(name, namespace="kvfabric")
    tokens = list(range(900, 900 + 3 * 16))
    ray.get(actor.put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    ray.get(actor.flush.remote(), timeout=T)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [name]
    other = sorted(fabric.nodes)[0]
    assert client.fetch(tokens, NS, into=other) == 3                # peers were connected both ways
    cluster.remove_node(added)
    eventually(lambda: name not in ray.get(fabric.directory.node_names.remote(), timeout=T))
    flush(fabric)       # the directory purges the shards before it stops listing the node
    assert [m.node for m in client.lookup(tokens, NS)] == [other]


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
    assert sum(1 for n in served if n) >= 2            # more than one shard answers now


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
    ray.get([s.load_report.remote() for s in fabric.shards], timeout=T)    # forget earlier lookups
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
    eventually(lambda: all([(m.node, m.pages) for m in client.lookup(p, "auto-tenant")] == [(node, 2)]
                           for p in prompts))


def test_client_keyers_stay_bounded(fabric):
    """A router's or model server's client sees every tenant over its life (100k here)."""
    from tests.actors.test_bounded_memory import BOUND, grown
    client = FabricClient.connect(timeout_s=10.0)
    tokens = list(range(32))
    assert grown(lambda i: client.keys(tokens, f"tenant-{i}")) < BOUND


def test_a_killed_directory_restarts_with_its_routes_and_nodes(fabric):
    """The route table and the node list survive a restart of the directory: it
    rebuilds them from the node actors."""
    from kvfabric.fabric import RouteTable
    before_routes = ray.get(fabric.directory.get_routes.remote(), timeout=T)
    before_nodes = ray.get(fabric.directory.node_names.remote(), timeout=T)
    assert RouteTable.decode(before_routes).version > 0          # earlier tests split
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


def test_a_killed_shard_restarts_and_is_refilled_by_the_nodes(fabric):
    import time
    node = sorted(fabric.nodes)[0]
    tokens = list(range(20_000, 20_000 + 3 * 16))
    ray.get(fabric.nodes[node].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [node]
    owner = client.routes.owner(client.keys(tokens, NS))
    ray.kill(fabric.shards[owner], no_restart=False)
    deadline = time.monotonic() + T
    found = []
    while not found and time.monotonic() < deadline:     # partial answers while it refills
        found = client.lookup(tokens, NS)
        other = list(range(30_000, 30_000 + 16))
        ray.get(fabric.nodes[node].put.remote(other, prefix_kv(LAYOUT, other), NS), timeout=T)
        flush(fabric)
    assert [m.node for m in found] == [node]
    for shard in fabric.shards:
        until_available(shard)


def test_shards_reject_bad_input_without_change(fabric):
    shard = fabric.shards[0]
    until_available(shard)
    before = ray.get(shard.stats.remote(), timeout=T)
    for junk in (b"", b"\x93\x01\x02", b"x" * 64):
        assert ray.get(shard.apply.remote(junk), timeout=T) == "rejected"
        assert ray.get(shard.load_snapshot.remote(junk), timeout=T) == "rejected"
    from kvfabric.fabric import EventBatch, PageState
    foreign = EventBatch("intruder", 1, 0, (PageState(b"k" * 16, b"p" * 16, 0, 1),), cleared=True,
                         fingerprint=b"g" * 16)                     # another model's layout
    assert ray.get(shard.apply.remote(foreign.encode()), timeout=T) == "rejected"
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(shard.lookup.remote(b"short", 10**6), timeout=T)
    after = ray.get(shard.stats.remote(), timeout=T)
    assert after["rejected"] == before["rejected"] + 7 and after["keys"] == before["keys"]
    assert "intruder" not in ray.get(shard.stats.remote(), timeout=T)["out_of_sync"]


def test_a_holder_the_directory_does_not_list_is_purged(fabric):
    """A node actor that died while the directory was down (a restarted directory lists
    only nodes that answer) is still named by the shards: the watcher purges such a
    stray. An engine's identity on a listed node is not one."""
    from kvfabric.fabric import EventBatch, PageState
    shard = fabric.shards[0]
    until_available(shard)
    stray, engine = "kvf-node-0123456789ab", f"{sorted(fabric.nodes)[0]}/engine/0"
    for name in (stray, engine):
        batch = EventBatch(name, 1, 0, (PageState(b"s" * 16, b"p" * 16, 0, 1),), cleared=True,
                           fingerprint=LAYOUT.fingerprint)
        assert ray.get(shard.apply.remote(batch.encode()), timeout=T) == "applied"
    eventually(lambda: stray not in ray.get(shard.holders.remote(), timeout=T))
    assert engine in ray.get(shard.holders.remote(), timeout=T)
    ray.get(shard.drop_node.remote(engine), timeout=T)


def _restart_directory(fabric) -> None:
    import time
    first = ray.get(fabric.directory.incarnation.remote(), timeout=T)
    ray.kill(fabric.directory, no_restart=False)
    deadline = time.monotonic() + T
    while True:                          # kill is asynchronous: wait for the new process
        try:
            if ray.get(fabric.directory.incarnation.remote(), timeout=T) != first:
                return
        except ray.exceptions.RayActorError:
            pass                         # restarting
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _node_actors(fabric) -> dict:
    return {n: ray.get_actor(n, namespace="kvfabric") for n in ray.get(fabric.directory.node_names.remote(), timeout=T)}


def _converged(fabric) -> bool:
    """Every shard and every attached node on the directory's route table."""
    from kvfabric.fabric import RouteTable
    version = RouteTable.decode(ray.get(fabric.directory.get_routes.remote(), timeout=T)).version
    shards = ray.get([s.get_route_version.remote() for s in fabric.shards], timeout=T)
    beats = [_beat(a) for a in _node_actors(fabric).values()]
    return all(v == version for v in shards) and all(b is not None and b.route_version == version for b in beats)


@pytest.mark.parametrize("cut", ["after_the_shards", "after_one_node"])
def test_a_directory_killed_mid_rebalance_converges(fabric, cut):
    """A rebalance is: shards take the new version, the directory the new table, nodes
    reroute. Killed after the first step (or partway through the last), the restarted
    directory brings every shard and node onto one table, and lookups find puts again."""
    from kvfabric.fabric import RouteTable
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
    from kvfabric.actors import FabricDirectory
    from kvfabric.fabric import RouteTable
    client = FabricClient.connect(timeout_s=10.0)
    tokens = list(range(90_000, 90_000 + 2 * 16))
    current = client.routes
    assert current.version > 0                                   # earlier tests split
    client.routes = RouteTable(current.shards, current.routes, current.version - 1)
    gone = FabricDirectory.options(namespace="kvfabric", num_cpus=0).remote(CONFIG, current.shards)
    ray.get(gone.get_routes.remote(), timeout=T)
    ray.kill(gone)
    client.directory = gone
    assert client.lookup(tokens, NS) == []
    client.routes = RouteTable(current.shards, current.routes, current.version - 1)
    assert asyncio.run(client.lookup_async(tokens, NS)) == []


def test_a_restarted_node_whose_clock_stepped_back_is_still_accepted(fabric):
    """Epochs do not come from the wall clock: a node actor Ray restarts with its clock
    behind the old one's still publishes, and its new pages are found."""
    from kvfabric.actors import join
    from kvfabric.actors.node.node_actor import NodeCacheActor

    class ClockSteppedBack(NodeCacheActor.__ray_metadata__.modified_class):
        def __init__(self, name, config):
            import time as clock            # this actor's own process: its wall clock only
            behind = ray.get_runtime_context().was_current_actor_reconstructed
            now = clock.time_ns() - (3600 * 10**9 if behind else 0)     # an hour back after a restart
            clock.time_ns = lambda: now
            super().__init__(name, config)

    name = "kvf-node-clock"
    actor = ray.remote(ClockSteppedBack).options(name=name, namespace="kvfabric", num_cpus=0.1,
                                                 max_restarts=-1).remote(name, CONFIG)
    try:
        join(fabric.directory, name, timeout_s=T)
        client = FabricClient.connect(timeout_s=10.0)
        first = list(range(95_000, 95_000 + 2 * 16))
        ray.get(actor.put.remote(first, prefix_kv(LAYOUT, first), NS), timeout=T)

        def found(tokens):
            ray.get(actor.flush.remote(), timeout=T)
            return [m.node for m in client.lookup(tokens, NS)] == [name]
        eventually(lambda: found(first))                 # join attached it
        ray.kill(actor, no_restart=False)
        eventually(lambda: client.lookup(first, NS) == [])
        second = list(range(96_000, 96_000 + 2 * 16))
        eventually(lambda: _beat(actor) is not None)
        ray.get(actor.put.remote(second, prefix_kv(LAYOUT, second), NS), timeout=T)
        eventually(lambda: found(second))
    finally:
        ray.kill(actor)
