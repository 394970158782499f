"""The decoder of vLLM's KV-event frames (deploy/vllm/events/event_wire.py), fuzzed as the
other decoders are (tests/actors/test_fuzz_events.py): valid frames are built by vLLM's own
msgspec classes and encoder, so the decoder is checked against the real format; random
bytes, bit-flipped frames and structures with one field replaced, deleted or added
must decode to exactly what an oracle written from the format says, or raise
KVEventError and nothing else."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

vllm_events = pytest.importorskip("vllm.distributed.kv_events")
import msgspec  # noqa: E402
from kvfabric.deploy.vllm.events.event_wire import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    KVEventFrame,
    decode_frame,
)

from tests.fuzzing import NEAR, RANDOM, flipped, fuzz, mutated  # noqa: E402

pytestmark = pytest.mark.fuzz

HASH = (
    st.binary(min_size=32, max_size=32)
    | st.binary(min_size=16, max_size=16)
    | st.integers(0, 2**64 - 1)
)
TEXT = (
    st.none()
    | st.sampled_from(["GPU", "CPU", "full_attention", "sliding_window"])
    | st.text(max_size=5)
)
EXTRA = st.none() | st.lists(
    st.text(max_size=4)
    | st.binary(max_size=4)
    | st.tuples(st.text(max_size=3), st.integers(0, 99)),
    max_size=3,
).map(tuple)


@st.composite
def stored(draw: st.DrawFn) -> Any:
    size = draw(st.integers(1, 4))
    hashes = draw(st.lists(HASH, max_size=3))
    blocks = len(hashes) + draw(st.sampled_from([0, 0, 1, 2]))  # a window group skips blocks
    return vllm_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | HASH),
        token_ids=draw(
            st.lists(st.integers(0, 2**31 - 1), min_size=size * blocks, max_size=size * blocks)
        ),
        block_size=size,
        lora_id=draw(st.none() | st.integers(0, 9)),
        medium=draw(TEXT),
        lora_name=draw(TEXT),
        extra_keys=draw(st.none() | st.lists(EXTRA, min_size=len(hashes), max_size=len(hashes))),
        group_idx=draw(st.none() | st.integers(0, 5)),
        kv_cache_spec_kind=draw(TEXT),
        kv_cache_spec_sliding_window=draw(st.none() | st.integers(1, 512)),
        locality=draw(TEXT),
        ownership=draw(TEXT),
        session_id=draw(TEXT),
    )


REMOVED = st.builds(
    vllm_events.BlockRemoved,
    block_hashes=st.lists(HASH, max_size=3),
    medium=TEXT,
    group_idx=st.none() | st.integers(0, 5),
    locality=TEXT,
    ownership=TEXT,
)
EVENTS = st.lists(stored() | REMOVED | st.just(vllm_events.AllBlocksCleared()), max_size=4)
BATCHES = st.builds(
    vllm_events.KVEventBatch,
    ts=st.floats(0, 2e9),
    events=EVENTS,
    data_parallel_rank=st.none() | st.integers(0, 7),
)
SEQ = st.integers(0, 2**63 - 1)


def frame_of(batch: Any, seq: int, topic: bytes = b"kv") -> list[bytes]:
    """What ZmqEventPublisher sends for `batch` as batch number `seq`."""
    return [topic, seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]


def _hash(h: Any) -> bytes:
    return h.to_bytes(8, "big") if isinstance(h, int) else h


def expected(batch: Any, seq: int, topic: bytes = b"kv") -> KVEventFrame:
    """The frame as our dataclasses, written field by field from vLLM's object."""
    out = []
    for e in batch.events:
        if isinstance(e, vllm_events.BlockStored):
            extra = (
                None
                if e.extra_keys is None
                else tuple(None if k is None else tuple(k) for k in e.extra_keys)
            )
            out.append(
                BlockStored(
                    tuple(map(_hash, e.block_hashes)),
                    None if e.parent_block_hash is None else _hash(e.parent_block_hash),
                    tuple(e.token_ids),
                    e.block_size,
                    e.medium,
                    e.group_idx,
                    e.kv_cache_spec_kind,
                    e.kv_cache_spec_sliding_window,
                    e.lora_id,
                    e.lora_name,
                    extra,
                )
            )
        elif isinstance(e, vllm_events.BlockRemoved):
            out.append(BlockRemoved(tuple(map(_hash, e.block_hashes)), e.medium, e.group_idx))
        else:
            out.append(AllBlocksCleared())
    return KVEventFrame(topic, seq, batch.ts, tuple(out), batch.data_parallel_rank)


@fuzz
@given(BATCHES, SEQ)
def test_vllm_frames_decode_exactly(batch: Any, seq: int) -> None:
    assert decode_frame(frame_of(batch, seq)) == expected(batch, seq)


# --- the oracle: the format as vLLM 0.32 writes it -------------------------------------------
def _uint(x: object) -> bool:
    return type(x) is int and x >= 0


def _text(x: object) -> bool:
    return x is None or type(x) is str and len(x) <= 1024


def _hash_ok(h: object) -> bool:
    return type(h) is bytes and len(h) in (16, 32) or type(h) is int and 0 <= h < 2**64


def _extra_ok(k: object) -> bool:
    return (
        k is None
        or type(k) is list
        and len(k) <= 64
        and all(
            type(v) in (str, bytes)
            and len(v) <= 1024
            or type(v) is list
            and len(v) == 2
            and type(v[0]) is str
            and len(v[0]) <= 1024
            and _uint(v[1])
            for v in k
        )
    )


STORED_REQ = {
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}
STORED_OPT = {
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
}


