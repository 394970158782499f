"""Where lookups land and entries lie, and which split evens them out.

Whoever sees lookups (an in-process sharded index, or each shard actor)
records them per region (the subtree a route or a first page names), with
hits per child one level down; a shard adds its entries per region and child
the same way (`fabric.regions`). `plan` picks the hottest region of the
hottest shard, by lookups first, else by entries, and splits it: a lone
child is descended into (same shard, next time one level deeper); several
children spread over all shards by key hash, so children that appear later
spread too."""
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


Regions = dict[bytes, tuple[tuple[bytes, ...], Counter]]    # root -> (path, count per child)


@dataclass
class LoadTracker:
    shards: int
    lookups: list[int] = field(default_factory=list)
    regions: Regions = field(default_factory=dict)
    entries: list[int] = field(default_factory=list)           # keys held, per shard
    entry_regions: Regions = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lookups = self.lookups or [0] * self.shards
        self.entries = self.entries or [0] * self.shards

    def record_entries(self, shard: int, held: int, regions: Regions) -> None:
        """What `shard` holds now: `held` keys, per region and child as `regions` says."""
        self.entries[shard] = held
        _merge(self.entry_regions, regions)

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
        self.entries = [a + b for a, b in zip(self.entries, other.entries)]
        _merge(self.regions, other.regions)
        _merge(self.entry_regions, other.entry_regions)

    def max_over_mean(self) -> float:
        return _max_over_mean(self.lookups)

    def fullest_if_uneven(self, target: float, entries_target: float | None = None) -> int | None:
        """The shard whose entries per region a plan needs: the fullest, when lookups
        are even enough and entries are not (regions cost a pass over a shard's keys)."""
        bound = target if entries_target is None else entries_target
        if self.shards == 1 or self.max_over_mean() > target or _max_over_mean(self.entries) <= bound:
            return None
        return max(range(self.shards), key=self.entries.__getitem__)

    def entries_max_over_mean(self) -> float:
        return _max_over_mean(self.entries)

    def plan(self, routes: RouteTable, target: float,
             entries_target: float | None = None) -> tuple[RouteTable, Split] | None:
        """The routes after one split, if lookups are more uneven than `target`, or
        else entries more uneven than `entries_target` (default: `target`)."""
        if self.shards == 1:
            return None
        entries_target = target if entries_target is None else entries_target
        for counts, regions, bound in ((self.lookups, self.regions, target),
                                       (self.entries, self.entry_regions, entries_target)):
            if _max_over_mean(counts) > bound:
                planned = self._split_hottest(routes, counts, regions)
                if planned is not None:
                    return planned
        return None

    def _split_hottest(self, routes: RouteTable, counts: list[int],
                       regions: Regions) -> tuple[RouteTable, Split] | None:
        hot = max(range(self.shards), key=counts.__getitem__)
        candidates = [(sum(c.values()), root) for root, (path, c) in regions.items()
                      if c and routes.locate(path)[0] == hot]
        if not candidates:
            return None
        path, hits = regions[max(candidates)[1]]
        if len(hits) == 1:
            (child,) = hits
            return routes.split(path, [child], [hot]), Split(path, (child,), (hot,))
        spread = routes.spread(path, hot)
        return spread, Split(path, tuple(hits), tuple(spread.hashed(c) for c in hits))


def _merge(into: Regions, other: Regions) -> None:
    for root, (path, counts) in other.items():
        into.setdefault(root, (path, Counter()))[1].update(counts)


def _max_over_mean(counts: list[int]) -> float:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 1.0
