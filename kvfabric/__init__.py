"""ray-kv-fabric: a cluster-wide, SWA-aware KV-cache fabric for LLM serving on Ray.

The repository's layers install as subpackages of this one: `kvfabric.core` (the
single-node core, no Ray), `kvfabric.transport` (page transfers), `kvfabric.actors`
(the Ray actors) and `kvfabric.deploy` (Serve apps, engines, the CLI). The names below
are the public API; each is imported on first use, so `import kvfabric` costs nothing
and importing the core never imports Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kvfabric._lazy as _lazy

from ._version import __version__

# In a source tree on sys.path without an install (a Ray runtime_env working_dir, or
# PYTHONPATH=checkout), the layers are this folder's siblings: look for subpackages there
# too. An installed wheel has them inside this folder; an editable install maps them.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "core").is_dir() and (_HERE.parent / "core" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))

_PUBLIC = {
    "kvfabric.core": (
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
    ),
    "kvfabric.transport": ("LocalTransport", "NixlTransport", "Transport", "TransportReader"),
    "kvfabric.actors": (
        "Fabric",
        "FabricClient",
        "NodeCacheActor",
        "NodeConfig",
        "start",
        "stop",
        "join",
    ),
    "kvfabric.deploy.vllm.serve.serve_llm": ("with_fabric", "FabricLLMServer", "FabricError"),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = ["__version__", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    return _lazy.load(globals(), _WHERE, name)


def __dir__() -> list[str]:
    return _lazy.names(globals(), _WHERE)
