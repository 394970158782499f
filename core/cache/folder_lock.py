"""Who owns a store folder: an exclusive `flock` on its lock file, held as long as the
store is open. The OS drops it with the process (a kill -9 included), so a folder whose
lock can be taken has no live owner. Two live stores never share a folder: the second
one's `take` raises FolderHeld.

flock locks belong to an open file, not to a process: two opens in one process exclude
each other as two processes do. The lock stays on its file when its folder is renamed
(`move`), so a folder can be claimed and renamed without a moment unowned."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = ".owner"


class FolderHeld(RuntimeError):
    """The folder's lock is held: another live store has it open."""


class FolderLock:
    """The lock on one folder, held until `release` (taken by `take` or `try_take`)."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder = folder
        self._fd: int | None = fd
        self.moved_from = ""  # the folder's name before `move`; "" where not moved

    @classmethod
    def try_take(cls, folder: Path | str) -> FolderLock | None:
        """The folder's lock, or None where another holds it (or the folder is gone).
        A folder without a lock file (written before there was one) gets one."""
        folder = Path(folder)
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        # For an operator: which process holds it (the lock itself is what counts).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(folder, fd)

    @classmethod
    def take(cls, folder: Path | str) -> FolderLock:
        """The folder's lock; FolderHeld where another live store holds it."""
        lock = cls.try_take(folder)
        if lock is None:
            try:
                pid = (Path(folder) / LOCK_NAME).read_text().strip() or "?"
            except OSError:
                pid = "?"
            raise FolderHeld(
                f"disk folder {folder} is in use: its {LOCK_NAME} is locked by a live process "
                f"(pid {pid}); two stores never share a folder"
            )
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holds(self, folder: Path) -> bool:
        """Whether this lock is on `folder`'s lock file (and not on one since moved there)."""
        if self._fd is None:
            return False
        try:
            there = os.stat(folder / LOCK_NAME)
        except OSError:
            return False
        mine = os.fstat(self._fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def move(self, to: Path) -> None:
        """Rename the folder to `to` (absent, or an empty folder), keeping the lock."""
        if self._fd is None:
            raise RuntimeError(f"the lock on {self.folder} is released")
        os.rename(self.folder, to)
        self.moved_from, self.folder = self.folder.name, to

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
