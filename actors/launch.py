"""Bring the fabric up on a Ray cluster, find it, and stop it.

`start` places one NodeCacheActor on every alive node (node affinity), the
index shards, and a directory holding the config, the route table and the
node list; all are named and detached in one Ray namespace, so any job or
Serve replica can connect (actors/client.py's FabricClient). `ensure` starts one
unless it runs, once however many processes ask at the same time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import ray
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.routes import RouteTable
from ray.exceptions import GetTimeoutError, RayError

from kvfabric._version import __version__

from .directory import FabricDirectory
from .index_shard import IndexShardActor
from .names import CALL_TIMEOUT_S, DIRECTORY, NAMESPACE, shard_name
from .node.node_actor import NodeConfig
from .node.node_placement import FabricUnplaced, join, place_node_actor, wait_started

STARTER = "kvf-starter"


class FabricMismatch(ValueError):
    """A running fabric caches another KV layout than the one asked for, or runs another
    kvfabric version (whose messages, page layouts and records this one may read
    differently: it is stopped, or the same version run, never joined)."""


def check_version(actor: "ray.actor.ActorHandle", what: str, namespace: str) -> None:
    """Raise FabricMismatch unless `actor` (the fabric's `what`) runs this kvfabric version.
    An actor of a version before this check has no `version` method."""
    try:
        method: Any = actor.version
    except AttributeError:
        theirs = "a version that does not report it"
    else:
        theirs = cast(str, ray.get(method.remote(), timeout=CALL_TIMEOUT_S))
        if theirs == __version__:
            return
    raise FabricMismatch(
        f"the fabric's {what} in namespace {namespace!r} runs kvfabric {theirs:.40}, this "
        f"process {__version__}: stop that fabric (kvfabric down) or run the same version"
    )


@dataclass
class Fabric:
    directory: "ray.actor.ActorHandle"
    nodes: dict[str, "ray.actor.ActorHandle"]
    shards: list["ray.actor.ActorHandle"]
    namespace: str = NAMESPACE


def start(
    config: NodeConfig,
    shards: int = 4,
    cpus_per_actor: float = 0.25,
    timeout_s: float = 180.0,
    watch_s: float = 2.0,
    namespace: str = NAMESPACE,
) -> Fabric:
    """Start the fabric on the connected cluster, in Ray namespace `namespace`: one node
    actor per alive node. `timeout_s` bounds each step (actors import torch and NIXL as
    they start); every `watch_s` seconds the directory reconciles membership (0: never).
    Whole or not at all: a start that fails (FabricUnplaced where Ray could not place an
    actor) stops every actor it started."""
    opts = dict(namespace=namespace, lifetime="detached", num_cpus=cpus_per_actor)
    # The watcher starts after the first nodes have joined, so it does not race them.
    # The directory restarts if killed and rebuilds its state from the node actors.
    # The ignores: @ray.remote made these classes ActorClasses, which mypy does not see.
    directory = FabricDirectory.options(  # type: ignore[attr-defined]
        name=DIRECTORY, max_concurrency=8, max_restarts=-1, **opts
    ).remote(config, shards, cpus_per_actor=cpus_per_actor, watch_s=watch_s, namespace=namespace)
    rule, fingerprint = MatchRule.of(config.layout), config.layout.fingerprint
    # Shard state is soft: a restarted shard starts empty, answers partially, and nodes
    # refill it (their next batch shows a gap; they answer with a snapshot).
    shard_actors = [
        IndexShardActor.options(name=shard_name(i), max_restarts=-1, **opts).remote(  # type: ignore[attr-defined]
            i, shards, rule, fingerprint, namespace
        )
        for i in range(shards)
    ]
    nodes = dict(
        place_node_actor(n["NodeID"], config, cpus_per_actor, namespace)
        for n in ray.nodes()
        if n["Alive"]
    )
    fabric = Fabric(directory, nodes, shard_actors, namespace)
    try:
        shards_by_name = {shard_name(i): a for i, a in enumerate(shard_actors)}
        wait_started({DIRECTORY: directory, **shards_by_name, **nodes}, cpus_per_actor, timeout_s)
        for name in nodes:
            join(directory, name, timeout_s)
        if watch_s > 0:
            ray.get(directory.watch.remote(watch_s), timeout=timeout_s)
    except BaseException:
        _kill([directory, *nodes.values(), *shard_actors])  # not the starter: it may be the caller
        raise
    return fabric


@ray.remote(num_cpus=0)
class _Starter:
    """One per namespace: its calls run one at a time, so processes that ensure the same
    fabric together start it once."""

    def version(self) -> str:
        return __version__

    def ensure(
        self,
        config: NodeConfig,
        shards: int,
        cpus: float,
        timeout_s: float,
        watch_s: float,
        ns: str,
    ) -> bool:
        try:
            directory = ray.get_actor(DIRECTORY, namespace=ns)
        except ValueError:
            start(config, shards, cpus, timeout_s, watch_s, ns)
            return True
        check_version(directory, "directory", ns)
        running = cast(NodeConfig, ray.get(directory.get_config.remote(), timeout=CALL_TIMEOUT_S))
        differences = config.layout.differences(running.layout)
        if differences:
            raise FabricMismatch(
                f"the fabric in namespace {ns!r} caches another KV layout ("
                + "; ".join(differences)
                + ")"
            )
        return False


def ensure(
    config: NodeConfig,
    shards: int = 4,
    cpus_per_actor: float = 0.25,
    timeout_s: float = 180.0,
    watch_s: float = 2.0,
    namespace: str = NAMESPACE,
) -> bool:
    """Start the fabric in `namespace` unless it runs; returns whether this call started
    it. A running fabric of another layout, or of another kvfabric version, is a
    FabricMismatch naming what differs."""
    starter = _Starter.options(  # type: ignore[attr-defined]  # @ray.remote made it an ActorClass
        name=STARTER, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote()
    # A starter left by another version runs that version's code: ask before calling it.
    check_version(starter, "starter", namespace)
    try:
        return cast(
            bool,
            ray.get(
                starter.ensure.remote(
                    config, shards, cpus_per_actor, timeout_s, watch_s, namespace
                ),
                timeout=timeout_s * 3,
            ),
        )
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (FabricMismatch, FabricUnplaced)):
            raise e.cause from None
        raise


def running(namespace: str = NAMESPACE, timeout_s: float = CALL_TIMEOUT_S) -> Fabric | None:
    """The fabric running in `namespace` (one `ensure` started, say), or None."""
    try:
        directory = ray.get_actor(DIRECTORY, namespace=namespace)
        names: list[str] = ray.get(directory.node_names.remote(), timeout=timeout_s)
        routes = RouteTable.decode(ray.get(directory.get_routes.remote(), timeout=timeout_s))
    except (ValueError, RayError, GetTimeoutError):
        return None
    nodes: dict[str, Any] = {}
    shards: list[Any] = []
    for name in names:
        try:
            nodes[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:
            pass  # died meanwhile
    for i in range(routes.shards):
        try:
            shards.append(ray.get_actor(shard_name(i), namespace=namespace))
        except ValueError:
            pass  # restarting: the handle lists the shards that answer now
    return Fabric(directory, nodes, shards, namespace)


def stop(fabric: Fabric, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Stop the watcher, then kill every fabric actor, including nodes it added itself."""
    names: list[str] = []
    try:
        ray.get(fabric.directory.stop_watching.remote(), timeout=timeout_s)
        names = ray.get(fabric.directory.node_names.remote(), timeout=timeout_s)
    except (RayError, GetTimeoutError):
        pass  # the directory is gone already: kill what we hold
    added = []
    for name in set(names) - set(fabric.nodes):
        try:
            added.append(ray.get_actor(name, namespace=fabric.namespace))
        except ValueError:
            pass  # died meanwhile
    try:
        added.append(ray.get_actor(STARTER, namespace=fabric.namespace))
    except ValueError:
        pass  # started without `ensure`
    _kill([fabric.directory, *fabric.nodes.values(), *added, *fabric.shards])


def _kill(actors: list["ray.actor.ActorHandle"]) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except RayError:
            pass  # already gone: stopping is idempotent
