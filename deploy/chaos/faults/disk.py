"""DiskFaults: what a chaos node's disk tier suffers, through its store's write hook
(DiskStore.hook): a kill -9 between a write's page bytes and their records, a full disk
(the journal refuses the next few appends, ENOSPC), or a byte of a page on disk flipped.
None of these may serve wrong KV or stop the node (disk_store.py says why)."""

from __future__ import annotations

import errno
import os
import random
import signal
from enum import Enum

from kvfabric.core.cache.disk_store import DiskStep, DiskStore
from kvfabric.core.cache.page_file import DiskFull

# How many writes in a row a full disk refuses the records of, before it has room again.
FULL_WRITES = 4


class DiskFault(str, Enum):
    KILL_MID_WRITE = "kill_mid_write"  # the process dies (-9) with pages written, unrecorded
    FULL = "full"  # the next FULL_WRITES writes' records find no room
    CORRUPT_PAGE = "corrupt_page"  # a byte of a page on disk flips (NodeChaos.after_get)


class DiskFaults:
    """The write hook of one node's disk store, idle until armed."""

    def __init__(self) -> None:
        self.store: DiskStore | None = None
        self.armed: DiskFault | None = None
        self.injected = 0
        self._refuse = 0  # writes a full disk still refuses the records of
        self._rng = random.Random(0)

    def attach(self, store: DiskStore) -> None:
        self.store = store
        store.hook = self

    def arm(self, fault: DiskFault) -> None:
        self.armed = DiskFault(fault)

    def disarm(self) -> None:
        self.armed = None
        self._refuse = 0

    def __call__(self, step: DiskStep) -> None:
        if step is not DiskStep.RECORD:
            return
        if self.armed is DiskFault.KILL_MID_WRITE:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.armed is DiskFault.FULL:
            self.armed = None
            self.injected += 1
            self._refuse = FULL_WRITES
        if self._refuse:
            self._refuse -= 1
            raise DiskFull(f"injected: {os.strerror(errno.ENOSPC)}")

    def corrupt(self) -> bool:
        """Flip a byte of one page on disk, if any is there (the store keeps writing
        and reading it: its next read must find the page corrupt)."""
        store = self.store
        if store is None or self.armed is not DiskFault.CORRUPT_PAGE:
            return False
        held = [(pool, slot) for pool, sums in store.sums.items() for slot in sums]
        if not held:
            return False
        pool, slot = self._rng.choice(sorted(held))
        size = store.files[pool].geometry.nbytes
        with open(store.data_path(pool), "r+b") as f:
            f.seek(slot * size + size // 2)
            byte = f.read(1)
            f.seek(slot * size + size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        self.armed = None
        self.injected += 1
        return True
