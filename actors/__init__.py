"""actors: the fabric on Ray (node cache actors, index shards, the directory). These
names are its public API (kvfabric re-exports them), each imported on first use;
everything else is imported from the module that defines it."""

from __future__ import annotations

from typing import Any

import kvfabric._lazy as _lazy

_WHERE = {
    "Fabric": ".launch",
    "FabricClient": ".client",
    "NodeCacheActor": ".node.node_actor",
    "NodeConfig": ".node.node_actor",
    "join": ".directory",
    "start": ".launch",
    "stop": ".launch",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return _lazy.load(globals(), _WHERE, name)


def __dir__() -> list[str]:
    return _lazy.names(globals(), _WHERE)
