"""A node's disk tier: page files per pool, the journal naming their pages, slots.

A folder holds one data file per pool (`<POOL>.pages`, page_file.py) and the journal
(disk_journal.py). A page is written before its PUT record is appended, so a record
never names bytes that were not written, and each record carries its page's checksum:
opening the folder again (`adopt`) trusts a record only once the bytes read back from
its slot match it. A kill -9 between the two, a page corrupted later, a data file
truncated, all lose those pages only; a journal of another KV identity loses all.

What `sync` buys: with `Sync.NONE` the OS writes pages and records back when it will;
a kill -9 loses nothing written (the page cache outlives the process) and a power loss
may lose pages, never serving wrong ones (checksums). `Sync.PAGES` flushes the data
file before the records naming it are appended; `Sync.ALL` also flushes the journal,
so a write that returned survives a power loss.

Every read is verified too: the store keeps the checksum of each page it holds (written
this run, or adopted), and `read` raises `CorruptPages` naming the slots whose bytes no
longer match (a page flipped on disk after it was written): the caller drops them, never
serves them. Pages live in the slots the allocator hands out.

A store owns its folder while open (folder_lock.py): a second store opening it, in this
process or another, gets FolderHeld.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import Callable, Mapping, Sequence

import torch

from .allocator import PageAllocator
from .disk_journal import DiskJournal, Drop, Replay
from .disk_records import Free, PageMeta, Put, each_page, page_checksum, read_checks
from .folder_lock import FolderLock
from .layout import KVLayout, PoolName
from .page_file import (
    PageFile,
    PageFileError,
    PageGeometry,
    PosixPageFile,
    check_io,
    page_rows,
)

# How a store makes its page files: PosixPageFile, or transport.nixl_file's.
PageFileMaker = Callable[[Path, int, PageGeometry], PageFile]
_VERIFY_BATCH = 64  # pages read back at once while adopting


class Unrecorded(PageFileError):
    """Pages written whose records the journal could not take (a full disk): their bytes
    are right, and a restart will not find them."""


class CorruptPages(PageFileError):
    """Slots read back whose bytes do not match the checksum of the page written there:
    `slots` (of `pool`) must not be served. The other slots of the read are right."""

    def __init__(self, pool: PoolName, slots: list[int]) -> None:
        super().__init__(f"{pool.name} slots {slots[:8]} do not match their checksums")
        self.pool = pool
        self.slots = slots


@dataclass(frozen=True)
class SavedPages:
    """Pages of one pool read as they are (checked or not), to be written back by
    `DiskStore.restore` with the checksums and records they had."""

    pool: PoolName
    slots: list[int]
    pages: torch.Tensor
    sums: list[int]  # read check of each (read_checks)
    records: list[Put]


class DiskStep(str, enum.Enum):
    """Where a write stands, for a store's `hook` (tests and chaos runs act there)."""

    PAGES = "pages"  # about to write the page bytes
    RECORD = "record"  # the bytes are written, their records not yet appended


# Called at each step of a write; raising there fails the write as that step's I/O would
# (a PageFileError at RECORD: the journal could not take the records). Production sets none.
DiskHook = Callable[[DiskStep], None]


class Sync(str, enum.Enum):
    NONE = "none"
    PAGES = "pages"
    ALL = "all"


@dataclass
class Adoption:
    """The pages a reopened folder holds, and what it dropped (journal and pages)."""

    trusted: list[Put]
    dropped: Counter[Drop] = field(default_factory=Counter)
    identity: list[str] = field(default_factory=list)  # why another identity's were dropped


