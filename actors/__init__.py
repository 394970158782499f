"""actors: Ray actors over the fabric core (per-node cache actors, index shards, client)."""

from .directory import FabricDirectory, Membership, join
from .index_shard import IndexShardActor
from .launch import Fabric, FabricClient, start, stop
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
