"""ShardSink: an engine's pages go to the fabric's index shards as a publisher of its own.

The same path as a node actor's (actors/node/index_link.py: batches per shard without
waiting, snapshots to shards that fell behind or restarted). The directory does not
know engines, so the sink admits the engine's epoch to every shard itself before its
first batch (older lives of the name are refused from then on), and reads the route
table again every `refresh_s` (a rebalance sends every shard a snapshot)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from kvfabric.actors.directory import CALL_TIMEOUT_S, NAMESPACE, shard_name
from kvfabric.actors.epochs import GcsEpochs
from kvfabric.actors.node.index_link import IndexLink
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.index.routes import RouteTable
from kvfabric.deploy.serving.engine_identity import engine_index_node

from .engine_pages import EnginePages
from .event_feed import EngineEventFeed


@dataclass(frozen=True)
class FeedSpec:
    """Where an engine's KV events are read, and what the index names the engine."""

    slot: str
    group_pools: tuple[PoolName, ...]
    endpoint: str
    replay_endpoint: str | None = None
    # A LoRA adapter's identity by name (namespaces.RequestNamespaces.adapter_named).
    adapters: Callable[[str], str | None] | None = None

    @classmethod
    def of(
        cls,
        kv_events_config: Any,
        slot: str,
        group_pools: tuple[PoolName, ...],
        adapters: Callable[[str], str | None] | None = None,
    ) -> "FeedSpec | None":
        """From vLLM's KVEventsConfig: None unless a slot is named and the engine
        publishes its events over ZMQ."""
        cfg = kv_events_config
        if not slot or cfg is None or not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
            return None
        replay = cfg.replay_endpoint
        return cls(
            slot,
            group_pools,
            _subscriber(cfg.endpoint),
            _subscriber(replay) if replay else None,
            adapters,
        )

    def start(
        self, directory, node_actor: str, layout: KVLayout, namespace: str = NAMESPACE
    ) -> EngineEventFeed:
        return start_engine_feed(
            directory,
            node_actor,
            self.slot,
            layout,
            self.group_pools,
            self.endpoint,
            self.replay_endpoint,
            namespace=namespace,
            adapters=self.adapters,
        )


def _subscriber(endpoint: str) -> str:
    """The address to connect to where the publisher binds (it binds "tcp://*:port")."""
    return endpoint.replace("://*:", "://127.0.0.1:", 1)


class ShardSink:
    def __init__(
        self,
        directory,
        timeout_s: float = CALL_TIMEOUT_S,
        refresh_s: float = 2.0,
        namespace: str = NAMESPACE,
    ) -> None:
        self.directory, self.timeout_s, self.refresh_s = directory, timeout_s, refresh_s
        self.namespace = namespace  # the fabric's
        self.link: IndexLink[EnginePages] | None = None
        self._refreshed = 0.0

    def attach(self, pages: EnginePages) -> None:
        routes = self._routes()
        shards = [
            ray.get_actor(shard_name(i), namespace=self.namespace) for i in range(routes.shards)
        ]
        ray.get([s.admit.remote(pages.node, pages.epoch) for s in shards], timeout=self.timeout_s)
        self.link = IndexLink(pages)
        self.link.attach(shards, routes)
        self._refreshed = time.monotonic()

    def publish(self, every_shard: bool = False) -> int:
        """Send what changed (with `every_shard`, a heartbeat to every shard); batches sent."""
        if self.link is None or self.link.routes is None:
            raise RuntimeError("attach first")
        if time.monotonic() - self._refreshed >= self.refresh_s:
            self._refreshed = time.monotonic()
            routes = self._routes()
            if routes.version != self.link.routes.version:
                self.link.reroute(routes)
        return self.link.publish(every_shard)

    def _routes(self) -> RouteTable:
        return RouteTable.decode(
            ray.get(self.directory.get_routes.remote(), timeout=self.timeout_s)
        )


def start_engine_feed(
    directory,
    node_actor: str,
    slot: str,
    layout: KVLayout,
    group_pools: tuple[PoolName, ...],
    endpoint: str,
    replay_endpoint: str | None = None,
    namespace: str = NAMESPACE,
    adapters: Callable[[str], str | None] | None = None,
    **feed_args,
) -> EngineEventFeed:
    """Feed the index of the fabric in `namespace` from one engine's KV events, as
    `<node_actor>/engine/<slot>` under a new epoch (serving/engine_identity.py), from a process
    connected to the Ray cluster."""
    identity = engine_index_node(node_actor, slot)
    pages = EnginePages(identity, GcsEpochs().claim(), layout, group_pools, adapters=adapters)
    sink = ShardSink(directory, namespace=namespace)
    sink.attach(pages)
    feed = EngineEventFeed(pages, sink, endpoint, replay_endpoint, **feed_args)
    feed.start()
    return feed
