"""The disk tier under a NodeCache: host evictions write pages to disk instead of dropping
them, hits load them back, and a new cache over the same folder (a restarted node)
adopts them and serves them again; pages of another KV identity, corrupted pages and
pages a killed process was writing are never served."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.check import PageAudit
from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy

from tests.examples import examples
from tests.kvgen import prefix_kv

LAYOUT = KVLayout(layers=("full", "swa", "full"), kv_heads=1, head_dim=4, page_size=4, window=8)
CAPS = {PoolName.FULL: PoolCapacity(8, 8, 96), PoolName.SWA: PoolCapacity(4, 4, 48)}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of 5 to 10 pages, half of them sharing a first page."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(LAYOUT.page_size)]
    out = []
    for i in range(n):
        own = [rng.randrange(1000) for _ in range(LAYOUT.page_size * rng.randrange(4, 10))]
        out.append((shared if i % 2 else []) + own)
    return out


def open_cache(
    folder: Path, layout: KVLayout = LAYOUT, to_disk: WritePolicy = WritePolicy.WRITE_BACK
) -> tuple[NodeCache, DiskStore]:
    store = DiskStore(folder, layout, {p: c.disk for p, c in CAPS.items()})
    tier = TierConfig(disk=to_disk)
    return NodeCache(layout, CAPS, tier=tier, device="cpu", disk=store), store


def served_right(cache: NodeCache, tokens: list[int], layout: KVLayout = LAYOUT) -> int:
    """Tokens a get serves for `tokens`, after checking every byte against the KV put."""
    hit = cache.get(tokens, "t")
    if hit.tokens == 0:
        return 0
    want = prefix_kv(layout, tokens)
    for li, kind in enumerate(layout.layers):
        start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
        assert torch.equal(hit.layers[li], want[li][:, start : hit.tokens]), (li, hit.tokens)
    return hit.tokens


def disk_pages(cache: NodeCache) -> int:
    return sum(1 for v in cache.held_pages() for _, tier in v.held if tier == Tier.DISK)


@pytest.fixture
def filled(tmp_path):
    """A cache whose host tier overflowed to disk many times over, then closed."""
    cache, store = open_cache(tmp_path)
    seqs = prompts(24)
    for t in seqs:
        cache.put(t, prefix_kv(LAYOUT, t), "t")
        cache.check()
    assert disk_pages(cache) > 20, "the host tier never overflowed to disk"
    hits = [served_right(cache, t) for t in seqs]
    assert sum(hits) > 0 and cache.tiers.loaded_back > 0, "nothing came back from disk"
    cache.check()
    store.close()
    return tmp_path, seqs, hits


def test_host_evictions_go_to_disk_and_hits_load_them_back(filled):
    _, seqs, hits = filled
    # Prompts long evicted from device and host still hit, from disk.
    assert sum(h > 0 for h in hits[:12]) >= 6, hits


def test_a_restarted_cache_adopts_the_disk_pages_and_serves_them(filled):
    folder, seqs, _ = filled
    cache, store = open_cache(folder)
    cache.check()
    assert cache.adopted.pages > 20, cache.adopted
    hits = [served_right(cache, t) for t in seqs]
    assert sum(h > 0 for h in hits) >= 12, hits
    cache.check()
    store.close()


def test_written_through_to_disk_every_prompt_the_cache_held_hits_after_a_restart(tmp_path):
    """Write-back leaves on disk only what every pool evicted, and a hybrid model's SWA
    pages outlive its full ones on device: a restart then finds full KV without the
    window. Written through, the disk holds what memory did."""
    cache, store = open_cache(tmp_path, to_disk=WritePolicy.WRITE_THROUGH)
    seqs = prompts(8, seed=5)
    for t in seqs:
        cache.put(t, prefix_kv(LAYOUT, t), "t")
    before = [served_right(cache, t) for t in seqs]
    cache.check()
    store.close()
    cache, store = open_cache(tmp_path, to_disk=WritePolicy.WRITE_THROUGH)
    cache.check()
    after = [served_right(cache, t) for t in seqs]
    # (A prompt longer than the device tier cannot be loaded back whole: it misses both
    # times, or hits a shorter prefix.)
    assert sum(h > 0 for h in before) >= 6
    assert all(a > 0 for a, b in zip(after, before) if b > 0), (before, after)
    store.close()


def test_pages_of_another_identity_are_dropped_never_served(filled):
    folder, seqs, _ = filled
    other = KVLayout(**{**LAYOUT.to_dict(), "tag": "model=other"})
    cache, store = open_cache(folder, other)
    assert cache.adopted.pages == 0 and disk_pages(cache) == 0
    assert all(served_right(cache, t, other) == 0 for t in seqs)
    store.close()


def test_a_corrupted_page_is_not_adopted_nor_anything_after_it(filled):
    folder, seqs, _ = filled
    data = bytearray((folder / "FULL.pages").read_bytes())
    page = LAYOUT.page_bytes(PoolName.FULL)
    for slot in range(0, CAPS[PoolName.FULL].disk, 3):  # a byte of every third slot
        data[slot * page + 5] ^= 0xFF
    (folder / "FULL.pages").write_bytes(bytes(data))
    cache, store = open_cache(folder)
    cache.check()
    assert cache.adopted.pages > 0
    for t in seqs:
        served_right(cache, t)  # whatever is served is the KV that was put
    store.close()


def flip_bytes(folder: Path, pool: PoolName, slots: list[int], at: int = 5) -> None:
    """Flip a byte of each slot's page in the data file, under the store that has it open."""
    size = LAYOUT.page_bytes(pool)
    with open(folder / f"{pool.name}.pages", "r+b") as f:
        for slot in slots:
            f.seek(slot * size + at % size)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))


