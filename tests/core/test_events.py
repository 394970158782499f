import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.index.events import EventBatch, EventError, PageMask, PageState, Snapshot
from kvfabric.core.index.events import decode as decode_events

K = b"k" * 16
P = b"p" * 16
GOOD = [1, "batch", "node-a", 3, 7, False, [[K, P, 0, int(PageMask.FULL_DEVICE)]], b"f" * 16]


def test_round_trip():
    batch = EventBatch(
        "node-a",
        3,
        7,
        (PageState(K, P, 0, 1), PageState(P, K, 1, 0)),
        cleared=True,
        fingerprint=b"f" * 16,
    )
    assert decode_events(batch.encode()) == batch
    snap = Snapshot("node-a", 3, 7, (PageState(K, P, 0, 5),), b"f" * 16)
    assert decode_events(snap.encode()) == snap


@pytest.mark.parametrize(
    "i,value",
    [
        (0, 2),
        (1, "gossip"),
        (2, ""),
        (2, 7),
        (3, -1),
        (4, True),
        (5, 1),
        (7, b"short"),
        (7, "fp"),
        (6, "pages"),
        (6, [[K, P, 0]]),
        (6, [[K[:8], P, 0, 1]]),
        (6, [[K, P, -1, 1]]),
        (6, [[K, P, 0, 64]]),
    ],
)
def test_each_bad_field_is_rejected(i, value):
    msg = list(GOOD)
    msg[i] = value
    with pytest.raises(EventError):
        decode_events(msgpack.packb(msg))


def test_snapshot_lists_held_pages_only_and_garbage_is_rejected():
    with pytest.raises(EventError, match="held pages"):
        decode_events(msgpack.packb([1, "snapshot", "n", 0, 0, True, [[K, P, 0, 0]], b""]))
    for junk in (
        b"",
        b"\xc1",
        msgpack.packb({"a": 1}),
        msgpack.packb(GOOD[:7]),
        msgpack.packb(GOOD) + b"x",
    ):
        with pytest.raises(EventError):
            decode_events(junk)


@given(st.binary(max_size=200))
def test_fuzzed_bytes_never_escape_as_other_errors(data):
    try:
        assert isinstance(decode_events(data), (EventBatch, Snapshot))
    except EventError:
        return


@given(
    st.lists(
        st.one_of(
            st.integers(-2, 20),
            st.text(max_size=3),
            st.booleans(),
            st.binary(max_size=17),
            st.lists(
                st.lists(
                    st.one_of(st.binary(min_size=16, max_size=16), st.integers(-1, 17)), max_size=5
                ),
                max_size=3,
            ),
        ),
        max_size=8,
    )
)
def test_fuzzed_messages_decode_or_fail_cleanly(msg):
    try:
        out = decode_events(msgpack.packb(msg))
    except EventError:
        return
    assert isinstance(out, (EventBatch, Snapshot))


def test_an_index_refuses_another_layouts_events():
    from kvfabric.core.index.match_rule import MatchRule
    from kvfabric.core.index.prefix_index import PrefixIndex

    index = PrefixIndex(MatchRule(0), fingerprint=b"f" * 16)
    foreign = EventBatch(
        "node-a", 1, 0, (PageState(K, P, 0, 1),), cleared=True, fingerprint=b"g" * 16
    )
    with pytest.raises(EventError, match="layout"):
        index.apply(foreign)
    with pytest.raises(EventError, match="layout"):
        index.load_snapshot(Snapshot("node-a", 1, 0, (PageState(K, P, 0, 1),), b"g" * 16))
    assert len(index) == 0 and index.nodes() == []
    own = EventBatch("node-a", 1, 0, (PageState(K, P, 0, 1),), cleared=True, fingerprint=b"f" * 16)
    assert index.apply(own).value == "applied" and len(index) == 1