class DiskStore:
    """Pages of every pool of `layout` on disk in `folder`. Not thread-safe."""

    def __init__(
        self,
        folder: Path | str,
        layout: KVLayout,
        capacity: Mapping[PoolName, int],
        *,
        sync: Sync = Sync.NONE,
        page_file: PageFileMaker = PosixPageFile,
        compact_factor: float = 4.0,
        owner: FolderLock | None = None,
    ) -> None:
        """`owner`: the folder's lock, taken already (a claimed orphan's, orphan_folder.py);
        the store holds it from here on and releases it at `close`. None: taken here."""
        self.folder = Path(folder)
        self.layout = layout
        self.sync = Sync(sync)
        unknown = set(capacity) - set(layout.pools)
        if unknown or not capacity:
            if owner is not None:
                owner.release()
            raise ValueError(f"capacity names pools of {list(layout.pools)}, got {dict(capacity)}")
        self.folder.mkdir(parents=True, exist_ok=True)
        if owner is not None and not owner.holds(self.folder):
            owner.release()
            raise ValueError(f"the lock given is not {self.folder}'s")
        self.owner = owner if owner is not None else FolderLock.take(self.folder)
        self.files: dict[PoolName, PageFile] = {}
        try:
            for pool, n in capacity.items():
                geometry = PageGeometry(layout.page_shape(pool), layout.torch_dtype)
                self.files[pool] = page_file(self.data_path(pool), n, geometry)
            self.journal = DiskJournal(
                self.folder,
                layout,
                capacity,
                sync=self.sync is Sync.ALL,
                compact_factor=compact_factor,
            )
        except BaseException:
            for f in self.files.values():
                f.close()
            self.owner.release()
            raise
        self.slots = {pool: PageAllocator(n) for pool, n in capacity.items()}
        # The read check of each page a slot holds, recorded or not (a full journal): what
        # every read is checked against.
        self.sums: dict[PoolName, dict[int, int]] = {pool: {} for pool in capacity}
        self.hook: DiskHook | None = None
        self._adopted = False

    @property
    def found(self) -> Replay:
        return self.journal.found

    def adopt(self) -> Adoption:
        """The pages left by an earlier run whose bytes match their records; their slots
        become used. The others are FREEd in the journal. Once, before any write."""
        if self._adopted:
            raise RuntimeError("adopt() runs once, before the store is written")
        self._adopted = True
        found = self.journal.found
        out = Adoption([], Counter(found.dropped), list(found.identity))
        dropped: list[Put] = []
        by_pool: dict[PoolName, list[Put]] = {}
        for put in found.live.values():
            by_pool.setdefault(put.pool, []).append(put)
        for pool, puts in by_pool.items():
            file = self.files[pool]
            for i in range(0, len(puts), _VERIFY_BATCH):
                batch = puts[i : i + _VERIFY_BATCH]
                for put, why in zip(batch, self._verify(file, batch)):
                    if isinstance(why, int):
                        out.trusted.append(put)
                        self.sums[pool][put.slot] = why
                    else:
                        out.dropped[why] += 1
                        dropped.append(put)
        for pool in by_pool:
            self.slots[pool].take([p.slot for p in out.trusted if p.pool == pool])
        try:
            self.journal.append(Free(p.pool, p.slot) for p in dropped)
        except PageFileError:
            pass  # their records stay, harmless: each is checked again at the next open
        return out

    @staticmethod
    def _verify(file: PageFile, puts: list[Put]) -> list[Drop | int]:
        """Per record, where its slot's bytes match its checksum their read check, else
        why not."""
        inside = [p for p in puts if p.slot < file.valid_slots]
        pages = torch.empty((len(inside), *file.geometry.shape), dtype=file.geometry.dtype)
        try:
            file.read([p.slot for p in inside], pages)
        except PageFileError:
            return [Drop.UNREADABLE] * len(puts)
        rows = page_rows(pages)
        sums = {p.slot: c for p, c in zip(inside, each_page(page_checksum, rows))}
        reads = {p.slot: c for p, c in zip(inside, read_checks(rows))}
        return [
            Drop.BEYOND_FILE
            if p.slot not in sums
            else reads[p.slot]
            if sums[p.slot] == p.checksum
            else Drop.PAGE_CHECKSUM
            for p in puts
        ]

    def data_path(self, pool: PoolName) -> Path:
        """The data file of `pool`'s pages."""
        return self.folder / f"{pool.name}.pages"

    def alloc(self, pool: PoolName, n: int) -> list[int]:
        """n free slots of `pool` (OutOfPages where there are fewer)."""
        return self.slots[pool].alloc(n)

    def write(
        self, pool: PoolName, slots: Sequence[int], pages: torch.Tensor, metas: Sequence[PageMeta]
    ) -> list[Put]:
        """Write pages[i] to slots[i] (allocated ones), then record them; returns the
        records. Raises ValueError on bad input (nothing written), PageFileError (DiskFull
        where the disk is full) on failure: the slots then hold nothing trusted, and stay
        allocated for the caller to free. Unrecorded where the pages were written but the
        journal could not take their records: they serve this run, and no later one."""
        file = self._file(pool)
        if len(metas) != len(slots):
            raise ValueError(f"{len(slots)} slots but {len(metas)} page metas")
        if not all(isinstance(m, PageMeta) for m in metas):
            raise ValueError("metas must be PageMeta")
        check_io(file.geometry, file.capacity, slots, pages, "page file write")
        held = self.sums[pool]
        if self.hook is not None:
            self.hook(DiskStep.PAGES)
        for s in slots:  # until written whole, the slots hold no page a read may trust
            held.pop(s, None)
        file.write(slots, pages)  # validates slots and pages before writing anything
        if self.sync is not Sync.NONE:
            file.sync()
        rows = page_rows(pages)
        puts = [Put(pool, s, m, c) for s, m, c in zip(slots, metas, each_page(page_checksum, rows))]
        held.update(zip(slots, read_checks(rows)))
        try:
            if self.hook is not None:
                self.hook(DiskStep.RECORD)
            self.journal.append(puts)
        except PageFileError as e:
            raise Unrecorded(f"pages written but not recorded: {e}") from e
        return puts

    def records(self, pool: PoolName, slots: Sequence[int]) -> list[Put]:
        """The live records of those of `slots` that have one."""
        live = self.journal.live
        return [put for s in slots if (put := live.get((pool, s))) is not None]

    def read(self, pool: PoolName, slots: Sequence[int], out: torch.Tensor) -> None:
        """Read slots[i] into out[i] (a contiguous CPU tensor of len(slots) pages), each
        checked against its page's checksum: CorruptPages names those that differ (or
        hold no page), the others read right."""
        sums = self.sums[self._pool(pool)]
        found = _read_checked(self._file(pool), slots, out)
        bad = [s for s, got in zip(slots, found) if sums.get(s) != got]
        if bad:
            raise CorruptPages(pool, bad)

    def save(self, pool: PoolName, slots: Sequence[int]) -> SavedPages:
        """Those of `slots` holding a page, read as they are (unchecked: a corrupted page
        is written back corrupted, under its own checksum, and still fails its reads)."""
        sums = self.sums[self._pool(pool)]
        held = [s for s in slots if s in sums]
        file = self._file(pool)
        pages = torch.empty((len(held), *file.geometry.shape), dtype=file.geometry.dtype)
        file.read(held, pages)
        return SavedPages(pool, held, pages, [sums[s] for s in held], self.records(pool, held))

    def restore(self, saved: SavedPages) -> None:
        """Write `saved` back as it was: bytes, checksums, records. A journal that cannot
        take the records (a full disk) leaves the pages serving this run only."""
        if not saved.slots:
            return
        file = self._file(saved.pool)
        file.write(saved.slots, saved.pages)
        if self.sync is not Sync.NONE:
            file.sync()
        self.sums[saved.pool].update(zip(saved.slots, saved.sums))
        try:
            self.journal.append(saved.records)
        except PageFileError:
            pass  # as in `write`'s Unrecorded: the bytes are right, a restart misses them

    def free(self, pool: PoolName, slots: Sequence[int]) -> None:
        """The slots hold nothing any more. They are free even where recording that
        fails (PageFileError, raised): a stale PUT is harmless, as adoption trusts it
        only while its slot holds the very bytes it names."""
        self.slots[self._pool(pool)].free(list(slots))
        sums = self.sums[pool]
        for s in slots:
            sums.pop(s, None)
        self.journal.append(Free(pool, s) for s in slots)

    def close(self) -> None:
        self.journal.close()
        for f in self.files.values():
            f.close()
        self.owner.release()  # last: the folder is another store's to open from here

    def _pool(self, pool: PoolName) -> PoolName:
        if pool not in self.files:
            raise ValueError(f"no pool {pool!r} on disk; have {list(self.files)}")
        return pool

    def _file(self, pool: PoolName) -> PageFile:
        return self.files[self._pool(pool)]

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A large read is checked as it comes: its pages are read in chunks of about this many
# bytes on a reader thread while the caller checks the chunk before (the read and the
# check each let go of the GIL), so the check costs little beyond the read itself. The
# last chunk's check is not hidden: at 2 MiB it is about 0.15 ms of CRC-32C. Measured on
# 16 MiB batches against a plain read of the same file: 1 MiB chunks 0.73-0.88x, 2 MiB
# 0.85-1.03x, 4 MiB 0.79-0.85x, 8 MiB 0.80-0.84x.
READ_CHUNK_BYTES = 2 << 20
_reader: ThreadPoolExecutor | None = None


