"""The scheduler side's remote hits without Ray: a real NodeCache for the engine's node, a
real one for the peer, real staging pages and KV tensors. Only the edge is replaced:
the index lookup, the node's match and its fetch (a real export and import between the
two caches, as the node actor runs them) answer after a number of polls picked by the
test, or fail with any exception type, or never answer.

Checks: a prefix only the peer holds is fetched and loaded with exact bytes while vLLM
is told to ask again (None); any failure, at any step, or a step that never answers,
ends in a bounded number of asks with either the exact hit or recomputation (0), never
an escaped error; no staging slot leaks; remote tokens are counted apart from host ones."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("vllm")

from kvfabric.deploy.chaos.faults import StepFaultFile  # noqa: E402
from kvfabric.deploy.vllm.block_format import BlockFormat  # noqa: E402
from kvfabric.deploy.vllm.jobs import FabricSettings  # noqa: E402
from kvfabric.deploy.vllm.remote_fetch import Stage  # noqa: E402
from kvfabric.deploy.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvfabric.deploy.vllm.worker_side import WorkerSide  # noqa: E402
from kvfabric.fabric import (FetchOutcome, NodeCache, NodeMatch, PoolCapacity, Tier, export_prefix,  # noqa: E402
                             import_prefix)
from tests.deploy.vllm.test_vllm_sides import (D, FULL_BLOCKS, H, LAYOUT, NAMES, NB, PLAN, PROMPT, PS,  # noqa: E402
                                               SWA_BLOCKS, Blocks, LocalNode, Req, Rig, finish_first)
from kvfabric.transport.staging import StagingSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

NS = "default"
PEER = "peer"


class Weird(Exception):
    """An exception type no code path expects."""


EXCEPTIONS = [ValueError, KeyError, RuntimeError, MemoryError, TimeoutError, Weird]
# Where the edge can fail: starting a call (raised at once) or its answer (raised by result/poll).
POINTS = ["index_ready", "start_lookup", "submit_match", "lookup", "match", "start_fetch", "fetch"]


@dataclass
class Edge:
    """What each edge step does: answer after `delay[point]` polls, raise `fail[point]`,
    or never answer (`never`)."""
    delay: dict[str, int] = field(default_factory=dict)
    fail: dict[str, type] = field(default_factory=dict)
    never: set[str] = field(default_factory=set)
    # A fetch whose answer fails or never comes: whether the node committed it anyway.
    commits_anyway: bool = False
    reached: set[str] = field(default_factory=set)

    def at(self, point: str) -> None:
        self.reached.add(point)
        if point in self.fail and point.startswith(("start_", "submit_", "index_")):
            raise self.fail[point](f"injected at {point}")

    def answer(self, point: str, value) -> "Pending":
        self.reached.add(point)
        return Pending(value, self.fail.get(point), -1 if point in self.never else self.delay.get(point, 0))


@dataclass(eq=False)
class Pending:
    """A call at the edge: its answer, or the exception class its answer raises."""
    value: object
    error: type | None
    polls: int = 0            # polls before it answers; -1: never

    def done(self) -> bool:
        if self.polls == 0:
            return True
        self.polls -= self.polls > 0
        return False

    @property
    def pending(self):
        return None if self.polls == 0 else self

    def poll(self):                       # as a PendingLookup
        if not self.done():
            return None
        if self.error is not None:
            raise self.error("injected at lookup")
        return self.value


class FabricEdge(LocalNode):
    """The engine's node (a LocalNode) plus a peer node and the index, at the edge."""

    def __init__(self, spec: StagingSpec, edge: Edge) -> None:
        super().__init__(spec)
        self.edge = edge
        self.peer = fresh_cache()
        self.waits = 0

    def index_ready(self) -> bool:
        self.edge.at("index_ready")
        return True

    def start_lookup(self, tokens, namespace):
        self.edge.at("start_lookup")
        found = [NodeMatch(n, c.match(tokens, namespace).usable_pages, True) for n, c in ((PEER, self.peer), (self.name, self.cache))]
        return self.edge.answer("lookup", sorted([m for m in found if m.pages], key=lambda m: -m.pages))

    def submit(self, method: str, *args):
        if method != "match":
            return super().submit(method, *args)
        self.edge.at("submit_match")
        return self.edge.answer("match", self.call(method, *args))

    def start_fetch(self, peer: str, tokens, namespace):
        assert peer == PEER
        self.edge.at("start_fetch")
        answer = self.edge.answer("fetch", None)
        if answer.error is None and answer.polls >= 0 or self.edge.commits_anyway:
            answer.value = self._fetch(tokens, namespace).value
        return answer

    def _fetch(self, tokens, namespace) -> FetchOutcome:
        """The node actor's fetch, in process: the peer exports, this node imports."""
        keys = self.cache.keys(tokens, namespace)
        grant = export_prefix(self.peer, self.peer.leases, keys, self.cache.match(tokens, namespace).present_pages, 10.0)

        def read(pool, refs, pages):
            for (tier, index), page in zip(refs, pages):
                self.cache.registry.pool(pool, Tier.DEVICE).data[page] = self.peer.registry.pool(pool, tier).data[index]
        try:
            return import_prefix(self.cache, tokens, namespace, grant, read, peer=PEER)
        finally:
            if grant.lease_id:
                self.peer.leases.release(grant.lease_id)

    def finished(self, calls: list) -> list:
        return [c for c in calls if not isinstance(c, Pending) or c.done()]

    def result(self, call):
        if not isinstance(call, Pending):
            return super().result(call)
        if call.error is not None:
            raise call.error("injected at an answer")
        return call.value

    def wait_any(self, calls: list, timeout_s: float) -> None:
        self.waits += 1


