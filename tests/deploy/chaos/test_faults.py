"""The fault injectors on their own, without Ray: each acts only once armed, counts what
it did, and calming disarms it. The node actor only forwards to NodeChaos."""

from __future__ import annotations

import errno
import json
import threading
from types import SimpleNamespace

import pytest
from kvfabric.actors.node.node_actor import NodeConfig
from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import WritePolicy
from kvfabric.core.cache.txn import ReservationFailed
from kvfabric.deploy.chaos.faults import (
    AllocationFaults,
    ChaosAction,
    DiskFault,
    EventFault,
    Fault,
    FaultKind,
    NodeChaos,
)
from kvfabric.deploy.chaos.faults import disk as disk_faults
from kvfabric.transport.local import LocalTransport

from tests.core.test_disk_tier import CAPS as DISK_CAPS
from tests.core.test_disk_tier import LAYOUT as DISK_LAYOUT
from tests.core.test_disk_tier import open_cache, prompts, served_right
from tests.core.test_node_cache import MIXED, NS, make, seq
from tests.kvgen import prefix_kv

CAPS = {PoolName.FULL: PoolCapacity(16, 32), PoolName.SWA: PoolCapacity(8, 16)}  # make()'s


def chaos_node() -> tuple[NodeChaos, NodeCache]:
    config = NodeConfig(MIXED, CAPS, hooks=NodeChaos)
    assert config.hooks is not None
    hooks = config.hooks(config)
    assert isinstance(hooks, NodeChaos)
    cache = make(reserve_hook=hooks.reserve)
    hooks.transport(LocalTransport())
    return hooks, cache


def batches(n: int) -> list:
    return [(i, SimpleNamespace(seq=i)) for i in range(n)]


def test_allocation_faults_fail_the_armed_point_only():
    faults = AllocationFaults()
    faults(PoolName.FULL, Tier.DEVICE)  # idle until armed
    faults.arm(2)
    faults(PoolName.FULL, Tier.DEVICE)
    with pytest.raises(ReservationFailed, match="injected allocation failure: FULL/HOST"):
        faults(PoolName.FULL, Tier.HOST)
    faults(PoolName.SWA, Tier.DEVICE)  # fires once
    assert (faults.points, faults.injected) == (3, 1)
    with pytest.raises(ValueError):
        faults.arm(0)
    with pytest.raises(ValueError):
        AllocationFaults(rate=1.5)


def test_a_chaos_node_is_idle_until_armed_and_counts_what_fired():
    hooks, cache = chaos_node()
    tokens = seq(4)
    assert cache.put(tokens, prefix_kv(MIXED, tokens), NS) > 0
    hooks.after_get(cache)
    assert hooks.send(batches(2)) == batches(2)
    assert hooks.fired() == 0 and cache.match(tokens, NS).usable_pages > 0

    hooks.arm(ChaosAction(alloc_point=1))
    other = seq(4, start=100)
    assert cache.put(other, prefix_kv(MIXED, other), NS) == 0  # its reservation failed
    assert hooks.fired() == 1 and cache.stats().put_failures == 1
    cache.check()  # the failed put rolled back whole

    hooks.arm(ChaosAction(events=EventFault.DROP))
    assert hooks.send(batches(2)) == [] and hooks.fired() == 2

    hooks.arm(ChaosAction(evict_after_get=True))
    hooks.after_get(cache)
    assert cache.match(tokens, NS).usable_pages == 0 and hooks.fired() == 3
    cache.put(tokens, prefix_kv(MIXED, tokens), NS)
    hooks.after_get(cache)  # fired once: disarmed
    assert cache.match(tokens, NS).usable_pages > 0 and hooks.fired() == 3


def test_a_transfer_fault_goes_to_the_wrapped_transport_and_calm_disarms_all():
    hooks, cache = chaos_node()
    assert hooks.faulty is not None
    hooks.arm(ChaosAction(transport=Fault(FaultKind.HANG)))
    assert hooks.faulty.plan.next(4) == Fault(FaultKind.HANG) and hooks.fired() == 1
    hooks.arm(
        ChaosAction(
            transport=Fault(FaultKind.CORRUPT),
            alloc_point=1,
            events=EventFault.REORDER,
            evict_after_get=True,
        )
    )
    hooks.calm()
    assert hooks.faulty.plan.next(4) is None  # a fresh, empty plan
    hooks.after_get(cache)
    hooks.reserve(PoolName.FULL, Tier.DEVICE)
    assert hooks.send(batches(1)) == batches(1)
    assert hooks.fired() == 1  # replaced plans still count


def test_a_scripted_chaos_node_reads_its_script_first():
    hooks = NodeChaos(NodeConfig(MIXED, CAPS), script=[None, Fault(FaultKind.DELAY, delay_s=0.1)])
    faulty = hooks.transport(LocalTransport())
    assert faulty is hooks.faulty
    assert [hooks.faulty.plan.next(1), hooks.faulty.plan.next(1)] == [
        None,
        Fault(FaultKind.DELAY, delay_s=0.1),
    ]
    assert hooks.fired() == 1


@pytest.mark.parametrize("action", [None, "alloc", Fault(FaultKind.HANG)])
def test_a_chaos_node_refuses_what_is_not_a_chaos_action(action):
    hooks, _ = chaos_node()
    with pytest.raises(TypeError, match="ChaosAction"):
        hooks.arm(action)
    assert hooks.fired() == 0


