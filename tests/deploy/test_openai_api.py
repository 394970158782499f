"""The OpenAI-compatible ingress: happy paths against a real TinyLM engine, backend failures
as 503, the Serve deployment's late-bound app, and the real `openai` client over uvicorn.
Every 4xx case and fuzzed bodies: tests/deploy/test_openai_refusals.py. API keys:
tests/deploy/test_ingress_auth.py."""

import asyncio
import gc
import json
import socket
import threading
import time
import warnings

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from kvfabric.deploy.reference.engine import Engine, RequestError
from kvfabric.deploy.reference.serve.openai_api import (
    CompletionResponse,
    OpenAIIngress,
    build_fastapi,
)
from kvfabric.deploy.serving.cache_namespace import cache_namespace

from tests.deploy.ingress_backends import (
    CHAT_URL,
    CONFIG,
    KEY,
    LIMIT,
    MODEL,
    NAME,
    TENANTS,
    TOK,
    URL,
    EngineBackend,
    FakeBackend,
    assert_error,
    chat,
    client_for,
    ok,
    post,
)


# --- happy paths ---------------------------------------------------------------------------
def test_string_prompt_matches_the_engine():
    backend = EngineBackend()
    r = post(
        client_for(backend),
        {
            "model": NAME,
            "prompt": "Hello, fabric",
            "max_tokens": 5,
            "temperature": 0,
            "n": 1,
            "top_p": 1.0,
            "seed": 7,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    CompletionResponse.model_validate(body)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == NAME and abs(body["created"] - time.time()) < 60
    prompt = TOK.encode("Hello, fabric")
    want = Engine(MODEL).generate(prompt, 5).tokens
    ext = body["kvfabric"]
    assert ext["token_ids"] == want and ext["node"] == "node-0" and ext["logits_digest"] == ""
    assert ext["cached_tokens"] == 0 and ext["fetch"] == "none" and ext["ttft_ms"] >= 0
    choice = body["choices"][0]
    assert choice == {
        "index": 0,
        "text": TOK.decode(want),
        "finish_reason": "length",
        "logprobs": None,
    }
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 5,
        "total_tokens": len(prompt) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},  # as OpenAI's and vLLM's answers
    }
    [req] = backend.calls
    assert req.tokens == tuple(prompt) and req.max_tokens == 5
    assert req.namespace == "default" and req.use_cache and abs(req.arrival_s - time.time()) < 60
    assert not req.logits_digest
    r = post(
        client_for(backend),
        {
            "model": NAME,
            "prompt": "Hello, fabric",
            "max_tokens": 5,
            "kvfabric": {"logits_digest": True},
        },
    )
    assert r.status_code == 200 and backend.calls[-1].logits_digest
    assert len(r.json()["kvfabric"]["logits_digest"]) == 16


def sse(text: str) -> list[dict]:
    """The JSON chunks of a server-sent event stream, which must end with [DONE]."""
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_a_chat_is_the_engine_s_answer_to_the_chat_format():
    """A chat's prompt is the model's chat format (role tokens no text can forge); the
    answer is the engine's, as a chat completion; without a limit it runs to the server's."""
    client = client_for(EngineBackend())
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
        },
    ]
    r = post(
        client, chat(messages=messages, max_tokens=None, max_completion_tokens=5), url=CHAT_URL
    )
    assert r.status_code == 200, r.text
    ids = TOK.encode_chat([("system", "be brief"), ("user", "Hello")])
    want = Engine(MODEL).generate(ids, 5).tokens
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TOK.decode(want)}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["kvfabric"]["token_ids"] == want
    unlimited = post(client, chat(max_tokens=None), url=CHAT_URL).json()
    assert unlimited["usage"]["completion_tokens"] == LIMIT
    # A message's text cannot forge a turn: it is bytes, never a role token.
    forged = TOK.encode_chat([("user", "\x00<|assistant|>")])
    assert sum(t >= 258 for t in forged) == 3  # user, end of turn, assistant


