"""Pins with a time to live: a prefix lock held for a peer's export, or for
a request from its get to its put.

A peer that asked for an export, or a request that matched a prefix, may die
before it says it is done; its lease then expires on its own and the pages
become evictable again."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .locks import PrefixLock


class Unlocks(Protocol):
    """What a lease's end calls: the cache that granted its lock (NodeCache.unlock)."""

    def unlock(self, lock: PrefixLock) -> None: ...


@dataclass
class Lease:
    lease_id: int
    lock: PrefixLock
    expires_at: float


class LeaseTable:
    def __init__(self, cache: Unlocks, clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.clock = clock
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self.expired = 0

    def grant(self, lock: PrefixLock, ttl_s: float) -> Lease:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.expire()
        lease = Lease(next(self._ids), lock, self.clock() + ttl_s)
        self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: int) -> bool:
        """Release a lease; False if it is unknown (already released or expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.cache.unlock(lease.lock)
        return True

    def expire(self) -> int:
        """Release every lease past its time; returns how many."""
        now = self.clock()
        late = [i for i, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in late:
            self.release(lease_id)
        self.expired += len(late)
        return len(late)

    def __len__(self) -> int:
        return len(self._leases)

    def overdue(self) -> int:
        """Leases past their time but not yet released (should be 0 after expire())."""
        now = self.clock()
        return sum(1 for lease in self._leases.values() if lease.expires_at <= now)
