"""actors: Ray actors over the fabric core (per-node cache actors, index shards, client)."""
from .fabric import Fabric, FabricClient, FabricDirectory, join, start, stop
from .index_shard import IndexShardActor
from .node_actor import NodeCacheActor, NodeConfig

__all__ = ["Fabric", "FabricClient", "FabricDirectory", "IndexShardActor", "NodeCacheActor", "NodeConfig",
           "join", "start", "stop"]
