"""Placing node actors on Ray nodes and connecting them with their peers: what the
directory does to a node, apart from deciding when."""

from __future__ import annotations

import logging
from typing import Any

import ray
from kvfabric.actors.names import CALL_TIMEOUT_S, NAMESPACE, node_actor_name
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .node_actor import NodeCacheActor, NodeConfig

log = logging.getLogger(__name__)


class FabricUnplaced(RuntimeError):
    """Fabric actors Ray did not start in time: most often, no node has the CPU they ask."""


def wait_started(actors: dict[str, Any], cpus: float, timeout_s: float) -> None:
    """Wait up to `timeout_s` for every actor of `actors` (by name) to have started, else
    raise FabricUnplaced naming those that have not, what each asks and what the cluster
    has free: Ray waits for ever to place an actor no node has room for, and a join's call
    to it would time out saying nothing of why. An actor whose start failed raises."""
    refs: dict[str, Any] = {name: a.__ray_ready__.remote() for name, a in actors.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    late = sorted(name for name, ref in refs.items() if ref not in done)
    if not late:
        ray.get(ready, timeout=timeout_s)
        return
    free = ray.available_resources().get("CPU", 0.0)
    total = ray.cluster_resources().get("CPU", 0.0)
    raise FabricUnplaced(
        f"{len(late)} fabric actor(s) not started after {timeout_s:g} s ({', '.join(late[:6])}"
        f"{', ...' if len(late) > 6 else ''}): each asks {cpus:g} CPU, a node actor on its own "
        f"node, and the cluster has {free:g} of {total:g} CPU free. Leave the nodes room for "
        "them, or have them ask less (cpus_per_actor; the connector's node_cpus)"
    )


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
