"""The chaos harness as a pytest fixture, for users' own suites.

Installed with the package (entry point `pytest11`), so any test can ask for
`kvfabric_chaos`: the fabric and its Serve app with chaos on, on an embedded
3-node cluster shared by the test module, and a harness to run faults with:

    def test_my_policy_survives(kvfabric_chaos):
        report = kvfabric_chaos.run(seed=3, faults=20)
        assert report.ok()

A module may set `kvfabric_chaos_options = {"nodes": 4, "prompts": 8}`, and
`"engine": "vllm"` for vLLM engines under Ray Serve LLM (`kvfabric chaos --engine vllm`).
Nothing here imports Ray until the fixture is used.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kvfabric_chaos(request):
    from kvfabric.deploy.harness.cluster import keep_auth_on

    keep_auth_on()  # before Ray loads, unless the suite already chose
    from .run import session, vllm_session

    options = dict(getattr(request.module, "kvfabric_chaos_options", {}))
    started = vllm_session if options.get("engine") == "vllm" else session
    # Its log goes to stdout: pytest shows it with a failing test.
    with started(options.get("nodes", 3), options.get("prompts", 12), log=print) as harness:
        yield harness
