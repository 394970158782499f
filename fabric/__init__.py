"""fabric: the single-node core. No Ray here."""

from .cache.allocator import AllocatorError, OutOfPages, PageAllocator
from .cache.cached_kv import CachedKV
from .cache.check import InvariantError, PageAudit
from .cache.keys import KeyerCache, PageKeyer, encode_tokens, namespace_key
from .cache.layout import KVLayout, LayerKind, LayoutError, PoolName, Tier
from .cache.leases import Lease, LeaseTable
from .cache.locks import PrefixLock
from .cache.match import Match
from .cache.node_cache import CacheStats, NodeCache
from .cache.page_bytes import PageCopier, TorchCopier, page_checksums
from .cache.policies import AttentionPolicy, FullAttentionPolicy, SlidingWindowPolicy
from .cache.pools import PagePool, PoolCapacity, PoolEntry, PoolRegistry
from .cache.put_rows import PagedKV
from .cache.radix import RadixTree, TreeNode
from .cache.tiers import TierConfig, TierController, WritePolicy
from .cache.txn import ReservationFailed, ReservationHook, Transaction, TransactionClosed
from .exchange.destination import FetchOutcome, PageReader, ReadFailed, import_prefix
from .exchange.grant import ExportGrant, GrantError, PoolPages
from .exchange.source import export_prefix
from .index.answers import NodeMatch
from .index.balance import LoadTracker, Split
from .index.events import EventBatch, EventError, PageMask, PageState, Snapshot
from .index.events import decode as decode_events
from .index.match_rule import MatchRule
from .index.prefix_index import ApplyResult, PrefixIndex
from .index.publisher import EventPublisher, ShardPublisher
from .index.routes import Route, RouteError, RouteTable
from .index.sharded_index import ShardedIndex

__all__ = [
    "AllocatorError",
    "OutOfPages",
    "PageAllocator",
    "InvariantError",
    "PageAudit",
    "ExportGrant",
    "FetchOutcome",
    "GrantError",
    "PageReader",
    "PoolPages",
    "ReadFailed",
    "export_prefix",
    "import_prefix",
    "KeyerCache",
    "PageKeyer",
    "encode_tokens",
    "namespace_key",
    "KVLayout",
    "LayerKind",
    "LayoutError",
    "PoolName",
    "Tier",
    "Lease",
    "LeaseTable",
    "CachedKV",
    "PagedKV",
    "CacheStats",
    "Match",
    "NodeCache",
    "PrefixLock",
    "PageCopier",
    "TorchCopier",
    "page_checksums",
    "AttentionPolicy",
    "FullAttentionPolicy",
    "SlidingWindowPolicy",
    "PagePool",
    "PoolCapacity",
    "PoolEntry",
    "PoolRegistry",
    "TreeNode",
    "RadixTree",
    "TierConfig",
    "TierController",
    "WritePolicy",
    "ReservationFailed",
    "ReservationHook",
    "Transaction",
    "TransactionClosed",
    "EventBatch",
    "EventError",
    "PageMask",
    "PageState",
    "Snapshot",
    "decode_events",
    "EventPublisher",
    "ShardPublisher",
    "ApplyResult",
    "NodeMatch",
    "PrefixIndex",
    "MatchRule",
    "Route",
    "RouteError",
    "RouteTable",
    "ShardedIndex",
    "Split",
    "LoadTracker",
]
