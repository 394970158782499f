"""Node actors fetching from each other at once on a real Ray cluster: three nodes in
a ring, every fetch commits and leaves no lease; a fetch that gives up on a slow
export releases the lease that export took as soon as its reply lands."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import ray
import torch
from kvfabric.actors.epochs import PREFIX, GcsKV
from kvfabric.actors.node.node_actor import NodeConfig
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.pools import PoolCapacity

from tests.kvgen import prefix_kv
from tests.ray_cluster import node_actor_on, one_cpu_nodes
from tests.waiting import eventually as wait_for

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=2, head_dim=16, page_size=16, window=32)
CONFIG = NodeConfig(
    LAYOUT,
    {PoolName.FULL: PoolCapacity(64, 64), PoolName.SWA: PoolCapacity(32, 32)},
    device="cpu",
    fetch_deadline_s=30.0,
)
NS = "tenant"
T = 120.0


@pytest.fixture(scope="module")
def cluster():
    with one_cpu_nodes(3) as (c, nodes):
        yield c, nodes


def start(name: str, node, config: NodeConfig = CONFIG, **options):
    return node_actor_on(node, name, config, cpus=0.25, **options)


def connect_all(actors: dict) -> None:
    meta = {n: ray.get(a.metadata.remote(), timeout=T) for n, a in actors.items()}
    ray.get(
        [a.connect.remote(p, meta[p]) for n, a in actors.items() for p in actors if p != n],
        timeout=T,
    )


eventually = partial(wait_for, deadline_s=T, every_s=0.1)


def stop(actors) -> None:
    for actor in actors:
        try:
            ray.get(actor.shutdown.remote(), timeout=10)
        except ray.exceptions.RayError:
            pass  # already gone
        ray.kill(actor)


def test_three_nodes_fetching_in_a_ring(cluster):
    """Each node holds a distinct prefix and fetches the next one's, all at once: with
    blocking fetches every node waits on a peer that waits on the next (0 pages)."""
    _, nodes = cluster
    names = [f"ring-{i}" for i in range(3)]
    actors = {n: start(n, node) for n, node in zip(names, nodes)}
    try:
        connect_all(actors)
        for r in range(4):
            prompts = [
                list(range(10_000 * (3 * r + i) + 1, 10_000 * (3 * r + i) + 1 + 4 * 16))
                for i in range(3)
            ]
            assert ray.get(
                [actors[n].put.remote(p, prefix_kv(LAYOUT, p), NS) for n, p in zip(names, prompts)],
                timeout=T,
            ) == [4, 4, 4]
            nxt = [(i + 1) % 3 for i in range(3)]
            outcomes = ray.get(
                [
                    actors[names[i]].fetch.remote(actors[names[j]], names[j], prompts[j], NS)
                    for i, j in enumerate(nxt)
                ],
                timeout=T,
            )
            assert outcomes == ["committed"] * 3, (r, outcomes)
            for i, j in enumerate(nxt):
                hit = ray.get(actors[names[i]].get.remote(prompts[j], NS), timeout=T)
                want = prefix_kv(LAYOUT, prompts[j])
                assert hit.tokens == 4 * 16 and torch.equal(hit.layers[0], want[0])
        # Releases are sent without waiting: every lease is gone once they land.
        eventually(
            lambda: all(
                ray.get(a.stats.remote(), timeout=T)["leases"] == 0 for a in actors.values()
            )
        )
        ray.get([a.check.remote() for a in actors.values()], timeout=T)
    finally:
        stop(actors.values())


def test_a_fetch_that_gives_up_releases_the_late_lease(cluster):
    """The export answers after the fetch's deadline: the grant's lease is released when
    the reply lands, not when its TTL (here far beyond the test) runs out."""
    _, nodes = cluster
    hasty = dataclasses.replace(CONFIG, fetch_deadline_s=1e-6, lease_ttl_s=3600.0)
    source, dest = start("late-src", nodes[0], hasty), start("late-dst", nodes[1], hasty)
    try:
        connect_all({"late-src": source, "late-dst": dest})
        tokens = list(range(500, 500 + 3 * 16))
        ray.get(source.put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
        assert (
            ray.get(dest.fetch.remote(source, "late-src", tokens, NS), timeout=T)
            == "transfer_failed"
        )

        # The export may not even have run yet (no lease): wait for the late reply first.
        # A grant is released; an export that failed (as one may under load) or granted
        # no pages leased nothing, and the fetch counts it. Either way the source holds
        # no lease after.
        def late() -> dict:
            stats = ray.get(dest.stats.remote(), timeout=T)
            return {k: stats[k] for k in ("late_releases", "late_empty", "late_failures")}

        eventually(lambda: sum(late().values()) == 1, "the late reply", deadline_s=120.0)
        eventually(
            lambda: ray.get(source.stats.remote(), timeout=T)["leases"] == 0,
            f"the source's lease released after {late()}",
            deadline_s=60.0,
        )
        assert ray.get(dest.match.remote(tokens, NS), timeout=T) == 0
        ray.get([source.check.remote(), dest.check.remote()], timeout=T)
    finally:
        stop([source, dest])


def test_epochs_rise_across_restarts_without_a_clock(cluster):
    """A node actor Ray restarts claims its epoch from the GCS: above the old one. The
    GCS keeps one epoch key however many lives claimed (actors/epochs.py)."""
    _, nodes = cluster
    actor = start("epoch-node", nodes[2], max_restarts=-1)
    try:
        epochs = [ray.get(actor.heartbeat.remote(), timeout=T).epoch]
        for _ in range(2):
            ray.kill(actor, no_restart=False)
            eventually(lambda: _epoch(actor) not in (None, epochs[-1]))
            epochs.append(_epoch(actor))
        assert epochs == sorted(set(epochs))
        [stored] = GcsKV().keys(PREFIX)  # the latest claim of any actor in this cluster
        assert int(stored[len(PREFIX) :]) >= epochs[-1]
    finally:
        ray.kill(actor)


def _epoch(actor):
    try:
        return ray.get(actor.heartbeat.remote(), timeout=T).epoch
    except ray.exceptions.RayActorError:
        return None
