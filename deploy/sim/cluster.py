"""The cluster that `kvfabric replay` simulates: real `core/` caches and index, simulated time.

Every node is a real metadata-only `NodeCache` (FULL layers only: the trace says nothing of
attention kinds, and FULL is the pool whose pages bound a match), with a device tier and,
when `host_tokens` and `disk_tokens` say so, host and disk tiers under it: pages the device
evicts go down a tier (write-back), and a local hit on a page below the device costs reading
it up (`kvfabric.deploy.sim.local_hit`). Pages are tiny: one page per
512-token trace block, `page_tokens` token ids each, so that 10 x 3M tokens of capacity is a few
thousand pages per node; hit and prefill figures are converted back to real tokens.

A mode is a router of `kvfabric.deploy.placement` over a cache arrangement:
  pow2      Ray Serve's default router (PowerOfTwo) over node-local caches;
  affinity  Ray Serve LLM's PrefixCacheAffinityRouter (PrefixAffinity) over node-local caches;
  global    the fabric as deployed: FabricScore over the real sharded index, and the engine's
            fetch decision (kvfabric.deploy.placement.plan) when a prefill starts
            (`kvfabric.deploy.sim.global_mode`);
  pooled    one LRU cache of the whole cluster's capacity that every node reads at no cost:
            the limit of any cluster-wide cache of that size;
  infinite  one unbounded cache read at no cost: the ceiling.
A cluster decides, against real fabric state, what the router sees of each node (`views`),
what a prefill finds cached when it starts and how long it runs (`serve`), and what a node
stores when its prefill ends (`complete`: the prompt's pages; never the output, since the
trace's block hashes name prompt prefixes only); both are told the simulated time. A node
runs one prefill at a time and only its own completions change its cache, so what `serve`
matched is still there at `complete` (replicas, `global` only, land between prefills).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.cache.layout import KVLayout, LayerKind, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.index.replication import ReplicationConfig
from kvfabric.deploy.placement import (
    CostModel,
    FabricScore,
    NodeView,
    PageBytes,
    Prompt,
    Request,
    Router,
)

from .local_hit import LocalHit, take_local_hit
from .trace import BLOCK_TOKENS, TraceRequest, request_tokens

NAMESPACE = "trace"


class Mode(str, Enum):
    POW2 = "pow2"
    AFFINITY = "affinity"
    GLOBAL = "global"
    POOLED = "pooled"
    INFINITE = "infinite"


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 10
    capacity_tokens: int = 1_000_000  # KV capacity per node, real tokens (its device tier)
    # The host and disk tiers per node, real tokens (0: none, the default: the figures
    # without them stay as they were). Their read bandwidths are the cost model's.
    host_tokens: int = 0
    disk_tokens: int = 0
    shards: int = 8
    page_tokens: int = 4  # token ids per tiny page (one page per trace block)
    overhead_s: float = 0.005  # per request: scheduling, first decode step
    kv_bytes_per_token: int = 131_072  # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x fp16
    cost: CostModel = CostModel(
        prefill_tokens_per_s=10_000.0, transfer_bytes_per_s=10e9, fetch_overhead_s=0.002
    )
    decode_s_per_token: float = 0.02  # an output token, batched with the node's other decodes
    match_rate_threshold: float = 0.1  # affinity: PrefixCacheAffinityRouter's defaults
    imbalanced_threshold: float = math.inf
    seed: int = 0  # the random routers' choices
    rebalance_every: int = 100  # index lookups between rebalance checks
    # global: hot-prefix replication (off here; `kvfabric replay` turns it on by default)
    replication: ReplicationConfig = ReplicationConfig(enabled=False)

    def __post_init__(self) -> None:
        if not isinstance(self.page_tokens, int) or self.page_tokens < 2:
            # One token per page: blocks under one prefix would collide with odds 1/vocab.
            raise ValueError(f"page_tokens must be an int >= 2, got {self.page_tokens!r}")
        for name in ("nodes", "shards", "kv_bytes_per_token", "rebalance_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.capacity_tokens, int) or self.capacity_tokens < BLOCK_TOKENS:
            raise ValueError(
                f"capacity_tokens must be an int >= {BLOCK_TOKENS} (one block), "
                f"got {self.capacity_tokens!r}"
            )
        for name in ("host_tokens", "disk_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not (v == 0 or v >= BLOCK_TOKENS):
                raise ValueError(
                    f"{name} must be 0 (no such tier) or an int >= {BLOCK_TOKENS} (one block), "
                    f"got {v!r}"
                )
        if self.disk_tokens and not self.host_tokens:
            raise ValueError("disk_tokens needs host_tokens: the disk takes what the host evicts")
        for name in ("overhead_s", "decode_s_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not 0 <= self.match_rate_threshold <= 1 or not self.imbalanced_threshold >= 0:
            raise ValueError("match_rate_threshold must be in [0, 1] and imbalanced_threshold >= 0")

    @property
    def capacity_pages(self) -> int:
        return self.capacity_tokens // BLOCK_TOKENS

    @property
    def tier_pages(self) -> PoolCapacity:
        """One node's pages per tier."""
        return PoolCapacity(
            self.capacity_pages, self.host_tokens // BLOCK_TOKENS, self.disk_tokens // BLOCK_TOKENS
        )

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            layers=(LayerKind.FULL,), kv_heads=1, head_dim=1, page_size=self.page_tokens
        )

    @property
    def page_bytes(self) -> PageBytes:
        """What a fetch moves per page: one real 512-token block's K/V."""
        return PageBytes.full(BLOCK_TOKENS * self.kv_bytes_per_token)


