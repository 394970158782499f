"""A node actor's counters as Ray metrics, so Prometheus sees the fabric's own side in
both modes (the reference app's and vLLM's): each pool's fill by tier, lookups and hit
pages by tier, pages stored, evicted and written back, bytes read from other nodes, and
the engines' staging pages mapped. Exported by Ray's agents as `ray_kvfabric_node_*`
(counters end in `_total`), tagged with the fabric's Ray namespace and the node actor.

The cache keeps plain running totals; `publish` (on each directory heartbeat, a few
seconds apart) adds what they grew by since the last call, so nothing on a request's
path touches a metric."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.core.cache.node_cache import CacheStats
from ray.util import metrics

_KEYS = ("fabric", "node")
# Counter -> what it counts (exported as ray_kvfabric_node_<name>_total).
COUNTERS = (
    ("lookups", "Lookups of a prompt in this node's cache."),
    ("lookup_pages", "Pages of prompts looked up in this node's cache."),
    ("hit_pages", "Pages this node's cache served, by the tier they came from."),
    ("inserted_pages", "Pages stored in this node's cache."),
    ("evicted_pages", "Pages evicted from a tier of this node's cache."),
    ("written_back_pages", "Pages written back from device to host as evicted."),
    ("fetched_bytes", "KV bytes this node read from other nodes."),
)
GAUGES = ("kvfabric_node_pages", "kvfabric_node_staging_bytes", "kvfabric_node_staging_engines")


@dataclass(frozen=True)
class NodeSample:
    """What a node actor reports at one heartbeat."""

    stats: CacheStats
    fetched_bytes: int
    staging_engines: int
    staging_bytes: int


@dataclass
class NodeMetrics:
    fabric: str
    node: str
    _last: dict[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pages = metrics.Gauge(
            GAUGES[0],
            "Pages of a node's pool on a tier: its capacity, and those in use.",
            tag_keys=(*_KEYS, "pool", "tier", "state"),
        )
        self.staging = metrics.Gauge(
            GAUGES[1],
            "Bytes of the staging pages (/dev/shm) this node maps for its engines.",
            tag_keys=_KEYS,
        )
        self.engines = metrics.Gauge(
            GAUGES[2],
            "Engines whose staging pages this node maps.",
            tag_keys=_KEYS,
        )
        self.counters = {
            name: metrics.Counter(f"kvfabric_node_{name}", about, tag_keys=(*_KEYS, "tier"))
            for name, about in COUNTERS
        }

    def publish(self, sample: NodeSample) -> None:
        tags = {"fabric": self.fabric, "node": self.node}
        s = sample.stats
        for name, tier, total in (
            ("lookups", "", s.lookups),
            ("lookup_pages", "", s.lookup_pages),
            ("hit_pages", "device", s.hit_pages_device),
            ("hit_pages", "host", s.hit_pages_host),
            ("inserted_pages", "", s.inserted_pages),
            ("evicted_pages", "", s.evicted_pages),
            ("written_back_pages", "", s.written_back_pages),
            ("fetched_bytes", "", sample.fetched_bytes),
        ):
            grown = total - self._last.get((name, tier), 0)
            self._last[name, tier] = total
            if grown > 0:
                self.counters[name].inc(grown, tags={**tags, "tier": tier})
        for pool_tier, p in s.pools.items():
            pool, tier = pool_tier.split("/")
            for state in ("capacity", "used"):
                where = {**tags, "pool": pool.lower(), "tier": tier.lower(), "state": state}
                self.pages.set(p[state], tags=where)
        self.staging.set(sample.staging_bytes, tags=tags)
        self.engines.set(sample.staging_engines, tags=tags)
