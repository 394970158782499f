"""An engine's connector counters as its node keeps them (NodeCacheActor.engine_report):
anything but names to non-negative ints, nested once, is refused and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.actors.node.engine_host import EngineHost, EngineReportError

from tests.fuzzing import NEAR, RANDOM, fuzz

pytestmark = pytest.mark.fuzz


def report_ok(engine: object, counters: object, depth: int = 0) -> bool:
    """A non-empty name; a dict of at most 64 non-empty names to ints >= 0 or (once) such dicts."""
    if not (
        isinstance(engine, str)
        and 0 < len(engine) <= 256
        and type(counters) is dict
        and len(counters) <= 64
    ):
        return False
    return all(
        isinstance(k, str)
        and k
        and ((type(v) is int and v >= 0) or (depth == 0 and report_ok(engine, v, 1)))
        for k, v in counters.items()
    )


COUNTERS = st.dictionaries(
    st.text(max_size=4),
    st.integers(-1, 5)
    | NEAR
    | st.dictionaries(st.text(max_size=3), st.integers(-1, 3) | NEAR, max_size=3),
    max_size=5,
)


@fuzz
@given(st.text(max_size=5) | NEAR, COUNTERS | RANDOM)
def test_engine_reports_are_kept_iff_valid(engine: Any, counters: Any) -> None:
    # No node around it: keeping reports touches nothing of the node.
    host = EngineHost("kvf-node-0123456789ab", None, None, None, None, lambda: 0)  # type: ignore[arg-type]
    host.engine_report("e", {"finished_requests": 3})
    before = host.engine_reports()
    try:
        host.engine_report(engine, counters)
    except EngineReportError:
        assert host.engine_reports() == before and not report_ok(engine, counters)
        return
    assert report_ok(engine, counters)
    assert engine in host.engine_reports() or (
        engine == "e" and counters.get("finished_requests", 0) < 3
    )
