"""Claiming an orphan: a store folder beside ours whose owner is gone (its lock can be
taken), renamed to our name so that our store adopts its pages.

A node's folder is named after the node, and a node may come back under another name (a
host that rejoins a Ray cluster gets a new node id): its earlier folder is then an
orphan, found here by the next new node on that host. Only folders holding a journal are
candidates (one without holds no page): those whose journal holds records first (a node
that died as it started leaves a newer one holding none), then the most recently written.
The lock decides between two claimers racing for one folder: the loser tries the next."""

from __future__ import annotations

from pathlib import Path

from .disk_journal import JOURNAL
from .disk_records import Header
from .folder_lock import FolderLock

HEAD_BYTES = 1 << 16  # read of a journal to tell whether records follow its header


def _holds_records(journal: Path, size: int) -> bool:
    """Whether the journal holds a record after its header (a header it cannot read: no)."""
    with journal.open("rb") as f:
        header, end, _ = Header.decode(memoryview(f.read(HEAD_BYTES)))
    return header is not None and size > end


def _candidates(parent: Path, name: str) -> list[Path]:
    """Folders of `parent` other than `name` holding a journal: those with records first,
    then the most recently written (then by name: the order is the same for every
    claimer)."""
    found: list[tuple[bool, float, str, Path]] = []
    try:
        entries = list(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    for folder in entries:
        if folder.name == name or folder.name.startswith("."):
            continue
        journal = folder / JOURNAL
        try:
            stat = journal.stat()
            empty = not _holds_records(journal, stat.st_size)
        except OSError:  # not a store folder, or gone meanwhile
            continue
        found.append((empty, -stat.st_mtime, folder.name, folder))
    return [folder for *_, folder in sorted(found)]


def claim_orphan(parent: Path | str, name: str) -> FolderLock | None:
    """Rename an orphan folder of `parent` to `parent`/`name` and return its lock, held
    (`moved_from` names the orphan); None where there is no orphan. `name` must not exist."""
    parent = Path(parent)
    mine = parent / name
    for folder in _candidates(parent, name):
        lock = FolderLock.try_take(folder)
        if lock is None:
            continue  # a live owner, or another claimer got it first
        # Between our listing and our lock, another claimer may have taken this folder,
        # renamed it and died: our lock is then on a file that is no longer `folder`'s.
        if not lock.holds(folder):
            lock.release()
            continue
        try:
            lock.move(mine)
        except OSError:
            lock.release()
            continue
        return lock
    return None
