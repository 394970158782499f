"""The fabric's directory: config, route table, and which node actors belong.

The directory actor holds its membership passes (actors/membership.py: the member list;
drop the dead, rejoin the restarted, add node actors to new Ray nodes) and its watcher
(actors/watcher.py: runs those passes and rebalances by itself), each with its own state;
its methods of theirs delegate. This module holds the config and the route table,
recovery after a restart, and route changes."""

from __future__ import annotations

import logging
import os
import threading

import ray
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.index.answers import WireMatch
from kvfabric.core.index.balance import LoadTracker, chance_target
from kvfabric.core.index.routes import RouteTable
from ray.exceptions import GetTimeoutError, RayError

from kvfabric._version import __version__

from .membership import START_TIMEOUT_S, Membership, MembershipPasses
from .names import CALL_TIMEOUT_S, DIRECTORY, NAMESPACE, NODE_PREFIX, node_actor_name, shard_name
from .node.node_actor import Beat, NodeConfig
from .node.node_placement import connect_peers, existing, join, place_node_actor
from .replicas import FetchReport, ReplicaDirector
from .watcher import Watcher

__all__ = [
    "CALL_TIMEOUT_S",
    "DIRECTORY",
    "NAMESPACE",
    "NODE_PREFIX",
    "FabricDirectory",
    "Membership",
    "connect_peers",
    "join",
    "node_actor_name",
    "place_node_actor",
    "shard_name",
]

log = logging.getLogger(__name__)