def _read_checked(file: PageFile, slots: Sequence[int], out: torch.Tensor) -> list[int]:
    """Read slots[i] into out[i] and return each page's read check. The chunks are read one
    after another on the reader thread (a page file is not thread-safe; the disk never
    waits for this thread between chunks), and none is left reading when this returns or
    raises."""
    global _reader
    if out.nbytes <= READ_CHUNK_BYTES:
        file.read(slots, out)
        return read_checks(page_rows(out))
    if _reader is None:
        _reader = ThreadPoolExecutor(1, thread_name_prefix="kvf-disk-read")
    per = max(1, READ_CHUNK_BYTES // out[0].nbytes)
    starts = range(0, len(slots), per)
    done: SimpleQueue[int | BaseException] = SimpleQueue()
    stop = threading.Event()

    def read_all() -> None:
        for at in starts:
            if stop.is_set():
                return
            try:
                file.read(slots[at : at + per], out[at : at + per])
            except BaseException as e:  # handed to the caller, who raises it
                done.put(e)
                return
            done.put(at)

    task = _reader.submit(read_all)
    found: list[int] = []
    try:
        for _ in starts:
            at = done.get()
            if isinstance(at, BaseException):
                raise at
            found += read_checks(page_rows(out[at : at + per]))
    finally:
        stop.set()
        task.exception()  # never return with a read still writing into `out`
    return found
