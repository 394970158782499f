"""Who gets in and which namespace a request uses (deploy/serving/ingress_auth.py), through the
ingress's HTTP interface in process (FastAPI's TestClient): two keys with their own
namespaces, 401 and 403 answers with the backend untouched, the API description behind
the key, and one open tenant when no table is set. The same over a real cluster:
tests/deploy/test_serve_tenants.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.deploy.serving.cache_namespace import cache_namespace
from kvfabric.deploy.serving.tenants import parse_tenants
from kvfabric.deploy.vllm.events.namespaces import RequestNamespaces

from tests.deploy.ingress_backends import KEY, FakeBackend, assert_error, client_for, ok, post
from tests.examples import examples

KEY_A, KEY_B, KEY_AB = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789", "sk-tenant-ab-012345678"
TABLE = parse_tenants(
    {
        KEY_A: {"namespaces": ["a", "a-eval"]},
        KEY_B: {"namespaces": ["b"], "default": "b"},
        KEY_AB: {"namespaces": ["a", "b"], "default": "b"},
    }
)
DOCS = ("/openapi.json", "/docs", "/redoc")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def with_ns(namespace: str | None = None, **kw) -> dict:
    return ok(**kw) if namespace is None else ok(kvfabric={"namespace": namespace}, **kw)


def test_a_request_gets_the_namespace_its_key_grants():
    backend = FakeBackend()
    client = client_for(backend, TABLE)
    cases = [
        (KEY_A, None, "a"),
        (KEY_A, "a-eval", "a-eval"),
        (KEY_B, None, "b"),
        (KEY_B, "b", "b"),
        (KEY_AB, None, "b"),
        (KEY_AB, "a", "a"),
    ]
    for key, asked, got in cases:
        r = post(client, with_ns(asked), headers=bearer(key))
        assert r.status_code == 200, r.text
        assert backend.calls[-1].namespace == cache_namespace(got), (key, asked)
    # `user` names no namespace: it picked one before (issue 11).
    assert post(client, ok(user="b"), headers=bearer(KEY_A)).status_code == 200
    assert backend.calls[-1].namespace == cache_namespace("a")


@pytest.mark.parametrize(
    "key,asked",
    [
        (KEY_A, "b"),
        (KEY_B, "a"),
        (KEY_B, "a-eval"),
        (KEY_A, "default"),
        (KEY_B, "nobody-has-this"),
        (KEY_AB, "a-eval"),
    ],
)
def test_a_namespace_the_key_does_not_grant_is_a_403(key, asked):
    backend = FakeBackend()
    r = post(client_for(backend, TABLE), with_ns(asked), headers=bearer(key))
    assert_error(r, 403, "namespace_forbidden", repr(asked))
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("permission_error", "kvfabric.namespace")
    # One answer whether another tenant has the namespace or nobody does: no oracle either.
    assert err["message"] == f"this API key does not grant the namespace {asked!r}"
    assert backend.calls == []


def test_cache_salt_names_the_namespace_as_under_vllm():
    """The reference app takes the tenant field vLLM's clients send, cache_salt, as
    kvfabric.namespace: granted the same, a 403 naming it, never beside another name."""
    backend = FakeBackend()
    client = client_for(backend, TABLE)
    assert post(client, ok(cache_salt="a-eval"), headers=bearer(KEY_A)).status_code == 200
    assert backend.calls[-1].namespace == cache_namespace("a-eval")
    same = ok(cache_salt="a", kvfabric={"namespace": "a"})
    assert post(client, same, headers=bearer(KEY_AB)).status_code == 200
    assert backend.calls[-1].namespace == cache_namespace("a")
    r = post(client, ok(cache_salt="b"), headers=bearer(KEY_A))
    assert_error(r, 403, "namespace_forbidden", "'b'")
    assert r.json()["error"]["param"] == "cache_salt"
    both = ok(cache_salt="a", kvfabric={"namespace": "a-eval"})
    r = post(client, both, headers=bearer(KEY_A))
    assert r.status_code == 400 and "give one" in r.json()["error"]["message"], r.text
    for bad in ("", 7, ["a"], "x" * 10_000):
        assert post(client, ok(cache_salt=bad), headers=bearer(KEY_A)).status_code == 400
    assert len(backend.calls) == 2


@settings(max_examples=examples(40), deadline=None)
@given(st.one_of(st.none(), st.text(min_size=1, max_size=12)))
def test_a_salt_is_one_cache_namespace_in_both_apps(salt):
    """The reference app files a request with a cache_salt where the vLLM app files a
    request with that salt (one function, deploy/serving/cache_namespace.py), so one
    name means one namespace to the index, the routers and the nodes of both."""
    backend = FakeBackend()
    body = ok() if salt is None else ok(cache_salt=salt)
    assert post(client_for(backend, None), body).status_code == 200
    vllm = SimpleNamespace(cache_salt=salt, prompt_embeds=None, lora_request=None)
    assert backend.calls[-1].namespace == RequestNamespaces().of(vllm) == cache_namespace(salt)


BAD_AUTH = (
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": KEY_A},
    {"Authorization": f"Basic {KEY_A}"},
    {"Authorization": f"Bearer {KEY_A}x"},
    {"Authorization": f"Bearer {KEY_A[:-1]}"},
    {"Authorization": f"Bearer {KEY}"},
    {"Authorization": "Bearer "},
    {"Authorization": "Bearer"},
)


@pytest.mark.parametrize("headers", BAD_AUTH, ids=range(len(BAD_AUTH)))
def test_no_key_or_a_wrong_key_is_a_401_everywhere_but_healthz(headers):
    backend = FakeBackend()
    client = client_for(backend, TABLE)
    for r in (
        post(client, ok(), headers=headers),
        post(client, with_ns("a"), headers=headers),
        post(client, b"{bad", headers=headers),  # auth before parsing: nothing learnt
        client.get("/v1/models", headers=headers),
        client.get("/v1/models/x", headers=headers),
        *(client.get(path, headers=headers) for path in DOCS),
    ):
        assert_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert KEY_A not in r.text
    assert backend.calls == []
    assert client.get("/healthz").status_code == 200  # load balancers probe it without a key


def test_the_scheme_is_case_insensitive_and_the_token_trimmed():
    backend = FakeBackend()
    client = client_for(backend, TABLE)
    for header in (f"bearer {KEY_B}", f"BEARER  {KEY_B} ", f"Bearer {KEY_B}\t"):
        assert post(client, ok(), headers={"Authorization": header}).status_code == 200
    assert [c.namespace for c in backend.calls] == [cache_namespace("b")] * 3


def test_the_api_description_needs_a_key_and_carries_it_in_the_page():
    client = client_for(FakeBackend(), TABLE)
    spec = client.get("/openapi.json", headers=bearer(KEY_B))
    assert spec.status_code == 200 and "/v1/completions" in spec.json()["paths"]
    assert set(spec.json()["paths"]) == {
        "/healthz",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/completions",
        "/v1/chat/completions",
    }
    for path, marker in (("/docs", "SwaggerUIBundle"), ("/redoc", "Redoc.init")):
        r = client.get(path, headers=bearer(KEY_A))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        # The page holds the description: a browser's fetch of /openapi.json has no key.
        assert marker in r.text and '"/v1/completions"' in r.text


def test_without_a_table_every_caller_is_one_tenant():
    backend = FakeBackend()
    client = client_for(backend, None)
    # No key, any key: the same tenant, the same default namespace; `user` changes nothing.
    for headers, body in (
        ({}, ok()),
        (bearer("anything"), ok()),
        ({}, ok(user="tenant-a")),
        (bearer(KEY_A), ok(user="default")),
    ):
        assert post(client, body, headers=headers).status_code == 200
    # None named: none, as a vLLM request without a cache_salt (not "default", which
    # a request may name).
    assert [c.namespace for c in backend.calls] == [cache_namespace(None)] * 4
    # That tenant may use any namespace: without keys, namespaces separate caches, not callers.
    for named in ("a", "default"):
        assert post(client, with_ns(named)).status_code == 200
        assert backend.calls[-1].namespace == cache_namespace(named) != cache_namespace(None)
    for path in DOCS:
        assert client.get(path).status_code == 200


@given(
    st.sampled_from([KEY_A, KEY_B, KEY_AB]),
    st.one_of(
        st.none(), st.sampled_from(["a", "a-eval", "b", "c"]), st.text(min_size=1, max_size=6)
    ),
)
def test_every_request_is_served_in_a_granted_namespace_or_refused(key, asked):
    """The rule for any key and namespace: 200 in a namespace the key grants (its default
    when none is asked), else 403, never another namespace."""
    backend = FakeBackend()
    r = post(client_for(backend, TABLE), with_ns(asked), headers=bearer(key))
    tenant = TABLE.match(key.encode())
    if asked is None or asked in tenant.namespaces:
        assert r.status_code == 200, r.text
        [call] = backend.calls
        assert call.namespace == cache_namespace(tenant.default if asked is None else asked)
    else:
        assert_error(r, 403, "namespace_forbidden")
        assert backend.calls == []


def test_the_table_is_checked_when_the_app_is_built():
    with pytest.raises(TypeError):
        client_for(FakeBackend(), {KEY_A: {"namespaces": ["a"]}})  # a dict is no table
    assert json.dumps(repr(TABLE)).count("sk-") == 0


def test_no_key_reaches_the_logs(caplog):
    caplog.set_level("DEBUG")
    client = client_for(FakeBackend(fail=RuntimeError("replica died")), TABLE)
    for key in (KEY_A, KEY_A + "x", KEY_B):
        for r in (
            post(client, ok(), headers=bearer(key)),
            post(client, with_ns("zz"), headers=bearer(key)),
            client.get("/docs", headers=bearer(key)),
        ):
            assert KEY_A not in r.text and KEY_B not in r.text
    assert caplog.records and "sk-" not in caplog.text  # the 503 was logged, without a key
