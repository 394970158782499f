"""The OpenAI-compatible ingress: happy paths against a real TinyLM engine, every
4xx case with the backend untouched, backend failures as 503, fuzzed bodies (never
a 5xx, never a backend call for an invalid one), the Serve deployment's late-bound
app, and the real `openai` client over uvicorn. API keys: tests/deploy/test_ingress_auth.py."""
import asyncio
import gc
import hashlib
import json
import socket
import threading
import time
import warnings

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import given, strategies as st

from kvfabric.deploy.reference.engine import Engine, RequestError
from kvfabric.deploy.reference.model import ModelConfig, TinyLM
from kvfabric.deploy.serve.openai_api import (MAX_BODY_BYTES, CompletionResponse, OpenAIIngress, build_fastapi)
from kvfabric.deploy.serve.protocol import GenerateRequest, GenerateResult
from kvfabric.deploy.serve.tenants import parse_tenants
from kvfabric.deploy.reference.tokenizer import OFFSET, ByteTokenizer

CONFIG = ModelConfig(max_positions=128)
MODEL = TinyLM(CONFIG)
NAME = "tiny-lm"
KEY = "sk-test-key-0123456789"
TENANTS = parse_tenants({KEY: {"namespaces": ["default"]}})    # more of them: tests/deploy/test_tenants.py
LIMIT = 32                       # max_tokens_limit
TOK = ByteTokenizer(CONFIG.vocab)
URL = "/v1/completions"


class EngineBackend:
    """A real model server in process: Engine without cache, GenerateRequest -> GenerateResult."""

    def __init__(self) -> None:
        self.engine = Engine(MODEL)
        self.calls: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.calls.append(req)
        g = self.engine.generate(req.tokens, req.max_tokens, req.namespace, return_logits=req.logits_digest)
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in g.logits)).hexdigest()[:16] \
            if req.logits_digest else ""
        return GenerateResult(g.tokens, g.prompt_tokens, g.cached_tokens, g.cached_tokens, 0, 0,
                              g.fetch, g.ttft_s, "node-0", digest)


class FakeBackend:
    """Fast, and checks that every request it gets is one the model can take."""

    def __init__(self, fail: BaseException | None = None, result: object = None) -> None:
        self.calls: list[GenerateRequest] = []
        self.fail, self.result = fail, result

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        assert isinstance(req, GenerateRequest) and req.tokens
        assert all(isinstance(t, int) and 0 <= t < CONFIG.vocab for t in req.tokens)
        assert 0 <= req.max_tokens <= LIMIT and len(req.tokens) + req.max_tokens <= CONFIG.max_positions
        assert isinstance(req.namespace, str) and req.namespace
        self.calls.append(req)
        if self.fail is not None:
            raise self.fail
        if self.result is not None:
            return self.result
        out = [OFFSET + ord("a")] * req.max_tokens
        return GenerateResult(out, len(req.tokens), 0, 0, 0, 0, "none", 0.001, "node-0", "d")


def client_for(backend, tenants=None) -> TestClient:
    return TestClient(build_fastapi(backend, NAME, CONFIG, tenants, max_tokens_limit=LIMIT),
                      raise_server_exceptions=False)


def post(client, body, **kw):
    return client.post(URL, content=body if isinstance(body, bytes) else json.dumps(body), **kw)


def assert_error(r, status, code=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if contains is not None:
        assert contains in err["message"], err


# --- tokenizer ---------------------------------------------------------------------------
@given(st.text())
def test_tokenizer_round_trips_text(text):
    ids = TOK.encode(text)
    assert all(OFFSET <= i < OFFSET + 256 for i in ids)
    assert TOK.decode(ids) == text


def test_tokenizer_edges():
    for vocab, error in ((257, ValueError), (True, TypeError), (300.0, TypeError)):
        with pytest.raises(error):
            ByteTokenizer(vocab)
    assert TOK.decode([0, 1, OFFSET + 104, 300, 511, -5, OFFSET + 105]) == "hi"
    assert TOK.decode([OFFSET + 0xFF, OFFSET + 104]) == "\ufffdh"
    with pytest.raises(ValueError, match="not valid Unicode"):
        TOK.encode("a\ud800")
    with pytest.raises(TypeError):
        TOK.decode([1.5])


# --- happy paths ---------------------------------------------------------------------------
def test_string_prompt_matches_the_engine():
    backend = EngineBackend()
    r = post(client_for(backend), {"model": NAME, "prompt": "Hello, fabric", "max_tokens": 5,
                                   "temperature": 0, "n": 1, "top_p": 1.0, "seed": 7})
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
    assert choice == {"index": 0, "text": TOK.decode(want), "finish_reason": "length", "logprobs": None}
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                             "total_tokens": len(prompt) + 5}
    [req] = backend.calls
    assert req.tokens == tuple(prompt) and req.max_tokens == 5
    assert req.namespace == "default" and req.use_cache and abs(req.arrival_s - time.time()) < 60
    assert not req.logits_digest
    r = post(client_for(backend), {"model": NAME, "prompt": "Hello, fabric", "max_tokens": 5,
                                   "kvfabric": {"logits_digest": True}})
    assert r.status_code == 200 and backend.calls[-1].logits_digest
    assert len(r.json()["kvfabric"]["logits_digest"]) == 16


