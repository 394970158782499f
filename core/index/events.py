"""KV events: what a node tells the global index about its pages.

An event states a page's whole presence on the node (pools and tiers, as a
mask; 0 means gone), not a delta, so applying one twice is harmless. Events
travel in batches `(node, epoch, seq, pages)`: the index applies one node's
batches in `seq` order, asks for a snapshot on a gap, and replaces everything
an old epoch published when a new epoch (a restarted node) appears."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag
from typing import Sequence

import msgpack
from kvfabric.core.cache.keys import KEY_BYTES
from kvfabric.core.wire import unpack

EVENTS_VERSION = 1
MAX_PAGES_PER_BATCH = 1 << 20
MAX_DEPTH = 1 << 64  # depths stay below it: what the wire carries (u64), as the C core keeps them


class PageMask(IntFlag):
    """Where a node holds a page's KV, per pool and tier."""

    FULL_DEVICE = 1
    FULL_HOST = 2
    SWA_DEVICE = 4
    SWA_HOST = 8
    FULL_DISK = 16
    SWA_DISK = 32
    FULL = FULL_DEVICE | FULL_HOST | FULL_DISK
    SWA = SWA_DEVICE | SWA_HOST | SWA_DISK
    DEVICE = FULL_DEVICE | SWA_DEVICE


class EventError(ValueError):
    """A batch or snapshot that fails validation; nothing of it is applied."""


@dataclass(frozen=True)
class PageState:
    key: bytes  # the page's chained key
    parent: bytes  # the previous page's key (the namespace root key for page 0)
    depth: int  # the page's position in its sequence
    mask: int  # PageMask bits; 0: the node no longer holds the page


@dataclass(frozen=True)
class EventBatch:
    node: str
    epoch: int
    seq: int
    pages: tuple[PageState, ...]
    cleared: bool = False  # the node dropped every page before these
    fingerprint: bytes = b""  # the publisher's layout; an index for another layout refuses it

    def encode(self) -> bytes:
        return _encode(
            "batch", self.node, self.epoch, self.seq, self.cleared, self.pages, self.fingerprint
        )


@dataclass(frozen=True)
class Snapshot:
    """Every page a node holds, as of batch `seq` of `epoch`."""

    node: str
    epoch: int
    seq: int
    pages: tuple[PageState, ...]
    fingerprint: bytes = b""

    def encode(self) -> bytes:
        return _encode(
            "snapshot", self.node, self.epoch, self.seq, True, self.pages, self.fingerprint
        )


def _encode(
    kind: str,
    node: str,
    epoch: int,
    seq: int,
    cleared: bool,
    pages: Sequence[PageState],
    fingerprint: bytes,
) -> bytes:
    """The one event message `decode` reads: a batch's or a snapshot's (cleared)."""
    return msgpack.packb(
        [
            EVENTS_VERSION,
            kind,
            node,
            epoch,
            seq,
            cleared,
            [[p.key, p.parent, p.depth, p.mask] for p in pages],
            fingerprint,
        ]
    )


def decode(data: bytes) -> EventBatch | Snapshot:
    """Decode and validate; raises EventError saying what is wrong."""
    msg = unpack(data, EventError, "event message")
    if not isinstance(msg, list) or len(msg) != 8:
        raise EventError("an event message is a list of 8 fields")
    version, kind, node, epoch, seq, cleared, pages, fingerprint = msg
    if not _uint(version) or version != EVENTS_VERSION:
        raise EventError(f"event version {version!r}, expected {EVENTS_VERSION}")
    if kind not in ("batch", "snapshot"):
        raise EventError(f"unknown message kind {kind!r}")
    if not isinstance(node, str) or not node or len(node) > 256:
        raise EventError("node must be a non-empty str of at most 256 characters")
    if not _uint(epoch) or not _uint(seq) or not isinstance(cleared, bool):
        raise EventError("epoch and seq must be ints >= 0, cleared a bool")
    if not isinstance(fingerprint, bytes) or len(fingerprint) not in (0, KEY_BYTES):
        raise EventError(f"fingerprint must be {KEY_BYTES} bytes (or empty)")
    if not isinstance(pages, list) or len(pages) > MAX_PAGES_PER_BATCH:
        raise EventError(f"pages must be a list of at most {MAX_PAGES_PER_BATCH}")
    states = tuple(_page(p, i) for i, p in enumerate(pages))
    if kind == "snapshot":
        if not cleared:
            raise EventError("a snapshot states the node's whole contents (cleared must be true)")
        if any(s.mask == 0 for s in states):
            raise EventError("a snapshot lists held pages only (mask > 0)")
        return Snapshot(node, epoch, seq, states, fingerprint)
    return EventBatch(node, epoch, seq, states, cleared, fingerprint)


def _page(p: object, i: int) -> PageState:
    if not isinstance(p, list) or len(p) != 4:
        raise EventError(f"page {i}: expected [key, parent, depth, mask]")
    key, parent, depth, mask = p
    if not (
        isinstance(key, bytes)
        and len(key) == KEY_BYTES
        and isinstance(parent, bytes)
        and len(parent) == KEY_BYTES
    ):
        raise EventError(f"page {i}: key and parent must be {KEY_BYTES} bytes")
    if not _uint(depth) or not _uint(mask) or mask > _MAX_MASK:
        raise EventError(f"page {i}: depth must be an int >= 0 and mask a PageMask")
    return PageState(key, parent, depth, mask)


_MAX_MASK = int(PageMask.FULL | PageMask.SWA)


def _uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_header(node: object, epoch: object, seq: object) -> None:
    """A batch's or snapshot's sender and position, however it was built (wire or in process)."""
    if not isinstance(node, str) or not node:
        raise EventError("node must be a non-empty str")
    for name, v in (("epoch", epoch), ("seq", seq)):
        if not _uint(v):
            raise EventError(f"{name} must be an int >= 0, got {v!r}")


def check_pages(pages: Sequence[PageState], allow_zero: bool) -> None:
    """Whole-batch validation before any of it is applied: bad input changes nothing."""
    for i, p in enumerate(pages):
        if not (
            isinstance(p, PageState)
            and type(p.key) is bytes
            and len(p.key) == KEY_BYTES
            and type(p.parent) is bytes
            and len(p.parent) == KEY_BYTES
        ):
            raise EventError(f"page {i}: key and parent must be {KEY_BYTES} bytes")
        if (
            not _uint(p.depth)
            or p.depth >= MAX_DEPTH
            or not _uint(p.mask)
            or not (0 if allow_zero else 1) <= p.mask <= _MAX_MASK
        ):
            raise EventError(f"page {i}: bad depth {p.depth!r} or mask {p.mask!r}")
