"""fabric: the single-node core, no Ray. These names are its public API (kvfabric
re-exports them); everything else is imported from the module that defines it."""

from .cache.cached_kv import CachedKV
from .cache.check import InvariantError
from .cache.layout import KVLayout, LayerKind, PoolName, Tier
from .cache.match import Match
from .cache.node_cache import NodeCache
from .cache.pools import PoolCapacity
from .cache.tiers import TierConfig, WritePolicy
from .exchange.destination import FetchOutcome, import_prefix
from .exchange.grant import ExportGrant
from .exchange.source import export_prefix
from .index.events import EventBatch
from .index.match_rule import MatchRule
from .index.prefix_index import PrefixIndex
from .index.publisher import EventPublisher
from .index.routes import RouteTable
from .index.sharded_index import ShardedIndex

__all__ = [
    "NodeCache",
    "KVLayout",
    "LayerKind",
    "PoolName",
    "Tier",
    "PoolCapacity",
    "TierConfig",
    "WritePolicy",
    "CachedKV",
    "Match",
    "PrefixIndex",
    "MatchRule",
    "ShardedIndex",
    "RouteTable",
    "EventPublisher",
    "EventBatch",
    "FetchOutcome",
    "ExportGrant",
    "export_prefix",
    "import_prefix",
    "InvariantError",
]
