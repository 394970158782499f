"""Placing node actors on Ray nodes and connecting them with their peers: what the
directory does to a node, apart from deciding when."""

from __future__ import annotations

import logging

import ray
from kvfabric.actors.names import CALL_TIMEOUT_S, NAMESPACE, node_actor_name
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .node_actor import NodeCacheActor, NodeConfig

log = logging.getLogger(__name__)


def place_node_actor(ray_node_id: str, config: NodeConfig, cpus: float, namespace: str = NAMESPACE):
    """A detached node actor of the fabric in `namespace`, pinned to one Ray node (hard
    affinity: it dies with the node)."""
    strategy = NodeAffinitySchedulingStrategy(ray_node_id, soft=False)
    name = node_actor_name(ray_node_id)
    # Ray restarts a killed node actor (a new epoch); the directory's watcher rejoins it.
    return name, NodeCacheActor.options(  # type: ignore[attr-defined]  # @ray.remote made it an ActorClass
        name=name,
        namespace=namespace,
        lifetime="detached",
        max_restarts=-1,
        num_cpus=cpus,
        scheduling_strategy=strategy,
    ).remote(name, config, namespace)


def join(directory, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Have the directory bring node actor `name` in (FabricDirectory.join: the one join
    order). Each of its steps is bounded by `timeout_s`; so is the whole, by their count."""
    peers = len(ray.get(directory.node_names.remote(), timeout=timeout_s))
    ray.get(directory.join.remote(name, timeout_s), timeout=timeout_s * (4 + peers))


def connect_peers(
    name: str,
    actor,
    meta: bytes,
    others: dict[str, bytes],
    timeout_s: float,
    namespace: str = NAMESPACE,
) -> None:
    """Connect `name` and each of `others` both ways. A peer that cannot be reached (one
    dying as this runs) is skipped: fetches between that pair fail and recompute."""
    for peer, peer_meta in others.items():
        try:
            ray.get(
                [
                    actor.connect.remote(peer, peer_meta),
                    ray.get_actor(peer, namespace=namespace).connect.remote(name, meta),
                ],
                timeout=timeout_s,
            )
        except (RayError, ValueError) as e:
            log.warning("connecting %s and %s failed: %s", name, peer, e)


def dead_hosts() -> set[str]:
    """Names of node actors whose Ray node Ray reports dead."""
    nodes = ray.nodes()
    alive = {node_actor_name(n["NodeID"]) for n in nodes if n["Alive"]}
    return {node_actor_name(n["NodeID"]) for n in nodes if not n["Alive"]} - alive


def existing(name: str, namespace: str = NAMESPACE):
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
