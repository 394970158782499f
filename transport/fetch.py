"""The transport half of a remote fetch: NodeCache device pools on a
transport, and a page reader with a deadline for fabric's import transaction."""
from __future__ import annotations

import time

from fabric import NodeCache, PoolName, ReadFailed, Tier

from .base import PeerDisconnected, PeerNotConnected, Transport, TransferError


def pool_name(pool: PoolName) -> str:
    """Transports name a cache's device pools after the pool."""
    return pool.name.lower()


def register_device_pools(transport: Transport, cache: NodeCache) -> None:
    """Register every device pool of `cache` (peers read device pages only)."""
    for entry in cache.registry:
        if entry.device.data is None or entry.device.capacity == 0:
            raise ValueError(f"pool {entry.name.name} holds no bytes to register")
        transport.register_pool(pool_name(entry.name), entry.device.data)


class TransportReader:
    """A fabric `PageReader` over a connected peer, all reads within one deadline."""

    def __init__(self, transport: Transport, peer: str, deadline_s: float) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        self.transport, self.peer = transport, peer
        self.deadline = time.monotonic() + deadline_s

    def __call__(self, pool: PoolName, refs: list[tuple[Tier, int]], pages: list[int]) -> None:
        if any(tier != Tier.DEVICE for tier, _ in refs):
            raise ReadFailed("peers export device pages only")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ReadFailed("fetch deadline passed before the read started")
        try:
            handle = self.transport.read(self.peer, {pool_name(pool): ([i for _, i in refs], pages)})
            self.transport.wait(handle, left)
        except (PeerDisconnected, PeerNotConnected) as e:
            raise ReadFailed(str(e)) from e           # a dead peer writes nothing more
        except TransferError as e:
            # Abandoned, not known finished: NIXL may still land its bytes later.
            raise ReadFailed(str(e), may_still_write=True) from e
        except ValueError as e:           # indices the peer's pools cannot hold: a bad grant
            raise ReadFailed(f"rejected read: {e}") from e
