"""IndexLink: what a node actor sends the index shards, and what it learns back.

Batches go out under the node's route table without waiting; a shard that saw a
gap answers need_snapshot (a restarted shard answers nothing: its call failed)
and gets this node's snapshot of its part at the next publish, or as soon as its
owner acts on `on_behind` (called, from whatever thread completes the reply, when
one says so). Replies are read from their futures once they are done: nothing
here waits on a shard."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

from kvfabric.core.index.events import EventBatch
from kvfabric.core.index.prefix_index import ApplyResult
from kvfabric.core.index.publisher import ShardPublisher
from kvfabric.core.index.routes import RouteTable

MAX_UNANSWERED = 4096  # event sends a node remembers until their shard answers
CONFIRM_AFTER_S = 0.25  # batches out: every shard hears where the sequence is this much later
RESYNC_AFTER_FAILURE_S = 0.5  # a failed send's snapshot is resent this much later

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
        self.unconfirmed = False  # batches went out since every shard last heard the sequence
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
        self.unconfirmed = not every_shard and (self.unconfirmed or bool(batches))
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


class LinkPacer:
    """Runs an attached IndexLink's follow-ups on its owner's event loop, under the
    owner's lock, so the index catches up in a round trip, not a heartbeat: a snapshot
    as soon as a reply says a shard fell behind (a moment later after a failed call:
    the shard may still be restarting), and CONFIRM_AFTER_S after batches went out, a
    mark of the sequence to every shard (so a lost last batch shows as a gap then)."""

    def __init__(self, link: IndexLink, lock: threading.Lock) -> None:
        self.link, self.lock = link, lock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._confirming: asyncio.Task | None = None
        self._retry_due = False  # a resend after a failed call is scheduled

    def start(self) -> None:
        """On the owner's loop: follow up from now on (again after stop)."""
        self._loop = asyncio.get_running_loop()
        self.link.on_behind = self._behind
        if self._confirming is None or self._confirming.done():
            self._confirming = self._loop.create_task(self._confirm())

    def stop(self) -> None:
        self.link.on_behind = None
        if self._confirming is not None:
            self._confirming.cancel()

    def _behind(self, failed: bool) -> None:
        """From whatever thread completed the reply."""
        loop = self._loop
        if loop is None:
            return
        try:
            if not failed:
                loop.call_soon_threadsafe(self._catch_up)
            elif not self._retry_due:
                self._retry_due = True  # however many calls failed: one resend
                loop.call_soon_threadsafe(loop.call_later, RESYNC_AFTER_FAILURE_S, self._catch_up)
        except RuntimeError:
            pass  # the loop is closed: the owner is ending

    def _catch_up(self) -> None:
        self._retry_due = False
        with self.lock:
            self.link.resync_behind()

    async def _confirm(self) -> None:
        while True:
            await asyncio.sleep(CONFIRM_AFTER_S)
            if self.link.unconfirmed:
                with self.lock:
                    self.link.publish(every_shard=True)
