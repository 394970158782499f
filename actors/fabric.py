"""Bring the fabric up on a Ray cluster, find it, and use it.

`start` places one NodeCacheActor on every alive node (node affinity), the
index shards, and a directory holding the config, the route table and the
node list; all are named and detached in one Ray namespace, so any job or
Serve replica can `connect`. `FabricClient` is plain Python: lookups route
locally and go to one shard; a fetch pulls the best remote prefix into a
node; every failure degrades to a shorter or empty prefix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fabric import LoadTracker, NodeMatch, PageKeyer, PoolName, RouteTable

from .index_shard import IndexShardActor
from .node_actor import NodeCacheActor, NodeConfig

NAMESPACE = "kvfabric"
DIRECTORY = "kvf-directory"
CALL_TIMEOUT_S = 10.0


@ray.remote
class FabricDirectory:
    def __init__(self, config: NodeConfig, shards: int) -> None:
        self.config = config
        self.routes = RouteTable(shards)
        self.nodes: dict[str, bytes] = {}          # node actor name -> NIXL metadata

    def get_config(self) -> NodeConfig:
        return self.config

    def get_routes(self) -> bytes:
        return self.routes.encode()

    def register(self, name: str, metadata: bytes) -> dict[str, bytes]:
        """Add a node; returns the others (name -> metadata) for it to connect to."""
        others = dict(self.nodes)
        self.nodes[name] = metadata
        return others

    def unregister(self, name: str) -> bool:
        return self.nodes.pop(name, None) is not None

    def node_names(self) -> list[str]:
        return sorted(self.nodes)

    def rebalance(self, target: float = 1.25, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Split the hottest subtree if shard lookups are uneven; nodes then resend
        snapshots under the new routes. Returns whether routes changed."""
        shards = [ray.get_actor(shard_name(i), namespace=NAMESPACE) for i in range(self.routes.shards)]
        load = LoadTracker(self.routes.shards)
        for report in ray.get([s.load_report.remote() for s in shards], timeout=timeout_s):
            load.merge(report)
        planned = load.plan(self.routes, target)
        if planned is None:
            return False
        self.routes = planned[0]
        ray.get([s.set_route_version.remote(self.routes.version) for s in shards], timeout=timeout_s)
        nodes = [ray.get_actor(n, namespace=NAMESPACE) for n in self.nodes]
        ray.get([n.reroute.remote(self.routes.encode()) for n in nodes], timeout=timeout_s)
        return True


@dataclass
class Fabric:
    directory: "ray.actor.ActorHandle"
    nodes: dict[str, "ray.actor.ActorHandle"]
    shards: list["ray.actor.ActorHandle"]


def shard_name(i: int) -> str:
    return f"kvf-index-{i}"


def start(config: NodeConfig, shards: int = 4, cpus_per_actor: float = 0.25,
          timeout_s: float = 180.0) -> Fabric:
    """Start the fabric on the connected cluster: one node actor per alive node.
    `timeout_s` bounds each step (actors import torch and NIXL as they start)."""
    opts = dict(namespace=NAMESPACE, lifetime="detached", num_cpus=cpus_per_actor)
    directory = FabricDirectory.options(name=DIRECTORY, **opts).remote(config, shards)
    window = config.layout.window_pages
    has_full = PoolName.FULL in config.layout.pools
    fingerprint = config.layout.fingerprint
    # Shard state is soft: a restarted shard starts empty, answers partially, and nodes
    # refill it (their next batch shows a gap; they answer with a snapshot).
    shard_actors = [IndexShardActor.options(name=shard_name(i), max_restarts=-1, **opts)
                    .remote(i, shards, window, has_full, fingerprint) for i in range(shards)]
    routes = ray.get(directory.get_routes.remote(), timeout=timeout_s)
    nodes = {}
    for node in (n for n in ray.nodes() if n["Alive"]):
        name = f"kvf-node-{node['NodeID'][:12]}"
        strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        nodes[name] = NodeCacheActor.options(name=name, scheduling_strategy=strategy, **opts).remote(name, config)
    ray.get([s.noop.remote() for s in shard_actors], timeout=timeout_s)
    for name, actor in nodes.items():
        join(directory, name, actor, timeout_s)
        ray.get(actor.attach_index.remote(shard_actors, routes), timeout=timeout_s)
    return Fabric(directory, nodes, shard_actors)


