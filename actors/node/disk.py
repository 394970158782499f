"""A node's disk tier: where its pages live and how they are written, and the store
the node actor opens over them at start (adopting what an earlier life left there, or
what a node gone from this host left in a folder now orphaned), and the read bandwidth it
measures there then."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Mapping

from kvfabric.core.cache.disk_probe import read_bytes_per_s
from kvfabric.core.cache.disk_store import DiskStore, PageFileMaker, Sync
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.orphan_folder import claim_orphan
from kvfabric.core.cache.page_file import PageFile, PageGeometry, PosixPageFile
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.transport.nixl_file import NixlFileError, NixlPageFile


class DiskIO(str, Enum):
    """How page files are read and written. AUTO, the default: NIXL's POSIX backend, or
    plain pread/pwrite where the installed NIXL lacks that plugin (said in the node's log
    and stats). The two read and write the same bytes at the same speed here (`kvfabric
    bench disk`); NIXL takes VRAM too where GDS is built in."""

    AUTO = "auto"
    NIXL = "nixl"  # NIXL's POSIX backend; a node whose NIXL lacks it fails to start
    POSIX = "posix"  # plain pread/pwrite


log = logging.getLogger(__name__)


def nixl_or_posix(path: Path, capacity: int, geometry: PageGeometry) -> PageFile:
    """A page file through NIXL's POSIX backend, or a plain one where NIXL cannot open it
    (its plugin missing from the wheel, an agent that does not start). A disk too small
    fails either way, so that error is not retried."""
    try:
        return NixlPageFile(path, capacity, geometry)
    except NixlFileError as e:
        log.warning("page file %s: NIXL failed (%s); using plain pread/pwrite", path, e)
        return PosixPageFile(path, capacity, geometry)


def page_file_io(store: DiskStore) -> DiskIO:
    """What the store's page files were opened with: NIXL or POSIX (AUTO resolved)."""
    nixl = [isinstance(f, NixlPageFile) for f in store.files.values()]
    return DiskIO.NIXL if nixl and all(nixl) else DiskIO.POSIX


_MAKERS: dict[DiskIO, PageFileMaker] = {
    DiskIO.AUTO: nixl_or_posix,
    DiskIO.NIXL: NixlPageFile,
    DiskIO.POSIX: PosixPageFile,
}
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


@dataclass(frozen=True)
class DiskConfig:
    """Each node keeps its disk pages in `folder`/<its name>/; capacities' `disk` says how
    many pages per pool. `sync`: what is flushed before a page's record (disk_store.py).
    `probe_bytes`: the file read back at start to measure the disk (disk_probe.py); 0: not
    measured, routers use the cost model's figure. `io`: how page files are read and
    written (DiskIO). `adopt_orphans`: a node whose folder does not exist yet claims an
    orphan beside it (a folder no live node owns, such as the one this host's node left
    under its earlier Ray node id), adopting its pages."""

    folder: str
    sync: Sync = Sync.NONE
    io: DiskIO = DiskIO.AUTO
    probe_bytes: int = 16 << 20
    adopt_orphans: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.folder, str) or not self.folder:
            raise ValueError(f"the disk folder must be a non-empty path, got {self.folder!r}")
        probe = self.probe_bytes
        if isinstance(probe, bool) or not isinstance(probe, int) or probe < 0:
            raise ValueError(f"probe_bytes must be a whole number >= 0, got {probe!r}")
        if not isinstance(self.adopt_orphans, bool):
            raise ValueError(f"adopt_orphans must be a bool, got {self.adopt_orphans!r}")
        object.__setattr__(self, "sync", Sync(self.sync))
        object.__setattr__(self, "io", DiskIO(self.io))


def open_store(
    name: str,
    config: DiskConfig | None,
    layout: KVLayout,
    capacities: Mapping[PoolName, PoolCapacity],
) -> DiskStore | None:
    """The node `name`'s disk store, or None where it has no disk tier. Its folder is
    `name`'s, or an orphan claimed and renamed to it (the store's `owner.moved_from` then
    names the orphan). FolderHeld where a live store holds the folder."""
    pages = {pool: cap.disk for pool, cap in capacities.items() if cap.disk}
    if config is None or not pages:
        if pages:
            raise ValueError(f"disk capacities {pages} but no disk folder configured")
        return None
    if not _NAME.fullmatch(name):
        raise ValueError(f"node name {name!r} cannot name a folder")
    folder = Path(config.folder) / name
    owner = None
    if config.adopt_orphans and not folder.exists():
        owner = claim_orphan(config.folder, name)
    return DiskStore(
        folder, layout, pages, sync=config.sync, page_file=_MAKERS[config.io], owner=owner
    )


def read_bandwidth(store: DiskStore | None, config: DiskConfig | None) -> float:
    """Bytes/s the node's disk reads, measured in its store's folder; 0.0 where it has no
    disk tier, is not to be measured, or the probe failed (it never stops a node)."""
    if store is None or config is None:
        return 0.0
    return read_bytes_per_s(store.folder, config.probe_bytes)
