"""How a node actor fetches a prefix from a peer: ask the peer to export it under a
lease, import it through fabric's fetch transaction (the read runs in the import
thread), release the lease, late or not; and free the pages quarantined for a peer once
the reads from it that were given up have completed. Every failure becomes a
FetchOutcome, never an exception.

A mixin of NodeCacheActor: it uses the actor's `config`, `cache`, `gate`, `transport`,
`link`, `peers` and fetch counters.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Sequence

import ray
from kvfabric.fabric import ExportGrant, FetchOutcome, GrantError, import_prefix
from kvfabric.transport.fetch import TransportReader

if TYPE_CHECKING:
    from kvfabric.fabric import EventPublisher, NodeCache
    from kvfabric.transport import Transport

    from .cache_gate import CacheGate
    from .index_link import IndexLink
    from .node_actor import NodeConfig


class PeerFetch:
    """The node actor's fetches from its peers (a mixin). What it uses of the actor:"""

    config: NodeConfig
    cache: NodeCache
    gate: CacheGate
    transport: Transport
    link: IndexLink[EventPublisher]
    peers: set[str]
    fetches: dict[str, int]
    late_releases: int
    late_failures: int
    fetched_bytes: int

    async def fetch(
        self, peer: ray.actor.ActorHandle, peer_name: str, tokens: Sequence[int], namespace: str
    ) -> str:
        """Pull the peer's longer prefix of `tokens`; returns the FetchOutcome's value."""
        outcome = await self._fetch(peer, peer_name, tokens, namespace)
        with self.gate.mutex:
            self.fetches[outcome.value] = self.fetches.get(outcome.value, 0) + 1
            self.link.publish()
        return outcome.value

    async def _fetch(
        self, peer, peer_name: str, tokens: Sequence[int], namespace: str
    ) -> FetchOutcome:
        if peer_name not in self.peers:
            return FetchOutcome.TRANSFER_FAILED
        with self.gate.mutex:
            if self.cache.quarantines(peer_name):
                return FetchOutcome.PEER_QUARANTINED  # before a lease is taken for nothing
            keys = self.cache.keys(tokens, namespace)
            skip = self.cache.match(tokens, namespace).present_pages
        deadline = self.config.fetch_deadline_s
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
        holds. A failure (the export failed, the peer died, a garbled grant) is counted."""
        if late.cancelled() or late.exception() is not None:
            self.late_failures += 1
            return
        try:
            lease_id = ExportGrant.decode(late.result()).lease_id
        except GrantError:
            self.late_failures += 1
            return
        if lease_id:
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
