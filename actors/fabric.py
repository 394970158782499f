"""The old import path of the fabric's launch and client, kept for deploy/ and users'
code: they live in actors/launch.py and actors/client.py (the name `fabric` alone is the
core, fabric/)."""

from .client import FabricClient, PendingLookup
from .launch import Fabric, FabricMismatch, ensure, running, start, stop

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
