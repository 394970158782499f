"""vLLM (CPU backend) with the FabricConnector, for real: one Ray cluster of two nodes
with the fabric on it (a node actor on each, the index, the directory), one engine for
the module (an engine starts in 25-90 s here), that of the head node's actor. The other
node is the remote one: a prefix only it holds is fetched over NIXL for the engine.

The engine's own KV cache is sized below the workload (3k tokens), so filler prompts
evict a conversation from it and the next turn is served from the node's host tier.
Reference outputs come from the same engine with a fresh cache_salt per run: no cache,
vLLM's or the fabric's, can match a salt never seen before, so every token is computed.
"""
from __future__ import annotations

from functools import partial
import glob
import json
import os
import random
import time
import uuid

import pytest

vllm = pytest.importorskip("vllm")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from kvfabric.actors import FabricClient, start, stop  # noqa: E402
from kvfabric.actors.directory import NAMESPACE as FABRIC_NS, node_actor_name  # noqa: E402
from kvfabric.actors.node.node_actor import NodeCacheActor, NodeConfig  # noqa: E402
from kvfabric.deploy.chaos.faults import ChaosAction, Fault, FaultKind, NodeChaos, StepFaultFile  # noqa: E402
from kvfabric.deploy.vllm.connector import kv_transfer_config  # noqa: E402
from kvfabric.deploy.vllm.model import ensure_tiny_model  # noqa: E402
from kvfabric.deploy.vllm.plan import layout_for_model  # noqa: E402
from kvfabric.deploy.vllm.namespaces import fabric_namespace  # noqa: E402
from kvfabric.fabric import NodeMatch, PoolCapacity, PoolName  # noqa: E402
from tests.waiting import eventually as wait_for

NAMESPACE = "kvf-vllm-test"
TENANT = "default"           # the fabric namespace of requests without a cache_salt
BLOCK = 32
PROMPT_CHARS = 1200          # one token per byte: 1,200 tokens, longer than the 256-token window
MAX_TOKENS = 12
CALL_TIMEOUT_S = 120


eventually = partial(wait_for, deadline_s=CALL_TIMEOUT_S, every_s=0.2)


