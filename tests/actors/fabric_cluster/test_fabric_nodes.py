"""Node actors on a Ray cluster of four nodes (conftest.py's, shared with
test_fabric_index.py): node actors publish to index shards; a client finds a prefix put
on one node from anywhere, fetches it into another with equal bytes; a killed, restarted,
added or removed node actor leaves or rejoins the index."""

from __future__ import annotations

from functools import partial

import ray
import torch
from kvfabric.actors.client import FabricClient
from kvfabric.core.cache.layout import PoolName

from tests.actors.fabric_cluster.cluster_kit import (
    CONFIG,
    LAYOUT,
    NS,
    T,
    eventually,
    flush,
    heartbeat_of,
    until_available,
)
from tests.kvgen import prefix_kv


def test_index_finds_a_prefix_and_fetch_moves_it(fabric):
    names = sorted(fabric.nodes)
    a, b = names[0], names[1]
    tokens = list(range(50, 50 + 5 * 16))
    assert (
        ray.get(fabric.nodes[a].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T) == 5
    )
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    found = client.lookup(tokens, NS)
    assert [(m.node, m.pages) for m in found] == [(a, 5)]
    assert client.lookup(tokens, "another-tenant") == []  # tenants never see each other
    assert client.fetch(tokens, NS, into=b) == 5
    hit = ray.get(fabric.nodes[b].get.remote(tokens, NS), timeout=T)
    want = prefix_kv(LAYOUT, tokens)
    assert torch.equal(hit.layers[0], want[0]) and torch.equal(
        hit.layers[1], want[1][:, hit.starts[PoolName.SWA] :]
    )
    flush(fabric)
    assert {m.node for m in client.lookup(tokens, NS)} == {a, b}
    ray.get([n.check.remote() for n in fabric.nodes.values()], timeout=T)


