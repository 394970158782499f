"""How a node actor reaches its peers: connect and forget them, fetch a prefix from one
(ask it to export the prefix under a lease, import it through fabric's fetch transaction
with the read in the import thread, release the lease, late or not), and free the pages
quarantined for a peer once the reads from it that were given up have completed. Every
failure of a fetch becomes a FetchOutcome, never an exception.

The node actor holds one PeerFetch and hands it the cache, the gate, the transport and
its publish; the peers and the fetch counters are the PeerFetch's own."""

from __future__ import annotations

import asyncio
import functools
from typing import Callable, Sequence

import ray
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.exchange.destination import FetchOutcome, import_prefix
from kvfabric.core.exchange.grant import ExportGrant, GrantError
from kvfabric.transport.base import Transport
from kvfabric.transport.fetch import TransportReader

from .cache_gate import CacheGate

# (peer, tokens, namespace, the page keys the peer granted): a committed fetch on demand
Reporter = Callable[[str, Sequence[int], str, tuple[bytes, ...]], None]


class PeerFetch:
    def __init__(
        self,
        cache: NodeCache,
        gate: CacheGate,
        transport: Transport,
        publish: Callable[[], object],
        deadline_s: float,
        report: Reporter | None = None,
    ) -> None:
        """`publish`: sends the index what changed (called under the gate's mutex);
        `deadline_s`: the bound on a peer's export, and on each read from it; `report`:
        told each committed fetch made on demand (hot-prefix replication counts them)."""
        self.cache = cache
        self.gate = gate
        self.transport = transport
        self.publish = publish
        self.deadline_s = deadline_s
        self.report = report
        self.peers: set[str] = set()
        self.fetches: dict[str, int] = {}  # outcomes by FetchOutcome value
        # Replies that came after their fetch gave up, each counted once by what it held:
        self.late_releases = 0  # a grant: its lease released
        self.late_empty = 0  # a grant of no pages (nothing leased, nothing to release)
        self.late_failures = 0  # no grant: the export failed, the peer died, garbled bytes
        self.fetched_bytes = 0  # read from peers over the transport (NIXL)

    async def connect(self, peer: str, metadata: bytes) -> None:
        await self.gate.run_wire(lambda: self.transport.connect(peer, metadata))
        self.peers.add(peer)

    async def _connect_on_demand(self, peer, peer_name: str) -> bool:
        """A peer the directory has listed but not yet connected to this node (its join
        still running, or a connect that failed and was skipped): connect now from its own
        metadata. A dead peer's metadata never comes, and the fetch fails as before."""
        ask = asyncio.wrap_future(peer.metadata.remote().future())
        try:
            metadata = await asyncio.wait_for(ask, timeout=self.deadline_s)
            await self.connect(peer_name, metadata)
        except Exception:  # any failure here is the peer's: the fetch recomputes
            return False
        return True

    async def forget(self, peer: str) -> int:
        """`peer`'s process is gone: disconnect it and free the pages its abandoned reads
        held, since a dead process writes nothing more. Returns the pages freed."""
        self.peers.discard(peer)
        # The import thread runs this after any read in flight, which may quarantine.
        await self.gate.run_wire(lambda: self.transport.disconnect(peer))
        with self.gate.mutex:
            return self.cache.release_quarantine(peer)

    async def fetch(
        self,
        peer: ray.actor.ActorHandle,
        peer_name: str,
        tokens: Sequence[int],
        namespace: str,
        on_demand: bool = True,
    ) -> str:
        """Pull the peer's longer prefix of `tokens`; returns the FetchOutcome's value.
        `on_demand`: False for a replica's copy, which is not reported."""
        granted: list[tuple[bytes, ...]] = []
        outcome = await self._fetch(peer, peer_name, tokens, namespace, granted)
        with self.gate.mutex:
            self.fetches[outcome.value] = self.fetches.get(outcome.value, 0) + 1
            self.publish()
        if outcome is FetchOutcome.COMMITTED and on_demand and self.report and granted:
            self.report(peer_name, tokens, namespace, granted[0])
        return outcome.value

    async def _fetch(
        self,
        peer,
        peer_name: str,
        tokens: Sequence[int],
        namespace: str,
        granted: list[tuple[bytes, ...]],
    ) -> FetchOutcome:
        if peer_name not in self.peers and not await self._connect_on_demand(peer, peer_name):
            return FetchOutcome.TRANSFER_FAILED
        with self.gate.mutex:
            if self.cache.quarantines(peer_name):
                return FetchOutcome.PEER_QUARANTINED  # before a lease is taken for nothing
            keys = self.cache.keys(tokens, namespace)
            skip = self.cache.match(tokens, namespace).present_pages
        deadline = self.deadline_s
        ref = peer.export.remote(keys, skip)
        reply = asyncio.wrap_future(ref.future())
        done, _ = await asyncio.wait({reply}, timeout=deadline)
        if not done:
            # Given up: the grant may still come, and its lease must not wait out its TTL
            # (the callback keeps the ref, and so the reply, alive until then).
            def release(
                late: asyncio.Future, ref: object = ref
            ) -> None:  # holds `ref` until the reply lands
                self._release_late(peer, late)

            reply.add_done_callback(release)
            return FetchOutcome.TRANSFER_FAILED
        if reply.exception() is not None:
            return FetchOutcome.TRANSFER_FAILED  # the peer died or its export failed
        try:
            grant = ExportGrant.decode(reply.result())
        except GrantError:
            return FetchOutcome.BAD_GRANT
        granted.append(grant.keys)
        reader = TransportReader(self.transport, peer_name, deadline)
        try:
            read = self.gate.released(reader)
            return await self.gate.run_import(
                keys[0] if keys else None,
                lambda: self._import(tokens, namespace, grant, read, peer_name),
            )
        finally:
            self.fetched_bytes += reader.bytes_read
            if grant.lease_id:
                peer.release.remote(grant.lease_id)  # if lost, the lease expires

    def _import(
        self, tokens, namespace: str, grant: ExportGrant, read, peer_name: str
    ) -> FetchOutcome:
        """In the import thread, holding the cache mutex (given up while reading)."""
        return import_prefix(self.cache, tokens, namespace, grant, read, peer=peer_name)

    def _release_late(self, peer, late: asyncio.Future) -> None:
        """An export's reply that came after its fetch gave up: release the lease its grant
        holds. Every reply is counted once (late_releases, late_empty, late_failures), so
        a caller waiting on late replies sees each one land."""
        if late.cancelled() or late.exception() is not None:
            self.late_failures += 1
            return
        try:
            lease_id = ExportGrant.decode(late.result()).lease_id
        except GrantError:
            self.late_failures += 1
            return
        if not lease_id:
            self.late_empty += 1
            return
        peer.release.remote(lease_id)
        self.late_releases += 1

    async def probe_quarantine(self) -> list[str]:
        """For each connected peer with quarantined pages, ask the transport whether every
        read from it that was given up has completed since (it polls them): if so, those
        pages change no more and are freed. A peer still stopped keeps them (until it
        resumes or dies). Returns the peers released."""
        with self.gate.mutex:
            peers = sorted(self.cache.quarantined_peers() & self.peers)
        return [p for p in peers if await self.gate.run_wire(functools.partial(self._probe, p))]

    def _probe(self, peer: str) -> bool:
        """In the import thread, where reads run: none from `peer` is being waited on, and
        no new one starts (its quarantine refuses fetches from it) before the release."""
        if not self.transport.drained(peer):
            return False
        with self.gate.mutex:
            self.cache.release_quarantine(peer)
        return True
