"""How a node's page files are read and written (DiskIO): NIXL's POSIX backend by
default, plain pread/pwrite where the installed NIXL lacks that plugin (a wheel built
without it: simulated by pointing NIXL_PLUGIN_DIR at an empty folder, in a child process
as NIXL reads it once), and either reads what the other wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from kvfabric.actors.node.disk import DiskConfig, DiskIO, open_store, page_file_io
from kvfabric.core.cache.disk_records import PageMeta
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.pools import PoolCapacity

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=4, page_size=2, window=4)
CAPACITIES = {PoolName.FULL: PoolCapacity(4, 0, 8), PoolName.SWA: PoolCapacity(4, 0, 8)}


def write_pages(folder: Path, io: DiskIO) -> tuple[DiskIO, list[torch.Tensor]]:
    """Open a node's store with `io`, write a page to each pool, close it: what it opened
    with, and the pages."""
    config = DiskConfig(str(folder), io=io, probe_bytes=0)
    store = open_store("n0", config, LAYOUT, CAPACITIES)
    assert store is not None
    try:
        store.adopt()
        pages = []
        for i, pool in enumerate(LAYOUT.pools):
            page = torch.randn(
                1, *LAYOUT.page_shape(pool), generator=torch.Generator().manual_seed(i)
            )
            meta = PageMeta(bytes(16), 0, bytes([i + 1]) * 16, bytes(4 * LAYOUT.page_size))
            store.write(pool, store.alloc(pool, 1), page, [meta])
            pages.append(page)
        return page_file_io(store), pages
    finally:
        store.close()


def read_pages(folder: Path, io: DiskIO) -> tuple[DiskIO, list[torch.Tensor]]:
    """Reopen the store with `io`: what it opened with, and each pool's adopted page."""
    config = DiskConfig(str(folder), io=io, probe_bytes=0)
    store = open_store("n0", config, LAYOUT, CAPACITIES)
    assert store is not None
    try:
        found = {put.pool: put.slot for put in store.adopt().trusted}
        pages = []
        for pool in LAYOUT.pools:
            out = torch.empty(1, *LAYOUT.page_shape(pool))
            store.read(pool, [found[pool]], out)
            pages.append(out)
        return page_file_io(store), pages
    finally:
        store.close()


def test_auto_takes_nixl_here_and_each_io_reads_what_the_other_wrote(tmp_path: Path):
    assert DiskConfig(str(tmp_path)).io is DiskIO.AUTO
    used, written = write_pages(tmp_path, DiskIO.AUTO)
    assert used is DiskIO.NIXL
    used, read = read_pages(tmp_path, DiskIO.POSIX)
    assert used is DiskIO.POSIX
    assert all(torch.equal(a, b) for a, b in zip(written, read))

    again = tmp_path / "again"
    _, written = write_pages(again, DiskIO.POSIX)
    used, read = read_pages(again, DiskIO.NIXL)
    assert used is DiskIO.NIXL
    assert all(torch.equal(a, b) for a, b in zip(written, read))


CHILD = """
import json, sys
from pathlib import Path
from tests.actors.test_disk_io import DiskIO, read_pages, write_pages
folder = Path(sys.argv[1])
used, written = write_pages(folder, DiskIO.AUTO)
again, read = read_pages(folder, DiskIO.AUTO)
same = all(a.equal(b) for a, b in zip(written, read))
try:
    write_pages(folder / "nixl", DiskIO.NIXL)
    refused = ""
except Exception as e:
    refused = f"{type(e).__name__}: {e}"
print(json.dumps({"used": [used.value, again.value], "same": same, "refused": refused}))
"""


def test_without_nixls_posix_plugin_auto_falls_back_and_nixl_is_refused(tmp_path: Path):
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    env = {**os.environ, "NIXL_PLUGIN_DIR": str(empty), "KVF_HYPOTHESIS": "ci"}
    root = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "disk")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["used"] == ["posix", "posix"] and got["same"]
    assert "NIXL failed" in child.stderr and "plain pread/pwrite" in child.stderr
    assert got["refused"].startswith("NixlFileError") and "NIXL" in got["refused"]
