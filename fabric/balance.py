"""Where lookups land, and which split evens them out.

Whoever sees lookups (an in-process sharded index, or each shard actor)
records them per region (the subtree a route or a first page names), with
hits per child one level down. `plan` picks the hottest region of the
hottest shard and splits it: a lone child is descended into (same shard,
next time one level deeper); several children spread over all shards by
key hash, so children that appear later spread too."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from .routes import RouteTable


@dataclass(frozen=True)
class Split:
    path: tuple[bytes, ...]       # the region root the split went below
    children: tuple[bytes, ...]
    shards: tuple[int, ...]


@dataclass
class LoadTracker:
    shards: int
    lookups: list[int] = field(default_factory=list)
    regions: dict[bytes, tuple[tuple[bytes, ...], Counter]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lookups = self.lookups or [0] * self.shards

    def record(self, keys: Sequence[bytes], shard: int, depth: int) -> None:
        """A lookup of `keys` went to `shard`; its region's root page is at `depth`."""
        self.lookups[shard] += 1
        root = keys[depth]
        region = self.regions.get(root)
        if region is None:
            region = self.regions[root] = (tuple(keys[:depth + 1]), Counter())
        if depth + 1 < len(keys):
            region[1][keys[depth + 1]] += 1

    def merge(self, other: "LoadTracker") -> None:
        self.lookups = [a + b for a, b in zip(self.lookups, other.lookups)]
        for root, (path, hits) in other.regions.items():
            mine = self.regions.setdefault(root, (path, Counter()))
            mine[1].update(hits)

    def max_over_mean(self) -> float:
        mean = sum(self.lookups) / len(self.lookups)
        return max(self.lookups) / mean if mean else 1.0

    def plan(self, routes: RouteTable, target: float) -> tuple[RouteTable, Split] | None:
        """The routes after one split, if lookups are more uneven than `target`."""
        if self.shards == 1 or self.max_over_mean() <= target:
            return None
        hot = max(range(self.shards), key=self.lookups.__getitem__)
        candidates = [(sum(c.values()), root) for root, (path, c) in self.regions.items()
                      if c and routes.locate(path)[0] == hot]
        if not candidates:
            return None
        path, hits = self.regions[max(candidates)[1]]
        if len(hits) == 1:
            (child,) = hits
            return routes.split(path, [child], [hot]), Split(path, (child,), (hot,))
        spread = routes.spread(path, hot)
        return spread, Split(path, tuple(hits), tuple(spread.hashed(c) for c in hits))
