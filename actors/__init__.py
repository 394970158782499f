"""actors: the fabric on Ray (node cache actors, index shards, the directory). These
names are its public API (kvfabric re-exports them); everything else is imported from
the module that defines it."""

from .client import FabricClient
from .directory import join
from .launch import Fabric, start, stop
from .node.node_actor import NodeCacheActor, NodeConfig

__all__ = ["Fabric", "FabricClient", "NodeCacheActor", "NodeConfig", "join", "start", "stop"]
