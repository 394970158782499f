"""The scheduler side's remote hits without Ray: a real NodeCache for the engine's node, a
real one for the peer, real staging pages and KV tensors. Only the edge is replaced:
the index lookup, the node's match and its fetch (a real export and import between the
two caches, as the node actor runs them) answer after a number of polls picked by the
test, or fail with any exception type, or never answer.

Checks: a prefix only the peer holds is fetched and loaded with exact bytes while vLLM
is told to ask again (None); any failure, at any step, or a step that never answers,
ends in a bounded number of asks with either the exact hit or recomputation (0), never
an escaped error; no staging slot leaks; remote tokens are counted apart from host ones.
The edge they run against: tests/deploy/vllm/connector/fabric_edge.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples

pytest.importorskip("vllm")

from kvfabric.core.cache.layout import Tier
from kvfabric.core.index.answers import NodeMatch
from kvfabric.deploy.vllm.connector.jobs import FabricSettings  # noqa: E402
from kvfabric.deploy.vllm.connector.remote_fetch import Stage  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from tests.deploy.vllm.connector.fabric_edge import (  # noqa: E402
    PEER,
    Edge,
    FabricEdge,
    ask_until_known,
    load,
    loaded_exactly,
    make_rig,
    move_to_peer,
    slots_in_use,
)
from tests.deploy.vllm.connector.sides_rig import (  # noqa: E402
    FULL_BLOCKS,
    LAYOUT,
    PROMPT,
    SWA_BLOCKS,
    Blocks,
    Req,
    finish_first,
)


class Weird(Exception):
    """An exception type no code path expects."""


EXCEPTIONS = [ValueError, KeyError, RuntimeError, MemoryError, TimeoutError, Weird]
# Where the edge can fail: starting a call (raised at once) or its answer (raised by result/poll).
POINTS = ["index_ready", "start_lookup", "submit_match", "lookup", "match", "start_fetch", "fetch"]


def test_a_prefix_only_the_peer_holds_is_fetched_and_loaded_exactly(tmp_path_factory):
    rig = make_rig(tmp_path_factory, Edge(delay={"lookup": 2, "fetch": 3}))
    try:
        move_to_peer(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, asks = ask_until_known(rig, req, [0.0])
        assert n == 40 and asks > 1  # vLLM was told to ask again while it fetched
        assert rig.node.waits > 0  # an idle engine waited on the fabric, not spun
        out = load(rig, req, n)
        assert out.finished_recving == {"r2"} and not out.failed_recving and loaded_exactly(rig)
        stats = rig.sched.stats
        assert stats.remote_loaded_tokens == 40 and stats.host_loaded_tokens == 0
        assert stats.remote.fetches == stats.remote.committed == 1 and stats.remote.failures == 0
        assert rig.sched.hit_sources_of(req, 40) == {CacheHitSource.P2P: 40}
        assert slots_in_use(rig) == 0
        # Asked again (vLLM re-admits it after a preemption): no second fetch.
        assert rig.sched.num_new_matched_tokens(req, 0)[0] == 40 and stats.remote.fetches == 1
    finally:
        rig.node.shared.unlink()


def test_no_fetch_when_the_node_holds_as_much(tmp_path_factory):
    rig = make_rig(tmp_path_factory, Edge())
    try:
        finish_first(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, _ = ask_until_known(rig, req, [0.0])
        assert n == 40 and rig.sched.stats.remote.fetches == 0
        load(rig, req, n)
        assert rig.sched.stats.remote_loaded_tokens == 0 and loaded_exactly(rig)
    finally:
        rig.node.shared.unlink()


def test_no_load_call_when_the_node_holds_no_more_than_vllm(tmp_path_factory):
    # The admission's match already said so: the load call would only queue in the node.
    rig = make_rig(tmp_path_factory, Edge())
    calls: list[str] = []
    call = rig.node.call
    rig.node.call = lambda method, *args: calls.append(method) or call(method, *args)
    try:
        fresh = Req("r0", PROMPT, PROMPT, 0)
        assert rig.sched.num_new_matched_tokens(fresh, 0) == (0, False)  # no node holds it
        finish_first(rig)  # the node: 10 pages
        longer = PROMPT + list(range(300, 320))  # 15 pages of prompt
        assert rig.sched.num_new_matched_tokens(Req("r2", longer, longer, 0), 40) == (0, False)
        assert "load_staged" not in calls
        assert rig.sched.stats.lookups_answered_by_match == 2
        # The node holding more than vLLM's own hit is still loaded from.
        n, _ = rig.sched.num_new_matched_tokens(Req("r3", longer, longer, 0), 32)
        assert n == 8 and calls.count("load_staged") == 1
        rig.sched.after_alloc(
            Req("r3", longer, longer, 0), Blocks(([0] * 8 + [40, 41, 42], list(range(30, 45)))), 0
        )
        assert slots_in_use(rig) == 0
    finally:
        rig.node.shared.unlink()


def test_a_match_answered_while_the_prefix_was_being_stored_is_asked_again(tmp_path_factory):
    """The node answers its match before a store of the same prefix (its calls run
    concurrently): that answer predates the store, so it must not stand for the node once
    the store has ended. CI met this as a hit that loaded nothing."""
    rig = make_rig(tmp_path_factory, Edge())
    try:
        rig.node.stalled = []  # the store waits in the node; its match answers at once
        finish_first(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        assert rig.sched.num_new_matched_tokens(req, 0) == (None, False)  # the store first
        rig.node.resume()
        rig.step()
        n, _ = ask_until_known(rig, req, [0.0])
        assert n == 40
        assert not load(rig, req, n).failed_recving and loaded_exactly(rig)
        assert slots_in_use(rig) == 0
    finally:
        rig.node.shared.unlink()


class AnswersWhileWaitedOn(FabricEdge):
    """The index and the node answer while admission waits on them (as in milliseconds)."""

    def wait_any(self, calls: list, timeout_s: float) -> int:
        super().wait_any(calls, timeout_s)
        return 1


@pytest.mark.parametrize("on_peer", [False, True])
def test_a_prompt_answered_while_admission_waits_loses_no_engine_step(tmp_path_factory, on_peer):
    """A hit on the node is loaded at the first ask; a longer prefix on a peer is fetched
    at once (vLLM asks again only while the fetch runs)."""
    rig = make_rig(tmp_path_factory, Edge(delay={"lookup": 2, "match": 1, "fetch": 1}))
    rig.node.__class__ = AnswersWhileWaitedOn
    try:
        move_to_peer(rig) if on_peer else finish_first(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, asks = ask_until_known(rig, req, [0.0])
        assert (
            n == 40 and asks == (2 if on_peer else 1) and rig.sched.stats.remote.fetches == on_peer
        )
        assert not load(rig, req, n).failed_recving and loaded_exactly(rig)
    finally:
        rig.node.shared.unlink()


class EngineListedFirst(FabricEdge):
    """The index also names an engine's device cache (its KV events) with more pages."""

    def start_lookup(self, tokens, namespace):
        from kvfabric.deploy.serving.engine_identity import engine_index_node

        found = super().start_lookup(tokens, namespace)
        engine = NodeMatch(engine_index_node(PEER, "0"), 1000, Tier.DEVICE)
        found.value = [engine, *found.value] if found.error is None else found.value
        return found


