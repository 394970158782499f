"""The vLLM demo's own parts without engines: conversation texts from the trace, the
streaming client against a real HTTP server speaking OpenAI's event stream, and the
report's arithmetic. (The demo end to end is `kvfabric demo`; its figures are in
docs/internals.md.)"""

from __future__ import annotations

import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvfabric.deploy.cli.demo import parse
from kvfabric.deploy.demo.conversation import (
    ALPHABET,
    PassResult,
    StreamingClient,
    Turn,
    conversation_texts,
    replay_conversations,
    single_turn_texts,
)
from kvfabric.deploy.demo.load import (
    LoadReport,
    poisson_arrivals,
    reserve_as_the_stock_engine,
    steady_rate,
)
from kvfabric.deploy.demo.vllm import Report
from kvfabric.deploy.harness.cluster import Endpoint
from kvfabric.deploy.harness.http_replay import conversations
from kvfabric.deploy.sim.trace import load_trace


def test_a_conversations_turns_share_their_earlier_text():
    convs = conversations(load_trace(None))[:5]
    texts = conversation_texts(convs, 32, 2000)
    for conv, turns in zip(convs, texts):
        assert len(turns) == len(conv) >= 3
        for a, b, ra, rb in zip(turns, turns[1:], conv, conv[1:]):
            same = next(
                (k for k, (x, y) in enumerate(zip(ra.hash_ids, rb.hash_ids)) if x != y),
                min(len(ra.hash_ids), len(rb.hash_ids)),
            )
            assert a[: 32 * same] == b[: 32 * same] and set(a + b) <= set(ALPHABET)
    assert all(len(t) <= 2000 for turns in texts for t in turns)


def test_single_turn_prompts_keep_their_requests_text_but_share_no_prefix():
    trace = load_trace(None)[:40]
    texts = single_turn_texts(trace, 32, 2000)
    assert len(texts) == 40 and set("".join(texts)) <= set(ALPHABET)
    assert len({t[:32] for t in texts}) == 40  # every first block its own
    # Past the first block, each is its request's text (the trace's requests all share
    # their first hash block, and many more).
    assert [t[32:] for t in texts] == [
        t[32:] for turns in conversation_texts([trace], 32, 2000) for t in turns
    ]
    assert texts == single_turn_texts(trace, 32, 2000)


def test_the_arrival_schedule_is_the_seeds_at_any_rate():
    one = poisson_arrivals(500, 2.0, seed=7)
    assert one == poisson_arrivals(500, 2.0, seed=7)  # both passes get this very schedule
    assert one != poisson_arrivals(500, 2.0, seed=8)
    assert one[0] == 0 and all(b >= a for a, b in zip(one, one[1:]))
    assert poisson_arrivals(500, 4.0, seed=7) == pytest.approx([t / 2 for t in one])
    # Exponential gaps scaled to a mean of 1/rate exactly: the pass offers the rate.
    assert one[-1] == pytest.approx(499 / 2.0)
    assert len(set(b - a for a, b in zip(one, one[1:]))) == 499  # not fixed intervals
    assert poisson_arrivals(0, 1.0, seed=7) == [] and poisson_arrivals(1, 1.0, seed=7) == [0.0]