@dataclass(frozen=True)
class SimRequest:
    """A trace request with its tiny-page tokens and page keys, computed once for every mode."""

    index: int
    arrival_s: float
    input_length: int  # real prompt tokens
    output_length: int
    tokens: list[int]  # page_tokens ids per block, every block a whole page
    keys: list[bytes]

    @property
    def pages(self) -> int:
        return len(self.keys)

    @property
    def prompt(self) -> Prompt:
        return Prompt(self.input_length, BLOCK_TOKENS)

    @property
    def request(self) -> Request:
        return Request(self.prompt, self.keys, self.arrival_s)

    def hit_tokens(self, pages: int) -> int:
        """Real prompt tokens in the first `pages` blocks (the last block may be partial)."""
        return self.prompt.hit_tokens(pages)


def prepare(trace: Sequence[TraceRequest], config: SimConfig) -> list[SimRequest]:
    keyer = PageKeyer(NAMESPACE, config.layout.fingerprint, config.page_tokens)
    out = []
    for i, r in enumerate(trace):
        # A full-length copy, so that the last (partial) block is a whole page too: its hit is
        # prorated in real tokens by `hit_tokens`, not dropped.
        whole = dataclasses.replace(r, input_length=len(r.hash_ids) * BLOCK_TOKENS)
        tokens = request_tokens(whole, tokens_per_block=config.page_tokens)
        out.append(
            SimRequest(
                i, r.timestamp_ms / 1e3, r.input_length, r.output_length, tokens, keyer.keys(tokens)
            )
        )
    return out


@dataclass(frozen=True)
class Service:
    """What a prefill found when it started, and how long it runs (tokens are real tokens)."""

    local_tokens: int  # found in the node's own cache
    hit_tokens: int  # local plus fetched
    prefill_tokens: int
    fetched_bytes: int
    duration_s: float
    host_tokens: int = 0  # of local_tokens, read up from the node's host tier
    disk_tokens: int = 0  # and from its disk tier


def make_cache(config: SimConfig, pages: PoolCapacity) -> NodeCache:
    """A metadata-only cache of `pages` per tier; pages evicted go a tier down (write-back,
    the default TierConfig), from the device to the host and from the host to disk."""
    caps = {PoolName.FULL: dataclasses.replace(pages, device=max(pages.device, 1))}
    return NodeCache(config.layout, caps, store_bytes=False, device="cpu")


class Cluster:
    """Node-local caches: each node serves what its own cache holds and fetches nothing."""

    def __init__(self, config: SimConfig, router: Router) -> None:
        self.config, self.router = config, router
        self.names = [f"node-{i}" for i in range(config.nodes)]
        self.caches = [make_cache(config, config.tier_pages) for _ in range(config.nodes)]

    def views(self, req: SimRequest, loads: Sequence[int]) -> list[NodeView]:
        """What the router sees of each node: its queue (Serve's routers see no cache)."""
        return [NodeView(q, name=self.names[i]) for i, q in enumerate(loads)]

    def route(self, req: SimRequest, loads: Sequence[int]) -> int:
        node = self.router.rank(req.request, self.views(req, loads))[0]
        self.router.routed(req.request, node)
        return node

    def cache_of(self, node: int) -> NodeCache:
        return self.caches[node]

    def serve(self, node: int, req: SimRequest, now: float) -> Service:
        local = take_local_hit(self.cache_of(node), req.tokens, NAMESPACE)
        return self.service(req, local, local.pages, 0, 0.0)

    def service(
        self, req: SimRequest, local: LocalHit, cached: int, fetched_bytes: int, fetch_s: float
    ) -> Service:
        c = self.config
        hit = req.hit_tokens(cached)
        return Service(
            req.hit_tokens(local.pages),
            hit,
            req.input_length - hit,
            fetched_bytes,
            c.overhead_s
            + self.load_s(local)
            + fetch_s
            + c.cost.recompute_s(req.input_length - hit),
            self.tokens_on(req, local, Tier.HOST),
            self.tokens_on(req, local, Tier.DISK),
        )

    def load_s(self, local: LocalHit) -> float:
        """Reading a local hit's pages below the device up to it, one tier after the other."""
        c = self.config
        return sum(
            c.cost.load_s(t, c.page_bytes.fetch(local.pages_on(t))) for t in (Tier.HOST, Tier.DISK)
        )

    @staticmethod
    def tokens_on(req: SimRequest, local: LocalHit, tier: Tier) -> int:
        """Real prompt tokens of the hit's pages read from `tier` (the last may be partial)."""
        return sum(req.hit_tokens(j + 1) - req.hit_tokens(j) for j in local.positions_on(tier))

    def complete(self, node: int, req: SimRequest, now: float) -> None:
        self.cache_of(node).put(req.tokens, None, NAMESPACE)

    def shard_balance(self) -> float | None:
        return None


class SharedCluster(Cluster):
    """One cache every node reads at no network cost (`pages` of it per tier): pooled, or
    infinite. Its host and disk pages are read up at their tiers' cost, as a node's are."""

    def __init__(self, config: SimConfig, router: Router, pages: PoolCapacity) -> None:
        self.config, self.router = config, router
        self.names = [f"node-{i}" for i in range(config.nodes)]
        self.caches = []  # nodes here are compute only: the cache is shared
        self.shared = make_cache(config, pages)

    def views(self, req: SimRequest, loads: Sequence[int]) -> list[NodeView]:
        held = self.shared.match(req.tokens, NAMESPACE).usable_pages
        return [NodeView(q, held, self.names[i]) for i, q in enumerate(loads)]

    def cache_of(self, node: int) -> NodeCache:
        return self.shared


def fabric_score(config: SimConfig) -> FabricScore:
    return FabricScore(config.cost, config.page_bytes, config.overhead_s)
