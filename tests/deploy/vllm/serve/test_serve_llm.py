"""vLLM under Ray Serve LLM with the fabric as its KV layer, added as a user adds it to
their own deployment: a plain `LLMConfig` naming a hub id (found in the local Hugging
Face cache, as a download leaves it), wrapped by `with_fabric` and served by Ray's own
`build_openai_app` and ingress. Two engines on two Ray nodes, the FabricConnector in
each, FabricLLMRouter ranking the replicas, the index fed by the engines' KV events.
Outputs through the fabric equal outputs with no cache at all (a fresh cache_salt per
reference run: nothing can match it).

The same app, with the chaos harness's settings added to the user's config (unarmed,
they change nothing) and a disk tier written through on each node, also takes the faults
of the vLLM path that need no engine restart and those of the disk, in the module's last
test: one app start for both (each costs CI minutes)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import urllib.request
import uuid
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import ray  # noqa: E402
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import CALL_TIMEOUT_S, DIRECTORY  # noqa: E402
from kvfabric.actors.served import fabrics_of  # noqa: E402
from kvfabric.deploy.chaos.plan import ChaosKind  # noqa: E402
from kvfabric.deploy.chaos.run import chaos_settings, vllm_harness  # noqa: E402
from kvfabric.deploy.chaos.vllm_harness import orphans, remove_orphans  # noqa: E402
from kvfabric.deploy.harness.cluster import free_port, local_cluster, serve_app  # noqa: E402
from kvfabric.deploy.serving.cache_namespace import cache_namespace  # noqa: E402
from kvfabric.deploy.serving.engine_identity import is_engine, node_actor_of  # noqa: E402
from kvfabric.deploy.vllm.serve.llm_router import OpenAIPrompts  # noqa: E402
from kvfabric.deploy.vllm.serve.model import ensure_tiny_model  # noqa: E402
from kvfabric.deploy.vllm.serve.serve_llm import with_fabric  # noqa: E402
from ray.serve.llm import LLMConfig, build_openai_app  # noqa: E402

from tests.deploy import openai_script, ray_metrics
from tests.waiting import eventually as wait_for

MODEL_ID = "kvfabric-tiny-vllm"
HUB_ID = "kvfabric-tests/tiny-llama-swa"
PROMPT_CHARS = 900  # about 900 tokens (one per byte): 28 blocks of 32
MAX_TOKENS = 8
ENGINE_CACHE_BYTES = 12 << 20
T = 180.0


eventually = partial(wait_for, deadline_s=T, every_s=0.25)


class App:
    def __init__(self, endpoint, model_dir: str, chaos_file: str) -> None:
        self.endpoint = endpoint
        self.chaos_file = chaos_file  # the engines' step faults (the chaos test's)
        self.prompts = OpenAIPrompts()
        self.prompts.load_tokenizer(model_dir)
        self.rng = random.Random(7)

    def text(self) -> str:
        return "".join(
            self.rng.choice("abcdefghijklmnop qrstuvwxyz.,") for _ in range(PROMPT_CHARS)
        )

    def complete(self, prompt: str, salt: str | None = None) -> list[int]:
        """The greedy output's token ids."""
        return self.request(prompt, salt)["token_ids"]

    def request(self, prompt: str, salt: str | None = None) -> dict:
        body = {
            "model": MODEL_ID,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        if salt is not None:
            body["cache_salt"] = salt
        req = urllib.request.Request(
            self.endpoint.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=T) as r:
            return json.load(r)["choices"][0]

    def reference(self, prompt: str) -> list[int]:
        return self.complete(prompt, salt=f"ref-{uuid.uuid4().hex}")

    def tokens(self, prompt: str) -> list[int]:
        return self.prompts.tokens_of(prompt, None)


def fabric() -> str:
    """The Ray namespace of the fabric the engines started (they announce it under the
    model's name): one, since both engines have one KV identity."""
    (namespace,) = fabrics_of(MODEL_ID)
    return namespace


def node(name: str):
    return ray.get_actor(name, namespace=fabric())


def node_names() -> list[str]:
    return ray.get(node(DIRECTORY).node_names.remote(), timeout=CALL_TIMEOUT_S)


def hub_cache(model_dir: Path, hub: Path, repo_id: str) -> None:
    """Lay `model_dir` out as the Hugging Face cache holds a download of `repo_id`: blobs
    named by their content's hash, a snapshot of links to them, `refs/main` naming it."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / f.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def users_llm_config() -> LLMConfig:
    """What a user deploys on CPU nodes without the fabric: the hub id, vLLM's engine
    kwargs, two replicas of an engine each."""
    return LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": HUB_ID},
        engine_kwargs={
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 2048,
            "block_size": 32,
            "kv_cache_memory_bytes": ENGINE_CACHE_BYTES,
        },
        deployment_config={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
        placement_group_config={"bundles": [{"CPU": 2.0}]},
    )


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    hf_home = tmp_path_factory.mktemp("hf")
    hub_cache(ensure_tiny_model(), hf_home / "hub", HUB_ID)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the cluster's processes inherit it
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    chaos_file = str(tmp_path_factory.mktemp("chaos") / "steps.json")
    earlier = orphans()
    started = time.monotonic()
    try:
        # An engine's bundle takes 2 of a node's 3 CPUs; the fabric's actors take at most 1
        # of a node (0.25 each): one engine per node, wherever the shards land.
        with local_cluster(2, cpus_per_node=3):
            from ray import serve

            try:
                config = with_fabric(
                    users_llm_config(),
                    device_pages=64,
                    host_pages=2048,
                    disk_pages=4096,
                    disk_folder=str(tmp_path_factory.mktemp("disk")),
                    **chaos_settings(chaos_file),
                )
                built = build_openai_app(
                    {
                        "llm_configs": [config],
                        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0.25}},
                    }
                )
                endpoint = serve_app(built, "/v1/models", port=free_port(), wait_s=600.0)
                print(
                    f"\ncluster, fabric and two vLLM engines under Ray Serve LLM up in "
                    f"{time.monotonic() - started:.1f} s"
                )
                # This process read its Hugging Face settings at import: the folder, not the id.
                yield App(endpoint, str(ensure_tiny_model()), chaos_file)
            finally:
                serve.shutdown()
        remove_orphans(keep=earlier)  # the records of engines no node is left to reap
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_outputs_through_the_fabric_equal_uncached_outputs(app):
    """Ten prompts of about 900 tokens, three times what the two engines' own caches hold
    (3,048 tokens each), three times each (routed by the index, served from the engines'
    and the nodes' caches): every answer equals the uncached one, and the nodes' pools
    served hits the engines had evicted."""
    prompts = [app.text() for _ in range(10)]
    want = [app.reference(p) for p in prompts]
    for _ in range(3):
        for p, w in zip(prompts, want):
            assert app.complete(p) == w
    stats = [ray.get(node(n).cache_stats.remote(), timeout=CALL_TIMEOUT_S) for n in node_names()]
    assert sum(s.inserted_pages for s in stats) > 0, (
        "the engines stored nothing in their nodes' pools"
    )
    assert sum(s.hit_pages_device + s.hit_pages_host for s in stats) > 0, (
        "the nodes' pools served no hit"
    )
    # The engines' connectors report what they did to their nodes (NodeCacheActor.engine_reports).
    reports = eventually(
        lambda: (
            [r for r in engine_reports() if r["finished_requests"] >= 1]
            if sum(r["finished_requests"] for r in engine_reports()) >= 40
            else None
        ),
        "every finished request reported",
    )
    assert sum(r["loaded_tokens"] for r in reports) >= PROMPT_CHARS // 2, (
        "no engine loaded from its node"
    )
    assert sum(r["load_failures"] + r["save_failures"] for r in reports) == 0


def test_chat_completions_serve_the_bundled_model_as_completions_do(app):
    """The bundled model ships a chat template: /v1/chat/completions answers, routed and
    cached as completions are (the router tokenizes a chat through the same template),
    and a cached answer equals the uncached one."""
    messages = [
        {"role": "system", "content": "answer in kind"},
        {"role": "user", "content": app.text()},
    ]

    def chat(salt: str | None) -> str:
        body = {"model": MODEL_ID, "messages": messages, "max_tokens": MAX_TOKENS}
        body |= {"temperature": 0.0} | ({"cache_salt": salt} if salt else {})
        req = urllib.request.Request(
            app.endpoint.base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=T) as r:
            return json.load(r)["choices"][0]["message"]["content"]

    want = chat(f"ref-{uuid.uuid4().hex}")
    assert [chat(None) for _ in range(3)] == [want] * 3


def test_the_openai_script_both_apps_pass(app):
    """tests/deploy/openai_script.py, which the reference app passes too
    (tests/deploy/test_serve_app.py): completions, chat, streaming, cached tokens."""
    prompt = app.text()[:300]
    cached = openai_script.run(app.endpoint.base_url, MODEL_ID, prompt)
    assert cached["completion"] >= 256 and cached["chat"] >= 256  # whole blocks of 32


def test_the_connectors_and_the_nodes_counters_are_exported_through_ray_s_metrics(app):
    """Under Ray Serve LLM, vLLM records each engine's connector metrics with Ray's metrics
    (connector_metrics.py): every node's Prometheus export shows the fabric's counters, as
    `ray_vllm_kvfabric_*_total`, with the replica's id; the node actors' own
    (node_metrics.py) as `ray_kvfabric_node_*`, with the fabric and the node."""
    for _ in range(2):
        app.complete(app.text())

    def lookups() -> float | None:
        found = ray_metrics.samples("ray_vllm_kvfabric_lookups_total")
        assert all("ReplicaId" in labels for labels, _ in found), found
        total = sum(v for _, v in found)
        return total if total >= 2 else None

    # Ray's agents export what the replicas reported at their last interval (seconds):
    # the first request's lookup may be exported an interval before the second's.
    assert eventually(lookups, "both requests' lookups exported", deadline_s=180) >= 2

    def node_pages() -> list | None:
        found = [
            (labels["node"], labels["pool"], labels["tier"], v)
            for labels, v in ray_metrics.samples("ray_kvfabric_node_pages")
            if labels["fabric"] == fabric() and labels["state"] == "capacity"
        ]
        return found if {n for n, *_ in found} == set(node_names()) else None

    pages = eventually(node_pages, "every node's pools exported", deadline_s=180)
    assert ("full", "device", 64.0) in [(p, t, v) for _, p, t, v in pages]
    stored = eventually(
        lambda: sum(v for _, v in ray_metrics.samples("ray_kvfabric_node_inserted_pages_total")),
        "the pages the nodes stored exported",
        deadline_s=180,
    )
    assert stored > 0


def engine_reports() -> list[dict]:
    return [
        r
        for n in node_names()
        for r in ray.get(node(n).engine_reports.remote(), timeout=CALL_TIMEOUT_S).values()
    ]


def test_the_index_names_the_engine_that_holds_a_prompt(app):
    """The engines' KV events reach the index: after a request, the index names an engine
    (`<node actor>/engine/<replica>`) for the prompt's pages, in its tenant's namespace only."""
    prompt, salt = app.text(), f"tenant-{uuid.uuid4().hex[:8]}"
    tokens = app.request(prompt, salt=salt)["prompt_token_ids"]
    assert app.tokens(prompt) == tokens  # the router reads the prompt as the engine does
    client = FabricClient.connect(timeout_s=CALL_TIMEOUT_S, namespace=fabric())

    def engines(namespace: str) -> list[str]:
        return [
            m.node for m in client.lookup(tokens, namespace) if is_engine(m.node) and m.pages > 0
        ]

    held = eventually(lambda: engines(cache_namespace(salt)), "the index names the engine")
    assert {node_actor_of(e) for e in held} <= set(node_names())
    assert engines(cache_namespace(f"other-{salt}")) == []


# Last in the module: it kills and stops node actors.
def test_each_fault_of_the_vllm_path_leaves_the_app_whole(app):
    """`kvfabric chaos --engine vllm`'s harness over this app, the faults of the vLLM path
    that need no engine restart once each: a node actor killed (-9) with a load staged,
    one stopped past the engines' call deadline; and the disk's: a node actor killed as
    it writes an engine's save to disk, a page flipped on disk under a load, a full disk.
    Afterwards every answer equalled the uncached one, no client retried, and no page,
    lease or staging file was left behind.

    The faults that end an engine are run by `kvfabric chaos --engine vllm` (every kind:
    a worker killed -9 mid-load or mid-save, /dev/shm full as its replacement starts), not
    here: each costs Serve two engine starts, minutes apiece on CI's two cores. Their parts
    are tested alone: a worker killed mid-load or mid-save and its engine reaped
    (tests/deploy/vllm/connector/test_engine_kill.py), the app running again a request whose
    engine died (test_llm_ingress.py), a staging reservation on a full /dev/shm
    (tests/transport/test_staging.py)."""
    harness = vllm_harness(
        app.endpoint,
        MODEL_ID,
        str(ensure_tiny_model()),
        4,
        users_llm_config().engine_kwargs["max_model_len"],
        chaos_file=app.chaos_file,
        engine_cache_bytes=ENGINE_CACHE_BYTES,
        log=print,
    )
    kinds = [
        ChaosKind.NODE_KILL_MID_LOAD,
        ChaosKind.NODE_STALL,
        ChaosKind.DISK_KILL_MID_WRITE,
        ChaosKind.DISK_CORRUPT_PAGE,
        ChaosKind.DISK_FULL,
    ]
    reports = [
        harness.run(seed=i, faults=1, kinds=[kind], interval_s=0.5, quiet_s=2.0)
        for i, kind in enumerate(kinds)
    ]
    for kind, report in zip(kinds, reports):
        assert report.by_kind == {kind.value: 1}, report
        assert report.requests > 0
        assert report.failed_requests == report.retried_requests == report.wrong_outputs == 0
        assert report.leaked_pages == report.double_owned_pages == 0
        assert report.expired_leases_unreleased == 0 and report.leaked_staging_files == 0
        # The index agreed with every node again (how soon is a figure: `kvfabric chaos
        # --engine vllm` prints it; a test checks behaviour, not time).
        assert report.index_converged_s != float("inf"), report