def test_an_engines_entry_is_never_fetched_from(tmp_path_factory):
    rig = make_rig(tmp_path_factory, Edge())
    rig.node.__class__ = EngineListedFirst
    try:
        move_to_peer(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, _ = ask_until_known(rig, req, [0.0])
        assert n == 40 and rig.sched.stats.remote.committed == 1  # from the peer's node actor
        assert rig.sched.stats.remote.failures == 0
    finally:
        rig.node.shared.unlink()


@settings(max_examples=examples(40), deadline=None)
@given(
    point=st.sampled_from(POINTS),
    exception=st.sampled_from(EXCEPTIONS),
    never=st.booleans(),
    commits_anyway=st.booleans(),
    delay=st.dictionaries(st.sampled_from(["lookup", "match", "fetch"]), st.integers(0, 2)),
)
def test_any_failure_at_any_step_becomes_recomputation_or_an_exact_hit(
    tmp_path_factory, point, exception, never, commits_anyway, delay
):
    edge = Edge(delay=delay, commits_anyway=commits_anyway)
    if never and point in ("lookup", "match", "fetch"):
        edge.never.add(point)  # past its deadline instead of failing
    else:
        edge.fail[point] = exception
    rig = make_rig(tmp_path_factory, edge, timeout_s=5.0, fetch_timeout_s=5.0)
    try:
        move_to_peer(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, asks = ask_until_known(rig, req, [0.0])
        assert point in edge.reached
        assert rig.sched.stats.remote.failures == 1
        assert all(r.stage is Stage.READY for r in rig.sched.remote.requests.values())
        # Exact bytes of a fetch that committed though its answer was lost, or nothing.
        fetched = point == "fetch" and commits_anyway
        assert n == (40 if fetched else 0)
        out = load(rig, req, n)
        assert not out.failed_recving and (n == 0 or loaded_exactly(rig))
        assert rig.sched.stats.remote_loaded_tokens == 0  # no committed answer, no remote count
        assert slots_in_use(rig) == 0
        rig.node.cache.check()
        rig.node.peer.check()
        assert len(rig.node.peer.leases) == 0  # every export lease released
        rig.sched.finished(req, (SWA_BLOCKS, FULL_BLOCKS))
        assert not rig.sched.remote.requests and not rig.sched.hit_sources
    finally:
        rig.node.shared.unlink()


def test_a_link_not_connected_refuses_lookups_and_fetches():
    from kvfabric.deploy.vllm.connector.node_link import NodeLink

    link = NodeLink(FabricSettings(node_actor="node-a"), LAYOUT)
    with pytest.raises(RuntimeError, match="index_ready first"):
        link.start_lookup([1, 2, 3], "ns")
    with pytest.raises(RuntimeError, match="ready first"):
        link.start_fetch("node-b", [1, 2, 3], "ns")