def fresh_cache() -> NodeCache:
    return NodeCache(LAYOUT, {p: PoolCapacity(device=64, host=64) for p in LAYOUT.pools}, device="cpu")


def make_rig(tmp_path_factory, edge: Edge, **settings_) -> Rig:
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 64)
    fault_file = str(tmp_path_factory.mktemp("f") / "faults.json")
    settings_ = FabricSettings(node_actor="local", **StepFaultFile.settings(fault_file), **settings_)
    sched, worker = SchedulerSide(PLAN, settings_, spec), WorkerSide(PLAN, settings_, spec)
    node = FabricEdge(spec, edge)
    node.attach(sched)
    g = torch.Generator().manual_seed(0)
    worker.register({n: torch.randn(NB, H, PS, 2 * D, generator=g) for n in NAMES}, BlockFormat.KV_ROWS)
    return Rig(sched, worker, worker.views, fault_file, node)


def move_to_peer(rig: Rig) -> None:
    """What the first request stored on this node, held by the peer only."""
    finish_first(rig)
    rig.node.peer, rig.node.cache = rig.node.cache, fresh_cache()


def ask_until_known(rig: Rig, req: Req, clock: list[float], max_asks: int = 50) -> tuple[int, int]:
    """Ask as vLLM does, a step apart, until the answer is known: (tokens, asks)."""
    rig.sched.remote.clock = lambda: clock[0]
    for asks in range(1, max_asks + 1):
        n, is_async = rig.sched.num_new_matched_tokens(req, 0)
        if n is not None:
            assert is_async == (n > 0)
            return n, asks
        assert not is_async
        rig.step()
        clock[0] += 1.0
    raise AssertionError(f"no answer after {max_asks} asks")


def load(rig: Rig, req: Req, n: int):
    swa = [0] * 8 + [40, 41, 42]
    if n:
        rig.sched.after_alloc(req, Blocks((swa, list(range(30, 41)))), n)
    return rig.step()


def loaded_exactly(rig: Rig) -> bool:
    full = all(torch.equal(rig.kv[n][list(range(30, 40))], rig.kv[n][FULL_BLOCKS[:10]]) for n in NAMES[1::2])
    swa = all(torch.equal(rig.kv[n][[40, 41]], rig.kv[n][SWA_BLOCKS[8:10]]) for n in NAMES[0::2])
    return full and swa


def slots_in_use(rig: Rig) -> int:
    return sum(a.capacity - a.free_count for a in rig.sched.allocators.values())


