"""Tenants on the Serve app, through real HTTP on a 2-node cluster: two API keys with
disjoint namespaces (and a third that holds one of each), one tenant's cached prefix
invisible to the other, 403 for a namespace the key does not grant, 401 without a valid
key, the API description behind the key. (No table, one tenant: tests/deploy/test_serve_app.py.)"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from kvfabric.deploy.harness.cluster import free_port, local_cluster, up
from kvfabric.deploy.harness.http_replay import Client
from kvfabric.deploy.reference.serve.app import AppArgs
from kvfabric.deploy.serving.tenants import TenantsError
from ray import serve

MODEL = "kvfabric-tiny"
ARGS = {"device_pages": 256, "host_pages": 256, "max_positions": 1024}
KEY_A, KEY_B, KEY_AB = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789", "sk-both-a-and-b-012345"
TABLE = {
    KEY_A: {"namespaces": ["a"]},
    KEY_B: {"namespaces": ["b", "b-eval"]},
    KEY_AB: {"namespaces": ["b", "a"], "default": "b"},
}
PAGES = 5


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps(TABLE))
    with local_cluster(2, cpus_per_node=2):
        ep = up(ARGS | {"tenants_file": str(path)}, port=free_port())
        yield ep
        serve.shutdown()


def call(
    endpoint, path: str, body: dict | None = None, key: str | None = None
) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {}
    )
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(endpoint.base_url + path, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def complete(
    endpoint, key: str, tokens: list[int], namespace: str | None = None, **kw
) -> tuple[int, dict]:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0, **kw}
    if namespace is not None:
        body["kvfabric"] = {"namespace": namespace}
    return call(endpoint, "/v1/completions", body, key)


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 2 for i in range(PAGES * 16)]


def cached_by(
    endpoint, key: str, tokens: list[int], namespace: str | None = None, within_s: float = 60
) -> dict:
    """Ask until the answer is served from the cache in full (the index learns of new
    pages asynchronously); the last answer. Only the asker's own namespace is touched."""
    deadline = time.monotonic() + within_s
    while True:
        status, body = complete(endpoint, key, tokens, namespace)
        assert status == 200, body
        if body["kvfabric"]["cached_tokens"] == len(tokens) or time.monotonic() > deadline:
            return body["kvfabric"]


def test_one_tenants_cached_prefix_is_invisible_to_another(endpoint):
    p = prompt(1)
    status, first = complete(endpoint, KEY_A, p)
    assert status == 200 and first["kvfabric"]["cached_tokens"] == 0
    a = cached_by(endpoint, KEY_A, p)
    assert a["cached_tokens"] == len(p)
    # B's identical prompt, in B's default namespace and in its other one: nothing cached
    # (each is B's first request there). `user` names no namespace: B calling itself "a"
    # is still B (issue 11: it was tenant a then).
    for ns, user in ((None, "a"), ("b-eval", None)):
        status, b = complete(endpoint, KEY_B, p, ns, **({"user": user} if user else {}))
        assert status == 200 and b["kvfabric"]["cached_tokens"] == 0, b
        assert b["kvfabric"]["token_ids"] == a["token_ids"]
    # The control: a key that grants "a" does see A's pages, so the zeros above are isolation.
    assert cached_by(endpoint, KEY_AB, p, "a")["cached_tokens"] == len(p)
    # The replay client with a key and no namespace: its key's default (A's: "a").
    client, deadline = Client(endpoint, KEY_A), time.monotonic() + 60
    try:
        while (hit := client.complete(MODEL, p, 2, True, None).cached_tokens) < len(
            p
        ) and time.monotonic() < deadline:
            pass  # bounded, as in cached_by: routing follows the index
        assert hit == len(p)
    finally:
        client.close()


@pytest.mark.parametrize(
    "key,namespace", [(KEY_B, "a"), (KEY_A, "b"), (KEY_A, "default"), (KEY_B, "nobody")]
)
def test_a_namespace_the_key_does_not_grant_is_a_403(endpoint, key, namespace):
    status, body = complete(endpoint, key, prompt(2), namespace)
    assert status == 403, body
    assert (
        body["error"]["code"] == "namespace_forbidden"
        and body["error"]["type"] == "permission_error"
    )


def test_the_openai_client_with_a_key(endpoint):
    base = endpoint.base_url + "/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY_B, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt=prompt(3), max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(
            model=MODEL, prompt=prompt(3), max_tokens=2, extra_body={"kvfabric": {"namespace": "a"}}
        )
    stranger = openai.OpenAI(
        base_url=base, api_key="sk-not-a-key-0123456789", max_retries=0, timeout=120
    )
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=MODEL, prompt=prompt(3), max_tokens=2)


@pytest.mark.parametrize("key", [None, "wrong", KEY_A + "x", KEY_A.upper()])
def test_no_key_or_a_wrong_key_is_a_401(endpoint, key):
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": prompt(4), "max_tokens": 1}),
        ("/v1/models", None),
        ("/openapi.json", None),
        ("/docs", None),
        ("/redoc", None),
    ):
        status, answer = call(endpoint, path, body, key)
        assert status == 401, (path, answer)
        assert answer["error"]["code"] == "invalid_api_key"
    assert call(endpoint, "/healthz")[0] == 200


def test_the_api_description_answers_with_a_key(endpoint):
    status, spec = call(endpoint, "/openapi.json", key=KEY_A)
    assert status == 200 and "/v1/completions" in spec["paths"]
    for path in ("/docs", "/redoc"):
        status, page = call(endpoint, path, key=KEY_B)
        assert status == 200 and "/v1/completions" in page


def test_a_bad_table_fails_before_any_replica(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({KEY_A: {"namespaces": []}}))
    with pytest.raises(TenantsError, match="entry 1"):
        AppArgs(tenants_file=str(bad)).tenants()
