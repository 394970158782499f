"""Where a request goes: the routers `kvfabric replay` compares, one of them deployed.

Each ranks the nodes for one request from what a Ray Serve router sees of them: each
replica's queue length (requests queued or running there) and, for the fabric, what the
global index says each node holds of the prompt and what the router itself sent there.
The first node of the ranking is where the request goes when it accepts (Serve tries the
rest in order).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from kvfabric.core.cache.layout import Tier

from .cost import CostModel, PageBytes, Plan, Prompt, plan


@dataclass(frozen=True)
class NodeView:
    queued: int  # requests queued or running there: Serve's queue length
    cached_pages: int = 0  # of this prompt, usable there (the fabric index's answer)
    name: str = ""  # the node, the same from one request to the next
    # The slowest tier those pages need reading from (the index's answer too), and the
    # node's own disk read bandwidth as it measured it at start (0: the cost model's).
    tier: Tier = Tier.DEVICE
    disk_read_bytes_per_s: float = 0.0


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    keys: Sequence[bytes] = ()  # the prompt's page keys (a key names its whole prefix)
    at_s: float = 0.0  # when it is routed, on the router's clock


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
    """The fabric's router (kvfabric.deploy.serving.router.FabricRequestRouter): the node where
    the first token is expected soonest. That is when the prefills this router already sent there
    should end (its own estimates, on its own clock: a replica's queue length counts the
    requests decoding there too, which hardly delay a prefill), plus this request's own
    time there: a fixed overhead (scheduling, the first decode step), reading its own hit
    up from the tier the index says it lies on (host memory, or disk at the node's measured
    bandwidth), fetching the rest of the longest prefix held anywhere when the cost model
    says moving beats recomputing (the engine then does the same), and prefilling what is
    left. Ties go to the shorter
    queue, then round-robin, so that cold requests spread. The first node ranked is taken
    to be where the request goes."""

    def __init__(self, cost: CostModel, sizes: PageBytes, overhead_s: float = 0.0) -> None:
        if not overhead_s >= 0:
            raise ValueError(f"overhead_s must be >= 0, got {overhead_s!r}")
        self.cost, self.sizes, self.overhead_s = cost, sizes, overhead_s
        self.free_at: dict[str, float] = {}  # node -> when the prefills sent there should end
        self._turn = 0

    def plan(self, req: Request, have: int, best: int, source: NodeView | None = None) -> Plan:
        if source is None:
            return plan(self.cost, self.sizes, req.prompt, have, best)
        rate = source.disk_read_bytes_per_s
        return plan(self.cost, self.sizes, req.prompt, have, best, source.tier, rate)

    def load_s(self, view: NodeView) -> float:
        """Reading the node's own hit up to its device, at its slowest tier's bandwidth."""
        if not view.cached_pages or view.tier is Tier.DEVICE:
            return 0.0
        nbytes = self.sizes.fetch(view.cached_pages)
        return self.cost.load_s(view.tier, nbytes, view.disk_read_bytes_per_s)

    def backlog_s(self, node: str, now: float) -> float:
        return max(0.0, self.free_at.get(node, now) - now)

    def rank(self, req: Request, nodes: Sequence[NodeView]) -> list[int]:
        n = len(nodes)
        if not n:
            return []
        best = max(v.cached_pages for v in nodes)
        source = min((v for v in nodes if v.cached_pages == best), key=lambda v: v.tier)
        own = [
            self.overhead_s + self.load_s(v) + self.plan(req, v.cached_pages, best, source).seconds
            for v in nodes
        ]
        wait = [self.backlog_s(v.name, req.at_s) for v in nodes]
        start, self._turn = self._turn, (self._turn + 1) % n
        order = sorted(
            range(n),
            key=lambda i: (
                wait[i] + own[i],
                -nodes[i].cached_pages,
                nodes[i].queued,
                (i - start) % n,
            ),
        )
        top = order[0]
        if len(self.free_at) > 2 * n:  # replicas come and go: keep the ones ranked now
            self.free_at = {v.name: self.free_at[v.name] for v in nodes if v.name in self.free_at}
        self.free_at[nodes[top].name] = req.at_s + wait[top] + own[top]
        return order