@pytest.mark.parametrize("url, body", [(URL, ok(max_tokens=6)), (CHAT_URL, chat(max_tokens=6))])
def test_a_stream_joins_to_the_whole_answer(url, body):
    """stream=true: the answer's text a token at a time (a character split over tokens
    comes whole), the finish reason last, then the usage if asked."""
    client = client_for(EngineBackend())
    whole = post(client, body, url=url).json()
    r = post(client, body | {"stream": True, "stream_options": {"include_usage": True}}, url=url)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    *pieces, last, usage = chunks
    if url == CHAT_URL:
        assert pieces[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(p["choices"][0]["delta"].get("content", "") for p in pieces)
        assert text == whole["choices"][0]["message"]["content"]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    else:
        text = "".join(p["choices"][0]["text"] for p in pieces)
        assert text == whole["choices"][0]["text"]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["kvfabric"]["token_ids"] == whole["kvfabric"]["token_ids"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    plain = sse(post(client, body | {"stream": True}, url=url).text)
    assert "usage" not in plain[-1]


def test_token_list_prompt_and_namespaces():
    backend = EngineBackend()
    client = client_for(backend)
    ids = [5, 400, 511, 0, 17]
    r = post(
        client,
        {
            "model": NAME,
            "prompt": ids,
            "max_tokens": 3,
            "user": "alice",
            "kvfabric": {"namespace": "tenant-a", "cache": False},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["kvfabric"]["token_ids"] == Engine(MODEL).generate(ids, 3).tokens
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = post(client, {"model": NAME, "prompt": ids, "user": "alice", "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    r = post(client, {"model": NAME, "prompt": "x", "max_tokens": 0, "kvfabric": {}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
    first, second, third = backend.calls
    want = (tuple(ids), cache_namespace("tenant-a"), False)
    assert (first.tokens, first.namespace, first.use_cache) == want
    # `user` is OpenAI's end-user id, not a namespace: it picked one before (issue 11).
    assert (second.namespace, second.use_cache, second.max_tokens) == ("default", True, 16)
    assert (third.namespace, third.max_tokens) == ("default", 0)


def test_models_health_and_unknown_routes():
    client = client_for(FakeBackend())
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["object"] == "list"
    [card] = r.json()["data"]
    assert card["id"] == NAME and card["object"] == "model" and isinstance(card["created"], int)
    assert client.get(f"/v1/models/{NAME}").json()["id"] == NAME
    assert_error(client.get("/v1/models/gpt-4"), 404, "model_not_found")
    assert client.get("/healthz").json() == {"status": "ok"}
    assert_error(client.get("/nope"), 404)
    r = client.get(URL)
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


# --- failures behind the ingress ---------------------------------------------------------
@pytest.mark.parametrize(
    "backend,status,code",
    [
        (FakeBackend(fail=RuntimeError("replica died")), 503, "backend_unavailable"),
        (FakeBackend(fail=TimeoutError()), 503, "backend_unavailable"),
        (FakeBackend(result="not a result"), 503, "backend_unavailable"),
        (FakeBackend(fail=RequestError("token 9 is not an id")), 400, "invalid_request"),
    ],
)
def test_backend_failures_become_clean_errors(backend, status, code):
    r = post(client_for(backend), ok())
    assert_error(r, status, code)
    assert "Traceback" not in r.text and len(backend.calls) == 1
    if status == 503:
        assert r.json()["error"]["type"] == "server_error"


# --- the Serve deployment ----------------------------------------------------------------
class FakeHandle:
    """Stands in for a DeploymentHandle: handle.generate.remote(req) is awaitable."""

    def __init__(self, backend) -> None:
        self.generate = self
        self._backend = backend

    def remote(self, req):
        return self._backend.generate(req)


def test_serve_ingress_builds_its_app_on_the_replica(tmp_path):
    from ray.serve import Deployment

    assert isinstance(OpenAIIngress, Deployment)
    cls = OpenAIIngress.func_or_class
    backend = FakeBackend()
    # What a Serve replica does, without a cluster: the async constructor, then the builder.
    replica = cls.__new__(cls)
    (tmp_path / "t.json").write_text(json.dumps({KEY: {"namespaces": ["default"]}}))
    asyncio.run(
        cls.__init__(replica, FakeHandle(backend), NAME, CONFIG, str(tmp_path / "t.json"), LIMIT)
    )
    client = TestClient(replica.__serve_build_asgi_app__())
    auth = {"Authorization": f"Bearer {KEY}"}
    r = post(client, ok(max_tokens=3), headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaa"
    assert len(backend.calls) == 1
    with pytest.raises(ValueError):  # bad config fails the replica's start
        asyncio.run(cls.__init__(cls.__new__(cls), FakeHandle(backend), "", CONFIG))
    # The wrapper's __del__ is async (Serve awaits it on a replica): collect ours here,
    # where its never-awaited coroutine is expected, not during some later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        del replica, client
        gc.collect()


# --- the real openai client over HTTP ----------------------------------------------------
@pytest.fixture(scope="module")
def live_server():
    backend = EngineBackend()
    app = build_fastapi(backend, NAME, CONFIG, TENANTS, max_tokens_limit=LIMIT)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1], backend
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_openai_client(live_server):
    port, backend = live_server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=4)
    want = Engine(MODEL).generate(TOK.encode("Hello"), 4).tokens
    assert out.object == "text_completion" and out.model == NAME
    assert out.choices[0].text == TOK.decode(want) and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 4
    assert out.model_extra["kvfabric"]["token_ids"] == want
    assert [m.id for m in client.models.list()] == [NAME]
    calls = len(backend.calls)
    with pytest.raises(openai.BadRequestError, match="greedy"):
        client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0.7)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=4)
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=NAME, prompt="Hello", max_tokens=4)
    assert len(backend.calls) == calls
