"""A page file through NIXL's POSIX backend (core.cache.page_file's `PageFile`).

The data file is opened and preallocated as `PosixPageFile` does it, registered once
as a FILE_SEG (offset, length, fd); each write or read registers the caller's tensor
as DRAM, posts one local WRITE (DRAM -> file) or READ (file -> DRAM) with a descriptor
per stretch of pages adjacent both in the file and in the tensor, and waits for it
with a bounded deadline (paced as transport waits are). Where GDS is present the same
calls take VRAM; here, POSIX only.

Failures raise `NixlFileError` (or `NixlFileTimeout`): both a transport
`TransferError` and a page file's `PageFileError`, so the disk store handles them as
any page file's. A transfer given up at its deadline is held, not released (NIXL's
POSIX backend cannot cancel I/O in flight: releasing it could free what the kernel
still writes); its tensor's bytes are undefined, and `close` releases it.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from kvfabric.core.cache.page_file import (
    PageFileError,
    PageGeometry,
    check_io,
    open_data_file,
    sync_data_file,
)

from .base import BackendError, TransferTimeout
from .nixl_transport import _NIXL_ERRORS, _nb, quietly
from .pacer import PollPacer
from .runs import merge_runs, order_pairs

_names = itertools.count()


class NixlFileError(BackendError, PageFileError):
    """NIXL's POSIX backend failed a page file's I/O (its exception as __cause__)."""


class NixlFileTimeout(TransferTimeout, PageFileError):
    """A page file's I/O did not complete within its deadline; held, not cancelled."""


class NixlPageFile:
    """`PageFile` over NIXL's POSIX backend. Not thread-safe."""

    def __init__(
        self,
        path: Path,
        capacity: int,
        geometry: PageGeometry,
        *,
        deadline_s: float = 30.0,
        backend_params: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.geometry = geometry
        self.deadline_s = deadline_s
        self._held: list[tuple[int, Any]] = []  # (request, DRAM registration) given up
        self._fd: int | None = None
        self._fd, self.valid_slots = open_data_file(self.path, capacity, geometry.nbytes)
        cfg = _nb.nixlAgentConfig()
        cfg.useProgThread = False  # a local transfer progresses as it is polled
        cfg.useListenThread = False
        self.name = f"kvf-file-{os.getpid()}-{next(_names)}"
        try:
            self._agent = _nb.nixlAgent(self.name, cfg)
            self._backends = [self._agent.createBackend("POSIX", dict(backend_params or {}))]
            self._file_reg = _nb.nixlRegDList(
                _nb.FILE_SEG, [(0, capacity * geometry.nbytes, self._fd, "")]
            )
            if capacity:
                self._agent.registerMem(self._file_reg, self._backends)
        except _NIXL_ERRORS as e:
            os.close(self._fd)
            self._fd = None
            raise NixlFileError(f"opening {self.path} in NIXL: {type(e).__name__}: {e}") from e

    def write(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        idx = check_io(self.geometry, self.capacity, slots, pages, "page file write")
        self._transfer(_nb.NIXL_WRITE, idx, pages, "writing")

    def read(self, slots: Sequence[int], out: torch.Tensor) -> None:
        idx = check_io(self.geometry, self.capacity, slots, out, "page file read")
        self._transfer(_nb.NIXL_READ, idx, out, "reading")

    def sync(self) -> None:
        sync_data_file(self._require_open(), self.path)

    def close(self) -> None:
        if self._fd is None:
            return
        for xfer, reg in self._held:
            quietly(self._agent.releaseXferReq, xfer)
            quietly(self._agent.deregisterMem, reg, self._backends)
        self._held.clear()
        if self.capacity:
            quietly(self._agent.deregisterMem, self._file_reg, self._backends)
        del self._agent
        os.close(self._fd)
        self._fd = None

    def _transfer(self, op: Any, idx: np.ndarray, tensor: torch.Tensor, what: str) -> None:
        fd = self._require_open()
        if not len(idx):
            return
        size = self.geometry.nbytes
        slots, rows = order_pairs(idx, np.arange(len(idx), dtype=np.int64))
        runs = merge_runs(slots, rows)
        file_at, mem_at, length = runs.byte_ranges(size)
        base = tensor.data_ptr()
        mem = np.stack([base + mem_at, length, np.zeros_like(length)], axis=1).astype(np.uint64)
        fil = np.stack([file_at, length, np.full_like(length, fd)], axis=1).astype(np.uint64)
        where = f"{what} {len(idx)} pages of {self.path}"
        reg = _nb.nixlRegDList(_nb.DRAM_SEG, [(base, len(idx) * size, 0, "")])
        xfer: int | None = None
        try:
            self._agent.registerMem(reg, self._backends)
            xfer = self._agent.createXferReq(
                op,
                _nb.nixlXferDList(_nb.DRAM_SEG, mem),
                _nb.nixlXferDList(_nb.FILE_SEG, fil),
                self.name,
                "",
                self._backends,
            )
            status = self._agent.postXferReq(xfer, "")
            self._wait(xfer, status, where)
        except _NIXL_ERRORS as e:
            self._end(xfer, reg)
            raise NixlFileError(f"{where}: {type(e).__name__}: {e}") from e
        except NixlFileTimeout:
            assert xfer is not None  # it timed out waiting, so it was posted
            self._held.append((xfer, reg))
            raise
        except NixlFileError:
            self._end(xfer, reg)
            raise
        self._end(xfer, reg)

    def _wait(self, xfer: int, status: Any, where: str) -> None:
        start = time.monotonic()
        deadline = start + self.deadline_s
        pacer = PollPacer()
        while status == _nb.NIXL_IN_PROG:
            now = time.monotonic()
            if now >= deadline:
                raise NixlFileTimeout(f"{where}: not done after {now - start:.3f} s; held")
            nap = pacer.pause(now - start, deadline - now)
            if nap > 0:
                time.sleep(nap)
            status = self._agent.getXferStatus(xfer)
        if status != _nb.NIXL_SUCCESS:
            raise NixlFileError(f"{where}: status {status}")

    def _end(self, xfer: int | None, reg: Any) -> None:
        if xfer is not None:
            quietly(self._agent.releaseXferReq, xfer)
        quietly(self._agent.deregisterMem, reg, self._backends)

    def _require_open(self) -> int:
        if self._fd is None:
            raise NixlFileError(f"{self.path} is closed")
        return self._fd
