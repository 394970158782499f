"""Page transfer layer: NIXL reads between nodes, torch copies within one. These names
are its public API (kvfabric re-exports them); everything else is imported from the
module that defines it.

Importing this package does not import NIXL; `NixlTransport` is loaded on first use so
that code paths (and hosts) without NIXL can still use the rest.
"""

from __future__ import annotations

from typing import Any

from .base import Transport
from .fetch import TransportReader
from .local import LocalTransport

__all__ = ["LocalTransport", "NixlTransport", "Transport", "TransportReader"]


def __getattr__(name: str) -> Any:
    if name == "NixlTransport":
        from .nixl_transport import NixlTransport

        return NixlTransport
    raise AttributeError(f"module 'kvfabric.transport' has no attribute {name!r}")
