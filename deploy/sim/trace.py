"""Loader for request traces in the Mooncake format (``deploy/sim/traces/``).

Each line of a trace is one JSON object::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival time in ms, ``hash_ids`` holds one remapped prefix-block hash per
``block_tokens`` (512) prompt tokens; equal ids mean a reusable prefix block. Token contents are
not part of the trace: :func:`request_tokens` expands hash ids into deterministic token ids.

Stdlib only, so that benchmarks and tools can use it without importing Ray or torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvfabric.core.wire import is_int

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_TRACE",
    "VOCAB_SIZE",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "request_tokens",
]

BLOCK_TOKENS = 512
VOCAB_SIZE = 32000
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl"

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_SALT = b"ray-kv-fabric/trace-block/"


class TraceError(ValueError):
    """A trace file is malformed; the message names the file and the 1-based line."""

    def __init__(self, path: Path | str, line: int, reason: str) -> None:
        self.path = Path(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path.name}:{line}: {reason}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _parse_line(obj: object, block_tokens: int) -> TraceRequest:
    """Validate one decoded line; raises ValueError with the reason (no location)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")

    for name, minimum in (("timestamp", 0), ("input_length", 1), ("output_length", 0)):
        value = obj[name]
        if not is_int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")

    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"hash_ids must be a list, got {type(hash_ids).__name__}")
    for i, h in enumerate(hash_ids):
        if not is_int(h):
            raise ValueError(f"hash_ids[{i}] must be an integer, got {h!r}")
        if h < 0:
            raise ValueError(f"hash_ids[{i}] must be >= 0, got {h}")
    input_length = obj["input_length"]
    expected = -(-input_length // block_tokens)  # exact: a float ceil overflows on huge ints
    if len(hash_ids) != expected:
        raise ValueError(
            f"hash_ids has {len(hash_ids)} block(s) but input_length {input_length} needs "
            f"ceil({input_length}/{block_tokens}) = {expected}"
        )
    return TraceRequest(
        timestamp_ms=obj["timestamp"],
        input_length=input_length,
        output_length=obj["output_length"],
        hash_ids=tuple(hash_ids),
    )


def load_trace(
    path: str | Path | None = None,
    limit: int | None = None,
    *,
    block_tokens: int = BLOCK_TOKENS,
    require_ordered: bool = True,
) -> list[TraceRequest]:
    """Load and validate a Mooncake-format trace (default: the packaged conversation trace).

    Every line is checked; a malformed one raises :class:`TraceError` naming file and line.
    Blank lines are skipped. ``limit`` keeps the first ``limit`` requests (lines after them are
    not read). With ``require_ordered`` (default) a timestamp smaller than the previous one is
    an error, since replaying relies on arrival order; pass False to accept any order as is.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = DEFAULT_TRACE if path is None else Path(path)
    requests: list[TraceRequest] = []
    if limit == 0:
        return requests
    previous_ts = -1
    with path.open("rb") as f:
        # The lines text mode's universal newlines would give, decoded one at a time so that
        # a bad byte is reported with its line.
        for lineno, raw in enumerate((part for chunk in f for part in chunk.splitlines()), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(
                    path, lineno, f"not UTF-8: {e.reason} at byte {e.start + 1}"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(
                    path, lineno, f"invalid JSON: {e.msg} (column {e.colno})"
                ) from None
            except RecursionError:
                raise TraceError(path, lineno, "invalid JSON: nested too deeply") from None
            except ValueError as e:  # e.g. an integer of more digits than int() takes
                raise TraceError(path, lineno, f"invalid JSON: {e}") from None
            try:
                req = _parse_line(obj, block_tokens)
            except ValueError as e:
                raise TraceError(path, lineno, str(e)) from None
            if require_ordered and req.timestamp_ms < previous_ts:
                raise TraceError(
                    path,
                    lineno,
                    f"timestamp {req.timestamp_ms} is smaller than the previous one "
                    f"({previous_ts})",
                )
            previous_ts = req.timestamp_ms
            requests.append(req)
            if limit is not None and len(requests) >= limit:
                break
    return requests


_BlockCache = dict[int, tuple[int, ...]]
# (tokens_per_block, vocab_size) -> hash id -> token block; cleared when it grows past the cap.
_block_caches: dict[tuple[int, int], _BlockCache] = {}
_BLOCK_CACHE_CAP = 1 << 20


def _block_cache(tokens_per_block: int, vocab_size: int) -> _BlockCache:
    cache = _block_caches.setdefault((tokens_per_block, vocab_size), {})
    if len(cache) > _BLOCK_CACHE_CAP:
        cache.clear()
    return cache


def _make_block(hash_id: int, tokens_per_block: int, vocab_size: int) -> tuple[int, ...]:
    """Deterministic token ids for one hash block: SHAKE-128 of the id, 4 bytes per token."""
    digest = hashlib.shake_128(_SALT + b"%d" % hash_id).digest(4 * tokens_per_block)
    # Native-endian uint32 words reduced into the vocabulary (bias < 1e-5 for 32000).
    return tuple(map(vocab_size.__rmod__, memoryview(digest).cast("I")))


def request_tokens(
    req: TraceRequest,
    tokens_per_block: int = 32,
    block_tokens: int = BLOCK_TOKENS,
    *,
    vocab_size: int = VOCAB_SIZE,
) -> list[int]:
    """Expand a request's hash ids into token ids, scaled down to ``tokens_per_block`` per block.

    Each hash id becomes ``tokens_per_block`` ids in ``[0, vocab_size)`` that depend only on the
    hash id (equal ids give equal tokens; different ids collide with probability
    ``vocab_size ** -tokens_per_block``). The prompt length is scaled to
    ``ceil(input_length * tokens_per_block / block_tokens)`` and the last block is cut to it, so
    every block keeps at least one token.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n_blocks = len(req.hash_ids)
    if n_blocks != -(-req.input_length // block_tokens):
        raise ValueError(
            f"request has {n_blocks} hash block(s), inconsistent with input_length "
            f"{req.input_length} at {block_tokens} tokens per block"
        )
    length = -(-req.input_length * tokens_per_block // block_tokens)  # exact integer ceil
    cache = _block_cache(tokens_per_block, vocab_size)
    tokens: list[int] = []
    for h in req.hash_ids:
        block = cache.get(h)
        if block is None:
            block = cache[h] = _make_block(h, tokens_per_block, vocab_size)
        tokens.extend(block)
    del tokens[length:]
    return tokens
