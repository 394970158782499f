"""Hot-prefix replication: which prefixes to copy to more nodes ahead of demand, and which
copies to give up. Pure logic, fed events and an injected clock; whoever holds it (the
replay's cluster, or the index's actor) carries out its decisions.

A prefix is hot when remote fetches passed through it at least `threshold` times within
the last `window_s` seconds (a fetch of pages K[:n] passes through every K[:d], d <= n;
chained keys name their whole prefix, so the deepest hot K[:d] of a fetch is the hot
prefix that fetch met). A hot prefix is copied to nodes that do not hold it, each copy (a
replica) counted against its target's budget. A replica not hit within the window is cold:
it is dropped (the fabric stops counting it; its pages stay as ordinary cached pages that
eviction takes first, being the least recently used) before any budget is spent anew.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

Chain = tuple[bytes, ...]  # a prefix's page keys from page 0
Holders = Callable[[Chain], Collection[str]]  # nodes that hold all of a prefix now


@dataclass(frozen=True)
class ReplicationConfig:
    """`budget_pages` (per node) wins over `budget_fraction` (of each node's capacity)."""

    enabled: bool = True
    threshold: int = 4  # remote fetches of a prefix within the window that make it hot
    window_s: float = 60.0
    budget_pages: int | None = None
    budget_fraction: float = 0.1
    fanout: int = 2  # new replicas of one hot prefix per decision
    min_pages: int = 1  # shorter prefixes are not worth a copy

    def __post_init__(self) -> None:
        for name in ("threshold", "fanout", "min_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.window_s, (int, float)) and 0 < self.window_s < math.inf):
            raise ValueError(f"window_s must be a number > 0, got {self.window_s!r}")
        if self.budget_pages is not None and (
            not isinstance(self.budget_pages, int) or self.budget_pages < 0
        ):
            raise ValueError(f"budget_pages must be an int >= 0, got {self.budget_pages!r}")
        if not 0 <= self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in [0, 1], got {self.budget_fraction!r}")

    def budget(self, capacity_pages: int) -> int:
        """Replica pages a node of `capacity_pages` may hold."""
        if self.budget_pages is not None:
            return min(self.budget_pages, capacity_pages)
        return int(self.budget_fraction * capacity_pages)


@dataclass(frozen=True)
class Replicate:
    """Copy the prefix `keys` from `source` (a node that holds it) to `target`."""

    keys: Chain
    source: str
    target: str


@dataclass(frozen=True)
class Drop:
    """`node`'s replica of `keys` went cold: it no longer counts as a replica."""

    keys: Chain
    node: str


Decision = Replicate | Drop


@dataclass
class Replica:
    keys: Chain
    node: str
    placed_s: float
    last_hit_s: float


@dataclass(frozen=True)
class _Fetch:
    at_s: float
    keys: Chain
    source: str


class ReplicationPolicy:
    """Watches remote fetches and local hits; `decide` says what to copy and what to drop.
    Deterministic: the same events at the same times give the same decisions."""

    def __init__(self, config: ReplicationConfig, capacity_pages: Mapping[str, int]) -> None:
        self.config = config
        self.budgets = {n: config.budget(c) for n, c in capacity_pages.items()}
        self._fetches: deque[_Fetch] = deque()  # within the window, oldest first
        self._through: Counter[bytes] = Counter()  # chain-end key -> fetches through it
        self._hot: dict[bytes, _Fetch] = {}  # chain-end key -> the latest fetch it was hot in
        self.replicas: dict[tuple[str, bytes], Replica] = {}  # (node, chain-end key) ->
        self.used = dict.fromkeys(self.budgets, 0)  # replica pages per node
        self.placed = 0
        self.dropped = 0

    # --- events -------------------------------------------------------------------------
    def fetched(self, now: float, keys: Sequence[bytes], source: str, reader: str) -> None:
        """`reader` fetched the pages `keys` (page 0 on) from `source`."""
        if not self.config.enabled or not keys:
            return
        self._expire(now)
        fetch = _Fetch(now, tuple(keys), source)
        self._fetches.append(fetch)
        self._through.update(fetch.keys)
        self.hit(now, source, fetch.keys)  # a replica that serves a fetch is not cold
        hot = 0
        for d, key in enumerate(fetch.keys, 1):
            if self._through[key] < self.config.threshold:
                break  # shallower keys are passed through at least as often: none deeper
            hot = d
        if hot >= self.config.min_pages:
            end = fetch.keys[hot - 1]
            self._hot[end] = _Fetch(now, fetch.keys[:hot], source)
            for d in range(hot - 1):  # a longer hot prefix covers the shorter ones
                self._hot.pop(fetch.keys[d], None)

    def hit(self, now: float, node: str, keys: Sequence[bytes]) -> None:
        """`node` served the pages `keys` (page 0 on) itself: the replicas there that they
        cover whole stay warm."""
        if not self.config.enabled:
            return
        for d, key in enumerate(keys, 1):
            replica = self.replicas.get((node, key))
            if replica is not None and replica.keys == tuple(keys[:d]):
                replica.last_hit_s = max(replica.last_hit_s, now)

    def lost(self, node: str, keys: Sequence[bytes]) -> None:
        """`node` no longer holds its replica of `keys` (evicted, or the node left)."""
        replica = self.replicas.pop((node, keys[-1]), None) if keys else None
        if replica is not None:
            self.used[node] -= len(replica.keys)

    # --- decisions ----------------------------------------------------------------------
    def decide(self, now: float, holders: Holders) -> list[Decision]:
        """Drop the cold replicas, then place hot prefixes (hottest first) on nodes that do
        not hold them and have the budget room, least used first; every decision is
        applied to the policy's own state as it is returned."""
        if not self.config.enabled:
            return []
        self._expire(now)
        out: list[Decision] = []
        cold = sorted(
            (r for r in self.replicas.values() if now - r.last_hit_s > self.config.window_s),
            key=lambda r: (r.last_hit_s, r.node, r.keys),
        )
        for r in cold:
            self.lost(r.node, r.keys)
            self.dropped += 1
            out.append(Drop(r.keys, r.node))
        ranked = sorted(
            self._hot.values(), key=lambda f: (-self._through[f.keys[-1]], -len(f.keys), f.keys)
        )
        for hot in ranked:
            held = set(holders(hot.keys))
            if hot.source not in held and held:
                source = min(held)  # the fetch's source lost it since: copy from a holder
            elif hot.source in held:
                source = hot.source
            else:
                continue  # nobody holds it any more
            pages = len(hot.keys)
            targets = sorted(
                (
                    n
                    for n, budget in self.budgets.items()
                    if n not in held
                    and (n, hot.keys[-1]) not in self.replicas
                    and self.used[n] + pages <= budget
                ),
                key=lambda n: (self.used[n], n),
            )
            for target in targets[: self.config.fanout]:
                self.replicas[(target, hot.keys[-1])] = Replica(hot.keys, target, now, now)
                self.used[target] += pages
                self.placed += 1
                out.append(Replicate(hot.keys, source, target))
        return out

    def add_node(self, node: str, capacity_pages: int) -> None:
        self.budgets[node] = self.config.budget(capacity_pages)
        self.used.setdefault(node, 0)

    def remove_node(self, node: str) -> None:
        for r in [r for r in self.replicas.values() if r.node == node]:
            self.lost(node, r.keys)
        self.budgets.pop(node, None)
        self.used.pop(node, None)
        self._hot = {k: f for k, f in self._hot.items() if f.source != node}

    # --- the window ---------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        horizon = now - self.config.window_s
        while self._fetches and self._fetches[0].at_s < horizon:
            old = self._fetches.popleft()
            self._through.subtract(old.keys)
            for key in old.keys:
                if self._through[key] <= 0:
                    del self._through[key]
        for end in [e for e in self._hot if self._through[e] < self.config.threshold]:
            del self._hot[end]
