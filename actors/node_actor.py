"""NodeCacheActor: one per node, owning that node's NodeCache and transport agent.

It answers puts, gets and matches, exports prefixes to peers under leases,
and imports prefixes from peers through fabric's fetch transaction. Every
failure of a fetch (peer gone, export slow, transfer fault) becomes a
FetchOutcome, never an exception, so a request can always recompute."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import time

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from fabric import (AllocationFaults, CachedKV, EventPublisher, ExportGrant, FetchOutcome, GrantError, KVLayout,
                    NodeCache, PoolCapacity, PoolName, RouteTable, Tier, TierConfig, export_prefix,
                    import_prefix)
from transport import FaultPlan, FaultyTransport, LocalTransport, NixlTransport
from transport.fetch import TransportReader, register_device_pools

from .chaos_hooks import ChaosAction, EventMangler


MAX_UNANSWERED = 4096      # event sends a node remembers until their shard answers


@dataclass(frozen=True)
class NodeConfig:
    layout: KVLayout
    capacities: dict[PoolName, PoolCapacity]
    tier: TierConfig = field(default_factory=TierConfig)
    device: str | None = None          # default: cuda when present, else cpu
    lease_ttl_s: float = 10.0
    fetch_deadline_s: float = 2.0
    quarantine_s: float = 30.0
    faults: FaultPlan | None = None    # scripted transport faults from the start (tests)
    chaos: bool = False                # accept injected faults at run time (`inject`)


@ray.remote
class NodeCacheActor:
    def __init__(self, name: str, config: NodeConfig) -> None:
        self.name = name
        self.config = config
        self.cache = NodeCache(config.layout, config.capacities, tier=config.tier, device=config.device,
                               copier=LocalTransport(), faults=AllocationFaults() if config.chaos else None)
        self.leases = self.cache.leases     # exports' leases and requests' holds
        nixl = NixlTransport(name)
        faults = config.faults or (FaultPlan() if config.chaos else None)
        self.transport = nixl if faults is None else FaultyTransport(nixl, faults)
        self.mangle = EventMangler()
        self._evict_after_get = False
        self._evictions_injected = 0
        self._transport_faults_done = 0     # faults of transport plans since replaced
        register_device_pools(self.transport, self.cache)
        self.peers: set[str] = set()
        self.fetches: dict[str, int] = {}
        # A restarted actor starts a new epoch: the index drops what the old one said.
        self.epoch = time.time_ns()
        self.publisher = EventPublisher(self.cache, name, epoch=self.epoch)
        self.shards: list = []
        self.routes: RouteTable | None = None
        self._sent: list[tuple[int, ray.ObjectRef]] = []

    # --- identity and peers -----------------------------------------------------------
    def metadata(self) -> bytes:
        return self.transport.metadata()

    def connect(self, peer: str, metadata: bytes) -> None:
        self.transport.connect(peer, metadata)
        self.peers.add(peer)

    # --- local cache ------------------------------------------------------------------
    def put(self, tokens: Sequence[int], kv: Sequence[torch.Tensor], namespace: str,
            starts: dict[PoolName, int] | None = None, release: int = 0) -> int:
        """Store what `kv` has rows for (see NodeCache.put); `release`: the caller's hold."""
        stored = self.cache.put(tokens, kv, namespace, starts=starts, release=release)
        self.publish()
        return stored

    def get(self, tokens: Sequence[int], namespace: str, hold_s: float | None = None) -> CachedKV:
        """The usable cached prefix, its K/V in host memory: the caller is another
        process, which may not see this node's GPU (no-op on CPU pools). With
        `hold_s`, the prefix stays pinned until the caller's put (`hit.hold`)."""
        hit = self.cache.get(tokens, namespace, hold_s)
        if self._evict_after_get:
            self._evict_all()
        self.publish()      # load-backs and evictions change what the index should know
        hit.layers = [None if t is None else t.cpu() for t in hit.layers]
        return hit

    def release_hold(self, hold_id: int) -> bool:
        """Release a hold a get gave (a request that failed, or stored nothing)."""
        return self.cache.release_hold(hold_id)

    def match(self, tokens: Sequence[int], namespace: str) -> int:
        return self.cache.match(tokens, namespace).pages

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self.cache.keys(tokens, namespace)

    # --- serving peers -----------------------------------------------------------------
    def export(self, keys: list[bytes], skip: int) -> bytes:
        grant = export_prefix(self.cache, self.leases, keys, skip, self.config.lease_ttl_s)
        return grant.encode()

    def release(self, lease_id: int) -> bool:
        return self.leases.release(lease_id)

    # --- fetching from peers --------------------------------------------------------------
    def fetch(self, peer: ray.actor.ActorHandle, peer_name: str, tokens: Sequence[int],
              namespace: str) -> str:
        """Pull the peer's longer prefix of `tokens`; returns the FetchOutcome's value."""
        outcome = self._fetch(peer, peer_name, tokens, namespace)
        self.fetches[outcome.value] = self.fetches.get(outcome.value, 0) + 1
        self.publish()
        return outcome.value

    def _fetch(self, peer, peer_name: str, tokens: Sequence[int], namespace: str) -> FetchOutcome:
        if peer_name not in self.peers:
            return FetchOutcome.TRANSFER_FAILED
        keys = self.cache.keys(tokens, namespace)
        skip = self.cache.match(tokens, namespace).matched
        deadline = self.config.fetch_deadline_s
        try:
            grant = ExportGrant.decode(ray.get(peer.export.remote(keys, skip), timeout=deadline))
        except (RayActorError, GetTimeoutError):
            return FetchOutcome.TRANSFER_FAILED
        except GrantError:
            return FetchOutcome.BAD_GRANT
        try:
            outcome = import_prefix(self.cache, tokens, namespace, grant,
                                    TransportReader(self.transport, peer_name, deadline),
                                    self.config.quarantine_s, peer=peer_name)
        finally:
            if grant.lease_id:
                peer.release.remote(grant.lease_id)   # if lost, the lease expires
        if outcome == FetchOutcome.COMMITTED:
            # A later read from this peer completed: earlier abandoned ones drained.
            self.cache.release_quarantine(peer=peer_name)
        return outcome

    # --- events for the global index ---------------------------------------------------
    def attach_index(self, shards: list, routes: bytes) -> None:
        """Publish to these index shards under this route table (from now on)."""
        self.shards, self.routes = list(shards), RouteTable.decode(routes)
        self.publish()

    def publish(self, every_shard: bool = False) -> int:
        """Send what changed since the last call, one batch per shard (with
        `every_shard`, an empty one to shards with no news); returns batches sent.

        Sends do not wait; a shard that saw a gap (it answers need_snapshot) gets
        this node's snapshot for its part on the next call."""
        if self.routes is None:
            return 0
        self._resync_behind()
        batches = list(self.publisher.drain_routed(self.routes, every_shard).items())
        for shard, batch in self.mangle(batches):
            self._sent.append((shard, self.shards[shard].apply.remote(batch.encode())))
        return len(batches)

    def heartbeat(self) -> tuple[int, bool]:
        """The directory's periodic call: expire overdue leases, and tell every shard
        where this node's sequence is, so a lost batch shows as a gap and heals by a
        snapshot even when nothing else changes. Returns (epoch, whether attached
        to the index): a node Ray restarted is not, until the directory rejoins it."""
        self.leases.expire()
        self.publish(every_shard=True)
        return self.epoch, self.routes is not None

    def _resync_behind(self) -> None:
        if not self._sent:
            return
        refs = [ref for _, ref in self._sent]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        behind = set()
        for shard, ref in self._sent:
            if ref in done_set:
                try:
                    if ray.get(ref, timeout=0) == "need_snapshot":
                        behind.add(shard)
                except ray.exceptions.RayError:
                    behind.add(shard)      # a restarted shard has lost our events
        # Only the latest unanswered sends are kept (a hung shard answers none): a gap an
        # older one would have shown, a later batch to that shard shows too.
        self._sent = [(s, r) for s, r in self._sent if r not in done_set][-MAX_UNANSWERED:]
        if behind:
            snaps = self.publisher.snapshots(self.routes)
            for shard in behind:
                self._sent.append((shard, self.shards[shard].load_snapshot.remote(snaps[shard].encode())))

    def reroute(self, routes: bytes) -> None:
        """New routes: every shard gets this node's snapshot of its part (shard state is soft)."""
        self.routes = RouteTable.decode(routes)
        self.publish()
        for shard, snap in self.publisher.snapshots(self.routes).items():
            self._sent.append((shard, self.shards[shard].load_snapshot.remote(snap.encode())))

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every batch sent so far is applied (tests, shutdown)."""
        self.publish()
        if self._sent:
            ray.wait([r for _, r in self._sent], num_returns=len(self._sent), timeout=timeout_s)
            self._resync_behind()

    def drain_events(self) -> bytes | None:
        """The next encoded event batch (not routed), or None if nothing changed.
        Only for a node with no index attached: it takes the changes publish() would send."""
        if self.routes is not None:
            raise RuntimeError("this node publishes to an index; use publish()")
        batch = self.publisher.drain()
        return None if batch is None else batch.encode()

    def snapshot(self) -> bytes:
        """Everything held, as of the last drained batch, encoded."""
        return self.publisher.snapshot().encode()

    def ping(self) -> str:
        return self.name

    # --- chaos -----------------------------------------------------------------------------
    def inject(self, action: ChaosAction) -> None:
        """Suffer `action` (only a node started with chaos=True)."""
        if not self.config.chaos:
            raise RuntimeError(f"{self.name} was not started with chaos=True")
        if action.transport is not None:
            self._replace_plan(FaultPlan([action.transport]))
        if action.alloc_point:
            self.cache.faults.arm(action.alloc_point)
        if action.events is not None:
            self.mangle.arm(action.events)
        self._evict_after_get = action.evict_after_get

    def _evict_all(self) -> None:
        """Evict every unlocked page: what happens to a request's match when other
        requests and peers' exports crowd the pools between its get and its put."""
        self._evict_after_get = False
        self._evictions_injected += 1
        for pool, capacity in self.config.capacities.items():
            for tier, pages in ((Tier.DEVICE, capacity.device), (Tier.HOST, capacity.host)):
                if pages:
                    self.cache.evict(pool, tier, pages)

    def _replace_plan(self, plan: FaultPlan) -> None:
        self._transport_faults_done += len(self.transport.plan.injected)
        self.transport.plan = plan

    def fired(self) -> int:
        """How many injected faults have acted so far (armed ones count once they hit)."""
        transport = self._transport_faults_done
        if isinstance(self.transport, FaultyTransport):
            transport += len(self.transport.plan.injected)
        allocation = self.cache.faults.injected if self.cache.faults is not None else 0
        return transport + allocation + self.mangle.applied + self._evictions_injected

    def calm(self) -> None:
        """Disarm every injected fault (held-back events go out with the next send)."""
        if self.config.chaos:
            self._replace_plan(FaultPlan())
            self.cache.faults.disarm()
            self.mangle.armed = None
            self._evict_after_get = False

    def audit(self) -> dict:
        """Page ownership counts and overdue leases, without expiring any first."""
        a = self.cache.audit()
        return {"leaked": a.leaked, "double_owned": a.double_owned, "unallocated": a.unallocated,
                "leases_overdue": self.leases.overdue(), "leases": len(self.leases)}

    def membership(self) -> tuple[bytes, bytes | None]:
        """(transport metadata, the route table it publishes under): what a restarted
        directory rebuilds itself from."""
        return self.transport.metadata(), None if self.routes is None else self.routes.encode()

    def release_quarantine(self) -> int:
        """Free quarantined pages whose hold has passed; returns how many."""
        return self.cache.release_quarantine()

    # --- health --------------------------------------------------------------------------
    def check(self) -> None:
        self.leases.expire()
        self.cache.check()

    def stats(self) -> dict:
        self.leases.expire()
        s = self.cache.stats()
        return {"name": self.name, "nodes": s.nodes, "pools": s.pools, "leases": len(self.leases),
                "fetches": dict(self.fetches), "quarantined": len(self.cache.quarantined)}

    def shutdown(self) -> None:
        self.transport.close()
