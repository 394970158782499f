"""A node's link to the index shards, without Ray: a new route table that reaches a node
before the directory attaches it (a rebalance racing a restart) must not attach it with no
shards, or every later publish fails."""

from __future__ import annotations

from kvfabric.actors.node.index_link import IndexLink
from kvfabric.core.index.publisher import EventPublisher
from kvfabric.core.index.routes import RouteTable

from tests.core.test_node_cache import MIXED, make, seq
from tests.kvgen import prefix_kv


class Shard:
    """Stands in for a shard actor handle: records what `apply` is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.apply = self.load_snapshot = self

    def remote(self, data: bytes):
        self.sent.append(data)
        return Reply()


class Reply:
    def future(self):
        from concurrent.futures import Future

        done: Future = Future()
        done.set_result("ok")
        return done


def test_a_reroute_before_attach_is_ignored_until_attach():
    cache = make()
    link = IndexLink(EventPublisher(cache, "n", epoch=1))
    link.reroute(RouteTable(3))  # a rebalance reached the node first
    assert not link.attached
    tokens = seq(3)
    cache.put(tokens, prefix_kv(MIXED, tokens), "ns")
    assert link.publish() == 0  # nothing to send to yet, and no IndexError
    shards = [Shard() for _ in range(3)]
    link.attach(shards, RouteTable(3))
    assert link.attached and sum(len(s.sent) for s in shards) > 0
    link.reroute(RouteTable(3))  # attached: snapshots go to every shard
    assert all(s.sent for s in shards)


class Pending:
    """A reply the test completes later, from another thread as Ray does."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self.done: Future = Future()

    def future(self):
        return self.done


class HeldShard(Shard):
    def __init__(self) -> None:
        super().__init__()
        self.replies: list[Pending] = []

    def remote(self, data: bytes):
        self.sent.append(data)
        self.replies.append(Pending())
        return self.replies[-1]


def _answer(reply: Pending, result=None, error: Exception | None = None) -> None:
    import threading

    t = threading.Thread(
        target=reply.done.set_exception if error else reply.done.set_result, args=(error or result,)
    )
    t.start()
    t.join(timeout=10)


def test_a_shard_that_fell_behind_is_named_when_its_reply_comes_not_at_the_next_publish():
    from kvfabric.core.index.prefix_index import ApplyResult

    calls: list[bool] = []
    cache = make()
    link = IndexLink(EventPublisher(cache, "n", epoch=1), on_behind=calls.append)
    shard = HeldShard()
    link.attach([shard], RouteTable(1))
    tokens = seq(2)
    cache.put(tokens, prefix_kv(MIXED, tokens), "ns")
    assert link.publish() == 1
    first, second = shard.replies[-2:]
    _answer(first, ApplyResult.APPLIED)
    assert calls == []  # in step: nothing to do
    _answer(second, ApplyResult.NEED_SNAPSHOT)
    assert calls == [False]  # at once, from the thread that completed the reply
    sent = len(shard.sent)
    link.resync_behind()  # what the owner then does
    assert len(shard.sent) == sent + 1  # the snapshot
    _answer(shard.replies[-1], error=RuntimeError("the shard died"))
    assert calls == [False, True]  # failed: the owner retries a moment later


def test_without_an_owner_to_tell_a_gap_waits_for_the_next_publish():
    from kvfabric.core.index.prefix_index import ApplyResult

    cache = make()
    link = IndexLink(EventPublisher(cache, "n", epoch=1))
    shard = HeldShard()
    link.attach([shard], RouteTable(1))
    for reply in shard.replies:
        _answer(reply, ApplyResult.NEED_SNAPSHOT)
    sent = len(shard.sent)
    link.publish(every_shard=True)
    assert len(shard.sent) == sent + 2  # the snapshot, then the heartbeat's batch


def test_the_pacer_marks_the_sequence_after_changes_and_resends_a_snapshot_on_a_gap():
    """A lost last batch shows as a gap at the pacer's mark, and the shard's
    need_snapshot brings the snapshot at once: no heartbeat, no later change."""
    import asyncio
    import threading

    from kvfabric.actors.node.index_link import CONFIRM_AFTER_S, LinkPacer
    from kvfabric.core.index.events import EventBatch, Snapshot, decode
    from kvfabric.core.index.prefix_index import ApplyResult

    cache = make()
    link = IndexLink(EventPublisher(cache, "n", epoch=1))
    shard = HeldShard()
    pacer = LinkPacer(link, threading.Lock())

    async def until(condition, what: str, limit_s: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + limit_s
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.01)

    async def run() -> None:
        link.attach([shard], RouteTable(1))
        pacer.start()
        link.send_filter = lambda sends: []  # the next batch is lost on the way
        tokens = seq(2)
        cache.put(tokens, prefix_kv(MIXED, tokens), "ns")
        assert link.publish() == 1 and link.unconfirmed
        link.send_filter = None
        sent = len(shard.sent)
        await until(lambda: len(shard.sent) > sent, "no mark of the sequence")
        mark = decode(shard.sent[-1])
        assert isinstance(mark, EventBatch) and not mark.pages and not link.unconfirmed
        threading.Thread(
            target=shard.replies[-1].done.set_result, args=(ApplyResult.NEED_SNAPSHOT,)
        ).start()
        await until(lambda: len(shard.sent) > sent + 1, "no snapshot after need_snapshot")
        assert isinstance(decode(shard.sent[-1]), Snapshot)
        await asyncio.sleep(2 * CONFIRM_AFTER_S)
        assert len(shard.sent) == sent + 2  # nothing new: no further marks
        pacer.stop()

    asyncio.run(run())
