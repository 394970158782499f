"""NodeCacheActor: one per node, owning that node's NodeCache and transport agent.

It answers puts, gets and matches, exports prefixes to peers under leases,
and imports prefixes from peers through fabric's fetch transaction. Two collaborators
do their parts, each with its own state: `peer_fetch` (actors/node/peer_fetch.py) its
peers and fetches, `engines` (actors/node/engine_host.py) the engines on its host; the
actor's methods of theirs delegate. Every failure of a fetch (peer gone, export slow,
transfer fault) becomes a FetchOutcome, never an exception, so a request can always
recompute.

An asyncio actor: no method blocks on another actor, so two nodes fetching from
each other both get served. The cache is touched under `CacheGate` rules."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray
import torch
from kvfabric.actors.epochs import EpochSource, GcsEpochs
from kvfabric.actors.names import NAMESPACE
from kvfabric.core.cache.cached_kv import CachedKV
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import CacheStats, NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig
from kvfabric.core.exchange.source import export_prefix
from kvfabric.core.index.publisher import EventPublisher
from kvfabric.core.index.replication import ReplicationConfig
from kvfabric.core.index.routes import RouteTable
from kvfabric.transport.fetch import register_device_pools
from kvfabric.transport.local import LocalTransport
from kvfabric.transport.nixl_transport import NixlTransport
from kvfabric.transport.staging import StagedHit, StagingSpec

from .cache_gate import CacheGate
from .disk import DiskConfig, open_store, page_file_io, read_bandwidth
from .engine_host import EngineHost
from .engine_process import EngineProcess
from .fetch_reports import FetchReports
from .hooks import NodeHooks
from .index_link import IndexLink, LinkPacer
from .node_metrics import NodeMetrics, NodeSample
from .peer_fetch import PeerFetch


@dataclass(frozen=True)
class NodeConfig:
    layout: KVLayout
    capacities: dict[PoolName, PoolCapacity]
    tier: TierConfig = field(default_factory=TierConfig)
    device: str | None = None  # default: cuda when present, else cpu
    lease_ttl_s: float = 10.0
    fetch_deadline_s: float = 2.0
    # Tests and chaos runs: builds the node's hooks in its process (a class or other
    # picklable callable, as kvfabric.deploy.chaos has); None in production.
    hooks: Callable[[NodeConfig], NodeHooks] | None = None
    epochs: EpochSource = field(default_factory=GcsEpochs)
    # Hot-prefix replication (actors/replicas.py): off unless asked for.
    replication: ReplicationConfig = ReplicationConfig(enabled=False)
    # The disk tier's folder and I/O (capacities' `disk` sizes it); None: no disk tier.
    disk: DiskConfig | None = None


@dataclass(frozen=True)
class Beat:
    """A node's answer to the directory's heartbeat."""

    epoch: int
    attached: bool  # publishing to the index (a restarted actor is not, until rejoined)
    route_version: int | None  # of the route table it publishes under
    # This host's engines whose process ended: index name -> the epoch of that life.
    gone_engines: dict[str, int] = field(default_factory=dict)


@ray.remote
class NodeCacheActor:
    def __init__(self, name: str, config: NodeConfig, fabric: str = NAMESPACE) -> None:
        """`fabric`: the Ray namespace of the fabric this node belongs to (its metrics'
        label; an actor's runtime context names its job's namespace, not its own)."""
        self.name = name
        self.fabric = fabric
        self.config = config
        self.hooks = hooks = None if config.hooks is None else config.hooks(config)
        # A restarted actor finds its earlier life's disk pages here and adopts them; a
        # node new to this host, those of an orphaned folder (a node gone from it).
        self.disk = open_store(name, config.disk, config.layout, config.capacities)
        # Measured once, before any page is read: routers weigh this node's disk hits by it.
        self._disk_read_bytes_per_s = read_bandwidth(self.disk, config.disk)
        if hooks is not None and self.disk is not None:
            hooks.disk(self.disk)
        self.cache = NodeCache(
            config.layout,
            config.capacities,
            tier=config.tier,
            device=config.device,
            copier=LocalTransport(),
            reserve_hook=None if hooks is None else hooks.reserve,
            disk=self.disk,
        )
        self.leases = self.cache.leases  # exports' and requests' leases
        nixl = NixlTransport(name)
        self.transport = nixl if hooks is None else hooks.transport(nixl)
        register_device_pools(self.transport, self.cache)
        self._metadata = self.transport.metadata()  # fixed once the pools are registered
        self.gate = CacheGate()
        self._probing: asyncio.Task | None = None  # the heartbeat's probe of quarantined peers
        self.metrics: NodeMetrics | None = None  # made at the first heartbeat (in Ray)
        # A restarted actor starts a new epoch, above every earlier one of this name:
        # the index drops what the old one said (see actors/epochs.py: no clock).
        self.epoch = config.epochs.claim()
        self.link = IndexLink(
            EventPublisher(self.cache, name, epoch=self.epoch),
            None if hooks is None else hooks.send,
        )
        self.pacer = LinkPacer(self.link, self.gate.mutex)
        self.peer_fetch = PeerFetch(
            self.cache,
            self.gate,
            self.transport,
            self.link.publish,
            config.fetch_deadline_s,
            FetchReports(name, fabric, config.layout.page_size)
            if config.replication.enabled
            else None,
        )
        self.engines = EngineHost(
            name,
            config.layout,
            self.cache,
            self.gate,
            self._family,
            self.link.publish,
            None if hooks is None else hooks.after_get,
        )
        self.engines.adopt_engines()
        # What lives now (torch, Ray, this actor's fixed parts) lives as long as the process:
        # out of the collector's reach, a full collection walks what requests made, not ~170k
        # import-time objects (~100 ms a pass here). The radix tree is never tracked.
        gc.collect()
        gc.freeze()

    # --- identity and peers -----------------------------------------------------------
    def metadata(self) -> bytes:
        return self._metadata

    async def connect(self, peer: str, metadata: bytes) -> None:
        await self.peer_fetch.connect(peer, metadata)

    async def forget_peer(self, peer: str) -> int:
        """`peer`'s process is gone (the directory dropped it, or Ray restarted it):
        disconnect it and free the pages its abandoned reads held, since a dead
        process writes nothing more. Returns the pages freed."""
        return await self.peer_fetch.forget(peer)

    # --- fetching from peers (PeerFetch's) -------------------------------------------------
    async def fetch(
        self, peer: ray.actor.ActorHandle, peer_name: str, tokens: Sequence[int], namespace: str
    ) -> str:
        """Pull the peer's longer prefix of `tokens`; returns the FetchOutcome's value."""
        return await self.peer_fetch.fetch(peer, peer_name, tokens, namespace)

    async def replicate(
        self, peer: ray.actor.ActorHandle, peer_name: str, tokens: Sequence[int], namespace: str
    ) -> str:
        """The directory's copy of a hot prefix (actors/replicas.py): a fetch like any other,
        but not on demand, so not reported back as one."""
        return await self.peer_fetch.fetch(peer, peer_name, tokens, namespace, on_demand=False)

    async def probe_quarantine(self) -> list[str]:
        """Free the pages quarantined for each peer whose given-up reads have all completed
        since; returns the peers released (see PeerFetch.probe_quarantine)."""
        return await self.peer_fetch.probe_quarantine()

    # --- local cache ------------------------------------------------------------------
    async def put(
        self,
        tokens: Sequence[int],
        kv: Sequence[torch.Tensor],
        namespace: str,
        starts: dict[PoolName, int] | None = None,
        release: int = 0,
    ) -> int:
        """Store what `kv` has rows for (see NodeCache.put); `release`: the caller's lease."""
        async with self.gate.family(self._family(tokens, namespace)):
            with self.gate.mutex:
                stored = self.cache.put(tokens, kv, namespace, starts=starts, release=release)
                self.link.publish()
        return stored

    async def get(
        self, tokens: Sequence[int], namespace: str, lease_s: float | None = None
    ) -> CachedKV:
        """The usable cached prefix, its K/V in host memory: the caller is another
        process, which may not see this node's GPU (no-op on CPU pools). With
        `lease_s`, the prefix stays pinned until the caller's put (`hit.lease`)."""
        async with self.gate.family(self._family(tokens, namespace)):
            with self.gate.mutex:
                hit = self.cache.get(tokens, namespace, lease_s)
                if self.hooks is not None:
                    self.hooks.after_get(self.cache)
                self.link.publish()  # load-backs and evictions change what the index should know
                hit.pages = {pool: t.cpu() for pool, t in hit.pages.items()}
        return hit

    def release_lease(self, lease_id: int) -> bool:
        """Release a lease a get gave (a request that failed, or stored nothing)."""
        with self.gate.mutex:
            return self.cache.release_lease(lease_id)

    def match(self, tokens: Sequence[int], namespace: str) -> int:
        with self.gate.mutex:
            return self.cache.match(tokens, namespace).usable_pages

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        with self.gate.mutex:
            return self.cache.keys(tokens, namespace)

    def layout(self) -> KVLayout:
        return self.config.layout

    def cache_stats(self) -> CacheStats:
        """The cache's counters (hits by tier among them)."""
        with self.gate.mutex:
            return self.cache.stats()

    def _family(self, tokens: Sequence[int], namespace: str) -> bytes | None:
        with self.gate.mutex:
            first = self.cache.keys(tokens[: self.config.layout.page_size], namespace)
        return first[0] if first else None

    # --- serving peers -----------------------------------------------------------------
    async def export(self, keys: list[bytes], skip: int) -> bytes:
        async with self.gate.family(keys[0] if keys else None):
            with self.gate.mutex:
                grant = export_prefix(self.cache, self.leases, keys, skip, self.config.lease_ttl_s)
        return grant.encode()

    def release(self, lease_id: int) -> bool:
        with self.gate.mutex:
            return self.leases.release(lease_id)

    # --- events for the global index ---------------------------------------------------
    async def attach_index(self, shards: list, routes: bytes) -> None:
        """Publish to these index shards under this route table (from now on). The
        directory admits this node's epoch to the shards first."""
        with self.gate.mutex:
            self.link.attach(shards, RouteTable.decode(routes))
        self.pacer.start()

    def publish(self, every_shard: bool = False) -> int:
        """Send what changed since the last call (see IndexLink.publish)."""
        with self.gate.mutex:
            return self.link.publish(every_shard)

    async def heartbeat(self) -> Beat:
        """The directory's periodic call: expire overdue leases, and tell every shard
        where this node's sequence is, so a lost batch shows as a gap and heals by a
        snapshot even when nothing else changes. Starts a probe of quarantined peers.
        Names the engines found gone since the last beat, for the directory to drop."""
        with self.gate.mutex:
            self.leases.expire()
            self.link.publish(every_shard=True)
            routes = self.link.routes
            probing = bool(self.cache.quarantined_peers())
            sample = NodeSample(
                dataclasses.replace(self.cache.stats()),
                self.peer_fetch.fetched_bytes,
                *self.engines.staging_use(),
            )
        if self.metrics is None:
            self.metrics = NodeMetrics(self.fabric, self.name)
        self.metrics.publish(sample)
        if probing and (self._probing is None or self._probing.done()):
            self._probing = asyncio.create_task(self.peer_fetch.probe_quarantine())
        gone = self.engines.reap_engines()
        return Beat(
            self.epoch, routes is not None, None if routes is None else routes.version, gone
        )

    def reroute(self, routes: bytes) -> None:
        with self.gate.mutex:
            self.link.reroute(RouteTable.decode(routes))

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every batch sent so far is applied (tests, shutdown)."""
        with self.gate.mutex:
            self.link.publish()
            pending = self.link.pending()
        if pending:
            await asyncio.wait([asyncio.wrap_future(f) for f in pending], timeout=timeout_s)
            with self.gate.mutex:
                self.link.resync_behind()

    def drain_events(self) -> bytes | None:
        """The next encoded event batch (not routed), or None if nothing changed.
        Only for a node with no index attached: it takes the changes publish() would send."""
        if self.link.attached:
            raise RuntimeError("this node publishes to an index; use publish()")
        with self.gate.mutex:
            batch = self.link.publisher.drain()
        return None if batch is None else batch.encode()

    def snapshot(self) -> bytes:
        """Everything held, as of the last drained batch, encoded."""
        with self.gate.mutex:
            return self.link.publisher.snapshot().encode()

    def ping(self) -> str:
        return self.name

    # --- the engines on this host (EngineHost's) ---------------------------------------------
    def adopt_engines(self) -> list[int]:
        """Watch again the engines this node's records name (done at the actor's start);
        returns the pids adopted (see EngineHost.adopt_engines)."""
        return self.engines.adopt_engines()

    def engine_started(self, proc: EngineProcess) -> None:
        """An engine on this host announces itself (see EngineHost.engine_started)."""
        self.engines.engine_started(proc)

    def reap_engines(self) -> dict[str, int]:
        """Drop what the node kept for engines whose process is gone; returns every ended
        engine's index name and epoch not yet retired (see EngineHost.reap_engines)."""
        return self.engines.reap_engines()

    def engines_retired(self, retired: dict[str, int]) -> None:
        """The directory retired these lives in every shard: stop naming them."""
        self.engines.engines_retired(retired)

    def watched_engines(self) -> list[int]:
        return self.engines.watched_engines()

    async def load_staged(
        self,
        spec: StagingSpec,
        tokens: Sequence[int],
        namespace: str,
        skip_pages: int,
        slots: dict[PoolName, list[int]],
    ) -> StagedHit:
        """Copy the usable cached prefix beyond `skip_pages` into the engine's staging pages."""
        return await self.engines.load_staged(spec, tokens, namespace, skip_pages, slots)

    async def save_staged(
        self,
        spec: StagingSpec,
        tokens: Sequence[int],
        namespace: str,
        slots: dict[PoolName, list[int]],
        firsts: dict[PoolName, int],
    ) -> int:
        """Store the whole pages of `tokens` the engine wrote to its staging pages (see
        EngineHost.save_staged)."""
        return await self.engines.save_staged(spec, tokens, namespace, slots, firsts)

    def drop_staging(self, spec: StagingSpec) -> bool:
        """Unmap an engine's staging pages (the engine is shutting down)."""
        return self.engines.drop_staging(spec)

    def engine_report(self, engine: str, counters: dict) -> None:
        """An engine's connector counters so far (see EngineHost.engine_report)."""
        self.engines.engine_report(engine, counters)

    def staging_use(self) -> tuple[int, int]:
        """The engines whose staging pages this node maps, and those pages' bytes."""
        return self.engines.staging_use()

    def engine_reports(self) -> dict[str, dict]:
        return self.engines.engine_reports()

    # --- hooks (tests, chaos) ----------------------------------------------------------------
    def inject(self, action: Any) -> None:
        """Arm `action` in the node's hooks (what it means is theirs: a ChaosAction for
        kvfabric.deploy.chaos's). Only a node started with NodeConfig(hooks=...)."""
        if self.hooks is None:
            raise RuntimeError(
                f"{self.name} has no hooks to inject into: start it with NodeConfig(hooks=...)"
            )
        with self.gate.mutex:
            self.hooks.arm(action)

    def calm(self) -> None:
        """Disarm whatever the hooks hold armed (a node without hooks has nothing armed)."""
        if self.hooks is not None:
            with self.gate.mutex:
                self.hooks.calm()

    def fired(self) -> int:
        """How many armed actions have acted so far (0 without hooks)."""
        with self.gate.mutex:
            return 0 if self.hooks is None else self.hooks.fired()

    def audit(self) -> dict:
        """Page ownership counts and overdue leases, without expiring any first."""
        with self.gate.mutex:
            a = self.cache.audit()
            return {
                "leaked": a.leaked,
                "double_owned": a.double_owned,
                "unallocated": a.unallocated,
                "leases_overdue": self.leases.overdue(),
                "leases": len(self.leases),
            }

    def membership(self) -> tuple[bytes, bytes | None]:
        """(transport metadata, the route table it publishes under): what a restarted
        directory rebuilds itself from."""
        routes = self.link.routes
        return self._metadata, None if routes is None else routes.encode()

    # --- health --------------------------------------------------------------------------
    def check(self) -> None:
        with self.gate.mutex:
            self.leases.expire()
            self.cache.check()

    def stats(self) -> dict:
        with self.gate.mutex:
            self.leases.expire()
            s = self.cache.stats()
            return {
                "name": self.name,
                "nodes": s.nodes,
                "pools": s.pools,
                "leases": len(self.leases),
                "fetches": dict(self.peer_fetch.fetches),
                "quarantined": len(self.cache.quarantined),
                "peers": sorted(self.peer_fetch.peers),
                "late_releases": self.peer_fetch.late_releases,
                "late_empty": self.peer_fetch.late_empty,
                "late_failures": self.peer_fetch.late_failures,
                "epoch": self.epoch,
                "fetched_bytes": self.peer_fetch.fetched_bytes,
                "staging_engines": self.engines.staging_use()[0],
                "adopted_pages": self.cache.adopted.pages,  # from disk, at start
                # The orphan folder whose pages it adopted ("": its own folder, or none).
                "adopted_from": "" if self.disk is None else self.disk.owner.moved_from,
                # Read back from disk not matching their checksums: never served, dropped.
                "disk_corrupt_pages": s.disk_corrupt_pages,
                "disk_read_bytes_per_s": self._disk_read_bytes_per_s,
                # How its page files are read and written ("": no disk tier).
                "disk_io": "" if self.disk is None else page_file_io(self.disk).value,
            }

    def disk_read_bytes_per_s(self) -> float:
        """Its disk's read bandwidth measured at start; 0.0: no disk tier, or not measured."""
        return self._disk_read_bytes_per_s

    async def shutdown(self) -> None:
        self.pacer.stop()
        await self.gate.run_wire(self.transport.close)
        if self.disk is not None:
            with self.gate.mutex:
                self.disk.close()
        self.gate.close()
