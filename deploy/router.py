"""FabricRequestRouter: Ray Serve request routing by the cluster-wide page index.

Ray Serve LLM's prefix-aware router keeps its own text tree per deployment,
fed by where it sent requests. This router asks the fabric's global index
instead: which node really holds the longest usable prefix of this request
(in pages, SWA rules applied, any tier), whoever put it there. Each candidate
replica scores the prompt tokens its node would not have to prefill, less a
penalty per request already queued on it; replicas are tried best first.
"""
from __future__ import annotations

import asyncio
import logging
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from actors import FabricClient
from actors.directory import node_actor_name

from .protocol import GenerateRequest
from .vllm.engine_identity import node_actor_of

log = logging.getLogger(__name__)


class FabricRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, queue_penalty_tokens: int = 256, page_size: int = 16) -> None:
        """`queue_penalty_tokens`: how many cached prompt tokens one queued request
        is worth giving up (a request ahead of this one delays it about that much)."""
        if queue_penalty_tokens < 0 or page_size <= 0:
            raise ValueError("queue_penalty_tokens must be >= 0 and page_size > 0")
        self._penalty = queue_penalty_tokens
        self._page_size = page_size
        self._client: FabricClient | None = None
        self.routed_by_prefix = 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request = _request_of(pending_request)
        if request is None or not request.use_cache or len(candidate_replicas) < 2:
            return [candidate_replicas]
        cached = await self._cached_pages(request)
        if not any(cached.values()):
            return [candidate_replicas]       # nothing cached anywhere: any replica will do
        scored = sorted(candidate_replicas, key=lambda r: -self._score(r, cached))
        self.routed_by_prefix += 1
        return [[r] for r in scored]

    def _score(self, replica: RunningReplica, cached: dict[str, int]) -> float:
        pages = cached.get(node_actor_name(replica.node_id), 0)
        queued = self._replica_queue_len_cache.get(replica.replica_id) or 0
        return pages * self._page_size - self._penalty * queued

    async def _cached_pages(self, request: GenerateRequest) -> dict[str, int]:
        """Node actor name -> usable cached pages of the prompt; {} when the index cannot say."""
        try:
            if self._client is None:
                self._client = await asyncio.to_thread(FabricClient.connect)
            found = await self._client.lookup_async(request.tokens, request.namespace)
        except Exception as e:           # routing must never fail a request
            log.warning("fabric lookup failed, routing without it: %s", e)
            return {}
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
