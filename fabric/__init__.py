"""fabric: the single-node core. No Ray here."""
from .allocator import AllocatorError, OutOfPages, PageAllocator
from .check import InvariantError, PageAudit
from .export import export_prefix
from .fetch import FetchOutcome, PageReader, ReadFailed, import_prefix
from .grant import ExportGrant, GrantError, PoolPages
from .events import EventBatch, EventError, PageMask, PageState, Snapshot, decode as decode_events
from .faults import AllocationFaults
from .index import ApplyResult, NodeMatch, PrefixIndex
from .keys import KeyerCache, PageKeyer, encode_tokens, namespace_key
from .layout import KVLayout, LayerKind, LayoutError, PoolName, Tier
from .leases import Lease, LeaseTable
from .node_cache import CachedKV, CacheStats, Match, NodeCache, PrefixLock
from .pages import PageCopier, TorchCopier, page_checksums
from .publisher import EventPublisher
from .policies import AttentionPolicy, FullAttentionPolicy, SlidingWindowPolicy
from .pools import PagePool, PoolCapacity, PoolEntry, PoolRegistry
from .radix import TreeNode, RadixTree
from .routes import Route, RouteError, RouteTable
from .balance import LoadTracker, Split
from .sharded_index import ShardedIndex
from .tiers import TierConfig, TierController, WritePolicy
from .txn import ReservationFailed, Transaction, TransactionClosed

__all__ = [
    "AllocatorError", "OutOfPages", "PageAllocator", "InvariantError", "PageAudit", "ExportGrant",
    "FetchOutcome", "GrantError", "PageReader", "PoolPages", "ReadFailed", "export_prefix",
    "import_prefix", "AllocationFaults", "KeyerCache", "PageKeyer", "encode_tokens",
    "namespace_key", "KVLayout", "LayerKind", "LayoutError", "PoolName", "Tier", "Lease",
    "LeaseTable", "CachedKV", "CacheStats", "Match", "NodeCache", "PrefixLock", "PageCopier",
    "TorchCopier", "page_checksums", "AttentionPolicy", "FullAttentionPolicy",
    "SlidingWindowPolicy", "PagePool", "PoolCapacity", "PoolEntry", "PoolRegistry", "TreeNode",
    "RadixTree", "TierConfig", "TierController", "WritePolicy", "ReservationFailed",
    "Transaction", "TransactionClosed", "EventBatch", "EventError", "PageMask", "PageState",
    "Snapshot", "decode_events", "EventPublisher", "ApplyResult", "NodeMatch", "PrefixIndex",
    "Route", "RouteError", "RouteTable", "ShardedIndex", "Split", "LoadTracker",
]
