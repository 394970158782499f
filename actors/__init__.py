"""actors: Ray actors over the fabric core (per-node cache actors, index shards, client)."""
from .node_actor import NodeCacheActor, NodeConfig

__all__ = ["NodeCacheActor", "NodeConfig"]
