"""What the OpenAI ingress tests share: the model, the in-process backends the ingress calls
(a real engine, and a fast fake that checks what it is given), and an HTTP client for the
ingress's FastAPI app. Used by tests/deploy/test_openai_api.py, test_openai_refusals.py,
test_ingress_auth.py and test_tokenizer.py."""

import hashlib
import json

from fastapi.testclient import TestClient
from kvfabric.deploy.reference.engine import Engine
from kvfabric.deploy.reference.model import ModelConfig, TinyLM
from kvfabric.deploy.reference.serve.openai_api import build_fastapi
from kvfabric.deploy.reference.tokenizer import OFFSET, ByteTokenizer
from kvfabric.deploy.serving.protocol import GenerateRequest, GenerateResult
from kvfabric.deploy.serving.tenants import parse_tenants

CONFIG = ModelConfig(max_positions=128)
MODEL = TinyLM(CONFIG)
NAME = "tiny-lm"
KEY = "sk-test-key-0123456789"
TENANTS = parse_tenants(
    {KEY: {"namespaces": ["default"]}}
)  # more of them: tests/deploy/test_tenants.py
LIMIT = 32  # max_tokens_limit
TOK = ByteTokenizer(CONFIG.vocab)
URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"


class EngineBackend:
    """A real model server in process: Engine without cache, GenerateRequest -> GenerateResult."""

    def __init__(self) -> None:
        self.engine = Engine(MODEL)
        self.calls: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.calls.append(req)
        g = self.engine.generate(
            req.tokens, req.max_tokens, req.namespace, return_logits=req.logits_digest
        )
        digest = (
            hashlib.sha256(b"".join(t.numpy().tobytes() for t in g.logits)).hexdigest()[:16]
            if req.logits_digest
            else ""
        )
        return GenerateResult(
            g.tokens,
            g.prompt_tokens,
            g.cached_tokens,
            g.cached_tokens,
            0,
            0,
            g.fetch,
            g.ttft_s,
            "node-0",
            digest,
        )


class FakeBackend:
    """Fast, and checks that every request it gets is one the model can take."""

    def __init__(self, fail: BaseException | None = None, result: object = None) -> None:
        self.calls: list[GenerateRequest] = []
        self.fail, self.result = fail, result

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        assert isinstance(req, GenerateRequest) and req.tokens
        assert all(isinstance(t, int) and 0 <= t < CONFIG.vocab for t in req.tokens)
        assert (
            0 <= req.max_tokens <= LIMIT
            and len(req.tokens) + req.max_tokens <= CONFIG.max_positions
        )
        assert isinstance(req.namespace, str) and req.namespace
        self.calls.append(req)
        if self.fail is not None:
            raise self.fail
        if self.result is not None:
            return self.result
        out = [OFFSET + ord("a")] * req.max_tokens
        return GenerateResult(out, len(req.tokens), 0, 0, 0, 0, "none", 0.001, "node-0", "d")


def client_for(backend, tenants=None) -> TestClient:
    return TestClient(
        build_fastapi(backend, NAME, CONFIG, tenants, max_tokens_limit=LIMIT),
        raise_server_exceptions=False,
    )


def post(client, body, url=URL, **kw):
    return client.post(url, content=body if isinstance(body, bytes) else json.dumps(body), **kw)


def assert_error(r, status, code=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if contains is not None:
        assert contains in err["message"], err


def ok(**kw):
    return {"model": NAME, "prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
