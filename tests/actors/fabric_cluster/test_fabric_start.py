"""Starting a fabric, each test in a Ray namespace of its own. A fabric left running by
another kvfabric version is refused, never joined: `ensure` (which every engine's
connector and the apps call) names both versions; the other version's actors are
stand-ins with its names. The same version's fabric starts once and is joined. A start
whose actors no node can place fails naming why, and leaves none behind."""

from __future__ import annotations

import uuid

import pytest
import ray
from kvfabric.actors.launch import (
    STARTER,
    FabricMismatch,
    FabricUnplaced,
    ensure,
    running,
    start,
    stop,
)
from kvfabric.actors.names import DIRECTORY
from kvfabric.actors.node.node_actor import NodeConfig
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.pools import PoolCapacity

from kvfabric import __version__
from tests.actors.fabric_cluster.cluster_kit import LAYOUT, T, eventually

SMALL = NodeConfig(
    LAYOUT, {PoolName.FULL: PoolCapacity(8, 0), PoolName.SWA: PoolCapacity(8, 0)}, device="cpu"
)


@ray.remote(num_cpus=0)
class _OtherVersion:
    """An actor of another kvfabric version, which reports it."""

    def __init__(self, version: str) -> None:
        self._version = version

    def version(self) -> str:
        return self._version

    def ensure(self, *args) -> bool:
        raise AssertionError("another version's starter was called")


@ray.remote(num_cpus=0)
class _Silent:
    """A starter of a version before the check: no version method."""

    def ensure(self, *args) -> bool:
        raise AssertionError("another version's starter was called")


def _kill_starter(ns: str) -> None:
    """The starter `ensure` left in `ns` (detached: it outlives the test); none is there
    when the test failed before `ensure` made one."""
    try:
        starter = ray.get_actor(STARTER, namespace=ns)
    except ValueError:
        return
    ray.kill(starter)


def _namespace() -> str:
    return f"kvf-version-{uuid.uuid4().hex[:8]}"


def _detached(cls, name: str, ns: str, *args):
    actor = cls.options(name=name, namespace=ns, lifetime="detached").remote(*args)
    ray.get(actor.__ray_ready__.remote(), timeout=T)
    return actor


@pytest.mark.parametrize("starter", ["0.0.1-test", None])
def test_a_starter_of_another_version_is_refused_naming_both(cluster, starter):
    ns = _namespace()
    other = (
        _detached(_OtherVersion, STARTER, ns, starter)
        if starter
        else _detached(_Silent, STARTER, ns)
    )
    try:
        said = starter or "a version that does not report it"
        with pytest.raises(
            FabricMismatch, match=f"runs kvfabric {said}, this process {__version__}"
        ):
            ensure(SMALL, shards=1, timeout_s=T, watch_s=0, namespace=ns)
        assert running(ns) is None  # nothing started beside it
    finally:
        ray.kill(other)


def test_a_directory_of_another_version_is_refused_by_the_starter(cluster):
    ns = _namespace()
    directory = _detached(_OtherVersion, DIRECTORY, ns, "0.0.1-test")
    try:
        with pytest.raises(FabricMismatch, match="directory .* runs kvfabric 0.0.1-test"):
            ensure(SMALL, shards=1, timeout_s=T, watch_s=0, namespace=ns)
    finally:
        ray.kill(directory)
        _kill_starter(ns)


def test_the_same_version_starts_once_and_is_joined(cluster):
    ns = _namespace()
    try:
        assert ensure(SMALL, shards=1, timeout_s=T, watch_s=0, namespace=ns) is True
        assert ensure(SMALL, shards=1, timeout_s=T, watch_s=0, namespace=ns) is False
        fabric = running(ns)
        assert fabric is not None
        assert ray.get(fabric.directory.version.remote(), timeout=T) == __version__
    finally:
        fabric = running(ns)
        if fabric is not None:
            stop(fabric)


def test_a_start_no_node_can_place_names_why_and_leaves_no_actor(cluster):
    """Ray waits for ever to place an actor no node has room for: the start gives up at
    its bound, says what the actors ask and what the cluster has, and kills them."""
    ns = _namespace()
    huge = dict(shards=1, cpus_per_actor=1000.0, timeout_s=3.0, watch_s=0, namespace=ns)
    try:
        with pytest.raises(FabricUnplaced, match=r"each asks 1000 CPU.* of \d+ CPU free"):
            start(SMALL, **huge)
        eventually(lambda: running(ns) is None, "the unplaced actors gone")
        with pytest.raises(FabricUnplaced, match="not started after 3 s"):
            ensure(SMALL, **huge)  # through the starter: the same error, unwrapped
        eventually(lambda: running(ns) is None, "the unplaced actors gone")
    finally:
        _kill_starter(ns)
