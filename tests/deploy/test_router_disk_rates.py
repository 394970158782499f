"""The Serve router weighs each node's disk by the read bandwidth the node measured: asked
of the node actor the first time the node is a candidate, never waited for long, a
failed ask left at the cost model's figure (0.0) and tried again later, a learned rate
asked again later (a restarted node measures again), an answer that is no bandwidth
refused."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvfabric.actors.names import node_actor_name
from kvfabric.core.cache.layout import Tier
from kvfabric.core.index.answers import NodeMatch
from kvfabric.deploy.serving.disk_rates import DiskRates
from kvfabric.deploy.serving.protocol import GenerateRequest
from kvfabric.deploy.serving.router import RATE_WAIT_S, FabricRanking, GenerateRequestPrompts


@dataclass(frozen=True)
class ReplicaID:  # the fields of Serve's ReplicaID and RunningReplica the router reads
    unique_id: str


@dataclass(frozen=True)
class Replica:
    replica_id: ReplicaID
    node_id: str


@dataclass
class Pending:
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)


class Index:  # the fabric client's lookup: node a holds 2 pages of every prompt, on disk
    async def lookup_async(self, tokens, namespace):
        return [NodeMatch(node_actor_name("a" * 20), 2, Tier.DISK)]


class Views:  # the placement: records the views it ranks, keeps their order
    def __init__(self) -> None:
        self.seen: list = []

    def rank(self, request, views):
        self.seen.append(views)
        return list(range(len(views)))


class Ranking(GenerateRequestPrompts, FabricRanking):
    def __init__(self, rates: dict[str, float]) -> None:
        # Serve's RequestRouter.__init__ wants a deployment; the ranking needs only these.
        self.init_ranking()
        self._replica_queue_len_cache: dict = {}
        self._client = Index()  # type: ignore[assignment]
        self._placement = self.views = Views()  # type: ignore[assignment]
        self._page_size = 16
        self.rates = rates
        self.asked: list[str] = []

    async def _ask_disk_rate(self, node: str) -> float:
        self.asked.append(node)
        if node not in self.rates:
            raise ConnectionError(f"{node} is restarting")
        return self.rates[node]


def test_each_node_s_measured_rate_reaches_its_view():
    a, b, c = (Replica(ReplicaID(f"r{x}"), x * 20) for x in "abc")
    name = {r: node_actor_name(r.node_id) for r in (a, b, c)}
    ranking = Ranking({name[a]: 2e9, name[b]: 0.3e9})
    request = Pending([GenerateRequest(tokens=tuple(range(64)), max_tokens=1, namespace="t")])

    async def route_twice():
        await ranking.choose_replicas([a, b, c], request)
        await ranking.choose_replicas([a, b, c], request)

    asyncio.run(route_twice())
    first, second = ranking.views.seen
    assert [v.disk_read_bytes_per_s for v in first] == [2e9, 0.3e9, 0.0]  # c's ask failed
    assert [v.cached_pages for v in first] == [2, 0, 0]  # the index's answer beside it
    assert [v.tier for v in first] == [Tier.DISK, Tier.DEVICE, Tier.DEVICE]
    assert second == first
    # Asked once each: a known rate is kept, a failed ask waits RETRY_S.
    assert sorted(ranking.asked) == sorted(name.values())


def test_a_slow_answer_is_not_waited_for_and_a_failed_ask_is_tried_again():
    answers: dict[str, float] = {"slow": 1e9}
    asked: list[str] = []

    async def ask(node: str) -> float:
        asked.append(node)
        if node == "slow":
            await asyncio.sleep(0.5)
        if node not in answers:
            raise TimeoutError(node)
        return answers[node]

    async def run() -> None:
        rates = DiskRates(ask, retry_s=0.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await rates.of(["slow", "gone"], RATE_WAIT_S) == {"slow": 0.0, "gone": 0.0}
        assert loop.time() - start < 0.4
        await asyncio.sleep(0.7)
        answers["gone"] = 3e9  # back: asked again, since its retry time has passed
        assert await rates.of(["slow", "gone"], RATE_WAIT_S) == {"slow": 1e9, "gone": 3e9}
        assert sorted(asked) == ["gone", "gone", "slow"]

    asyncio.run(run())


def test_a_learned_rate_is_asked_again_and_a_bad_answer_changes_nothing():
    """A node restarted on another disk measures again: its rate is asked again after
    `refresh_s`, the old one answering meanwhile; an answer that is no bandwidth (NaN,
    negative, infinite, not a number) is refused and the rate known before stays."""
    answers: dict[str, object] = {"n": 1e9}
    given: list[object] = []
    now = [0.0]

    async def ask(node: str):
        given.append(answers[node])
        return answers[node]

    async def settled(rates: DiskRates) -> dict[str, float]:
        """The rates once the background asks have ended (each answers at once)."""
        while rates._asking:
            await asyncio.sleep(0)
        return await rates.of(["n"], 0.0)

    async def run() -> None:
        rates = DiskRates(ask, retry_s=5.0, refresh_s=60.0, clock=lambda: now[0])
        assert await rates.of(["n"], 1.0) == {"n": 1e9}
        answers["n"] = 2e9
        now[0] = 59.0
        assert await settled(rates) == {"n": 1e9}  # not due yet: not asked
        now[0] = 61.0
        assert await rates.of(["n"], 1.0) == {"n": 1e9}  # due: asked in the background
        assert await settled(rates) == {"n": 2e9}
        assert given == [1e9, 2e9]
        bad = [float("nan"), -1.0, float("inf"), "3e9", None, True]
        for value in bad:
            answers["n"] = value
            now[0] += 61.0
            await rates.of(["n"], 1.0)
            assert await settled(rates) == {"n": 2e9}, value
        assert given[2:] == bad, given  # each asked, each refused

    asyncio.run(run())
