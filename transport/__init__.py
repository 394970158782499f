"""Page transfer layer: NIXL reads between nodes, torch copies within one.

Importing this package does not import NIXL; `NixlTransport` is loaded on first use so
that code paths (and hosts) without NIXL can still use the rest.
"""

from __future__ import annotations

from typing import Any

from .base import (
    BackendError,
    MemKind,
    PeerDisconnected,
    PeerMetadata,
    PeerNotConnected,
    PoolLayout,
    ReadSpec,
    TransferAborted,
    TransferError,
    TransferHandle,
    TransferState,
    TransferTimeout,
    Transport,
    coalesce_order,
)
from .fetch import TransportReader, pool_name, register_device_pools
from .local import LocalTransport, copy_pages

__all__ = [
    "TransportReader",
    "pool_name",
    "register_device_pools",
    "BackendError",
    "LocalTransport",
    "MemKind",
    "NixlTransport",
    "PeerDisconnected",
    "PeerMetadata",
    "PeerNotConnected",
    "PoolLayout",
    "ReadSpec",
    "Transport",
    "TransferAborted",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTimeout",
    "coalesce_order",
    "copy_pages",
    "map_nixl_error",
]


def __getattr__(name: str) -> Any:
    if name in ("NixlTransport", "map_nixl_error"):
        from . import nixl_transport

        return getattr(nixl_transport, name)
    raise AttributeError(f"module 'transport' has no attribute {name!r}")
