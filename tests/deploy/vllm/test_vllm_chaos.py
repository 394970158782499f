"""`kvfabric chaos --engine vllm` through its pytest fixture: vLLM engines with the
FabricConnector under Ray Serve LLM (two nodes, an engine on each), requests flowing
through the OpenAI API, and the faults of the vLLM path once each: a node actor killed
with a load staged, a node actor stopped past the engines' call deadline, and a worker
killed (-9) as it copies a save to staging (vLLM ends the engine, Serve starts another,
the app runs the requests that died with it again) whose replacement then finds /dev/shm
full as it reserves its staging (that start fails, Serve's next one runs).
Afterwards every answer equalled the uncached one, no client retried, and no page,
lease or staging file was left behind."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfabric.deploy.chaos.plan import ChaosKind

kvfabric_chaos_options = {"engine": "vllm", "nodes": 2, "prompts": 4}

# Each fault of the vLLM path that only the app shows, once: SHM_FULL kills its worker
# mid-save (WORKER_KILL_MID_SAVE's fault) before the full /dev/shm; a worker killed
# mid-load, an engine restart more, is in `kvfabric chaos --engine vllm` and, its engine
# reaped, in test_engine_kill.py. CI's time goes to engine restarts (a minute or more each).
KINDS = [
    ChaosKind.NODE_KILL_MID_LOAD,
    ChaosKind.NODE_STALL,
    ChaosKind.SHM_FULL,
]


def test_each_fault_of_the_vllm_path_leaves_the_app_whole(kvfabric_chaos):
    reports = [
        kvfabric_chaos.run(seed=i, faults=1, kinds=[kind], interval_s=0.5, quiet_s=2.0)
        for i, kind in enumerate(KINDS)
    ]
    for kind, report in zip(KINDS, reports):
        assert report.by_kind == {kind.value: 1}, report
        assert report.requests > 0
        assert report.failed_requests == report.retried_requests == report.wrong_outputs == 0
        assert report.leaked_pages == report.double_owned_pages == 0
        assert report.expired_leases_unreleased == 0 and report.leaked_staging_files == 0
        # The index agreed with every node again (how soon is a figure: `kvfabric chaos
        # --engine vllm` prints it; a test checks behaviour, not time).
        assert report.index_converged_s != float("inf"), report
    # The requests the killed worker's engine held were run again by the app, not failed.
    assert reports[KINDS.index(ChaosKind.SHM_FULL)].app_retried_requests > 0
