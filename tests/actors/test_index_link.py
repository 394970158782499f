"""A node's link to the index shards, without Ray: a new route table that reaches a node
before the directory attaches it (a rebalance racing a restart) must not attach it with no
shards, or every later publish fails."""

from __future__ import annotations

from kvfabric.actors.node.index_link import IndexLink
from kvfabric.fabric import EventPublisher, RouteTable

from tests.fabric.test_node_cache import MIXED, make, seq
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
