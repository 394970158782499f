"""The disk store: a reopened folder serves exactly the pages whose bytes match their
records, whatever happened to it: a kill -9 mid-write, a full disk, corrupted or
truncated data files, another KV identity. A folder is one live store's at a time."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.disk_journal import Drop
from kvfabric.core.cache.disk_records import PageMeta
from kvfabric.core.cache.disk_store import CorruptPages, DiskStore, Sync
from kvfabric.core.cache.folder_lock import LOCK_NAME, FolderHeld, FolderLock
from kvfabric.core.cache.layout import KVLayout, PoolName

LAYOUT = KVLayout(layers=("full", "full", "swa"), kv_heads=1, head_dim=4, page_size=2, window=4)
CAPACITY = {PoolName.FULL: 32, PoolName.SWA: 8}


def page_of(pool: PoolName, key: bytes) -> torch.Tensor:
    """The page a key names: derived from it, so any reader can check it."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randn(LAYOUT.page_shape(pool), generator=gen)


def meta(n: int) -> PageMeta:
    return PageMeta(bytes(16), n, n.to_bytes(16, "little"), n.to_bytes(4, "little") * 2)


def write(store: DiskStore, pool: PoolName, keys: list[int]) -> dict[int, int]:
    """Write pages of `keys`; {slot: key}."""
    slots = store.alloc(pool, len(keys))
    metas = [meta(k) for k in keys]
    store.write(pool, slots, torch.stack([page_of(pool, m.key) for m in metas]), metas)
    return dict(zip(slots, keys))


def check_adopted(store: DiskStore) -> dict[tuple[PoolName, int], int]:
    """Adopt; every trusted page's bytes are its key's. {(pool, slot): key}."""
    adoption = store.adopt()
    out = {}
    for put in adoption.trusted:
        page = torch.empty(LAYOUT.page_shape(put.pool))
        store.read(put.pool, [put.slot], page[None])
        assert torch.equal(page, page_of(put.pool, put.meta.key)), put
        out[(put.pool, put.slot)] = put.meta.position
    return out


@pytest.mark.parametrize("sync", list(Sync))
def test_a_reopened_folder_serves_what_was_written(tmp_path, sync):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY, sync=sync)
    assert store.adopt().trusted == []
    full = write(store, PoolName.FULL, list(range(10)))
    swa = write(store, PoolName.SWA, [100, 101])
    gone = list(full)[:3]
    store.free(PoolName.FULL, gone)
    store.close()
    store = DiskStore(tmp_path, LAYOUT, CAPACITY, sync=sync)
    got = check_adopted(store)
    want = {(PoolName.FULL, s): k for s, k in full.items() if s not in gone}
    assert got == want | {(PoolName.SWA, s): k for s, k in swa.items()}
    # Adopted slots are in use; the rest are free.
    assert store.slots[PoolName.FULL].used_count == 7
    assert not set(store.alloc(PoolName.FULL, 25)) & {s for _, s in want}
    store.close()


