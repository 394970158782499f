"""The fabric's directory: config, route table, and which node actors belong.

It keeps membership true without anyone asking: a watcher thread reconciles
every `watch_s` seconds. A node actor Ray reports dead (its name gone, or its Ray node dead)
is dropped from the directory and from every index shard; an alive Ray node
without a node actor gets one, joined to its peers and the index, so a node
added to the cluster (or re-added after a removal) joins the fabric by itself.
A node actor that is merely slow is left alone: only Ray's word counts. One the index
names but the directory does not list (it died while the directory was down) is
purged from the shards; if it is alive after all, it is added again."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import cast

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayError

from kvfabric.fabric import LoadTracker, RouteTable
from kvfabric.fabric.index.balance import chance_target

from .names import (CALL_TIMEOUT_S, DIRECTORY, NAMESPACE, NODE_PREFIX, is_node_actor_name, node_actor_name,
                    owner_node, shard_name)
from .node.node_actor import Beat, NodeConfig
from .node.node_placement import connect_peers, dead_hosts, existing, join, place_node_actor

__all__ = ["CALL_TIMEOUT_S", "DIRECTORY", "NAMESPACE", "NODE_PREFIX", "FabricDirectory", "Membership",
           "connect_peers", "join", "node_actor_name", "place_node_actor", "shard_name"]

START_TIMEOUT_S = 180.0      # a new node actor imports torch and NIXL
REBALANCE_EVERY_S = 10.0     # the watcher's rebalance period
REBALANCE_SIGMAS = 3.0       # its bar for uneven lookups (see kvfabric.fabric.index.balance.chance_target)
log = logging.getLogger(__name__)


@dataclass
class Membership:
    """What one reconcile pass changed."""
    dropped: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    rejoined: list[str] = field(default_factory=list)
    retired_engines: list[str] = field(default_factory=list)


# Threaded (see `start`): the watcher thread and callers' methods run side by side, and
# a node actor that registers while a reconcile waits on it cannot deadlock the directory.
@ray.remote
class FabricDirectory:
    def __init__(self, config: NodeConfig, shards: int, cpus_per_actor: float = 0.25,
                 watch_s: float = 0.0) -> None:
        self.config = config
        self.routes = RouteTable(shards)
        self.nodes: dict[str, bytes] = {}          # node actor name -> NIXL metadata
        self.cpus_per_actor = cpus_per_actor
        self._lock = threading.RLock()             # guards nodes and routes; never held across a call
        self._rebalancing = threading.Lock()       # one rebalance at a time
        self._undropped: set[str] = set()          # dropped nodes some shard has not heard of yet
        self._joining: set[str] = set()            # attached to the index, not yet registered
        self._adding = threading.Lock()            # one pass adding node actors at a time
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # Restarted by Ray (the same arguments again): the node actors hold what this
        # actor held, each the latest route table it was given and its own metadata.
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._recover()
            if watch_s > 0:
                self.watch(watch_s)

    def _recover(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(NODE_PREFIX)]
        answers = {}
        for name in names:
            actor = existing(name)
            if actor is not None:
                answers[name] = actor.membership.remote()
        for name, ref in answers.items():
            try:
                meta, routes = ray.get(ref, timeout=timeout_s)
            except (RayError, GetTimeoutError):
                continue                    # dead or stuck: the watcher decides later
            self.nodes[name] = meta
            if routes is not None:
                table = RouteTable.decode(routes)
                if table.version > self.routes.version:
                    self.routes = table
        log.info("directory restarted: recovered %d nodes, routes version %d", len(self.nodes),
                 self.routes.version)
        self._converge(timeout_s)

    def _converge(self, timeout_s: float, beats: dict | None = None) -> None:
        """Bring every shard and node onto this directory's route table: after a restart,
        or a rebalance cut short. Shards ahead of it (killed after they took a version
        whose table died with the old process, which a client may hold) make it re-issue
        its table above theirs, so such clients are told to refresh; shards and nodes
        behind it get it. Serialized with rebalances; never moves anyone back."""
        with self._rebalancing:
            if beats is None:
                beats = self._beats(self.node_names(), timeout_s)
            shards = self._shards()
            versions = {}
            for i, shard in enumerate(shards):
                try:
                    versions[i] = ray.get(shard.get_route_version.remote(), timeout=timeout_s)
                except RayError:
                    pass                    # restarting: it starts at 0, and hears next pass
            with self._lock:
                if max(versions.values(), default=0) > self.routes.version:
                    self.routes = RouteTable(self.routes.shards, self.routes.routes, max(versions.values()) + 1)
                routes = self.routes.encode()
                version = self.routes.version
            try:
                ray.get([shards[i].set_route_version.remote(version) for i, v in versions.items() if v < version],
                        timeout=timeout_s)
            except RayError as e:
                log.warning("a shard did not take route version %d (next pass retries): %s", version, e)
            for name, beat in beats.items():
                if beat is None or beat.route_version is None or beat.route_version >= version:   # not attached
                    continue
                try:
                    ray.get(ray.get_actor(name, namespace=NAMESPACE).reroute.remote(routes), timeout=timeout_s)
                except (RayError, ValueError) as e:
                    log.warning("rerouting %s failed (next pass retries): %s", name, e)

    def get_config(self) -> NodeConfig:
        return self.config

    def incarnation(self) -> int:
        """This actor's process id: it changes when Ray restarts the actor."""
        return os.getpid()

    def get_routes(self) -> bytes:
        with self._lock:
            return self.routes.encode()

    def register(self, name: str, metadata: bytes) -> dict[str, bytes]:
        """Add a node; returns the others (name -> metadata) for it to connect to."""
        with self._lock:
            others = {n: m for n, m in self.nodes.items() if n != name}
            self.nodes[name] = metadata
            return others

    def unregister(self, name: str) -> bool:
        with self._lock:
            return self.nodes.pop(name, None) is not None

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self.nodes)

    # --- membership ----------------------------------------------------------------------
    def reconcile(self, add: bool = True, timeout_s: float = CALL_TIMEOUT_S,
                  start_timeout_s: float = START_TIMEOUT_S) -> Membership:
        """Heartbeat every node; drop those Ray reports dead, rejoin those Ray
        restarted (a new actor: new transport agent, not attached to the index);
        with `add`, give every alive Ray node lacking a node actor one (a new actor
        imports torch and NIXL: `start_timeout_s`). Waits on other actors without
        `_lock` held."""
        beats = self._beats(self.node_names(), timeout_s)
        dead = sorted(name for name, beat in beats.items() if beat is None)
        restarted = sorted(name for name, beat in beats.items() if beat is not None and not beat.attached)
        done = Membership(dropped=dead)
        for name in dead:
            self._drop(name, timeout_s)
        done.retired_engines = self._retire_engines(beats, timeout_s)
        for name in sorted((self._undropped | self._strays(timeout_s)) - set(dead)):
            self._drop(name, timeout_s)
        for name in restarted:
            if self._rejoin(name, timeout_s):
                done.rejoined.append(name)
        self._converge(timeout_s, beats)
        if add:
            with self._adding:
                done.added = self._add_missing(start_timeout_s)
        return done

    def _retire_engines(self, beats: dict[str, Beat | None], timeout_s: float) -> list[str]:
        """Clear the index entries of engines whose node saw their process end, each life
        by its epoch: admitted from the next epoch on, that life and its late events are
        gone, a later life of the name keeps its own. Then tell the node."""
        retired: list[str] = []
        for name, beat in ((n, b) for n, b in beats.items() if b is not None and b.gone_engines):
            try:
                ray.get([s.admit.remote(engine, epoch + 1) for s in self._shards()
                         for engine, epoch in beat.gone_engines.items()], timeout=timeout_s)
                ray.get_actor(name, namespace=NAMESPACE).engines_retired.remote(beat.gone_engines)
                retired += sorted(beat.gone_engines)
            except (RayError, ValueError) as e:
                log.warning("retiring %s's ended engines failed (next pass retries): %s", name, e)
        return retired

    def _strays(self, timeout_s: float) -> set[str]:
        """Node actors (and their engines) the index names that are neither members nor
        joining: one that died while the directory was down (a restarted directory
        recovers only the nodes that answer) or whose join failed half-way. Holders
        first, then members: a node registers before it stops joining."""
        held: set[str] = set()
        try:
            for names in ray.get([s.holders.remote() for s in self._shards()], timeout=timeout_s):
                held.update(names)
        except RayError as e:
            log.warning("listing the index's holders failed (next pass retries): %s", e)
        with self._lock:
            members = set(self.nodes) | self._joining
        return {n for n in held if (owner := owner_node(n)) is not None and owner not in members}

    def _beats(self, names: list[str], timeout_s: float) -> dict[str, Beat | None]:
        """Each answering node's Beat; None for the dead. Slow or restarting ones are left out."""
        refs: dict[str, ray.ObjectRef] = {}
        beats: dict[str, Beat | None] = {}
        # A node actor dies with its Ray node (hard affinity), whatever state Ray shows
        # the actor in while it notices: a dead host is a dead node, asked or not.
        gone = dead_hosts()
        for name in names:
            if name in gone:
                beats[name] = None
                continue
            try:
                refs[name] = ray.get_actor(name, namespace=NAMESPACE).heartbeat.remote()
            except ValueError:         # the name is gone: the actor died for good
                beats[name] = None
        for name, ref in refs.items():
            try:
                beats[name] = ray.get(ref, timeout=timeout_s)
            except ActorDiedError:
                beats[name] = None
            except (GetTimeoutError, RayError):
                continue               # slow or restarting is not dead
        return beats

    def attach(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Admit node `name`'s epoch to every shard, then attach it to the index: a node
        dropped before (or restarted) is accepted again, and nothing older of it is."""
        actor = ray.get_actor(name, namespace=NAMESPACE)
        epoch = cast(Beat, ray.get(actor.heartbeat.remote(), timeout=timeout_s)).epoch
        shards = self._shards()
        ray.get([s.admit.remote(name, epoch) for s in shards], timeout=timeout_s)
        with self._lock:
            self._undropped.discard(name)
        routes = self.get_routes()
        ray.get(actor.attach_index.remote(shards, routes), timeout=timeout_s)
        if self.get_routes() != routes:      # a split landed in between: catch up
            ray.get(actor.reroute.remote(self.get_routes()), timeout=timeout_s)

    def join(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Bring node actor `name` in, in the one join order: attach it to the index
        first (once registered, a node is taken to be in the index), then register it
        and connect it with its peers both ways."""
        actor = ray.get_actor(name, namespace=NAMESPACE)
        self.attach(name, timeout_s)
        meta = cast(bytes, ray.get(actor.metadata.remote(), timeout=timeout_s))
        connect_peers(name, actor, meta, self.register(name, meta), timeout_s)

    def _rejoin(self, name: str, timeout_s: float) -> bool:
        """Attach a restarted node actor to the index and reconnect it with its peers."""
        try:
            self._forget(name, timeout_s)      # its old process is dead: what it held drops
            self.join(name, timeout_s)
            return True
        except (RayError, ValueError) as e:
            log.warning("rejoining %s failed (next pass retries): %s", name, e)
            return False

    def _forget(self, name: str, timeout_s: float) -> None:
        """Tell every other node that `name`'s process is gone: disconnect it and free
        the pages its abandoned reads held. A node that does not answer is left out (it
        keeps them quarantined and refuses fetches from `name` until the next rejoin)."""
        for peer in self.node_names():
            if peer == name:
                continue
            try:
                ray.get(ray.get_actor(peer, namespace=NAMESPACE).forget_peer.remote(name), timeout=timeout_s)
            except (RayError, ValueError) as e:
                log.warning("telling %s to forget %s failed: %s", peer, name, e)

    def _drop(self, name: str, timeout_s: float) -> None:
        """Purge `name` from the shards, then from the members: once it is no longer
        listed, the index no longer names it (unless a shard did not answer)."""
        try:
            ray.get([s.drop_node.remote(name) for s in self._shards()], timeout=timeout_s)
            with self._lock:
                self._undropped.discard(name)
        except RayError as e:
            # Its late batches could still reach that shard: the next pass drops it again.
            log.warning("dropping %s: a shard did not answer: %s", name, e)
            with self._lock:
                self._undropped.add(name)
        finally:
            self.unregister(name)
        if is_node_actor_name(name):       # an engine is no transport peer
            self._forget(name, timeout_s)

    def _add_missing(self, timeout_s: float) -> list[str]:
        added, known = [], set(self.node_names())
        for node in ray.nodes():
            name = node_actor_name(node["NodeID"])
            if not node["Alive"] or name in known:
                continue
            with self._lock:
                self._joining.add(name)
            try:
                if existing(name) is None:     # else one an earlier pass started but did not finish
                    place_node_actor(node["NodeID"], self.config, self.cpus_per_actor)
                self.join(name, timeout_s)
                added.append(name)
            except (RayError, ValueError) as e:
                log.warning("adding a node actor on %s failed (next pass retries): %s", node["NodeID"], e)
                self.unregister(name)
            finally:
                with self._lock:
                    self._joining.discard(name)
        return added

    def _shards(self) -> list:
        return [ray.get_actor(shard_name(i), namespace=NAMESPACE) for i in range(self.routes.shards)]

    def watch(self, every_s: float) -> None:
        """Reconcile every `every_s` seconds from now on, in a thread of this actor."""
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        if self._watcher is not None and not self._watcher.is_alive():
            self._watcher = None                 # stopped: start again
        if self._watcher is None:
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, args=(every_s,), daemon=True,
                                             name="kvf-membership")
            self._watcher.start()

    def _watch(self, every_s: float) -> None:
        balance_at = time.monotonic() + REBALANCE_EVERY_S
        adding: threading.Thread | None = None
        while not self._stop.wait(every_s):
            try:
                changed = self.reconcile(add=False)
                if changed.dropped or changed.rejoined:
                    log.info("membership: dropped %s, rejoined %s", changed.dropped, changed.rejoined)
            except Exception as e:      # the watcher must outlive any one bad pass
                log.warning("membership pass failed: %s", e)
            # Starting a node actor takes a while (torch, NIXL): drops must not wait for it.
            if adding is None or not adding.is_alive():
                adding = threading.Thread(target=self._add_pass, daemon=True, name="kvf-adding")
                adding.start()
            if time.monotonic() >= balance_at:
                # Also what keeps the shards' load counts short: each pass takes them.
                balance_at = time.monotonic() + REBALANCE_EVERY_S
                try:
                    if self.rebalance(sigmas=REBALANCE_SIGMAS):
                        log.info("rebalanced: routes version %d", self.routes.version)
                except Exception as e:
                    log.warning("rebalance pass failed: %s", e)

    def _add_pass(self) -> None:
        try:
            with self._adding:
                added = self._add_missing(START_TIMEOUT_S)
            if added:
                log.info("membership: added %s", added)
        except Exception as e:          # the next pass tries again
            log.warning("adding node actors failed: %s", e)

    def stop_watching(self, wait_s: float = 0.0) -> bool:
        """Stop the watcher once its pass in progress ends, waiting up to `wait_s` for
        that; returns whether it has stopped. `watch` starts it again."""
        self._stop.set()
        if self._watcher is not None and wait_s > 0:
            self._watcher.join(wait_s)
        return self._watcher is None or not self._watcher.is_alive()

    # --- routes --------------------------------------------------------------------------
    def rebalance(self, target: float = 1.25, timeout_s: float = CALL_TIMEOUT_S, sigmas: float = 0.0) -> bool:
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
            planned = load.plan(current, lookups, target, regions_of=lambda i: ray.get(
                shards[i].entry_regions.remote(current.encode()), timeout=timeout_s))
            if planned is None:
                return False
            # Shards first: no client can hold a table newer than every shard knows, so a
            # restart cut in here re-issues above it (see _recover). Then the table, then nodes.
            ray.get([s.set_route_version.remote(planned[0].version) for s in shards], timeout=timeout_s)
            with self._lock:
                self.routes = planned[0]
            routes = planned[0].encode()
            nodes = [ray.get_actor(n, namespace=NAMESPACE) for n in self.node_names()]
            ray.get([n.reroute.remote(routes) for n in nodes], timeout=timeout_s)
            return True
