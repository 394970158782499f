"""`kvfabric replay` with host and disk tiers under each node's device: evicted pages go down
a tier instead of away, a hit on them costs reading them up, and the command's options and
report for them. The cluster without them: tests/deploy/test_simulate.py."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from kvfabric.core.cache.layout import Tier
from kvfabric.deploy.cli.main import main as cli
from kvfabric.deploy.placement import PowerOfTwo
from kvfabric.deploy.sim.cluster import NAMESPACE, Cluster, Mode, SimConfig, fabric_score
from kvfabric.deploy.sim.replay import run_mode, simulate
from kvfabric.deploy.sim.trace import BLOCK_TOKENS
from kvfabric.deploy.sim.workloads import Shape, generate

from tests.deploy.sim_traces import SMALL, busy_trace, requests_of, write_trace
from tests.deploy.test_simulate import CheckedFabric

B = BLOCK_TOKENS


def test_a_disk_tier_hits_at_least_as_much_at_equal_host_memory():
    rows = busy_trace()
    without = dataclasses.replace(SMALL, host_tokens=20 * B)
    with_disk = dataclasses.replace(without, disk_tokens=400 * B)
    reqs = requests_of(rows, without)
    for mode in (Mode.GLOBAL, Mode.POW2):
        a, b = run_mode(mode, without, reqs), run_mode(mode, with_disk, reqs)
        assert a.hits_by_tier()["disk"] == 0 < b.hits_by_tier()["disk"]
        assert b.hit_rate >= a.hit_rate > 0
        assert a.hits_by_tier()["host"] > 0  # the device ran full: pages went down
    assert b.index_disagreements == 0  # what went to disk, the index still names


def test_every_index_answer_matches_the_caches_across_tiers():
    config = dataclasses.replace(SMALL, host_tokens=20 * B, disk_tokens=100 * B)
    reqs = requests_of(busy_trace(), config)
    cluster = CheckedFabric(config, fabric_score(config))
    res = simulate(cluster, reqs, Mode.GLOBAL)
    assert res.hits_by_tier()["disk"] > 0 and res.fetches > 0
    assert cluster.wrong == 0 and cluster.index_disagreements(reqs) == []
    for cache in cluster.caches:
        cache.check()


def test_a_host_tier_hits_at_least_as_much_as_the_device_alone():
    reqs = requests_of(busy_trace(), SMALL)
    alone = run_mode(Mode.GLOBAL, SMALL, reqs)
    host = run_mode(Mode.GLOBAL, dataclasses.replace(SMALL, host_tokens=40 * B), reqs)
    assert alone.hits_by_tier()["host"] == alone.hits_by_tier()["disk"] == 0
    assert host.hit_rate >= alone.hit_rate


# Four-block prompts of their own, on one node whose device holds one of them, its host one.
ONE = SimConfig(nodes=1, shards=1, capacity_tokens=4 * B, host_tokens=4 * B, disk_tokens=40 * B)


def _served_after(others: int, config: SimConfig = ONE):
    """Store prompt 0 then `others` more, then serve prompt 0 again."""
    rows = [
        {
            "timestamp": i,
            "input_length": 4 * B,
            "output_length": 1,
            "hash_ids": [10 * i + k for k in range(4)],
        }
        for i in range(others + 1)
    ]
    reqs = requests_of(rows, config)
    cluster = Cluster(config, PowerOfTwo(random.Random(0)))
    for r in reqs:
        cluster.complete(0, r, 0.0)
    return cluster.serve(0, reqs[0], 0.0)


def test_a_hit_costs_its_tiers_read():
    device, host, disk = _served_after(0), _served_after(1), _served_after(2)
    # The whole prompt hits each time; only where it was read from differs.
    for svc in (device, host, disk):
        assert svc.local_tokens == svc.hit_tokens == 4 * B and svc.prefill_tokens == 0
    assert (device.host_tokens, device.disk_tokens) == (0, 0)
    assert (host.host_tokens, host.disk_tokens) == (4 * B, 0)
    assert (disk.host_tokens, disk.disk_tokens) == (0, 4 * B)
    assert device.duration_s < host.duration_s < disk.duration_s
    nbytes = ONE.page_bytes.fetch(4)
    assert disk.duration_s == pytest.approx(device.duration_s + ONE.cost.load_s(Tier.DISK, nbytes))
    assert host.duration_s == pytest.approx(device.duration_s + ONE.cost.load_s(Tier.HOST, nbytes))
    # Without a disk tier the prompt the host evicted is gone.
    gone = _served_after(2, dataclasses.replace(ONE, disk_tokens=0))
    assert gone.hit_tokens == 0


def test_a_hit_from_disk_comes_up_to_the_device():
    rows = [
        {
            "timestamp": i,
            "input_length": 4 * B,
            "output_length": 1,
            "hash_ids": [10 * i + k for k in range(4)],
        }
        for i in range(3)
    ]
    reqs = requests_of(rows, ONE)
    cluster = Cluster(ONE, PowerOfTwo(random.Random(0)))
    for r in reqs:
        cluster.complete(0, r, 0.0)
    assert cluster.serve(0, reqs[0], 0.0).disk_tokens == 4 * B
    again = cluster.serve(0, reqs[0], 0.0)
    assert (again.host_tokens, again.disk_tokens, again.local_tokens) == (0, 0, 4 * B)
    cluster.caches[0].check()
    assert cluster.caches[0].match(reqs[0].tokens, NAMESPACE).usable_device_pages == 4


def test_config_validation_of_the_tiers():
    assert SimConfig(host_tokens=B, disk_tokens=2 * B).tier_pages.disk == 2
    for bad in (
        {"host_tokens": -1},
        {"host_tokens": B - 1},
        {"host_tokens": 1.5},
        {"disk_tokens": B},  # no host tier above it
        {"host_tokens": B, "disk_tokens": 7},
    ):
        with pytest.raises(ValueError):
            SimConfig(**bad)


def test_the_long_context_shape_is_long():
    rows = generate(Shape.LONG, 200, seed=3)
    assert len(rows) == 200
    assert min(r["input_length"] for r in rows) >= 64 * B


def test_replay_command_reports_hits_by_tier(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", busy_trace()[:150])
    argv = ["replay", "--trace", str(trace), "--nodes", "3", "--capacity-tokens", "10240"]
    argv += ["--host-tokens", "10240", "--disk-tokens", "204800", "--no-progress", "--json"]
    assert cli([*argv, "--disk-read-bytes-per-s", "3e9", "--modes", "global,pow2"]) == 0
    out = capsys.readouterr().out
    assert "hit tokens by tier" in out and "disk 204,800 tokens (3.0 GB/s)" in out
    got = json.loads(out.strip().splitlines()[-1])
    for fields in got["modes"].values():
        tiers = fields["hit_tokens_by_tier"]
        assert set(tiers) == {"device", "host", "disk", "remote"}
        assert sum(tiers.values()) == fields["hit_tokens"]
        assert tiers["disk"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--host-tokens", "-1"],
        ["--host-tokens", "100"],
        ["--host-tokens", "x"],
        ["--disk-tokens", "100"],
        ["--disk-tokens", "1024"],  # no host tier
        ["--host-read-bytes-per-s", "0"],
        ["--host-read-bytes-per-s", "nan"],
        ["--disk-read-bytes-per-s", "-5"],
        ["--disk-read-bytes-per-s", "inf"],
    ],
)
def test_bad_tier_options_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli(["replay", *argv])
    assert e.value.code == 2