def event_ok(e: object) -> bool:
    if type(e) is not dict:
        return False
    kind, names = e.get("type"), set(e) - {"type"}
    common = all(_text(e.get(n)) for n in ("locality", "ownership", "session_id"))
    hashes = e.get("block_hashes")
    hashes_ok = type(hashes) is list and len(hashes) <= 1 << 16 and all(map(_hash_ok, hashes))
    group_ok = e.get("group_idx") is None or _uint(e.get("group_idx"))
    if kind == "AllBlocksCleared":
        return not names
    if kind == "BlockRemoved":
        return (
            {"block_hashes", "medium"}
            <= names
            <= {"block_hashes", "medium", "group_idx", "locality", "ownership"}
            and common
            and hashes_ok
            and _text(e["medium"])
            and group_ok
        )
    if kind != "BlockStored" or not STORED_REQ <= names <= STORED_REQ | STORED_OPT or not hashes_ok:
        return False
    size, tokens, extra, window = (
        e["block_size"],
        e["token_ids"],
        e.get("extra_keys"),
        e.get("kv_cache_spec_sliding_window"),
    )
    return (
        common
        and group_ok
        and _uint(size)
        and 0 < size <= 1 << 16
        and type(tokens) is list
        and len(tokens) % size == 0
        and size * len(hashes) <= len(tokens) <= size << 16
        and all(type(t) is int and 0 <= t < 2**31 for t in tokens)
        and (e["parent_block_hash"] is None or _hash_ok(e["parent_block_hash"]))
        and (e["lora_id"] is None or _uint(e["lora_id"]))
        and _text(e["medium"])
        and _text(e["lora_name"])
        and _text(e.get("kv_cache_spec_kind"))
        and (window is None or _uint(window) and window > 0)
        and (
            extra is None
            or type(extra) is list
            and len(extra) == len(hashes)
            and all(map(_extra_ok, extra))
        )
    )


def batch_ok(m: object) -> bool:
    return (
        type(m) is list
        and len(m) in (2, 3)
        and type(m[0]) in (int, float)
        and math.isfinite(m[0])
        and (len(m) == 2 or m[2] is None or _uint(m[2]))
        and type(m[1]) is list
        and all(map(event_ok, m[1]))
    )


def _decode_or_reject(parts: Any) -> KVEventFrame | None:
    try:
        return decode_frame(parts)
    except KVEventError:
        return None


@fuzz
@given(
    st.binary(max_size=300)
    | st.tuples(BATCHES, SEQ).map(lambda b: frame_of(*b)[2]).flatmap(flipped)
)
def test_payload_bytes_decode_or_raise_kv_event_error(payload: bytes) -> None:
    out = _decode_or_reject([b"", bytes(8), payload])
    if out is not None:
        assert batch_ok(msgpack.unpackb(payload, strict_map_key=True))


def _typed(old: Any) -> st.SearchStrategy:
    """Values of other types at each field, and near-valid ones of its own type."""
    if isinstance(old, bytes):
        return st.binary(min_size=15, max_size=33) | NEAR
    if isinstance(old, int) and not isinstance(old, bool):
        return st.sampled_from([-1, 0, 2**31, 2**64 - 1, 1 << 16, (1 << 16) + 1]) | NEAR
    return NEAR | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"])


WIRES = st.tuples(BATCHES, SEQ).map(lambda b: msgpack.unpackb(frame_of(*b)[2], strict_map_key=True))


@fuzz
@given(
    st.one_of(
        RANDOM,
        WIRES.flatmap(
            lambda w: mutated(
                w, _typed, new_keys=st.sampled_from(sorted(STORED_REQ | STORED_OPT) + ["type", "x"])
            )
        ),
    )
)
def test_structures_are_accepted_iff_valid(wire: Any) -> None:
    try:
        payload = msgpack.packb(wire)
    except (TypeError, ValueError, OverflowError):
        return  # not encodable: never on the wire
    out = _decode_or_reject([b"", bytes(8), payload])
    event("accepted" if out else "rejected")
    assert (out is not None) == batch_ok(wire), wire


@fuzz
@given(st.lists(st.binary(max_size=12) | NEAR, max_size=4), BATCHES)
def test_bad_envelopes_raise_kv_event_error(parts: list, batch: Any) -> None:
    good = frame_of(batch, 1)
    for bad in (
        parts,
        good[:2],
        good + [b""],
        [good[0], good[1][:7], good[2]],
        [b"x" * 1025, good[1], good[2]],
        [good[0], b"\xff" * 8, good[2]],
        [good[0], good[1], bytearray(good[2])],
    ):
        with pytest.raises(KVEventError):
            decode_frame(bad)


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 0),
        ("block_size", True),
        ("token_ids", [1]),
        ("token_ids", [1, 2, 3]),
        ("token_ids", []),
        ("block_hashes", [b"x" * 31]),
        ("block_hashes", b"x" * 32),
        ("parent_block_hash", -1),
        ("group_idx", -1),
        ("kv_cache_spec_sliding_window", 0),
        ("extra_keys", [[1.5]]),
        ("medium", 7),
        ("lora_id", "a"),
        ("unknown_field", 1),
    ],
)
def test_each_bad_stored_field_is_refused(field: str, value: Any) -> None:
    wire = [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"h" * 32],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ],
        0,
    ]
    assert decode_frame([b"", bytes(8), msgpack.packb(wire)]).events[0].block_size == 2
    wire[1][0][field] = value
    with pytest.raises(KVEventError):
        decode_frame([b"", bytes(8), msgpack.packb(wire)])
