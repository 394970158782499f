"""The old import path of the fabric's launch and client, kept for deploy/ and users'
code: they live in actors/launch.py (the name `fabric` alone is the core, fabric/)."""

from .launch import (
    Fabric,
    FabricClient,
    FabricMismatch,
    PendingLookup,
    ensure,
    running,
    start,
    stop,
)

__all__ = [
    "Fabric",
    "FabricClient",
    "FabricMismatch",
    "PendingLookup",
    "ensure",
    "running",
    "start",
    "stop",
]
