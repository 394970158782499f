"""What the scheduler side tells the worker side each step, and settings both read.

Jobs name staging slots and vLLM block ids only: the bytes move by the worker's
copies between its KV tensors and the shared staging pages.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

from kvfabric.fabric import PoolName


@dataclass
class PoolMove:
    """Copies of one pool's pages: staging slot i <-> block blocks[g][i] of group g,
    for each of the pool's groups (block -1: nothing to copy for that group)."""
    pool: PoolName
    slots: list[int]
    blocks: dict[int, list[int]]


@dataclass
class CopyJob:
    req_id: str
    moves: list[PoolMove]
    # Set when the scheduler side already knows the load cannot be complete: the
    # worker reports it failed, so vLLM recomputes.
    doomed: str = ""
    # Saves: the job's name in the worker's report, and whether the request has
    # finished (vLLM keeps its blocks until the worker reports it sent).
    key: str = ""
    ends_request: bool = False


@dataclass
class FabricMeta(KVConnectorMetadata):
    loads: list[CopyJob] = field(default_factory=list)     # staging -> vLLM blocks
    saves: list[CopyJob] = field(default_factory=list)     # vLLM blocks -> staging


@dataclass
class FabricWorkerMeta(KVConnectorWorkerMetadata):
    """Save jobs the worker has copied to staging, and those that failed."""
    saved: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, FabricWorkerMeta)
        # With several workers, a job is saved only if every worker saved its part.
        failed = self.failed | other.failed
        return FabricWorkerMeta((self.saved | other.saved) - failed, failed)


@dataclass(frozen=True)
class FabricSettings:
    """`kv_connector_extra_config` of the FabricConnector."""
    ray_address: str = ""
    ray_namespace: str = "kvfabric"
    node_actor: str = ""           # the NodeCacheActor of this engine's node
    staging_pages: int = 512       # per pool
    timeout_s: float = 5.0         # every call to the node actor, and an index lookup
    remote: bool = True            # fetch longer prefixes from other nodes (needs the fabric's index)
    fetch_timeout_s: float = 10.0  # a fetch from another node, before the request computes instead
    lookup_wait_s: float = 0.05    # admission waits this long for the index (later: at a next step)
    fault_file: str = ""           # tests: a JSON file of injected faults, read at each step
    # Feed the fabric's index from this engine's KV events (its kv_events_config) as
    # `<node_actor>/engine/<engine_slot>`; empty: no feed.
    engine_slot: str = ""

    def __post_init__(self) -> None:
        # Settings come from a deployment's config: a wrong type fails here, with its name.
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool":
                ok = isinstance(v, bool)
            elif f.type == "str":
                ok = isinstance(v, str) and len(v) <= 4096
            elif f.type == "int":
                ok = type(v) is int and 1 <= v <= 1 << 20
            else:        # seconds
                ok = type(v) in (int, float) and 0 <= v <= 3600
            if not ok:
                raise ValueError(f"FabricConnector setting {f.name} must be a {f.type} in range, got {v!r:.80}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "FabricSettings":
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown FabricConnector settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**extra)


class InjectedFault(Exception):
    """Raised where a test armed a fault of no built-in kind."""


_EXCEPTIONS = {"ValueError": ValueError, "KeyError": KeyError, "RuntimeError": RuntimeError,
               "MemoryError": MemoryError, "OSError": OSError, "TimeoutError": TimeoutError,
               "IndexError": IndexError, "InjectedFault": InjectedFault}


def maybe_fail(settings: FabricSettings, point: str) -> None:
    """Raise, once, the exception a test armed at `point` in the fault file, if any.
    The file maps a point ("node_load", "worker_load", "worker_save", "node_save") to
    an exception class name; a fault that fired is taken out of the file, so the test
    sees that it did."""
    path = settings.fault_file
    if not path or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            armed = json.load(f)
    except (OSError, ValueError):
        return     # being rewritten by the test: read it at the next step
    name = armed.pop(point, None)
    if not name:
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(armed, f)
    os.replace(tmp, path)
    raise _EXCEPTIONS.get(name, InjectedFault)(f"injected at {point}")
