"""Injected allocation failures, so tests and chaos runs reach every
reservation point's failure path."""
from __future__ import annotations

import random

from .layout import PoolName, Tier


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

    def should_fail(self, pool: PoolName, tier: Tier) -> bool:
        self.points += 1
        hit = self.points in self._fail_at or (self.rate > 0 and self._rng.random() < self.rate)
        self.injected += hit
        return hit
