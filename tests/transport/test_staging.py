"""Shared-memory staging between an engine and a node's cache (transport/staging.py):
what an engine stages is what a later load stages back, page for page; an engine that
only holds the SWA window never gets placeholder bytes stored as SWA KV."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.page_bytes import pack
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.transport.staging import StagingPages, StagingSpec, load_to_staging, save_from_staging

from tests.kvgen import prefix_kv

LAYOUT = KVLayout(
    layers=("swa", "full", "swa", "full"), kv_heads=2, head_dim=8, page_size=4, window=8, tag="test"
)
W = LAYOUT.window_pages
SLOTS = 64


@pytest.fixture(scope="module")
def shared():
    pages = StagingPages(StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", SLOTS), LAYOUT)
    yield pages
    pages.unlink()


def new_cache() -> NodeCache:
    return NodeCache(
        LAYOUT,
        {
            PoolName.FULL: PoolCapacity(device=64, host=64),
            PoolName.SWA: PoolCapacity(device=64, host=64),
        },
        device="cpu",
    )


def stage(
    shared: StagingPages, tokens: list[int], swa_first: int, one_run: bool = True
) -> dict[PoolName, list[int]]:
    """What the engine's worker does at a request's end: its pages into staging slots,
    SWA only from the surviving window (slots after the full pool's; each pool's in
    reverse order unless `one_run`, as a churned allocator hands them out)."""
    n = len(tokens) // LAYOUT.page_size
    kv = prefix_kv(LAYOUT, tokens)
    slots = {PoolName.FULL: list(range(n)), PoolName.SWA: list(range(n, n + n - swa_first))}
    if not one_run:
        slots = {p: s[::-1] for p, s in slots.items()}
    for pool, idx in slots.items():
        first = 0 if pool == PoolName.FULL else swa_first
        shared.pools[pool][idx] = pack(LAYOUT, pool, kv, list(range(first, n)))
    return slots


def loaded(shared: StagingPages, hit, pool: PoolName) -> torch.Tensor:
    return shared.pools[pool][hit.slots[pool]]


@pytest.mark.parametrize("one_run", [True, False])
def test_staged_pages_come_back_equal(shared, one_run):
    """Slots in one run take the pool's pages straight in; scattered ones by a scatter:
    the same bytes either way, saved and loaded."""
    cache = new_cache()
    tokens = list(range(100, 100 + 10 * LAYOUT.page_size))
    n = len(tokens) // LAYOUT.page_size
    staged = stage(shared, tokens, n - W, one_run)
    assert save_from_staging(cache, shared, tokens, "t", staged, {PoolName.SWA: n - W}) == n
    shared.pools[PoolName.FULL].zero_()
    shared.pools[PoolName.SWA].zero_()
    slots = {PoolName.FULL: list(range(20, 40)), PoolName.SWA: list(range(40, 40 + W))}
    if not one_run:
        slots = {p: s[::-1] for p, s in slots.items()}
    hit = load_to_staging(cache, shared, tokens + [1], "t", 3, slots)
    assert (hit.pages, hit.first_page, hit.firsts) == (
        n,
        3,
        {PoolName.FULL: 3, PoolName.SWA: n - W},
    )
    kv = prefix_kv(LAYOUT, tokens)
    assert torch.equal(
        loaded(shared, hit, PoolName.FULL), pack(LAYOUT, PoolName.FULL, kv, list(range(3, n)))
    )
    assert torch.equal(
        loaded(shared, hit, PoolName.SWA), pack(LAYOUT, PoolName.SWA, kv, list(range(n - W, n)))
    )
    # Another namespace (tenant) never sees it.
    assert load_to_staging(cache, shared, tokens + [1], "u", 0, slots).pages == 0


def test_a_save_copies_without_the_lock_and_other_prefixes_are_served_meanwhile(shared):
    """The node actor's save gives up the cache's lock while it copies (CacheGate.released):
    another thread then checks the cache (the pages being filled count as owned), stores and
    reads another prefix, and the save still commits whole."""
    cache, lock, copying, resume = (
        new_cache(),
        threading.Lock(),
        threading.Event(),
        threading.Event(),
    )
    tokens = list(range(100, 100 + 10 * LAYOUT.page_size))
    other = list(range(900, 900 + 6 * LAYOUT.page_size))
    n = len(tokens) // LAYOUT.page_size
    slots = stage(shared, tokens, n - W)

    def unlocked(copy):
        def run():
            lock.release()
            try:
                copying.set()
                assert resume.wait(30)
                copy()
            finally:
                lock.acquire()

        return run

    def save():
        with lock:
            return save_from_staging(
                cache, shared, tokens, "t", slots, {PoolName.SWA: n - W}, unlocked
            )

    with ThreadPoolExecutor(1) as pool:
        stored = pool.submit(save)
        assert copying.wait(30)
        with lock:  # what the node actor's loop does meanwhile
            cache.check()
            assert cache.put(other, prefix_kv(LAYOUT, other), "t") == 6
            assert cache.get(other + [1], "t").tokens == len(other)
            assert cache.get(tokens + [1], "t").tokens == 0  # not there until committed
        resume.set()
        assert stored.result(timeout=30) == n
    cache.check()
    hit = load_to_staging(cache, shared, tokens + [1], "t", 0, slots)
    kv = prefix_kv(LAYOUT, tokens)
    assert torch.equal(
        loaded(shared, hit, PoolName.FULL), pack(LAYOUT, PoolName.FULL, kv, list(range(n)))
    )


def test_too_few_slots_load_nothing(shared):
    cache = new_cache()
    tokens = list(range(8 * LAYOUT.page_size))
    save_from_staging(
        cache, shared, tokens, "t", stage(shared, tokens, 8 - W), {PoolName.SWA: 8 - W}
    )
    hit = load_to_staging(
        cache, shared, tokens, "t", 0, {PoolName.FULL: [0, 1], PoolName.SWA: [2, 3]}
    )
    assert hit.pages == 0 and not hit.slots


def test_a_prompt_ending_on_a_page_hits_when_asked_again(shared):
    """vLLM asks for a prompt's tokens but its last (it computes that one itself): a
    prompt of exactly 10 pages is asked as 9 pages and a token, whose SWA window starts a
    page earlier than the window the prompt's own end needs. Both are stored."""
    cache = new_cache()
    tokens = list(range(300, 300 + 10 * LAYOUT.page_size))
    n = len(tokens) // LAYOUT.page_size
    first = n - W - 1  # the engine still holds one page before the window
    assert (
        save_from_staging(
            cache, shared, tokens, "t", stage(shared, tokens, first), {PoolName.SWA: first}
        )
        == n
    )
    slots = {PoolName.FULL: list(range(20, 40)), PoolName.SWA: list(range(40, 40 + W))}
    asked = tokens[:-1]
    hit = load_to_staging(cache, shared, asked, "t", 0, slots)
    assert (hit.pages, hit.firsts[PoolName.SWA]) == (n - 1, n - 1 - W)
    kv = prefix_kv(LAYOUT, tokens)
    assert torch.equal(
        loaded(shared, hit, PoolName.SWA),
        pack(LAYOUT, PoolName.SWA, kv, list(range(n - 1 - W, n - 1))),
    )
    # Ending inside a page, the same pages keep only the window before their own end.
    other = new_cache()
    longer = tokens + [7]
    save_from_staging(
        other, shared, longer, "t", stage(shared, longer, first), {PoolName.SWA: first}
    )
    assert load_to_staging(other, shared, asked, "t", 0, slots).pages == 0
    assert load_to_staging(other, shared, longer, "t", 0, slots).pages == n