def test_token_list_prompt_and_namespaces():
    backend = EngineBackend()
    client = client_for(backend)
    ids = [5, 400, 511, 0, 17]
    r = post(client, {"model": NAME, "prompt": ids, "max_tokens": 3, "user": "alice",
                      "kvfabric": {"namespace": "tenant-a", "cache": False}})
    assert r.status_code == 200, r.text
    assert r.json()["kvfabric"]["token_ids"] == Engine(MODEL).generate(ids, 3).tokens
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = post(client, {"model": NAME, "prompt": ids, "user": "alice", "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    r = post(client, {"model": NAME, "prompt": "x", "max_tokens": 0, "kvfabric": {}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
    first, second, third = backend.calls
    assert (first.tokens, first.namespace, first.use_cache) == (tuple(ids), "tenant-a", False)
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


# --- every refusal leaves the backend untouched ------------------------------------------
def ok(**kw):
    return {"model": NAME, "prompt": "hi", "max_tokens": 2, **kw}


ROOM = CONFIG.max_positions - 2
BAD = [
    (ok(model="gpt-4"), 404, "model_not_found", "gpt-4"),
    (ok(prompt=""), 400, None, "empty"),
    (ok(prompt=[]), 400, None, "empty"),
    (ok(prompt="a" * (ROOM + 1)), 400, "context_length_exceeded", str(ROOM)),
    (ok(prompt=[1] * (ROOM + 1)), 400, "context_length_exceeded", None),
    (ok(prompt="\u00e9" * (ROOM // 2 + 1)), 400, "context_length_exceeded", None),  # 2 bytes each
    (ok(prompt=[1, CONFIG.vocab]), 400, "invalid_token", "512"),
    (ok(prompt=[-1]), 400, "invalid_token", None),
    (ok(prompt=[1, True]), 400, "invalid_body", "integers"),
    (ok(prompt=[1.0]), 400, "invalid_body", "integers"),
    (ok(prompt=["a", "b"]), 400, "invalid_body", "batched"),
    (ok(prompt=[[1, 2]]), 400, "invalid_body", "batched"),
    (ok(prompt=7), 400, "invalid_body", "string or a list"),
    (ok(prompt="a\ud800"), 400, None, "Unicode"),
    (ok(temperature=0.7), 400, "unsupported_parameter", "greedy"),
    (ok(temperature="0"), 400, "invalid_body", "temperature"),
    (ok(stream=True), 400, "unsupported_parameter", "streaming is not supported"),
    (ok(stream="no"), 400, "invalid_body", "stream"),
    (ok(max_tokens=-1), 400, "invalid_body", "max_tokens"),
    (ok(max_tokens=LIMIT + 1), 400, None, "limit"),
    (ok(max_tokens="2"), 400, "invalid_body", "max_tokens"),
    (ok(max_tokens=2.0), 400, "invalid_body", "max_tokens"),
    (ok(max_tokens=True), 400, "invalid_body", "max_tokens"),
    (ok(n=2), 400, "unsupported_parameter", "n=2"),
    (ok(stop=["x" * 5000]), 400, "unsupported_parameter", "stop=[\"xxx"),
    (ok(top_p=0.5), 400, "unsupported_parameter", "top_p"),
    (ok(stop=["\n"]), 400, "unsupported_parameter", "stop"),
    (ok(logprobs=1), 400, "unsupported_parameter", "logprobs"),
    (ok(echo=True), 400, "unsupported_parameter", "echo"),
    (ok(unknown_field=1), 400, "invalid_body", "unknown_field"),
    (ok(user=5), 400, "invalid_body", "user"),
    (ok(user="u" * 300), 400, "invalid_body", "user"),
    (ok(kvfabric={"namespace": ""}), 400, "invalid_body", "kvfabric.namespace"),
    (ok(kvfabric={"cache": "yes"}), 400, "invalid_body", "kvfabric.cache"),
    (ok(kvfabric={"logits_digest": 1}), 400, "invalid_body", "kvfabric.logits_digest"),
    (ok(kvfabric={"tier": "device"}), 400, "invalid_body", "kvfabric.tier"),
    (ok(kvfabric=[]), 400, "invalid_body", "kvfabric"),
    ({"prompt": "hi"}, 400, "invalid_body", "model"),
    ({"model": NAME}, 400, "invalid_body", "prompt"),
    ([ok()], 400, "invalid_body", "JSON object"),
    (None, 400, "invalid_body", None),
    (b"{not json", 400, "invalid_json", None),
    (b"", 400, "invalid_json", None),
    (b'{"model": "tiny-lm", "prompt": "hi", "temperature": NaN}', 400, "invalid_json", "NaN"),
    (b'{"model": "tiny-lm", "prompt": [' + b"9" * 5000 + b"]}", 400, "invalid_json", None),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None),
    (b"\xff\xfe\x00garbage", 400, "invalid_json", None),
    (b" " * (MAX_BODY_BYTES + 1), 413, "body_too_large", None),
]


@pytest.mark.parametrize("body,status,code,contains", BAD, ids=range(len(BAD)))
def test_refusals_leave_the_backend_untouched(body, status, code, contains):
    backend = FakeBackend()
    r = post(client_for(backend), body)
    assert_error(r, status, code, contains)
    assert backend.calls == []


def test_config_is_validated():
    base = {"backend": FakeBackend(), "model_name": NAME, "model_config": CONFIG, "tenants": None}
    for kw in ({"model_name": ""}, {"max_tokens_limit": 0},
               {"max_tokens_limit": CONFIG.max_positions}, {"model_config": ModelConfig(vocab=100)}):
        with pytest.raises(ValueError):
            build_fastapi(**{**base, **kw})
    for args in ((object(), NAME, CONFIG, None, LIMIT), (FakeBackend(), NAME, CONFIG, KEY, LIMIT)):
        with pytest.raises(TypeError):          # a key string is no tenant table
            build_fastapi(*args)


# --- failures behind the ingress ---------------------------------------------------------
@pytest.mark.parametrize("backend,status,code", [
    (FakeBackend(fail=RuntimeError("replica died")), 503, "backend_unavailable"),
    (FakeBackend(fail=TimeoutError()), 503, "backend_unavailable"),
    (FakeBackend(result="not a result"), 503, "backend_unavailable"),
    (FakeBackend(fail=RequestError("token 9 is not an id")), 400, "invalid_request"),
])
def test_backend_failures_become_clean_errors(backend, status, code):
    r = post(client_for(backend), ok())
    assert_error(r, status, code)
    assert "Traceback" not in r.text and len(backend.calls) == 1
    if status == 503:
        assert r.json()["error"]["type"] == "server_error"


# --- fuzzing -----------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "stream", "user", "kvfabric", "n",
          "top_p", "stop", "seed", "echo"]
FIELD_VALUES = st.one_of(
    JSON, st.sampled_from([NAME, "hi", 0, 1, 2, None, True, False, [], {}]),
    st.lists(st.integers(-2, CONFIG.vocab + 1), max_size=6),
    st.fixed_dictionaries({}, optional={"namespace": st.text(max_size=4), "cache": JSON}))


@pytest.mark.fuzz
def test_fuzzed_bodies_never_5xx():
    backend = FakeBackend()
    client = client_for(backend)

    @given(st.one_of(JSON, st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), JSON,
                                           max_size=6)))
    def garbage(body):
        # Never a valid request: no model named NAME can come out of these.
        r = post(client, body)
        assert 400 <= r.status_code < 500, r.text
        assert "error" in r.json()
        assert backend.calls == []

    @given(st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=4),
           st.lists(st.sampled_from(FIELDS), max_size=2), st.binary(max_size=8))
    def near_valid(changes, drop, raw):
        body = {k: v for k, v in {**ok(), **changes}.items() if k not in drop}
        before = len(backend.calls)
        r = post(client, body)
        assert r.status_code in (200, 400, 404), r.text
        assert len(backend.calls) == before + (r.status_code == 200)
        if r.status_code == 200:
            CompletionResponse.model_validate(r.json())
        else:
            assert set(r.json()["error"]) >= {"message", "type", "code"}
        # Raw bytes are almost never JSON; whatever they are, no 5xx.
        assert post(client, raw).status_code < 500

    garbage()
    near_valid()


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
    asyncio.run(cls.__init__(replica, FakeHandle(backend), NAME, CONFIG, str(tmp_path / "t.json"), LIMIT))
    client = TestClient(replica.__serve_build_asgi_app__())
    auth = {"Authorization": f"Bearer {KEY}"}
    r = post(client, ok(max_tokens=3), headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaa"
    assert len(backend.calls) == 1
    with pytest.raises(ValueError):     # bad config fails the replica's start
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
