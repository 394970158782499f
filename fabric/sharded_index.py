"""The prefix index split over shards by subtree, in one process.

Index shard actors hold one PrefixIndex each and the caller routes with the
route table; this class does the same in process (for replay, benchmarks
and the differential tests) and decides splits: when one shard takes too
large a share of lookups, its hottest region is split one level down and
the children spread over the least loaded shards. After a split, nodes
resend snapshots under the new routes (shard state is soft)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from .events import EventBatch, Snapshot
from .index import ApplyResult, NodeMatch, PrefixIndex
from .routes import RouteTable


@dataclass(frozen=True)
class Split:
    path: tuple[bytes, ...]       # the region root the split went below
    children: tuple[bytes, ...]
    shards: tuple[int, ...]


class ShardedIndex:
    def __init__(self, shards: int, window_pages: int, has_full: bool = True) -> None:
        self.routes = RouteTable(shards)
        self.shards = [PrefixIndex(window_pages, has_full) for _ in range(shards)]
        self.lookups = [0] * shards                    # since the last rebalance
        self.total_lookups = [0] * shards
        self._regions: dict[bytes, tuple[tuple[bytes, ...], Counter]] = {}   # root key -> (path, child hits)

    # --- events ---------------------------------------------------------------------
    def apply(self, batches: dict[int, EventBatch]) -> dict[int, ApplyResult]:
        return {shard: self.shards[shard].apply(b) for shard, b in batches.items()}

    def load_snapshot(self, shard: int, snap: Snapshot) -> None:
        self.shards[shard].load_snapshot(snap)

    def drop_node(self, node: str) -> None:
        for shard in self.shards:
            shard.drop_node(node)

    # --- lookups --------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[NodeMatch]:
        if not keys:
            return []
        shard, depth = self.routes.locate(keys)
        self.lookups[shard] += 1
        self.total_lookups[shard] += 1
        root = keys[depth]
        region = self._regions.get(root)
        if region is None:
            region = self._regions[root] = (tuple(keys[:depth + 1]), Counter())
        if depth + 1 < len(keys):
            region[1][keys[depth + 1]] += 1
        return self.shards[shard].lookup(keys)

    # --- balance --------------------------------------------------------------------
    def load_max_over_mean(self, total: bool = True) -> float:
        loads = self.total_lookups if total else self.lookups
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    def rebalance(self, target: float = 1.1) -> Split | None:
        """Split the hottest region of the hottest shard if lookups are uneven.

        Returns the split (the routes already changed: resend snapshots), or None."""
        if len(self.shards) == 1 or self.load_max_over_mean(total=False) <= target:
            return None
        hot = max(range(len(self.shards)), key=self.lookups.__getitem__)
        candidates = [(sum(c.values()), root) for root, (path, c) in self._regions.items()
                      if c and self.routes.locate(path)[0] == hot]
        if not candidates:
            return None
        _, root = max(candidates)
        path, hits = self._regions[root]
        if len(hits) == 1:
            # One child takes it all: descend (same shard), and look deeper next time.
            (child,) = hits
            self.routes = self.routes.split(path, [child], [hot])
            split = Split(path, (child,), (hot,))
        else:
            self.routes = self.routes.spread(path, hot)
            split = Split(path, tuple(hits), tuple(self.routes.hashed(c) for c in hits))
        self.lookups = [0] * len(self.shards)
        self._regions = {}
        return split

    def stats(self) -> dict:
        return {"shards": len(self.shards), "routes": len(self.routes.routes),
                "route_version": self.routes.version, "lookups": list(self.total_lookups),
                "keys": [len(s) for s in self.shards],
                "load_max_over_mean": round(self.load_max_over_mean(), 3)}
