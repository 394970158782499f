"""Who an engine is to the index: a publisher identity of its own, beside its node's.

The index keys holders by name. An engine's device cache is published under
`<node actor>/engine/<slot>`: the node actor's name first, so a router maps a match
back to the replica on that node as it does for the node (`node_actor_of`), and a slot
name the deployer keeps stable across restarts of the engine (the replica's name, or
"0" for one engine per node). Each life of the subscriber claims a new epoch for that
name from the GCS (actors/epochs.py: no clock), so what a restarted engine publishes
replaces what its previous life said; an engine under a new slot name would leave
the old name's entries behind until it stopped cleanly (a clean stop publishes
that the engine holds nothing)."""

from __future__ import annotations

ENGINE_MARK = "/engine/"
MAX_NAME = 256  # the events format's bound on a node name


def engine_index_node(node_actor: str, slot: str) -> str:
    for what, v in (("node_actor", node_actor), ("slot", slot)):
        if not isinstance(v, str) or not v or ENGINE_MARK in v:
            raise ValueError(f"{what} must be a non-empty str without {ENGINE_MARK!r}, got {v!r}")
    name = f"{node_actor}{ENGINE_MARK}{slot}"
    if len(name) > MAX_NAME:
        raise ValueError(f"engine identity {name!r} is longer than {MAX_NAME} characters")
    return name


def node_actor_of(index_node: str) -> str:
    """The node actor of an index holder: itself for a node, its node for an engine."""
    return index_node.split(ENGINE_MARK, 1)[0]


def is_engine(index_node: str) -> bool:
    return ENGINE_MARK in index_node
