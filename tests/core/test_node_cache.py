import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.deploy.chaos.faults import AllocationFaults

from tests.examples import examples
from tests.kvgen import prefix_kv

MIXED = KVLayout(
    layers=("full", "swa", "full", "swa"), kv_heads=2, head_dim=4, page_size=4, window=8
)
FULL_ONLY = KVLayout(layers=("full", "full"), kv_heads=1, head_dim=4, page_size=4)
SWA_ONLY = KVLayout(layers=("swa", "swa"), kv_heads=1, head_dim=4, page_size=4, window=8)
NS = "tenant"


def make(layout=MIXED, full=(16, 32), swa=(8, 16), policy=WritePolicy.WRITE_BACK, **kw):
    caps = {PoolName.FULL: PoolCapacity(*full), PoolName.SWA: PoolCapacity(*swa)}
    caps = {p: caps[p] for p in layout.pools}
    return NodeCache(
        layout, caps, tier=TierConfig(policy=policy, selective_hits=2), device="cpu", **kw
    )


def put(cache, tokens, ns=NS):
    n = cache.put(tokens, prefix_kv(cache.layout, tokens), ns)
    cache.check()
    return n


def assert_bytes(cache, tokens, hit):
    want = prefix_kv(cache.layout, tokens)
    for i, kind in enumerate(cache.layout.layers):
        start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
        assert torch.equal(hit.layers[i], want[i][:, start : hit.tokens]), f"layer {i}"


def seq(n_pages, start=0, ps=4):
    return list(range(start, start + n_pages * ps))


def open_end(tokens):
    """`tokens` and one more: a put of them ends inside a page, so SWA keeps the window
    before their last whole page only (see test_tokens_ending_on_a_page_...)."""
    return tokens + [999]


@pytest.mark.parametrize("layout", [MIXED, FULL_ONLY, SWA_ONLY], ids=["mixed", "full", "swa"])
def test_put_get_bytes_round_trip(layout):
    cache = make(layout)
    tokens = seq(5) + [999, 998]  # a partial page is never cached
    assert put(cache, tokens) == 5
    hit = cache.get(tokens + [5, 6, 7], NS)
    assert hit.tokens == 20
    assert_bytes(cache, tokens, hit)
    assert cache.get(tokens, "other-tenant").tokens == 0
    cache.check()


def test_swa_window_must_be_present():
    cache = make()
    tokens = seq(6)  # window 8 tokens = 2 pages: SWA kept at 4, 5
    put(cache, open_end(tokens))
    assert cache.match(tokens, NS).usable_pages == 6
    # Every shorter prefix ends where SWA was freed at insert: not usable.
    for k in range(1, 6):
        assert cache.match(tokens[: k * 4], NS).usable_pages == 0
    hit = cache.get(tokens, NS)
    assert hit.tokens == 24 and hit.starts[PoolName.SWA] == 16
    assert_bytes(cache, tokens, hit)


def test_tombstoned_pages_serve_full_part_of_longer_match():
    cache = make()
    a = seq(6)
    put(cache, open_end(a))
    assert cache.presence(cache.match(a, NS), PoolName.SWA) == [False] * 4 + [True] * 2
    hit = cache.get(a + seq(1, 500), NS)
    assert hit.tokens == 24  # full KV of tombstoned pages 0..3 is used
    assert_bytes(cache, a, hit)


