"""FabricRequestRouter: Ray Serve request routing by the cluster-wide page index.

Ray Serve LLM's prefix-aware router keeps its own text tree per deployment,
fed by where it sent requests. This router asks the fabric's global index
instead: which node really holds the longest usable prefix of this request
(in pages, SWA rules applied, any tier), whoever put it there. It ranks the
replicas with `deploy.placement.FabricScore` (the node where the first token
is expected soonest, its fetch planned as the engine plans it), the same
object `kvfabric replay` measures; replicas are tried best first.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from actors import FabricClient
from actors.directory import node_actor_name
from fabric import KVLayout

from .placement import CostModel, FabricScore, NodeView, PageBytes, Prompt, Request
from .protocol import GenerateRequest
from .vllm.engine_identity import node_actor_of

log = logging.getLogger(__name__)


class FabricRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, layout: dict, prefill_tokens_per_s: float = 10_000.0,
                         transfer_bytes_per_s: float = 10e9, fetch_overhead_s: float = 2e-3,
                         overhead_s: float = 5e-3) -> None:
        """`layout`: the model's KVLayout as a dict (page size, and bytes a fetch moves);
        the rest is the cost model's and a request's fixed overhead (a replica measures
        its own; the router ranks by ratios of these, so nominal figures serve)."""
        kv = KVLayout.from_dict(layout)
        self._page_size = kv.page_size
        self._placement = FabricScore(CostModel(prefill_tokens_per_s, transfer_bytes_per_s, fetch_overhead_s),
                                      PageBytes.of(kv), overhead_s)
        self._client: FabricClient | None = None
        self.routed_by_prefix = 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request = _request_of(pending_request)
        if request is None or not request.use_cache or len(candidate_replicas) < 2:
            return [candidate_replicas]
        cached = await self._cached_pages(request)
        if cached is None:
            return [candidate_replicas]       # the index cannot say: Serve's own choice
        views = [NodeView(self._replica_queue_len_cache.get(r.replica_id) or 0,
                          cached.get(node_actor_name(r.node_id), 0), r.replica_id.unique_id)
                 for r in candidate_replicas]
        order = self._placement.rank(Request(Prompt(len(request.tokens), self._page_size),
                                             at_s=time.monotonic()), views)
        self.routed_by_prefix += any(v.cached_pages for v in views)
        return [[candidate_replicas[i]] for i in order]

    async def _cached_pages(self, request: GenerateRequest) -> dict[str, int] | None:
        """Node actor name -> usable cached pages of the prompt; None when the index cannot say."""
        try:
            if self._client is None:
                self._client = await asyncio.to_thread(FabricClient.connect)
            found = await self._client.lookup_async(request.tokens, request.namespace)
        except Exception as e:           # routing must never fail a request
            log.warning("fabric lookup failed, routing without it: %s", e)
            return None
        # An engine's own device cache is indexed under its node's name plus the engine
        # (deploy/vllm/engine_identity.py): its pages count for the replica on that node.
        cached: dict[str, int] = {}
        for m in found:
            node = node_actor_of(m.node)
            cached[node] = max(cached.get(node, 0), m.pages)
        return cached


def _request_of(pending: Optional[PendingRequest]) -> GenerateRequest | None:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, GenerateRequest):
            return arg
    return None
