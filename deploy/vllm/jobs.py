"""What the scheduler side tells the worker side each step, and settings both read.

Jobs name staging slots and vLLM block ids only: the bytes move by the worker's
copies between its KV tensors and the shared staging pages.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from kvfabric.fabric import PoolName
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


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
    loads: list[CopyJob] = field(default_factory=list)  # staging -> vLLM blocks
    saves: list[CopyJob] = field(default_factory=list)  # vLLM blocks -> staging


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


class ConnectorStep(str, Enum):
    """The connector's steps where a load or a save can fail (see StepHook)."""

    NODE_LOAD = "node_load"  # the scheduler side asks the node actor to stage a prefix
    WORKER_LOAD = "worker_load"  # the worker copies staged pages into vLLM's blocks
    WORKER_SAVE = "worker_save"  # the worker copies vLLM's blocks to staging
    NODE_SAVE = "node_save"  # the scheduler side asks the node actor to store them


class StepHook(Protocol):
    """Called as each step starts; raising (any exception) fails that load or save, as a
    real failure there would. Tests and chaos runs give one; production gives none."""

    def __call__(self, step: ConnectorStep) -> None: ...


_HOOK_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class FabricSettings:
    """`kv_connector_extra_config` of the FabricConnector."""

    ray_address: str = ""
    ray_namespace: str = "kvfabric"
    node_actor: str = ""  # the NodeCacheActor of this engine's node
    staging_pages: int = 512  # per pool
    timeout_s: float = 5.0  # every call to the node actor, and an index lookup
    remote: bool = True  # fetch longer prefixes from other nodes (needs the fabric's index)
    fetch_timeout_s: float = 10.0  # a fetch from another node, before the request computes instead
    lookup_wait_s: float = 0.05  # admission waits this long for the index (later: at a next step)
    # Tests, chaos: "module:factory" of a StepHook, built with step_hook_arg in each process.
    step_hook: str = ""
    step_hook_arg: str = ""
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
            else:  # seconds
                ok = type(v) in (int, float) and 0 <= v <= 3600
            if not ok:
                raise ValueError(
                    f"FabricConnector setting {f.name} must be a {f.type} in range, got {v!r:.80}"
                )
        if self.step_hook and not _HOOK_SPEC.fullmatch(self.step_hook):
            raise ValueError(
                "FabricConnector setting step_hook must be 'module:name', got "
                f"{self.step_hook!r:.80}"
            )

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "FabricSettings":
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(
                f"unknown FabricConnector settings {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**extra)

    def make_step_hook(self) -> StepHook | None:
        """The hook `step_hook` names, built with `step_hook_arg` (None when unset)."""
        if not self.step_hook:
            return None
        module, _, name = self.step_hook.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"FabricConnector setting step_hook {self.step_hook!r}: {e}") from None
        hook: StepHook = factory(self.step_hook_arg)
        return hook