def test_a_page_corrupted_under_a_running_cache_is_a_miss_then_lost(tmp_path):
    """Every full page on disk corrupted: no get serves one; the pages (and those after
    them) leave the tree, and the prompts put again are served again."""
    cache, store = open_cache(tmp_path)
    seqs = prompts(24)
    for t in seqs:
        cache.put(t, prefix_kv(LAYOUT, t), "t")
    flip_bytes(tmp_path, PoolName.FULL, sorted(store.sums[PoolName.FULL]))
    hits = [served_right(cache, t) for t in seqs]
    cache.check()
    stats = cache.stats()
    assert stats.disk_corrupt_pages > 0 and stats.disk_lost_pages >= stats.disk_corrupt_pages
    assert not cache.lost.pending and disk_pages(cache) < 20
    assert [served_right(cache, t) for t in seqs] == hits  # a miss now, not a failed load
    for t in seqs:
        cache.put(t, prefix_kv(LAYOUT, t), "t")
    assert sum(served_right(cache, t) > 0 for t in seqs) >= 12
    cache.check()
    assert cache.audit() == PageAudit(0, 0, 0)
    store.close()


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bad=st.lists(
        st.tuples(st.booleans(), st.integers(0, 95), st.integers(0, 1 << 12)), max_size=12
    ),
    seed=st.integers(0, 3),
)
def test_corruption_under_a_running_cache_never_serves_wrong_kv(tmp_path_factory, bad, seed):
    folder = tmp_path_factory.mktemp("d")
    cache, store = open_cache(folder)
    seqs = prompts(16, seed=seed)
    for t in seqs:
        cache.put(t, prefix_kv(LAYOUT, t), "t")
    for swa, i, at in bad:  # a byte of the i-th page on disk
        pool = PoolName.SWA if swa else PoolName.FULL
        held = sorted(store.sums[pool])
        if held:
            flip_bytes(folder, pool, [held[i % len(held)]], at)
    for t in seqs + seqs[::-1]:
        served_right(cache, t)  # whatever is served is the KV that was put
        cache.check()
    for t in seqs[:4]:
        cache.put(t, prefix_kv(LAYOUT, t), "t")
        served_right(cache, t)
    cache.check()
    assert cache.audit() == PageAudit(0, 0, 0)
    store.close()


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from tests.core.test_disk_tier import LAYOUT, open_cache, prompts
    from tests.kvgen import prefix_kv
    from pathlib import Path
    cache, store = open_cache(Path({folder!r}))
    for i, t in enumerate(prompts(400, seed=1)):
        cache.put(t, prefix_kv(LAYOUT, t), "t")
        print(i, flush=True)
    """
)


@pytest.mark.parametrize("seed", [3, 4])
def test_a_node_killed_mid_write_restarts_serving_only_what_was_put(tmp_path, seed):
    root = str(Path(__file__).resolve().parents[2])
    code = CHILD.format(root=root, folder=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        want = random.Random(seed).randrange(30, 120)
        assert proc.stdout is not None
        for _ in range(want):  # bounded: the child ends after 400 lines
            if not proc.stdout.readline():
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    cache, store = open_cache(tmp_path)
    cache.check()
    assert cache.adopted.pages > 0
    assert sum(served_right(cache, t) > 0 for t in prompts(400, seed=1)[:want]) > 0
    store.close()
