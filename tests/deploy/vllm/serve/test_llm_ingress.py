"""Tenants in front of the vLLM app (deploy/vllm/serve/llm_ingress.py): the request's cache_salt,
which is its namespace in vLLM's cache and the fabric's, comes from its API key. Through
the ingress's own request path in process; the LLM deployment behind it is the edge."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples

pytest.importorskip("vllm")

from kvfabric.deploy.vllm.serve.llm_ingress import FabricLLMIngress  # noqa: E402
from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest  # noqa: E402
from starlette.requests import Request  # noqa: E402

from tests.deploy.test_ingress_auth import KEY_A, KEY_AB, KEY_B, TABLE  # noqa: E402

TABLE_YAML = {
    KEY_A: {"namespaces": ["a", "a-eval"]},
    KEY_B: {"namespaces": ["b"], "default": "b"},
    KEY_AB: {"namespaces": ["a", "b"], "default": "b"},
}


def request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw})


@pytest.fixture(scope="module")
def ingress(tmp_path_factory) -> FabricLLMIngress:
    path = tmp_path_factory.mktemp("t") / "tenants.json"
    path.write_text(json.dumps(TABLE_YAML))
    return FabricLLMIngress({}, {}, tenants_file=str(path))


def send(ingress: FabricLLMIngress, headers: dict[str, str], salt: str | None):
    served: list[str | None] = []

    async def engine(body, req):  # the LLM deployment: records what it was given
        served.append(body.cache_salt)
        return "served"

    body = CompletionRequest(model="m", prompt="hello", cache_salt=salt)
    answer = asyncio.run(ingress._as_tenant(body, request(headers), engine))
    return answer, served


@settings(max_examples=examples(60), deadline=None)
@given(
    key=st.sampled_from([KEY_A, KEY_B, KEY_AB, "sk-not-a-tenant-0000", None]),
    salt=st.sampled_from([None, "a", "a-eval", "b", "c", "default"]),
)
def test_each_request_runs_with_a_salt_its_key_grants_or_is_refused(ingress, key, salt):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer, served = send(ingress, headers, salt)
    tenant = TABLE.match(key.encode()) if key else None
    if tenant is None:
        assert answer.status_code == 401 and served == []
    elif salt is not None and not tenant.grants(salt):
        assert answer.status_code == 403 and served == []
        assert json.loads(answer.body)["error"]["param"] == "cache_salt"
    else:
        assert answer == "served" and served == [salt if salt is not None else tenant.default]


def test_without_a_table_the_client_picks_its_salt():
    open_ingress = FabricLLMIngress({}, {})
    for salt in (None, "anything"):
        answer, served = send(open_ingress, {}, salt)
        assert answer == "served" and served == [salt]


def test_a_bad_table_fails_the_app_args(tmp_path):
    from kvfabric.deploy.serving.tenants import TenantsError
    from kvfabric.deploy.vllm.serve.serve_llm import llm_app_builder

    bad = tmp_path / "t.json"
    bad.write_text('{"short": {"namespaces": ["a"]}}')
    with pytest.raises(TenantsError):
        llm_app_builder({"tenants_file": str(bad)})


def test_every_route_of_the_served_app_needs_a_key(tmp_path):
    """The ingress as Serve builds and runs it (make_fastapi_ingress, then the replica's
    wrapper): with a tenant table, every route of its table, FastAPI's API description
    included, answers 401 with no key or a wrong one, and lets a key of the table through
    (to whatever the route then says: no engine stands behind it here, nor the replica
    Serve's routes call into; which namespaces a key may use is the test above's)."""
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
    from starlette.testclient import TestClient

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TABLE_YAML))
    served = make_fastapi_ingress(FabricLLMIngress)
    replica = object.__new__(served)
    asyncio.run(served.__init__(replica, {}, {}, tenants_file=str(path)))
    routes = [
        (method, r.path.replace("{model:path}", "m"))
        for r in replica.app.app.routes
        for method in sorted(getattr(r, "methods", None) or {"GET"})
        if method != "HEAD"
    ]
    paths = {p for _, p in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= paths
    assert {"/docs", "/openapi.json", "/redoc", "/v1/embeddings", "/v1/score"} <= paths
    with TestClient(replica.app, raise_server_exceptions=False) as client:
        for method, route in routes:
            for headers in ({}, {"Authorization": "Bearer sk-not-a-tenant-0000"}):
                answer = client.request(method, route, headers=headers, json={})
                assert answer.status_code == 401, (method, route, headers)
                assert answer.json()["error"]["code"] == "invalid_api_key"
            ok = client.request(method, route, headers={"Authorization": f"Bearer {KEY_B}"})
            assert ok.status_code != 401, (method, route)


def test_without_a_table_no_route_asks_for_a_key():
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
    from starlette.testclient import TestClient

    served = make_fastapi_ingress(FabricLLMIngress)
    replica = object.__new__(served)
    asyncio.run(served.__init__(replica, {}, {}))
    with TestClient(replica.app, raise_server_exceptions=False) as client:
        assert client.get("/openapi.json").status_code == 200


def died() -> Exception:
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError()


def run_with(engine, stream: bool = False):
    body = CompletionRequest(model="m", prompt="hello", stream=stream)
    return asyncio.run(FabricLLMIngress({}, {})._as_tenant(body, request({}), engine))


@pytest.fixture
def no_backoff(monkeypatch):
    from kvfabric.deploy.vllm.serve import llm_ingress

    monkeypatch.setattr(llm_ingress, "BACKOFF_S", 0.0)
    return llm_ingress


def test_a_request_whose_engine_died_runs_again_and_says_so(no_backoff):
    from fastapi.responses import JSONResponse

    calls: list[int] = []

    async def engine(body, req):
        calls.append(1)
        if len(calls) <= 2:
            raise died()
        return JSONResponse({"choices": []})

    answer = run_with(engine)
    assert len(calls) == 3 and answer.headers[no_backoff.RETRIES_HEADER] == "2"


@pytest.mark.parametrize(
    "what", ["another failure", "a stream", "an engine that stays dead"], ids=str
)
def test_what_is_not_run_again(no_backoff, what):
    """A failure of a live engine is the answer; a stream may have sent its first chunk;
    and retries end."""
    calls: list[int] = []

    async def engine(body, req):
        calls.append(1)
        raise ValueError("a live engine's error") if what == "another failure" else died()

    with pytest.raises(Exception) as raised:
        run_with(engine, stream=what == "a stream")
    want = no_backoff.RETRIES + 1 if what == "an engine that stays dead" else 1
    assert len(calls) == want
    assert no_backoff.engine_gone(raised.value) == (what != "another failure")


def test_which_errors_say_the_engine_died():
    from kvfabric.deploy.vllm.serve.llm_ingress import engine_gone
    from ray.exceptions import ActorDiedError
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    def chained() -> Exception:
        try:
            raise died()
        except Exception as e:
            try:
                raise RuntimeError("the replica's generator failed") from e
            except RuntimeError as outer:
                return outer

    assert engine_gone(died()) and engine_gone(chained()) and engine_gone(ActorDiedError())
    as_response = OpenAIHTTPException(message="dead", status_code=500, type="EngineDeadError")
    assert engine_gone(as_response)
    assert not engine_gone(OpenAIHTTPException(message="bad", status_code=400, type="BadRequest"))
    assert not engine_gone(RuntimeError("out of memory"))
