"""EngineEventFeed (deploy/vllm/events/event_feed.py) against vLLM's real ZmqEventPublisher (no
engine, no Ray): frames over ZMQ, a gap filled from the replay endpoint, a gap with no
replay forgets what the engine held, a bad frame is dropped, a stop says the engine
holds nothing. The sink applies the batches to a real in-process PrefixIndex."""

from __future__ import annotations

import time
import uuid

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")
import msgspec  # noqa: E402
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import PrefixIndex
from kvfabric.core.index.routes import RouteTable
from kvfabric.deploy.vllm.events.engine_pages import EnginePages  # noqa: E402
from kvfabric.deploy.vllm.events.event_feed import EngineEventFeed  # noqa: E402

from tests.deploy.vllm.events.test_engine_pages import GROUPS, LAYOUT, NODE, PS, vllm_hash  # noqa: E402

DEADLINE_S = 30.0


class IndexSink:
    """The feed's sink over one in-process index shard."""

    def __init__(self, pages: EnginePages) -> None:
        self.pages, self.routes = pages, RouteTable(1)
        self.index = PrefixIndex(MatchRule.of(LAYOUT), LAYOUT.fingerprint)

    def publish(self, every_shard: bool = False) -> int:
        batches = self.pages.drain_routed(self.routes, every_shard)
        for batch in batches.values():
            self.index.apply(batch)
        return len(batches)


def stored_batch(i: int) -> object:
    """Batch i: block 0 of prompt i, stored by every group."""
    tokens = [i] * PS
    h = vllm_hash(None, tuple(tokens))
    return kv_events.KVEventBatch(
        ts=time.time(),
        events=[
            kv_events.BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=tokens,
                block_size=PS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=g,
            )
            for g in range(len(GROUPS))
        ],
    )


def frame(batch: object, seq: int) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def publisher():
    base = f"ipc:///tmp/kvf-test-{uuid.uuid4().hex[:12]}"
    pub = kv_events.ZmqEventPublisher(
        0, endpoint=base, replay_endpoint=base + "-replay", buffer_steps=100
    )
    yield pub, base
    pub.shutdown()


def new_feed(endpoint: str, replay: str | None) -> tuple[EngineEventFeed, IndexSink]:
    pages = EnginePages(NODE, 1, LAYOUT, GROUPS)
    sink = IndexSink(pages)
    return EngineEventFeed(pages, sink, endpoint, replay, poll_s=0.02, replay_timeout_s=5.0), sink


def test_frames_over_zmq_reach_the_index_and_a_stop_clears_them(publisher) -> None:
    pub, base = publisher
    feed, sink = new_feed(base, base + "-replay")
    feed.start()
    try:
        # A SUB socket misses what was sent before it joined: the replay endpoint fills that in.
        for i in range(3):
            pub.publish(stored_batch(i))
        wait_for(lambda: len(pub._buffer) == 3, "the publisher to send")
        pub.publish(stored_batch(3))
        wait_for(lambda: len(sink.index.node_pages(NODE)) == 4, "four pages in the index")
        assert feed.stats.bad_frames == 0 and feed.stats.resets == 0
    finally:
        assert feed.stop()
    assert sink.index.node_pages(NODE) == {}


def test_a_gap_is_filled_from_the_replay_endpoint(publisher) -> None:
    pub, base = publisher
    for i in range(4):
        pub.publish(stored_batch(i))  # nobody subscribed: only the replay buffer has them
    wait_for(lambda: len(pub._buffer) == 4, "the publisher to buffer")
    feed, sink = new_feed(base, base + "-replay")
    assert feed.receive(frame(stored_batch(4), 4))
    sink.publish()
    assert (feed.stats.gaps, feed.stats.replayed, feed.stats.resets) == (1, 4, 0)
    assert len(sink.index.node_pages(NODE)) == 5
    assert not feed.receive(frame(stored_batch(2), 2))  # the live copy of a replayed batch
    assert feed.stats.duplicates == 1


def test_a_gap_without_replay_forgets_what_the_engine_held() -> None:
    feed, sink = new_feed("ipc:///tmp/kvf-unused", None)
    for seq in (0, 1):
        feed.receive(frame(stored_batch(seq), seq))
    sink.publish()
    assert len(sink.index.node_pages(NODE)) == 2
    feed.receive(frame(stored_batch(7), 3))  # batch 2 was lost
    sink.publish()
    assert feed.stats.resets == 1 and len(sink.index.node_pages(NODE)) == 1
    feed.receive(frame(stored_batch(8), 0))  # a restarted publisher starts again at 0
    sink.publish()
    assert feed.stats.resets == 2 and len(sink.index.node_pages(NODE)) == 1


@pytest.mark.parametrize(
    "bad",
    [
        [b"only one"],
        [b"", bytes(8), b"\xc1"],
        [b"", bytes(7), b"\x90"],
        [b"", bytes(8), msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0])],
    ],
)
def test_a_bad_frame_is_counted_and_dropped(bad: list[bytes]) -> None:
    feed, sink = new_feed("ipc:///tmp/kvf-unused", None)
    feed.receive(frame(stored_batch(0), 0))
    assert not feed.receive(bad)
    sink.publish()
    assert (
        feed.stats.bad_frames == 1 and feed.expected == 1 and len(sink.index.node_pages(NODE)) == 1
    )
