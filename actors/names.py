"""The fabric's Ray names: its namespace, and the names of its directory, index shards
and node actors (a node actor is named after the Ray node it is pinned to).

A fabric caches one KV layout. Several can run on one cluster, each in a Ray namespace
of its own: the default one, or the one its layout's fingerprint names
(`layout_namespace`), where engines of that KV identity find or start theirs."""

from __future__ import annotations

NAMESPACE = "kvfabric"
DIRECTORY = "kvf-directory"
CALL_TIMEOUT_S = 10.0  # the bound on a control call to a fabric actor
NODE_PREFIX = "kvf-node-"


def layout_namespace(fingerprint: bytes, base: str = NAMESPACE) -> str:
    """The Ray namespace of the fabric caching the layout with this fingerprint."""
    return f"{base}.{fingerprint.hex()[:16]}"


def shard_name(i: int) -> str:
    return f"kvf-index-{i}"


def node_actor_name(ray_node_id: str) -> str:
    return f"{NODE_PREFIX}{ray_node_id[:12]}"


def is_node_actor_name(name: str) -> bool:
    """Whether `name` is one `node_actor_name` gives (an engine's identity, which starts
    the same and goes on with "/engine/...", is not)."""
    rest = name[len(NODE_PREFIX) :] if name.startswith(NODE_PREFIX) else ""
    return len(rest) == 12 and all(c in "0123456789abcdef" for c in rest)


def owner_node(holder: str) -> str | None:
    """The node actor an index holder belongs to: a node actor itself, or the node of an
    engine published as `<node actor>/...`; None for any other name."""
    node = holder.split("/", 1)[0]
    return node if is_node_actor_name(node) else None
