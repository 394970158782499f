"""vLLM's KV-event frames, decoded strictly into our own frozen dataclasses.

A vLLM engine started with `kv_events_config` publishes on ZMQ multipart frames
`(topic, seq, payload)`: `seq` 8 bytes big-endian, `payload` msgpack of a KVEventBatch
`[ts, events, data_parallel_rank]` (an array; the rank may be left out), each event a
map tagged by its "type": BlockStored, BlockRemoved or AllBlocksCleared (fields as in
vllm/distributed/kv_events.py of vLLM 0.32; fields left at their default may be absent).

Everything is checked before anything is returned; any fault raises KVEventError and
nothing else. Unknown fields are refused too: a field this decoder does not know may
change what a block hash means (a new hash input), and a guess would publish wrong keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, TypeGuard

from kvfabric.core.wire import unpack

MAX_BLOCKS_PER_EVENT = 1 << 16
MAX_EVENTS_PER_BATCH = 1 << 16
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKEN_ID = 2**31 - 1  # the fabric's keyer packs token ids as int32
MAX_TEXT = 1024  # topic, medium, LoRA name, kind and other short strings
MAX_EXTRA_KEYS = 64  # per block
HASH_BYTES = (16, 32)  # xxh3-128, sha256 (sha256_cbor); int hashes are 64-bit
INT_HASH_BYTES = 8
SEQ_BYTES = 8
END_SEQ = b"\xff" * SEQ_BYTES  # the replay stream's end marker (seq -1, empty payload)


class KVEventError(ValueError):
    """A frame that is not a well-formed vLLM KV-event batch; nothing of it is used."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]  # int hashes as 8 bytes big-endian
    parent_hash: bytes | None
    # The tokens of the block range stored, block_size per block: one block per hash,
    # unless the group skipped blocks of the range (a sliding window's out-of-window ones).
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    group: int | None
    spec_kind: str | None
    sliding_window: int | None
    lora_id: int | None
    lora_name: str | None
    # Per block: the untagged hash inputs besides tokens (LoRA name, multimodal pairs,
    # cache_salt, prompt-embeds digests); None for a block with none.
    extra_keys: tuple[tuple[object, ...] | None, ...] | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str | None
    group: int | None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped every block: it carries nothing else."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventFrame:
    topic: bytes
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None


def decode_frame(parts: Sequence[bytes]) -> KVEventFrame:
    """One ZMQ multipart message `(topic, seq, payload)`; raises KVEventError."""
    if (
        not isinstance(parts, (list, tuple))
        or len(parts) != 3
        or not all(type(p) is bytes for p in parts)
    ):
        raise KVEventError("a KV-event frame is three byte strings: topic, seq, payload")
    topic, seq, payload = parts
    if len(topic) > MAX_TEXT:
        raise KVEventError(f"topic longer than {MAX_TEXT} bytes")
    if len(seq) != SEQ_BYTES or seq == END_SEQ:
        raise KVEventError(f"seq must be {SEQ_BYTES} bytes (not the end marker)")
    ts, events, rank = _batch(unpack(payload, KVEventError, "KV-event batch"))
    return KVEventFrame(topic, int.from_bytes(seq, "big"), ts, events, rank)


def _batch(msg: object) -> tuple[float, tuple[KVEvent, ...], int | None]:
    if type(msg) is not list or len(msg) not in (2, 3):
        raise KVEventError("a KV-event batch is [ts, events, data_parallel_rank]")
    ts, events = msg[0], msg[1]
    rank = msg[2] if len(msg) == 3 else None
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise KVEventError(f"ts must be a finite number, got {ts!r}")
    if rank is not None and not _uint(rank):
        raise KVEventError(f"data_parallel_rank must be an int >= 0 or nil, got {rank!r}")
    if type(events) is not list or len(events) > MAX_EVENTS_PER_BATCH:
        raise KVEventError(f"events must be a list of at most {MAX_EVENTS_PER_BATCH}")
    return float(ts), tuple(_event(e, i) for i, e in enumerate(events)), rank


# Per event type: required fields, then optional ones (vLLM omits those at their default).
_STORED_REQUIRED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_STORED_OPTIONAL = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
_REMOVED_REQUIRED = ("block_hashes", "medium")
_REMOVED_OPTIONAL = ("group_idx", "locality", "ownership")


def _event(e: object, i: int) -> KVEvent:
    if type(e) is not dict:
        raise KVEventError(f"event {i}: not a map")
    kind = e.get("type")
    if kind == "BlockStored":
        _fields(e, i, _STORED_REQUIRED, _STORED_OPTIONAL)
        return _stored(e, i)
    if kind == "BlockRemoved":
        _fields(e, i, _REMOVED_REQUIRED, _REMOVED_OPTIONAL)
        return BlockRemoved(
            _hashes(e["block_hashes"], i),
            _text(e["medium"], i, "medium"),
            _opt_uint(e.get("group_idx"), i, "group_idx"),
        )
    if kind == "AllBlocksCleared":
        _fields(e, i, (), ())
        return AllBlocksCleared()
    raise KVEventError(f"event {i}: unknown type {kind!r}")


