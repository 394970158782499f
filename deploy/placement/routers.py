"""Where a request goes: the routers `kvfabric replay` compares, one of them deployed.

Each ranks the nodes for one request from what a Ray Serve router sees of them: each
replica's queue length (requests queued or running there) and, for the fabric, what the
global index says each node holds of the prompt. The first node of the ranking is where
the request goes when it accepts (Serve tries the rest in order).
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from .cost import CostModel, PageBytes, Plan, Prompt, plan


@dataclass(frozen=True)
class NodeView:
    queued: int                  # requests queued or running there: Serve's queue length
    cached_pages: int = 0        # of this prompt, usable there (the fabric index's answer)


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    keys: Sequence[bytes] = ()   # the prompt's page keys (a key names its whole prefix)


class Router(ABC):
    @abstractmethod
    def rank(self, req: Request, nodes: Sequence[NodeView]) -> list[int]:
        """Node indexes, best first; at least one when `nodes` is not empty."""

    def routed(self, req: Request, node: int) -> None:
        """`req` went to `node` (whatever the ranking said)."""


def least_queued(candidates: Sequence[int], nodes: Sequence[NodeView]) -> list[int]:
    """`candidates` by queue length, shortest first; ties keep their order (Serve picks
    the first candidate with the lowest queue length)."""
    return sorted(candidates, key=lambda i: nodes[i].queued)


class PowerOfTwo(Router):
    """Ray Serve's default router: two replicas at random, the shorter queue first."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def rank(self, req: Request, nodes: Sequence[NodeView]) -> list[int]:
        n = len(nodes)
        if n <= 2:
            return least_queued(self.rng.sample(range(n), n), nodes)
        return least_queued(self.rng.sample(range(n), 2), nodes)


class FabricScore(Router):
    """The fabric's router (deploy.router.FabricRequestRouter): the node where the first
    token is expected soonest. That is the node's queue, each request in it counted at the
    mean estimate of what this router places, plus this request's own time there: a fixed
    overhead (scheduling, the first decode step), fetching the rest of the longest prefix
    held anywhere when the cost model says moving beats recomputing (the engine then does
    the same), and prefilling what is left. Equal scores go round-robin, so that cold
    requests spread."""

    def __init__(self, cost: CostModel, sizes: PageBytes, overhead_s: float = 0.0,
                 smoothing: float = 0.05) -> None:
        if not 0 < smoothing <= 1 or not overhead_s >= 0:
            raise ValueError(f"smoothing must be in (0, 1] and overhead_s >= 0, got {smoothing!r}, {overhead_s!r}")
        self.cost, self.sizes, self.overhead_s, self.smoothing = cost, sizes, overhead_s, smoothing
        self.mean_s: float | None = None         # the mean estimate of placed requests
        self._turn = 0

    def plan(self, req: Request, have: int, best: int) -> Plan:
        return plan(self.cost, self.sizes, req.prompt, have, best)

    def rank(self, req: Request, nodes: Sequence[NodeView]) -> list[int]:
        n = len(nodes)
        if not n:
            return []
        best = max(v.cached_pages for v in nodes)
        own = [self.overhead_s + self.plan(req, v.cached_pages, best).seconds for v in nodes]
        per_queued = own[0] if self.mean_s is None else self.mean_s
        start, self._turn = self._turn, (self._turn + 1) % n
        order = sorted(range(n), key=lambda i: (nodes[i].queued * per_queued + own[i],
                                                -nodes[i].cached_pages, (i - start) % n))
        chosen = own[order[0]]
        self.mean_s = chosen if self.mean_s is None else self.mean_s + self.smoothing * (chosen - self.mean_s)
        return order
