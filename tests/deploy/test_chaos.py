"""The chaos harness through its pytest fixture (as users get it): every kind of
fault lands while requests flow, and afterwards nothing is lost or wrong."""

from __future__ import annotations

import pytest
from kvfabric.deploy.chaos.plan import ENGINE_KINDS, ChaosKind, schedule

kvfabric_chaos_options = {"nodes": 3, "prompts": 6}


def test_every_fault_kind_leaves_the_fabric_whole(kvfabric_chaos):
    kinds = [k for k in ENGINE_KINDS["reference"] if k is not ChaosKind.REMOVE_READD_NODE]
    # The disk kinds among them: the harness's nodes have a disk tier.
    assert {ChaosKind.DISK_KILL_MID_WRITE, ChaosKind.DISK_CORRUPT_PAGE, ChaosKind.DISK_FULL} <= set(
        kinds
    )
    # This seed's schedule has every kind at least once and four restarts (of a node actor,
    # a shard, the directory, a node mid disk write) in 26 faults.
    faults, seed = 26, 106
    assert set(schedule(seed, faults, kinds)) == set(kinds)
    report = kvfabric_chaos.run(seed=seed, faults=faults, kinds=kinds, interval_s=0.2, quiet_s=2.0)
    assert report.requests > 0
    assert report.faults_injected == faults and sum(report.by_kind.values()) == faults
    assert set(report.by_kind) == {k.value for k in kinds}
    assert (
        report.failed_requests == 0 and report.retried_requests == 0 and report.wrong_outputs == 0
    )
    assert report.leaked_pages == 0 and report.double_owned_pages == 0
    assert report.expired_leases_unreleased == 0
    assert report.index_converged_s <= 5.0  # the index agreed with every node
    assert report.ok(faults)


def test_a_removed_and_readded_node(kvfabric_chaos):
    report = kvfabric_chaos.run(seed=1, faults=1, kinds=[ChaosKind.REMOVE_READD_NODE], quiet_s=2.0)
    assert report.by_kind == {"remove_readd_node": 1}
    # A request on the removed node's replica is retried by the app, never by the client.
    assert (
        report.failed_requests == 0 and report.retried_requests == 0 and report.wrong_outputs == 0
    )
    assert report.leaked_pages == 0 and report.double_owned_pages == 0
    assert report.index_converged_s != float("inf")


def test_the_schedule_is_seeded_and_spaces_restarts():
    kinds = list(ChaosKind)
    assert schedule(3, 200, kinds) == schedule(3, 200, kinds)
    assert schedule(3, 200, kinds) != schedule(4, 200, kinds)
    plan = schedule(3, 200, kinds)
    removals = [i for i, k in enumerate(plan) if k is ChaosKind.REMOVE_READD_NODE]
    assert all(b - a >= 25 for a, b in zip(removals, removals[1:]))
    assert set(plan) == set(kinds)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kinds", "nope"],
        ["--faults", "0"],
        ["--interval-s", "-1"],
        ["--kinds", "node_stall"],  # a vLLM engine's fault, with the reference engine
        ["--kinds", "shm_full"],
        ["--engine", "vllm", "--kinds", "transfer_hang"],
        ["--engine", "vllm", "--address", "auto"],
    ],
)
def test_bad_chaos_arguments_exit_with_usage(argv):
    from kvfabric.deploy.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["chaos", *argv])
    assert e.value.code == 2