def test_tokens_ending_on_a_page_keep_the_window_one_page_shorter():
    """An engine computes a request's last token itself: asked for the same 24 tokens
    again, it matches 23 of them, 5 pages, whose window (pages 3, 4) the put keeps too
    when its tokens end on a page boundary. Ending inside a page, it keeps 4, 5 only."""
    aligned, inside = make(), make()
    put(aligned, seq(6))
    put(inside, open_end(seq(6)))
    assert aligned.presence(aligned.match(seq(6), NS), PoolName.SWA) == [False] * 3 + [True] * 3
    assert inside.presence(inside.match(seq(6), NS), PoolName.SWA) == [False] * 4 + [True] * 2
    asked = seq(6)[:-1]  # what an engine asks of the same prompt
    assert aligned.match(asked, NS).usable_pages == 5
    assert inside.match(asked, NS).usable_pages == 0
    hit = aligned.get(asked, NS)
    assert hit.tokens == 20 and hit.starts[PoolName.SWA] == 12
    assert_bytes(aligned, seq(6), hit)
    # Full attention has no window: nothing more is kept, whatever the end.
    full = make(FULL_ONLY)
    put(full, seq(6))
    assert full.match(asked, NS).usable_pages == 5


def test_branch_point_keeps_its_window():
    cache = make()
    shared = seq(3)
    put(cache, shared + seq(3, 100))
    assert cache.match(shared + seq(2, 200), NS).usable_pages == 0  # branch point was tombstoned
    put(cache, shared + seq(3, 200))  # insert at the branch keeps its window
    hit = cache.get(shared + seq(2, 300), NS)
    assert hit.tokens == 12
    assert_bytes(cache, shared, hit)


def test_lru_eviction_and_locks():
    cache = make(FULL_ONLY, full=(6, 0), policy=WritePolicy.WRITE_THROUGH)
    a, b = seq(3, 0), seq(3, 100)
    put(cache, a)
    put(cache, b)
    lock = cache.lock(cache.match(a, NS))
    assert cache.evict(PoolName.FULL, Tier.DEVICE, 6) == 3  # only b is unlocked
    cache.check()
    assert cache.match(a, NS).usable_pages == 3 and cache.match(b, NS).usable_pages == 0
    cache.unlock(lock)
    with pytest.raises(RuntimeError):
        cache.unlock(lock)
    put(cache, b)
    cache.get(b, NS)  # b is now most recent
    put(cache, seq(3, 200))  # evicts a (least recent)
    assert cache.match(a, NS).usable_pages == 0 and cache.match(b, NS).usable_pages == 3


def test_swa_tombstones_before_anchored_windows():
    cache = make(swa=(4, 0))
    put(cache, open_end(seq(6)))  # SWA at 4, 5
    put(cache, open_end(seq(6, 100)))  # SWA at its 4, 5: pool full
    put(cache, open_end(seq(6) + seq(2, 300)))  # extends the first: its old end 4, 5 is interior
    cache.check()
    assert cache.match(seq(6, 100), NS).usable_pages == 6  # the anchored window survived
    assert cache.match(seq(6) + seq(2, 300), NS).usable_pages == 8
    assert cache.match(seq(6), NS).usable_pages < 6  # the unanchored window went first


def test_write_back_then_load_back_bytes():
    cache = make(full=(6, 12), swa=(2, 4))
    a, b = seq(6), seq(6, 100)
    put(cache, open_end(a))
    put(cache, open_end(b))  # a's device pages written back to host
    m = cache.match(a, NS)
    assert m.usable_pages == 6 and m.usable_device_pages < 6
    hit = cache.get(a, NS)  # loads back, evicting (writing back) b
    assert_bytes(cache, a, hit)
    assert cache.stats().hit_pages_host > 0
    cache.check()
    assert_bytes(cache, b, cache.get(b, NS))


