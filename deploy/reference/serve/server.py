"""The model-server deployment: one replica per node, each serving requests
through its node's cache actor and the fabric.

A replica finds the node actor of the Ray node it runs on, runs the reference
model through an Engine whose local cache is that actor and whose remote is
the fabric client, and exports what it sees as Ray metrics (so hit tokens by
tier, bytes moved, fetch latency and rollbacks show in the Ray dashboard and
Prometheus). The fetch overhead of the cost model is measured: it follows the
fetches this replica actually makes."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Mapping, Sequence

import ray
import torch
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import NAMESPACE, node_actor_name
from kvfabric.core.cache.cached_kv import CachedKV
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.index.answers import NodeMatch
from kvfabric.deploy.reference.engine import CostModel, Engine, Generation
from kvfabric.deploy.reference.model import ModelConfig, TinyLM
from kvfabric.deploy.serving.protocol import GenerateRequest, GenerateResult, PrefixFetch
from ray import serve
from ray.exceptions import GetTimeoutError, RayError
from ray.util import metrics

CALL_TIMEOUT_S = 10.0
# A fetch makes about this many actor calls in a row (lookup, match, export, the
# read, release, match again): until fetches are seen, its fixed cost is this many
# measured round trips.
FETCH_CALLS = 8


class ActorCache:
    """The engine's local cache: the node's NodeCacheActor (same node: tensors
    travel through shared memory)."""

    def __init__(self, actor, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def get(self, tokens: Sequence[int], namespace: str, lease_s: float | None = None) -> CachedKV:
        return ray.get(
            self.actor.get.remote(list(tokens), namespace, lease_s), timeout=self.timeout_s
        )

    def put(
        self,
        tokens: Sequence[int],
        kv: Sequence[torch.Tensor],
        namespace: str,
        *,
        starts: Mapping[PoolName, int] | None = None,
        release: int = 0,
    ) -> int:
        host = [t.detach().cpu() for t in kv]  # the actor moves them to its pools' device
        return ray.get(
            self.actor.put.remote(list(tokens), host, namespace, starts, release),
            timeout=self.timeout_s,
        )

    def release_lease(self, lease_id: int) -> bool:
        return ray.get(self.actor.release_lease.remote(lease_id), timeout=self.timeout_s)


class FabricRemote:
    """Other nodes' caches through the global index, timed for the cost model."""

    def __init__(self, client: FabricClient, node: str) -> None:
        self.client, self.node = client, node
        self.last_fetch_s = 0.0
        self._best: tuple[str, tuple[int, ...], NodeMatch] | None = None  # the last lookup's answer

    def best_remote(self, tokens: Sequence[int], namespace: str) -> int:
        best = next((m for m in self.client.lookup(tokens, namespace) if m.node != self.node), None)
        self._best = None if best is None else (namespace, tuple(tokens), best)
        return 0 if best is None else best.pages

    def fetch(self, tokens: Sequence[int], namespace: str) -> int:
        """Fetch from the node `best_remote` just found (no second lookup), else from
        whichever the index names now."""
        source = None
        if self._best is not None and self._best[:2] == (namespace, tuple(tokens)):
            source = self._best[2]
        start = time.perf_counter()
        try:
            return self.client.fetch(tokens, namespace, into=self.node, source=source)
        finally:
            self.last_fetch_s = time.perf_counter() - start


