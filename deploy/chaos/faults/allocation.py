"""AllocationFaults: a reservation hook (core/cache/txn.py) that fails chosen
reservation points, so tests and chaos runs reach every reservation's failure path."""

from __future__ import annotations

import random

from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.txn import ReservationFailed


class AllocationFaults:
    """Fails chosen reservation points, counted from the last `arm`.

    `arm(k)` fails the k-th reservation point from now (1-based); `rate` fails
    each point with that probability from a seeded generator."""

    def __init__(self, seed: int = 0, rate: float = 0.0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.points = 0
        self.injected = 0
        self._fail_at: set[int] = set()
        self._rng = random.Random(seed)

    def arm(self, *at: int) -> None:
        if any(k < 1 for k in at):
            raise ValueError("reservation points are counted from 1")
        self.points = 0
        self._fail_at = set(at)

    def disarm(self) -> None:
        self._fail_at.clear()
        self.rate = 0.0

    def __call__(self, pool: PoolName, tier: Tier) -> None:
        """The hook: count this reservation point, and fail it if chosen."""
        self.points += 1
        if self.points in self._fail_at or (self.rate > 0 and self._rng.random() < self.rate):
            self.injected += 1
            raise ReservationFailed(f"injected allocation failure: {pool.name}/{tier.name}")
