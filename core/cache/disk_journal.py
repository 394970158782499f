"""The disk tier's journal: which page lies in which slot, appended record by record.

A file in the store's folder: a header carrying the KV identity, then PUT and FREE
records (disk_records.py). Opening it replays the records into the live set (the last
PUT of each slot not FREEd after it) and says how many it dropped and why: a torn tail
(a crash mid-append), a bad frame (corruption), a slot outside today's capacity, or all
of them where the header's identity is not the layout's; such a journal is replaced by
a fresh one, its pages never served.

Appends are one write(2) of whole frames at the end; a failed or short one (a full
disk, a file size limit) is cut off again, so the journal stays whole and usable, and
`DiskFull` or `PageFileError` raised. When dead records outnumber live ones by
`compact_factor`, the live ones are rewritten to a new file, synced, and renamed over
the old one (atomic: a crash leaves the old or the new journal, both whole).
"""

from __future__ import annotations

import enum
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from .disk_records import FrameState, Free, Header, Put, Record, decode, encode, read_frame
from .layout import KVLayout, PoolName
from .page_file import PageFileError, io_error

JOURNAL = "journal"


class Drop(str, enum.Enum):
    """Why a record (or a page) is not trusted."""

    TORN_TAIL = "torn_tail"  # the file ends inside it (a crash mid-append)
    BAD_FRAME = "bad_frame"  # its checksum does not match, or it decodes to no record
    IDENTITY = "identity"  # written under another KV identity
    SLOT_RANGE = "slot_range"  # its pool or slot is outside today's capacity
    BEYOND_FILE = "beyond_file"  # its slot lies past the end the data file had
    PAGE_CHECKSUM = "page_checksum"  # the slot's bytes do not match its checksum
    UNREADABLE = "unreadable"  # reading the slot failed


@dataclass
class Replay:
    """What opening a journal found."""

    live: dict[tuple[PoolName, int], Put]
    dropped: Counter[Drop] = field(default_factory=Counter)
    identity: list[str] = field(default_factory=list)  # why the identity differed
    records: int = 0  # records in the file, dropped ones included


def replay(data: bytes, layout: KVLayout, capacity: Mapping[PoolName, int]) -> Replay:
    """The live records of a journal's bytes; never raises on any bytes."""
    view = memoryview(data)
    header, at, state = Header.decode(view)
    out = Replay({})
    if header is None:
        if data:  # what follows a header that cannot be read cannot be trusted
            out.identity.append("no readable journal header")
            out.dropped[Drop.TORN_TAIL if state is FrameState.TORN else Drop.BAD_FRAME] += 1
        return out
    differences = header.differences(layout)
    records: list[Record] = []
    while at < len(view):
        state, body, at = read_frame(view, at)
        if state is FrameState.TORN:
            out.dropped[Drop.TORN_TAIL] += 1
            break
        if state is FrameState.BAD:
            out.dropped[Drop.BAD_FRAME] += 1
            continue
        try:
            records.append(decode(body))
        except ValueError:
            out.dropped[Drop.BAD_FRAME] += 1
    out.records = len(records)
    if differences:
        out.identity = differences
        out.dropped[Drop.IDENTITY] += len(records)
        return out
    for record in records:
        if record.slot >= capacity.get(record.pool, 0):
            out.dropped[Drop.SLOT_RANGE] += 1
        elif isinstance(record, Put):
            out.live[(record.pool, record.slot)] = record
        else:
            out.live.pop((record.pool, record.slot), None)
    return out


class DiskJournal:
    """The journal file of one store folder, open for appends. Not thread-safe."""

    def __init__(
        self,
        folder: Path,
        layout: KVLayout,
        capacity: Mapping[PoolName, int],
        *,
        sync: bool = False,
        compact_factor: float = 4.0,
        compact_min: int = 1024,
    ) -> None:
        """Open (replaying it) or create the journal; `self.found` says what was in it.
        `sync`: fsync after every append (else the OS writes it back). Compacts when
        dead records exceed both `compact_min` and `compact_factor` x the live ones."""
        self.path = Path(folder) / JOURNAL
        self.layout = layout
        self.sync = sync
        self.compact_factor = compact_factor
        self.compact_min = compact_min
        self.capacity = dict(capacity)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as e:
            raise io_error(e, f"reading {self.path}") from e
        self.found = replay(data, layout, self.capacity)
        self.live = dict(self.found.live)
        self._fd = -1
        self._end = 0
        self._records = 0
        self._rewrite()  # drops what replay dropped: a torn tail, bad frames, another identity

    @property
    def dead(self) -> int:
        """Records in the file that no longer say anything (overwritten or freed)."""
        return self._records - len(self.live)

    def append(self, records: Iterable[Record]) -> None:
        """Append records in one write; on failure the journal is as before."""
        batch = list(records)
        data = b"".join(encode(r) for r in batch)
        if not data:
            return
        fd = self._require_open()
        try:
            done = os.write(fd, data)
            if done != len(data):  # a regular file writes all unless its limit is hit
                os.write(fd, data[done:])  # raises the reason (EFBIG, ENOSPC)
                raise OSError(0, f"short write: {done} of {len(data)} bytes")
            if self.sync:
                os.fsync(fd)
        except OSError as e:
            self._cut()
            raise io_error(e, f"appending to {self.path}") from e
        self._end += len(data)
        self._records += len(batch)
        for r in batch:
            if isinstance(r, Put):
                self.live[(r.pool, r.slot)] = r
            else:
                self.live.pop((r.pool, r.slot), None)
        if self.dead > max(self.compact_min, self.compact_factor * len(self.live)):
            self.compact()

    def compact(self) -> None:
        """Rewrite the live records to a new file, atomically."""
        self._rewrite()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        data = Header.of(self.layout).encode() + b"".join(encode(r) for r in self.live.values())
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            if os.write(fd, data) != len(data):
                raise OSError(0, "short write")
            os.fsync(fd)
            os.rename(tmp, self.path)
            _sync_folder(self.path.parent)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise io_error(e, f"rewriting {self.path}") from e
        os.close(fd)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._end = len(data)
        self._records = len(self.live)

    def _cut(self) -> None:
        """Drop whatever a failed append left past the last whole record."""
        try:
            os.ftruncate(self._fd, self._end)
        except OSError as e:  # the file is as the append left it: replay drops the tail
            raise PageFileError(f"cutting {self.path} back after a failed append: {e}") from e

    def _require_open(self) -> int:
        if self._fd < 0:
            raise PageFileError(f"{self.path} is closed")
        return self._fd


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["DiskJournal", "Drop", "Free", "Put", "Replay", "replay"]
