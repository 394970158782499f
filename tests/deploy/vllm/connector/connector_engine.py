"""The engine the connector tests run on (test_vllm_connector.py): vLLM (CPU backend) with
the FabricConnector on a Ray cluster of two nodes with the fabric on it, and what the
tests do with it (generate, evict, move a prompt to the other node, arm a fault).
No test here."""

from __future__ import annotations

import glob
import json
import os
import random
import time
import uuid
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import ray
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import node_actor_name
from kvfabric.actors.launch import running, stop
from kvfabric.actors.served import fabrics_of
from kvfabric.core.cache.layout import Tier
from kvfabric.core.index.answers import NodeMatch
from kvfabric.deploy.chaos.faults import HOOKS, ChaosAction, StepFaultFile
from kvfabric.deploy.serving.cache_namespace import cache_namespace
from kvfabric.deploy.vllm.connector import kv_transfer_config
from kvfabric.deploy.vllm.serve.model import ensure_tiny_model
from ray.cluster_utils import Cluster

from tests.waiting import eventually as wait_for

NAMESPACE = "kvf-vllm-test"
NODE_HOOKS = HOOKS
TENANT = "default"  # the fabric namespace of requests without a cache_salt
BLOCK = 32
PROMPT_CHARS = 1200  # one token per byte: 1,200 tokens, longer than the 256-token window
MAX_TOKENS = 12
CALL_TIMEOUT_S = 120


eventually = partial(wait_for, deadline_s=CALL_TIMEOUT_S, every_s=0.2)


