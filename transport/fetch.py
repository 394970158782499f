"""The transport half of a remote fetch: NodeCache device pools on a
transport, and a page reader with a deadline for fabric's import transaction."""

from __future__ import annotations

import time

from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.exchange.destination import ReadFailed

from .base import PeerNotConnected, TransferError, Transport


def pool_name(pool: PoolName) -> str:
    """Transports name a cache's device pools after the pool."""
    return pool.name.lower()


def register_device_pools(transport: Transport, cache: NodeCache) -> None:
    """Register every device pool of `cache` (peers read device pages only)."""
    for pool, data in cache.device_pools().items():
        if data is None or data.shape[0] == 0:
            raise ValueError(f"pool {pool.name} holds no bytes to register")
        transport.register_pool(pool_name(pool), data)


class TransportReader:
    """A fabric `PageReader` over a connected peer, all reads within one deadline."""

    def __init__(self, transport: Transport, peer: str, deadline_s: float) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        self.transport, self.peer = transport, peer
        self.deadline = time.monotonic() + deadline_s
        self.bytes_read = 0  # of reads that completed

    def __call__(self, pool: PoolName, refs: list[tuple[Tier, int]], pages: list[int]) -> None:
        if any(tier != Tier.DEVICE for tier, _ in refs):
            raise ReadFailed("peers export device pages only")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ReadFailed("fetch deadline passed before the read started")
        try:
            handle = self.transport.read(
                self.peer, {pool_name(pool): ([i for _, i in refs], pages)}
            )
            self.transport.wait(handle, left)
            self.bytes_read += handle.nbytes
        except PeerNotConnected as e:
            raise ReadFailed(str(e)) from e  # raised before anything was posted
        except TransferError as e:
            # Given up, not known finished: NIXL may still land its bytes later (the
            # transport holds it: `drained`). That includes PeerDisconnected: an endpoint
            # error does not prove the peer's process gone.
            raise ReadFailed(str(e), may_still_write=True) from e
        except ValueError as e:  # indices the peer's pools cannot hold: a bad grant
            raise ReadFailed(f"rejected read: {e}") from e