class Engine:
    def __init__(self, llm, fabric, here: str, there: str, fault_file: str, layout=None,
                 events: str = "") -> None:
        self.llm = llm
        self.fabric = fabric
        self.here, self.there = here, there      # the engine's node actor, the remote one
        self.node, self.peer = fabric.nodes[here], fabric.nodes[there]
        self.fault_file = fault_file
        self.layout = layout
        self.events = events          # the engine's KV-event endpoint (its replay endpoint: + "-replay")
        self.rng = random.Random(1234)

    def text(self, n: int = PROMPT_CHARS) -> str:
        return "".join(self.rng.choice("abcdefghijklmnop qrstuvwxyz.,") for _ in range(n))

    def generate(self, prompt: str, salt: str | None = None) -> tuple[list[int], int]:
        from vllm import SamplingParams
        item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        out = self.llm.generate([item], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    def reference(self, prompt: str) -> list[int]:
        return self.generate(prompt, salt=f"ref-{uuid.uuid4().hex}")[0]

    def evict(self) -> None:
        """Fill the engine's own cache with other prompts (its LRU drops the older ones)."""
        for _ in range(3):
            self.generate(self.text(), salt=f"filler-{uuid.uuid4().hex}")

    def external_hits(self) -> int:
        return int(sum(m.value for m in self.llm.get_metrics()
                       if m.name == "vllm:external_prefix_cache_hits"))

    def remote_hits(self) -> int:
        """Tokens the connector loaded after fetching them from another node (vLLM's
        cached-tokens-by-source counter, source p2p)."""
        return int(sum(m.value for m in self.llm.get_metrics()
                       if m.name == "vllm:prompt_tokens_cached_by_source" and m.labels.get("source") == "p2p"))

    def pages(self, node, ids: list[int]) -> int:
        return ray.get(node.match.remote(ids, TENANT), timeout=CALL_TIMEOUT_S)

    def move_to_peer(self, prompt: str) -> int:
        """Leave the prompt's KV on the other node only: computed by this engine (and
        saved to its node), fetched into the peer, then dropped from this node and from
        vLLM's own cache. Returns the pages the peer holds."""
        ids = self.llm.get_tokenizer().encode(prompt)
        want = (len(ids) - 1) // BLOCK
        self.generate(prompt)
        have = eventually(lambda: (n := self.pages(self.node, ids)) >= want and n, "the prompt saved here")
        client = FabricClient.connect(timeout_s=CALL_TIMEOUT_S)
        assert client.fetch(ids, TENANT, into=self.there, source=NodeMatch(self.here, have, True)) >= want
        self.evict()
        ray.get(self.node.inject.remote(ChaosAction(evict_after_get=True)), timeout=CALL_TIMEOUT_S)
        ray.get(self.node.get.remote(ids, TENANT), timeout=CALL_TIMEOUT_S)      # then evicts all it can
        assert self.pages(self.node, ids) == 0
        ray.get([self.node.flush.remote(), self.peer.flush.remote()], timeout=CALL_TIMEOUT_S)
        found = eventually(lambda: [(m.node, m.pages) for m in client.lookup(ids, TENANT)] == [(self.there, have)],
                           "the index to say only the peer holds it")
        assert found
        return have

    def quiet(self) -> None:
        """No fault armed and no quarantined page left on this node (a hung or dead
        peer's read quarantines pages until a probe read from it completes)."""
        ray.get(self.node.calm.remote(), timeout=CALL_TIMEOUT_S)

        def released() -> bool:
            ray.get(self.node.probe_quarantine.remote(), timeout=CALL_TIMEOUT_S)
            return ray.get(self.node.stats.remote(), timeout=CALL_TIMEOUT_S)["quarantined"] == 0
        eventually(released, "the quarantine released")

    def node_host_hits(self) -> int:
        return ray.get(self.node.cache_stats.remote(), timeout=CALL_TIMEOUT_S).hit_pages_host

    def arm(self, point: str, exception: str) -> None:
        with open(self.fault_file, "w") as f:
            json.dump({point: exception}, f)

    def armed(self) -> dict:
        with open(self.fault_file) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    path = ensure_tiny_model()
    # On a loaded machine a raylet may wait past Ray's default for its agents to start
    # (and abort): give them longer.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=1)          # the remote node
    ray.init(address=cluster.address, namespace=NAMESPACE)
    cluster.wait_for_nodes()
    llm = fab = None
    try:
        layout = layout_for_model(path, BLOCK)
        # The node's device tier holds about one prompt: the others move to its host
        # tier (write-back) and are loaded back from there. chaos: transport faults
        # can be armed on a node's next read from its peer.
        caps = {PoolName.FULL: PoolCapacity(device=48, host=2048),
                PoolName.SWA: PoolCapacity(device=16, host=512)}
        fab = start(NodeConfig(layout, caps, device="cpu", hooks=NodeChaos), shards=1, cpus_per_actor=0.25,
                    timeout_s=CALL_TIMEOUT_S, watch_s=1.0)
        here = node_actor_name(ray.get_runtime_context().get_node_id())
        (there,) = set(fab.nodes) - {here}
        fault_file = str(tmp_path_factory.mktemp("faults") / "faults.json")
        from vllm import LLM
        from vllm.config import KVEventsConfig
        events = f"ipc:///tmp/kvf-events-{uuid.uuid4().hex[:12]}"
        llm = LLM(model=str(path), enforce_eager=True, dtype="float32", seed=0, max_model_len=2048,
                  block_size=BLOCK, kv_cache_memory_bytes=12 << 20, disable_log_stats=False,
                  kv_transfer_config=kv_transfer_config(here, cluster.address, ray_namespace=FABRIC_NS,
                                                        **StepFaultFile.settings(fault_file)),
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events,
                                                  replay_endpoint=events + "-replay"))
        print(f"\ncluster, fabric and engine up in {time.monotonic() - started:.1f} s")
        yield Engine(llm, fab, here, there, fault_file, layout, events)
    finally:
        engine_id = None
        if llm is not None:
            engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
            llm.llm_engine.engine_core.shutdown()
        if fab is not None:
            stop(fab)
        ray.shutdown()
        cluster.shutdown()
        for f in glob.glob(f"/dev/shm/kvf-vllm-{engine_id}-*") if engine_id else []:
            os.unlink(f)


def test_greedy_outputs_are_deterministic(engine):
    prompt = engine.text()
    first = engine.reference(prompt)
    assert first == engine.reference(prompt)
    assert len(set(first)) > 1 or len(first) < MAX_TOKENS    # real weights, not one repeated token