def test_write_through_and_selective():
    wt = make(policy=WritePolicy.WRITE_THROUGH)
    put(wt, seq(4))
    assert all(wt.presence(wt.match(seq(4), NS), PoolName.FULL, (Tier.HOST,)))
    sel = make(policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    put(sel, seq(4))
    on_host = lambda: sel.presence(sel.match(seq(4), NS), PoolName.FULL, (Tier.HOST,))  # noqa: E731
    sel.get(seq(4), NS)
    assert not any(on_host())
    sel.get(seq(4), NS)  # second hit reaches selective_hits=2
    assert all(on_host())
    sel.check()


def test_load_back_failure_degrades_to_device_prefix():
    cache = make(FULL_ONLY, full=(4, 8))
    a = seq(4)
    put(cache, a)
    put(cache, seq(4, 100))  # a fully written back to host
    lock = cache.lock(cache.match(seq(4, 100), NS))  # device full and locked
    hit = cache.get(a, NS)
    assert hit.tokens == 0 and cache.stats().load_back_failures == 1
    cache.unlock(lock)
    cache.check()


def test_failure_at_every_reservation_point_of_a_put():
    """A put under pressure passes several reservation points (its own, and
    write-backs inside eviction). Failing any one either fails the whole put,
    leaving everything as before, or is absorbed (a write-back becomes a drop)."""

    def run(point):
        faults = AllocationFaults()
        cache = make(full=(6, 8), swa=(2, 4), reserve_hook=faults)
        put(cache, open_end(seq(5)))
        before = cache.snapshot()
        faults.arm(*([point] if point else []))
        second = open_end(seq(5, 100))
        n = cache.put(second, prefix_kv(MIXED, second), NS)
        cache.check()
        return faults, cache, before, n

    total = run(0)[0].points
    assert total >= 3
    outcomes = set()
    for point in range(1, total + 1):
        faults, cache, before, n = run(point)
        assert faults.injected == 1
        outcomes.add(n)
        if n == 0:
            assert cache.snapshot() == before
        else:
            assert_bytes(cache, seq(5, 100), cache.get(seq(5, 100), NS))
    assert outcomes == {0, 5}


def test_put_rejects_bad_kv_and_changes_nothing():
    cache = make()
    before = cache.snapshot()
    good = prefix_kv(MIXED, seq(2))
    for bad in (good[:3], [good[0].double()] + good[1:], [good[0][:, :4]] + good[1:], None):
        with pytest.raises(ValueError):
            cache.put(seq(2), bad, NS)
    assert cache.snapshot() == before


def test_metadata_only_mode():
    cache = make(FULL_ONLY, store_bytes=False)
    assert cache.put(seq(5), None, NS) == 5
    keys = cache.keys(seq(5), NS)
    assert cache.match_keys(keys).usable_pages == 5
    assert cache.match_keys(keys[:3]).usable_pages == 3
    assert cache.match_keys(keys[1:]).usable_pages == 0  # a chain must start at the root
    assert cache.match(seq(5), NS).keys == keys
    assert cache.get(seq(5), NS).tokens == 20
    cache.check()


@pytest.mark.parametrize("incremental", [True, False])
def test_eviction_under_pressure_evicts_a_batch_at_a_time(monkeypatch, incremental):
    """A full pool evicts a slice of itself per eviction, not one eviction per put; small
    pools (under EVICTION_BATCH pages) evict exactly what a put needs. Kept candidates
    walk the tree once (the first eviction builds them); the reference walks it per
    eviction."""
    from kvfabric.core.cache.eviction import Evictor
    from kvfabric.core.cache.node_cache import EVICTION_BATCH
    from kvfabric.core.cache.policies import FullAttentionPolicy

    layout = KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=2)
    walks, evictions = [], []
    real, real_make_room = FullAttentionPolicy.groups, Evictor.make_room
    monkeypatch.setattr(
        FullAttentionPolicy, "groups", lambda self, *a: walks.append(1) or real(self, *a)
    )
    monkeypatch.setattr(
        Evictor,
        "make_room",
        lambda self, *a, **k: evictions.append(1) or real_make_room(self, *a, **k),
    )
    pages = 4 * EVICTION_BATCH
    cache = NodeCache(
        layout,
        {PoolName.FULL: PoolCapacity(pages, 0)},
        store_bytes=False,
        device="cpu",
        incremental_eviction=incremental,
    )
    for i in range(200):  # 200 distinct 4-page prompts through a 256-page pool
        assert cache.put([i * 10 + j for j in range(8)], None, NS) == 4
        cache.check()
    assert 0 < len(evictions) <= 200 * 4 // (pages // EVICTION_BATCH) // 2
    assert len(walks) == (1 if incremental else len(evictions))
    assert cache.match([199 * 10 + j for j in range(8)], NS).usable_pages == 4  # the newest stays
    small = NodeCache(layout, {PoolName.FULL: PoolCapacity(8, 0)}, store_bytes=False, device="cpu")
    for i in range(3):
        small.put([i * 10 + j for j in range(8)], None, NS)
    assert small.stats().pools["FULL/DEVICE"]["used"] == 8  # exactly full: nothing extra freed


