"""IndexShardActor: one shard of the global prefix index, fed by node actors' events."""

from __future__ import annotations

import ray
from kvfabric.core.cache.keys import KEY_BYTES
from kvfabric.core.index.answers import WireMatch
from kvfabric.core.index.balance import LoadTracker
from kvfabric.core.index.events import EventBatch, EventError, Snapshot
from kvfabric.core.index.events import decode as decode_events
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import ApplyResult, PrefixIndex
from kvfabric.core.index.regions import entries_by_region
from kvfabric.core.index.routes import RouteTable
from kvfabric.core.wire import is_int

from .index_metrics import IndexMetrics
from .names import NAMESPACE


@ray.remote
class IndexShardActor:
    def __init__(
        self,
        shard: int,
        shards: int,
        rule: MatchRule,
        fingerprint: bytes | None = None,
        fabric: str = NAMESPACE,
    ) -> None:
        """`fabric`: the Ray namespace of the fabric this shard belongs to (its metrics'
        label)."""
        self.shard, self.shard_count = shard, shards
        self.fabric = fabric
        self.metrics: IndexMetrics | None = None  # made at the first report, in Ray
        self.index = PrefixIndex(rule, fingerprint)
        self.load = LoadTracker(shards)
        self.route_version = 0
        self.rejected = 0
        self.lookups = 0

    def apply(self, data: bytes) -> ApplyResult:
        """An encoded event batch; what became of it."""
        batch = self._decode(data, EventBatch)
        return ApplyResult.REJECTED if batch is None else self._checked(self.index.apply, batch)

    def load_snapshot(self, data: bytes) -> ApplyResult:
        snap = self._decode(data, Snapshot)
        return (
            ApplyResult.REJECTED if snap is None else self._checked(self.index.load_snapshot, snap)
        )

    def _checked(self, apply, msg) -> ApplyResult:
        try:
            return apply(msg)
        except EventError:  # e.g. another model's layout: refused, nothing applied
            self.rejected += 1
            return ApplyResult.REJECTED

    def _decode(self, data: bytes, kind: type):
        """The decoded message if it is valid and of `kind`; else counts a rejection."""
        try:
            msg = decode_events(data)
        except EventError:
            msg = None
        if not isinstance(msg, kind):
            self.rejected += 1
            return None
        return msg

    def lookup(self, keys: bytes, route_version: int, depth: int = -1) -> list[WireMatch] | None:
        """Each node's usable match for the concatenated 16-byte page keys, best
        first; None: the caller's routes are stale. (One bytes object pickles
        much faster than a list of keys.)"""
        if not is_int(route_version) or not is_int(depth):
            raise ValueError(
                f"route_version and depth must be ints, got {route_version!r}, {depth!r}"
            )
        if route_version < self.route_version:
            return None
        if not isinstance(keys, bytes) or len(keys) % KEY_BYTES:
            raise ValueError(f"keys must be bytes, a multiple of {KEY_BYTES} long")
        self.lookups += 1
        split = [keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]
        if 0 <= depth < len(split):  # the caller says where its region starts: count it
            self.load.record(split, self.shard, depth)
        return [(m.node, m.pages, int(m.tier)) for m in self.index.lookup(split)]

    def load_report(self) -> LoadTracker:
        """Lookups since the last report, per region, and keys held; starts a new count."""
        report, self.load = self.load, LoadTracker(self.shard_count)
        report.entries[self.shard] = len(self.index)
        if ray.is_initialized():  # the directory's pass: a time to publish the metrics too
            if self.metrics is None:
                self.metrics = IndexMetrics(self.fabric, self.shard)
            self.metrics.publish(self.lookups, len(self.index), len(self.index.nodes()))
        return report

    def entry_regions(self, routes: bytes) -> dict:
        """Keys held per region and child under these routes (a pass over every key)."""
        return entries_by_region(self.index, RouteTable.decode(routes))

    def set_route_version(self, version: int) -> None:
        self.route_version = max(self.route_version, version)

    def get_route_version(self) -> int:
        return self.route_version

    def drop_node(self, node: str) -> None:
        """The directory's word that `node` died: its events are refused until `admit`."""
        self.index.drop_node(node)

    def holders(self) -> list[str]:
        """The publishers this shard names as holding pages."""
        return self.index.nodes()

    def admit(self, node: str, epoch: int) -> None:
        """The directory's word that `node` belongs, publishing from `epoch` on."""
        self.index.admit(node, epoch)

    def retire(self, node: str, epoch: int) -> None:
        """The directory's word that life `epoch` of `node` (an engine) ended."""
        self.index.retire(node, epoch)

    def noop(self, *payload: object) -> None:
        """Does nothing: the baseline a lookup's latency is measured against."""
        return None

    def stats(self) -> dict:
        # The shard counts what it refused before the index saw it (the index never rejects).
        return {
            **self.index.stats(),
            "shard": self.shard,
            "lookups": self.lookups,
            "rejected": self.rejected,
        }