class ServingMetrics:
    """Ray metrics of one replica, tagged by node."""

    def __init__(self, node: str) -> None:
        tags = ("node",)
        self.node = {"node": node}
        self.hit_tokens = metrics.Counter(
            "kvfabric_hit_tokens", "prompt tokens served from a cache", tag_keys=("node", "tier")
        )
        self.miss_tokens = metrics.Counter(
            "kvfabric_miss_tokens", "prompt tokens prefilled", tag_keys=tags
        )
        self.bytes_moved = metrics.Counter(
            "kvfabric_fetched_bytes", "KV bytes fetched from peers", tag_keys=tags
        )
        self.rollbacks = metrics.Counter(
            "kvfabric_fetch_rollbacks", "fetches that failed and rolled back", tag_keys=tags
        )
        self.fetch_latency = metrics.Histogram(
            "kvfabric_fetch_latency_ms",
            "remote fetch latency",
            boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
            tag_keys=tags,
        )
        self.ttft = metrics.Histogram(
            "kvfabric_ttft_ms",
            "time to first token",
            boundaries=[5, 10, 20, 50, 100, 200, 500, 1000, 2000],
            tag_keys=tags,
        )

    def record(self, g: Generation, fetched_bytes: int, fetch_s: float, ttft_s: float) -> None:
        for tier, n in (
            ("device", g.device_tokens),
            ("host", g.host_tokens),
            ("remote", g.remote_tokens),
        ):
            if n:
                self.hit_tokens.inc(n, tags={**self.node, "tier": tier})
        if g.computed_tokens:
            self.miss_tokens.inc(g.computed_tokens, tags=self.node)
        if fetched_bytes:
            self.bytes_moved.inc(fetched_bytes, tags=self.node)
        if g.fetch == PrefixFetch.FAILED:
            self.rollbacks.inc(1, tags=self.node)
        if g.fetch in (PrefixFetch.FETCHED, PrefixFetch.FAILED):
            self.fetch_latency.observe(fetch_s * 1e3, tags=self.node)
        self.ttft.observe(ttft_s * 1e3, tags=self.node)


def find_node_actor(wait_s: float = 120.0):
    """The node actor of the Ray node this process runs on (it may still be joining)."""
    name = node_actor_name(ray.get_runtime_context().get_node_id())
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return name, ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no fabric node actor {name} on this node; is the fabric up?")
            time.sleep(0.5)


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0.25})
class ModelServer:
    def __init__(
        self, model_config: ModelConfig, torch_threads: int = 1, device: str | None = None
    ) -> None:
        torch.set_num_threads(torch_threads)  # replicas share the node's cores
        self.node, actor = find_node_actor()
        # A GPU when Ray gave this replica one (AppArgs.gpus_per_replica), else the CPU.
        model = TinyLM(model_config, device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.remote = FabricRemote(FabricClient.connect(), self.node)
        cost = CostModel.measure(model, fetch_overhead_s=FETCH_CALLS * _round_trip_s(actor))
        self.cached = Engine(model, ActorCache(actor), remote=self.remote, cost=cost)
        self.uncached = Engine(model, None)
        self.metrics = ServingMetrics(self.node)

    def generate(self, req: GenerateRequest) -> GenerateResult:
        engine = self.cached if req.use_cache else self.uncached
        waited = max(0.0, time.time() - req.arrival_s) if req.arrival_s else 0.0
        fetched_before = engine.stats.fetched_bytes
        try:
            g = engine.generate(
                req.tokens, req.max_tokens, req.namespace, return_logits=req.logits_digest
            )
        except (RayError, GetTimeoutError):
            # The node's cache actor failed mid-request: serve it uncached, never fail it.
            g = self.uncached.generate(
                req.tokens, req.max_tokens, req.namespace, return_logits=req.logits_digest
            )
        if g.fetch in (PrefixFetch.FETCHED, PrefixFetch.FAILED):
            self._learn_fetch_cost(self.remote.last_fetch_s)
        ttft = waited + g.ttft_s
        fetched = engine.stats.fetched_bytes - fetched_before
        self.metrics.record(g, fetched, self.remote.last_fetch_s, ttft)
        return GenerateResult(
            g.tokens,
            g.prompt_tokens,
            g.cached_tokens,
            g.device_tokens,
            g.host_tokens,
            g.remote_tokens,
            g.fetch,
            ttft,
            self.node,
            _digest(g.logits) if g.logits is not None else "",
            fetched_bytes=fetched,
        )

    def _learn_fetch_cost(self, seconds: float) -> None:
        """Move the cost model's fixed fetch overhead toward what fetches really take."""
        cost = self.cached.cost
        if cost is not None and seconds > 0:
            self.cached.cost = dataclasses.replace(
                cost, fetch_overhead_s=0.5 * cost.fetch_overhead_s + 0.5 * seconds
            )

    def stats(self) -> dict:
        return {
            "node": self.node,
            "cached": self.cached.stats.as_dict(),
            "uncached": self.uncached.stats.as_dict(),
            "fetch_overhead_s": self.cached.cost.fetch_overhead_s if self.cached.cost else None,
        }


def _round_trip_s(actor, calls: int = 5) -> float:
    """Median time of a no-op call to the node actor."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        ray.get(actor.ping.remote(), timeout=CALL_TIMEOUT_S)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _digest(logits: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for step in logits:
        h.update(step.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()
