"""Shared-memory staging pages between a node's cache and an engine on the same host.

An engine process (vLLM's worker) and the node actor both map the same files in
/dev/shm, one per pool, laid out as the fabric's pages ([n, layers, 2, page, heads,
dim]). The engine copies its KV blocks in or out; the node actor copies between
these pages and its cache. Bytes never go through Ray's object store or pickling:
a Ray call carries only token ids and page numbers.

The files' space is reserved when they are made (posix_fallocate): a tmpfs that cannot
hold them fails that step with an error naming the size, instead of a SIGBUS at the
first write into a page it never backed. What a caller names (a spec, slots, first
pages) is checked at each entry before any file is touched.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from kvfabric.core.cache.insert import Unlocked
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.put_rows import PagedKV
from kvfabric.core.wire import is_int

SHM_DIR = Path("/dev/shm")
MAX_PAGES = 1 << 20
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,159}")


class StagingError(ValueError):
    """A staging spec, slot list or first page that is not valid; nothing was touched."""


class StagingSpaceError(OSError):
    """The staging files do not fit in the shared-memory folder."""

    def __str__(self) -> str:
        return str(self.strerror)  # the sizes and what to do, without "[Errno 28]"


@dataclass(frozen=True)
class StagingSpec:
    """Where the staging files are and how many pages each holds."""

    prefix: str  # file name prefix under SHM_DIR: letters, digits, ".", "_", "-"
    pages: int

    def __post_init__(self) -> None:
        check_spec(self)

    def path(self, pool: PoolName) -> Path:
        return SHM_DIR / f"{self.prefix}-{pool.name.lower()}"

    def bytes_needed(self, layout: KVLayout) -> int:
        return sum(self.pages * layout.page_bytes(pool) for pool in layout.pools)


def check_spec(spec: Any) -> StagingSpec:
    """`spec` as a valid StagingSpec (a spec that came through pickling skipped its
    constructor's check: every entry that takes one from outside calls this)."""
    if not isinstance(spec, StagingSpec):
        raise StagingError(f"expected a StagingSpec, got {type(spec).__name__}")
    prefix, pages = spec.prefix, spec.pages
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise StagingError(
            f"a staging prefix is 1-160 letters, digits, '.', '_' or '-' (not first), "
            f"got {prefix!r:.80}"
        )
    if type(pages) is not int or not 0 < pages <= MAX_PAGES:
        raise StagingError(f"staging pages must be an int in 1..{MAX_PAGES}, got {pages!r:.40}")
    return spec


def check_slots(
    slots: Any, spec: StagingSpec, pools: Sequence[PoolName]
) -> dict[PoolName, list[int]]:
    """Slots a caller names: for pools of the layout, distinct ints in [0, spec.pages)."""
    if not isinstance(slots, Mapping):
        raise StagingError(f"slots must map pools to slot lists, got {type(slots).__name__}")
    out = {}
    for key, idx in slots.items():
        if key not in pools:
            raise StagingError(f"slots for {key!r:.40}, not a pool of this layout")
        pool = PoolName(key)  # a plain int equal to a pool's value names that pool
        if not isinstance(idx, (list, tuple)) or len(idx) > spec.pages:
            raise StagingError(f"{pool.name} slots must be a list of at most {spec.pages}")
        if not all(is_int(i) and 0 <= i < spec.pages for i in idx) or len(set(idx)) != len(idx):
            raise StagingError(
                f"{pool.name} slots must be distinct ints in [0, {spec.pages}), got {idx!r:.80}"
            )
        out[pool] = list(idx)
    return out


def check_space(spec: StagingSpec, layout: KVLayout) -> None:
    """Refuse, naming the size and how to raise it, staging that the shared-memory folder
    cannot hold beside what is there (an engine calls this before it starts)."""
    need = spec.bytes_needed(layout)
    have = sum(spec.path(p).stat().st_size for p in layout.pools if spec.path(p).exists())
    free = shutil.disk_usage(SHM_DIR).free
    if need - have > free:
        raise StagingSpaceError(errno.ENOSPC, _space_message(need, free))


def _space_message(need: int, free: int) -> str:
    return (
        f"staging needs {need / 2**20:.1f} MiB in {SHM_DIR}, {free / 2**20:.1f} MiB free: "
        "make it larger (Docker: --shm-size; Kubernetes: an emptyDir with medium: Memory "
        "and a sizeLimit mounted at /dev/shm) or lower the connector's staging_pages"
    )


class StagingPages:
    """The staging pages of every pool of `layout`, mapped shared (created if missing)."""

    def __init__(self, spec: StagingSpec, layout: KVLayout) -> None:
        self.spec = spec
        self.layout = layout
        self.pools: dict[PoolName, torch.Tensor] = {}
        made: list[Path] = []  # a later pool that does not fit takes these back with it
        try:
            for pool in layout.pools:
                shape = (spec.pages, *layout.page_shape(pool))
                numel = 1
                for d in shape:
                    numel *= d
                path = spec.path(pool)
                if _ensure_file(path, numel * layout.torch_dtype.itemsize):
                    made.append(path)
                flat = torch.from_file(str(path), shared=True, size=numel, dtype=layout.torch_dtype)
                _populate(flat)
                self.pools[pool] = flat.view(shape)
        except BaseException:
            for path in made:
                path.unlink(missing_ok=True)
            raise

    def unlink(self) -> None:
        for pool in self.pools:
            try:
                self.spec.path(pool).unlink()
            except FileNotFoundError:
                continue  # already gone: unlinking is idempotent


MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module names it from 3.13 on


def _populate(mapped: torch.Tensor) -> bool:
    """Fault in the page table of a shared mapping now (its pages are reserved already),
    without changing a byte: else the first copy through it takes a fault per 4 KiB page,
    about twice the copy's time, on the first hit or save. False where the kernel cannot
    (before 5.14): the first copy then pays it."""
    nbytes = mapped.numel() * mapped.element_size()
    if nbytes == 0 or _madvise is None:
        return False
    return _madvise(mapped.data_ptr(), nbytes, MADV_POPULATE_WRITE) == 0


def _libc_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _ensure_file(path: Path, size: int) -> bool:
    """Make `path` hold `size` reserved bytes; True if this call created it."""
    # O_CREAT without O_EXCL: the engine's processes and the node actor may race to
    # create it; ftruncate to the same size and fallocate are idempotent.
    made = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        # tmpfs backs a page at its first write, and a full one answers that write with
        # SIGBUS: reserve every page now, where running out is an error that says so.
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if made:
            path.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            free = shutil.disk_usage(path.parent).free
            raise StagingSpaceError(e.errno, _space_message(size, free)) from None
        raise
    finally:
        os.close(fd)
    return made


@dataclass
class StagedHit:
    """What `load_to_staging` put in the staging pages: each pool's KV for pages
    [firsts[pool], pages). The load starts at `first_page`; a pool whose policy needs
    less (a window) starts later."""

    pages: int = 0
    first_page: int = 0
    firsts: dict[PoolName, int] = field(default_factory=dict)
    host_pages: int = 0  # of those pages, how many came from the host tier (or disk)
    slots: dict[PoolName, list[int]] = field(default_factory=dict)


def load_to_staging(
    cache: NodeCache,
    shared: StagingPages,
    tokens: Sequence[int],
    namespace: str,
    skip_pages: int,
    slots: dict[PoolName, list[int]],
) -> StagedHit:
    """Copy the usable cached prefix of `tokens` beyond `skip_pages` into staging `slots`
    (the pool's i-th staged page goes to slots[pool][i]); nothing if they are too few."""
    layout = cache.layout
    ps = layout.page_size
    slots = check_slots(slots, shared.spec, layout.pools)
    if not is_int(skip_pages) or skip_pages < 0:
        raise StagingError(f"skip_pages must be an int >= 0, got {skip_pages!r:.40}")
    # The pool's pages are copied straight into the slots (one pass).
    sinks = {p: (shared.pools[p], s) for p, s in slots.items()}
    hit = cache.get(tokens, namespace, first_page=skip_pages, into=sinks)
    n = hit.tokens // ps
    if n <= skip_pages:
        return StagedHit()
    # Each pool stages pages [firsts[pool], n): from skip_pages for full attention, the
    # window before n for SWA. A shorter load than the hit would need the SWA window before
    # its own end, which the hit does not carry: a pool with too few slots loads nothing.
    firsts = {pool: start // ps for pool, start in hit.starts.items()}
    if any(len(slots.get(p, ())) < n - first for p, first in firsts.items()):
        return StagedHit()
    out = StagedHit(n, skip_pages, firsts, hit.host_tokens // ps)
    for pool, first in firsts.items():
        if first == n:
            continue
        dst = slots[pool][: n - first]
        if pool not in hit.sinks:  # gathered elsewhere (device memory): one scatter
            staged = shared.pools[pool]
            staged.index_copy_(0, torch.tensor(dst, dtype=torch.long), hit.pages[pool].to("cpu"))
        out.slots[pool] = dst
    return out


def save_from_staging(
    cache: NodeCache,
    shared: StagingPages,
    tokens: Sequence[int],
    namespace: str,
    slots: dict[PoolName, list[int]],
    firsts: Mapping[PoolName, int],
    unlocked: Unlocked | None = None,
) -> int:
    """Store the whole pages of `tokens` from staging: a pool's KV of page firsts[pool] + i
    in slots[pool][i] (pools not in `firsts` from page 0). Full KV from a later page grows
    the cache only where it holds every page before (NodeCache.put). `tokens` are those
    the engine computed, a partial last page included: on a page end, the put keeps the
    window a repeat of them needs too (NodeCache.put). `unlocked` wraps the copy
    (NodeCache.put). Returns pages newly stored."""
    layout = cache.layout
    ps = layout.page_size
    n = len(tokens) // ps
    slots = check_slots(slots, shared.spec, layout.pools)
    if (
        not isinstance(firsts, Mapping)
        or set(firsts) - set(layout.pools)
        or not all(is_int(f) and f >= 0 for f in firsts.values())
    ):
        raise StagingError(
            f"first pages must be ints >= 0 for pools of the layout, got {firsts!r:.80}"
        )
    rows: dict[PoolName, list[int]] = {}
    starts: dict[PoolName, int] = {}
    for pool in layout.pools:
        first = firsts.get(pool, 0)
        idx = slots.get(pool, [])
        if len(idx) != n - first:
            raise StagingError(f"{pool.name}: {len(idx)} staged pages for positions [{first}, {n})")
        starts[pool] = first * ps  # rows before it were never staged: not stored
        rows[pool] = idx
    # The slots are read where they lie: the put copies the pages it stores once.
    staged = PagedKV({p: shared.pools[p] for p in layout.pools}, rows)
    return cache.put(tokens, staged, namespace, starts=starts, unlocked=unlocked)
