"""EngineEventFeed: reads a vLLM engine's KV-event socket and keeps the index told.

A background thread subscribes to the engine's ZMQ publisher, decodes each frame
(event_wire.py), applies it to the engine's pages (engine_pages.py) and publishes the
changes through its sink (index_sink.py), every wait bounded by `poll_s`. A bad frame
is logged, counted and dropped.

Sequence numbers: vLLM numbers its batches 0, 1, 2...; a SUB socket loses what was
sent before it connected or beyond its high-water mark. On a gap the feed asks the
engine's replay endpoint (if configured) for the missing batches; if it has none, or
they no longer all are in its buffer, or it does not answer in `replay_timeout_s`,
the feed forgets what the engine holds (a restatement: the index drops the engine's
pages) and goes on from the batch at hand: a page it then does not know costs a miss,
never a wrong hit. A number below the expected one is a duplicate of a replayed batch
(dropped), or a restarted publisher (the same: forget, go on). A clean stop publishes
that the engine holds nothing."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import zmq

from .engine_pages import EnginePages
from .event_wire import END_SEQ, SEQ_BYTES, KVEventError, KVEventFrame, decode_frame

log = logging.getLogger(__name__)


class Sink(Protocol):
    def publish(self, every_shard: bool = False) -> int: ...


@dataclass
class FeedStats:
    frames: int = 0
    bad_frames: int = 0
    gaps: int = 0
    replayed: int = 0
    resets: int = 0
    duplicates: int = 0
    publish_errors: int = 0


class EngineEventFeed:
    def __init__(
        self,
        pages: EnginePages,
        sink: Sink,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        poll_s: float = 0.05,
        replay_timeout_s: float = 2.0,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.pages, self.sink = pages, sink
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.poll_s, self.replay_timeout_s, self.heartbeat_s = poll_s, replay_timeout_s, heartbeat_s
        self.expected = 0  # the next vLLM seq the pages are waiting for
        self.replayed_from: int | None = None
        self.stats = FeedStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("already started")
        sub = self._ctx.socket(zmq.SUB)  # made here, used only by the thread
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        self._thread = threading.Thread(
            target=self._run, args=(sub,), daemon=True, name=f"kv-events {self.pages.node}"
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop reading, publish that the engine holds nothing; whether the thread ended."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self, sub: zmq.Socket) -> None:
        beat = time.monotonic()
        try:
            while not self._stop.is_set():
                changed = False
                if sub.poll(int(self.poll_s * 1000)):
                    changed = self.receive(sub.recv_multipart(zmq.NOBLOCK))
                    while sub.poll(0) and not self._stop.is_set():  # drain a burst, publish once
                        changed = self.receive(sub.recv_multipart(zmq.NOBLOCK)) or changed
                heartbeat = time.monotonic() - beat >= self.heartbeat_s
                if changed or heartbeat:
                    beat = time.monotonic() if heartbeat else beat
                    self._publish(every_shard=heartbeat)
            self.pages.clear()
            self._publish(every_shard=True)
        finally:
            sub.close(linger=0)

    def _publish(self, every_shard: bool) -> None:
        try:
            self.sink.publish(every_shard)
        except Exception as e:  # the index is soft state: the next publish or snapshot catches up
            self.stats.publish_errors += 1
            log.warning("publishing %s's KV events failed: %r", self.pages.node, e)

    def receive(self, parts: list[bytes]) -> bool:
        """One frame from the socket; whether the pages changed."""
        try:
            frame = decode_frame(parts)
        except KVEventError as e:
            self.stats.bad_frames += 1
            log.warning("dropped a bad KV-event frame from %s: %s", self.endpoint, e)
            return False
        self.stats.frames += 1
        if frame.seq < self.expected:
            if self.replayed_from is not None and frame.seq >= self.replayed_from:
                self.stats.duplicates += 1  # already had it from the replay
                return False
            self._reset(frame.seq)  # the publisher restarted
        elif frame.seq > self.expected:
            self.stats.gaps += 1
            missed = self._replay(self.expected, frame.seq)
            if missed is None:
                self._reset(frame.seq)
            else:
                for f in missed:
                    self.pages.apply(f.events)
                self.stats.replayed += len(missed)
                self.replayed_from = self.expected
        self.pages.apply(frame.events)
        self.expected = frame.seq + 1
        return True

    def _reset(self, seq: int) -> None:
        self.stats.resets += 1
        log.warning(
            "%s: KV events before seq %d are lost: forgetting what the engine held",
            self.pages.node,
            seq,
        )
        self.pages.clear()
        self.replayed_from = None

    def _replay(self, start: int, stop: int) -> list[KVEventFrame] | None:
        """Batches [start, stop) from the engine's replay endpoint, or None if not all came."""
        if self.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[KVEventFrame] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                if not sock.poll(int(min(left, self.poll_s) * 1000) + 1):
                    continue
                parts = sock.recv_multipart(zmq.NOBLOCK)
                if len(parts) == 4 and parts[2] == END_SEQ:
                    break
                frame = decode_frame(parts[1:])
                if start <= frame.seq < stop:
                    got.append(frame)
        except (KVEventError, zmq.ZMQError) as e:
            self.stats.bad_frames += 1
            log.warning("replay from %s failed: %s", self.replay_endpoint, e)
            return None
        finally:
            sock.close(linger=0)
        got.sort(key=lambda f: f.seq)
        if [f.seq for f in got] != list(range(start, stop)):
            return None
        return got
