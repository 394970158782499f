"""Fuzzing the decoders of wire messages (issue #6), part one: KV events and snapshots,
and the index shard fed them. Export replies and route tables: tests/core/test_fuzz_exchange.py.
Trace files and configs: tests/deploy/test_fuzz_files.py. (HTTP bodies:
tests/deploy/test_openai_refusals.py.)

How the decoders are fuzzed, and the `fuzz` mark: tests/fuzzing.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from kvfabric.actors.index_shard import IndexShardActor
from kvfabric.core.index.events import EventBatch, EventError, PageMask, PageState, Snapshot
from kvfabric.core.index.events import decode as decode_events
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import ApplyResult, PrefixIndex

from tests.fuzzing import FP, KEY, NEAR, RANDOM, U64, _uint, flipped, fuzz, mutated, typed

pytestmark = pytest.mark.fuzz


# --- KV events and snapshots ---------------------------------------------------------------
def event_wire(m: EventBatch | Snapshot) -> list:
    kind, cleared = ("batch", m.cleared) if isinstance(m, EventBatch) else ("snapshot", True)
    return [
        1,
        kind,
        m.node,
        m.epoch,
        m.seq,
        cleared,
        [[p.key, p.parent, p.depth, p.mask] for p in m.pages],
        m.fingerprint,
    ]


MAX_MASK = int(PageMask.FULL | PageMask.SWA)  # every pool's every tier, disk included


def event_ok(m: object) -> bool:
    """The events format: [1, kind, node, epoch, seq, cleared, pages, fingerprint]."""
    if not (type(m) is list and len(m) == 8):
        return False
    v, kind, node, epoch, seq, cleared, pages, fp = m
    snap = kind == "snapshot"
    return (
        type(v) is int
        and v == 1
        and type(kind) is str
        and kind in ("batch", "snapshot")
        and type(node) is str
        and 1 <= len(node) <= 256
        and _uint(epoch)
        and _uint(seq)
        and type(cleared) is bool
        and (cleared or not snap)
        and type(fp) is bytes
        and len(fp) in (0, 16)
        and type(pages) is list
        and all(
            type(p) is list
            and len(p) == 4
            and all(type(k) is bytes and len(k) == 16 for k in p[:2])
            and _uint(p[2])
            and _uint(p[3])
            and (1 if snap else 0) <= p[3] <= MAX_MASK
            for p in pages
        )
    )


def pages(min_mask: int = 0) -> st.SearchStrategy[tuple[PageState, ...]]:
    page = st.builds(PageState, KEY, KEY, U64, st.integers(min_mask, MAX_MASK))
    return st.lists(page, max_size=6).map(tuple)


NODE = st.text(min_size=1, max_size=256)
FINGERPRINT = st.sampled_from([b"", FP]) | KEY
BATCHES = st.builds(EventBatch, NODE, U64, U64, pages(), st.booleans(), FINGERPRINT)
SNAPSHOTS = st.builds(Snapshot, NODE, U64, U64, pages(1), FINGERPRINT)
MESSAGES = BATCHES | SNAPSHOTS


@fuzz
@given(MESSAGES)
def test_events_round_trip_exactly(msg: EventBatch | Snapshot) -> None:
    assert decode_events(msg.encode()) == msg
    assert decode_events(msg.encode()).encode() == msg.encode()


def _decode_event_or_reject(data: bytes) -> EventBatch | Snapshot | None:
    try:
        out = decode_events(data)
    except EventError:
        return None
    assert decode_events(out.encode()) == out  # whatever passes is a well-formed message
    return out


@fuzz
@given(st.binary(max_size=300) | MESSAGES.map(lambda m: m.encode()).flatmap(flipped))
def test_event_bytes_decode_or_raise_event_error(data: bytes) -> None:
    _decode_event_or_reject(data)


@fuzz
@given(st.one_of(RANDOM, MESSAGES.map(event_wire).flatmap(mutated)))
def test_event_structures_are_accepted_iff_valid(wire: Any) -> None:
    out = _decode_event_or_reject(msgpack.packb(wire))
    event("accepted" if out else "rejected")
    assert (out is not None) == event_ok(wire), wire
    if out is not None:
        assert event_wire(out) == wire


# The index shard (in process, without Ray) fed encoded messages: a rejection changes nothing.
A_KEYS = [bytes([1, i]) * 8 for i in range(4)]
B_KEYS = [bytes([2, i]) * 8 for i in range(4)]
ROOT = b"R" * 16


def _chain(keys: list[bytes], mask: int) -> tuple[PageState, ...]:
    return tuple(PageState(k, keys[i - 1] if i else ROOT, i, mask) for i, k in enumerate(keys))


def loaded_shard() -> Any:
    shard = IndexShardActor.__ray_actor_class__(0, 1, MatchRule(2), FP)
    assert (
        shard.apply(EventBatch("a", 1, 0, _chain(A_KEYS, 1), fingerprint=FP).encode()) == "applied"
    )
    assert (
        shard.apply(EventBatch("b", 1, 0, _chain(B_KEYS[:3], 5), fingerprint=FP).encode())
        == "applied"
    )
    return shard


def index_state(index: PrefixIndex) -> tuple:
    return (
        index.stats(),
        {n: (index.node_pages(n), index.sync_point(n)) for n in index.nodes()},
        index.lookup(A_KEYS),
        index.lookup(B_KEYS),
        [index.page_meta(k) for k in A_KEYS + B_KEYS],
    )


def shard_state(shard: Any) -> tuple:
    """All but the count of rejections."""
    return index_state(shard.index), shard.lookups, shard.load.lookups, dict(shard.load.regions)


# What a shard may be sent next: a's next batch, b's snapshot, a new node's first batch.
NEXT = [
    EventBatch("a", 1, 1, _chain(A_KEYS[:2], 3), fingerprint=FP),
    Snapshot("b", 1, 1, _chain(B_KEYS, 5), FP),
    EventBatch("c", 0, 0, _chain(B_KEYS[:2], 1), cleared=True, fingerprint=FP),
]


@fuzz
@given(
    st.sampled_from(NEXT).flatmap(
        lambda m: st.tuples(
            st.just(m),
            st.one_of(
                flipped(m.encode()),
                st.one_of(
                    mutated(event_wire(m)), mutated(event_wire(m), typed, ops=("replace",))
                ).map(msgpack.packb),
            ),
        )
    )
)
def test_index_shard_rejections_change_nothing(case: tuple[EventBatch | Snapshot, bytes]) -> None:
    msg, data = case
    shard = loaded_shard()
    before = shard_state(shard)
    answer = (shard.apply if isinstance(msg, EventBatch) else shard.load_snapshot)(data)
    event(answer)
    out = _decode_event_or_reject(data)
    if out is None or type(out) is not type(msg) or out.fingerprint != FP:
        assert answer == "rejected"  # of another layout (or none): refused too
    if answer == "rejected":
        assert shard_state(shard) == before and shard.rejected == 1
    else:
        assert answer in {r.value for r in ApplyResult}


def with_page_field(
    m: EventBatch | Snapshot, i: int, field: str, value: object
) -> EventBatch | Snapshot:
    """`m` of this layout, with one field of page i (mod the page count) set to `value`."""
    ps = list(m.pages)
    i %= len(ps)
    ps[i] = dataclasses.replace(ps[i], **{field: value})
    return dataclasses.replace(m, pages=tuple(ps), fingerprint=FP)


@fuzz
@given(
    st.one_of(
        MESSAGES,
        st.builds(
            with_page_field,
            MESSAGES.filter(lambda m: m.pages),
            st.integers(0, 5),
            st.sampled_from(["key", "parent", "depth", "mask"]),
            NEAR,
        ),
    )
)
def test_prefix_index_checks_messages_built_in_process(msg: EventBatch | Snapshot) -> None:
    """PrefixIndex.apply/load_snapshot take objects, not bytes: they check them again."""
    index = loaded_shard().index
    before = index_state(index)
    valid = event_ok(event_wire(msg)) and msg.fingerprint == FP
    try:
        (index.apply if isinstance(msg, EventBatch) else index.load_snapshot)(msg)
    except EventError:
        assert not valid and index_state(index) == before
        return
    assert valid


@fuzz
@given(
    st.binary(max_size=80) | st.lists(st.sampled_from(A_KEYS + B_KEYS), max_size=5).map(b"".join),
    st.integers(-2, 2) | NEAR,
    st.integers(-2, 6) | NEAR,
)
def test_index_shard_lookup_checks_its_arguments(
    keys: bytes, route_version: Any, depth: Any
) -> None:
    shard = loaded_shard()
    before = shard_state(shard)
    try:
        found = shard.lookup(keys, route_version, depth)
    except ValueError:
        assert shard_state(shard) == before
        return
    assert type(route_version) is int and type(depth) is int
    assert found is None or all(isinstance(n, str) and type(p) is int for n, p, _ in found)