def test_host_tier_hit_after_device_eviction_equals_uncached(engine):
    prompt = engine.text()
    want = engine.reference(prompt)
    assert engine.generate(prompt)[0] == want      # computed, then saved to the node
    engine.evict()
    before, host_before = engine.external_hits(), engine.node_host_hits()
    got, cached = engine.generate(prompt)
    loaded = engine.external_hits() - before
    assert got == want
    # The whole pages of the prompt but its last token came from the fabric, some of
    # them loaded back from the node's host tier.
    assert loaded >= (PROMPT_CHARS - 1) // BLOCK * BLOCK - BLOCK, (loaded, cached)
    assert engine.node_host_hits() > host_before


def test_conversation_longer_than_the_window(engine):
    """Turn 2 extends turn 1 (prompt and output): the hit covers more than the SWA window,
    and SWA KV is loaded for the window before its end only."""
    turn1 = engine.text(700)
    out1, _ = engine.generate(turn1)
    tok = engine.llm.get_tokenizer()
    turn2 = turn1 + tok.decode(out1) + engine.text(500)
    want = engine.reference(turn2)
    engine.evict()
    before = engine.external_hits()
    assert engine.generate(turn2)[0] == want
    assert engine.external_hits() - before >= 600


@pytest.mark.parametrize("point,exception", [("worker_load", "KeyError"), ("worker_load", "MemoryError"),
                                             ("worker_load", "InjectedFault"), ("node_load", "RuntimeError"),
                                             ("worker_save", "ValueError"), ("node_save", "OSError")])
def test_injected_failure_becomes_recomputation(engine, point, exception):
    prompt = engine.text()
    want = engine.reference(prompt)
    if point.endswith("save"):
        engine.arm(point, exception)
    assert engine.generate(prompt)[0] == want
    engine.evict()
    if point.endswith("load"):
        engine.arm(point, exception)
    assert engine.generate(prompt)[0] == want
    assert point not in engine.armed(), "the fault never fired"
    # After the failure, the fabric still serves (a save that failed stored nothing,
    # so the next turn computes and saves again; a load that failed left the pages there).
    engine.evict()
    assert engine.generate(prompt)[0] == want


def test_tenants_never_share(engine):
    prompt = engine.text()
    want = engine.reference(prompt)
    assert engine.generate(prompt, salt="tenant-a")[0] == want
    engine.evict()
    before = engine.external_hits()
    got, cached = engine.generate(prompt, salt="tenant-b")
    assert got == want and cached == 0
    assert engine.external_hits() == before
    engine.evict()
    got, cached = engine.generate(prompt, salt="tenant-a")
    assert got == want and engine.external_hits() > before


def test_a_node_with_another_layout_is_not_used(engine):
    """A node whose layout fingerprint differs (here: another model tag) leaves the
    connector off rather than loading bytes of another layout."""
    from dataclasses import replace
    from kvfabric.deploy.vllm.jobs import FabricSettings
    from kvfabric.deploy.vllm.node_link import NodeLink

    layout = layout_for_model(ensure_tiny_model(), BLOCK)
    other = replace(layout, tag=layout.tag + "-other")
    name = f"other-{uuid.uuid4().hex[:6]}"
    caps = {p: PoolCapacity(device=4, host=4) for p in layout.pools}
    actor = NodeCacheActor.options(name=name, namespace=NAMESPACE, num_cpus=0).remote(name, NodeConfig(other, caps, device="cpu"))
    try:
        assert ray.get(actor.ping.remote(), timeout=CALL_TIMEOUT_S) == name
        link = NodeLink(FabricSettings(node_actor=name, ray_namespace=NAMESPACE, timeout_s=CALL_TIMEOUT_S), layout)
        assert not link.ready() and "layout" in link.disabled
        same = NodeLink(FabricSettings(node_actor=engine.here, ray_namespace=FABRIC_NS, timeout_s=CALL_TIMEOUT_S),
                        layout)
        assert same.ready()
    finally:
        ray.kill(actor)


def test_remote_hit_from_another_node_equals_uncached(engine):
    """A prompt only the other node holds is fetched from it (NIXL, the node's fetch
    transaction) while the engine keeps stepping, then loaded: output equal to the
    uncached run, and the loaded tokens count as remote (p2p) hits."""
    prompt = engine.text()
    want = engine.reference(prompt)
    engine.move_to_peer(prompt)
    before, remote_before = engine.external_hits(), engine.remote_hits()
    fetched_before = ray.get(engine.node.stats.remote(), timeout=CALL_TIMEOUT_S)["fetches"].get("committed", 0)
    got, _ = engine.generate(prompt)
    assert got == want
    assert ray.get(engine.node.stats.remote(), timeout=CALL_TIMEOUT_S)["fetches"].get("committed", 0) == fetched_before + 1
    loaded = engine.external_hits() - before
    assert engine.remote_hits() - remote_before == loaded >= (PROMPT_CHARS - 1) // BLOCK * BLOCK - BLOCK