def test_an_all_swa_layout_loads_its_window():
    """Every layer windowed (Mistral-style): the scheduler reserves the window's slots
    only, and the hit stages the window before its end into them."""
    layout = KVLayout(layers=("swa", "swa"), kv_heads=2, head_dim=8, page_size=4, window=8)
    w = layout.window_pages
    cache = NodeCache(layout, {PoolName.SWA: PoolCapacity(device=64, host=64)}, device="cpu")
    shared = StagingPages(StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", SLOTS), layout)
    try:
        tokens = list(range(500, 500 + 10 * layout.page_size)) + [1]
        n = 10
        kv = prefix_kv(layout, tokens)
        staged = list(range(w))
        shared.pools[PoolName.SWA][staged] = pack(layout, PoolName.SWA, kv, list(range(n - w, n)))
        assert (
            save_from_staging(
                cache, shared, tokens, "t", {PoolName.SWA: staged}, {PoolName.SWA: n - w}
            )
            == n
        )
        slots = {PoolName.SWA: list(range(20, 20 + min(n - 2, w)))}  # what the scheduler reserves
        hit = load_to_staging(cache, shared, tokens, "t", 2, slots)
        assert (hit.pages, hit.firsts[PoolName.SWA]) == (n, n - w)
        assert torch.equal(
            shared.pools[PoolName.SWA][hit.slots[PoolName.SWA]],
            pack(layout, PoolName.SWA, kv, list(range(n - w, n))),
        )
        # One slot short of the window: nothing is staged.
        short = {PoolName.SWA: slots[PoolName.SWA][:-1]}
        assert load_to_staging(cache, shared, tokens, "t", 2, short).pages == 0
    finally:
        shared.unlink()


@given(
    st.lists(
        st.tuples(st.integers(1, 12), st.integers(0, 11), st.integers(0, 3)), min_size=1, max_size=6
    )
)
def test_loads_only_return_bytes_an_engine_staged(shared, convs):
    """Conversations branching off each other, each saved with only its surviving SWA
    window: whatever a later load stages equals the true K/V of those positions (a
    branch point's window, which no engine handed over, is never stored from zeros)."""
    cache = new_cache()
    seqs: list[list[int]] = []
    for pages, branch_from, salt in convs:
        base = seqs[branch_from % len(seqs)] if seqs else []
        keep = (len(base) // LAYOUT.page_size) * branch_from // 12 * LAYOUT.page_size
        tokens = base[:keep] + [
            1000 * (len(seqs) + 1) + salt * 7 + i for i in range(pages * LAYOUT.page_size)
        ]
        n = len(tokens) // LAYOUT.page_size
        if n > SLOTS // 2:
            continue
        swa_first = max(0, n - W)
        save_from_staging(
            cache, shared, tokens, "t", stage(shared, tokens, swa_first), {PoolName.SWA: swa_first}
        )
        seqs.append(tokens)
        cache.check()
    for tokens in seqs:
        for cut in range(1, len(tokens) // LAYOUT.page_size + 1):
            prefix = tokens[: cut * LAYOUT.page_size]
            slots = {
                PoolName.FULL: list(range(SLOTS // 2)),
                PoolName.SWA: list(range(SLOTS // 2, SLOTS)),
            }
            hit = load_to_staging(cache, shared, prefix, "t", 0, slots)
            if not hit.pages:
                continue
            kv = prefix_kv(LAYOUT, prefix[: hit.pages * LAYOUT.page_size])
            assert torch.equal(
                loaded(shared, hit, PoolName.FULL),
                pack(LAYOUT, PoolName.FULL, kv, list(range(hit.pages))),
            )
            assert torch.equal(
                loaded(shared, hit, PoolName.SWA),
                pack(LAYOUT, PoolName.SWA, kv, list(range(hit.firsts[PoolName.SWA], hit.pages))),
            )


def test_files_live_in_shared_memory(shared):
    for pool in LAYOUT.pools:
        assert os.path.exists(shared.spec.path(pool))
        assert str(shared.spec.path(pool)).startswith("/dev/shm/")


def test_layout_tag_is_part_of_the_fingerprint():
    """An engine's model and KV tensor layout (the tag) separate caches as geometry does;
    a layout without a tag keeps the fingerprint it always had."""
    plain = KVLayout(layers=("swa", "full"), kv_heads=2, head_dim=8, page_size=4, window=8)
    tagged = KVLayout(
        layers=("swa", "full"), kv_heads=2, head_dim=8, page_size=4, window=8, tag="vllm:x"
    )
    assert tagged.fingerprint != plain.fingerprint
    assert (
        tagged.fingerprint != KVLayout.from_dict({**tagged.to_dict(), "tag": "vllm:y"}).fingerprint
    )
    assert KVLayout.from_dict(tagged.to_dict()) == tagged
    assert "tag" not in plain.to_dict() and KVLayout.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError):
        KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=1, tag=3)


# --- what a caller names is checked; space is reserved where it is made ----------------------


def test_specs_that_would_name_other_files_are_refused():
    from kvfabric.transport.staging import StagingError, check_spec

    for prefix in ("../../tmp/x", "a/b", "", ".hidden", "x" * 161, "kvf\x00", 7):
        with pytest.raises(StagingError, match="prefix"):
            StagingSpec(prefix, 4)  # type: ignore[arg-type]
    for pages in (0, -1, 1 << 21, 2.0, None, True):
        with pytest.raises(StagingError, match="pages"):
            StagingSpec("kvf-ok", pages)  # type: ignore[arg-type]
    forged = object.__new__(StagingSpec)  # as unpickling makes one: no constructor check
    object.__setattr__(forged, "prefix", "../../tmp/x")
    object.__setattr__(forged, "pages", 4)
    with pytest.raises(StagingError):
        check_spec(forged)


@given(
    slots=st.dictionaries(
        st.one_of(st.sampled_from(list(PoolName)), st.integers(), st.text(max_size=2)),
        st.one_of(
            st.lists(st.integers(-3, SLOTS + 3), max_size=6),
            st.lists(st.one_of(st.floats(), st.none(), st.booleans()), max_size=2),
            st.none(),
            st.text(max_size=3),
        ),
        max_size=3,
    ),
    skip=st.one_of(st.integers(-2, 4), st.none(), st.floats()),
)
def test_bad_slots_are_refused_before_any_byte_moves(shared, slots, skip):
    """Slots a caller names must be distinct ints below the spec's pages, for the layout's
    pools; anything else is a StagingError and neither the cache nor staging changes."""
    from kvfabric.transport.staging import StagingError

    cache = new_cache()
    tokens = list(range(8 * LAYOUT.page_size))
    stage_slots = stage(shared, tokens, 8 - W)
    save_from_staging(cache, shared, tokens, "t", stage_slots, {PoolName.SWA: 8 - W})
    before, staged = cache.snapshot(), {p: t.clone() for p, t in shared.pools.items()}
    valid = (
        type(skip) is int
        and skip >= 0
        and all(
            p in LAYOUT.pools
            and isinstance(v, list)
            and all(type(i) is int and 0 <= i < SLOTS for i in v)
            and len(set(v)) == len(v)
            for p, v in slots.items()
        )
    )
    try:
        load_to_staging(cache, shared, tokens, "t", skip, slots)
    except StagingError:
        assert not valid
        assert cache.snapshot() == before
        assert all(torch.equal(shared.pools[p], staged[p]) for p in staged)
        return
    assert valid


def test_a_failed_reservation_is_an_error_naming_the_size_and_leaves_no_file(monkeypatch):
    """posix_fallocate answering ENOSPC (a full /dev/shm) fails the mapping with the size
    needed and how to raise it; the file it started is gone."""
    import errno

    from kvfabric.transport import staging
    from kvfabric.transport.staging import StagingSpaceError

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging.os, "posix_fallocate", full)
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", SLOTS)
    with pytest.raises(StagingSpaceError, match="--shm-size"):
        StagingPages(spec, LAYOUT)
    assert not any(spec.path(p).exists() for p in LAYOUT.pools)


@pytest.mark.parametrize("existing", [False, True])
def test_a_pool_that_does_not_fit_takes_back_the_files_this_mapping_made(monkeypatch, existing):
    """The full pool fits, the SWA pool does not: the full pool's file goes too if this
    mapping made it (nothing is left for no engine), and stays if another process of the
    engine had made it (it maps it still)."""
    import errno

    from kvfabric.transport import staging
    from kvfabric.transport.staging import StagingSpaceError

    reserve = staging.os.posix_fallocate
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", SLOTS)
    assert len(LAYOUT.pools) == 2
    first, second = (spec.path(p) for p in LAYOUT.pools)

    def second_full(fd, offset, size):
        if os.readlink(f"/proc/self/fd/{fd}") == str(second):
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(fd, offset, size)

    if existing:
        StagingPages(StagingSpec(spec.prefix, SLOTS), LAYOUT)
        second.unlink()
    monkeypatch.setattr(staging.os, "posix_fallocate", second_full)
    try:
        with pytest.raises(StagingSpaceError, match="--shm-size"):
            StagingPages(spec, LAYOUT)
        assert first.exists() == existing and not second.exists()
    finally:
        first.unlink(missing_ok=True)


FILL = """
import sys
from kvfabric.core import KVLayout
from kvfabric.transport import staging
from kvfabric.transport.staging import StagingPages, StagingSpaceError, StagingSpec, check_space
staging.SHM_DIR = staging.Path(sys.argv[1])
layout = KVLayout(layers=("full",), kv_heads=1, head_dim=64, page_size=32)  # 16 KiB pages
big = StagingSpec("kvf-big", 256)  # 4 MiB: more than the folder holds
try:
    check_space(big, layout)
    sys.exit("check_space let it through")
except StagingSpaceError as e:
    print("checked:", e)
try:
    StagingPages(big, layout)
    sys.exit("the mapping was made")
except StagingSpaceError as e:
    print("refused:", e)
small = StagingPages(StagingSpec("kvf-small", 32), layout)  # 512 KiB fits
for t in small.pools.values():
    t.fill_(1.0)  # every page written: none unbacked
print("wrote", sum(t.numel() for t in small.pools.values()))
"""


def test_staging_on_a_full_tmpfs_is_refused_not_a_sigbus(tmp_path):
    """On a real 1 MiB tmpfs: staging that does not fit is refused up front and at
    creation, naming the size; staging that fits is written whole. Without the
    reservation, the first write into an unbacked page killed the process (SIGBUS): the
    check runs in a child, so such a death fails this test rather than the run."""
    import subprocess
    import sys

    folder = tmp_path / "shm"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run = subprocess.run(
            [sys.executable, "-c", FILL, str(folder)], capture_output=True, text=True, timeout=120
        )
    finally:
        subprocess.run(["umount", str(folder)], check=False)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    lines = run.stdout.splitlines()
    assert lines[0].startswith("checked: staging needs 4.0 MiB") and "--shm-size" in lines[0]
    assert lines[1].startswith("refused: staging needs")
    assert "wrote" in run.stdout


def _resident_kib(path: str) -> int:
    """Rss of this process's mappings of `path` (/proc/self/smaps): what its page table maps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_staging_is_mapped_in_before_the_first_copy_and_keeps_its_bytes():
    """Pre-faulted at start (MADV_POPULATE_WRITE): the first hit or save copies at the
    speed of later ones. Mapping it again (the other side) keeps what was written."""
    from kvfabric.transport.staging import _populate

    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 256)
    first = StagingPages(spec, LAYOUT)
    try:
        full = first.pools[PoolName.FULL]
        nbytes = full.numel() * full.element_size()
        resident = _resident_kib(str(spec.path(PoolName.FULL))) * 1024
        if not _populate(full):
            pytest.skip("this kernel cannot pre-fault a mapping (Linux < 5.14)")
        assert resident >= nbytes  # mapped in before any byte was written
        full.fill_(1.5)
        second = StagingPages(spec, LAYOUT)  # the engine's side, mapped while in use
        assert bool((second.pools[PoolName.FULL] == 1.5).all())
    finally:
        first.unlink()