def test_a_prefix_only_the_peer_holds_is_fetched_and_loaded_exactly(tmp_path_factory):
    rig = make_rig(tmp_path_factory, Edge(delay={"lookup": 2, "fetch": 3}))
    try:
        move_to_peer(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, asks = ask_until_known(rig, req, [0.0])
        assert n == 40 and asks > 1           # vLLM was told to ask again while it fetched
        assert rig.node.waits > 0             # an idle engine waited on the fabric, not spun
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
        assert rig.sched.num_new_matched_tokens(fresh, 0) == (0, False)      # no node holds it
        finish_first(rig)                                                    # the node: 10 pages
        longer = PROMPT + list(range(300, 320))                              # 15 pages of prompt
        assert rig.sched.num_new_matched_tokens(Req("r2", longer, longer, 0), 40) == (0, False)
        assert "load_staged" not in calls
        assert rig.sched.stats.lookups_answered_by_match == 2
        # The node holding more than vLLM's own hit is still loaded from.
        n, _ = rig.sched.num_new_matched_tokens(Req("r3", longer, longer, 0), 32)
        assert n == 8 and calls.count("load_staged") == 1
        rig.sched.after_alloc(Req("r3", longer, longer, 0), Blocks(([0] * 8 + [40, 41, 42], list(range(30, 45)))), 0)
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
        assert n == 40 and asks == (2 if on_peer else 1) and rig.sched.stats.remote.fetches == on_peer
        assert not load(rig, req, n).failed_recving and loaded_exactly(rig)
    finally:
        rig.node.shared.unlink()


class EngineListedFirst(FabricEdge):
    """The index also names an engine's device cache (its KV events) with more pages."""

    def start_lookup(self, tokens, namespace):
        from kvfabric.deploy.vllm.engine_identity import engine_index_node
        found = super().start_lookup(tokens, namespace)
        engine = NodeMatch(engine_index_node(PEER, "0"), 1000, True)
        found.value = [engine, *found.value] if found.error is None else found.value
        return found


def test_an_engines_entry_is_never_fetched_from(tmp_path_factory):
    rig = make_rig(tmp_path_factory, Edge())
    rig.node.__class__ = EngineListedFirst
    try:
        move_to_peer(rig)
        req = Req("r2", PROMPT, PROMPT, 0)
        n, _ = ask_until_known(rig, req, [0.0])
        assert n == 40 and rig.sched.stats.remote.committed == 1     # from the peer's node actor
        assert rig.sched.stats.remote.failures == 0
    finally:
        rig.node.shared.unlink()


@settings(max_examples=40, deadline=None)
@given(point=st.sampled_from(POINTS), exception=st.sampled_from(EXCEPTIONS),
       never=st.booleans(), commits_anyway=st.booleans(),
       delay=st.dictionaries(st.sampled_from(["lookup", "match", "fetch"]), st.integers(0, 2)))
def test_any_failure_at_any_step_becomes_recomputation_or_an_exact_hit(
        tmp_path_factory, point, exception, never, commits_anyway, delay):
    edge = Edge(delay=delay, commits_anyway=commits_anyway)
    if never and point in ("lookup", "match", "fetch"):
        edge.never.add(point)           # past its deadline instead of failing
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
        assert rig.sched.stats.remote_loaded_tokens == 0       # no committed answer, no remote count
        assert slots_in_use(rig) == 0
        rig.node.cache.check()
        rig.node.peer.check()
        assert len(rig.node.peer.leases) == 0      # every export lease released
        rig.sched.finished(req, (SWA_BLOCKS, FULL_BLOCKS))
        assert not rig.sched.remote.requests and not rig.sched.hit_sources
    finally:
        rig.node.shared.unlink()


def test_a_link_not_connected_refuses_lookups_and_fetches():
    from kvfabric.deploy.vllm.node_link import NodeLink
    link = NodeLink(FabricSettings(node_actor="node-a"), LAYOUT)
    with pytest.raises(RuntimeError, match="index_ready first"):
        link.start_lookup([1, 2, 3], "ns")
    with pytest.raises(RuntimeError, match="ready first"):
        link.start_fetch("node-b", [1, 2, 3], "ns")
