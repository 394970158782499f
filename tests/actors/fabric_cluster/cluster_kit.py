"""What the fabric-on-a-cluster tests share: the layout and node config they start the
fabric with (conftest.py), and waits on it. No test here."""

from __future__ import annotations

import tempfile
import time
from functools import partial

import ray
from kvfabric.actors.node.disk import DiskConfig
from kvfabric.actors.node.node_actor import NodeConfig
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.core.index.routes import RouteTable

from tests.waiting import eventually as wait_for

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=2, head_dim=16, page_size=16, window=32)
# The nodes' disk tiers, one folder each under this one (conftest.py removes it).
DISK_FOLDER = tempfile.mkdtemp(prefix="kvf-fabric-disk-")
CONFIG = NodeConfig(
    LAYOUT,
    {PoolName.FULL: PoolCapacity(64, 64, 256), PoolName.SWA: PoolCapacity(32, 32, 128)},
    TierConfig(disk=WritePolicy.WRITE_THROUGH),  # a restarted node finds what it held
    device="cpu",
    disk=DiskConfig(DISK_FOLDER),
)
NS = "tenant"
T = 120.0


eventually = partial(wait_for, deadline_s=T, every_s=0.2)


def flush(f):
    ray.get([n.flush.remote() for n in f.nodes.values()], timeout=T)


def routes_version(f) -> int:
    return RouteTable.decode(ray.get(f.directory.get_routes.remote(), timeout=T)).version


def until_available(actor, deadline_s: float = T) -> None:
    """Wait out an actor's restart (calls fail with ActorUnavailableError meanwhile)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            ray.get(actor.noop.remote(), timeout=T)
            return
        except ray.exceptions.RayActorError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def heartbeat_of(actor):
    """The actor's heartbeat answer, or None while it is dead or restarting."""
    try:
        return ray.get(actor.heartbeat.remote(), timeout=T)
    except ray.exceptions.RayActorError:
        return None
