"""Ray Serve LLM's PrefixCacheAffinityRouter (ray 2.60), modelled over page keys.

What it does (ray.llm._internal.serve.routing_policies.prefix_aware): it keeps a prefix
tree of the prompts it routed, per replica, inserted when a request is routed (not when
the replica computed or evicted anything: the tree is what was sent, not what is cached;
its eviction is off by default, so it only grows). For a request, when the replicas'
queue lengths differ by no more than `imbalanced_threshold` (default infinity), it walks
the tree along the prompt while some replica owns the next node; if the matched share of
the prompt is at least `match_rate_threshold` (default 0.1) the candidates are the
replicas owning the deepest matched node, else the replicas with the fewest characters
in the tree. Serve sends the request to the candidate with the shortest queue (the first
on ties). When the queues are uneven beyond the threshold it falls back to power of two
choices. Here the tree is over page keys (a key names its whole prefix, so a flat map
from key to owners is the tree) and sizes are in tokens instead of characters.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

from .routers import NodeView, PowerOfTwo, Request, Router, least_queued


class PrefixAffinity(Router):
    def __init__(
        self,
        rng: random.Random,
        match_rate_threshold: float = 0.1,
        imbalanced_threshold: float = math.inf,
    ) -> None:
        if not 0 <= match_rate_threshold <= 1 or not imbalanced_threshold >= 0:
            raise ValueError("match_rate_threshold must be in [0, 1] and imbalanced_threshold >= 0")
        self.match_rate_threshold = match_rate_threshold
        self.imbalanced_threshold = imbalanced_threshold
        self.fallback = PowerOfTwo(rng)
        self.owners: dict[bytes, set[int]] = {}  # page key -> replicas it was routed to
        self.sizes: dict[int, int] = {}  # replica -> tokens it owns in the tree

    def match(self, keys: Sequence[bytes], candidates: Sequence[int]) -> tuple[int, list[int]]:
        """(pages matched, candidates owning the deepest matched page; all of them when
        nothing matched)."""
        allowed = set(candidates)
        depth, owners = 0, list(candidates)
        for k in keys:
            held = self.owners.get(k)
            if not held or not held & allowed:
                break
            depth += 1
            owners = [c for c in candidates if c in held]
        return depth, owners

    def smallest(self, candidates: Sequence[int]) -> list[int]:
        least = min(self.sizes.get(c, 0) for c in candidates)
        return [c for c in candidates if self.sizes.get(c, 0) == least]

    def rank(self, req: Request, nodes: Sequence[NodeView]) -> list[int]:
        fallback = self.fallback.rank(req, nodes)  # Ray computes it first, always
        queued = [v.queued for v in nodes]
        if not req.keys or not nodes or max(queued) - min(queued) > self.imbalanced_threshold:
            return fallback
        candidates = list(range(len(nodes)))
        depth, owners = self.match(req.keys, candidates)
        rate = req.prompt.hit_tokens(depth) / req.prompt.tokens if req.prompt.tokens else 0.0
        chosen = owners if rate >= self.match_rate_threshold else self.smallest(candidates)
        return least_queued(chosen, nodes)

    def routed(self, req: Request, node: int) -> None:
        """Insert the prompt for `node`, as Ray's on_request_routed does."""
        size = self.sizes.get(node, 0)
        for j, k in enumerate(req.keys):
            held = self.owners.setdefault(k, set())
            if node not in held:
                held.add(node)
                size += req.prompt.hit_tokens(j + 1) - req.prompt.hit_tokens(j)
        self.sizes[node] = size
