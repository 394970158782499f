"""An index shard's counters as Ray metrics: lookups answered, keys held, publishers
named (exported as `ray_kvfabric_index_*`, labelled with the fabric's Ray namespace and
the shard). Published at each load report (the directory's rebalance pass, every
REBALANCE_EVERY_S), so a lookup touches no metric."""

from __future__ import annotations

from dataclasses import dataclass

from ray.util import metrics

_KEYS = ("fabric", "shard")
# What the dashboard and docs may name (exported names: the Counter's with `_total`).
COUNTERS = ("kvfabric_index_lookups",)
GAUGES = ("kvfabric_index_keys", "kvfabric_index_holders")


@dataclass
class IndexMetrics:
    fabric: str
    shard: int
    _lookups: int = 0

    def __post_init__(self) -> None:
        self.lookups = metrics.Counter(
            COUNTERS[0], "Prefix lookups this index shard answered.", tag_keys=_KEYS
        )
        self.keys = metrics.Gauge(GAUGES[0], "Page keys this index shard holds.", tag_keys=_KEYS)
        self.holders = metrics.Gauge(
            GAUGES[1], "Publishers (node actors, engines) this shard names.", tag_keys=_KEYS
        )

    def publish(self, lookups: int, keys: int, holders: int) -> None:
        tags = {"fabric": self.fabric, "shard": str(self.shard)}
        if lookups > self._lookups:
            self.lookups.inc(lookups - self._lookups, tags=tags)
        self._lookups = lookups
        self.keys.set(keys, tags=tags)
        self.holders.set(holders, tags=tags)