@pytest.mark.parametrize("kind", list(FaultKind))
def test_transport_fault_on_a_remote_fetch_becomes_recomputation(engine, kind):
    """The engine's node fails its read from the peer (each fault kind; a delay past the
    fetch deadline): the fetch rolls back whole, the request computes, output equal."""
    prompt = engine.text()
    want = engine.reference(prompt)
    engine.move_to_peer(prompt)
    engine.quiet()
    fired, remote_before = ray.get(engine.node.fired.remote(), timeout=CALL_TIMEOUT_S), engine.remote_hits()
    fault = Fault(kind, after=1, delay_s=30.0)        # DELAY: far past the node's fetch deadline
    ray.get(engine.node.inject.remote(ChaosAction(transport=fault)), timeout=CALL_TIMEOUT_S)
    try:
        assert engine.generate(prompt)[0] == want
        assert ray.get(engine.node.fired.remote(), timeout=CALL_TIMEOUT_S) == fired + 1, "the fault never acted"
        assert engine.remote_hits() == remote_before
    finally:
        engine.quiet()
    ray.get([engine.node.check.remote(), engine.peer.check.remote()], timeout=CALL_TIMEOUT_S)


def test_kv_events_name_the_engine_in_the_index_until_it_evicts(engine):
    """The engine's own device cache, fed to the fabric's index by its KV events: after a
    request the index names the engine for the prompt's pages (that tenant's only), and
    after the engine evicts them, or clears its cache, it no longer does."""
    from vllm import SamplingParams

    from kvfabric.deploy.vllm.engine_identity import engine_index_node
    from kvfabric.deploy.vllm.engine_pages import group_pools_of
    from kvfabric.deploy.vllm.index_sink import start_engine_feed

    layout = engine.layout
    directory = engine.fabric.directory          # the module's fabric: its directory and shard
    pools = group_pools_of(engine.llm.llm_engine.engine_core.call_utility("get_kv_cache_group_metadata"))
    feed = start_engine_feed(directory, engine.here, "0", layout, pools, engine.events, engine.events + "-replay")
    me = engine_index_node(engine.here, "0")
    try:
        client = FabricClient(directory, timeout_s=CALL_TIMEOUT_S)

        def engine_pages(tokens: list[int], salt: str) -> int:
            return max((m.pages for m in client.lookup(tokens, fabric_namespace(salt)) if m.node == me), default=0)

        def step_engine() -> None:
            # vLLM hands its KV events to the publisher in a step: a one-token request makes one.
            engine.generate("x", salt=f"step-{uuid.uuid4().hex}")

        def wait_until(cond, what: str, poke=lambda: time.sleep(0.1)) -> None:
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while not cond():
                assert time.monotonic() < deadline, f"timed out waiting until {what} ({feed.stats}, " \
                                                    f"{feed.pages.stats})"
                poke()

        def prompt_tokens(salt: str) -> list[int]:
            out = engine.llm.generate([{"prompt": engine.text(), "cache_salt": salt}],
                                      SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            return list(out.prompt_token_ids)

        salt = f"events-{uuid.uuid4().hex}"
        tokens = prompt_tokens(salt)
        wait_until(lambda: engine_pages(tokens, salt) > 0, "the index names the engine")
        assert engine_pages(tokens, f"other-{salt}") == 0         # another tenant's identical prompt
        engine.evict()
        wait_until(lambda: engine_pages(tokens, salt) == 0, "the evicted prompt is gone from the index")

        tokens = prompt_tokens(salt)
        wait_until(lambda: engine_pages(tokens, salt) > 0, "the index names the engine again")

        # Blocks of a finished request wait for the connector's save, which completes in a
        # later step: a reset refused for that is tried again after a step.
        wait_until(engine.llm.reset_prefix_cache, "the engine clears its cache", poke=step_engine)
        wait_until(lambda: engine_pages(tokens, salt) == 0, "a cleared cache is gone from the index",
                   poke=step_engine)
        assert feed.stats.bad_frames == 0 and feed.pages.stats.clears > 0
    finally:
        assert feed.stop()