def _fields(e: dict, i: int, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    names = set(e) - {"type"}
    missing = set(required) - names
    unknown = names - set(required) - set(optional)
    if missing or unknown:
        raise KVEventError(
            f"event {i} ({e['type']}): missing {sorted(missing)}, unknown "
            f"{sorted(map(str, unknown))}"
        )
    for name in ("locality", "ownership", "session_id"):
        _text(e.get(name), i, name)


def _stored(e: dict, i: int) -> BlockStored:
    hashes = _hashes(e["block_hashes"], i)
    parent = e["parent_block_hash"]
    parent = None if parent is None else _hash(parent, i)
    size = e["block_size"]
    if not _uint(size) or not 0 < size <= MAX_BLOCK_SIZE:
        raise KVEventError(
            f"event {i}: block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {size!r}"
        )
    tokens = e["token_ids"]
    # The tokens of the event's whole block range: a sliding-window group lists the hashes
    # of its in-window blocks only, with the tokens (and parent) of the whole range.
    if (
        type(tokens) is not list
        or len(tokens) % size
        or len(tokens) < size * len(hashes)
        or len(tokens) > size * MAX_BLOCKS_PER_EVENT
    ):
        raise KVEventError(
            f"event {i}: token_ids must be whole blocks, at least one per block hash"
        )
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise KVEventError(f"event {i}: token ids must be ints in [0, {MAX_TOKEN_ID}]")
    window = e.get("kv_cache_spec_sliding_window")
    if window is not None and (not _uint(window) or window == 0):
        raise KVEventError(f"event {i}: kv_cache_spec_sliding_window must be an int > 0 or nil")
    lora_id = e["lora_id"]
    if lora_id is not None and not _uint(lora_id):
        raise KVEventError(f"event {i}: lora_id must be an int >= 0 or nil")
    return BlockStored(
        hashes,
        parent,
        tuple(tokens),
        size,
        _text(e["medium"], i, "medium"),
        _opt_uint(e.get("group_idx"), i, "group_idx"),
        _text(e.get("kv_cache_spec_kind"), i, "kv_cache_spec_kind"),
        window,
        lora_id,
        _text(e["lora_name"], i, "lora_name"),
        _extra_keys(e.get("extra_keys"), len(hashes), i),
    )


def _hashes(x: object, i: int) -> tuple[bytes, ...]:
    # May be empty: a sliding-window group whose new blocks all fell out of its window
    # still sends its BlockStored.
    if type(x) is not list or len(x) > MAX_BLOCKS_PER_EVENT:
        raise KVEventError(
            f"event {i}: block_hashes must be a list of at most {MAX_BLOCKS_PER_EVENT}"
        )
    return tuple(_hash(h, i) for h in x)


def _hash(h: object, i: int) -> bytes:
    if type(h) is bytes and len(h) in HASH_BYTES:
        return h
    if type(h) is int and 0 <= h < 1 << 64:
        return h.to_bytes(INT_HASH_BYTES, "big")
    raise KVEventError(
        f"event {i}: a block hash is {' or '.join(map(str, HASH_BYTES))} bytes or a 64-bit int"
    )


def _extra_keys(x: object, blocks: int, i: int) -> tuple[tuple[object, ...] | None, ...] | None:
    if x is None:
        return None
    if type(x) is not list or len(x) != blocks:
        raise KVEventError(f"event {i}: extra_keys must list one entry per block")
    return tuple(None if k is None else _block_keys(k, i) for k in x)


def _block_keys(k: object, i: int) -> tuple[object, ...]:
    if type(k) is not list or len(k) > MAX_EXTRA_KEYS:
        raise KVEventError(
            f"event {i}: a block's extra keys are a list of at most {MAX_EXTRA_KEYS}"
        )
    out: list[object] = []
    for v in k:
        if type(v) is str and len(v) <= MAX_TEXT or type(v) is bytes and len(v) <= MAX_TEXT:
            out.append(v)
        elif (
            type(v) is list
            and len(v) == 2
            and type(v[0]) is str
            and len(v[0]) <= MAX_TEXT
            and type(v[1]) is int
            and v[1] >= 0
        ):
            out.append((v[0], v[1]))  # a multimodal (identifier, offset) pair
        else:
            raise KVEventError(
                f"event {i}: extra key {v!r} is not a name, digest or (identifier, offset)"
            )
    return tuple(out)


def _text(x: object, i: int, name: str) -> str | None:
    if x is None or type(x) is str and len(x) <= MAX_TEXT:
        return x
    raise KVEventError(f"event {i}: {name} must be a str of at most {MAX_TEXT} characters or nil")


def _opt_uint(x: object, i: int, name: str) -> int | None:
    if x is None or _uint(x):
        return x
    raise KVEventError(f"event {i}: {name} must be an int >= 0 or nil, got {x!r}")


def _uint(x: object) -> TypeGuard[int]:
    return type(x) is int and x >= 0