def test_only_a_usable_length_can_be_locked():
    """SWA usability is not prefix-closed: in an SWA-only cache a match usable for 4 pages
    is not usable for 1 (page 0's window is tombstoned). Locking 1 page used to pin a node
    holding nothing, which eviction then left as a locked leaf without pages."""
    layout = KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=2)
    cache = NodeCache(layout, {PoolName.SWA: PoolCapacity(8, 0)}, store_bytes=False)
    tokens = [0, 1, 2, 0, 2, 0, 0, 2, 0]
    cache.put(tokens, None, NS)
    match = cache.match(tokens, NS)
    assert match.usable_pages == 4
    before = cache.snapshot()
    with pytest.raises(ValueError, match="not usable"):
        cache.lock(match, 1)
    assert cache.snapshot() == before and not any(any(n.locks) for n in cache.tree.nodes())
    lock = cache.lock(match, 4)
    assert cache.evict(PoolName.SWA, Tier.DEVICE, 4) == 0  # its only page is pinned
    cache.check()
    cache.unlock(lock)
    assert cache.evict(PoolName.SWA, Tier.DEVICE, 4) == 1
    cache.check()


SMALL = {
    "swa": KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=2),
    "swa-wide": KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=1, window=3),
    "mixed": KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=3),
}


@settings(max_examples=examples(200), deadline=None)
@example(  # a lock at a length whose window is tombstoned, then an eviction
    layout="swa",
    device=8,
    seqs=[[0, 1, 2, 0, 2, 0, 0, 2, 0]],
    steps=[("p", 0, 0), ("l", 0, 1), ("e", 0, 1)],
)
@given(
    layout=st.sampled_from(sorted(SMALL)),
    device=st.integers(4, 16),
    seqs=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=14), min_size=2, max_size=4),
    steps=st.lists(st.tuples(st.sampled_from("plue"), st.integers(0, 3), st.integers(0, 8))),
)
def test_locks_at_any_length_leave_the_cache_whole(layout, device, seqs, steps):
    """Locks asked for at any length (refused where it is not usable), evictions and
    unlocks in any order: the invariants hold after every step."""
    kv = SMALL[layout]
    cache = NodeCache(kv, {p: PoolCapacity(device, 0) for p in kv.pools}, store_bytes=False)
    locks = []
    for kind, i, n in steps:
        tokens = seqs[i % len(seqs)]
        if kind == "p":
            cache.put(tokens, None, NS)
        elif kind == "l":
            match = cache.match(tokens, NS)
            try:
                locks.append(cache.lock(match, min(n, match.present_pages)))
            except ValueError:
                pass  # not a usable length: refused, nothing changed
        elif kind == "u" and locks:
            cache.unlock(locks.pop(n % len(locks)))
        elif kind == "e":
            cache.evict(kv.pools[-1], Tier.DEVICE, n)
        cache.check()