class Engine:
    def __init__(
        self, llm, fabric, here: str, there: str, fault_file: str, layout=None, events: str = ""
    ) -> None:
        self.llm = llm
        self.fabric = fabric
        self.namespace = fabric.namespace  # the Ray namespace of the engine's fabric
        self.here, self.there = here, there  # the engine's node actor, the remote one
        self.node, self.peer = fabric.nodes[here], fabric.nodes[there]
        self.fault_file = fault_file
        self.layout = layout
        self.events = events  # the engine's KV-event endpoint (its replay endpoint: + "-replay")
        self.rng = random.Random(1234)

    def text(self, n: int = PROMPT_CHARS) -> str:
        return "".join(self.rng.choice("abcdefghijklmnop qrstuvwxyz.,") for _ in range(n))

    def generate(self, prompt: str, salt: str | None = None) -> tuple[list[int], int]:
        from vllm import SamplingParams

        item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        out = self.llm.generate(
            [item], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
        )[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    def reference(self, prompt: str) -> list[int]:
        return self.generate(prompt, salt=f"ref-{uuid.uuid4().hex}")[0]

    def evict(self) -> None:
        """Compute other prompts (their saves crowd the node's device pool, whose LRU
        pages go to its host tier), then empty the engine's own prefix cache. The prompts
        alone did not always evict it: a finished request's blocks stay in use until a
        later step reports its save done, later on a loaded machine, and so went back to
        the cache after the others. Each prompt's save lands before the next: a save the
        node still writes holds device pages, and a host hit needs device room to load
        back (NodeCache.get), which a 48-page pool cannot give both."""
        for _ in range(3):
            filler, salt = self.text(), f"filler-{uuid.uuid4().hex}"
            self.generate(filler, salt=salt)
            self.saved(filler, salt)
        self.clear_own_cache()

    def clear_own_cache(self) -> None:
        """Empty the engine's own prefix cache: only the fabric can hit then. vLLM resets
        it only once no block is in use: step the engine with a prompt shorter than a
        page (nothing of it is saved) until the reset takes."""
        from vllm import SamplingParams

        def reset() -> bool:
            if self.llm.reset_prefix_cache():
                return True
            item = {"prompt": "step " * (BLOCK // 8), "cache_salt": f"step-{uuid.uuid4().hex}"}
            self.llm.generate([item], SamplingParams(max_tokens=1), use_tqdm=False)
            return False

        eventually(reset, "vLLM's own prefix cache cleared", every_s=0.1)

    def external_hits(self) -> int:
        return self.metric("vllm:external_prefix_cache_hits")

    def metric(self, name: str, **labels: str) -> int:
        """A counter of vLLM's registry (the connector's own too), summed over the
        children whose labels include `labels`."""
        return int(
            sum(
                m.value
                for m in self.llm.get_metrics()
                if m.name == name and labels.items() <= m.labels.items()
            )
        )

    def counters(self) -> dict[str, int]:
        """The connector's counters (vllm:kvfabric_*, by name and labels) now: a failed
        test's message says what the connector did meanwhile."""
        out: dict[str, int] = {}
        for m in self.llm.get_metrics():
            if m.name.startswith("vllm:kvfabric_"):
                key = m.name + "".join(f" {k}={v}" for k, v in sorted(m.labels.items()))
                out[key] = out.get(key, 0) + int(m.value)
        return out

    def what_happened(self, before: dict[str, int], prompt: str) -> str:
        """The counters that moved since `before`, and how much of `prompt` the node holds."""
        now = self.counters()
        moved = {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        ids = self.llm.get_tokenizer().encode(prompt)
        stats = ray.get(self.node.cache_stats.remote(), timeout=CALL_TIMEOUT_S)
        return (
            f"connector counters moved: {moved}; the node holds {self.pages(self.node, ids)} "
            f"pages; its cache's load-back failures so far: {stats.load_back_failures}"
        )

    def remote_hits(self) -> int:
        """Tokens the connector loaded after fetching them from another node (vLLM's
        cached-tokens-by-source counter, source p2p)."""
        return self.metric("vllm:prompt_tokens_cached_by_source", source="p2p")

    def pages(self, node, ids: list[int], salt: str | None = None) -> int:
        return ray.get(node.match.remote(ids, cache_namespace(salt)), timeout=CALL_TIMEOUT_S)

    def saved(self, prompt: str, salt: str | None = None) -> int:
        """Wait until this node holds the prompt's whole pages: its save lands after the
        request ends (off the engine's step), later on a loaded machine. Returns them."""
        ids = self.llm.get_tokenizer().encode(prompt)
        want = (len(ids) - 1) // BLOCK
        return eventually(
            lambda: (n := self.pages(self.node, ids, salt)) >= want and n, "the prompt saved here"
        )

    def move_to_peer(self, prompt: str) -> int:
        """Leave the prompt's KV on the other node only: computed by this engine (and
        saved to its node), fetched into the peer, then dropped from this node and from
        vLLM's own cache. Returns the pages the peer holds."""
        ids = self.llm.get_tokenizer().encode(prompt)
        want = (len(ids) - 1) // BLOCK
        self.generate(prompt)
        have = self.saved(prompt)
        client = self.client()
        assert (
            client.fetch(
                ids, TENANT, into=self.there, source=NodeMatch(self.here, have, Tier.DEVICE)
            )
            >= want
        )
        self.evict()
        ray.get(self.node.inject.remote(ChaosAction(evict_after_get=True)), timeout=CALL_TIMEOUT_S)
        ray.get(self.node.get.remote(ids, TENANT), timeout=CALL_TIMEOUT_S)  # then evicts all it can
        assert self.pages(self.node, ids) == 0
        ray.get([self.node.flush.remote(), self.peer.flush.remote()], timeout=CALL_TIMEOUT_S)
        found = eventually(
            lambda: [(m.node, m.pages) for m in client.lookup(ids, TENANT)] == [(self.there, have)],
            "the index to say only the peer holds it",
        )
        assert found
        return have

    def client(self) -> FabricClient:
        return FabricClient.connect(timeout_s=CALL_TIMEOUT_S, namespace=self.namespace)

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


def engine_args(here: str, address: str, **settings) -> dict:
    """A test engine's vLLM arguments: fp32, block 32, its own KV cache 12 MiB (3k
    tokens), the FabricConnector of node actor `here`. The engine starts the fabric of its
    KV identity: the node's device tier holds about one prompt, the others move to its
    host tier (write-back) and are loaded back from there; chaos hooks on the nodes
    (transport faults can be armed on a node's next read from its peer)."""
    return dict(
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=2048,
        block_size=BLOCK,
        kv_cache_memory_bytes=12 << 20,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config(
            here,
            address,
            device_pages=48,
            host_pages=2048,
            swa_device_pages=16,
            swa_host_pages=512,
            shards=1,
            watch_s=1.0,
            node_hooks=NODE_HOOKS,
            **settings,
        ),
    )


def engine_fabric(served: str):
    """The fabric the engine serving `served` started (it announced its namespace)."""
    (namespace,) = fabrics_of(served)
    fab = running(namespace)
    assert fab is not None, namespace
    return fab


@contextmanager
def running_engine(fault_file: str) -> Iterator[Engine]:
    """A cluster of two nodes with the fabric on it and one engine on the head node's
    node actor, its connector's steps failing as `fault_file` says; all shut down after."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    path = ensure_tiny_model()
    # On a loaded machine a raylet may wait past Ray's default for its agents to start
    # (and abort): give them longer.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)  # the remote node
    ray.init(address=cluster.address, namespace=NAMESPACE)
    cluster.wait_for_nodes()
    llm = fab = None
    try:
        here = node_actor_name(ray.get_runtime_context().get_node_id())
        from vllm import LLM
        from vllm.config import KVEventsConfig

        events = f"ipc:///tmp/kvf-events-{uuid.uuid4().hex[:12]}"
        llm = LLM(
            model=str(path),
            **engine_args(here, cluster.address, **StepFaultFile.settings(fault_file)),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=events,
                replay_endpoint=events + "-replay",
            ),
        )
        fab = engine_fabric(str(path))
        (there,) = set(fab.nodes) - {here}
        layout = FabricClient.connect(CALL_TIMEOUT_S, fab.namespace).layout
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
        for f in glob.glob(f"/dev/shm/kvf-vllm-{engine_id}[-.]*") if engine_id else []:
            os.unlink(f)
