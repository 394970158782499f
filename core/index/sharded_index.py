"""The prefix index split over shards by subtree, in one process.

Index shard actors hold one PrefixIndex each and the caller routes with the
route table; this class does the same in process (for replay, benchmarks
and the differential tests) and decides splits: when one shard takes too
large a share of lookups (or, lookups being even, holds too large a share of
entries), its hottest (largest) region is split one level down and the
children spread over the shards. After a split, nodes
resend snapshots under the new routes (shard state is soft)."""

from __future__ import annotations

from typing import Sequence

from .answers import NodeMatch
from .balance import LoadTracker, Split, chance_target
from .events import EventBatch, Snapshot
from .match_rule import MatchRule
from .prefix_index import ApplyResult, PrefixIndex
from .regions import entries_by_region
from .routes import RouteTable


class ShardedIndex:
    def __init__(self, shards: int, rule: MatchRule) -> None:
        self.routes = RouteTable(shards)
        self.shards = [PrefixIndex(rule) for _ in range(shards)]
        self.load = LoadTracker(shards)  # since the last rebalance
        self.total_lookups = [0] * shards

    # --- events ---------------------------------------------------------------------
    def apply(self, batches: dict[int, EventBatch]) -> dict[int, ApplyResult]:
        return {shard: self.shards[shard].apply(b) for shard, b in batches.items()}

    def load_snapshot(self, shard: int, snap: Snapshot) -> None:
        self.shards[shard].load_snapshot(snap)

    def drop_node(self, node: str) -> None:
        for shard in self.shards:
            shard.drop_node(node)

    def admit(self, node: str, epoch: int) -> None:
        for shard in self.shards:
            shard.admit(node, epoch)

    # --- lookups --------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[NodeMatch]:
        if not keys:
            return []
        shard, depth = self.routes.locate(keys)
        self.load.record(keys, shard, depth)
        self.total_lookups[shard] += 1
        return self.shards[shard].lookup(keys)

    # --- balance --------------------------------------------------------------------
    def load_max_over_mean(self) -> float:
        mean = sum(self.total_lookups) / len(self.total_lookups)
        return max(self.total_lookups) / mean if mean else 1.0

    def rebalance(self, target: float = 1.1, entries_target: float | None = None) -> Split | None:
        """Split the hottest region of the hottest shard if lookups are uneven, else
        the largest region of the fullest shard if entries are.

        Returns the split (the routes already changed: resend snapshots), or None."""
        for i, shard in enumerate(self.shards):
            self.load.entries[i] = len(shard)
        planned = self.load.plan(
            self.routes,
            target,
            entries_target,
            regions_of=lambda i: entries_by_region(self.shards[i], self.routes),
        )
        if planned is None:
            return None
        self.routes, split = planned
        self.load = LoadTracker(len(self.shards))
        return split

    def rebalance_if_uneven(self, target: float = 1.1, sigmas: float | None = None) -> Split | None:
        """`rebalance`, when lookups are uneven beyond chance (`chance_target`: a split
        costs every node a snapshot) or entries beyond `target`; what the directory's
        watcher does, in process."""
        bar = chance_target(target, self.load.lookups, sigmas) or target
        return self.rebalance(target=bar, entries_target=target)

    def stats(self) -> dict:
        return {
            "shards": len(self.shards),
            "routes": len(self.routes.routes),
            "route_version": self.routes.version,
            "lookups": list(self.total_lookups),
            "keys": [len(s) for s in self.shards],
            "load_max_over_mean": round(self.load_max_over_mean(), 3),
        }
