"""`kvfabric replay`: the simulated cluster on small synthetic traces in the Mooncake format."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

import pytest

from deploy.cli import main as cli
from deploy.sim_cluster import (NAMESPACE, GlobalPolicy, LocalPolicy, Mode, SimConfig, make_policy,
                                prepare)
from deploy.simulate import replay, run_mode, simulate
from deploy.trace import BLOCK_TOKENS, TraceRequest, load_trace

# ---- synthetic traces ---------------------------------------------------------------------


def synthetic_trace(n: int, seed: int = 0, *, new_per_s: float = 1.0, systems: int = 20,
                    p_continue: float = 0.7, think_median_s: float = 60.0,
                    user_tokens: tuple[int, int] = (200, 6000)) -> list[dict]:
    """Multi-turn conversations under shared system prompts (Zipf-popular), in the Mooncake
    format. Conversations start as a Poisson process; each turn's prompt is the previous one
    plus its answer plus a new user message, after a log-normal think time (some come back
    much later). As in the real trace, a turn keeps the hash ids of the previous prompt's
    whole blocks; its partial last block and everything after get new ids."""
    rng = random.Random(seed)
    ids = itertools.count()
    prompts = [[next(ids) for _ in range(rng.randint(1, 8))] for _ in range(systems)]
    weights = [1 / (k + 1) for k in range(systems)]
    rows: list[dict] = []
    t = 0.0
    while len(rows) < 4 * n:
        t += rng.expovariate(new_per_s)
        system = rng.choices(prompts, weights)[0]
        length, hashes, at = len(system) * BLOCK_TOKENS, list(system), t
        while True:
            length += rng.randint(*user_tokens)
            if length > 128_000:
                break
            hashes = hashes + [next(ids) for _ in range(-(-length // BLOCK_TOKENS) - len(hashes))]
            output = rng.randint(20, 800)
            rows.append({"timestamp": int(at * 1e3), "input_length": length, "output_length": output,
                         "hash_ids": list(hashes)})
            if rng.random() > p_continue:
                break
            hashes = hashes[: length // BLOCK_TOKENS]      # the partial last block changes
            length += output
            at += rng.lognormvariate(math.log(think_median_s), 1.5)
        if len(rows) >= 4 * n:
            break
    rows.sort(key=lambda r: r["timestamp"])
    return rows[:n]


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


def test_infinite_ge_global_ge_local_under_heavy_sharing(busy_rows):
    # No load slack: the router sends a request to the least loaded node whatever it holds.
    config = dataclasses.replace(SMALL, load_bound=0, capacity_tokens=100 * BLOCK_TOKENS)
    reqs = requests_of(busy_rows, config)
    res = {m: run_mode(m, config, reqs) for m in Mode}
    hit = {m: r.hit_rate for m, r in res.items()}
    assert hit[Mode.INFINITE] >= hit[Mode.GLOBAL] > 1.1 * hit[Mode.LOCAL] > 0
    assert res[Mode.GLOBAL].ttft_ms(0.5) < res[Mode.LOCAL].ttft_ms(0.5)


def test_with_room_for_everything_global_equals_infinite():
    # Requests come in bursts of one per node, far apart: every prefill of a burst ends before
    # the next, so every mode sees the same completed prompts, and the best single holder of
    # a prefix holds all of it (a node stores whole prompts).
    rows = [dict(r, timestamp=(i // SMALL.nodes) * 100_000) for i, r in enumerate(synthetic_trace(160, seed=3))]
    config = dataclasses.replace(SMALL, capacity_tokens=10**8, load_bound=0)
    reqs = requests_of(rows, config)
    res = {m: run_mode(m, config, reqs) for m in Mode}
    assert res[Mode.GLOBAL].hit_tokens == res[Mode.INFINITE].hit_tokens > 0
    assert res[Mode.GLOBAL].prefill_tokens == res[Mode.INFINITE].prefill_tokens
    # A burst fills every node: the holder is often busy, so local recomputes what global fetches.
    assert res[Mode.GLOBAL].hit_tokens > res[Mode.LOCAL].hit_tokens
    assert res[Mode.GLOBAL].bytes_moved > 0 == res[Mode.LOCAL].bytes_moved
    # One at a time, nobody is busy: local routing alone finds every prefix's holder.
    spaced = [dict(r, timestamp=i * 100_000) for i, r in enumerate(rows)]
    reqs = requests_of(spaced, config)
    hits = {m: run_mode(m, config, reqs).hit_tokens for m in Mode}
    assert len(set(hits.values())) == 1


def test_one_node_all_modes_agree(busy_rows):
    reqs = requests_of(busy_rows[:200], SMALL)
    one = dataclasses.replace(SMALL, nodes=1)
    local, glob = run_mode(Mode.LOCAL, one, reqs), run_mode(Mode.GLOBAL, one, reqs)
    assert (local.hit_tokens, local.ttft_s) == (glob.hit_tokens, glob.ttft_s) and glob.bytes_moved == 0
    big = dataclasses.replace(one, capacity_tokens=10**8)
    hits = {m: run_mode(m, big, reqs).hit_tokens for m in Mode}
    assert len(set(hits.values())) == 1 and hits[Mode.LOCAL] > 0
    assert run_mode(Mode.INFINITE, one, reqs).hit_rate >= local.hit_rate


def test_clock_queue_and_cost_model():
    # Two 10-block prompts sharing 4 blocks, arriving together on one node: the second waits
    # for the first, then prefills only its 6 new blocks (its last one 100 tokens short).
    rows = [{"timestamp": 0, "input_length": 5120, "output_length": 1, "hash_ids": list(range(10))},
            {"timestamp": 0, "input_length": 5020, "output_length": 1,
             "hash_ids": [0, 1, 2, 3] + list(range(100, 106))}]
    config = dataclasses.replace(SMALL, nodes=1)
    res = run_mode(Mode.LOCAL, config, requests_of(rows, config))
    rate, over = config.cost.prefill_tokens_per_s, config.overhead_s
    first = over + 5120 / rate
    assert res.ttft_s == pytest.approx([first, first + over + (5020 - 2048) / rate])
    assert res.hit_tokens == 2048 and res.prefill_tokens == 5120 + 5020 - 2048


def test_caches_stay_within_capacity_and_index_matches_the_caches(busy_rows):
    config = dataclasses.replace(SMALL, rebalance_every=20)
    reqs = requests_of(busy_rows, config)
    policy = make_policy(Mode.GLOBAL, config, reqs)
    assert isinstance(policy, GlobalPolicy)
    res = simulate(policy, reqs)
    assert policy.splits > 0            # the check covers routes that moved
    assert res.fetches > 0 and res.index_checked > 0 and res.index_disagreements == 0
    # The differential check, by hand: what the sharded index answers is what each node's
    # NodeCache really holds, for every request of the trace.
    assert policy.index_disagreements(reqs) == []
    for req in reqs[::9]:
        said = {m.node: m.pages for m in policy.index.lookup(req.keys)}
        held = {n.name: n.cache.match(req.tokens, NAMESPACE).pages for n in policy.nodes}
        assert said == {k: v for k, v in held.items() if v}
    for node in policy.nodes:
        pool = node.cache.stats().pools["FULL/DEVICE"]
        assert pool["used"] <= pool["capacity"] == config.capacity_pages
        node.cache.check()


class CheckedGlobal(GlobalPolicy):
    """Holds every index answer the router and the fetch planner get to what the nodes' caches
    really hold at that moment, splits (and skipped resends) included."""

    def _lookup(self, req):
        got = super()._lookup(req)
        truth = {i: p for i, n in enumerate(self.nodes) if (p := n.cache.match(req.tokens, NAMESPACE).pages)}
        self.wrong += got != truth
        return got


@pytest.mark.parametrize("sigmas", [0.0, 2.0])
def test_every_index_answer_matches_the_caches_while_routes_split(busy_rows, sigmas):
    config = dataclasses.replace(SMALL, rebalance_every=10, rebalance_sigmas=sigmas, rebalance_target=1.0)
    reqs = requests_of(busy_rows, config)
    policy = CheckedGlobal(config)
    policy.wrong = 0
    simulate(policy, reqs)
    assert policy.splits >= 5 and policy.lookups == 2 * len(reqs) and policy.wrong == 0


def test_keys_are_per_block_and_per_tenant():
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [5, 6, 7]},
            {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [5, 6, 9]},
            {"timestamp": 2, "input_length": 900, "output_length": 1, "hash_ids": [8, 6]}]
    a, b, c = requests_of(rows, SMALL)
    assert [len(r.tokens) for r in (a, b, c)] == [3 * SMALL.page_tokens, 3 * SMALL.page_tokens,
                                                  2 * SMALL.page_tokens]
    assert a.keys[:2] == b.keys[:2] and a.keys[2] != b.keys[2]
    assert c.keys[1] != a.keys[1]                    # same block id under another prefix
    policy = LocalPolicy(SMALL)
    cache = policy.nodes[0].cache
    assert cache.keys(a.tokens, NAMESPACE) == a.keys
    assert cache.keys(a.tokens, "other-tenant")[0] != a.keys[0]
    cache.put(a.tokens, None, NAMESPACE)
    assert cache.match(b.tokens, NAMESPACE).pages == 2
    assert cache.match(a.tokens, "other-tenant").pages == 0
    assert (a.hit_tokens(3), b.hit_tokens(2), b.hit_tokens(3)) == (1500, 1024, 1100)


# ---- the command --------------------------------------------------------------------------


def test_replay_command_prints_table_and_json(tmp_path, capsys, busy_rows):
    trace = write_trace(tmp_path / "t.jsonl", busy_rows[:150])
    plot = tmp_path / "hit.png"
    assert cli(["replay", "--trace", str(trace), "--nodes", "3", "--capacity-tokens", "20480",
                "--shards", "4", "--json", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    out = json.loads(lines[-1])
    assert (out["requests"], out["nodes"], out["capacity_tokens"]) == (150, 3, 20480)
    for mode in ("local", "global", "infinite"):
        assert {"hit_rate", "prefill_tokens", "ttft_p50_ms", "ttft_p99_ms"} <= set(out["modes"][mode])
        assert 0 <= out["modes"][mode]["hit_rate"] <= 1
    g = out["modes"]["global"]
    assert g["index_disagreements"] == 0
    assert out["global_over_local_hit_rate"] == pytest.approx(
        g["hit_rate"] / out["modes"]["local"]["hit_rate"], rel=1e-2)
    assert out["global_over_infinite_hit_rate"] <= 1.0 + 1e-9
    assert out["shard_load_max_over_mean"] >= 1.0
    assert {(s["mode"], s["capacity_tokens"]) for s in out["sweep"]} >= {
        ("local", 5120), ("global", 10240), ("global", 40960)}
    assert any(line.startswith("global ") for line in lines) and "2.22" in captured.out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "150/150" in captured.err                  # the progress bar


def test_replay_keeps_what_the_trace_gives():
    reqs = requests_of(synthetic_trace(60, seed=1), SMALL)
    result = replay(SMALL, reqs)
    assert set(result.main) == set(Mode) and len(result.sweep) == 3
    assert sum(r.input_length for r in reqs) == result.main[Mode.LOCAL].prompt_tokens
    for r in result.main.values():
        assert r.hit_tokens + r.prefill_tokens == r.prompt_tokens and len(r.ttft_s) == len(reqs)


@pytest.mark.parametrize("argv", [
    ["--nodes", "0"], ["--capacity-tokens", "511"], ["--shards", "0"], ["--requests", "0"],
    ["--prefill-tokens-per-s", "0"], ["--prefill-tokens-per-s", "nan"], ["--transfer-bytes-per-s", "-1"],
    ["--overhead-ms", "-1"], ["--fetch-overhead-ms", "inf"], ["--kv-bytes-per-token", "0"],
    ["--load-bound", "-1"], ["--page-tokens", "1"], ["--nodes", "two"], ["--bogus"],
    ["--plot", "/no/such/dir/x.png"]])
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
    assert SimConfig().capacity_pages == 3_000_000 // BLOCK_TOKENS
    for bad in ({"capacity_tokens": 100}, {"nodes": 0}, {"load_bound": -1}, {"overhead_s": math.nan},
                {"page_tokens": 1}, {"rebalance_target": 0.5}):
        with pytest.raises(ValueError):
            SimConfig(**bad)
