"""Hot-prefix replication in the replay's `global` mode: the real ReplicationPolicy
(kvfabric.core.index.replication) fed the simulated cluster's remote fetches and local hits.

A replica is the prefix's pages put in the target node's own cache, the same capacity as
without replication (it takes room from that node's other pages, and eviction treats it
like any other cached prefix); the target publishes it, so routers and fetch planners see
it. The copy runs in the background (a NIXL read that costs no prefill): it lands when it
is decided if the target is idle, else when the target's running prefill ends (a node's
cache changes only between its prefills, as everywhere in the replay). Its bytes are
counted apart from the requests' fetches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.index.replication import (
    Drop,
    Holders,
    Replicate,
    ReplicationConfig,
    ReplicationPolicy,
)

from .cluster import NAMESPACE, SimRequest


@dataclass
class ReplicaStats:
    placed: int = 0  # replicas decided
    landed: int = 0  # of those, put in their target's cache
    pages_copied: int = 0  # pages the landed copies stored anew
    dropped: int = 0  # replicas that went cold
    evicted: int = 0  # replicas eviction took before they went cold


@dataclass
class Replicator:
    """What the `global` cluster delegates replication to; its state is its own."""

    config: ReplicationConfig
    caches: Sequence[NodeCache]
    names: Sequence[str]
    capacity_pages: int
    page_tokens: int
    holders: Holders  # nodes that hold a whole prefix, as the index says
    publish: Callable[[int], None]  # a node's cache changed: tell the index
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    def __post_init__(self) -> None:
        self.policy = ReplicationPolicy(self.config, dict.fromkeys(self.names, self.capacity_pages))
        self.slot = {n: i for i, n in enumerate(self.names)}
        self.running: set[int] = set()  # nodes in a prefill
        self.pending: dict[int, list[Replicate]] = {}  # busy targets' copies, in order
        self.tokens: dict[bytes, list[int]] = {}  # a fetched page key -> its request's tokens

    def served(self, now: float, node: int, req: SimRequest, local: int) -> None:
        """`node` starts a prefill that found `local` pages in its own cache."""
        self.running.add(node)
        if local:
            self.policy.hit(now, self.names[node], req.keys[:local])

    def fetched(self, now: float, node: int, source: int, req: SimRequest, pages: int) -> None:
        for key in req.keys[:pages]:
            self.tokens.setdefault(key, req.tokens)
        self.policy.fetched(now, req.keys[:pages], self.names[source], self.names[node])

    def completed(self, now: float, node: int) -> None:
        """`node`'s prefill ended and its cache and the index took its pages: its queued
        copies land, evictions are noticed, and the policy decides."""
        self.running.discard(node)
        for r in self.pending.pop(node, []):
            self._land(r)
        self._check(node)
        for d in self.policy.decide(now, self.holders):
            if isinstance(d, Drop):
                self.stats.dropped += 1
                continue
            self.stats.placed += 1
            target = self.slot[d.target]
            if target in self.running:
                self.pending.setdefault(target, []).append(d)
            else:
                self._land(d)

    def _land(self, r: Replicate) -> None:
        if (r.target, r.keys[-1]) not in self.policy.replicas:
            return  # went cold or was lost while it waited for its target
        target = self.slot[r.target]
        tokens = self.tokens[r.keys[-1]][: len(r.keys) * self.page_tokens]
        new = self.caches[target].put(tokens, None, NAMESPACE)
        self.stats.landed += 1
        self.stats.pages_copied += new
        self.publish(target)
        self._check(target)

    def _check(self, node: int) -> None:
        """Replicas on `node` that its cache no longer holds whole are lost."""
        cache, name = self.caches[node], self.names[node]
        mine = [r.keys for r in self.policy.replicas.values() if r.node == name]
        for keys in mine:
            if cache.match_keys(list(keys)).usable_pages < len(keys):
                self.policy.lost(name, keys)
                self.stats.evicted += 1

    def replica_pages(self) -> int:
        return sum(self.policy.used.values())
