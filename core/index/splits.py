"""Which route change evens out the shards: the planner behind `LoadTracker.plan`.

For each of the busiest regions on the busiest shard it weighs two changes, from the
counts the tracker holds: spreading the region where its hits part (the children of its
branch point hashed over all shards, each taking an equal share: the hits below are
unknown), or moving the whole region to the least busy shard (what a region whose hits
never part, a prompt asked again and again, allows). A change is judged by the counts it
leaves, busiest first, compared in order (the busiest shard's count first, then the next):
the change that leaves the smallest goes ahead, if that is smaller than now and it takes
the busiest shard down by more than chance moves it (a standard deviation). So no shard
ends up busier than the busiest was (a move never makes its target busier than the source
was, and regions do not swing back and forth), and a later change sees to the next
busiest. Nothing here knows a workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .region_hits import RegionHits, Regions
from .routes import RouteTable

CANDIDATES = 16  # regions of the busiest shard weighed, busiest first


@dataclass(frozen=True)
class Split:
    path: tuple[bytes, ...]  # the page the change went below (or the region moved)
    children: tuple[bytes, ...]  # its children the counts knew of (none for a branch point)
    shards: tuple[int, ...]  # and where each went (a move: where the region went)


def plan_split(
    routes: RouteTable, counts: Sequence[int], regions: Regions
) -> tuple[RouteTable, Split] | None:
    """The routes after the best change for `counts` (hits per shard) given where the
    hits lie (`regions`), or None when no change evens them out beyond chance."""
    k = len(counts)
    mean = sum(counts) / k if k else 0
    if k < 2 or not mean:
        return None
    hot = max(range(k), key=counts.__getitem__)
    cool = min((i for i in range(k) if i != hot), key=counts.__getitem__)
    spread_at = {r.key for r in routes.routes if r.spread}
    on_hot = sorted(
        (r for r in regions.values() if r.total and routes.locate(r.path)[0] == hot),
        key=lambda r: r.total,
        reverse=True,
    )[:CANDIDATES]
    now: list[float] = sorted(counts, reverse=True)
    best: tuple[list[float], int, RegionHits, tuple[bytes, ...] | None] | None = None
    for n, region in enumerate(on_hot):
        r = region.total
        if r * (1 - 1 / k) <= math.sqrt(mean):
            break  # this and the rest move less than chance does
        options: list[tuple[list[float], tuple[bytes, ...] | None]] = []
        at = _spread_point(region)
        if at is not None and at[-1] not in spread_at:
            options.append(([c + r / k - (r if i == hot else 0) for i, c in enumerate(counts)], at))
        if r > math.sqrt(mean):
            options.append(
                (
                    [
                        c - r if i == hot else c + r if i == cool else c
                        for i, c in enumerate(counts)
                    ],
                    None,
                )
            )
        for after, where in options:
            ranked = sorted(after, reverse=True)
            if best is None or (ranked, n) < best[:2]:
                best = (ranked, n, region, where)
    if best is not None and best[0] < now:
        _, _, region, at = best
        if at is not None:
            table = routes.spread(at, hot)
            kids = tuple(region.children) if at == region.path else ()
            return table, Split(at, kids, tuple(table.hashed(c) for c in kids))
        return routes.move(region.path, cool), Split(region.path, (), (cool,))
    # Entries counted one level down only: a lone child is descended into (same shard),
    # so that next time the region's children there can spread.
    routed = {r.key for r in routes.routes}
    for region in on_hot:
        child = region.lone_child() if region.common is None else None
        if child is not None and child not in routed:
            return routes.split(region.path, [child], [hot]), Split(region.path, (child,), (hot,))
    return None


def _spread_point(region: RegionHits) -> tuple[bytes, ...] | None:
    """Where spreading the region's children splits its hits: for lookups, where they
    part; for entries (counted one level down), the root, if several children hold them."""
    if region.common is not None:
        return region.branch()
    return region.path if len(region.children) > 1 else None