# Threaded (see `start`): the watcher thread and callers' methods run side by side, and
# a node actor that registers while a reconcile waits on it cannot deadlock the directory.
@ray.remote
class FabricDirectory:
    def __init__(
        self,
        config: NodeConfig,
        shards: int,
        cpus_per_actor: float = 0.25,
        watch_s: float = 0.0,
        namespace: str = NAMESPACE,
    ) -> None:
        self.config = config
        self.namespace = namespace  # the fabric's: its node actors' and shards' Ray namespace
        self.routes = RouteTable(shards)
        self._lock = threading.RLock()  # guards routes; never held across a call
        self._rebalancing = threading.Lock()  # one rebalance at a time
        self.membership = MembershipPasses(
            config, namespace, cpus_per_actor, self.get_routes, self._shards, self._converge
        )
        self.watcher = Watcher(
            self.membership, self.rebalance, route_version=lambda: self.routes.version
        )
        self.replicas = (
            ReplicaDirector(config.replication, config.layout.page_size, self._holders, self._copy)
            if config.replication.enabled
            else None
        )
        # Restarted by Ray (the same arguments again): the node actors hold what this
        # actor held, each the latest route table it was given and its own metadata.
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._recover()
            if watch_s > 0:
                self.watch(watch_s)

    def _recover(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == self.namespace and a["name"].startswith(NODE_PREFIX)
        ]
        answers = {}
        for name in names:
            actor = existing(name, self.namespace)
            if actor is not None:
                answers[name] = actor.membership.remote()
        for name, ref in answers.items():
            try:
                meta, routes = ray.get(ref, timeout=timeout_s)
            except (RayError, GetTimeoutError):
                continue  # dead or stuck: the watcher decides later
            self.membership.register(name, meta)
            if routes is not None:
                table = RouteTable.decode(routes)
                if table.version > self.routes.version:
                    self.routes = table
        log.info(
            "directory restarted: recovered %d nodes, routes version %d",
            len(self.membership.node_names()),
            self.routes.version,
        )
        self._converge(timeout_s)

    def _converge(self, timeout_s: float, beats: dict[str, Beat | None] | None = None) -> None:
        """Bring every shard and node onto this directory's route table: after a restart,
        or a rebalance cut short. Shards ahead of it (killed after they took a version
        whose table died with the old process, which a client may hold) make it re-issue
        its table above theirs, so such clients are told to refresh; shards and nodes
        behind it get it. Serialized with rebalances; never moves anyone back."""
        with self._rebalancing:
            if beats is None:
                beats = self.membership.beats(self.node_names(), timeout_s)
            shards = self._shards()
            versions = {}
            for i, shard in enumerate(shards):
                try:
                    versions[i] = ray.get(shard.get_route_version.remote(), timeout=timeout_s)
                except RayError:
                    pass  # restarting: it starts at 0, and hears next pass
            with self._lock:
                if max(versions.values(), default=0) > self.routes.version:
                    self.routes = RouteTable(
                        self.routes.shards, self.routes.routes, max(versions.values()) + 1
                    )
                routes = self.routes.encode()
                version = self.routes.version
            try:
                ray.get(
                    [
                        shards[i].set_route_version.remote(version)
                        for i, v in versions.items()
                        if v < version
                    ],
                    timeout=timeout_s,
                )
            except RayError as e:
                log.warning(
                    "a shard did not take route version %d (next pass retries): %s", version, e
                )
            for name, beat in beats.items():
                if (
                    beat is None or beat.route_version is None or beat.route_version >= version
                ):  # not attached
                    continue
                try:
                    ray.get(
                        ray.get_actor(name, namespace=self.namespace).reroute.remote(routes),
                        timeout=timeout_s,
                    )
                except (RayError, ValueError) as e:
                    log.warning("rerouting %s failed (next pass retries): %s", name, e)

    def version(self) -> str:
        """The kvfabric version this fabric runs (launch.py's ensure refuses another)."""
        return __version__

    def get_config(self) -> NodeConfig:
        return self.config

    def get_namespace(self) -> str:
        return self.namespace

    def incarnation(self) -> int:
        """This actor's process id: it changes when Ray restarts the actor."""
        return os.getpid()

    def get_routes(self) -> bytes:
        with self._lock:
            return self.routes.encode()

    # --- membership (MembershipPasses') -----------------------------------------------------
    def register(self, name: str, metadata: bytes) -> dict[str, bytes]:
        """Add a node; returns the others (name -> metadata) for it to connect to."""
        return self.membership.register(name, metadata)

    def unregister(self, name: str) -> bool:
        return self.membership.unregister(name)

    def node_names(self) -> list[str]:
        return self.membership.node_names()

    def reconcile(
        self,
        add: bool = True,
        timeout_s: float = CALL_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> Membership:
        """One membership pass: drop the dead, rejoin the restarted, with `add` start node
        actors on Ray nodes lacking one (see MembershipPasses.reconcile)."""
        return self.membership.reconcile(add, timeout_s, start_timeout_s)

    def attach(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Admit node `name`'s epoch to every shard, then attach it to the index."""
        self.membership.attach(name, timeout_s)

    def join(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Bring node actor `name` in, in the one join order (see MembershipPasses.join)."""
        self.membership.join(name, timeout_s)

    # --- the watcher (Watcher's) -----------------------------------------------------------
    def watch(self, every_s: float) -> None:
        """Reconcile every `every_s` seconds from now on, in a thread of this actor."""
        self.watcher.watch(every_s)

    def stop_watching(self, wait_s: float = 0.0) -> bool:
        """Stop the watcher once its pass in progress ends, waiting up to `wait_s` for
        that; returns whether it has stopped. `watch` starts it again."""
        return self.watcher.stop_watching(wait_s)

    # --- hot-prefix replication (ReplicaDirector's) ---------------------------------------
    def fetched(self, report: FetchReport) -> int:
        """A node actor's committed on-demand fetch: count it, start the copies it makes
        due; returns how many started (0 with replication off)."""
        if self.replicas is None:
            return 0
        capacity = self.config.capacities[PoolName.FULL].device
        self.replicas.members(self.node_names(), capacity)
        return len(self.replicas.fetched(report))

    def _holders(self, keys: tuple[bytes, ...]) -> list[str]:
        """Nodes whose usable match covers all of `keys`, as the owning shard says (a
        lookup with no depth: it adds no load); none when the shard does not answer."""
        with self._lock:
            shard, version = self.routes.owner(keys), self.routes.version
        try:
            actor = ray.get_actor(shard_name(shard), namespace=self.namespace)
            got: list[WireMatch] | None = ray.get(
                actor.lookup.remote(b"".join(keys), version), timeout=CALL_TIMEOUT_S
            )
        except (RayError, GetTimeoutError, ValueError):
            return []
        return [node for node, pages, _ in got or [] if pages >= len(keys)]

    def _copy(self, target: str, source: str, tokens: list[int], namespace: str, done) -> None:
        """`target` pulls the prefix from `source` through the remote-fetch transaction."""
        try:
            to = ray.get_actor(target, namespace=self.namespace)
            src = ray.get_actor(source, namespace=self.namespace)
        except ValueError:
            done("transfer_failed")
            return

        def finished(f) -> None:
            done("transfer_failed" if f.exception() is not None else f.result())

        to.replicate.remote(src, source, tokens, namespace).future().add_done_callback(finished)

    def _shards(self) -> list:
        return [
            ray.get_actor(shard_name(i), namespace=self.namespace)
            for i in range(self.routes.shards)
        ]

    # --- routes --------------------------------------------------------------------------
    def rebalance(
        self, target: float = 1.25, timeout_s: float = CALL_TIMEOUT_S, sigmas: float = 0.0
    ) -> bool:
        """Split the hottest subtree if shard lookups are uneven (else the largest if
        entries are); nodes then resend snapshots under the new routes. Returns
        whether routes changed. With `sigmas`, lookups must be uneven beyond chance
        (`chance_target`). The watcher calls this every REBALANCE_EVERY_S."""
        with self._rebalancing:
            shards = self._shards()
            current = RouteTable.decode(self.get_routes())
            load = LoadTracker(current.shards)
            for report in ray.get([s.load_report.remote() for s in shards], timeout=timeout_s):
                load.merge(report)
            lookups = chance_target(target, load.lookups, sigmas) or target
            planned = load.plan(
                current,
                lookups,
                target,
                regions_of=lambda i: ray.get(
                    shards[i].entry_regions.remote(current.encode()), timeout=timeout_s
                ),
            )
            if planned is None:
                return False
            # Shards first: no client can hold a table newer than every shard knows, so a
            # restart cut in here re-issues above it (see _recover). Then the table, then nodes.
            ray.get(
                [s.set_route_version.remote(planned[0].version) for s in shards], timeout=timeout_s
            )
            with self._lock:
                self.routes = planned[0]
            routes = planned[0].encode()
            nodes = [ray.get_actor(n, namespace=self.namespace) for n in self.node_names()]
            ray.get([n.reroute.remote(routes) for n in nodes], timeout=timeout_s)
            return True
