"""The disk journal's bytes: its header (the KV identity) and its framed records.

Header: MAGIC, then one frame whose body is JSON: the layout (`KVLayout.to_dict()`,
tag included), its fingerprint and each pool's page bytes. Record: one frame whose body
is a PUT (a page now lies in a slot: its key, its parent's, position, tokens, checksum)
or a FREE (the slot holds nothing). A frame is its body's length, a checksum of the
body, then the body, so a torn or corrupted frame is found and skipped, never decoded.

Page checksum: SHA-256 (first 16 bytes) of the page's bytes. Strong (no corruption
pattern collides in practice) and, where the CPU has SHA instructions (x86 since Ice
Lake/Zen, ARMv8), about 3x BLAKE2b's speed: 1.46 against 0.53 GB/s on this repository's
test host; it runs on every page written, so its speed is the write path's. Frames are
small, so their checksum is BLAKE2b, keyed apart from pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Any, Callable, TypeVar

import numpy as np

from . import native
from .keys import KEY_BYTES
from .layout import KVLayout, LayoutError, PoolName

MAGIC = b"KVF-DISK-JOURNAL-1\n"
CHECKSUM_BYTES = 16
_FRAME = struct.Struct("<I16s")  # body length, BLAKE2b-128 of the body
_SLOT = struct.Struct("<BBI")  # kind, pool, slot
_PUT = struct.Struct("<qI16s16s16s")  # position, token bytes len, parent, key, checksum
MAX_BODY = 1 << 24  # a length beyond this is a corrupted frame, not a record
FRAME_BYTES = _FRAME.size


class Kind(IntEnum):
    PUT = 1
    FREE = 2


@dataclass(frozen=True)
class PageMeta:
    """What names a page's content: the chained key of its prefix, and what made it."""

    parent: bytes  # the key of the page before (the namespace root's for page 0)
    position: int  # the page's index in its prompt
    key: bytes  # KEY_BYTES
    tokens: bytes  # the page's token ids, int32 little-endian

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise ValueError(f"a page key is {KEY_BYTES} bytes, got {self.key!r:.60}")
        if not isinstance(self.parent, bytes) or len(self.parent) != KEY_BYTES:
            raise ValueError(f"a parent key is {KEY_BYTES} bytes, got {self.parent!r:.60}")
        if not isinstance(self.tokens, bytes):
            raise ValueError("tokens must be bytes")
        if not isinstance(self.position, int) or self.position < 0:
            raise ValueError(f"position must be an int >= 0, got {self.position!r}")


@dataclass(frozen=True)
class Put:
    pool: PoolName
    slot: int
    meta: PageMeta
    checksum: bytes  # page_checksum of the slot's bytes


@dataclass(frozen=True)
class Free:
    pool: PoolName
    slot: int


Record = Put | Free


def page_checksum(page: memoryview | bytes) -> bytes:
    return hashlib.sha256(page).digest()[:CHECKSUM_BYTES]


def _import_crc32c() -> ModuleType:
    from . import _crc32c  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _crc32c


_CRC32C = native.load(native.MODE, _import_crc32c)


def read_checks(rows: np.ndarray) -> list[int]:
    """What each row of a uint8 array [pages, page bytes] read back is checked against, for
    a page written or adopted this run. CRC-32C in C (csrc/crc32c.c: SSE4.2 on three
    streams, 15 GB/s a core here, where zlib's CRC-32 does 1.8 and SHA-256 1.4), on the
    calling thread: handing pages to threads cost more than it saved (6.8 against 13 GB/s
    on a 16 MiB batch). On pure Python, zlib's CRC-32 on threads. Either catches every
    error burst of up to 32 bits, and the values never leave the process, so the two never
    meet. Adoption keeps to the record's SHA-256, as a slot may then hold any earlier page;
    within a run the store knows what each slot holds, and a read is checked only for
    bytes changed on disk since."""
    if _CRC32C is not None:
        return [_CRC32C.crc32c(row) for row in rows]
    return each_page(zlib.crc32, rows)


# SHA-256 of a batch runs on threads (hashlib and zlib let go of the GIL on buffers this
# large).
_PARALLEL_BYTES = 1 << 20  # a batch smaller than this is hashed inline
_THREADS = min(8, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
R = TypeVar("R")


def each_page(check: Callable[[Any], R], rows: np.ndarray) -> list[R]:
    """`check` (page_checksum, or zlib's CRC-32) of each row of a uint8 array [pages, page
    bytes], on several threads where the batch is large."""
    global _pool
    if _THREADS < 2 or len(rows) < 2 or rows.nbytes < _PARALLEL_BYTES:
        return [check(r) for r in rows]
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="kvf-checksum")
    return list(_pool.map(check, rows))


