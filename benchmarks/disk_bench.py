"""Page write and read bandwidth of the disk tier's store, against plain file I/O.

The store (core/cache/disk_store.py) writes pages of the vLLM demo model's geometry (8
layers, 2 KV heads x 64, fp32, pages of 32 tokens: 256 KiB a page, all layers in one
pool) in batches (`--batch` pages a call: one pwritev per run of adjacent slots, a
SHA-256 checksum per page, one journal append), and reads them back in batches (each
page checked against its CRC-32C). The limits, measured in the same run on the same file
system (`--folder`): one sequential pwrite per batch of the same bytes into a plain file
of the same size; one sequential pread per batch of the same bytes from the store's own
page file (the same blocks: no luck of where a file lies). `ratio_write` and
`ratio_read` are the store's bandwidth over the limit's (1.0: at the limit). Each page
file the store can use is measured (`--page-files`: plain POSIX I/O, NIXL's POSIX
backend); the top-level ratios are the first's.

Page cache: both sides end each write pass with fdatasync and
posix_fadvise(POSIX_FADV_DONTNEED), and drop the file again before each read pass, so
where the kernel honours the advice both read from the disk; where it does not (tmpfs,
some overlay file systems) both read from the page cache, which is a memory copy.
Nothing here can drop the caches of other files (no root), so the folder's file system
is printed with the figures.

Steady state: one warm-up pass of each side first (page faults of the buffers, the
files' first blocks), then `--repeat` passes: all the writes, then all the reads, the two
sides alternating (the reads change which goes first each pass) so that both see the
same disk. Bandwidths are medians over passes; a ratio is the median of each pass's
ratio. Python's collector runs before each pass and is off while timing.
Run: .venv/bin/kvfabric bench disk [--folder DIR] [--pages N] [--batch N] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from kvfabric.core.cache.disk_records import PageMeta, page_checksum
from kvfabric.core.cache.disk_store import DiskStore, PageFileMaker
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.page_file import PosixPageFile, page_rows

LAYOUT = KVLayout(layers=("full",) * 8, kv_heads=2, head_dim=64, page_size=32, tag="disk-bench")
POOL = PoolName.FULL


def page_files() -> dict[str, PageFileMaker]:
    from kvfabric.transport.nixl_file import NixlPageFile

    return {"posix": PosixPageFile, "nixl": NixlPageFile}


def file_system(folder: Path) -> str:
    """The type of the file system holding `folder` (the longest mount point above it)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, point, fs, *_ = line.split()
            if str(folder).startswith(point) and len(point) > len(best):
                best, kind = point, fs
    except OSError:
        pass  # no /proc here: the report says "unknown", the figures stand
    return kind


