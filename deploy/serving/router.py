"""Ray Serve request routing by the cluster-wide page index.

Ray Serve LLM's prefix-aware router keeps its own text tree per deployment,
fed by where it sent requests. These routers ask the fabric's global index
instead: which node really holds the longest usable prefix of this request
(in pages, SWA rules applied, and the slowest tier they lie on; an engine's own device cache
included), whoever put it there. `FabricRanking` ranks the replicas with
`kvfabric.deploy.placement.FabricScore` (the node where the first token is expected
soonest, its fetch planned as the engine plans it), the same object
`kvfabric replay` measures; replicas are tried best first. What a request's
prompt is comes from a mixin: `GenerateRequestPrompts` for the reference
model server (here), `OpenAIPrompts` for Ray Serve LLM (deploy/vllm/serve/llm_router.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import List, Optional, Sequence

import ray
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import NAMESPACE, node_actor_name
from kvfabric.core.cache.layout import Tier
from kvfabric.deploy.placement import CostModel, FabricScore, NodeView, PageBytes, Prompt, Request
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .disk_rates import DiskRates
from .engine_identity import node_actor_of
from .protocol import GenerateRequest

log = logging.getLogger(__name__)
RETRY_S = 2.0  # how often a router looks again for a fabric (or a node's disk rate) not found
RATE_WAIT_S = 0.05  # a request waits at most this for the disk rates of nodes new to it


@dataclass(frozen=True)
class RoutedPrompt:
    """What the index is asked about a request: its prompt's tokens, in its tenant's namespace."""

    tokens: Sequence[int]
    namespace: str


class FabricRanking(RequestRouter):
    """One `choose_replicas` for every fabric router; `prompt_of` comes from a mixin."""

    def init_ranking(
        self,
        prefill_tokens_per_s: float = 10_000.0,
        transfer_bytes_per_s: float = 10e9,
        fetch_overhead_s: float = 2e-3,
        overhead_s: float = 5e-3,
    ) -> None:
        """The cost model's figures and a request's fixed overhead (a replica measures its
        own; the router ranks by ratios of these, so nominal figures serve). The page
        geometry comes from the fabric, once found."""
        self._cost = CostModel(prefill_tokens_per_s, transfer_bytes_per_s, fetch_overhead_s)
        self._overhead_s = overhead_s
        self._client: FabricClient | None = None
        self._placement: FabricScore | None = None
        self._page_size = 0
        self._next_try = 0.0  # when to look for a fabric not found yet
        self._namespace: str | None = None  # the fabric's, once found
        self._disk_rates = DiskRates(self._ask_disk_rate, RETRY_S)

    def ray_namespace(self) -> str | None:
        """The Ray namespace of the fabric to ask; None while it is not known."""
        return NAMESPACE

    @abstractmethod
    async def prompt_of(self, pending: PendingRequest) -> RoutedPrompt | None:
        """The request's prompt; None to leave the choice to Serve (no prompt, caching off)."""

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        try:
            prompt = await self.prompt_of(pending_request)
        except Exception as e:  # routing must never fail a request
            log.warning("reading the request's prompt failed, routing without the index: %s", e)
            prompt = None
        if prompt is None or not prompt.tokens:
            return [candidate_replicas]
        cached = await self._cached_pages(prompt)
        if cached is None or self._placement is None:
            return [candidate_replicas]  # the index cannot say: Serve's own choice
        names = [node_actor_name(r.node_id) for r in candidate_replicas]
        rates = await self._disk_rates.of(names, RATE_WAIT_S)
        views = []
        for r, name in zip(candidate_replicas, names):
            pages, tier = cached.get(name, (0, Tier.DEVICE))
            views.append(
                NodeView(
                    self._replica_queue_len_cache.get(r.replica_id) or 0,
                    pages,
                    r.replica_id.unique_id,
                    tier,
                    rates[name],
                )
            )
        order = self._placement.rank(
            Request(Prompt(len(prompt.tokens), self._page_size), at_s=time.monotonic()), views
        )
        return [[candidate_replicas[i]] for i in order]

    async def _cached_pages(self, prompt: RoutedPrompt) -> dict[str, tuple[int, Tier]] | None:
        """Node actor name -> usable cached pages of the prompt and the slowest tier they
        lie on; None when the index cannot say."""
        try:
            if self._client is None and not await self._connect():
                return None
            assert self._client is not None
            found = await self._client.lookup_async(prompt.tokens, prompt.namespace)
        except Exception as e:  # routing must never fail a request
            log.warning("fabric lookup failed, routing without it: %s", e)
            return None
        # An engine's own device cache is indexed under its node's name plus the engine
        # (deploy/serving/engine_identity.py): its pages count for the replica on that node.
        cached: dict[str, tuple[int, Tier]] = {}
        for m in found:  # best first: a node's first match is its best
            cached.setdefault(node_actor_of(m.node), (m.pages, m.tier))
        return cached

    async def _connect(self) -> bool:
        """Find the fabric (at most every RETRY_S while it is not there)."""
        if time.monotonic() < self._next_try:
            return False
        self._next_try = time.monotonic() + RETRY_S
        namespace = await asyncio.to_thread(self.ray_namespace)
        if namespace is None:
            return False
        client = await asyncio.to_thread(FabricClient.connect, 2.0, namespace)
        self._page_size = client.layout.page_size
        self._placement = FabricScore(self._cost, PageBytes.of(client.layout), self._overhead_s)
        self._client = client
        self._namespace = namespace
        return True

    async def _ask_disk_rate(self, node: str) -> float:
        """The node actor's disk read bandwidth as it measured it (DiskRates asks)."""
        actor = await asyncio.to_thread(ray.get_actor, node, namespace=self._namespace)
        return float(await actor.disk_read_bytes_per_s.remote())


class GenerateRequestPrompts:
    """The reference model server's requests carry their tokens (deploy/serving/protocol.py)."""

    async def prompt_of(self, pending: PendingRequest) -> RoutedPrompt | None:
        for arg in list(pending.args) + list(pending.kwargs.values()):
            if isinstance(arg, GenerateRequest):
                return RoutedPrompt(arg.tokens, arg.namespace) if arg.use_cache else None
        return None


class FabricRequestRouter(GenerateRequestPrompts, FIFOMixin, FabricRanking):
    # Ray declares the hook as **kwargs and calls it with the deployment's request_router_kwargs.
    def initialize_state(self, **cost: float) -> None:  # type: ignore[override]
        """`cost`: see `FabricRanking.init_ranking`."""
        self.init_ranking(**cost)