def test_a_fetch_from_a_peer_not_yet_connected_connects_it_first(fabric):
    """The directory lists a joining node before its connects with every peer are done
    (and skips a connect that fails): a fetch from such a peer connects on demand."""
    names = sorted(fabric.nodes)
    a, c = names[0], names[2]
    tokens = list(range(70_000, 70_000 + 2 * 16))
    ray.get(fabric.nodes[a].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    ray.get(fabric.nodes[c].forget_peer.remote(a), timeout=T)
    assert FabricClient.connect(timeout_s=10.0).fetch(tokens, NS, into=c) == 2
    ray.get(fabric.nodes[c].check.remote(), timeout=T)


def test_source_killed_mid_fetch_leaves_the_destination_clean(fabric):
    """The abandoned read's pages stay quarantined (no time frees them, and the dead
    source's probe fails) until the directory drops the source and tells every node
    to forget it: then they are freed."""
    import dataclasses
    import time

    from kvfabric.actors.directory import join
    from kvfabric.actors.node.node_actor import NodeCacheActor
    from kvfabric.deploy.chaos.faults import Fault, FaultKind, NodeChaos

    source_name = sorted(fabric.nodes)[0]
    tokens = list(range(300, 300 + 4 * 16))
    ray.get(fabric.nodes[source_name].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    hanging = dataclasses.replace(
        CONFIG, hooks=partial(NodeChaos, script=[Fault(FaultKind.HANG, delay_s=3600.0)])
    )
    dest = NodeCacheActor.options(name="kvf-node-chaos", namespace="kvfabric", num_cpus=0.1).remote(
        "kvf-node-chaos", hanging
    )
    join(fabric.directory, "kvf-node-chaos", timeout_s=T)
    # The drop below happens when the test says (the watcher would race the checks before it).
    assert ray.get(fabric.directory.stop_watching.remote(wait_s=T / 2), timeout=T)
    source = fabric.nodes.pop(source_name)
    pending = dest.fetch.remote(source, source_name, tokens, NS)
    time.sleep(0.5)
    ray.kill(source)  # dies while the read is in flight
    assert ray.get(pending, timeout=T) == "transfer_failed"
    assert ray.get(dest.match.remote(tokens, NS), timeout=T) == 0  # nothing half-inserted
    ray.get(dest.check.remote(), timeout=T)
    assert (
        ray.get(dest.probe_quarantine.remote(), timeout=T) == []
    )  # the dead source answers no probe
    stats = ray.get(dest.stats.remote(), timeout=T)
    assert stats["quarantined"] > 0 and source_name in stats["peers"]
    assert (
        ray.get(dest.fetch.remote(source, source_name, tokens, NS), timeout=T) == "peer_quarantined"
    )
    changed = ray.get(fabric.directory.reconcile.remote(add=False), timeout=T)
    assert source_name in changed.dropped
    stats = ray.get(dest.stats.remote(), timeout=T)
    assert stats["quarantined"] == 0 and stats["pools"]["FULL/DEVICE"]["used"] == 0
    assert source_name not in stats["peers"]  # forgotten: disconnected too
    ray.kill(dest)
    ray.get(fabric.directory.watch.remote(0.5), timeout=T)
    # The directory's watcher drops the dead dest from the directory and the index (and
    # gives the source's Ray node, still alive, a fresh node actor of the same name).
    client = FabricClient.connect(timeout_s=10.0)
    eventually(
        lambda: (
            "kvf-node-chaos" not in ray.get(fabric.directory.node_names.remote(), timeout=T)
            and client.lookup(tokens, NS) == []
        )
    )


def test_a_killed_node_actor_leaves_the_index(fabric):
    names = sorted(fabric.nodes)
    victim = names[2]
    tokens = list(range(700, 700 + 3 * 16))
    ray.get(fabric.nodes[victim].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    flush(fabric)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [victim]
    ray.kill(fabric.nodes.pop(victim))
    client.purge_dead_nodes()  # at once, rather than at the watcher's next pass
    assert client.lookup(tokens, NS) == []
    assert client.fetch(tokens, NS, into=names[0]) == 0  # nothing to fetch: recompute


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
    # The new actor is attached and connected again; what the old one wrote through to
    # disk, it adopted and announced under its new epoch.
    eventually(
        lambda: (beat := heartbeat_of(actor)) is not None and beat.epoch > epoch and beat.attached
    )
    eventually(lambda: [m.node for m in client.lookup(tokens, NS)] == [victim])
    again = list(range(61_000, 61_000 + 2 * 16))
    ray.get(actor.put.remote(again, prefix_kv(LAYOUT, again), NS), timeout=T)
    flush(fabric)
    assert [m.node for m in client.lookup(again, NS)] == [victim]
    assert client.fetch(again, NS, into=other) == 2
    ray.get([fabric.nodes[n].check.remote() for n in (victim, other)], timeout=T)


def test_a_killed_node_actor_adopts_its_disk_pages_and_the_index_finds_them(fabric):
    names = sorted(fabric.nodes)
    victim, other = names[-1], names[0]
    actor = fabric.nodes[victim]
    # 12 prompts of 16 pages: past device and host (64 + 64), the first ones go to disk.
    prompts = [list(range(80_000 + 1000 * i, 80_000 + 1000 * i + 16 * 16)) for i in range(12)]
    for tokens in prompts:
        ray.get(actor.put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    epoch = ray.get(actor.heartbeat.remote(), timeout=T).epoch
    ray.kill(actor, no_restart=False)  # forced, as a crash: no shutdown, nothing flushed
    eventually(
        lambda: (beat := heartbeat_of(actor)) is not None and beat.epoch > epoch and beat.attached
    )
    stats = ray.get(actor.stats.remote(), timeout=T)
    assert stats["adopted_pages"] >= 3 * 16
    assert stats["disk_io"] == "nixl"  # DiskIO.AUTO, where NIXL has its POSIX plugin
    # It measured its disk's read bandwidth again at start (the routers weigh its disk by it).
    assert stats["disk_read_bytes_per_s"] > 0
    assert (
        ray.get(actor.disk_read_bytes_per_s.remote(), timeout=T) == stats["disk_read_bytes_per_s"]
    )
    client = FabricClient.connect(timeout_s=10.0)
    first = prompts[0]
    eventually(lambda: [(m.node, m.pages) for m in client.lookup(first, NS)] == [(victim, 16)])
    # A peer fetches them from the restarted node's disk; the bytes are those put.
    assert client.fetch(first, NS, into=other) == 16
    hit = ray.get(fabric.nodes[other].get.remote(first, NS), timeout=T)
    want = prefix_kv(LAYOUT, first)
    assert torch.equal(hit.layers[0], want[0]) and torch.equal(
        hit.layers[1], want[1][:, hit.starts[PoolName.SWA] :]
    )
    ray.get([fabric.nodes[n].check.remote() for n in (victim, other)], timeout=T)


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
    assert client.fetch(tokens, NS, into=other) == 3  # peers were connected both ways
    cluster.remove_node(added)
    eventually(lambda: name not in ray.get(fabric.directory.node_names.remote(), timeout=T))
    flush(fabric)  # the directory purges the shards before it stops listing the node
    assert [m.node for m in client.lookup(tokens, NS)] == [other]


def test_a_holder_the_directory_does_not_list_is_purged(fabric):
    """A node actor that died while the directory was down (a restarted directory lists
    only nodes that answer) is still named by the shards: the watcher purges such a
    stray. An engine's identity on a listed node is not one."""
    from kvfabric.core.index.events import EventBatch, PageState

    shard = fabric.shards[0]
    until_available(shard)
    stray, engine = "kvf-node-0123456789ab", f"{sorted(fabric.nodes)[0]}/engine/0"
    for name in (stray, engine):
        batch = EventBatch(
            name,
            1,
            0,
            (PageState(b"s" * 16, b"p" * 16, 0, 1),),
            cleared=True,
            fingerprint=LAYOUT.fingerprint,
        )
        assert ray.get(shard.apply.remote(batch.encode()), timeout=T) == "applied"
    eventually(lambda: stray not in ray.get(shard.holders.remote(), timeout=T))
    assert engine in ray.get(shard.holders.remote(), timeout=T)
    ray.get(shard.drop_node.remote(engine), timeout=T)


def test_a_restarted_node_whose_clock_stepped_back_is_still_accepted(fabric):
    """Epochs do not come from the wall clock: a node actor Ray restarts with its clock
    behind the old one's still publishes, and its new pages are found."""
    from kvfabric.actors.directory import join
    from kvfabric.actors.node.node_actor import NodeCacheActor

    class ClockSteppedBack(NodeCacheActor.__ray_metadata__.modified_class):
        def __init__(self, name, config):
            import time as clock  # this actor's own process: its wall clock only

            behind = ray.get_runtime_context().was_current_actor_reconstructed
            now = clock.time_ns() - (3600 * 10**9 if behind else 0)  # an hour back after a restart
            clock.time_ns = lambda: now
            super().__init__(name, config)

    name = "kvf-node-clock"
    actor = (
        ray.remote(ClockSteppedBack)
        .options(name=name, namespace="kvfabric", num_cpus=0.1, max_restarts=-1)
        .remote(name, CONFIG)
    )
    try:
        join(fabric.directory, name, timeout_s=T)
        client = FabricClient.connect(timeout_s=10.0)
        first = list(range(95_000, 95_000 + 2 * 16))
        ray.get(actor.put.remote(first, prefix_kv(LAYOUT, first), NS), timeout=T)

        def found(tokens):
            ray.get(actor.flush.remote(), timeout=T)
            return [m.node for m in client.lookup(tokens, NS)] == [name]

        eventually(lambda: found(first))  # join attached it
        epoch = ray.get(actor.heartbeat.remote(), timeout=T).epoch
        ray.kill(actor, no_restart=False)
        second = list(range(96_000, 96_000 + 2 * 16))
        eventually(lambda: (beat := heartbeat_of(actor)) is not None and beat.epoch > epoch)
        ray.get(actor.put.remote(second, prefix_kv(LAYOUT, second), NS), timeout=T)
        eventually(lambda: found(second))
        eventually(lambda: found(first))  # written through to disk, adopted
    finally:
        ray.kill(actor)


def test_a_node_back_under_a_new_id_adopts_the_disk_pages_it_left(fabric, cluster):
    """A host that rejoins the cluster gets a new Ray node id, so its node actor a new name
    and folder: it claims the folder its earlier node left (an orphan: no live process holds
    its lock), adopts its pages and announces them."""
    import os

    from kvfabric.actors.directory import node_actor_name
    from kvfabric.core.cache.folder_lock import FolderLock

    from tests.actors.fabric_cluster.cluster_kit import DISK_FOLDER

    def listed() -> list[str]:
        return ray.get(fabric.directory.node_names.remote(), timeout=T)

    def joined(node) -> tuple[str, ray.actor.ActorHandle]:
        cluster.wait_for_nodes()
        name = node_actor_name(node.node_id)
        eventually(lambda: name in listed())
        return name, ray.get_actor(name, namespace="kvfabric")

    def unowned(folder: str) -> bool:
        lock = FolderLock.try_take(folder)
        if lock is not None:
            lock.release()
        return lock is not None

    gone = cluster.add_node(num_cpus=1)
    old, actor = joined(gone)
    tokens = list(range(98_000, 98_000 + 3 * 16))
    ray.get(actor.put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
    ray.get(actor.flush.remote(), timeout=T)
    client = FabricClient.connect(timeout_s=10.0)
    assert [m.node for m in client.lookup(tokens, NS)] == [old]
    cluster.remove_node(gone)
    eventually(lambda: old not in listed())
    eventually(lambda: client.lookup(tokens, NS) == [])  # purged with the node
    eventually(lambda: unowned(os.path.join(DISK_FOLDER, old)))  # its process has ended
    back = cluster.add_node(num_cpus=1)
    try:
        new, actor = joined(back)
        assert new != old
        stats = ray.get(actor.stats.remote(), timeout=T)
        assert stats["adopted_from"] == old and stats["adopted_pages"] >= 3
        assert not os.path.exists(os.path.join(DISK_FOLDER, old))  # renamed to the new name
        eventually(lambda: [(m.node, m.pages) for m in client.lookup(tokens, NS)] == [(new, 3)])
        assert client.fetch(tokens, NS, into=sorted(fabric.nodes)[0]) == 3
    finally:
        cluster.remove_node(back)
    eventually(lambda: new not in listed())
