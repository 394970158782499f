"""The vLLM demo's own parts without engines: conversation texts from the trace, the
streaming client against a real HTTP server speaking OpenAI's event stream, and the
report's arithmetic. (The demo end to end is `kvfabric demo`; its figures are in
docs/internals.md.)"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvfabric.deploy.cli.cluster import Endpoint
from kvfabric.deploy.cli.demo import parse
from kvfabric.deploy.cli.http_replay import conversations
from kvfabric.deploy.sim.trace import load_trace
from kvfabric.deploy.vllm.conversation_replay import (
    ALPHABET,
    PassResult,
    StreamingClient,
    Turn,
    conversation_texts,
    replay_conversations,
)
from kvfabric.deploy.vllm.demo import Report


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


class OpenAIStream(BaseHTTPRequestHandler):
    """Answers /v1/completions as vLLM's server does when streaming with usage."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "fail":
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
    finally:
        client.close()


def test_a_failed_request_is_counted_and_the_rest_go_on(server):
    texts = [["abc", "fail", "abcd"], ["xy"]]
    result = replay_conversations(
        "t", server, "m", texts, 2, concurrency=2, uncached=True, progress=False
    )
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


def test_the_demo_defaults_follow_the_engine():
    vllm, ref = parse([]), parse(["--engine", "reference"])
    assert (vllm.engine, vllm.nodes, vllm.requests, vllm.concurrency) == ("vllm", 2, 60, 6)
    assert (ref.nodes, ref.requests, ref.concurrency) == (3, 120, 3)
    assert parse(["--requests", "7"]).requests == 7


def test_the_gpu_demo_shares_the_one_gpu_among_its_engines():
    from kvfabric.deploy.vllm.demo import app_args

    cpu, gpu = app_args(2, 8 << 20), app_args(3, 8 << 20, gpu=True)
    assert (cpu.gpus_per_replica, cpu.gpu_memory_utilization, cpu.device()) == (0.0, 0.9, "cpu")
    assert (gpu.gpus_per_replica, gpu.gpu_memory_utilization, gpu.device()) == (1.0, 0.267, "cuda")
    # Nothing else differs.
    assert gpu.but(gpus_per_replica=0.0, gpu_memory_utilization=0.9) == cpu.but(replicas=3)