def test_the_step_fault_file_fires_once_what_it_names(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.deploy.chaos.faults import InjectedFault, StepFaultFile
    from kvfabric.deploy.vllm.connector.jobs import ConnectorStep, FabricSettings

    path = tmp_path / "faults.json"
    hook = FabricSettings(**StepFaultFile.settings(str(path))).make_step_hook()
    assert isinstance(hook, StepFaultFile)
    hook(ConnectorStep.NODE_LOAD)  # no file: nothing armed
    path.write_text(json.dumps({"node_load": "KeyError", "worker_save": "Nope"}))
    hook(ConnectorStep.WORKER_LOAD)
    with pytest.raises(KeyError, match="node_load"):
        hook(ConnectorStep.NODE_LOAD)
    hook(ConnectorStep.NODE_LOAD)  # taken out of the file
    with pytest.raises(InjectedFault, match="worker_save"):
        hook(ConnectorStep.WORKER_SAVE)
    assert json.loads(path.read_text()) == {}
    with pytest.raises(ValueError, match="path"):
        StepFaultFile("")


def test_a_step_fault_is_either_fired_or_disarmed_never_both_nor_lost(tmp_path):
    """Engines take faults at their steps while the harness disarms: each armed fault is
    raised by exactly one step or handed back by `disarm`, over many interleavings."""
    pytest.importorskip("vllm")
    from kvfabric.deploy.chaos.faults import InjectedFault, StepFaultFile
    from kvfabric.deploy.vllm.connector.jobs import ConnectorStep

    steps = [ConnectorStep.NODE_LOAD, ConnectorStep.WORKER_LOAD, ConnectorStep.WORKER_SAVE]
    harness = StepFaultFile(str(tmp_path / "faults.json"))
    for round_ in range(60):
        harness.arm({s.value: "InjectedFault" for s in steps})
        fired: list[str] = []
        go = threading.Barrier(len(steps) + 1)

        def engine(step: ConnectorStep) -> None:
            hook = StepFaultFile(harness.path)  # a process of its own would open its own
            go.wait()
            for _ in range(round_ % 5):
                try:
                    hook(step)
                except InjectedFault:
                    fired.append(step.value)

        threads = [threading.Thread(target=engine, args=(s,)) for s in steps]
        for t in threads:
            t.start()
        go.wait()
        left = harness.disarm()
        for t in threads:
            t.join(timeout=30)
        assert sorted(fired + list(left)) == sorted(s.value for s in steps)
        assert harness.armed() == {}


def test_the_step_fault_file_fails_a_step_as_a_full_shm_would(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.deploy.chaos.faults import StepFaultFile
    from kvfabric.deploy.chaos.faults.step_file import FULL
    from kvfabric.deploy.vllm.connector.jobs import ConnectorStep
    from kvfabric.transport.staging import StagingSpaceError

    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"staging": FULL}))
    hook = StepFaultFile(str(path))
    with pytest.raises(StagingSpaceError, match="staging: /dev/shm is full") as e:
        hook(ConnectorStep.STAGING)
    assert e.value.errno == errno.ENOSPC
    hook(ConnectorStep.STAGING)  # once


def disk_chaos_node(folder) -> tuple[NodeChaos, NodeCache, DiskStore]:
    """A chaos node over a disk tier written through (tests/core/test_disk_tier.py's)."""
    config = NodeConfig(DISK_LAYOUT, DISK_CAPS, hooks=NodeChaos)
    assert config.hooks is not None
    hooks = config.hooks(config)
    assert isinstance(hooks, NodeChaos)
    cache, store = open_cache(folder, to_disk=WritePolicy.WRITE_THROUGH)
    hooks.disk(store)
    return hooks, cache, store


def test_a_full_disk_refuses_records_but_the_node_serves_on(tmp_path):
    hooks, cache, store = disk_chaos_node(tmp_path)
    seqs = prompts(8, seed=2)
    for t in seqs[:2]:
        cache.put(t, prefix_kv(DISK_LAYOUT, t), "t")
    recorded = len(store.journal.live)
    hooks.arm(ChaosAction(disk=DiskFault.FULL))
    for t in seqs[2:]:
        cache.put(t, prefix_kv(DISK_LAYOUT, t), "t")
    assert hooks.fired() == 1 and 0 < len(store.journal.live) - recorded
    assert all(served_right(cache, t) > 0 for t in seqs[2:4])  # unrecorded, served this run
    cache.check()
    store.close()
    cache, store = open_cache(tmp_path, to_disk=WritePolicy.WRITE_THROUGH)  # a restart
    cache.check()
    assert served_right(cache, seqs[0]) > 0  # recorded before the disk filled
    for t in seqs:
        served_right(cache, t)
    store.close()


def test_a_corrupted_disk_page_is_never_served(tmp_path):
    hooks, cache, store = disk_chaos_node(tmp_path)
    seqs = prompts(8, seed=3)
    for t in seqs:
        cache.put(t, prefix_kv(DISK_LAYOUT, t), "t")
    for _ in range(4):
        hooks.arm(ChaosAction(disk=DiskFault.CORRUPT_PAGE))
        hooks.after_get(cache)  # flips a byte of a page on disk, evicts the memory tiers
        for t in seqs:
            served_right(cache, t)
        cache.check()
    assert hooks.fired() == 4 + 4  # each flip, and the eviction after it
    assert cache.stats().disk_corrupt_pages > 0
    store.close()


def test_a_kill_mid_write_comes_between_the_pages_and_their_records(tmp_path, monkeypatch):
    hooks, cache, store = disk_chaos_node(tmp_path)
    killed = []

    def kill(pid: int, sig: int) -> None:
        killed.append(sorted(store.journal.live))
        raise SystemExit("killed")

    monkeypatch.setattr(disk_faults.os, "kill", kill)
    t = prompts(1, seed=4)[0]
    hooks.arm(ChaosAction(disk=DiskFault.KILL_MID_WRITE))
    with pytest.raises(SystemExit):
        cache.put(t, prefix_kv(DISK_LAYOUT, t), "t")
    assert killed == [[]]  # the pages were written, none recorded
    store.close()