def test_bad_writes_change_nothing(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    write(store, PoolName.FULL, [1])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    page = page_of(PoolName.FULL, meta(2).key)[None]
    with pytest.raises(ValueError, match="1 slots but 2 page metas"):
        store.write(PoolName.FULL, [5], page, [meta(2), meta(3)])
    with pytest.raises(ValueError, match="out of range"):
        store.write(PoolName.FULL, [32], page, [meta(2)])
    with pytest.raises(ValueError, match="want pages"):
        store.write(PoolName.SWA, [1], page, [meta(2)])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    store.close()


@given(
    hits=st.lists(st.tuples(st.booleans(), st.floats(0, 1), st.integers(0, 255)), max_size=8),
    cut=st.one_of(st.none(), st.integers(0, 32)),
)
def test_corruption_never_serves_a_wrong_page(tmp_path_factory, hits, cut):
    folder = tmp_path_factory.mktemp("s")
    store = DiskStore(folder, LAYOUT, CAPACITY)
    store.adopt()
    written = write(store, PoolName.FULL, list(range(20)))
    store.free(PoolName.FULL, list(written)[:4])
    store.close()
    data_file, journal = folder / "FULL.pages", folder / "journal"
    for in_journal, where, value in hits:
        path = journal if in_journal else data_file
        data = bytearray(path.read_bytes())
        data[min(int(where * len(data)), len(data) - 1)] = value
        path.write_bytes(bytes(data))
    if cut is not None:
        with open(data_file, "r+b") as f:
            f.truncate(cut * LAYOUT.page_bytes(PoolName.FULL))
    store = DiskStore(folder, LAYOUT, CAPACITY)
    got = check_adopted(store)  # every page served matches its key
    assert set(got.items()) <= {((PoolName.FULL, s), k) for s, k in written.items()}
    if not hits and cut is None:
        assert len(got) == 16
    store.close()


def test_a_truncated_data_file_loses_the_pages_past_its_end(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    write(store, PoolName.FULL, list(range(10)))
    store.close()
    with open(tmp_path / "FULL.pages", "r+b") as f:
        f.truncate(6 * LAYOUT.page_bytes(PoolName.FULL) + 3)
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    adoption = store.adopt()
    assert sorted(p.slot for p in adoption.trusted) == list(range(6))
    assert adoption.dropped == Counter({Drop.BEYOND_FILE: 4})
    store.close()
    # Dropped records were freed in the journal: the next open finds nothing to drop.
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert len(store.adopt().trusted) == 6 and not store.found.dropped
    store.close()


def test_another_identity_is_never_served(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    write(store, PoolName.FULL, list(range(4)))
    store.close()
    other = KVLayout(
        layers=("full", "full", "swa"), kv_heads=1, head_dim=4, page_size=2, window=4, tag="m=x"
    )
    store = DiskStore(tmp_path, other, CAPACITY)
    adoption = store.adopt()
    assert adoption.trusted == [] and adoption.dropped == Counter({Drop.IDENTITY: 4})
    assert adoption.identity == ["tag m: None vs 'x'"]
    store.close()


# A child writing pages in a loop (freeing the oldest when full), printing after each
# batch; the parent kills it (SIGKILL) or it hits its file size limit.
CHILD = textwrap.dedent(
    """
    import resource, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_disk_store import CAPACITY, LAYOUT, meta, page_of
    from kvfabric.core.cache.disk_store import DiskStore
    from kvfabric.core.cache.layout import PoolName
    from kvfabric.core.cache.page_file import PageFileError
    store = DiskStore({folder!r}, LAYOUT, CAPACITY)
    store.adopt()
    if {limit}:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, hard))
    held, n = [], 0
    while n < 100000:
        pool = PoolName.FULL if n % 3 else PoolName.SWA
        keys = [n + i for i in range(1 + n % 4)]
        n += len(keys)
        writing = False
        try:
            if store.slots[pool].free_count < len(keys):
                old = [s for p, s in held if p == pool][: len(keys) + 2]
                store.free(pool, old)
                held = [(p, s) for p, s in held if not (p == pool and s in old)]
                print("freed", pool.name, *old, flush=True)
            slots = store.alloc(pool, len(keys))
            writing = True
            metas = [meta(k) for k in keys]
            store.write(pool, slots, torch.stack([page_of(pool, m.key) for m in metas]), metas)
        except PageFileError as e:  # DiskFull (a FREE), or Unrecorded (a PUT)
            print("full", e, flush=True)
            # The store goes on once there is room again.
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
            if writing:  # a failed free frees its slots all the same
                store.free(pool, slots)
            slot = store.alloc(pool, 1)
            store.write(pool, slot, page_of(pool, meta(10**6).key)[None], [meta(10**6)])
            print("wrote", pool.name, f"{{slot[0]}}:{{10**6}}", flush=True)
            break
        held += [(pool, s) for s in slots]
        print("wrote", pool.name, *[f"{{s}}:{{k}}" for s, k in zip(slots, keys)], flush=True)
    """
)


def child(folder: Path, limit: int = 0) -> subprocess.Popen:
    code = CHILD.format(tests=str(Path(__file__).parent), folder=str(folder), limit=limit)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def lines(proc: subprocess.Popen, n: int, deadline_s: float = 60.0) -> list[str]:
    """The child's next `n` lines (fewer where it ends), within a deadline."""
    out: list[str] = []
    end = time.monotonic() + deadline_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(out) < n:
            left = end - time.monotonic()
            assert left > 0, f"the child wrote {len(out)} of {n} lines in {deadline_s} s"
            if sel.select(left):
                line = proc.stdout.readline()
                if not line:
                    break
                out.append(line.strip())
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_a_kill_9_mid_write_serves_only_whole_pages(tmp_path, seed):
    rng = random.Random(seed)
    proc = child(tmp_path)
    try:
        got = lines(proc, rng.randint(20, 200))
        assert len(got) > 10, proc.stderr.read() if proc.poll() is not None else got
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    adopted = check_adopted(store)  # each page's bytes are its key's
    assert adopted, "a killed writer left no page"
    # What the child had reported written and not overwritten since is there, unless
    # it was freed after the last line read.
    assert len(adopted) >= min(10, sum(CAPACITY.values()) // 2)
    store.close()


def test_a_full_disk_raises_and_keeps_the_pages_written_before(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.close()
    size = CAPACITY[PoolName.FULL] * LAYOUT.page_bytes(PoolName.FULL)  # the biggest file
    proc = child(tmp_path, limit=size)
    try:
        out = lines(proc, 10**6)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert out and out[-2].startswith("full"), (out[-3:], proc.stderr.read())
    assert "File too large" in out[-2] and out[-1].endswith(":1000000")
    assert any(line.startswith("freed") for line in out), "the child never reused a slot"
    # Exactly the pages reported written and not freed since are adopted, with their bytes.
    live: dict[tuple[PoolName, int], int] = {}
    for line in out[:-2] + out[-1:]:
        what, pool, *items = line.split()
        for item in items:
            if what == "freed":
                del live[(PoolName[pool], int(item))]
            else:
                slot, key = map(int, item.split(":"))
                live[(PoolName[pool], slot)] = key
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert check_adopted(store) == live
    # The store is usable after the restart: it writes and adopts again.
    held = len(live)
    if store.slots[PoolName.SWA].free_count == 0:
        store.free(PoolName.SWA, [next(s for p, s in live if p == PoolName.SWA)])
        held -= 1
    write(store, PoolName.SWA, [7])
    store.close()
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert len(check_adopted(store)) == held + 1
    store.close()


def flip(folder: Path, pool: PoolName, slot: int, at: int = 5) -> None:
    """Flip a byte of `slot`'s page in the data file, under the store that has it open."""
    with open(folder / f"{pool.name}.pages", "r+b") as f:
        f.seek(slot * LAYOUT.page_bytes(pool) + at)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def test_a_read_names_the_pages_corrupted_since_they_were_written(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    written = write(store, PoolName.FULL, list(range(6)))
    slots = list(written)
    flip(tmp_path, PoolName.FULL, slots[2])
    out = torch.empty((len(slots), *LAYOUT.page_shape(PoolName.FULL)))
    with pytest.raises(CorruptPages) as e:
        store.read(PoolName.FULL, slots, out)
    assert e.value.pool is PoolName.FULL and e.value.slots == [slots[2]]
    for i, s in enumerate(slots):  # the others read right
        if s != slots[2]:
            assert torch.equal(out[i], page_of(PoolName.FULL, meta(written[s]).key))
    # Saved and written back (a rolled-back copy), a corrupted page stays one.
    saved = store.save(PoolName.FULL, slots)
    store.write(PoolName.FULL, slots[:1], torch.zeros_like(out[:1]), [meta(99)])
    store.restore(saved)
    with pytest.raises(CorruptPages) as e:
        store.read(PoolName.FULL, slots, out)
    assert e.value.slots == [slots[2]]
    store.close()
    # Nor does a restart adopt it.
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert sorted(check_adopted(store)) == [(PoolName.FULL, s) for s in slots if s != slots[2]]
    store.close()


def test_a_freed_slot_reads_as_corrupt_never_as_its_old_page(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    slot = next(iter(write(store, PoolName.SWA, [1])))
    store.free(PoolName.SWA, [slot])
    with pytest.raises(CorruptPages):
        store.read(PoolName.SWA, [slot], torch.empty((1, *LAYOUT.page_shape(PoolName.SWA))))
    store.close()


def test_a_folder_a_live_store_holds_is_refused_to_another(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    write(store, PoolName.FULL, [1, 2])
    with pytest.raises(FolderHeld, match=f"in use.*pid {os.getpid()}.*never share"):
        DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert FolderLock.try_take(tmp_path) is None
    store.close()
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)  # closed, the folder is free again
    assert len(check_adopted(store)) == 2
    store.close()


def test_a_lock_given_must_be_the_folder_s_own(tmp_path):
    (tmp_path / "a").mkdir()
    lock = FolderLock.try_take(tmp_path / "a")
    assert lock is not None
    with pytest.raises(ValueError, match="not .*'s"):
        DiskStore(tmp_path / "b", LAYOUT, CAPACITY, owner=lock)
    assert not lock.held  # released all the same


# A child holding a store open until killed.
HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_disk_store import CAPACITY, LAYOUT, write
    from kvfabric.core.cache.disk_store import DiskStore
    from kvfabric.core.cache.layout import PoolName
    store = DiskStore({folder!r}, LAYOUT, CAPACITY)
    store.adopt()
    write(store, PoolName.FULL, [1, 2, 3])
    print("open", flush=True)
    time.sleep(600)
    """
)


def hold(folder: Path) -> subprocess.Popen:
    """A child process holding a store open in `folder`, once it says so."""
    code = HOLDER.format(tests=str(Path(__file__).parent), folder=str(folder))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    got = lines(proc, 1)
    assert got == ["open"], proc.stderr.read() if proc.poll() is not None else got
    return proc


def test_a_store_killed_9_leaves_its_folder_to_the_next(tmp_path):
    proc = hold(tmp_path)
    try:
        with pytest.raises(FolderHeld, match=f"pid {proc.pid}"):
            DiskStore(tmp_path, LAYOUT, CAPACITY)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert (tmp_path / LOCK_NAME).exists()  # left behind, and free: the OS dropped the lock
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    assert len(check_adopted(store)) == 3
    store.close()


@pytest.mark.parametrize("chunk_pages", [1, 2, 4])
def test_a_read_in_chunks_checks_every_page_and_a_failing_chunk_leaves_none_reading(
    tmp_path, monkeypatch, chunk_pages
):
    """A large read is read in chunks on a reader thread while the pages before are
    checked: every page is checked all the same (a corrupted page in any chunk is named),
    the pages come back in order, and a chunk whose read fails raises with no read left
    writing into the caller's tensor."""
    import kvfabric.core.cache.disk_store as disk_store

    monkeypatch.setattr(
        disk_store, "READ_CHUNK_BYTES", chunk_pages * LAYOUT.page_bytes(PoolName.FULL)
    )
    store = DiskStore(tmp_path, LAYOUT, CAPACITY)
    store.adopt()
    written = write(store, PoolName.FULL, list(range(9)))
    slots = list(reversed(written))  # any order
    want = torch.stack([page_of(PoolName.FULL, meta(written[s]).key) for s in slots])
    out = torch.empty_like(want)
    store.read(PoolName.FULL, slots, out)
    assert torch.equal(out, want)
    flip(tmp_path, PoolName.FULL, slots[7])
    with pytest.raises(CorruptPages) as e:
        store.read(PoolName.FULL, slots, out)
    assert e.value.slots == [slots[7]]
    assert all(torch.equal(out[i], want[i]) for i in range(len(slots)) if i != 7)

    file, reads, ended = store.files[PoolName.FULL], [], []
    real = file.read

    def failing(chunk, into):
        reads.append(list(chunk))
        if len(reads) == 2:
            raise OSError(5, "injected: I/O error")
        real(chunk, into)
        ended.append(len(reads))

    monkeypatch.setattr(file, "read", failing)
    with pytest.raises(OSError, match="injected"):
        store.read(PoolName.FULL, slots, out)
    assert len(reads) == 2 and ended == [1]  # nothing read after the failing chunk
    store.close()
