"""The scheduler side's edge, replaced for tests (test_vllm_remote.py): a real NodeCache
for the engine's node (sides_rig.py's LocalNode), a real one for the peer, and the index
lookup, the node's match and its fetch (a real export and import between the two caches,
as the node actor runs them) answering after a number of polls, raising any exception
type, or never answering, as an Edge says. No test here."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch
from kvfabric.core.cache.layout import Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.exchange.destination import FetchOutcome, import_prefix
from kvfabric.core.exchange.source import export_prefix
from kvfabric.core.index.answers import NodeMatch
from kvfabric.deploy.chaos.faults import StepFaultFile
from kvfabric.deploy.vllm.connector.block_format import BlockFormat
from kvfabric.deploy.vllm.connector.jobs import FabricSettings
from kvfabric.deploy.vllm.connector.scheduler_side import SchedulerSide
from kvfabric.deploy.vllm.connector.worker_side import WorkerSide
from kvfabric.transport.staging import StagingSpec

from tests.deploy.vllm.connector.sides_rig import (
    FULL_BLOCKS,
    LAYOUT,
    NAMES,
    NB,
    PLAN,
    PS,
    SWA_BLOCKS,
    Blocks,
    D,
    H,
    LocalNode,
    Req,
    Rig,
    finish_first,
)

PEER = "peer"


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
        return Pending(
            value, self.fail.get(point), -1 if point in self.never else self.delay.get(point, 0)
        )


@dataclass(eq=False)
class Pending:
    """A call at the edge: its answer, or the exception class its answer raises."""

    value: object
    error: type | None
    polls: int = 0  # polls before it answers; -1: never

    def done(self) -> bool:
        if self.polls == 0:
            return True
        self.polls -= self.polls > 0
        return False

    @property
    def pending(self):
        return None if self.polls == 0 else self

    def poll(self):  # as a PendingLookup
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
        found = [
            NodeMatch(n, c.match(tokens, namespace).usable_pages, Tier.DEVICE)
            for n, c in ((PEER, self.peer), (self.name, self.cache))
        ]
        return self.edge.answer(
            "lookup", sorted([m for m in found if m.pages], key=lambda m: -m.pages)
        )

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
        grant = export_prefix(
            self.peer,
            self.peer.leases,
            keys,
            self.cache.match(tokens, namespace).present_pages,
            10.0,
        )

        def read(pool, refs, pages):
            for (tier, index), page in zip(refs, pages):
                self.cache.registry.pool(pool, Tier.DEVICE).data[page] = self.peer.registry.pool(
                    pool, tier
                ).data[index]

        try:
            return import_prefix(self.cache, tokens, namespace, grant, read, peer=PEER)
        finally:
            if grant.lease_id:
                self.peer.leases.release(grant.lease_id)

    def finished(self, calls: list) -> list:
        edge = [c for c in calls if isinstance(c, Pending)]
        return [c for c in edge if c.done()] + super().finished(
            [c for c in calls if not isinstance(c, Pending)]
        )

    def result(self, call):
        if not isinstance(call, Pending):
            return super().result(call)
        if call.error is not None:
            raise call.error("injected at an answer")
        return call.value

    def wait_any(self, calls: list, timeout_s: float) -> None:
        self.waits += 1


def fresh_cache() -> NodeCache:
    return NodeCache(
        LAYOUT, {p: PoolCapacity(device=64, host=64) for p in LAYOUT.pools}, device="cpu"
    )


def make_rig(tmp_path_factory, edge: Edge, **settings_) -> Rig:
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 64)
    fault_file = str(tmp_path_factory.mktemp("f") / "faults.json")
    settings_ = FabricSettings(
        node_actor="local", **StepFaultFile.settings(fault_file), **settings_
    )
    sched, worker = SchedulerSide(PLAN, settings_, spec), WorkerSide(PLAN, settings_, spec)
    node = FabricEdge(spec, edge)
    node.attach(sched)
    g = torch.Generator().manual_seed(0)
    worker.register(
        {n: torch.randn(NB, H, PS, 2 * D, generator=g) for n in NAMES}, BlockFormat.KV_ROWS
    )
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
    full = all(
        torch.equal(rig.kv[n][list(range(30, 40))], rig.kv[n][FULL_BLOCKS[:10]])
        for n in NAMES[1::2]
    )
    swa = all(torch.equal(rig.kv[n][[40, 41]], rig.kv[n][SWA_BLOCKS[8:10]]) for n in NAMES[0::2])
    return full and swa


def slots_in_use(rig: Rig) -> int:
    return sum(a.capacity - a.free_count for a in rig.sched.slots.allocators.values())
