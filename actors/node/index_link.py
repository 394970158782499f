"""IndexLink: what a node actor sends the index shards, and what it learns back.

Batches go out under the node's route table without waiting; a shard that saw a
gap answers need_snapshot (a restarted shard answers nothing: its call failed)
and gets this node's snapshot of its part at the next publish, or as soon as its
owner acts on `on_behind` (called, from whatever thread completes the reply, when
one says so). Replies are read from their futures once they are done: nothing
here waits on a shard."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

from kvfabric.fabric import ApplyResult, EventBatch, RouteTable, ShardPublisher

MAX_UNANSWERED = 4096  # event sends a node remembers until their shard answers

P = TypeVar("P", bound=ShardPublisher)

# What one publish sends: (shard, batch) pairs, in order.
Sends = list[tuple[int, EventBatch]]
# The pairs to really send, given those a publish would send (tests, chaos: NodeHooks.send).
SendFilter = Callable[[Sends], Sends]


class IndexLink(Generic[P]):
    """Generic in its publisher, so that its owner reads back what it gave (a node
    actor drains its EventPublisher directly when no index is attached)."""

    def __init__(
        self,
        publisher: P,
        send_filter: SendFilter | None = None,
        on_behind: Callable[[bool], None] | None = None,
    ) -> None:
        """`on_behind(failed)`: a reply said its shard fell behind (`failed`: the call
        failed, the shard may still be restarting); the owner calls `resync_behind` soon,
        on its own thread, under its lock."""
        self.publisher = publisher
        self.send_filter = send_filter
        self.on_behind = on_behind
        self.shards: list = []
        self.routes: RouteTable | None = None
        self._sent: list[tuple[int, object, Future]] = []  # (shard, ref kept alive, its future)

    @property
    def attached(self) -> bool:
        return self.routes is not None

    def attach(self, shards: list, routes: RouteTable) -> None:
        self.shards, self.routes = list(shards), routes
        self.publish()

    def publish(self, every_shard: bool = False) -> int:
        """Send what changed since the last call, one batch per shard (with `every_shard`,
        an empty one to shards with no news); returns batches sent."""
        if self.routes is None:
            return 0
        self.resync_behind()
        batches = list(self.publisher.drain_routed(self.routes, every_shard).items())
        sends = batches if self.send_filter is None else self.send_filter(batches)
        for shard, batch in sends:
            self._send(shard, self.shards[shard].apply.remote(batch.encode()))
        return len(batches)

    def resync_behind(self) -> None:
        """Snapshots to the shards whose replies so far say they fell behind."""
        behind, pending = set(), []
        for shard, ref, reply in self._sent:
            if not reply.done():
                pending.append((shard, ref, reply))
            elif reply.exception() is not None or reply.result() is ApplyResult.NEED_SNAPSHOT:
                behind.add(shard)  # a restarted shard has lost our events
        # Only the latest unanswered sends are kept (a hung shard answers none): a gap an
        # older one would have shown, a later batch to that shard shows too.
        self._sent = pending[-MAX_UNANSWERED:]
        if behind and self.routes is not None:
            snaps = self.publisher.snapshots(self.routes)
            for shard in behind:
                self._send(shard, self.shards[shard].load_snapshot.remote(snaps[shard].encode()))

    def reroute(self, routes: RouteTable) -> None:
        """New routes: every shard gets this node's snapshot of its part (shard state is soft).
        A node not attached yet (a restarted or new actor a rebalance reached first) ignores
        them: attaching brings it the current table and its shards together."""
        if not self.attached:
            return
        self.routes = routes
        self.publish()
        for shard, snap in self.publisher.snapshots(self.routes).items():
            self._send(shard, self.shards[shard].load_snapshot.remote(snap.encode()))

    def pending(self) -> list[Future]:
        return [reply for _, _, reply in self._sent if not reply.done()]

    def _send(self, shard: int, ref) -> None:
        reply = ref.future()
        self._sent.append((shard, ref, reply))
        if self.on_behind is not None:
            reply.add_done_callback(self._answered)

    def _answered(self, reply: Future) -> None:
        if reply.cancelled() or self.on_behind is None:
            return
        failed = reply.exception() is not None
        if failed or reply.result() is ApplyResult.NEED_SNAPSHOT:
            self.on_behind(failed)
