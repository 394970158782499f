"""Hits per region (the subtree a route or a first page names), bounded: what a load
tracker (balance.py) and a shard's entry count (regions.py) record, and what the split
planner (splits.py) weighs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

MAX_REGIONS = 256  # regions a tracker keeps (it prunes to these at twice as many)
MAX_CHILDREN = 16  # children a region counts one by one (likewise)


@dataclass
class RegionHits:
    """Hits (lookups, or entries held) in one region: per child one level below its
    root, for the most hit children, and in all. For lookups, also the key path all
    of them shared (`common`) and the longest one's length."""

    path: tuple[bytes, ...]  # the region root's key path from depth 0
    children: Counter = field(default_factory=Counter)
    total: int = 0  # every hit in the region, counted child or not
    common: tuple[bytes, ...] | None = None  # None: no lookup recorded (or entries)
    longest: int = 0

    def add(self, child: bytes, n: int = 1) -> None:
        self.children[child] += n
        self.total += n
        if len(self.children) > 2 * MAX_CHILDREN:
            self.prune()

    def narrow(self, keys: Sequence[bytes]) -> None:
        """Shorten `common` to what `keys` shares with it."""
        self.longest = max(self.longest, len(keys))
        self.common = tuple(keys) if self.common is None else shared_path(self.common, keys)

    def merge(self, other: "RegionHits") -> None:
        self.children.update(other.children)
        self.total += other.total
        if other.common is not None:
            self.common = (
                other.common if self.common is None else shared_path(self.common, other.common)
            )
        self.longest = max(self.longest, other.longest)
        if len(self.children) > 2 * MAX_CHILDREN:
            self.prune()

    def prune(self) -> None:
        """Keep the MAX_CHILDREN most hit children (the total keeps counting them all)."""
        self.children = Counter(dict(self.children.most_common(MAX_CHILDREN)))

    def branch(self) -> tuple[bytes, ...] | None:
        """Where this region's lookups part: the path all of them shared, if some went
        on past it (None when none did, or nothing says: entries, no lookups)."""
        if self.common is None or len(self.common) >= self.longest:
            return None
        return self.common if len(self.common) >= len(self.path) else self.path

    def lone_child(self) -> bytes | None:
        """The only child ever hit, if there is just one."""
        if len(self.children) == 1:
            ((child, n),) = self.children.items()
            if n == self.total:
                return child
        return None


Regions = dict[bytes, RegionHits]  # region root key -> its hits


def shared_path(a: Sequence[bytes], b: Sequence[bytes]) -> tuple[bytes, ...]:
    """The longest common prefix of two key paths. A key names its whole prefix, so
    paths that agree at some depth agree above it: a binary search finds where."""
    n = min(len(a), len(b))
    if n and a[n - 1] == b[n - 1]:
        return tuple(a[:n])
    lo, hi = 0, n - 1  # a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return tuple(a[:lo])


def prune_regions(regions: Regions) -> None:
    """Keep the MAX_REGIONS most hit regions, each with its most hit children."""
    if len(regions) > MAX_REGIONS:
        keep = sorted(regions, key=lambda root: regions[root].total, reverse=True)[:MAX_REGIONS]
        kept = {root: regions[root] for root in keep}
        regions.clear()
        regions.update(kept)
    for region in regions.values():
        if len(region.children) > MAX_CHILDREN:
            region.prune()