def test_a_change_then_a_split_names_the_page_where_it_now_is():
    """Changes are listed as (node, position): a split before the publisher looks moves
    the head of the run into a new node above, and each page must still come out under
    its own key, position and tiers."""
    cache = make(FULL_ONLY, full=(8, 16))
    a = seq(8)
    put(cache, a)
    cache.track_changes(0)
    cache.take_changes()  # the first batch restates everything
    assert cache.evict(PoolName.FULL, Tier.DEVICE, 8) == 8  # written back: all 8 change
    cache.lock(cache.match(a, NS), 3)  # splits the run after page 3
    changed, restate = cache.take_changes()
    keys = cache.keys(a, NS)
    assert not restate
    assert [(v.key, v.position, v.held) for v, _ in changed] == [
        (k, i, ((PoolName.FULL, Tier.HOST),)) for i, k in enumerate(keys)
    ]
    assert [path for _, path in changed] == [keys[: i + 1] for i in range(8)]
    cache.check()


def test_a_put_that_refuses_its_input_still_releases_its_hold():
    cache = make(FULL_ONLY, full=(8, 16))
    a = seq(4)
    put(cache, a)
    hit = cache.get(a, NS, lease_s=60.0)
    assert hit.lease
    for starts in ({PoolName.FULL: 3}, {PoolName.SWA: 0}):  # not a page start; no such pool
        with pytest.raises(ValueError):
            cache.put(a, prefix_kv(cache.layout, a), NS, starts=starts, release=hit.lease)
        assert not cache.release_lease(hit.lease)  # released already, by the put
        hit = cache.get(a, NS, lease_s=60.0)
    cache.release_lease(hit.lease)
    cache.check()


@pytest.mark.parametrize("room", [False, True], ids=["fails", "commits"])
def test_a_put_branching_where_a_node_holds_nothing_leaves_no_empty_leaf(room):
    """SWA-only trees may hold a node's early pages and not its later ones: a put that
    branches inside such a node cuts it there, and the tail, holding nothing, goes
    whether or not the put then finds room."""
    cache = make(SWA_ONLY, swa=(3, 1))
    a = seq(4)
    put(cache, a)  # on a page end: SWA at 1, 2, 3
    cache.evict(PoolName.SWA, Tier.DEVICE, 3)  # the far page 1 to host, 2 and 3 dropped
    (node,) = cache.tree.nodes()
    assert node.n == 4 and node.slots[Tier.HOST][PoolName.SWA] == [-1, 0, -1, -1]
    lock = None
    if not room:  # the device pool full and pinned
        other = open_end(seq(6, 100))
        put(cache, other)
        lock = cache.lock(cache.match(other, NS))
    branch = open_end(a[:8] + seq(2, 500))  # shares pages 0, 1; needs SWA at 2, 3
    stored = cache.put(branch, prefix_kv(SWA_ONLY, branch), NS)
    assert stored == (2 if room else 0)
    cache.check()
    # a's head (pages 0, 1), then the new run (2, 3) or, with no room, the pinned prompt
    shapes = sorted((n.start, n.n) for n in cache.tree.nodes())
    assert shapes == ([(0, 2), (2, 2)] if room else [(0, 2), (0, 4), (4, 2)])  # lock cut it
    if lock is not None:
        cache.unlock(lock)


