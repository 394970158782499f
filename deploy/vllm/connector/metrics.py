"""The connector's counters as vLLM reports a connector's own: at each step the scheduler
side's ConnectorStats are read as what changed since the last read (`StatsReader`),
carried to vLLM's stat loggers as a KVConnectorStats (`FabricStats`), and recorded there
as Prometheus metrics (`FabricPromMetrics`): in vLLM's own registry when it runs alone
(`/metrics`, `LLM.get_metrics()`), through Ray's metrics under Ray Serve LLM, where
`vllm:kvfabric_loaded_tokens` is exported as `ray_vllm_kvfabric_loaded_tokens_total`.
Named under `vllm:` as vLLM's own connectors name theirs (`vllm:nixl_*`): dashboards of
vLLM's metrics, and `LLM.get_metrics()`, take only those.

Every counter has the engine's labels (model name, engine index); loaded tokens also a
`tier` label, the node tier or peer they came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .stats import ConnectorStats


@dataclass(frozen=True)
class Counter:
    key: str  # in FabricStats.data
    name: str  # the Prometheus name
    doc: str
    tier: str = ""  # the `tier` label's value; "": the counter has no such label


COUNTERS = (
    Counter("lookups", "vllm:kvfabric_lookups", "Requests the connector asked its node about."),
    *(
        Counter(
            f"loaded_tokens_{tier}",
            "vllm:kvfabric_loaded_tokens",
            "Prompt tokens loaded from the fabric into the engine, by where they came from "
            "(the node's device or host tier, or another node).",
            tier,
        )
        for tier in ("device", "host", "remote")
    ),
    Counter("load_failures", "vllm:kvfabric_load_failures", "Loads that failed (recomputed)."),
    Counter("saved_requests", "vllm:kvfabric_saved_requests", "Requests whose KV was saved."),
    Counter("stored_pages", "vllm:kvfabric_stored_pages", "Pages the node stored from saves."),
    Counter("save_failures", "vllm:kvfabric_save_failures", "Saves that failed (nothing stored)."),
    Counter("node_errors", "vllm:kvfabric_node_errors", "Node calls that failed or timed out."),
    Counter(
        "uncacheable_requests",
        "vllm:kvfabric_uncacheable_requests",
        "Requests never cached (prompt embeddings, an adapter whose files cannot be read).",
    ),
    Counter("remote_lookups", "vllm:kvfabric_remote_lookups", "Index lookups for other nodes."),
    Counter("remote_fetches", "vllm:kvfabric_remote_fetches", "Fetches started from another node."),
    Counter(
        "remote_failures", "vllm:kvfabric_remote_failures", "Remote lookups or fetches failed."
    ),
)
KEYS = frozenset(c.key for c in COUNTERS)


def snapshot(stats: ConnectorStats) -> dict[str, int]:
    """The counters' values now."""
    host, remote = stats.host_loaded_tokens, stats.remote_loaded_tokens
    return {
        "lookups": stats.lookups,
        "loaded_tokens_device": max(0, stats.loaded_tokens - host - remote),
        "loaded_tokens_host": host,
        "loaded_tokens_remote": remote,
        "load_failures": stats.load_failures,
        "saved_requests": stats.saved_requests,
        "stored_pages": stats.stored_pages,
        "save_failures": stats.save_failures,
        "node_errors": stats.node_errors,
        "uncacheable_requests": stats.uncacheable_requests,
        "remote_lookups": stats.remote.lookups,
        "remote_fetches": stats.remote.fetches,
        "remote_failures": stats.remote.failures,
    }


@dataclass
class StatsReader:
    """What changed in a ConnectorStats since the last read."""

    last: dict[str, int] = field(default_factory=dict)

    def since_last(self, stats: ConnectorStats) -> dict[str, int]:
        now = snapshot(stats)
        delta = {k: v - self.last.get(k, 0) for k, v in now.items() if v != self.last.get(k, 0)}
        self.last = now
        return delta


@dataclass
class FabricStats(KVConnectorStats):
    """Counter increments over an interval, by key (vLLM ships `data` from the engine core
    to its loggers, and sums intervals with `aggregate`)."""

    def __post_init__(self) -> None:
        self.data = check(self.data)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, n in check(other.data).items():
            self.data[key] = self.data.get(key, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


def check(data: Any) -> dict[str, int]:
    """`data` as counter increments: a dict of known keys to non-negative ints."""
    if not isinstance(data, dict):
        raise ValueError(f"connector stats must be a dict, got {type(data).__name__}")
    for key, n in data.items():
        if key not in KEYS:
            raise ValueError(f"unknown connector stat {key!r:.60}")
        if type(n) is not int or n < 0:
            raise ValueError(f"connector stat {key} must be an int >= 0, got {n!r:.40}")
    return dict(data)


class FabricPromMetrics(KVConnectorPromMetrics):
    """The counters, one child per engine (and tier), of the metric classes vLLM hands in
    (prometheus_client's, or Ray's wrappers under Ray Serve LLM)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        made: dict[str, Any] = {}
        self.children: dict[int, dict[str, Any]] = {i: {} for i in per_engine_labelvalues}
        for c in COUNTERS:
            if c.name not in made:
                labels = [*labelnames, "tier"] if c.tier else list(labelnames)
                made[c.name] = self._counter_cls(
                    name=c.name, documentation=c.doc, labelnames=labels
                )
            for i, values in per_engine_labelvalues.items():
                tier = [c.tier] if c.tier else []
                self.children[i][c.key] = made[c.name].labels(*values, *tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, n in check(transfer_stats_data).items():
            if n:
                self.children[engine_idx][key].inc(n)
