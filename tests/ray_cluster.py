"""A Ray cluster of one-CPU nodes on this machine, for tests that place actors node by
node, and a node cache actor pinned to one of them. Token auth stays on, with the
session's throw-away token (tests/conftest.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import ray
from kvfabric.actors.node.node_actor import NodeCacheActor, NodeConfig
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@contextlib.contextmanager
def one_cpu_nodes(workers: int) -> Iterator[tuple[Cluster, list[Any]]]:
    """A head and `workers` worker nodes of one CPU each, connected; yields the cluster and
    the workers' nodes (for node affinity), shuts both down after."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(workers)]
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def node_actor_on(node: Any, name: str, config: NodeConfig, cpus: float, **options: Any) -> Any:
    """A node cache actor named `name` on `node` (one of one_cpu_nodes' workers: hard
    affinity, it dies with the node); `options`: more of Ray's actor options."""
    strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    return NodeCacheActor.options(
        name=name, num_cpus=cpus, scheduling_strategy=strategy, **options
    ).remote(name, config)
