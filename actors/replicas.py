"""The directory's half of hot-prefix replication: node actors report the remote fetches
they committed; the ReplicationPolicy (kvfabric.core.index.replication) decides; a copy is
the target node actor pulling the prefix from a holder through the ordinary remote-fetch
transaction (`NodeCacheActor.replicate`), so a replica is an ordinary cached prefix there,
published and evictable. A copy that does not commit gives its budget back.

Ray stays outside: the directory hands in how to find a prefix's holders (an index
lookup) and how to start a copy; this holds the policy, the clock and the tokens each
hot prefix needs, and is safe to call from the directory's threads."""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Collection

from kvfabric.core.index.replication import (
    Holders,
    Replicate,
    ReplicationConfig,
    ReplicationPolicy,
)

KEPT = 1 << 14  # page keys whose tokens are kept (a hot prefix's are recent ones)
COMMITTED = "committed"  # FetchOutcome.COMMITTED's value, what a node actor's fetch returns


@dataclass(frozen=True)
class FetchReport:
    """A reader's committed remote fetch: the pages `keys` (page 0 on) of `tokens`."""

    source: str
    reader: str
    namespace: str
    tokens: tuple[int, ...]
    keys: tuple[bytes, ...]


# (target, source, tokens, namespace, done): start a copy; `done(outcome)` when it ends.
StartCopy = Callable[[str, str, list[int], str, Callable[[str], None]], None]


class ReplicaDirector:
    def __init__(
        self,
        config: ReplicationConfig,
        page_tokens: int,
        holders: Holders,
        copy: StartCopy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_tokens = page_tokens
        self.policy = ReplicationPolicy(config, {})
        self.holders, self.copy, self.clock = holders, copy, clock
        self._lock = threading.Lock()
        # page key -> a fetched request's tokens and namespace, the most recent KEPT keys
        self._tokens: OrderedDict[bytes, tuple[tuple[int, ...], str]] = OrderedDict()
        self.failed = 0  # copies that did not commit

    def members(self, nodes: Collection[str], capacity_pages: int) -> None:
        """The fabric's node actors now: new ones get a budget, gone ones lose theirs."""
        with self._lock:
            for node in sorted(set(self.policy.budgets) - set(nodes)):
                self.policy.remove_node(node)
            for node in sorted(set(nodes) - set(self.policy.budgets)):
                self.policy.add_node(node, capacity_pages)

    def join(self, node: str, capacity_pages: int) -> None:
        with self._lock:
            self.policy.add_node(node, capacity_pages)

    def leave(self, node: str) -> None:
        with self._lock:
            self.policy.remove_node(node)

    def fetched(self, report: FetchReport) -> list[Replicate]:
        """Count the fetch, then start the copies the policy decides; returns them."""
        with self._lock:
            now = self.clock()
            for key in report.keys:
                self._tokens[key] = (report.tokens, report.namespace)
                self._tokens.move_to_end(key)
            while len(self._tokens) > KEPT:
                self._tokens.popitem(last=False)
            self.policy.fetched(now, report.keys, report.source, report.reader)
            # A Drop needs nothing done: the cold copy stays as ordinary cached pages.
            decisions = self.policy.decide(now, lambda keys: self._holders(keys, report))
            copies = [d for d in decisions if isinstance(d, Replicate)]
            starts = []
            for r in copies:
                known = self._tokens.get(r.keys[-1])
                if known is None:  # fell out of KEPT: give the budget back
                    self.policy.lost(r.target, r.keys)
                else:
                    starts.append((r, *known))
        for r, tokens, namespace in starts:  # outside the lock: `done` may run at once
            self.copy(
                r.target,
                r.source,
                list(tokens[: len(r.keys) * self.page_tokens]),
                namespace,
                functools.partial(self._copied, r),
            )
        return [r for r, _, _ in starts]

    def _holders(self, keys: tuple[bytes, ...], report: FetchReport) -> list[str]:
        """The index's holders, and the reader whose fetch the index may not have yet."""
        held = list(self.holders(keys))
        if len(keys) <= len(report.keys) and report.keys[len(keys) - 1] == keys[-1]:
            held.append(report.reader)
        return held

    def _copied(self, r: Replicate, outcome: str) -> None:
        if outcome != COMMITTED:
            with self._lock:
                self.failed += 1
                self.policy.lost(r.target, r.keys)
