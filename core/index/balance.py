"""Where lookups land and entries lie, and which split evens them out.

Whoever sees lookups (an in-process sharded index, or each shard actor)
records them per region (the subtree a route or a first page names), with
hits per child one level down, and the key path every lookup of the region
shared (its branch point: where the region's lookups part); a shard adds its
entries per region and child the same way (`kvfabric.core.index.regions`). `plan` picks
the hottest region of the hottest shard, by lookups first, else by entries,
and splits it where its load parts: the children of its branch point spread
over all shards by key hash (so children that appear later spread too). A
region whose lookups never part (one prompt asked again and again) cannot be
split by prefix: the next hottest is. Nothing here is sized to a workload:
a split happens when a shard's share is beyond chance and a goal, and goes
to wherever the hot region's lookups part, however deep.

Lookups are unbounded, so what is counted is bounded: a region keeps exact hit
counts for its most hit children only (`MAX_CHILDREN`, and its total for all),
and a tracker keeps its most hit regions only (`MAX_REGIONS`). A split needs only
the hottest regions and where each parts, which both keep."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Callable, Sequence

from .region_hits import MAX_CHILDREN, MAX_REGIONS, RegionHits, Regions, prune_regions, shared_path
from .routes import RouteTable
from .splits import Split, plan_split

__all__ = [
    "LoadTracker",
    "MAX_CHILDREN",
    "MAX_REGIONS",
    "RegionHits",
    "Regions",
    "Split",
    "chance_target",
    "max_sigmas",
    "prune_regions",
    "shared_path",
]


@dataclass
class LoadTracker:
    shards: int
    lookups: list[int] = field(default_factory=list)
    regions: Regions = field(default_factory=dict)
    entries: list[int] = field(default_factory=list)  # keys held, per shard
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
            region = self.regions[root] = RegionHits(tuple(keys[: depth + 1]))
            if len(self.regions) > 2 * MAX_REGIONS:
                prune_regions(self.regions)
        if depth + 1 < len(keys):
            region.add(keys[depth + 1])
        else:
            region.total += 1  # a lookup of the root page itself
        region.narrow(keys)

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
        if (
            self.shards == 1
            or self.max_over_mean() > target
            or _max_over_mean(self.entries) <= bound
        ):
            return None
        return max(range(self.shards), key=self.entries.__getitem__)

    def entries_max_over_mean(self) -> float:
        return _max_over_mean(self.entries)

    def plan(
        self,
        routes: RouteTable,
        target: float,
        entries_target: float | None = None,
        regions_of: Callable[[int], Regions] | None = None,
    ) -> tuple[RouteTable, Split] | None:
        """The routes after one split, if lookups are more uneven than `target`, or
        else entries more uneven than `entries_target` (default: `target`).

        `regions_of(shard)`: that shard's entries per region, asked of the fullest shard
        only when an entries split is what the plan needs (it costs a pass over its keys).
        The one rebalance decision, in process (ShardedIndex) or over actors (the directory)."""
        if self.shards == 1:
            return None
        entries_target = target if entries_target is None else entries_target
        fullest = self.fullest_if_uneven(target, entries_target)
        if fullest is not None and regions_of is not None:
            self.record_entries(fullest, self.entries[fullest], regions_of(fullest))
        for counts, regions, bound in (
            (self.lookups, self.regions, target),
            (self.entries, self.entry_regions, entries_target),
        ):
            if _max_over_mean(counts) > bound:
                planned = plan_split(routes, counts, regions)
                if planned is not None:
                    return planned
        return None


def chance_target(
    target: float, counts: Sequence[float], sigmas: float | None = None
) -> float | None:
    """The max/mean bar a lookup split must pass to be beyond chance: over a few lookups
    a balanced shard's count still strays about sqrt(mean) from the mean, and a split can
    cost every node a snapshot. So `sigmas` standard deviations above the mean (default
    `max_sigmas`: the most of several shards strays further than one), or `target` if
    higher; None when there were no lookups."""
    mean = sum(counts) / len(counts) if counts else 0
    if not mean:
        return None
    z = max_sigmas(len(counts)) if sigmas is None else sigmas
    return max(target, 1 + z / math.sqrt(mean))


def max_sigmas(shards: int, false_alarm: float = 0.01) -> float:
    """How many standard deviations above the mean the busiest of `shards` evenly loaded
    shards stays below, but for a `false_alarm` share of the times it is asked."""
    return NormalDist().inv_cdf(1 - false_alarm / max(shards, 1))


def _merge(into: Regions, other: Regions) -> None:
    for root, region in other.items():
        mine = into.get(root)
        if mine is None:
            into[root] = RegionHits(region.path, Counter(region.children), region.total)
        else:
            mine.merge(region)
    if len(into) > 2 * MAX_REGIONS:
        prune_regions(into)


def _max_over_mean(counts: list[int]) -> float:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 1.0