def drop(fd: int) -> None:
    """Write the file back and ask the kernel to forget its pages."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn: Callable[[], None]) -> float:
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    finally:
        gc.enable()


def run(folder: Path, pages: int, batch: int, repeat: int, kinds: list[str]) -> dict:
    torch.set_num_threads(1)
    nbytes = LAYOUT.page_bytes(POOL)
    src = torch.randn(batch, *LAYOUT.page_shape(POOL))
    dst = torch.empty_like(src)
    src_rows, dst_rows = page_rows(src), page_rows(dst)
    batches = [list(range(i, min(i + batch, pages))) for i in range(0, pages, batch)]
    metas = [
        PageMeta(bytes(16), i, i.to_bytes(16, "little"), bytes(4 * LAYOUT.page_size))
        for i in range(pages)
    ]

    plain_path = folder / "plain.bin"
    plain = os.open(plain_path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(plain, 0, pages * nbytes)
    whole = memoryview(src_rows.reshape(-1))
    into = memoryview(dst_rows.reshape(-1))

    def plain_write() -> None:
        for b in batches:
            os.pwrite(plain, whole[: len(b) * nbytes], b[0] * nbytes)
        drop(plain)

    rows = []
    try:
        for kind in kinds:
            store = DiskStore(folder / kind, LAYOUT, {POOL: pages}, page_file=page_files()[kind])
            store.adopt()
            slots = store.alloc(POOL, pages)
            file = store.files[POOL]
            data_fd = os.open(folder / kind / f"{POOL.name}.pages", os.O_RDONLY)
            if slots != list(range(slots[0], slots[0] + pages)):
                raise RuntimeError("a fresh store gave slots that are not adjacent")
            first = slots[0] * nbytes

            def plain_read() -> None:
                for b in batches:
                    os.preadv(data_fd, [into[: len(b) * nbytes]], first + b[0] * nbytes)

            def store_write() -> None:
                for b in batches:
                    store.write(POOL, [slots[i] for i in b], src[: len(b)], metas[b[0] : b[-1] + 1])
                file.sync()
                os.posix_fadvise(data_fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def store_read() -> None:
                for b in batches:
                    store.read(POOL, [slots[i] for i in b], dst[: len(b)])

            times: dict[str, list[float]] = {k: [] for k in ("sw", "pw", "sr", "pr")}
            try:
                for _ in range(repeat + 1):  # the first pass of each: warm-up
                    times["sw"].append(timed(store_write))
                    times["pw"].append(timed(plain_write))
                # The reads after every write: the disk still writing back would slow
                # whichever read ran beside it.
                for i in range(repeat + 1):
                    reads = [("sr", store_read), ("pr", plain_read)]
                    for name, read in reads if i % 2 == 0 else reads[::-1]:
                        os.posix_fadvise(data_fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        times[name].append(timed(read))
                store.read(POOL, [slots[0]], dst[:1])
                if not torch.equal(dst[0], src[0]):
                    raise RuntimeError("the store read back other bytes than it wrote")
                plain_read()  # the limit read the same bytes
                if not torch.equal(dst[: len(batches[-1])], src[: len(batches[-1])]):
                    raise RuntimeError("the plain read of the store's file found other bytes")
            finally:
                os.close(data_fd)
                store.close()
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            # Ratios of the passes run side by side, then their median: the disk's speed
            # drifts between passes (0.6 to 2.7 GB/s for the same plain read here), and a
            # pair shares its moment.
            ratio = {
                side: statistics.median(p / s for p, s in zip(times[plain][1:], times[ours][1:]))
                for side, ours, plain in (("write", "sw", "pw"), ("read", "sr", "pr"))
            }
            total = pages * nbytes
            rows.append(
                {
                    "page_file": kind,
                    "write_gbps": round(total / med["sw"] / 1e9, 3),
                    "read_gbps": round(total / med["sr"] / 1e9, 3),
                    "plain_write_gbps": round(total / med["pw"] / 1e9, 3),
                    "plain_read_gbps": round(total / med["pr"] / 1e9, 3),
                    "ratio_write": round(ratio["write"], 3),
                    "ratio_read": round(ratio["read"], 3),
                }
            )
    finally:
        os.close(plain)
        plain_path.unlink(missing_ok=True)
    t = time.perf_counter()
    for row in src_rows:
        page_checksum(row)
    checksum_gbps = len(src_rows) * nbytes / (time.perf_counter() - t) / 1e9
    return {
        "name": "disk",
        "file_system": file_system(folder.resolve()),
        "page_bytes": nbytes,
        "pages": pages,
        "batch": batch,
        "ratio_write": rows[0]["ratio_write"],
        "ratio_read": rows[0]["ratio_read"],
        "checksum_gbps": round(checksum_gbps, 3),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench disk", description=__doc__)
    ap.add_argument("--folder", default=".", help="where the files go (the disk measured)")
    ap.add_argument("--pages", type=int, default=1024, help="pages written and read a pass")
    ap.add_argument("--batch", type=int, default=64, help="pages a write or read call")
    ap.add_argument("--repeat", type=int, default=15, help="timed passes (the median counts)")
    ap.add_argument("--page-files", nargs="+", choices=("posix", "nixl"), default=["posix", "nixl"])
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    if args.pages < 1 or args.batch < 1 or args.repeat < 1:
        ap.error("--pages, --batch and --repeat must be >= 1")
    with tempfile.TemporaryDirectory(prefix="kvf-disk-bench-", dir=args.folder) as folder:
        r = run(Path(folder), args.pages, args.batch, args.repeat, args.page_files)
    print(
        f"{r['pages']} pages of {r['page_bytes'] >> 10} KiB, {r['batch']} a call, on "
        f"{r['file_system']} (SHA-256 page checksums: {r['checksum_gbps']} GB/s):"
    )
    for row in r["rows"]:
        print(
            f"  {row['page_file']:>5}: write {row['write_gbps']} GB/s against plain "
            f"{row['plain_write_gbps']} (ratio {row['ratio_write']}), read "
            f"{row['read_gbps']} GB/s against plain {row['plain_read_gbps']} "
            f"(ratio {row['ratio_read']}; 1.0: the limit)"
        )
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
