"""A node opening its disk tier in a folder that does not exist yet (a node new to this
host, or one back under a new Ray node id) claims an orphan beside it: a folder no live
store holds. It is renamed to the node's name and its pages adopted; one a live process
holds is never claimed, nor is one orphan claimed twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from kvfabric.actors.node.disk import DiskConfig, open_store
from kvfabric.core.cache.disk_journal import JOURNAL
from kvfabric.core.cache.disk_records import PageMeta
from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.folder_lock import LOCK_NAME, FolderHeld, FolderLock
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.orphan_folder import claim_orphan
from kvfabric.core.cache.pools import PoolCapacity

from tests.core.test_disk_store import CAPACITY as HELD_CAPACITY
from tests.core.test_disk_store import LAYOUT as HELD_LAYOUT
from tests.core.test_disk_store import hold, lines

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=4, page_size=2, window=4)
CAPACITIES = {PoolName.FULL: PoolCapacity(4, 0, 8), PoolName.SWA: PoolCapacity(4, 0, 8)}


def config(folder: Path, **kw) -> DiskConfig:
    return DiskConfig(str(folder), probe_bytes=0, **kw)


def opened(folder: Path, name: str, **kw) -> DiskStore:
    store = open_store(name, config(folder, **kw), LAYOUT, CAPACITIES)
    assert store is not None
    return store


def claims(store: DiskStore, old: str, pages: int) -> None:
    """`store` took over `old`'s folder and adopts its `pages` pages; then it closes."""
    try:
        assert store.owner.moved_from == old
        assert len(store.adopt().trusted) == pages
    finally:
        store.close()


def stored(folder: Path, name: str, pages: int) -> None:
    """Node `name` writes `pages` pages to its own disk folder, then ends."""
    store = opened(folder, name, adopt_orphans=False)
    store.adopt()
    if not pages:
        store.close()
        return
    slots = store.alloc(PoolName.FULL, pages)
    metas = [PageMeta(bytes(16), i, i.to_bytes(16, "little"), bytes(8)) for i in range(pages)]
    shape = LAYOUT.page_shape(PoolName.FULL)
    store.write(
        PoolName.FULL,
        slots,
        torch.stack([torch.full(shape, float(i)) for i in range(pages)]),
        metas,
    )
    store.close()


def folders(parent: Path) -> set[str]:
    return {p.name for p in parent.iterdir()}


def test_a_new_node_claims_an_orphan_and_adopts_its_pages(tmp_path):
    stored(tmp_path, "kvf-node-old", 5)
    store = opened(tmp_path, "kvf-node-new")
    assert store.folder == tmp_path / "kvf-node-new"
    assert folders(tmp_path) == {"kvf-node-new"}  # renamed, not copied
    claims(store, "kvf-node-old", 5)
    # Back under its own name, a node opens its own folder: nothing claimed, pages kept.
    store = opened(tmp_path, "kvf-node-new")
    assert store.owner.moved_from == "" and len(store.adopt().trusted) == 5
    store.close()


def test_an_orphan_holding_pages_is_claimed_before_a_newer_one_holding_none(tmp_path):
    """A node that died as it started leaves a journal holding no record, newer than the
    folder of the node before it, which holds pages: that one is claimed, the empty one
    left for later."""
    stored(tmp_path, "kvf-node-old", 4)
    stored(tmp_path, "kvf-node-died-at-start", 0)
    old, empty = (tmp_path / n / JOURNAL for n in ("kvf-node-old", "kvf-node-died-at-start"))
    os.utime(old, (1_000_000, 1_000_000))  # written long before the empty one
    assert empty.stat().st_mtime > old.stat().st_mtime
    claims(opened(tmp_path, "kvf-node-new"), "kvf-node-old", 4)
    assert folders(tmp_path) == {"kvf-node-new", "kvf-node-died-at-start"}


def test_a_folder_a_live_store_holds_is_not_claimed(tmp_path):
    stored(tmp_path, "kvf-node-old", 3)
    alive = opened(tmp_path, "kvf-node-old")
    try:
        store = opened(tmp_path, "kvf-node-new")
        assert store.owner.moved_from == "" and store.adopt().trusted == []
        store.close()
        assert alive.folder.exists() and len(alive.adopt().trusted) == 3
        # Nor may a node open a folder a live store holds.
        with pytest.raises(FolderHeld, match="in use"):
            opened(tmp_path, "kvf-node-old")
    finally:
        alive.close()