def join(directory, name: str, actor, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Register a node and connect it and its peers both ways."""
    meta = ray.get(actor.metadata.remote(), timeout=timeout_s)
    others = ray.get(directory.register.remote(name, meta), timeout=timeout_s)
    calls = [actor.connect.remote(peer, peer_meta) for peer, peer_meta in others.items()]
    calls += [ray.get_actor(peer, namespace=NAMESPACE).connect.remote(name, meta) for peer in others]
    ray.get(calls, timeout=timeout_s)


def stop(fabric: Fabric) -> None:
    for actor in [fabric.directory, *fabric.nodes.values(), *fabric.shards]:
        try:
            ray.kill(actor)
        except RayError:
            pass            # already gone: stopping is idempotent


class FabricClient:
    def __init__(self, directory, timeout_s: float = 2.0) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        config: NodeConfig = ray.get(directory.get_config.remote(), timeout=CALL_TIMEOUT_S)
        self.layout = config.layout
        self.routes = RouteTable.decode(ray.get(directory.get_routes.remote(), timeout=CALL_TIMEOUT_S))
        self._shards: dict[int, object] = {}
        self._keyers: dict[str, PageKeyer] = {}

    @classmethod
    def connect(cls, timeout_s: float = 2.0) -> "FabricClient":
        return cls(ray.get_actor(DIRECTORY, namespace=NAMESPACE), timeout_s)

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        keyer = self._keyers.get(namespace)
        if keyer is None:
            keyer = self._keyers[namespace] = PageKeyer(namespace, self.layout.fingerprint, self.layout.page_size)
        return keyer.keys(tokens)

    def lookup(self, tokens: Sequence[int], namespace: str) -> list[NodeMatch]:
        """Each node's usable match for `tokens`, best first; [] if the index cannot answer."""
        keys = self.keys(tokens, namespace)
        if not keys:
            return []
        for _ in range(2):       # a stale route table is refreshed once
            shard, depth = self.routes.locate(keys)
            try:
                found = ray.get(self._shard(shard).lookup.remote(b"".join(keys), self.routes.version, depth),
                                timeout=self.timeout_s)
            except (RayError, GetTimeoutError):
                return []        # a miss costs recomputation, never an error
            if found is not None:
                return [NodeMatch(node, pages, device) for node, pages, device in found]
            self.routes = RouteTable.decode(ray.get(self.directory.get_routes.remote(), timeout=CALL_TIMEOUT_S))
        return []

    def fetch(self, tokens: Sequence[int], namespace: str, into: str) -> int:
        """Pull the best remote prefix of `tokens` into node `into`; returns the pages
        usable there afterwards (0 when anything fails)."""
        try:
            target = ray.get_actor(into, namespace=NAMESPACE)
            local = ray.get(target.match.remote(tokens, namespace), timeout=self.timeout_s)
            best = next((m for m in self.lookup(tokens, namespace) if m.node != into), None)
            if best is None or best.pages <= local:
                return local
            source = ray.get_actor(best.node, namespace=NAMESPACE)
            ray.get(target.fetch.remote(source, best.node, tokens, namespace), timeout=self.timeout_s * 4)
            return ray.get(target.match.remote(tokens, namespace), timeout=self.timeout_s)
        except (RayError, GetTimeoutError, ValueError):
            return 0

    def purge_dead_nodes(self) -> list[str]:
        """Drop nodes whose actor is gone from the directory and every shard."""
        dead = []
        for name in ray.get(self.directory.node_names.remote(), timeout=CALL_TIMEOUT_S):
            try:
                ray.get(ray.get_actor(name, namespace=NAMESPACE).ping.remote(), timeout=self.timeout_s)
            except (RayError, GetTimeoutError, ValueError):
                dead.append(name)
        for name in dead:
            ray.get(self.directory.unregister.remote(name), timeout=CALL_TIMEOUT_S)
            ray.get([self._shard(i).drop_node.remote(name) for i in range(self.routes.shards)],
                    timeout=CALL_TIMEOUT_S)
        return dead

    def _shard(self, i: int):
        handle = self._shards.get(i)
        if handle is None:
            handle = self._shards[i] = ray.get_actor(shard_name(i), namespace=NAMESPACE)
        return handle
