"""actors: Ray actors over the fabric core (per-node cache actors, index shards, client)."""

from .client import FabricClient
from .directory import FabricDirectory, Membership, join
from .index_shard import IndexShardActor
from .launch import Fabric, start, stop
from .node.node_actor import NodeCacheActor, NodeConfig

__all__ = [
    "Fabric",
    "FabricClient",
    "FabricDirectory",
    "IndexShardActor",
    "Membership",
    "NodeCacheActor",
    "NodeConfig",
    "join",
    "start",
    "stop",
]
