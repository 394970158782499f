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

from fabric import (AllocationFaults, CachedKV, CacheStats, EventPublisher, ExportGrant, FetchOutcome, GrantError, KVLayout, LeaseTable,
                    NodeCache, PoolCapacity, PoolName, RouteTable, TierConfig, export_prefix, import_prefix)
from transport import FaultPlan, FaultyTransport, LocalTransport, NixlTransport
from transport.fetch import TransportReader, register_device_pools
from transport.staging import SharedPages, StagedHit, StagingSpec, load_to_staging, save_from_staging

from .chaos_hooks import ChaosAction, EventMangler


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
        self.leases = LeaseTable(self.cache)
        nixl = NixlTransport(name)
        faults = config.faults or (FaultPlan() if config.chaos else None)
        self.transport = nixl if faults is None else FaultyTransport(nixl, faults)
        self.mangle = EventMangler()
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
    def put(self, tokens: Sequence[int], kv: Sequence[torch.Tensor], namespace: str) -> int:
        stored = self.cache.put(tokens, kv, namespace)
        self.publish()
        return stored

    def get(self, tokens: Sequence[int], namespace: str) -> CachedKV:
        """The usable cached prefix, its K/V in host memory: the caller is another
        process, which may not see this node's GPU (no-op on CPU pools)."""
        hit = self.cache.get(tokens, namespace)
        self.publish()      # load-backs and evictions change what the index should know
        hit.layers = [None if t is None else t.cpu() for t in hit.layers]
        return hit

    def match(self, tokens: Sequence[int], namespace: str) -> int:
        return self.cache.match(tokens, namespace).pages

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self.cache.keys(tokens, namespace)

    # --- engines on this host: bytes through shared-memory staging pages ----------------
    def layout(self) -> KVLayout:
        return self.config.layout

    def load_staged(self, spec: StagingSpec, tokens: Sequence[int], namespace: str,
                    skip_pages: int, slots: dict[PoolName, list[int]]) -> StagedHit:
        """Copy the usable cached prefix beyond `skip_pages` into the engine's staging pages."""
        hit = load_to_staging(self.cache, self._staging(spec), tokens, namespace, skip_pages, slots)
        self.publish()
        return hit

    def save_staged(self, spec: StagingSpec, tokens: Sequence[int], namespace: str,
                    slots: dict[PoolName, list[int]], swa_first_page: int) -> int:
        """Store the whole pages of `tokens` that the engine wrote to its staging pages."""
        stored = save_from_staging(self.cache, self._staging(spec), tokens, namespace, slots,
                                   swa_first_page)
        self.publish()
        return stored

    def cache_stats(self) -> CacheStats:
        """The cache's counters (hits by tier among them)."""
        return self.cache.stats()

    def drop_staging(self, spec: StagingSpec) -> None:
        shared = getattr(self, "_shared", {}).pop(spec.prefix, None)
        if shared is not None:
            shared.unlink()

    def _staging(self, spec: StagingSpec) -> SharedPages:
        if not hasattr(self, "_shared"):
            self._shared: dict[str, SharedPages] = {}
        shared = self._shared.get(spec.prefix)
        if shared is None:
            shared = self._shared[spec.prefix] = SharedPages(spec, self.config.layout)
        return shared

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
        self._sent = [(s, r) for s, r in self._sent if r not in done_set]
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
            self.transport.plan = FaultPlan([action.transport])
        if action.alloc_point:
            self.cache.faults.arm(action.alloc_point)
        if action.events is not None:
            self.mangle.arm(action.events)

    def calm(self) -> None:
        """Disarm every injected fault (held-back events go out with the next send)."""
        if self.config.chaos:
            self.transport.plan = FaultPlan()
            self.cache.faults.disarm()
            self.mangle.armed = None

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