@settings(max_examples=examples(60), deadline=None)
@given(
    pages=st.integers(1, 10),
    first=st.integers(0, 12),
    rows=st.lists(st.integers(0, 15), unique=True, max_size=12),
)
def test_a_get_from_a_first_page_into_caller_memory_gives_the_same_kv(pages, first, rows):
    """get(first_page=, into=) against a plain get of the same prefix: each pool's rows
    from max(its start, first_page) on, equal; copied into the caller's rows (in any order,
    page i into rows[i]) where there are enough, into new memory where not; the caller's
    other rows untouched."""
    c = make()
    tokens = seq(pages)
    c.put(tokens, prefix_kv(MIXED, tokens), "ns")
    plain = c.get(tokens, "ns")
    ps = MIXED.page_size
    sinks = {p: torch.full((16, *MIXED.page_shape(p)), 7.0) for p in MIXED.pools}
    hit = c.get(tokens, "ns", first_page=first, into={p: (t, rows) for p, t in sinks.items()})
    assert hit.tokens == plain.tokens
    n = hit.tokens // ps
    for pool in MIXED.pools:
        start = plain.starts[pool] // ps
        assert hit.starts[pool] // ps == min(max(start, first), n)
        want = plain.pages[pool][hit.starts[pool] // ps - start :]
        straight = len(want) <= len(rows)
        assert (pool in hit.sinks) == straight and (pool in hit.pages) != straight
        used = rows[: len(want)] if straight else []
        if straight:
            assert hit.sinks[pool] == (sinks[pool], used)
            assert torch.equal(sinks[pool][used], want)
        else:
            assert torch.equal(hit.pages[pool], want)
        others = [r for r in range(16) if r not in used]
        assert bool((sinks[pool][others] == 7.0).all())  # the caller's other rows: untouched
    for got, expected in zip(hit.layers, plain.layers):  # the same K/V, however it was copied
        if got is not None:
            assert torch.equal(got, expected[:, expected.shape[1] - got.shape[1] :])


@settings(max_examples=examples(60), deadline=None)
@given(
    pages=st.integers(1, 8),
    first=st.integers(0, 9),
    evicted=st.tuples(st.integers(0, 16), st.integers(0, 8)),
    rows=st.lists(st.integers(0, 15), unique=True, max_size=12),
)
def test_a_get_into_caller_memory_copies_host_pages_from_the_host(pages, first, evicted, rows):
    """Pages only the host tier holds go into the caller's rows from there when every
    pool's rows take them: the same K/V as a get before they left the device, and none is
    loaded back (the device tier's use is unchanged); the hit counts each position once,
    from host or device. With too few rows the hit loads them back to device, as a get
    without `into` does."""
    c = make()
    tokens = seq(pages)
    c.put(tokens, prefix_kv(MIXED, tokens), "ns")
    plain = c.get(tokens, "ns")
    want = {p: t.clone() for p, t in plain.pages.items()}
    for pool, n in zip((PoolName.FULL, PoolName.SWA), evicted):
        c.evict(pool, Tier.DEVICE, n)  # write-back: to the host tier
    c.check()

    def device_used() -> dict[str, int]:
        return {k: v["used"] for k, v in c.stats().pools.items() if k.endswith("/DEVICE")}

    used, host_before, device_before = device_used(), *hit_pages(c)
    sinks = {p: torch.full((16, *MIXED.page_shape(p)), 7.0) for p in MIXED.pools}
    hit = c.get(tokens, "ns", first_page=first, into={p: (t, rows) for p, t in sinks.items()})
    c.check()
    ps = MIXED.page_size
    n = hit.tokens // ps
    assert hit.tokens == plain.tokens
    rows_needed = {p: n - min(max(plain.starts[p] // ps, first), n) for p in MIXED.pools}
    direct = all(k <= len(rows) for k in rows_needed.values())
    if direct:
        assert device_used() == used  # nothing loaded back
    for pool in MIXED.pools:
        k = rows_needed[pool]
        expected = want[pool][len(want[pool]) - k :] if k else want[pool][:0]
        got = sinks[pool][rows[:k]] if pool in hit.sinks else hit.pages[pool]
        assert (pool in hit.sinks) == (k <= len(rows))
        assert torch.equal(got, expected)
    host, device = hit_pages(c)
    assert host - host_before + device - device_before == n
    assert hit.host_tokens == (host - host_before) * ps


def hit_pages(cache: NodeCache) -> tuple[int, int]:
    """The cache's hit pages so far, from host and from device (stats() is one live object)."""
    s = cache.stats()
    return s.hit_pages_host, s.hit_pages_device


@settings(max_examples=examples(40), deadline=None)
@given(
    pages=st.integers(1, 8),
    swa_first=st.integers(0, 8),
    held=st.integers(0, 8),
    scatter=st.none() | st.randoms(use_true_random=False),
)
def test_a_put_of_paged_kv_stores_what_a_put_of_layer_rows_does(pages, swa_first, held, scatter):
    """PagedKV (staging's page shape) against the per-layer rows of the same K/V, onto a
    cache that already holds a shorter prefix: the same pages stored, the same bytes read
    back. With `scatter`, the pages lie in shuffled rows of a larger tensor (staging
    slots, read where they lie: PagedKV.rows)."""
    from kvfabric.core.cache.page_bytes import pack
    from kvfabric.core.cache.put_rows import PagedKV

    tokens = seq(pages)
    kv = prefix_kv(MIXED, tokens)
    first = {PoolName.FULL: 0, PoolName.SWA: min(swa_first, pages)}
    starts = {p: f * MIXED.page_size for p, f in first.items()}
    rows = {p: pack(MIXED, p, kv, list(range(first[p], pages))) for p in MIXED.pools}
    by_layer, by_page = make(), make()
    if held:
        before = seq(min(held, pages))
        for c in (by_layer, by_page):
            c.put(before, prefix_kv(MIXED, before), "ns")
    layer_rows = [
        t[:, first[PoolName.FULL if k.value == "full" else PoolName.SWA] * MIXED.page_size :]
        for t, k in zip(kv, MIXED.layers)
    ]
    stored = by_layer.put(tokens, layer_rows, "ns", starts=starts)
    paged = PagedKV(rows)
    if scatter is not None:
        where, tensors = {}, {}
        for p, t in rows.items():
            at = list(range(len(t) + 3))
            scatter.shuffle(at)
            where[p] = at[: len(t)]
            tensors[p] = torch.full((len(t) + 3, *t.shape[1:]), -1.0, dtype=t.dtype)
            tensors[p][where[p]] = t
        paged = PagedKV(tensors, where)
    assert by_page.put(tokens, paged, "ns", starts=starts) == stored
    a, b = by_layer.get(tokens, "ns"), by_page.get(tokens, "ns")
    assert a.tokens == b.tokens and a.starts == b.starts
    assert all(torch.equal(a.pages[p], b.pages[p]) for p in a.pages)
    by_page.check()


def test_paged_kv_of_the_wrong_shape_is_refused_and_changes_nothing():
    from kvfabric.core.cache.page_bytes import pack
    from kvfabric.core.cache.put_rows import PagedKV

    c = make()
    tokens = seq(4)
    kv = prefix_kv(MIXED, tokens)
    good = {p: pack(MIXED, p, kv, list(range(4))) for p in MIXED.pools}
    for bad in (
        {PoolName.FULL: good[PoolName.FULL]},  # a pool missing
        {**good, PoolName.SWA: good[PoolName.SWA][:2]},  # too few pages
        {**good, PoolName.FULL: good[PoolName.FULL].double()},  # another dtype
        {**good, PoolName.FULL: good[PoolName.FULL].reshape(4, -1)},  # not page-shaped
    ):
        with pytest.raises(ValueError):
            c.put(tokens, PagedKV(bad), "ns")
        assert c.match(tokens, "ns").present_pages == 0
    rows = {p: [0, 1, 2, 3] for p in MIXED.pools}
    for bad_rows in (
        {PoolName.FULL: rows[PoolName.FULL]},  # a pool missing
        {**rows, PoolName.SWA: [0, 1, 2]},  # too few rows
        {**rows, PoolName.FULL: [0, 1, 2, 4]},  # a row past the tensor
        {**rows, PoolName.FULL: [0, -1, 2, 3]},  # a negative row
        {**rows, PoolName.FULL: [0, 1.0, 2, 3]},  # not an int
        {**rows, PoolName.FULL: [0, True, 2, 3]},
        {**rows, PoolName.FULL: "0123"},  # not a list
    ):
        with pytest.raises(ValueError):
            c.put(tokens, PagedKV(good, bad_rows), "ns")  # type: ignore[arg-type]
        assert c.match(tokens, "ns").present_pages == 0
    c.check()
