"""Hot-prefix replication live, on a real four-node Ray cluster: two nodes fetch a prefix
from the node that holds it; the directory then has the fourth node pull a copy through the
ordinary remote-fetch transaction, ahead of any request there; with replication off (the
default) nothing is copied."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import ray
from kvfabric.actors.launch import start, stop
from kvfabric.core.index.replication import ReplicationConfig

from tests.actors.fabric_cluster.cluster_kit import CONFIG, LAYOUT, NS
from tests.kvgen import prefix_kv
from tests.ray_cluster import one_cpu_nodes
from tests.waiting import eventually as wait_for

T = 120.0
eventually = partial(wait_for, deadline_s=T, every_s=0.2)


@pytest.fixture(scope="module")
def cluster():
    with one_cpu_nodes(3) as (c, _):
        yield c


def test_a_prefix_two_nodes_fetched_is_copied_to_the_others(cluster):
    config = dataclasses.replace(
        CONFIG, replication=ReplicationConfig(threshold=2, fanout=4, budget_fraction=0.5)
    )
    f = start(config, shards=1, cpus_per_actor=0.25, watch_s=0)
    try:
        names = sorted(f.nodes)
        assert len(names) == 4
        holder, first, second, other = names
        tokens = list(range(3, 3 + 4 * LAYOUT.page_size))
        nodes = f.nodes
        assert (
            ray.get(nodes[holder].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T) == 4
        )
        ray.get(nodes[holder].flush.remote(), timeout=T)
        for reader in (first, second):
            got = ray.get(nodes[reader].fetch.remote(nodes[holder], holder, tokens, NS), timeout=T)
            assert got == "committed"
        # The second report makes the prefix hot: `other` pulls it, nobody asked it to.
        eventually(lambda: ray.get(nodes[other].match.remote(tokens, NS), timeout=T) == 4)
        stats = ray.get(nodes[other].stats.remote(), timeout=T)
        assert stats["fetches"] == {"committed": 1}
        for n in nodes.values():
            ray.get(n.check.remote(), timeout=T)
    finally:
        stop(f)


def test_off_by_default_nothing_is_copied(cluster):
    assert not CONFIG.replication.enabled
    f = start(CONFIG, shards=1, cpus_per_actor=0.25, watch_s=0)
    try:
        holder, first, second, other = sorted(f.nodes)
        tokens = list(range(5, 5 + 4 * LAYOUT.page_size))
        nodes = f.nodes
        ray.get(nodes[holder].put.remote(tokens, prefix_kv(LAYOUT, tokens), NS), timeout=T)
        ray.get(nodes[holder].flush.remote(), timeout=T)
        for reader in (first, second):
            got = ray.get(nodes[reader].fetch.remote(nodes[holder], holder, tokens, NS), timeout=T)
            assert got == "committed"
        assert ray.get(f.directory.fetched.remote(None), timeout=T) == 0
        assert ray.get(nodes[other].match.remote(tokens, NS), timeout=T) == 0
    finally:
        stop(f)
