"""`kvfabric replay`: the simulated cluster on small synthetic traces in the Mooncake format."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from kvfabric.deploy.cli.main import main as cli
from kvfabric.deploy.placement import PowerOfTwo
from kvfabric.deploy.sim.cluster import NAMESPACE, Cluster, Mode, SimConfig, make_cluster, prepare
from kvfabric.deploy.sim.fabric import FabricCluster
from kvfabric.deploy.sim.replay import replay, run_mode, simulate
from kvfabric.deploy.sim.trace import BLOCK_TOKENS, TraceRequest, load_trace
from kvfabric.deploy.sim.workloads import Kind, conversations

# ---- synthetic traces ---------------------------------------------------------------------


def synthetic_trace(n: int, seed: int = 0, *, new_per_s: float = 1.0, systems: int = 20,
                    p_continue: float = 0.7, think_median_s: float = 60.0,
                    user_tokens: tuple[int, int] = (200, 6000)) -> list[dict]:
    """Multi-turn conversations under shared system prompts (Zipf-popular), in the Mooncake
    format (`kvfabric.deploy.sim.workloads`)."""
    kind = Kind(prefixes=systems, prefix_blocks=(1, 8), zipf=1.0, p_continue=p_continue,
                user_tokens=user_tokens, think_median_s=think_median_s)
    return conversations([kind], n, seed, new_per_s)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def requests_of(rows: list[dict], config: SimConfig):
    return prepare([TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
                    for r in rows], config)


SMALL = SimConfig(nodes=4, capacity_tokens=40 * BLOCK_TOKENS, shards=4)


@pytest.fixture(scope="module")
def busy_rows() -> list[dict]:
    """Conversations arriving faster than 4 nodes prefill them: routing must trade load
    against affinity, which is where a global cache pays."""
    return synthetic_trace(400, seed=7, new_per_s=4.0, think_median_s=2.0, user_tokens=(200, 2000))


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
    assert res[Mode.GLOBAL].bytes_moved > 0 == res[Mode.POW2].bytes_moved == res[Mode.AFFINITY].bytes_moved


def test_with_room_for_everything_global_equals_the_shared_caches():
    # One request at a time, far apart: every prefill ends before the next arrives, so every
    # mode sees the same completed prompts; a node stores whole prompts, so the best single
    # holder of a prefix holds all of it, and global fetches whatever another node holds.
    rows = [dict(r, timestamp=i * 100_000) for i, r in enumerate(synthetic_trace(160, seed=3))]
    config = dataclasses.replace(SMALL, capacity_tokens=10**8)
    reqs = requests_of(rows, config)
    res = {m: run_mode(m, config, reqs) for m in Mode}
    assert res[Mode.GLOBAL].hit_tokens == res[Mode.POOLED].hit_tokens == res[Mode.INFINITE].hit_tokens > 0
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
    rows = [{"timestamp": 0, "input_length": 5120, "output_length": 30, "hash_ids": list(range(10))},
            {"timestamp": 0, "input_length": 5020, "output_length": 7,
             "hash_ids": [0, 1, 2, 3] + list(range(100, 106))}]
    config = dataclasses.replace(SMALL, nodes=1)
    res = run_mode(Mode.POW2, config, requests_of(rows, config))
    rate, over, tpot = config.cost.prefill_tokens_per_s, config.overhead_s, config.decode_s_per_token
    first = over + 5120 / rate
    second = first + over + (5020 - 2048) / rate
    assert res.ttft_s == pytest.approx([first, second])
    assert sorted(res.e2e_s) == pytest.approx(sorted([first + 30 * tpot, second + 7 * tpot]))
    assert res.hit_tokens == 2048 and res.prefill_tokens == 5120 + 5020 - 2048


def test_a_request_counts_in_its_nodes_queue_until_its_output_is_decoded():
    # Load-only routing sees a node busy while it decodes: with a long decode the second
    # request goes to the other node, with none it may land on the first again.
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 1000, "hash_ids": [0]},
            {"timestamp": 5000, "input_length": 512, "output_length": 1, "hash_ids": [0]}]
    config = dataclasses.replace(SMALL, nodes=2)
    reqs = requests_of(rows, config)
    seen: list[list[int]] = []

    class Watching(PowerOfTwo):
        def rank(self, req, nodes):
            seen.append([v.queued for v in nodes])
            return super().rank(req, nodes)

    import random
    simulate(Cluster(config, Watching(random.Random(0))), reqs, Mode.POW2)
    assert sorted(seen[1]) == [0, 1]                  # 5 s later the first still decodes
    seen.clear()
    simulate(Cluster(dataclasses.replace(config, decode_s_per_token=0.0), Watching(random.Random(0))),
             reqs, Mode.POW2)
    assert seen[1] == [0, 0]


def test_caches_stay_within_capacity_and_index_matches_the_caches(busy_rows):
    config = dataclasses.replace(SMALL, rebalance_every=20)
    reqs = requests_of(busy_rows, config)
    cluster = make_cluster(Mode.GLOBAL, config, reqs)
    assert isinstance(cluster, FabricCluster)
    res = simulate(cluster, reqs, Mode.GLOBAL)
    assert cluster.splits > 0            # the check covers routes that moved
    assert res.fetches > 0 and res.index_checked > 0 and res.index_disagreements == 0
    # The differential check, by hand: what the sharded index answers is what each node's
    # NodeCache really holds, for every request of the trace.
    assert cluster.index_disagreements(reqs) == []
    for req in reqs[::9]:
        said = {m.node: m.pages for m in cluster.index.lookup(req.keys)}
        held = {name: c.match(req.tokens, NAMESPACE).usable_pages for name, c in zip(cluster.names, cluster.caches)}
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
        truth = {i: p for i, c in enumerate(self.caches) if (p := c.match(req.tokens, NAMESPACE).usable_pages)}
        self.wrong += got != truth
        return got


def test_every_index_answer_matches_the_caches_while_routes_split(busy_rows):
    from kvfabric.deploy.sim.cluster import fabric_score
    config = dataclasses.replace(SMALL, rebalance_every=10)
    reqs = requests_of(busy_rows, config)
    cluster = CheckedFabric(config, fabric_score(config))
    simulate(cluster, reqs, Mode.GLOBAL)
    assert cluster.splits >= 3 and cluster.lookups == 2 * len(reqs) and cluster.wrong == 0


def test_keys_are_per_block_and_per_tenant():
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [5, 6, 7]},
            {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [5, 6, 9]},
            {"timestamp": 2, "input_length": 900, "output_length": 1, "hash_ids": [8, 6]}]
    a, b, c = requests_of(rows, SMALL)
    assert [len(r.tokens) for r in (a, b, c)] == [3 * SMALL.page_tokens, 3 * SMALL.page_tokens,
                                                  2 * SMALL.page_tokens]
    assert a.keys[:2] == b.keys[:2] and a.keys[2] != b.keys[2]
    assert c.keys[1] != a.keys[1]                    # same block id under another prefix
    cache = make_cluster(Mode.POW2, SMALL, []).caches[0]
    assert cache.keys(a.tokens, NAMESPACE) == a.keys
    assert cache.keys(a.tokens, "other-tenant")[0] != a.keys[0]
    cache.put(a.tokens, None, NAMESPACE)
    assert cache.match(b.tokens, NAMESPACE).usable_pages == 2
    assert cache.match(a.tokens, "other-tenant").usable_pages == 0
    assert (a.hit_tokens(3), b.hit_tokens(2), b.hit_tokens(3)) == (1500, 1024, 1100)


# ---- the command --------------------------------------------------------------------------


def test_replay_command_prints_table_and_json(tmp_path, capsys, busy_rows):
    trace = write_trace(tmp_path / "t.jsonl", busy_rows[:150])
    plot = tmp_path / "hit.png"
    assert cli(["replay", "--trace", str(trace), "--nodes", "3", "--capacity-tokens", "20480,10240",
                "40960", "--shards", "4", "--json", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    out = json.loads(lines[-1])
    assert (out["requests"], out["nodes"], out["capacity_tokens"]) == (150, 3, 20480)
    assert set(out["modes"]) == {"pow2", "affinity", "global", "pooled", "infinite"}
    for fields in out["modes"].values():
        assert {"hit_rate", "prefill_tokens", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms"} <= set(fields)
        assert 0 <= fields["hit_rate"] <= 1
    g = out["modes"]["global"]
    assert g["index_disagreements"] == 0
    for base in ("pow2", "affinity", "pooled", "infinite"):
        assert out[f"global_over_{base}_hit_rate"] == pytest.approx(
            g["hit_rate"] / out["modes"][base]["hit_rate"], rel=1e-2)
    for base in ("pow2", "affinity"):
        assert out[f"global_over_{base}_ttft_p50"] == pytest.approx(
            g["ttft_p50_ms"] / out["modes"][base]["ttft_p50_ms"], rel=1e-2)
    assert out["global_over_infinite_hit_rate"] <= 1.0 + 1e-9
    assert out["shard_load_max_over_mean"] >= max(p["shard_load_max_over_mean"] for p in out["sweep"]) >= 1.0
    assert [p["capacity_tokens"] for p in out["sweep"]] == [20480, 10240, 40960]
    assert out["sweep"][0]["modes"] == out["modes"]
    # The infinite cache has no capacity: it ran once.
    assert len({json.dumps(p["modes"]["infinite"]) for p in out["sweep"]}) == 1
    assert any(line.startswith("global ") for line in lines) and "40,960 tokens per node" in captured.out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "150/150" in captured.err                  # the progress bar


def test_modes_pick_what_runs(tmp_path, capsys, busy_rows):
    trace = write_trace(tmp_path / "t.jsonl", busy_rows[:60])
    assert cli(["replay", "--trace", str(trace), "--nodes", "2", "--capacity-tokens", "20480",
                "--modes", "pow2,global", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["modes"]) == {"pow2", "global"}
    assert out["global_over_pow2_hit_rate"] is not None and out["global_over_affinity_hit_rate"] is None


def test_replay_keeps_what_the_trace_gives():
    reqs = requests_of(synthetic_trace(60, seed=1), SMALL)
    result = replay(SMALL, reqs)
    (point,) = result.points
    assert set(point.modes) == set(Mode)
    assert all(r.prompt_tokens == sum(q.input_length for q in reqs) for r in point.modes.values())
    for r in point.modes.values():
        assert r.hit_tokens + r.prefill_tokens == r.prompt_tokens
        assert len(r.ttft_s) == len(r.e2e_s) == len(reqs)
        assert all(e >= t for e, t in zip(sorted(r.e2e_s), sorted(r.ttft_s)))


@pytest.mark.parametrize("argv", [
    ["--nodes", "0"], ["--capacity-tokens", "511"], ["--capacity-tokens", "1000,x"], ["--shards", "0"],
    ["--requests", "0"], ["--prefill-tokens-per-s", "0"], ["--prefill-tokens-per-s", "nan"],
    ["--transfer-bytes-per-s", "-1"], ["--overhead-ms", "-1"], ["--fetch-overhead-ms", "inf"],
    ["--kv-bytes-per-token", "0"], ["--decode-ms-per-token", "-1"], ["--affinity-match-rate", "2"],
    ["--affinity-imbalance", "-1"], ["--modes", "local"], ["--page-tokens", "1"], ["--nodes", "two"],
    ["--bogus"], ["--plot", "/no/such/dir/x.png"]])
def test_bad_options_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli(["replay", *argv])
    assert e.value.code == 2


@pytest.mark.parametrize("body", [
    "", "\n\n", "not json\n", '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
    '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    '{"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
    '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}\n'])
def test_bad_traces_exit_2(tmp_path, capsys, body):
    path = tmp_path / "bad.jsonl"
    path.write_text(body)
    assert cli(["replay", "--trace", str(path), "--no-progress"]) == 2
    assert "kvfabric replay: error:" in capsys.readouterr().err


def test_missing_trace_exits_2(tmp_path, capsys):
    assert cli(["replay", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_synthetic_trace_is_valid_mooncake_format(tmp_path):
    rows = synthetic_trace(300, seed=5)
    loaded = load_trace(write_trace(tmp_path / "s.jsonl", rows))
    assert len(loaded) == 300
    firsts = {r.hash_ids[0] for r in loaded}
    assert 1 < len(firsts) <= 20                    # system prompts are shared


def test_config_validation():
    assert SimConfig().capacity_pages == 1_000_000 // BLOCK_TOKENS
    for bad in ({"capacity_tokens": 100}, {"nodes": 0}, {"decode_s_per_token": -1}, {"overhead_s": math.nan},
                {"page_tokens": 1}, {"match_rate_threshold": 1.5}, {"imbalanced_threshold": -1}):
        with pytest.raises(ValueError):
            SimConfig(**bad)
