"""What the scheduler side tells the worker side each step, and settings both read.

Jobs name staging slots and vLLM block ids only: the bytes move by the worker's
copies between its KV tensors and the shared staging pages.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.pools import PoolCapacity
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from kvfabric.actors.node.node_actor import NodeConfig


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
    idle: bool = False  # the step runs no forward: nothing for the loads to overlap
    # The step hands out a block an earlier prompt's save still reads: the save ends
    # before the forward (WorkerSide.before_forward).
    fence: bool = False


@dataclass
class FabricWorkerMeta(KVConnectorWorkerMetadata):
    """Save jobs workers have copied to staging (job -> how many workers: each
    tensor-parallel rank copies its own heads), and those that failed."""

    saved: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, FabricWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} with FabricWorkerMeta")
        # A job is saved once every worker has copied its part; one failure fails it.
        failed = self.failed | other.failed
        saved = dict(self.saved)
        for key, n in other.saved.items():
            saved[key] = saved.get(key, 0) + n
        return FabricWorkerMeta({k: n for k, n in saved.items() if k not in failed}, failed)


class ConnectorStep(str, Enum):
    """The connector's steps where a load, a save or an engine's start can fail (see
    StepHook)."""

    NODE_LOAD = "node_load"  # the scheduler side asks the node actor to stage a prefix
    WORKER_LOAD = "worker_load"  # the worker copies staged pages into vLLM's blocks
    WORKER_SAVE = "worker_save"  # the worker copies vLLM's blocks to staging
    NODE_SAVE = "node_save"  # the scheduler side asks the node actor to store them
    STAGING = "staging"  # a worker reserves its staging files (vLLM registers its KV caches)


class StepHook(Protocol):
    """Called as each step starts; raising (any exception) fails that load or save, as a
    real failure there would. Tests and chaos runs give one; production gives none."""

    def __call__(self, step: ConnectorStep) -> None: ...


_HOOK_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _at_least(low: int, default: int) -> Any:
    return field(default=default, metadata={"min": low})


@dataclass(frozen=True)
class FabricSettings:
    """`kv_connector_extra_config` of the FabricConnector."""

    ray_address: str = ""
    # The engine caches in the fabric of its KV identity, in Ray namespace
    # `<ray_namespace>.<layout fingerprint>` (actors/names.py), started by the first
    # engine of that identity with the node pools below.
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
    # The model's content digest as the deployer names it (a registry version it
    # guarantees names these weights): skips reading the files. "": read them once.
    model_digest: str = ""
    # The fabric this engine starts when none of its KV identity runs: each node's pools
    # (full attention; sliding window: 0 gives a quarter of the full pool's, at least 1),
    # its index shards, the CPUs each fabric actor takes, the membership watch period.
    device_pages: int = 64
    host_pages: int = _at_least(0, 4096)
    swa_device_pages: int = _at_least(0, 0)
    swa_host_pages: int = _at_least(0, 0)
    # Each node's disk tier (pages per pool; 0: none) in `disk_folder`, an absolute path on
    # every node (each fabric and node actor keeps its own folder below it); `disk_write`:
    # write_through (a restarted node actor finds every page it stored) or write_back;
    # `disk_sync`: none, pages or all (core/cache/disk_store.py); `disk_io`: auto (NIXL's
    # POSIX backend, plain pread/pwrite where NIXL lacks it), nixl or posix.
    disk_pages: int = _at_least(0, 0)
    swa_disk_pages: int = _at_least(0, 0)
    disk_folder: str = ""
    disk_write: str = "write_through"
    disk_sync: str = "none"
    disk_io: str = "auto"
    shards: int = 2
    node_cpus: float = 0.25
    watch_s: float = 2.0
    # Tests, chaos: "module:name" of the node actors' hooks (NodeConfig.hooks).
    node_hooks: str = ""

    def __post_init__(self) -> None:
        # Settings come from a deployment's config: a wrong type fails here, with its name.
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool":
                ok = isinstance(v, bool)
            elif f.type == "str":
                ok = isinstance(v, str) and len(v) <= 4096
            elif f.type == "int":
                ok = type(v) is int and f.metadata.get("min", 1) <= v <= 1 << 24
            else:  # seconds, CPUs
                ok = type(v) in (int, float) and 0 <= v <= 3600
            if not ok:
                raise ValueError(
                    f"FabricConnector setting {f.name} must be a {f.type} in range, got {v!r:.80}"
                )
        for name in ("step_hook", "node_hooks"):
            spec = getattr(self, name)
            if spec and not _HOOK_SPEC.fullmatch(spec):
                raise ValueError(
                    f"FabricConnector setting {name} must be 'module:name', got {spec!r:.80}"
                )
        self._check_disk()

    def _check_disk(self) -> None:
        for name, value, allowed in (
            ("disk_write", self.disk_write, _DISK_WRITES),
            ("disk_sync", self.disk_sync, _DISK_SYNCS),
            ("disk_io", self.disk_io, _DISK_IOS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"FabricConnector setting {name} must be one of {allowed}, got {value!r:.80}"
                )
        if self.swa_disk_pages and not self.disk_pages:
            raise ValueError("FabricConnector setting swa_disk_pages needs disk_pages")
        if self.disk_pages and not os.path.isabs(self.disk_folder):
            raise ValueError(
                "FabricConnector setting disk_folder must be an absolute path when "
                f"disk_pages is set, got {self.disk_folder!r:.80}"
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
        hook: StepHook = _named("step_hook", self.step_hook)(self.step_hook_arg)
        return hook

    def node_config(self, layout: KVLayout) -> NodeConfig:
        """The node actors' config of the fabric this engine starts for `layout`."""
        from kvfabric.actors.names import layout_namespace
        from kvfabric.actors.node.disk import DiskConfig, DiskIO
        from kvfabric.actors.node.node_actor import NodeConfig  # Ray's side: not in workers
        from kvfabric.core.cache.disk_store import Sync
        from kvfabric.core.cache.tiers import TierConfig, WritePolicy

        caps = {PoolName.FULL: PoolCapacity(self.device_pages, self.host_pages, self.disk_pages)}
        if PoolName.SWA in layout.pools:
            caps[PoolName.SWA] = PoolCapacity(
                self.swa_device_pages or max(1, self.device_pages // 4),
                self.swa_host_pages or self.host_pages // 4,
                self.swa_disk_pages or (self.disk_pages and max(1, self.disk_pages // 4)),
            )
        caps = {p: caps[p] for p in layout.pools}
        hooks = _named("node_hooks", self.node_hooks) if self.node_hooks else None
        disk = None
        if self.disk_pages:
            # One folder per fabric (KV identity): fabrics of two models on one host never
            # open each other's page files (a store drops pages of another identity).
            fabric = layout_namespace(layout.fingerprint, self.ray_namespace)
            disk = DiskConfig(
                os.path.join(self.disk_folder, fabric),
                sync=Sync(self.disk_sync),
                io=DiskIO(self.disk_io),
            )
        tier = TierConfig(disk=WritePolicy(self.disk_write))
        return NodeConfig(layout, caps, tier=tier, device="cpu", hooks=hooks, disk=disk)


_DISK_WRITES = ("write_through", "write_back")
_DISK_SYNCS = ("none", "pages", "all")
_DISK_IOS = ("auto", "nixl", "posix")


def _named(setting: str, spec: str) -> Any:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"FabricConnector setting {setting} {spec!r}: {e}") from None
