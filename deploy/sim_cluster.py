"""The cluster that `kvfabric replay` simulates: real `fabric/` caches and index, simulated time.

Every node is a real metadata-only `NodeCache` (FULL layers only: the trace says nothing of
attention kinds, and FULL is the pool whose pages bound a match). Pages are tiny: one page per
512-token trace block, `page_tokens` token ids each, so that 10 x 3M tokens of capacity is a few
thousand pages per node; hit and prefill figures are converted back to real tokens.

A policy per mode decides three things, all against real fabric state:
  route:    which node's queue a request joins, when it arrives (see each policy);
  serve:    what it finds cached when its prefill starts, and how long the prefill takes;
  complete: what the node stores when the prefill ends (the prompt's pages; never the output,
            since the trace's block hashes name prompt prefixes only).
A node serves one prefill at a time, and only its own completions change its cache, so what
`serve` matched is still there at `complete`.
"""
from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from fabric import EventPublisher, KVLayout, NodeCache, PageKeyer, PoolCapacity, PoolName
from fabric.sharded_index import ShardedIndex
from fabric.balance import chance_target

from .engine import CostModel
from .trace import BLOCK_TOKENS, TraceRequest, request_tokens

NAMESPACE = "trace"


class Mode(str, Enum):
    LOCAL = "local"          # each node its own cache; route to the longest local match within a load bound
    GLOBAL = "global"        # the fabric: route by expected TTFT, fetch the rest from the best remote holder
    INFINITE = "infinite"    # one cache of unbounded size shared by every node: the ceiling


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 10
    capacity_tokens: int = 3_000_000       # KV capacity per node, real tokens
    shards: int = 8
    page_tokens: int = 4                   # token ids per tiny page (one page per trace block)
    load_bound: int = 2                    # local routing: requests beyond the least loaded node
    overhead_s: float = 0.005              # per request: scheduling, first decode step
    kv_bytes_per_token: int = 131_072      # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x fp16
    cost: CostModel = CostModel(prefill_tokens_per_s=10_000.0, transfer_bytes_per_s=10e9,
                                fetch_overhead_s=0.002)
    rebalance_every: int = 100             # index lookups between rebalance checks
    rebalance_target: float = 1.1           # ShardedIndex's default
    rebalance_sigmas: float = 2.0          # how far beyond chance an imbalance must be to split

    def __post_init__(self) -> None:
        if not isinstance(self.page_tokens, int) or self.page_tokens < 2:
            # One token per page: blocks under one prefix would collide with odds 1/vocab.
            raise ValueError(f"page_tokens must be an int >= 2, got {self.page_tokens!r}")
        for name in ("nodes", "shards", "kv_bytes_per_token", "rebalance_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.capacity_tokens, int) or self.capacity_tokens < BLOCK_TOKENS:
            raise ValueError(f"capacity_tokens must be an int >= {BLOCK_TOKENS} (one block), "
                             f"got {self.capacity_tokens!r}")
        if not isinstance(self.load_bound, int) or self.load_bound < 0:
            raise ValueError(f"load_bound must be an int >= 0, got {self.load_bound!r}")
        for name in ("overhead_s", "rebalance_sigmas"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not (isinstance(self.rebalance_target, (int, float)) and self.rebalance_target >= 1):
            raise ValueError(f"rebalance_target must be >= 1, got {self.rebalance_target!r}")

    @property
    def capacity_pages(self) -> int:
        return self.capacity_tokens // BLOCK_TOKENS

    @property
    def layout(self) -> KVLayout:
        return KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=self.page_tokens)


@dataclass(frozen=True)
class SimRequest:
    """A trace request with its tiny-page tokens and page keys, computed once for every mode."""
    index: int
    arrival_s: float
    input_length: int            # real prompt tokens
    tokens: list[int]            # page_tokens ids per block, every block a whole page
    keys: list[bytes]

    @property
    def pages(self) -> int:
        return len(self.keys)

    def hit_tokens(self, pages: int) -> int:
        """Real prompt tokens in the first `pages` blocks (the last block may be partial)."""
        return min(pages * BLOCK_TOKENS, self.input_length)


def prepare(trace: Sequence[TraceRequest], config: SimConfig) -> list[SimRequest]:
    keyer = PageKeyer(NAMESPACE, config.layout.fingerprint, config.page_tokens)
    out = []
    for i, r in enumerate(trace):
        # A full-length copy, so that the last (partial) block is a whole page too: its hit is
        # prorated in real tokens by `hit_tokens`, not dropped.
        whole = dataclasses.replace(r, input_length=len(r.hash_ids) * BLOCK_TOKENS)
        tokens = request_tokens(whole, tokens_per_block=config.page_tokens)
        out.append(SimRequest(i, r.timestamp_ms / 1e3, r.input_length, tokens, keyer.keys(tokens)))
    return out


@dataclass(frozen=True)
class Service:
    """What a prefill found when it started, and how long it runs (tokens are real tokens)."""
    local_tokens: int            # found in the node's own cache
    hit_tokens: int              # local plus fetched
    prefill_tokens: int
    fetched_bytes: int
    duration_s: float


@dataclass(frozen=True)
class Placement:
    node: int
    estimate_s: float            # expected service time there, for the router's backlog view


@dataclass
class SimNode:
    name: str
    cache: NodeCache
    publisher: EventPublisher | None = None


def _make_cache(config: SimConfig, pages: int) -> NodeCache:
    caps = {PoolName.FULL: PoolCapacity(device=pages, host=0)}
    return NodeCache(config.layout, caps, store_bytes=False, device="cpu")


class Policy(ABC):
    """Routing and service of one mode. The router sees, per node, `loads` (requests queued or
    running) and `backlog_s` (expected seconds until the node is free: what is left of the
    running prefill plus the estimates of the queued ones)."""
    mode: Mode

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.nodes = self._make_nodes()
        self._turn = 0

    def _make_nodes(self) -> list[SimNode]:
        c = self.config
        return [SimNode(f"node-{i}", _make_cache(c, c.capacity_pages)) for i in range(c.nodes)]

    @abstractmethod
    def route(self, req: SimRequest, loads: list[int], backlog_s: list[float]) -> Placement:
        """Where `req` goes, and what it fetches on the way."""

    def _rotation(self, n: int) -> list[int]:
        """Node order for tie-breaks: round-robin, so that cold requests spread."""
        start, self._turn = self._turn, (self._turn + 1) % n
        return [*range(start, n), *range(start)]

    def _estimate(self, req: SimRequest, cached_pages: int, fetched_bytes: int = 0) -> float:
        c = self.config
        fetch = c.cost.transfer_s(fetched_bytes) if fetched_bytes else 0.0
        return c.overhead_s + fetch + c.cost.recompute_s(req.input_length - req.hit_tokens(cached_pages))

    def serve(self, node: int, req: SimRequest) -> Service:
        local = self.nodes[node].cache.get(req.tokens, NAMESPACE).tokens // self.config.page_tokens
        return self._service(req, local, local, 0)

    def _service(self, req: SimRequest, local: int, cached: int, fetched_bytes: int) -> Service:
        hit = req.hit_tokens(cached)
        return Service(req.hit_tokens(local), hit, req.input_length - hit, fetched_bytes,
                       self._estimate(req, cached, fetched_bytes))

    def complete(self, node: int, req: SimRequest) -> None:
        self.nodes[node].cache.put(req.tokens, None, NAMESPACE)

    def shard_balance(self) -> float | None:
        return None


class LocalPolicy(Policy):
    """Each node alone: the router asks every node's cache (no shared index), fetches nothing."""
    mode = Mode.LOCAL

    def route(self, req: SimRequest, loads: list[int], backlog_s: list[float]) -> Placement:
        """The longest match among nodes within the load bound (queue no longer than the
        shortest plus `load_bound`); ties to the least loaded, then round-robin."""
        bound = min(loads) + self.config.load_bound
        best, best_key = -1, None
        for i in self._rotation(len(loads)):
            if loads[i] <= bound:
                key = (self.nodes[i].cache.match(req.tokens, NAMESPACE).pages, -loads[i])
                if best_key is None or key > best_key:
                    best, best_key = i, key
        return Placement(best, self._estimate(req, best_key[0]))


class InfinitePolicy(Policy):
    """One unbounded cache every node reads at no cost: the ceiling for any placement (up to
    timing: hits count what is cached when a prefill starts, and queueing changes that)."""
    mode = Mode.INFINITE

    def __init__(self, config: SimConfig, total_pages: int) -> None:
        super().__init__(config)
        self.shared = _make_cache(config, max(total_pages, 1))

    def _make_nodes(self) -> list[SimNode]:
        return []           # nodes here are compute only: the cache is shared

    def route(self, req: SimRequest, loads: list[int], backlog_s: list[float]) -> Placement:
        """Every node sees the same cache: the one free soonest."""
        node = min(self._rotation(len(loads)), key=backlog_s.__getitem__)
        return Placement(node, self._estimate(req, self.shared.match(req.tokens, NAMESPACE).pages))

    def serve(self, node: int, req: SimRequest) -> Service:
        local = self.shared.get(req.tokens, NAMESPACE).tokens // self.config.page_tokens
        return self._service(req, local, local, 0)

    def complete(self, node: int, req: SimRequest) -> None:
        self.shared.put(req.tokens, None, NAMESPACE)


class GlobalPolicy(Policy):
    """The fabric: every node publishes its page events into the real sharded index. The router
    asks the index who holds how much of the prompt and sends the request where it expects the
    first token soonest: that node's backlog, plus fetching the rest of the longest match held
    anywhere when the cost model says moving beats recomputing, plus prefilling what is left
    (Mooncake's conductor does the same). The chosen node then fetches as planned."""
    mode = Mode.GLOBAL

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.index = ShardedIndex(config.shards, window_pages=0, has_full=True)
        self.slot = {n.name: i for i, n in enumerate(self.nodes)}
        self.lookups = 0
        self.splits = 0
        self.fetches = 0
        for n in self.nodes:
            n.publisher = EventPublisher(n.cache, n.name, epoch=1)
            self._publish(n)        # batch 0 of every shard says `cleared`: snapshots need a seq

    def _lookup(self, req: SimRequest) -> dict[int, int]:
        found = self.index.lookup(req.keys)
        self.lookups += 1
        if self.lookups % self.config.rebalance_every == 0:
            self._rebalance()
        return {self.slot[m.node]: m.pages for m in found}

    def route(self, req: SimRequest, loads: list[int], backlog_s: list[float]) -> Placement:
        # Routing on the match alone (within a load bound) would send every new conversation
        # to the holders of its system prompt: their caches churn while others idle. A fetch
        # is cheap, so a holder is worth only the time its match saves.
        matches = self._lookup(req)
        best = max(matches.values(), default=0)
        choice, choice_key, choice_est = -1, None, 0.0
        for i in self._rotation(len(loads)):
            have = matches.get(i, 0)
            estimate = self._estimate(req, *self._plan(req, have, best))
            key = (backlog_s[i] + estimate, -have)
            if choice_key is None or key < choice_key:
                choice, choice_key, choice_est = i, key, estimate
        return Placement(choice, choice_est)

    def _plan(self, req: SimRequest, have: int, best: int) -> tuple[int, int]:
        """(pages cached after a fetch if any, bytes fetched) for a node holding `have` pages
        when some node holds `best`: fetch when moving is cheaper than recomputing."""
        if best <= have:
            return have, 0
        extra = req.hit_tokens(best) - req.hit_tokens(have)
        nbytes = extra * self.config.kv_bytes_per_token
        return (best, nbytes) if self.config.cost.should_fetch(extra, nbytes) else (have, 0)

    def serve(self, node: int, req: SimRequest) -> Service:
        c = self.config
        local = self.nodes[node].cache.get(req.tokens, NAMESPACE).tokens // c.page_tokens
        remote = {i: p for i, p in self._lookup(req).items() if i != node}
        src = max(remote, key=lambda i: (remote[i], -i), default=None)
        cached, nbytes = self._plan(req, local, remote[src] if src is not None else 0)
        if nbytes:
            # The source serves the export: its pages count as used, as a real export's do.
            self.nodes[src].cache.get(req.tokens[: cached * c.page_tokens], NAMESPACE)
            self.fetches += 1
        return self._service(req, local, cached, nbytes)

    def complete(self, node: int, req: SimRequest) -> None:
        # The fetched pages and the computed ones go in together: nothing else writes to this
        # node's cache while its one prefill runs, so this equals inserting at fetch time.
        super().complete(node, req)
        self._publish(self.nodes[node])

    def _publish(self, node: SimNode) -> None:
        self.index.apply(node.publisher.drain_routed(self.index.routes))

    def _rebalance(self) -> None:
        c = self.config      # split only on imbalance beyond chance
        target = chance_target(c.rebalance_target, self.index.load.lookups, c.rebalance_sigmas)
        if target is None:
            return
        before = self.index.routes
        split = self.index.rebalance(target=target)
        if split is None:
            return
        self.splits += 1
        if len(split.children) == 1 and split.shards[0] == before.locate(split.path)[0]:
            # A lone child descended into on its own shard: every page stays where it was, so
            # nodes need not resend (a spread, even to one shard, moves the other children).
            return
        for n in self.nodes:        # shard state is soft: each node resends under the new routes
            for shard, snap in n.publisher.snapshots(self.index.routes).items():
                self.index.load_snapshot(shard, snap)

    def shard_balance(self) -> float | None:
        return self.index.load_max_over_mean()

    def index_disagreements(self, requests: Sequence[SimRequest]) -> list[int]:
        """Requests for which the index's answer differs from what the nodes' caches hold.
        Asks the owning shard directly, so that the check adds no lookup load."""
        bad = []
        for req in requests:
            if not req.keys:
                continue
            shard = self.index.shards[self.index.routes.owner(req.keys)]
            said = {m.node: m.pages for m in shard.lookup(req.keys)}
            held = {n.name: p for n in self.nodes if (p := n.cache.match(req.tokens, NAMESPACE).pages)}
            if said != held:
                bad.append(req.index)
        return bad


def make_policy(mode: Mode, config: SimConfig, requests: Sequence[SimRequest]) -> Policy:
    if mode is Mode.LOCAL:
        return LocalPolicy(config)
    if mode is Mode.GLOBAL:
        return GlobalPolicy(config)
    return InfinitePolicy(config, sum(r.pages for r in requests))
