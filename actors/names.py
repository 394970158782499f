"""The fabric's Ray names: its namespace, and the names of its directory, index shards
and node actors (a node actor is named after the Ray node it is pinned to)."""
from __future__ import annotations

NAMESPACE = "kvfabric"
DIRECTORY = "kvf-directory"
CALL_TIMEOUT_S = 10.0        # the bound on a control call to a fabric actor
NODE_PREFIX = "kvf-node-"


def shard_name(i: int) -> str:
    return f"kvf-index-{i}"


def node_actor_name(ray_node_id: str) -> str:
    return f"{NODE_PREFIX}{ray_node_id[:12]}"
