"""Hot-prefix replication in `kvfabric replay` (kvfabric.deploy.sim.replication): on a
trace of a few very hot prefixes it cuts remote fetches within the same memory, and with
it off the replay is what it was before replication existed."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kvfabric.core.index.replication import ReplicationConfig
from kvfabric.deploy.cli.main import main as cli
from kvfabric.deploy.sim.cluster import Mode, SimConfig
from kvfabric.deploy.sim.global_mode import FabricCluster
from kvfabric.deploy.sim.modes import make_cluster
from kvfabric.deploy.sim.replay import simulate
from kvfabric.deploy.sim.workloads import Shape, generate

from tests.deploy.sim_traces import busy_trace, requests_of, write_trace

ON = ReplicationConfig(threshold=2, fanout=8)
HOT = SimConfig(nodes=8, capacity_tokens=500_000, shards=4)


@pytest.fixture(scope="module")
def hot_rows():
    return generate(Shape.HOT, 1000, seed=1, new_per_s=40.0)


def run(rows, config):
    reqs = requests_of(rows, config)
    cluster = make_cluster(Mode.GLOBAL, config, reqs)
    assert isinstance(cluster, FabricCluster)
    return cluster, simulate(cluster, reqs, Mode.GLOBAL), reqs


def test_hot_prefixes_are_fetched_less_with_replication_in_the_same_memory(hot_rows):
    _, off, _ = run(hot_rows, HOT)
    cluster, on, reqs = run(hot_rows, dataclasses.replace(HOT, replication=ON))
    assert off.replicas is None and on.replicas is not None
    assert on.replicas.landed > 0 and on.replicas.pages_copied > 0
    assert on.fetches < 0.8 * off.fetches
    assert on.ttft_ms(0.99) <= off.ttft_ms(0.99)
    # Replicas live in the nodes' own caches, within their capacity and the budget, and
    # the index knows them.
    assert on.index_disagreements == 0 and cluster.index_disagreements(reqs) == []
    policy = cluster.replicator.policy
    for name, cache in zip(cluster.names, cluster.caches):
        pool = cache.stats().pools["FULL/DEVICE"]
        assert pool["used"] <= pool["capacity"] == HOT.capacity_pages
        assert policy.used[name] <= policy.budgets[name] == int(0.1 * HOT.capacity_pages)
        for r in policy.replicas.values():
            if r.node == name:
                assert cache.match_keys(list(r.keys)).usable_pages == len(r.keys)
        cache.check()
    assert cluster.replicator.running == set() and not any(cluster.replicator.pending.values())


def test_replication_is_deterministic(hot_rows):
    config = dataclasses.replace(HOT, replication=ON)
    a, b = run(hot_rows[:400], config)[1], run(hot_rows[:400], config)[1]
    assert (a.fetches, a.ttft_s, a.replicas) == (b.fetches, b.ttft_s, b.replicas)


# `kvfabric replay --trace T --nodes 3 --capacity-tokens 20480 --shards 4 --json` on
# busy_trace()[:150] at the commit before replication existed (8828ef1), elapsed_s and the
# sweep (its one point repeats these) aside.
BEFORE_JSON = {
    "requests": 150,
    "nodes": 3,
    "shards": 4,
    "capacity_tokens": 20480,
    "modes": {
        "pow2": {
            "hit_rate": 0.2064,
            "prefill_tokens": 558920,
            "ttft_p50_ms": 1778.4,
            "ttft_p99_ms": 8184.0,
            "e2e_p50_ms": 10825.8,
            "hit_tokens": 145408,
            "bytes_moved": 0,
        },
        "affinity": {
            "hit_rate": 0.5212,
            "prefill_tokens": 337224,
            "ttft_p50_ms": 461.3,
            "ttft_p99_ms": 3592.6,
            "e2e_p50_ms": 9408.9,
            "hit_tokens": 367104,
            "bytes_moved": 0,
        },
        "global": {
            "hit_rate": 0.4478,
            "prefill_tokens": 388936,
            "ttft_p50_ms": 485.3,
            "ttft_p99_ms": 3721.9,
            "e2e_p50_ms": 9293.9,
            "hit_tokens": 315392,
            "bytes_moved": 12884901888,
            "remote_hit_tokens": 98304,
            "fetches": 45,
            "shard_load_max_over_mean": 1.64,
            "index_checked": 150,
            "index_disagreements": 0,
        },
        "pooled": {
            "hit_rate": 0.5307,
            "prefill_tokens": 330568,
            "ttft_p50_ms": 311.7,
            "ttft_p99_ms": 1065.9,
            "e2e_p50_ms": 8821.9,
            "hit_tokens": 373760,
            "bytes_moved": 0,
        },
        "infinite": {
            "hit_rate": 0.6404,
            "prefill_tokens": 253256,
            "ttft_p50_ms": 184.9,
            "ttft_p99_ms": 490.6,
            "e2e_p50_ms": 8655.6,
            "hit_tokens": 451072,
            "bytes_moved": 0,
        },
    },
    "global_over_pow2_hit_rate": 2.169,
    "global_over_affinity_hit_rate": 0.859,
    "global_over_pooled_hit_rate": 0.844,
    "global_over_infinite_hit_rate": 0.699,
    "global_over_pow2_ttft_p50": 0.273,
    "global_over_affinity_ttft_p50": 1.052,
    "shard_load_max_over_mean": 1.64,
}


def replay_json(tmp_path, capsys, *flags):
    trace = write_trace(tmp_path / "t.jsonl", busy_trace()[:150])
    argv = ["replay", "--trace", str(trace), "--nodes", "3", "--capacity-tokens", "20480"]
    assert cli([*argv, "--shards", "4", "--json", "--no-progress", *flags]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out.pop("elapsed_s")
    (point,) = out.pop("sweep")
    assert point == {k: v for k, v in out.items() if k not in ("requests", "nodes", "shards")}
    return out


def test_off_the_replay_is_as_before_and_on_it_reports_both(tmp_path, capsys):
    off = replay_json(tmp_path, capsys, "--no-replicate")
    assert "replication" not in off and "replicas" not in off["modes"]["global"]
    assert off == BEFORE_JSON
    on = replay_json(tmp_path, capsys, "--replica-threshold", "2")
    rep = on["replication"]
    assert rep["off"] == {
        k: off["modes"]["global"][k] for k in ("fetches", "hit_rate", "ttft_p50_ms", "ttft_p99_ms")
    }
    assert rep["on"]["fetches"] == on["modes"]["global"]["fetches"]
    assert set(rep) >= {"fetches_on_over_off", "ttft_p50_on_over_off", "ttft_p99_on_over_off"}
    assert on["modes"]["global"]["replicas"]["placed"] >= 0
    # Only global changes: the other modes have no replicas.
    for mode in ("pow2", "affinity", "pooled", "infinite"):
        assert on["modes"][mode] == off["modes"][mode]


@pytest.mark.parametrize(
    "argv",
    [
        ["--replica-threshold", "0"],
        ["--replica-fanout", "0"],
        ["--replica-window-s", "0"],
        ["--replica-window-s", "inf"],
        ["--replica-budget", "1.5"],
    ],
)
def test_bad_replication_options_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli(["replay", *argv])
    assert e.value.code == 2
