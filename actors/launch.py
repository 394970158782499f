"""Bring the fabric up on a Ray cluster, find it, and use it.

`start` places one NodeCacheActor on every alive node (node affinity), the
index shards, and a directory holding the config, the route table and the
node list; all are named and detached in one Ray namespace, so any job or
Serve replica can `connect`. `ensure` starts one unless it runs, once however
many processes ask at the same time. `FabricClient` is plain Python: lookups
route locally and go to one shard; a fetch pulls the best remote prefix into a
node; every failure degrades to a shorter or empty prefix."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Generator, Sequence, cast

import ray
from kvfabric.fabric import KeyerCache, MatchRule, NodeMatch, RouteTable
from ray.exceptions import GetTimeoutError, RayError

from .directory import (
    CALL_TIMEOUT_S,
    DIRECTORY,
    NAMESPACE,
    FabricDirectory,
    Membership,
    join,
    place_node_actor,
    shard_name,
)
from .index_shard import IndexShardActor
from .node.node_actor import NodeConfig

STARTER = "kvf-starter"


class FabricMismatch(ValueError):
    """A running fabric caches another KV layout than the one asked for."""


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
    they start); every `watch_s` seconds the directory reconciles membership (0: never)."""
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
    ray.get([s.noop.remote() for s in shard_actors], timeout=timeout_s)
    for name in nodes:
        join(directory, name, timeout_s)
    if watch_s > 0:
        ray.get(directory.watch.remote(watch_s), timeout=timeout_s)
    return Fabric(directory, nodes, shard_actors, namespace)


