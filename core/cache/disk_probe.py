"""A disk's read bandwidth, measured once where a node opens its disk tier: a probe file
written, flushed, dropped from the page cache and read back. Routers weigh a disk hit by
it (deploy/placement/cost.py); 0.0 says unknown, and the cost model's figure serves."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)
PROBE_NAME = ".read-probe"  # in the store's folder; no page file or journal is named so
CHUNK = 1 << 20  # bytes per read, as a page batch reads


def read_bytes_per_s(folder: Path | str, nbytes: int, chunk: int = CHUNK) -> float:
    """Bytes per second read back from a file of `nbytes` in `folder`; 0.0 where `nbytes`
    is 0 or the probe failed (a full or read-only disk: it must never stop a node)."""
    if nbytes <= 0:
        return 0.0
    path = Path(folder) / PROBE_NAME
    try:
        _write(path, nbytes, chunk)
        return _read(path, nbytes, chunk)
    except OSError as e:
        log.warning(
            "measuring the disk read bandwidth in %s failed (%s): the cost model's figure serves",
            folder,
            e,
        )
        return 0.0
    finally:
        try:
            path.unlink()
        except OSError:
            pass  # never written, or the folder went away


def _write(path: Path, nbytes: int, chunk: int) -> None:
    block = os.urandom(min(chunk, nbytes))  # not compressible, as KV pages mostly are not
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)  # written back, so the page cache may drop it
        _drop_cached(fd)
    finally:
        os.close(fd)


def _drop_cached(fd: int) -> None:
    """Evict the file's pages, so the read comes from the disk. Where fadvise is missing
    or refused the read is still timed (then likely from memory); on tmpfs it gives memory
    speed either way, its pages being the page cache."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return  # refused: the read is timed all the same (see above), never an error


def _read(path: Path, nbytes: int, chunk: int) -> float:
    buffer = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        got = 0
        start = time.perf_counter()
        while got < nbytes:
            n = f.readinto(buffer[: min(chunk, nbytes - got)])
            if not n:
                raise OSError(f"the probe file ended at {got} of {nbytes} bytes")
            got += n
        elapsed = time.perf_counter() - start
    return nbytes / max(elapsed, 1e-9)
