"""FabricClient: what a job, router or engine uses of a running fabric, in plain Python.

Lookups route locally and go to one index shard; a fetch pulls the best remote prefix
into a node; every failure degrades to a shorter or empty prefix, never an error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Generator, Sequence, cast

import ray
from kvfabric.core.cache.keys import KeyerCache
from kvfabric.core.cache.layout import Tier
from kvfabric.core.index.answers import NodeMatch, WireMatch
from kvfabric.core.index.routes import RouteTable
from ray.exceptions import GetTimeoutError, RayError

from .membership import Membership
from .names import CALL_TIMEOUT_S, DIRECTORY, NAMESPACE, shard_name
from .node.node_actor import NodeConfig


class FabricClient:
    def __init__(self, directory, timeout_s: float = 2.0, namespace: str = NAMESPACE) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.namespace = namespace
        config: NodeConfig = ray.get(directory.get_config.remote(), timeout=CALL_TIMEOUT_S)
        self.layout = config.layout
        self.routes = RouteTable.decode(
            ray.get(directory.get_routes.remote(), timeout=CALL_TIMEOUT_S)
        )
        self._shards: dict[int, object] = {}
        # Bounded: a router or model server sees every tenant over its life.
        self._keyers = KeyerCache(self.layout.fingerprint, self.layout.page_size)

    @classmethod
    def connect(cls, timeout_s: float = 2.0, namespace: str = NAMESPACE) -> "FabricClient":
        """The client of the fabric in Ray namespace `namespace`."""
        return cls(ray.get_actor(DIRECTORY, namespace=namespace), timeout_s, namespace)

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self._keyers.get(namespace).keys(tokens)

    def lookup(self, tokens: Sequence[int], namespace: str) -> list[NodeMatch]:
        """Each node's usable match for `tokens`, best first; [] if the index cannot answer."""
        steps = self._lookup_steps(tokens, namespace)
        try:
            call = next(steps)
            while True:
                call = steps.send(ray.get(call.ref, timeout=call.timeout_s))
        except StopIteration as done:
            return done.value
        except (RayError, GetTimeoutError, ValueError):
            return []  # a miss costs recomputation, never an error

    async def lookup_async(self, tokens: Sequence[int], namespace: str) -> list[NodeMatch]:
        """`lookup` for an event loop (a request router): awaits instead of blocking."""
        steps = self._lookup_steps(tokens, namespace)
        try:
            call = next(steps)
            while True:
                call = steps.send(await asyncio.wait_for(call.ref, call.timeout_s))
        except StopIteration as done:
            return done.value
        except (RayError, asyncio.TimeoutError, ValueError):
            return []

    def start_lookup(self, tokens: Sequence[int], namespace: str) -> "PendingLookup":
        """`lookup` for a loop that must not wait (an engine's scheduler): poll the
        answer at each step."""
        return PendingLookup(self._lookup_steps(tokens, namespace))

    def _lookup_steps(
        self, tokens: Sequence[int], namespace: str
    ) -> Generator[_Call, Any, list[NodeMatch]]:
        """The lookup, as the calls it waits on (each answer is sent back in): `lookup`
        and `lookup_async` only differ in how they wait. A stale route table is
        refreshed once; any failure (the caller catches it) is a miss."""
        keys = self.keys(tokens, namespace)
        if not keys:
            return []
        for _ in range(2):
            shard, depth = self.routes.locate(keys)
            found = yield _Call(
                self._shard(shard).lookup.remote(b"".join(keys), self.routes.version, depth),
                self.timeout_s,
            )
            if found is not None:
                return _matches(found)
            self.routes = RouteTable.decode(
                (yield _Call(self.directory.get_routes.remote(), CALL_TIMEOUT_S))
            )
        return []

    def fetch(
        self, tokens: Sequence[int], namespace: str, into: str, source: NodeMatch | None = None
    ) -> int:
        """Pull the best remote prefix of `tokens` into node `into` (from `source`, when
        the caller has just looked it up); returns the pages usable there afterwards
        (0 when anything fails)."""
        try:
            target = ray.get_actor(into, namespace=self.namespace)
            best = source
            if best is None:
                local = cast(
                    int, ray.get(target.match.remote(tokens, namespace), timeout=self.timeout_s)
                )
                best = next((m for m in self.lookup(tokens, namespace) if m.node != into), None)
                if best is None or best.pages <= local:
                    return local
            holder = ray.get_actor(best.node, namespace=self.namespace)
            ray.get(
                target.fetch.remote(holder, best.node, tokens, namespace),
                timeout=self.timeout_s * 4,
            )
            return ray.get(target.match.remote(tokens, namespace), timeout=self.timeout_s)
        except (RayError, GetTimeoutError, ValueError):
            return 0

    def purge_dead_nodes(self) -> list[str]:
        """Drop nodes whose actor Ray reports dead, now (the directory's watcher also
        does this every few seconds)."""
        done: Membership = ray.get(
            self.directory.reconcile.remote(add=False), timeout=CALL_TIMEOUT_S * 3
        )
        return done.dropped

    def _shard(self, i: int):
        handle = self._shards.get(i)
        if handle is None:
            handle = self._shards[i] = ray.get_actor(shard_name(i), namespace=self.namespace)
        return handle


class PendingLookup:
    """A lookup in flight. `poll` never waits: None until the index has answered,
    then the matches. A failed call raises (the caller takes it as a miss); the
    caller bounds the whole by its own deadline."""

    def __init__(self, steps: Generator[_Call, Any, list[NodeMatch]]) -> None:
        self._steps = steps
        self._found: list[NodeMatch] | None = None
        self._call: _Call | None = None
        try:
            self._call = next(steps)
        except StopIteration as done:
            self._found = done.value

    @property
    def pending(self) -> "ray.ObjectRef | None":
        """The call it waits on now (None once answered)."""
        return None if self._found is not None or self._call is None else self._call.ref

    def poll(self) -> list[NodeMatch] | None:
        while self._found is None:
            call = self._call
            assert call is not None, "a lookup not answered waits on a call"
            ready, _ = ray.wait([call.ref], timeout=0)
            if not ready:
                return None
            try:
                self._call = self._steps.send(ray.get(call.ref, timeout=0))
            except StopIteration as done:
                self._found = done.value
        return self._found


@dataclass(frozen=True)
class _Call:
    ref: "ray.ObjectRef"
    timeout_s: float


def _matches(found: list[WireMatch]) -> list[NodeMatch]:
    return [NodeMatch(node, pages, Tier(tier)) for node, pages, tier in found]