class OpenAIStream(BaseHTTPRequestHandler):
    """Answers /v1/completions as vLLM's server does when streaming with usage. The
    prompt "hold" is answered once a "release" has come (or after 10 s, with an error)."""

    released = threading.Event()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "release":
            self.released.set()
        if body["prompt"] == "fail" or (
            body["prompt"] == "hold" and not self.released.wait(timeout=10)
        ):
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = len(body["prompt"])
        salted = "cache_salt" in body
        events = [{"choices": [{"text": "x", "token_ids": [i]}]} for i in range(body["max_tokens"])]
        events.append(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": n,
                    "prompt_tokens_details": {"cached_tokens": 0 if salted else n // 2},
                },
            }
        )
        for e in events:
            self._chunk(f"data: {json.dumps(e)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def log_message(self, *args):
        """Quiet: the test reads answers, not the server's access log."""


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), OpenAIStream)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Endpoint("127.0.0.1", httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def test_streamed_answers_give_tokens_usage_and_ttft_on_one_connection(server):
    client = StreamingClient(server, "m", timeout_s=10)
    try:
        for _ in range(3):  # keep-alive: the stream is read to its end
            turn = Turn(0, 0)
            client.complete("abcdef", 3, None, turn)
            assert (
                turn.token_ids == [0, 1, 2] and turn.prompt_tokens == 6 and turn.cached_tokens == 3
            )
            assert turn.ttft_ms > 0
            assert 0 < turn.sent_at < turn.last_token_at <= turn.done_at
            assert turn.tpot_ms >= 0 and turn.e2e_ms >= turn.ttft_ms
    finally:
        client.close()


def test_an_open_loop_sends_a_request_while_another_is_in_flight(server):
    """The server answers "hold" only once "release" has come: a sender that waited for
    the answer before sending the next would see "hold" fail."""
    OpenAIStream.released.clear()
    result = replay_conversations(
        "t",
        server,
        "m",
        [["hold"], ["release"]],
        2,
        concurrency=2,
        progress=False,
        arrivals=[0.0, 0.01],
    )
    assert result.failed == 0
    hold, release = result.turns
    assert release.sent_at < hold.done_at and result.send_lag_ms >= 0


def test_a_failed_request_is_counted_and_the_rest_go_on(server):
    texts = [["abc", "fail", "abcd"], ["xy"]]
    told: list[int] = []
    result = replay_conversations(
        "t",
        server,
        "m",
        texts,
        2,
        concurrency=2,
        uncached=True,
        progress=False,
        on_done=told.append,
    )
    assert sorted(told) == [1, 2, 3, 4]  # every finished request, the failed one too
    assert result.failed == 1 and "Error code: 400" in result.turns[1].error
    assert {(t.conversation, t.turn) for t in result.done} == {(0, 0), (0, 2), (1, 0)}
    assert result.cached_tokens == 0  # every request had a fresh cache_salt


def turn(c, k, ids, prompt=100, cached=0, ttft=10.0, error=""):
    return Turn(c, k, prompt, cached, ttft, ids, error)


def test_the_report_compares_outputs_and_splits_hits_by_tier():
    nocache = PassResult("nocache", [turn(0, 0, [1]), turn(0, 1, [2]), turn(1, 0, [3])], 1.0)
    baseline = PassResult(
        "baseline",
        [
            turn(0, 0, [1], cached=10, ttft=100),
            turn(0, 1, [2], ttft=300),
            turn(1, 0, [], error="boom"),
        ],
        1.0,
    )
    fabric = PassResult(
        "fabric",
        [
            turn(0, 0, [1], cached=50, ttft=40),
            turn(0, 1, [9], cached=60, ttft=60),
            turn(1, 0, [3], cached=20, ttft=50),
        ],
        1.0,
    )
    counts = {
        "loaded_tokens": 70,
        "remote_loaded_tokens": 30,
        "nixl_bytes": 4096,
        "object_store_bytes": 0,
    }
    r = Report.of({"caching off": nocache, "baseline": baseline, "fabric": fabric}, counts, nodes=2)
    assert r.output_mismatches == 1 and r.baseline_output_mismatches == 1 and r.failed_requests == 1
    assert (r.device_hit_tokens, r.host_hit_tokens, r.remote_hit_tokens) == (60, 40, 30)
    assert r.hit_rate == pytest.approx(130 / 300)
    assert r.ttft_p50_ms == 50 and r.baseline_ttft_p50_ms == 200 and r.ratio == pytest.approx(0.25)
    out = r.as_json()
    assert (
        out["engine"] == "vllm" and out["object_store_kv_bytes"] == 0 and out["nixl_bytes"] == 4096
    )
    assert r.first_errors == {"baseline": "boom"}


def test_the_warm_restart_figure_compares_the_requests_either_side_of_the_restart(monkeypatch):
    from kvfabric.deploy.demo import warm_restart

    restarts: list[str] = []
    monkeypatch.setattr(warm_restart, "restart_node_actors", lambda m: restarts.append(m) or 7)
    restarter = warm_restart.Restarter("m", after=3)
    turns = [
        Turn(0, 0, 100, 90, 1.0, [1], sent_at=1.0, done_at=2.0),  # before: 90 + 50 of 200
        Turn(0, 1, 100, 50, 1.0, [1], sent_at=3.0, done_at=9.0),
        Turn(1, 0, 100, 0, 1.0, [1], sent_at=9.5, done_at=12.0),  # in flight: neither side
        Turn(1, 1, 100, 70, 1.0, [1], sent_at=21.0, done_at=22.0),  # after: 70 + 0 of 200
        Turn(2, 0, 100, 0, 1.0, [1], sent_at=23.0, done_at=24.0),
        Turn(2, 1, 100, 100, 1.0, [], error="x", sent_at=25.0, done_at=26.0),  # failed
    ]
    assert restarter.report(PassResult("fabric", turns, 30.0)) is None  # it never ran
    restarter(2)
    assert restarts == []  # only the `after`-th request restarts
    restarter(3)
    assert restarts == ["m"]
    restarter.began, restarter.ended = 10.0, 20.0  # on the turns' clock
    got = restarter.report(PassResult("fabric", turns, 30.0))
    assert got is not None and (got.window, got.adopted_pages) == (2, 7)
    assert (got.hit_rate_before, got.hit_rate_after) == (0.7, 0.35)
    assert got.ratio == pytest.approx(0.5) and got.as_json()["ratio"] == 0.5
    assert "ratio 0.50" in got.line()
    assert got.before == ((0, 0), (0, 1)) and got.revisit_hit_rate is None
    # The window before, sent again: request i re-sent before[i]; one output differs.
    again = PassResult(
        "revisit",
        [Turn(0, 0, 100, 100, 1.0, [1]), Turn(1, 0, 100, 80, 1.0, [5])],
        3.0,
    )
    revisited = got.revisited(again, {(0, 0): [1], (0, 1): [1]})
    assert (revisited.revisit_hit_rate, revisited.revisit_mismatches) == (0.9, 1)
    assert "90.0%, 1 outputs differing" in revisited.line()
    assert revisited.as_json()["revisit_hit_rate"] == 0.9


def test_the_warm_restart_arguments_are_checked_before_anything_starts(capsys):
    from kvfabric.deploy.demo.vllm import TEMPORARY

    plain, disk = parse([]), parse(["--disk", "--requests", "120"])
    assert (plain.disk, plain.restart_after) == ("", 0)
    assert (disk.disk, disk.restart_after) == (TEMPORARY, 60)
    assert parse(["--disk", "/mnt/kv", "--restart-after", "10"]).restart_after == 10
    assert parse(["--restart-after", "10"]).disk == ""  # restarts cold: the comparison
    for bad in (
        ["--disk", "relative"],
        ["--restart-after", "60"],
        ["--restart-after", "0"],
        ["--engine", "reference", "--disk"],
        ["--rate", "1", "--disk"],
        ["--address", "ray://x:1", "--disk"],
    ):
        with pytest.raises(SystemExit):
            parse(bad)


def test_the_disk_demo_gives_each_node_a_disk_tier():
    from kvfabric.deploy.demo.vllm import DISK_PAGES, app_args

    app = app_args(2, 8 << 20, disk_folder="/tmp/x")
    assert (app.disk_pages, app.disk_folder, app.disk_write) == (
        DISK_PAGES,
        "/tmp/x",
        "write_through",
    )
    assert app_args(2, 8 << 20).disk_pages == 0


def timed(i, ids, sent, ttft_ms, last, done, error=""):
    """A request of an open-loop pass: sent at `sent` s, its last token at `last`."""
    return Turn(i, 0, 100, 0, ttft_ms, ids, error, sent_at=sent, last_token_at=last, done_at=done)


def test_the_load_report_gives_throughput_tpot_and_their_ratios():
    baseline = PassResult(
        "baseline",
        [
            # TPOT (last - first token) / (tokens - 1): (0.5 - 0.2) / 3 s = 100 ms
            timed(0, [1, 2, 3, 4], sent=10.0, ttft_ms=200, last=10.5, done=10.6),
            timed(1, [5, 6, 7, 8], sent=11.0, ttft_ms=100, last=11.4, done=11.5),  # 100 ms
            timed(2, [9, 9, 9, 9], sent=12.0, ttft_ms=300, last=12.9, done=14.0),  # 200 ms
        ],
        4.0,
    )
    fabric = PassResult(
        "fabric",
        [
            timed(0, [1, 2, 3, 4], sent=20.0, ttft_ms=200, last=20.8, done=20.9),  # 200 ms
            timed(1, [5, 6, 0, 8], sent=21.0, ttft_ms=100, last=21.7, done=21.8),  # 200 ms
            timed(2, [], sent=22.0, ttft_ms=0, last=0, done=0, error="boom"),
        ],
        2.0,
    )
    counts = {"saved_requests": 2, "loaded_tokens": 0, "object_store_bytes": None}
    r = LoadReport.of(
        {"baseline": baseline, "fabric": fabric},
        counts,
        nodes=2,
        seed=0,
        max_tokens=4,
        offered_rate=1.0,
        capacity_rate=1.2,
        probe_concurrency=6,
    )
    # Baseline: 12 tokens, 3 requests from its first send (10.0) to its last end (14.0).
    assert r.baseline.output_tokens == 12 and r.baseline.span_s == pytest.approx(4.0)
    assert r.baseline.throughput == pytest.approx(3.0)
    assert r.baseline.request_rate == pytest.approx(0.75)
    assert r.baseline.tpot_p50_ms == pytest.approx(100)
    assert r.baseline.ttft_p50_ms == 200 and r.baseline.e2e_p50_ms == pytest.approx(600)
    # Fabric: 8 tokens over 20.0 - 21.8 (the failed request's send counts, not its end).
    assert r.fabric.throughput == pytest.approx(8 / 1.8) and r.fabric.failed == 1
    assert r.fabric.tpot_p50_ms == pytest.approx(200)
    assert r.throughput_ratio == pytest.approx(8 / 1.8 / 3.0)
    assert r.tpot_ratio == pytest.approx(2.0)
    # Request 1's tokens differ; request 2 failed, counted as a failure only.
    assert r.output_mismatches == 1 and r.failed_requests == 1
    assert r.first_errors == {"fabric": "boom"}
    out = r.as_json()
    assert out["tpot_p50_ratio_vs_baseline"] == 2.0 and out["offered_rate"] == 1.0
    assert out["baseline_capacity_rate"] == 1.2 and out["capacity_probe_concurrency"] == 6
    assert out["connector"] == {
        "saved_requests": 2,
        "loaded_tokens": 0,
    }
    assert out["baseline"]["throughput_tok_s"] == 3.0
    assert json.loads(json.dumps(out)) == out


def test_a_single_token_has_no_tpot():
    assert math.isnan(timed(0, [1], sent=1.0, ttft_ms=10, last=1.01, done=1.02).tpot_ms)


def test_capacity_is_the_rate_while_every_sender_was_busy():
    # 8 requests, 2 senders: the 2nd completion (t=2) to the 6th, which let the last
    # request go (t=6): 4 completions in 4 s; the drain (t=20) is left out.
    ends = [1, 2, 3, 4, 5, 6, 10, 20]
    result = PassResult("p", [timed(i, [1], 0.5, 1, e, e) for i, e in enumerate(ends)], 20)
    assert steady_rate(result, 2) == pytest.approx(1.0)
    # Too short for that: the whole pass, from the first send.
    short = PassResult("p", [timed(i, [1], 0.5, 1, e, e) for i, e in enumerate([1, 2])], 2)
    assert steady_rate(short, 2) == pytest.approx(2 / 1.5)


@pytest.mark.parametrize("nodes", [1, 2, 3, 8])
def test_the_simulated_nodes_leave_room_for_the_fabric_beside_the_engines(nodes):
    """Each node holds its engine's bundle and its node actor; the directory, the index
    shards and the ingress fit in what the nodes have left (one node once had none)."""
    from kvfabric.deploy.demo.vllm import ENGINE_CPUS, cpus_per_node
    from kvfabric.deploy.vllm.connector.jobs import FabricSettings
    from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs
    from kvfabric.deploy.vllm.serve.serve_llm import INGRESS_CPUS

    actor = FabricSettings().node_cpus
    left = cpus_per_node(nodes) - ENGINE_CPUS - actor
    assert left >= 0
    assert nodes * left >= actor * (1 + LLMAppArgs.model_fields["shards"].default) + INGRESS_CPUS


def test_the_demo_defaults_follow_the_engine():
    vllm, ref = parse([]), parse(["--engine", "reference"])
    assert (vllm.engine, vllm.nodes, vllm.requests, vllm.concurrency) == ("vllm", 2, 60, 6)
    assert (ref.nodes, ref.requests, ref.concurrency) == (3, 120, 3)
    assert parse(["--requests", "7"]).requests == 7


def test_the_gpu_demo_shares_the_one_gpu_among_its_engines():
    from kvfabric.deploy.demo.vllm import app_args

    cpu, gpu = app_args(2, 8 << 20), app_args(3, 8 << 20, gpu=True)
    assert (cpu.gpus_per_replica, cpu.gpu_memory_utilization, cpu.device()) == (0.0, 0.9, "cpu")
    assert (gpu.gpus_per_replica, gpu.gpu_memory_utilization, gpu.device()) == (1.0, 0.267, "cuda")
    # Nothing else differs.
    assert gpu.but(gpus_per_replica=0.0, gpu_memory_utilization=0.9) == cpu.but(replicas=3)


def test_the_load_modes_arguments_are_checked_before_anything_starts(capsys):
    auto, fixed = parse(["--rate", "auto"]), parse(["--rate", "1.5", "--max-tokens", "8"])
    assert (auto.rate, auto.max_tokens, auto.seed) == ("auto", 32, 0)
    assert (fixed.rate, fixed.max_tokens) == (1.5, 8)
    assert parse([]).rate is None and parse([]).max_tokens == 8
    for bad in (["--rate", "0"], ["--rate", "-2"], ["--rate", "fast"], ["--rate", "inf"]):
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(SystemExit):
        parse(["--engine", "reference", "--rate", "1"])
    assert "--rate is for the vllm engine" in capsys.readouterr().err


def test_the_load_demos_engines_reserve_as_the_stock_engine_unless_the_user_said(monkeypatch):
    """vLLM reserves one core more for an engine with a connector: the load demo's passes
    reserve what the stock engine does, so both run the same engines."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    reserve_as_the_stock_engine()
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")
    reserve_as_the_stock_engine()
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "3"
