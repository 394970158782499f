"""A Ray cluster of one-CPU nodes on this machine, for tests that place actors node by
node. Token auth stays on, with the session's throw-away token (tests/conftest.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import ray
from ray.cluster_utils import Cluster


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
