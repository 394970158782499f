"""The simulated cluster of `kvfabric replay` on small synthetic traces: what each routing mode
hits, its clock and cost model, and the sharded index against the nodes' caches. The command
itself: tests/deploy/test_replay.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
from kvfabric.core.cache.layout import Tier
from kvfabric.core.cache.nodes import TIERS
from kvfabric.deploy.placement import PowerOfTwo
from kvfabric.deploy.sim.cluster import NAMESPACE, Cluster, Mode, SimConfig
from kvfabric.deploy.sim.global_mode import FabricCluster
from kvfabric.deploy.sim.modes import make_cluster
from kvfabric.deploy.sim.replay import run_mode, simulate
from kvfabric.deploy.sim.trace import BLOCK_TOKENS

from tests.deploy.sim_traces import SMALL, busy_trace, requests_of, synthetic_trace


@pytest.fixture(scope="module")
def busy_rows() -> list[dict]:
    return busy_trace()


# ---- figures ------------------------------------------------------------------------------

CACHING = (Mode.AFFINITY, Mode.GLOBAL, Mode.POOLED, Mode.INFINITE)


def test_the_fabric_beats_load_only_routing_under_heavy_sharing(busy_rows):
    config = dataclasses.replace(SMALL, capacity_tokens=100 * BLOCK_TOKENS)
    reqs = requests_of(busy_rows, config)
    res = {m: run_mode(m, config, reqs) for m in Mode}
    hit = {m: r.hit_rate for m, r in res.items()}
    assert hit[Mode.INFINITE] >= hit[Mode.POOLED] and hit[Mode.INFINITE] >= hit[Mode.GLOBAL]
    assert hit[Mode.GLOBAL] > 1.1 * hit[Mode.POW2] > 0
    assert res[Mode.GLOBAL].ttft_ms(0.5) < res[Mode.POW2].ttft_ms(0.5)
    assert (
        res[Mode.GLOBAL].bytes_moved
        > 0
        == res[Mode.POW2].bytes_moved
        == res[Mode.AFFINITY].bytes_moved
    )


def test_with_room_for_everything_global_equals_the_shared_caches():
    # One request at a time, far apart: every prefill ends before the next arrives, so every
    # mode sees the same completed prompts; a node stores whole prompts, so the best single
    # holder of a prefix holds all of it, and global fetches whatever another node holds.
    rows = [dict(r, timestamp=i * 100_000) for i, r in enumerate(synthetic_trace(160, seed=3))]
    config = dataclasses.replace(SMALL, capacity_tokens=10**8)
    reqs = requests_of(rows, config)
    res = {m: run_mode(m, config, reqs) for m in Mode}
    assert (
        res[Mode.GLOBAL].hit_tokens
        == res[Mode.POOLED].hit_tokens
        == res[Mode.INFINITE].hit_tokens
        > 0
    )
    assert res[Mode.GLOBAL].prefill_tokens == res[Mode.INFINITE].prefill_tokens
    # Routed by load alone, a request finds its prefix only where it happens to land.
    assert res[Mode.GLOBAL].hit_tokens > res[Mode.POW2].hit_tokens
    assert res[Mode.POW2].bytes_moved == 0


def test_one_node_all_modes_agree(busy_rows):
    reqs = requests_of(busy_rows[:200], SMALL)
    one = dataclasses.replace(SMALL, nodes=1)
    runs = {m: run_mode(m, one, reqs) for m in (Mode.POW2, Mode.AFFINITY, Mode.GLOBAL, Mode.POOLED)}
    assert len({(r.hit_tokens, tuple(r.ttft_s), tuple(r.e2e_s)) for r in runs.values()}) == 1
    assert runs[Mode.GLOBAL].bytes_moved == 0
    assert run_mode(Mode.INFINITE, one, reqs).hit_rate >= runs[Mode.POW2].hit_rate


def test_clock_queue_decode_and_cost_model():
    # Two 10-block prompts sharing 4 blocks, arriving together on one node: the second waits
    # for the first's prefill (not its decode), then prefills only its 6 new blocks (its last
    # one 100 tokens short); each then decodes its output.
    rows = [
        {"timestamp": 0, "input_length": 5120, "output_length": 30, "hash_ids": list(range(10))},
        {
            "timestamp": 0,
            "input_length": 5020,
            "output_length": 7,
            "hash_ids": [0, 1, 2, 3] + list(range(100, 106)),
        },
    ]
    config = dataclasses.replace(SMALL, nodes=1)
    res = run_mode(Mode.POW2, config, requests_of(rows, config))
    rate, over, tpot = (
        config.cost.prefill_tokens_per_s,
        config.overhead_s,
        config.decode_s_per_token,
    )
    first = over + 5120 / rate
    second = first + over + (5020 - 2048) / rate
    assert res.ttft_s == pytest.approx([first, second])
    assert sorted(res.e2e_s) == pytest.approx(sorted([first + 30 * tpot, second + 7 * tpot]))
    assert res.hit_tokens == 2048 and res.prefill_tokens == 5120 + 5020 - 2048


def test_a_request_counts_in_its_nodes_queue_until_its_output_is_decoded():
    # Load-only routing sees a node busy while it decodes: with a long decode the second
    # request goes to the other node, with none it may land on the first again.
    rows = [
        {"timestamp": 0, "input_length": 512, "output_length": 1000, "hash_ids": [0]},
        {"timestamp": 5000, "input_length": 512, "output_length": 1, "hash_ids": [0]},
    ]
    config = dataclasses.replace(SMALL, nodes=2)
    reqs = requests_of(rows, config)
    seen: list[list[int]] = []

    class Watching(PowerOfTwo):
        def rank(self, req, nodes):
            seen.append([v.queued for v in nodes])
            return super().rank(req, nodes)

    import random

    simulate(Cluster(config, Watching(random.Random(0))), reqs, Mode.POW2)
    assert sorted(seen[1]) == [0, 1]  # 5 s later the first still decodes
    seen.clear()
    simulate(
        Cluster(dataclasses.replace(config, decode_s_per_token=0.0), Watching(random.Random(0))),
        reqs,
        Mode.POW2,
    )
    assert seen[1] == [0, 0]


def test_caches_stay_within_capacity_and_index_matches_the_caches(busy_rows):
    config = dataclasses.replace(SMALL, rebalance_every=20)
    reqs = requests_of(busy_rows, config)
    cluster = make_cluster(Mode.GLOBAL, config, reqs)
    assert isinstance(cluster, FabricCluster)
    res = simulate(cluster, reqs, Mode.GLOBAL)
    assert cluster.splits > 0  # the check covers routes that moved
    assert res.fetches > 0 and res.index_checked > 0 and res.index_disagreements == 0
    # The differential check, by hand: what the sharded index answers is what each node's
    # NodeCache really holds, for every request of the trace.
    assert cluster.index_disagreements(reqs) == []
    for req in reqs[::9]:
        said = {m.node: m.pages for m in cluster.index.lookup(req.keys)}
        held = {
            name: c.match(req.tokens, NAMESPACE).usable_pages
            for name, c in zip(cluster.names, cluster.caches)
        }
        assert said == {k: v for k, v in held.items() if v}
    for cache in cluster.caches:
        pool = cache.stats().pools["FULL/DEVICE"]
        assert pool["used"] <= pool["capacity"] == config.capacity_pages
        cache.check()


class CheckedFabric(FabricCluster):
    """Holds every index answer the router and the fetch planner get to what the nodes' caches
    really hold at that moment, splits included."""

    wrong = 0

    def lookup(self, req):
        got = super().lookup(req)
        truth = {}
        for i, c in enumerate(self.caches):
            m = c.match(req.tokens, NAMESPACE)
            if m.usable_pages:  # the slowest tier the match reads: the fastest that holds it all
                tier = next(
                    t
                    for t in Tier
                    if c.usable(m.path, m.usable_pages, TIERS[: t + 1]) == m.usable_pages
                )
                truth[i] = (m.usable_pages, tier)
        self.wrong += {i: (m.pages, m.tier) for i, m in got.items()} != truth
        return got


def test_every_index_answer_matches_the_caches_while_routes_split(busy_rows):
    from kvfabric.deploy.sim.cluster import fabric_score

    config = dataclasses.replace(SMALL, rebalance_every=10)
    reqs = requests_of(busy_rows, config)
    cluster = CheckedFabric(config, fabric_score(config))
    simulate(cluster, reqs, Mode.GLOBAL)
    assert cluster.splits >= 3 and cluster.lookups == 2 * len(reqs) and cluster.wrong == 0


def test_keys_are_per_block_and_per_tenant():
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [5, 6, 7]},
        {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [5, 6, 9]},
        {"timestamp": 2, "input_length": 900, "output_length": 1, "hash_ids": [8, 6]},
    ]
    a, b, c = requests_of(rows, SMALL)
    assert [len(r.tokens) for r in (a, b, c)] == [
        3 * SMALL.page_tokens,
        3 * SMALL.page_tokens,
        2 * SMALL.page_tokens,
    ]
    assert a.keys[:2] == b.keys[:2] and a.keys[2] != b.keys[2]
    assert c.keys[1] != a.keys[1]  # same block id under another prefix
    cache = make_cluster(Mode.POW2, SMALL, []).caches[0]
    assert cache.keys(a.tokens, NAMESPACE) == a.keys
    assert cache.keys(a.tokens, "other-tenant")[0] != a.keys[0]
    cache.put(a.tokens, None, NAMESPACE)
    assert cache.match(b.tokens, NAMESPACE).usable_pages == 2
    assert cache.match(a.tokens, "other-tenant").usable_pages == 0
    assert (a.hit_tokens(3), b.hit_tokens(2), b.hit_tokens(3)) == (1500, 1024, 1100)


def test_config_validation():
    assert SimConfig().capacity_pages == 1_000_000 // BLOCK_TOKENS
    for bad in (
        {"capacity_tokens": 100},
        {"nodes": 0},
        {"decode_s_per_token": -1},
        {"overhead_s": math.nan},
        {"page_tokens": 1},
        {"match_rate_threshold": 1.5},
        {"imbalanced_threshold": -1},
    ):
        with pytest.raises(ValueError):
            SimConfig(**bad)