def test_a_folder_another_process_holds_is_not_claimed_until_it_is_killed_9(tmp_path):
    proc = hold(tmp_path / "kvf-node-old")  # a live store, 3 pages written
    try:
        assert claim_orphan(tmp_path, "kvf-node-new") is None
        assert folders(tmp_path) == {"kvf-node-old"}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    capacities = {pool: PoolCapacity(4, 0, n) for pool, n in HELD_CAPACITY.items()}
    store = open_store("kvf-node-new", config(tmp_path), HELD_LAYOUT, capacities)
    assert store is not None
    claims(store, "kvf-node-old", 3)


def test_a_bare_flock_holder_keeps_its_folder(tmp_path):
    """Only the lock counts: a process holding the lock file's flock, store or not."""
    stored(tmp_path, "kvf-node-old", 2)
    code = textwrap.dedent(
        f"""
        import fcntl, os, time
        fd = os.open({str(tmp_path / "kvf-node-old" / LOCK_NAME)!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert lines(proc, 1) == ["locked"]
        store = opened(tmp_path, "kvf-node-new")
        assert store.owner.moved_from == "" and store.adopt().trusted == []
        store.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert (tmp_path / "kvf-node-old").exists()


def test_a_folder_from_before_lock_files_is_claimed(tmp_path):
    stored(tmp_path, "kvf-node-old", 4)
    (tmp_path / "kvf-node-old" / LOCK_NAME).unlink()
    claims(opened(tmp_path, "kvf-node-new"), "kvf-node-old", 4)


def test_adopt_orphans_off_starts_empty(tmp_path):
    stored(tmp_path, "kvf-node-old", 4)
    store = opened(tmp_path, "kvf-node-new", adopt_orphans=False)
    assert store.owner.moved_from == "" and store.adopt().trusted == []
    store.close()
    assert folders(tmp_path) == {"kvf-node-old", "kvf-node-new"}
    with pytest.raises(ValueError, match="adopt_orphans"):
        config(tmp_path, adopt_orphans="no")


def test_orphans_go_most_recently_written_first_and_never_twice(tmp_path):
    for i, name in enumerate(["kvf-node-a", "kvf-node-b", "kvf-node-c"]):
        stored(tmp_path, name, 1 + i)
    for when, name in [(1000, "kvf-node-a"), (3000, "kvf-node-b"), (2000, "kvf-node-c")]:
        os.utime(tmp_path / name / JOURNAL, (when, when))
    (tmp_path / "not-a-store").mkdir()  # no journal: never a candidate
    (tmp_path / "a-file").write_bytes(b"x")
    got = []
    stores = [opened(tmp_path, f"kvf-node-n{i}") for i in range(4)]
    try:
        for store in stores:
            got.append((store.owner.moved_from, len(store.adopt().trusted)))
    finally:
        for store in stores:
            store.close()
    assert got == [("kvf-node-b", 2), ("kvf-node-c", 3), ("kvf-node-a", 1), ("", 0)]


@pytest.mark.parametrize("orphans", [1, 3])
def test_claimers_racing_never_share_an_orphan(tmp_path, orphans):
    for round_ in range(10):
        parent = tmp_path / str(round_)
        for i in range(orphans):
            stored(parent, f"kvf-node-old{i}", 1)
        claimers = 6
        start = threading.Barrier(claimers)
        claims: list[FolderLock | None] = [None] * claimers

        def claim(i: int) -> None:
            start.wait()
            claims[i] = claim_orphan(parent, f"kvf-node-new{i}")

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        won = [c for c in claims if c is not None]
        try:
            assert sorted(c.moved_from for c in won) == [f"kvf-node-old{i}" for i in range(orphans)]
            assert folders(parent) == {c.folder.name for c in won}
            assert all(c.holds(c.folder) for c in won)
        finally:
            for c in won:
                c.release()