def _frame_sum(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16, person=b"kvf-journal").digest()


def frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body), _frame_sum(body)) + body


class FrameState(IntEnum):
    OK = 0
    TORN = 1  # the file ends inside the frame
    BAD = 2  # its checksum does not match its body


def read_frame(data: memoryview, at: int) -> tuple[FrameState, bytes, int]:
    """(state, body, offset of the next frame) of the frame at `at`. A torn frame's next
    offset is the end; a bad one's is past its length when that is plausible."""
    if at + FRAME_BYTES > len(data):
        return FrameState.TORN, b"", len(data)
    length, want = _FRAME.unpack_from(data, at)
    end = at + FRAME_BYTES + length
    if length > MAX_BODY:
        return FrameState.BAD, b"", len(data)  # no length to skip by: the rest is lost
    if end > len(data):
        return FrameState.TORN, b"", len(data)
    body = bytes(data[at + FRAME_BYTES : end])
    if _frame_sum(body) != want:
        return FrameState.BAD, b"", end
    return FrameState.OK, body, end


def encode(record: Record) -> bytes:
    if isinstance(record, Free):
        return frame(_SLOT.pack(Kind.FREE, record.pool, record.slot))
    m = record.meta
    body = (
        _SLOT.pack(Kind.PUT, record.pool, record.slot)
        + _PUT.pack(m.position, len(m.tokens), m.parent, m.key, record.checksum)
        + m.tokens
    )
    return frame(body)


def decode(body: bytes) -> Record:
    """The record of a frame's body; ValueError where it is not one (a frame whose
    checksum matched, so written by another version, or a collision)."""
    try:
        kind, pool, slot = _SLOT.unpack_from(body)
        if kind == Kind.FREE and len(body) == _SLOT.size:
            return Free(PoolName(pool), slot)
        if kind != Kind.PUT:
            raise ValueError(f"record kind {kind}")
        position, tok_len, parent, key, checksum = _PUT.unpack_from(body, _SLOT.size)
        at = _SLOT.size + _PUT.size
        if len(body) != at + tok_len:
            raise ValueError("record length")
        meta = PageMeta(parent, position, key, body[at:])
        return Put(PoolName(pool), slot, meta, checksum)
    except struct.error as e:
        raise ValueError(str(e)) from e


@dataclass(frozen=True)
class Header:
    """The journal's identity: what every page of the folder was written under."""

    layout: dict  # KVLayout.to_dict()
    fingerprint: str  # hex
    page_bytes: dict[str, int]  # pool name -> bytes of one page

    @staticmethod
    def of(layout: KVLayout) -> "Header":
        return Header(
            layout.to_dict(),
            layout.fingerprint.hex(),
            {p.name: layout.page_bytes(p) for p in layout.pools},
        )

    def encode(self) -> bytes:
        doc = {"layout": self.layout, "fingerprint": self.fingerprint}
        doc["page_bytes"] = self.page_bytes
        return MAGIC + frame(json.dumps(doc, sort_keys=True).encode())

    @staticmethod
    def decode(data: memoryview) -> tuple["Header | None", int, FrameState]:
        """(header, offset of the first record, state): no header where the bytes end
        inside it (TORN: a crash at creation) or hold none (BAD: corrupted, or not a
        journal)."""
        magic = bytes(data[: len(MAGIC)])
        if magic != MAGIC:
            torn = len(data) < len(MAGIC) and MAGIC.startswith(magic)
            return None, 0, FrameState.TORN if torn else FrameState.BAD
        state, body, end = read_frame(data, len(MAGIC))
        if state is not FrameState.OK:
            return None, 0, state
        try:
            doc = json.loads(body)
            header = Header(doc["layout"], doc["fingerprint"], doc["page_bytes"])
        except (ValueError, KeyError, TypeError):
            return None, 0, FrameState.BAD
        return header, end, FrameState.OK

    def differences(self, layout: KVLayout) -> list[str]:
        """Why pages written under this header must not serve `layout` (empty: they may)."""
        try:
            theirs = KVLayout.from_dict(self.layout)
        except LayoutError as e:
            return [f"the journal's layout is unreadable: {e}"]
        out = theirs.differences(layout)
        if theirs.fingerprint.hex() != self.fingerprint:
            out.append("the journal's fingerprint does not match its layout")
        if self.page_bytes != Header.of(layout).page_bytes:
            out.append(f"page bytes: {self.page_bytes} vs {Header.of(layout).page_bytes}")
        return out
