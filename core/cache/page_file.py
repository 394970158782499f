"""A pool's pages on local disk: one preallocated file of fixed-size page slots.

`PageFile` is what the disk store needs of a page file; `PosixPageFile` does it with
plain file I/O (os.pwritev/os.preadv straight from and into the tensor's memory, one call
per run of adjacent slots), transport/nixl_file.py through NIXL's POSIX backend.

The file is preallocated when it is opened (posix_fallocate), so a disk too small fails
there with `DiskFull`, not in the middle of a run. A file found shorter than the
capacity (truncated by a crash or by hand) is extended, but its slots past the old end
hold no pages: `valid_slots` says how many slots held bytes at open.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch

# os.preadv/os.pwritev take at most IOV_MAX buffers per call (1024 on Linux).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class PageFileError(Exception):
    """A page file could not be opened, read or written. After a failed write the
    slots written are undefined (never trusted: their journal records come after);
    the file stays usable."""


class DiskFull(PageFileError):
    """The disk (or the process's file size limit) has no room: ENOSPC, EFBIG, EDQUOT."""


_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def io_error(e: OSError, what: str) -> PageFileError:
    """Our error for an OSError (chain it with `from e`)."""
    kind = DiskFull if e.errno in _FULL else PageFileError
    return kind(f"{what}: {os.strerror(e.errno) if e.errno else e}")


@dataclass(frozen=True)
class PageGeometry:
    """What one page slot holds: a tensor of `shape` and `dtype`."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class PageFile(Protocol):
    """Page slots [0, capacity) of one pool in one file. Not thread-safe."""

    geometry: PageGeometry
    capacity: int
    valid_slots: int  # slots [0, valid_slots) held bytes when the file was opened

    def write(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        """Write pages[i] to slot slots[i]; pages is a contiguous CPU tensor
        [len(slots), *geometry.shape]. Validates everything before writing anything."""

    def read(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """Read slot slots[i] into out[i] (same shape rules as `write`)."""

    def sync(self) -> None:
        """Make the pages written so far durable (fdatasync)."""

    def close(self) -> None:
        """Release the file; idempotent."""


def check_io(
    geometry: PageGeometry, capacity: int, slots: Sequence[int], pages: torch.Tensor, what: str
) -> np.ndarray:
    """`slots` as an int64 array once they and `pages` are valid for one write or read:
    distinct ints in [0, capacity), a contiguous CPU tensor of len(slots) pages."""
    if not isinstance(slots, (list, tuple, range)) or not all(
        type(s) is int or isinstance(s, np.integer) for s in slots
    ):
        raise ValueError(f"{what}: slots must be a list of ints, got {slots!r:.80}")
    idx = np.asarray(slots, dtype=np.int64).reshape(-1)
    if len(idx) and (idx.min() < 0 or idx.max() >= capacity):
        bad = int(idx[(idx < 0) | (idx >= capacity)][0])
        raise ValueError(f"{what}: slot {bad} out of range [0, {capacity})")
    if len(np.unique(idx)) != len(idx):
        raise ValueError(f"{what}: a slot appears twice")
    if not isinstance(pages, torch.Tensor):
        raise ValueError(f"{what}: pages must be a torch.Tensor, got {type(pages).__name__}")
    want = (len(idx), *geometry.shape)
    if pages.dtype != geometry.dtype or tuple(pages.shape) != want:
        raise ValueError(
            f"{what}: want pages {geometry.dtype} {want}, got {pages.dtype} {tuple(pages.shape)}"
        )
    if pages.device.type != "cpu" or not pages.is_contiguous():
        raise ValueError(f"{what}: pages must be a contiguous CPU tensor")
    return idx


def page_rows(pages: torch.Tensor) -> np.ndarray:
    """`pages`' memory as a numpy uint8 array [n, page bytes], in place (no copy; any
    dtype, bfloat16 and fp8 included)."""
    n = pages.shape[0]
    return pages.view(torch.uint8).numpy().reshape(n, -1) if n else np.zeros((0, 0), np.uint8)


def slot_runs(idx: np.ndarray) -> list[tuple[int, list[int]]]:
    """(first slot, rows) per stretch of adjacent slots, slots sorted, at most IOV_MAX
    rows each: one pwritev/preadv per stretch, rows anywhere in memory."""
    order = np.argsort(idx, kind="stable")
    runs: list[tuple[int, list[int]]] = []
    first = -2
    rows: list[int] = []
    for row in order.tolist():
        slot = int(idx[row])
        if rows and slot == first + len(rows) and len(rows) < _IOV_MAX:
            rows.append(row)
            continue
        if rows:
            runs.append((first, rows))
        first, rows = slot, [row]
    if rows:
        runs.append((first, rows))
    return runs


def open_data_file(path: Path, capacity: int, page_bytes: int) -> tuple[int, int]:
    """(fd, valid slots) of the data file at `path`, created or resized to hold
    `capacity` pages, its blocks allocated; DiskFull where the disk has no room."""
    if not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
    size = capacity * page_bytes
    created = not path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise io_error(e, f"opening {path}") from e
    try:
        found = os.fstat(fd).st_size
        if found > size:  # the capacity shrank: slots past it are gone
            os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        if created:
            path.unlink(missing_ok=True)
        raise io_error(e, f"allocating {size} bytes for {path}") from e
    return fd, min(found // page_bytes, capacity)


def sync_data_file(fd: int, path: Path) -> None:
    """Make what was written to the data file `fd` (at `path`) durable."""
    try:
        os.fdatasync(fd)
    except OSError as e:
        raise io_error(e, f"syncing {path}") from e


class PosixPageFile:
    """`PageFile` over plain pread/pwrite."""

    def __init__(self, path: Path, capacity: int, geometry: PageGeometry) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.geometry = geometry
        self._fd: int | None = None
        self._fd, self.valid_slots = open_data_file(self.path, capacity, geometry.nbytes)

    def write(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        idx = check_io(self.geometry, self.capacity, slots, pages, "page file write")
        fd, size = self._require_open(), self.geometry.nbytes
        rows = page_rows(pages)
        for first, run in slot_runs(idx):
            buffers = [rows[r] for r in run]
            try:
                done = os.pwritev(fd, buffers, first * size)
            except OSError as e:
                raise io_error(e, f"writing slots {first}..{first + len(run) - 1}") from e
            if done != size * len(run):  # a regular file writes all or raises
                raise PageFileError(f"short write at slot {first}: {done} bytes")

    def read(self, slots: Sequence[int], out: torch.Tensor) -> None:
        idx = check_io(self.geometry, self.capacity, slots, out, "page file read")
        fd, size = self._require_open(), self.geometry.nbytes
        rows = page_rows(out)
        for first, run in slot_runs(idx):
            try:
                done = os.preadv(fd, [rows[r] for r in run], first * size)
            except OSError as e:
                raise io_error(e, f"reading slots {first}..{first + len(run) - 1}") from e
            if done != size * len(run):  # the file was truncated under us
                raise PageFileError(f"short read at slot {first}: {done} bytes")

    def sync(self) -> None:
        sync_data_file(self._require_open(), self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _require_open(self) -> int:
        if self._fd is None:
            raise PageFileError(f"{self.path} is closed")
        return self._fd