@ray.remote(num_cpus=0)
class _Starter:
    """One per namespace: its calls run one at a time, so processes that ensure the same
    fabric together start it once."""

    def ensure(self, config: NodeConfig, shards: int, cpus: float, watch_s: float, ns: str) -> bool:
        try:
            directory = ray.get_actor(DIRECTORY, namespace=ns)
        except ValueError:
            start(config, shards=shards, cpus_per_actor=cpus, watch_s=watch_s, namespace=ns)
            return True
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
    it. A running fabric of another layout is a FabricMismatch naming what differs."""
    starter = _Starter.options(  # type: ignore[attr-defined]  # @ray.remote made it an ActorClass
        name=STARTER, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote()
    try:
        return cast(
            bool,
            ray.get(
                starter.ensure.remote(config, shards, cpus_per_actor, watch_s, namespace),
                timeout=timeout_s * 3,
            ),
        )
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, FabricMismatch):
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
            pass
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
    for actor in [fabric.directory, *fabric.nodes.values(), *added, *fabric.shards]:
        try:
            ray.kill(actor)
        except RayError:
            pass  # already gone: stopping is idempotent


class FabricClient:
    def __init__(self, directory, timeout_s: float = 2.0, namespace: str = NAMESPACE) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.namespace = namespace
        config: NodeConfig = ray.get(directory.get_config.remote(), timeout=CALL_TIMEOUT_S)
        self.layout = config.layout
        self.routes = RouteTable.decode(
            ray.get(directory.get_routes.remote(), timeout=CALL_TIMEOUT_S)
        )
        self._shards: dict[int, object] = {}
        # Bounded: a router or model server sees every tenant over its life.
        self._keyers = KeyerCache(self.layout.fingerprint, self.layout.page_size)

    @classmethod
    def connect(cls, timeout_s: float = 2.0, namespace: str = NAMESPACE) -> "FabricClient":
        """The client of the fabric in Ray namespace `namespace`."""
        return cls(ray.get_actor(DIRECTORY, namespace=namespace), timeout_s, namespace)

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self._keyers.get(namespace).keys(tokens)

    def lookup(self, tokens: Sequence[int], namespace: str) -> list[NodeMatch]:
        """Each node's usable match for `tokens`, best first; [] if the index cannot answer."""
        steps = self._lookup_steps(tokens, namespace)
        try:
            call = next(steps)
            while True:
                call = steps.send(ray.get(call.ref, timeout=call.timeout_s))
        except StopIteration as done:
            return done.value
        except (RayError, GetTimeoutError, ValueError):
            return []  # a miss costs recomputation, never an error

    async def lookup_async(self, tokens: Sequence[int], namespace: str) -> list[NodeMatch]:
        """`lookup` for an event loop (a request router): awaits instead of blocking."""
        steps = self._lookup_steps(tokens, namespace)
        try:
            call = next(steps)
            while True:
                call = steps.send(await asyncio.wait_for(call.ref, call.timeout_s))
        except StopIteration as done:
            return done.value
        except (RayError, asyncio.TimeoutError, ValueError):
            return []

    def start_lookup(self, tokens: Sequence[int], namespace: str) -> "PendingLookup":
        """`lookup` for a loop that must not wait (an engine's scheduler): poll the
        answer at each step."""
        return PendingLookup(self._lookup_steps(tokens, namespace))

    def _lookup_steps(
        self, tokens: Sequence[int], namespace: str
    ) -> Generator[_Call, Any, list[NodeMatch]]:
        """The lookup, as the calls it waits on (each answer is sent back in): `lookup`
        and `lookup_async` only differ in how they wait. A stale route table is
        refreshed once; any failure (the caller catches it) is a miss."""
        keys = self.keys(tokens, namespace)
        if not keys:
            return []
        for _ in range(2):
            shard, depth = self.routes.locate(keys)
            found = yield _Call(
                self._shard(shard).lookup.remote(b"".join(keys), self.routes.version, depth),
                self.timeout_s,
            )
            if found is not None:
                return _matches(found)
            self.routes = RouteTable.decode(
                (yield _Call(self.directory.get_routes.remote(), CALL_TIMEOUT_S))
            )
        return []

    def fetch(
        self, tokens: Sequence[int], namespace: str, into: str, source: NodeMatch | None = None
    ) -> int:
        """Pull the best remote prefix of `tokens` into node `into` (from `source`, when
        the caller has just looked it up); returns the pages usable there afterwards
        (0 when anything fails)."""
        try:
            target = ray.get_actor(into, namespace=self.namespace)
            best = source
            if best is None:
                local = cast(
                    int, ray.get(target.match.remote(tokens, namespace), timeout=self.timeout_s)
                )
                best = next((m for m in self.lookup(tokens, namespace) if m.node != into), None)
                if best is None or best.pages <= local:
                    return local
            holder = ray.get_actor(best.node, namespace=self.namespace)
            ray.get(
                target.fetch.remote(holder, best.node, tokens, namespace),
                timeout=self.timeout_s * 4,
            )
            return ray.get(target.match.remote(tokens, namespace), timeout=self.timeout_s)
        except (RayError, GetTimeoutError, ValueError):
            return 0

    def purge_dead_nodes(self) -> list[str]:
        """Drop nodes whose actor Ray reports dead, now (the directory's watcher also
        does this every few seconds)."""
        done: Membership = ray.get(
            self.directory.reconcile.remote(add=False), timeout=CALL_TIMEOUT_S * 3
        )
        return done.dropped

    def _shard(self, i: int):
        handle = self._shards.get(i)
        if handle is None:
            handle = self._shards[i] = ray.get_actor(shard_name(i), namespace=self.namespace)
        return handle


class PendingLookup:
    """A lookup in flight. `poll` never waits: None until the index has answered,
    then the matches. A failed call raises (the caller takes it as a miss); the
    caller bounds the whole by its own deadline."""

    def __init__(self, steps: Generator[_Call, Any, list[NodeMatch]]) -> None:
        self._steps = steps
        self._found: list[NodeMatch] | None = None
        self._call: _Call | None = None
        try:
            self._call = next(steps)
        except StopIteration as done:
            self._found = done.value

    @property
    def pending(self) -> "ray.ObjectRef | None":
        """The call it waits on now (None once answered)."""
        return None if self._found is not None or self._call is None else self._call.ref

    def poll(self) -> list[NodeMatch] | None:
        while self._found is None:
            call = self._call
            assert call is not None, "a lookup not answered waits on a call"
            ready, _ = ray.wait([call.ref], timeout=0)
            if not ready:
                return None
            try:
                self._call = self._steps.send(ray.get(call.ref, timeout=0))
            except StopIteration as done:
                self._found = done.value
        return self._found


@dataclass(frozen=True)
class _Call:
    ref: "ray.ObjectRef"
    timeout_s: float


def _matches(found: list[tuple[str, int, bool]]) -> list[NodeMatch]:
    return [NodeMatch(node, pages, device) for node, pages, device in found]
