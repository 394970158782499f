"""`kvfabric replay`: the command on small synthetic traces in the Mooncake format, and what it
refuses. The simulated cluster it runs: tests/deploy/test_simulate.py."""

from __future__ import annotations

import json

import pytest
from kvfabric.deploy.cli.main import main as cli
from kvfabric.deploy.sim.cluster import Mode
from kvfabric.deploy.sim.replay import replay
from kvfabric.deploy.sim.trace import load_trace

from tests.deploy.sim_traces import SMALL, busy_trace, requests_of, synthetic_trace, write_trace


def test_replay_command_prints_table_and_json(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", busy_trace()[:150])
    plot = tmp_path / "hit.png"
    assert (
        cli(
            [
                "replay",
                "--trace",
                str(trace),
                "--nodes",
                "3",
                "--capacity-tokens",
                "20480,10240",
                "40960",
                "--shards",
                "4",
                "--json",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    out = json.loads(lines[-1])
    assert (out["requests"], out["nodes"], out["capacity_tokens"]) == (150, 3, 20480)
    assert set(out["modes"]) == {"pow2", "affinity", "global", "pooled", "infinite"}
    for fields in out["modes"].values():
        assert {"hit_rate", "prefill_tokens", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms"} <= set(
            fields
        )
        assert 0 <= fields["hit_rate"] <= 1
    g = out["modes"]["global"]
    assert g["index_disagreements"] == 0
    for base in ("pow2", "affinity", "pooled", "infinite"):
        assert out[f"global_over_{base}_hit_rate"] == pytest.approx(
            g["hit_rate"] / out["modes"][base]["hit_rate"], rel=1e-2
        )
    for base in ("pow2", "affinity"):
        assert out[f"global_over_{base}_ttft_p50"] == pytest.approx(
            g["ttft_p50_ms"] / out["modes"][base]["ttft_p50_ms"], rel=1e-2
        )
    assert out["global_over_infinite_hit_rate"] <= 1.0 + 1e-9
    assert (
        out["shard_load_max_over_mean"]
        >= max(p["shard_load_max_over_mean"] for p in out["sweep"])
        >= 1.0
    )
    assert [p["capacity_tokens"] for p in out["sweep"]] == [20480, 10240, 40960]
    assert out["sweep"][0]["modes"] == out["modes"]
    # The infinite cache has no capacity: it ran once.
    assert len({json.dumps(p["modes"]["infinite"]) for p in out["sweep"]}) == 1
    assert (
        any(line.startswith("global ") for line in lines)
        and "40,960 tokens per node" in captured.out
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert captured.err == ""  # a progress bar only on a terminal: a log gets no redraws


def test_the_progress_bar_counts_each_run_to_its_end():
    import io

    from kvfabric.deploy.sim.replay import Bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    bar = Bar(150, stream=out)
    for label in ("global", "pooled"):
        update = bar.for_run(label)
        for done in (1, 75, 150):
            update(done)
    bar.close()
    text = out.getvalue()
    assert "global" in text and "pooled" in text and text.count("150/150") == 2, text


def test_modes_pick_what_runs(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", busy_trace()[:60])
    assert (
        cli(
            [
                "replay",
                "--trace",
                str(trace),
                "--nodes",
                "2",
                "--capacity-tokens",
                "20480",
                "--modes",
                "pow2,global",
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["modes"]) == {"pow2", "global"}
    assert (
        out["global_over_pow2_hit_rate"] is not None
        and out["global_over_affinity_hit_rate"] is None
    )


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


@pytest.mark.parametrize(
    "argv",
    [
        ["--nodes", "0"],
        ["--capacity-tokens", "511"],
        ["--capacity-tokens", "1000,x"],
        ["--shards", "0"],
        ["--requests", "0"],
        ["--prefill-tokens-per-s", "0"],
        ["--prefill-tokens-per-s", "nan"],
        ["--transfer-bytes-per-s", "-1"],
        ["--overhead-ms", "-1"],
        ["--fetch-overhead-ms", "inf"],
        ["--kv-bytes-per-token", "0"],
        ["--decode-ms-per-token", "-1"],
        ["--affinity-match-rate", "2"],
        ["--affinity-imbalance", "-1"],
        ["--modes", "local"],
        ["--page-tokens", "1"],
        ["--nodes", "two"],
        ["--bogus"],
        ["--plot", "/no/such/dir/x.png"],
    ],
)
def test_bad_options_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli(["replay", *argv])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "body",
    [
        "",
        "\n\n",
        "not json\n",
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}\n',
    ],
)
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
    assert 1 < len(firsts) <= 20  # system prompts are shared
