"""core: the single-node cache, the prefix index and the prefix exchange, no Ray. These
names are its public API (kvfabric re-exports them), each imported on first use;
everything else is imported from the module that defines it."""

from __future__ import annotations

from typing import Any

import kvfabric._lazy as _lazy

_WHERE = {
    "NodeCache": ".cache.node_cache",
    "KVLayout": ".cache.layout",
    "LayerKind": ".cache.layout",
    "PoolName": ".cache.layout",
    "Tier": ".cache.layout",
    "PoolCapacity": ".cache.pools",
    "TierConfig": ".cache.tiers",
    "WritePolicy": ".cache.tiers",
    "CachedKV": ".cache.cached_kv",
    "Match": ".cache.match",
    "InvariantError": ".cache.check",
    "PrefixIndex": ".index.prefix_index",
    "MatchRule": ".index.match_rule",
    "ShardedIndex": ".index.sharded_index",
    "RouteTable": ".index.routes",
    "EventPublisher": ".index.publisher",
    "EventBatch": ".index.events",
    "FetchOutcome": ".exchange.destination",
    "import_prefix": ".exchange.destination",
    "ExportGrant": ".exchange.grant",
    "export_prefix": ".exchange.source",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return _lazy.load(globals(), _WHERE, name)


def __dir__() -> list[str]:
    return _lazy.names(globals(), _WHERE)
