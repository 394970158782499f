"""The directory's membership passes: which node actors belong, kept true without anyone
asking (the watcher, actors/watcher.py, runs a pass every `watch_s` seconds).

A node actor Ray reports dead (its name gone, or its Ray node dead) is dropped from the
directory and from every index shard; an alive Ray node without a node actor gets one,
joined to its peers and the index, so a node added to the cluster (or re-added after a
removal) joins the fabric by itself. A node actor that is merely slow is left alone: only
Ray's word counts. One the index names but the directory does not list (it died while the
directory was down) is purged from the shards; if it is alive after all, it is added again.

The directory holds one MembershipPasses, which keeps the member list (node actor name ->
transport metadata) and who is joining; the directory hands it its config and how to
reach its route table and shards."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, cast

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayError

from .names import CALL_TIMEOUT_S, is_node_actor_name, node_actor_name, owner_node
from .node.node_actor import Beat, NodeConfig
from .node.node_placement import (
    FabricUnplaced,
    connect_peers,
    dead_hosts,
    existing,
    place_node_actor,
    wait_started,
)

START_TIMEOUT_S = 180.0  # a new node actor imports torch and NIXL
log = logging.getLogger(__name__)


@dataclass
class Membership:
    """What one reconcile pass changed."""

    dropped: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    rejoined: list[str] = field(default_factory=list)
    retired_engines: list[str] = field(default_factory=list)


# Bring every shard and node onto the directory's route table, given this pass's beats.
Converge = Callable[[float, dict[str, Beat | None]], None]


class MembershipPasses:
    def __init__(
        self,
        config: NodeConfig,
        namespace: str,
        cpus_per_actor: float,
        get_routes: Callable[[], bytes],
        shards: Callable[[], list],
        converge: Converge,
    ) -> None:
        """`config`, `cpus_per_actor`: what a node actor added is started with;
        `get_routes`: the directory's route table, encoded; `shards`: the index shards'
        handles."""
        self.config = config
        self.namespace = namespace  # the fabric's Ray namespace
        self.cpus_per_actor = cpus_per_actor
        self.get_routes = get_routes
        self._shards = shards
        self._converge = converge
        self.nodes: dict[str, bytes] = {}  # node actor name -> NIXL metadata
        self._lock = threading.RLock()  # guards nodes and the two sets; never held across a call
        self._undropped: set[str] = set()  # dropped nodes some shard has not heard of yet
        self._joining: set[str] = set()  # attached to the index, not yet registered
        self._adding = threading.Lock()  # one pass adding node actors at a time

    # --- the member list -----------------------------------------------------------------
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

    # --- passes --------------------------------------------------------------------------

    def reconcile(
        self,
        add: bool = True,
        timeout_s: float = CALL_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> Membership:
        """Heartbeat every node; drop those Ray reports dead, rejoin those Ray
        restarted (a new actor: new transport agent, not attached to the index);
        with `add`, give every alive Ray node lacking a node actor one (a new actor
        imports torch and NIXL: `start_timeout_s`). Waits on other actors without
        `_lock` held."""
        beats = self.beats(self.node_names(), timeout_s)
        dead = sorted(name for name, beat in beats.items() if beat is None)
        restarted = sorted(
            name for name, beat in beats.items() if beat is not None and not beat.attached
        )
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
            done.added = self.add_missing(start_timeout_s)
        return done

    def _retire_engines(self, beats: dict[str, Beat | None], timeout_s: float) -> list[str]:
        """Retire the engines whose node saw their process end, each life by its epoch, in
        every shard: that life's entries, slot and late events are gone, a later life of
        the name keeps its own. Then tell the node."""
        retired: list[str] = []
        for name, beat in ((n, b) for n, b in beats.items() if b is not None and b.gone_engines):
            try:
                ray.get(
                    [
                        s.retire.remote(engine, epoch)
                        for s in self._shards()
                        for engine, epoch in beat.gone_engines.items()
                    ],
                    timeout=timeout_s,
                )
                ray.get_actor(name, namespace=self.namespace).engines_retired.remote(
                    beat.gone_engines
                )
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

    def beats(self, names: list[str], timeout_s: float) -> dict[str, Beat | None]:
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
                refs[name] = ray.get_actor(name, namespace=self.namespace).heartbeat.remote()
            except ValueError:  # the name is gone: the actor died for good
                beats[name] = None
        for name, ref in refs.items():
            try:
                beats[name] = ray.get(ref, timeout=timeout_s)
            except ActorDiedError:
                beats[name] = None
            except (GetTimeoutError, RayError):
                continue  # slow or restarting is not dead
        return beats

    def attach(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Admit node `name`'s epoch to every shard, then attach it to the index: a node
        dropped before (or restarted) is accepted again, and nothing older of it is."""
        actor = ray.get_actor(name, namespace=self.namespace)
        epoch = cast(Beat, ray.get(actor.heartbeat.remote(), timeout=timeout_s)).epoch
        shards = self._shards()
        ray.get([s.admit.remote(name, epoch) for s in shards], timeout=timeout_s)
        with self._lock:
            self._undropped.discard(name)
        routes = self.get_routes()
        ray.get(actor.attach_index.remote(shards, routes), timeout=timeout_s)
        if self.get_routes() != routes:  # a split landed in between: catch up
            ray.get(actor.reroute.remote(self.get_routes()), timeout=timeout_s)

    def join(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Bring node actor `name` in, in the one join order: attach it to the index
        first (once registered, a node is taken to be in the index), then register it
        and connect it with its peers both ways."""
        actor = ray.get_actor(name, namespace=self.namespace)
        self.attach(name, timeout_s)
        meta = cast(bytes, ray.get(actor.metadata.remote(), timeout=timeout_s))
        connect_peers(name, actor, meta, self.register(name, meta), timeout_s, self.namespace)

    def _rejoin(self, name: str, timeout_s: float) -> bool:
        """Attach a restarted node actor to the index and reconnect it with its peers."""
        try:
            self._forget(name, timeout_s)  # its old process is dead: what it held drops
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
                ray.get(
                    ray.get_actor(peer, namespace=self.namespace).forget_peer.remote(name),
                    timeout=timeout_s,
                )
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
        if is_node_actor_name(name):  # an engine is no transport peer
            self._forget(name, timeout_s)

    def add_missing(self, timeout_s: float) -> list[str]:
        """Give every alive Ray node lacking a node actor one, and join it; one such pass
        at a time. Returns the node actors added."""
        with self._adding:
            return self._add_missing(timeout_s)

    def _add_missing(self, timeout_s: float) -> list[str]:
        added, known = [], set(self.node_names())
        for node in ray.nodes():
            name = node_actor_name(node["NodeID"])
            if not node["Alive"] or name in known:
                continue
            with self._lock:
                self._joining.add(name)
            try:
                actor = existing(name, self.namespace)  # one an earlier pass did not finish
                if actor is None:
                    _, actor = place_node_actor(
                        node["NodeID"], self.config, self.cpus_per_actor, self.namespace
                    )
                # One Ray cannot place would time the join out saying nothing of why.
                wait_started({name: actor}, self.cpus_per_actor, timeout_s)
                self.join(name, timeout_s)
                added.append(name)
            except (RayError, ValueError, FabricUnplaced) as e:
                log.warning(
                    "adding a node actor on %s failed (next pass retries): %s", node["NodeID"], e
                )
                self.unregister(name)
            finally:
                with self._lock:
                    self._joining.discard(name)
        return added
