"""The Serve app on a 3-node cluster: the real `openai` client, cached answers
equal to uncached ones bit for bit, the router sending a conversation back to
the node that holds it, one tenant for every caller without keys (with keys:
tests/deploy/test_serve_tenants.py), and clear 4xx answers for bad requests."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from kvfabric.deploy.harness.cluster import APP_NAME, free_port, local_cluster, up
from kvfabric.deploy.harness.http_replay import Client
from kvfabric.deploy.reference.serve.app import AppArgs, AppArgsError
from ray import serve

from tests.deploy import openai_script, ray_metrics
from tests.waiting import eventually

MODEL = "kvfabric-tiny"
ARGS = {"device_pages": 256, "host_pages": 256, "max_positions": 1024}


@pytest.fixture(scope="module")
def endpoint():
    with local_cluster(3, cpus_per_node=2):
        ep = up(ARGS, port=free_port())
        yield ep
        serve.shutdown()


def prompt(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 2 for i in range(pages * 16)]


def test_the_openai_client_completes_and_lists_models(endpoint):
    client = openai.OpenAI(
        base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(
        model=MODEL, prompt="The fabric remembers " * 8, max_tokens=4, temperature=0
    )
    assert out.usage.completion_tokens == 4 and out.usage.prompt_tokens == len(
        "The fabric remembers " * 8
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nothing", prompt="hi", max_tokens=1)


def test_cached_answers_equal_uncached_ones_and_follow_ups_return_to_the_holder(endpoint):
    client = Client(endpoint, None)
    try:
        first = prompt(1, 6)
        base = client.complete(MODEL, first, 3, cache=False, namespace="t1")
        warm = client.complete(MODEL, first, 3, cache=True, namespace="t1")
        again = client.complete(MODEL, first, 3, cache=True, namespace="t1")
        assert (base.token_ids, base.logits_digest) == (warm.token_ids, warm.logits_digest)
        assert (base.token_ids, base.logits_digest) == (again.token_ids, again.logits_digest)
        assert base.cached_tokens == 0 and again.cached_tokens == 6 * 16
        assert again.node == warm.node  # the router sent it where the prefix is
        turn = first + prompt(2, 3)
        for _ in range(3):  # a conversation goes on
            nocache = client.complete(MODEL, turn, 2, cache=False, namespace="t1")
            hit = client.complete(MODEL, turn, 2, cache=True, namespace="t1")
            assert (hit.token_ids, hit.logits_digest) == (nocache.token_ids, nocache.logits_digest)
            assert hit.cached_tokens >= len(turn) - 16 * 3 and hit.node == warm.node
            turn = turn + prompt(len(turn), 2)
        # Another tenant's identical prompt matches nothing of it.
        other = client.complete(MODEL, first, 3, cache=True, namespace="t2")
        assert other.cached_tokens == 0 and other.token_ids == base.token_ids
    finally:
        client.close()


def test_without_keys_every_caller_is_one_tenant(endpoint):
    """No tenant table: anonymous callers, callers with any key and any `user` share the
    namespace "default" (issue 11: `user` picked the namespace), and the docs are open."""

    def served(body: dict, headers: dict) -> dict:
        req = urllib.request.Request(
            endpoint.base_url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"} | headers,
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["kvfabric"]

    p = prompt(30, 4)
    body = {"model": MODEL, "prompt": p, "max_tokens": 2}
    deadline = time.monotonic() + 60  # the index learns of new pages asynchronously
    while (anon := served(body, {}))["cached_tokens"] < len(p) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert anon["cached_tokens"] == len(p)
    assert anon["logits_digest"] == ""  # not asked for: the server kept no logits
    other = served(body | {"user": "tenant-a"}, {"Authorization": "Bearer sk-anything-0123456789"})
    assert other["cached_tokens"] == len(p) and other["token_ids"] == anon["token_ids"]
    for path in ("/openapi.json", "/docs", "/redoc"):
        with urllib.request.urlopen(endpoint.base_url + path, timeout=60) as r:
            assert r.status == 200


@pytest.mark.parametrize(
    "body,status",
    [
        ({"model": MODEL, "prompt": "", "max_tokens": 2}, 400),
        ({"model": MODEL, "prompt": [], "max_tokens": 2}, 400),
        ({"model": MODEL, "prompt": [1] * 1100, "max_tokens": 2}, 400),  # longer than the model
        ({"model": MODEL, "prompt": [100000], "max_tokens": 2}, 400),  # not a token id
        ({"model": "other", "prompt": "hi", "max_tokens": 2}, 404),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": "yes"}, 400),
    ],
)
def test_bad_requests_get_clear_4xx_answers(endpoint, body, status):
    req = urllib.request.Request(
        endpoint.base_url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == status
    assert json.loads(e.value.read())["error"]["message"]


@pytest.mark.parametrize(
    "args",
    [
        {"bogus": 1},
        {"shards": 0},
        {"model_name": ""},
        {"nodes": -1},
        {"api_key": "sk-0123456789abcdef"},
        {"tenants_file": "t.yaml"},
        {"tenants_file": ""},
        {"device_pages": True},
        {"chaos": 1},
        {"device_pages": 8, "max_positions": 1024},
    ],
)  # pools < one prompt
def test_app_args_are_validated(args):
    with pytest.raises((AppArgsError, TypeError)):
        AppArgs.from_dict(args)


def test_serving_metrics_record_every_kind_of_answer(endpoint):
    """What a replica's Ray metrics get for each kind of answer, through the real Ray
    metrics (which check names and tags when used) in a Ray worker."""
    import ray

    @ray.remote(num_cpus=0)
    def record() -> dict:
        from kvfabric.deploy.reference.engine import Generation
        from kvfabric.deploy.reference.serve.server import ServingMetrics
        from kvfabric.deploy.serving.protocol import PrefixFetch

        m = ServingMetrics("kvf-node-test")
        seen: list = []
        for label, metric, method in (
            ("hit", m.hit_tokens, "inc"),
            ("miss", m.miss_tokens, "inc"),
            ("bytes", m.bytes_moved, "inc"),
            ("rollback", m.rollbacks, "inc"),
            ("fetch_ms", m.fetch_latency, "observe"),
            ("ttft_ms", m.ttft, "observe"),
        ):
            real = getattr(metric, method)

            def spy(value, tags=None, label=label, real=real):
                real(value, tags=tags)  # Ray validates; a bad tag raises here
                seen.append((fetch.value, label, value, tuple(sorted((tags or {}).items()))))

            setattr(metric, method, spy)
        for fetch in PrefixFetch:
            g = Generation([1], 64, 48, 16, 16, 16, 16, fetch, 4, 0.01, 0.02)
            m.record(
                g,
                fetched_bytes=4096 if fetch is PrefixFetch.FETCHED else 0,
                fetch_s=0.005,
                ttft_s=0.01,
            )
        return {f: [s[1:] for s in seen if s[0] == f] for f in {s[0] for s in seen}}

    seen = ray.get(record.remote(), timeout=120)
    node = ("node", "kvf-node-test")
    every = [("hit", 16, (node, ("tier", t))) for t in ("device", "host", "remote")] + [
        ("miss", 16, (node,))
    ]
    assert seen["none"] == seen["skipped"] == every + [("ttft_ms", 10.0, (node,))]
    assert seen["fetched"] == every + [
        ("bytes", 4096, (node,)),
        ("fetch_ms", 5.0, (node,)),
        ("ttft_ms", 10.0, (node,)),
    ]
    assert seen["failed"] == every + [
        ("rollback", 1, (node,)),
        ("fetch_ms", 5.0, (node,)),
        ("ttft_ms", 10.0, (node,)),
    ]


def test_down_removes_the_app_and_the_fabric_and_up_brings_them_back(endpoint):
    """Takes everything down, then up again on the same port: the other tests do not
    depend on running before this one."""
    import ray
    from kvfabric.deploy.harness.cluster import down

    killed = down()
    assert "kvf-directory" in killed and any(n.startswith("kvf-node-") for n in killed)
    assert any(n.startswith("kvf-index-") for n in killed)
    with pytest.raises(ValueError):
        ray.get_actor("kvf-directory", namespace="kvfabric")
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint.base_url + "/v1/models", timeout=10)
    assert up(ARGS, port=endpoint.port) == endpoint
    with urllib.request.urlopen(endpoint.base_url + "/v1/models", timeout=60) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL]


def test_the_openai_script_both_apps_pass(endpoint):
    """tests/deploy/openai_script.py, which the vLLM app passes too
    (tests/deploy/vllm/serve/test_serve_llm.py)."""
    cached = openai_script.run(endpoint.base_url, MODEL, "The fabric remembers " * 8)
    assert cached["completion"] == 160  # whole pages of 16 of the prompt's 168 bytes
    assert cached["chat"] >= 160


def test_the_node_actors_counters_are_exported_through_ray_s_metrics(endpoint):
    """The reference app's nodes export the same node metrics as vLLM's (node_metrics.py):
    each pool's fill by tier and what the caches stored, as Prometheus reads them; so do
    the index shards (index_metrics.py)."""
    client = openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="-", max_retries=0)
    client.completions.create(model=MODEL, prompt="Exported " * 20, max_tokens=2)

    def exported() -> dict | None:
        pages = ray_metrics.samples("ray_kvfabric_node_pages")
        stored = ray_metrics.samples("ray_kvfabric_node_inserted_pages_total")
        nodes = {labels["node"] for labels, _ in pages}
        if len(nodes) < 3 or not stored or sum(v for _, v in stored) <= 0:
            return None
        return {(t["node"], t["pool"], t["tier"], t["state"]): v for t, v in pages}

    pages = eventually(exported, "three nodes' metrics exported", deadline_s=180)
    # The index shards publish at the directory's rebalance pass (every 10 s).
    lookups = eventually(
        lambda: sum(v for _, v in ray_metrics.samples("ray_kvfabric_index_lookups_total")),
        "the index shards' lookups exported",
        deadline_s=180,
    )
    assert lookups > 0
    capacity = {k[1:3]: v for k, v in pages.items() if k[3] == "capacity"}
    assert capacity[("full", "device")] == ARGS["device_pages"]
    assert capacity[("full", "host")] == ARGS["host_pages"]
    assert all(v <= pages[k[:3] + ("capacity",)] for k, v in pages.items() if k[3] == "used")


def test_status_prints_every_node_s_pools_and_hits(endpoint):
    """`kvfabric status` in another process, against this cluster, as an operator runs
    it: the fabric's three nodes, their pools at the app's sizes, lookups and hits."""
    import subprocess
    import sys

    import ray

    openai_script.run(endpoint.base_url, MODEL, "Status " * 30)
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "kvfabric.deploy.cli.main", "status", "--address", address]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (fabric,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert fabric["namespace"] == "kvfabric" and len(fabric["nodes"]) == 3
    assert all(n["reachable"] for n in fabric["nodes"])
    fills = {(p["pool"], p["tier"]): p["capacity"] for p in fabric["nodes"][0]["pools"]}
    assert fills[("full", "device")] == ARGS["device_pages"]
    assert fills[("full", "host")] == ARGS["host_pages"]
    nodes = fabric["nodes"]
    assert sum(n["lookups"] for n in nodes) > 0 and sum(n["inserted_pages"] for n in nodes) > 0
    assert max(n["hit_rate"] for n in nodes) > 0
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "fabric kvfabric: 3 nodes" in table.stdout and "full/device" in table.stdout


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class NeverStarts:
    def __init__(self) -> None:
        raise RuntimeError("this replica refuses to start")


@serve.deployment(
    num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": {"kvf-no-node-has-this": 1}}
)
class NeverPlaced:
    def __call__(self, request) -> str:
        return "never"


def test_an_app_no_node_can_place_is_an_error_once_its_wait_is_over(endpoint):
    """Serve would wait for a replica no node can place for ever: `deploy` (`kvfabric up`)
    raises once its wait is over, naming the deployment still waiting."""
    from kvfabric.deploy.harness.cluster import DeployFailed, deploy

    try:
        with pytest.raises(DeployFailed, match="(?s)not running after 3 s.*NeverPlaced: "):
            deploy(NeverPlaced.bind(), "kvf-unplaced", "/unplaced", wait_s=3)
    finally:
        serve.delete("kvf-unplaced")
    assert serve.status().applications[APP_NAME].status.value == "RUNNING"


def test_an_app_serve_cannot_deploy_is_an_error_with_serve_s_causes(endpoint):
    """`kvfabric up` of an app Serve cannot deploy says why: each failed deployment's
    cause from Serve's status API, not only that some deployment failed."""
    from kvfabric.deploy.harness.cluster import DeployFailed, deploy

    try:
        with pytest.raises(
            DeployFailed, match="(?s)NeverStarts: DEPLOY_FAILED: .*this replica refuses to start"
        ):
            deploy(NeverStarts.bind(), "kvf-never", "/never")
    finally:
        serve.delete("kvf-never")
    assert serve.status().applications[APP_NAME].status.value == "RUNNING"
