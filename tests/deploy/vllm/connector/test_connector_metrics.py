"""The connector's counters as vLLM's stat loggers take them (connector_metrics.py):
increments read from the scheduler side's ConnectorStats, summed over intervals, checked
where they come in, and recorded as labelled Prometheus counters. With a real engine:
test_vllm_connector.py reads them from vLLM's registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvfabric.deploy.vllm.connector.metrics import (  # noqa: E402
    COUNTERS,
    KEYS,
    FabricPromMetrics,
    FabricStats,
    StatsReader,
    check,
    snapshot,
)
from kvfabric.deploy.vllm.connector.stats import ConnectorStats  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from tests.examples import examples

increments = st.dictionaries(st.sampled_from(sorted(KEYS)), st.integers(0, 10**9))


def test_a_snapshot_names_every_counter_and_splits_loaded_tokens_by_tier():
    stats = ConnectorStats(loaded_tokens=100, host_loaded_tokens=30, remote_loaded_tokens=20)
    stats.remote.fetches = 2
    now = snapshot(stats)
    assert set(now) == KEYS
    assert (now["loaded_tokens_device"], now["loaded_tokens_host"]) == (50, 30)
    assert now["loaded_tokens_remote"] == 20 and now["remote_fetches"] == 2


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6))
def test_the_reader_reports_each_increment_once(steps):
    stats, reader, total = ConnectorStats(), StatsReader(), 0
    for n in steps:
        stats.lookups += n
        stats.stored_pages += 2 * n
        delta = reader.since_last(stats)
        assert delta == ({"lookups": n, "stored_pages": 2 * n} if n else {})
        total += delta.get("lookups", 0)
    assert total == stats.lookups and reader.since_last(stats) == {}


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(increments, min_size=1, max_size=5))
def test_intervals_aggregate_to_their_sum(intervals):
    merged = FabricStats(data=dict(intervals[0]))
    for data in intervals[1:]:
        merged = merged.aggregate(FabricStats(data=dict(data)))
    for key in KEYS:
        assert merged.data.get(key, 0) == sum(d.get(key, 0) for d in intervals)
    assert merged.is_empty() == (not any(merged.data.values()))
    assert merged.reduce() == dict(sorted(merged.data.items()))


@pytest.mark.parametrize(
    "data",
    [[], {"lookups": -1}, {"lookups": 1.5}, {"lookups": True}, {"bogus": 1}, {1: 1}, None],
)
def test_stats_that_are_not_increments_are_refused_and_change_nothing(data):
    with pytest.raises(ValueError):
        check(data)
    kept = FabricStats(data={"lookups": 3})
    bad = object.__new__(FabricStats)  # as one built elsewhere without its check
    bad.data = data
    with pytest.raises(ValueError):
        kept.aggregate(bad)
    assert kept.data == {"lookups": 3}


def test_counters_are_recorded_per_engine_and_tier():
    registry = CollectorRegistry()

    def bound(cls):
        class OnRegistry(cls):  # vLLM builds them by name: give each the test's registry
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return OnRegistry

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    per_engine = {0: ["m", "0"], 1: ["m", "1"]}
    prom = FabricPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], per_engine
    )
    prom.observe({"loaded_tokens_host": 7, "loaded_tokens_remote": 2, "lookups": 1}, 1)
    prom.observe({"loaded_tokens_host": 3}, 1)
    prom.observe({"lookups": 5}, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name + "_total", labels)

    assert value("vllm:kvfabric_loaded_tokens", model_name="m", engine="1", tier="host") == 10
    assert value("vllm:kvfabric_loaded_tokens", model_name="m", engine="1", tier="remote") == 2
    assert value("vllm:kvfabric_loaded_tokens", model_name="m", engine="1", tier="device") == 0
    assert value("vllm:kvfabric_lookups", model_name="m", engine="0") == 5
    assert value("vllm:kvfabric_lookups", model_name="m", engine="1") == 1
    names = {m.name for m in registry.collect()}
    assert names == {c.name for c in COUNTERS}
    with pytest.raises(ValueError):
        prom.observe({"lookups": -2}, 0)
    assert value("vllm:kvfabric_lookups", model_name="m", engine="0") == 5
