"""`kvfabric chaos --engine vllm` through its pytest fixture: vLLM engines with the
FabricConnector under Ray Serve LLM (two nodes, an engine on each), requests flowing
through the OpenAI API, and the faults of the vLLM path that need no engine restart once
each: a node actor killed with a load staged, and a node actor stopped past the engines'
call deadline. Afterwards every answer equalled the uncached one, no client retried, and
no page, lease or staging file was left behind.

The faults that end an engine are run by `kvfabric chaos --engine vllm` (every kind, a
worker killed -9 mid-load or mid-save, /dev/shm full as the replacement starts), not here:
each costs Serve two engine starts, three minutes apiece on CI's two cores, which CI's
40 minutes cannot hold. Their parts are tested alone: a worker killed mid-load or
mid-save and its engine reaped (test_engine_kill.py), the app running again a request
whose engine died (test_llm_ingress.py), a staging reservation on a full /dev/shm
(tests/transport/test_staging.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfabric.deploy.chaos.plan import ChaosKind

kvfabric_chaos_options = {"engine": "vllm", "nodes": 2, "prompts": 4}

KINDS = [ChaosKind.NODE_KILL_MID_LOAD, ChaosKind.NODE_STALL]


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
