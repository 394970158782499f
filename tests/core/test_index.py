"""The global prefix index core: event ordering per node, lookup rules on hand-built cases,
and the bulk chain path. Lookups against a brute force: test_index_lookup.py."""

import pytest
from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.cache.layout import Tier
from kvfabric.core.index import presence
from kvfabric.core.index.answers import NodeMatch
from kvfabric.core.index.events import EventBatch, EventError, PageState, Snapshot, decode
from kvfabric.core.index.events import PageMask as M
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import ApplyResult as R
from kvfabric.core.index.prefix_index import PrefixIndex

KEYER = PageKeyer("tenant", b"f" * 16, 2)
FULL_ALL = int(M.FULL | M.SWA)  # every pool on both tiers: 15


def chain(tokens, mask=FULL_ALL):
    """PageStates for a token sequence, every page with `mask`."""
    keys = KEYER.keys(tokens)
    parents = [KEYER.root] + keys[:-1]
    return keys, tuple(PageState(k, p, d, mask) for d, (k, p) in enumerate(zip(keys, parents)))


KEYS, PAGES = chain(list(range(12)))  # 6 pages


def batch(node, epoch, seq, pages=(), cleared=False):
    return EventBatch(node, epoch, seq, tuple(pages), cleared)


def test_in_order_duplicate_and_gap():
    ix = PrefixIndex(MatchRule(2))
    assert ix.apply(batch("a", 1, 0, PAGES[:3])) is R.APPLIED
    assert ix.apply(batch("a", 1, 1, PAGES[3:])) is R.APPLIED
    assert ix.apply(batch("a", 1, 1, [])) is R.DUPLICATE
    assert ix.apply(batch("a", 1, 0, [PageState(KEYS[0], KEYER.root, 0, 0)])) is R.DUPLICATE
    assert ix.lookup(KEYS) == [NodeMatch("a", 6, Tier.DEVICE)]
    gap = batch("a", 1, 3, [PageState(k, KEYER.root, 0, 0) for k in KEYS])
    assert ix.apply(gap) is R.NEED_SNAPSHOT  # nothing of it applied
    assert ix.lookup(KEYS) == [NodeMatch("a", 6, Tier.DEVICE)] and ix.sync_point("a") == (1, 1)
    assert ix.apply(batch("a", 1, 2, [])) is R.APPLIED and ix.apply(gap) is R.APPLIED
    assert ix.lookup(KEYS) == [] and len(ix) == 0
    s = ix.stats()
    assert (s["applied"], s["duplicate"], s["need_snapshot"]) == (4, 2, 1)


def test_first_batch_needs_seq0_or_cleared():
    ix = PrefixIndex(MatchRule(1))
    assert ix.apply(batch("a", 1, 5, PAGES)) is R.NEED_SNAPSHOT
    assert ix.lookup(KEYS) == [] and ix.stats()["out_of_sync"] == ["a"]
    assert ix.apply(batch("a", 1, 6, PAGES[:2], cleared=True)) is R.APPLIED
    assert ix.lookup(KEYS) == [NodeMatch("a", 2, Tier.DEVICE)] and ix.sync_point("a") == (1, 6)


def test_epochs_replace_and_stale():
    ix = PrefixIndex(MatchRule(1))
    ix.apply(batch("a", 2, 0, PAGES))
    assert ix.apply(batch("a", 1, 7, PAGES[:1])) is R.STALE_EPOCH
    assert ix.apply(batch("a", 3, 0, PAGES[:2])) is R.APPLIED  # restart: old pages gone
    assert set(ix.node_pages("a")) == set(KEYS[:2]) and ix.lookup(KEYS)[0].pages == 2
    assert ix.apply(batch("a", 4, 3, PAGES)) is R.NEED_SNAPSHOT  # old state dropped anyway
    assert ix.node_pages("a") == {} and len(ix) == 0
    assert ix.apply(batch("a", 4, 4, PAGES)) is R.NEED_SNAPSHOT  # still out of sync
    assert ix.apply(batch("a", 5, 2, PAGES[:1], cleared=True)) is R.APPLIED
    assert ix.apply(batch("a", 4, 9, PAGES)) is R.STALE_EPOCH


def test_cleared_drops_before_applying():
    ix = PrefixIndex(MatchRule(0))
    ix.apply(batch("a", 1, 0, PAGES))
    ix.apply(batch("b", 1, 0, PAGES[:2]))
    assert ix.apply(batch("a", 1, 1, PAGES[:1], cleared=True)) is R.APPLIED
    assert ix.lookup(KEYS) == [NodeMatch("b", 2, Tier.DEVICE), NodeMatch("a", 1, Tier.DEVICE)]
    assert len(ix) == 2 and ix.page_meta(KEYS[1]) == (KEYS[0], 1) and ix.page_meta(KEYS[4]) is None


def test_snapshot_load_and_order():
    ix = PrefixIndex(MatchRule(2))
    ix.apply(batch("a", 1, 0, PAGES[:1]))
    assert ix.apply(batch("a", 1, 4, PAGES)) is R.NEED_SNAPSHOT
    assert ix.load_snapshot(Snapshot("a", 1, 4, PAGES[:4])) is R.APPLIED
    assert set(ix.node_pages("a")) == set(KEYS[:4]) and ix.sync_point("a") == (1, 4)
    assert ix.apply(batch("a", 1, 4, PAGES)) is R.DUPLICATE
    assert ix.apply(batch("a", 1, 5, PAGES[4:])) is R.APPLIED
    assert ix.lookup(KEYS) == [NodeMatch("a", 6, Tier.DEVICE)]
    assert ix.load_snapshot(Snapshot("a", 1, 3, ())) is R.DUPLICATE  # older than applied
    assert ix.load_snapshot(Snapshot("a", 0, 9, ())) is R.STALE_EPOCH
    assert ix.load_snapshot(Snapshot("a", 2, 0, PAGES[:1])) is R.APPLIED  # newer epoch replaces
    assert (
        ix.lookup(KEYS) == [NodeMatch("a", 1, Tier.DEVICE)] and ix.stats()["snapshots_loaded"] == 2
    )
    # a snapshot names a node the index has never seen: tracked from then on
    assert ix.load_snapshot(Snapshot("b", 7, 3, PAGES)) is R.APPLIED and ix.nodes() == ["a", "b"]


def test_drop_node_and_late_batches():
    ix = PrefixIndex(MatchRule(1))
    ix.apply(batch("a", 1, 0, PAGES))
    ix.apply(batch("b", 1, 0, PAGES[:3]))
    ix.drop_node("a")
    ix.drop_node("nobody")
    assert ix.nodes() == ["b"] and ix.node_pages("a") == {} and len(ix) == 3
    assert ix.lookup(KEYS) == [NodeMatch("b", 3, Tier.DEVICE)]
    assert ix.apply(batch("a", 1, 0, PAGES)) is R.DROPPED  # a late batch cannot resurrect it
    assert ix.apply(batch("a", 0, 5, PAGES)) is R.DROPPED
    assert ix.apply(batch("c", 1, 0, PAGES[:2])) is R.APPLIED  # reuses a's slot
    assert (
        ix.apply(batch("a", 2, 0, PAGES[:1])) is R.DROPPED
    )  # not even a new epoch, until admitted
    ix.admit("a", 2)  # the directory rejoined it
    assert ix.apply(batch("a", 1, 1, PAGES)) is R.STALE_EPOCH
    assert ix.apply(batch("a", 2, 0, PAGES[:1])) is R.APPLIED  # a restarted node is welcome
    assert [m.node for m in ix.lookup(KEYS)] == ["b", "c", "a"]


def test_lookup_rules_swa_window_and_tiers():
    ix = PrefixIndex(MatchRule(2))
    tomb = [
        p if i >= 3 else PageState(p.key, p.parent, p.depth, int(M.FULL_DEVICE))
        for i, p in enumerate(PAGES)
    ]
    ix.apply(batch("tomb", 1, 0, tomb))  # SWA freed on pages 0..2
    hostfull = [
        PageState(p.key, p.parent, p.depth, int(M.FULL_HOST | M.SWA_DEVICE)) for p in PAGES[:4]
    ]
    ix.apply(batch("host", 1, 0, hostfull))
    ix.apply(
        batch(
            "hole",
            1,
            0,
            PAGES[:2] + (PageState(KEYS[2], KEYS[1], 2, int(M.FULL_DEVICE)),) + PAGES[3:],
        )
    )
    assert ix.lookup(KEYS) == [
        NodeMatch("hole", 6, Tier.DEVICE),
        NodeMatch("tomb", 6, Tier.DEVICE),
        NodeMatch("host", 4, Tier.HOST),
    ]
    assert ix.lookup(KEYS[:4]) == [
        NodeMatch("host", 4, Tier.HOST),
        NodeMatch("hole", 2, Tier.DEVICE),
    ]
    assert ix.lookup(KEYS[:3]) == [
        NodeMatch("host", 3, Tier.HOST),
        NodeMatch("hole", 2, Tier.DEVICE),
    ]
    assert ix.lookup([b"?" * 16] + KEYS[1:]) == [] and ix.lookup([]) == []
    # SWA gone on pages 3 and 5: lengths 6, 5 and 4 fail their window, 3 is the best
    gappy = PrefixIndex(MatchRule(2))
    tomb_at = {3, 5}
    gappy.apply(
        batch(
            "g",
            1,
            0,
            [
                PageState(
                    p.key,
                    p.parent,
                    p.depth,
                    int(M.FULL_DEVICE) if i in tomb_at else int(M.FULL_DEVICE | M.SWA_HOST),
                )
                for i, p in enumerate(PAGES)
            ],
        )
    )
    assert gappy.lookup(KEYS) == [NodeMatch("g", 3, Tier.HOST)]
    # falling back never passes the FULL run: page 2 has SWA but no FULL
    masks = [int(M.FULL_DEVICE | M.SWA_DEVICE), int(M.FULL_DEVICE), int(M.SWA_DEVICE)]
    short = PrefixIndex(MatchRule(1))
    short.apply(
        batch("s", 1, 0, [PageState(p.key, p.parent, p.depth, m) for p, m in zip(PAGES, masks)])
    )
    assert short.lookup(KEYS) == [NodeMatch("s", 1, Tier.DEVICE)]
    swa_only = PrefixIndex(MatchRule(2, False))
    swa_only.apply(batch("tomb", 1, 0, tomb))
    assert swa_only.lookup(KEYS) == [NodeMatch("tomb", 6, Tier.DEVICE)]
    assert swa_only.lookup(KEYS[:3]) == []


def test_a_match_says_the_slowest_tier_it_reads_and_ranks_faster_first():
    """The index knows which tier a node holds a match's pages in: device, memory (device
    or host), else disk; the slowest page decides. Equal lengths rank faster tiers first,
    native and pure-Python tables alike."""
    disk, host, both = int(M.FULL_DISK | M.SWA_DISK), int(M.FULL_HOST | M.SWA_HOST), FULL_ALL
    one_on_disk = [both, both, disk, both, both, both]
    swa_on_disk = [int(M.FULL_DEVICE | M.SWA_DISK)] * 6  # the window's pages on disk
    for native in (False, True) if presence.ENABLED else (False,):
        ix = PrefixIndex(MatchRule(2), native=native)
        ix.apply(batch("d", 1, 0, chain(list(range(12)), disk)[1]))
        ix.apply(batch("h", 1, 0, chain(list(range(12)), host)[1]))
        ix.apply(batch("g", 1, 0, PAGES))
        ix.apply(
            batch(
                "m",
                1,
                0,
                [PageState(p.key, p.parent, p.depth, m) for p, m in zip(PAGES, one_on_disk)],
            )
        )
        ix.apply(
            batch(
                "w",
                1,
                0,
                [PageState(p.key, p.parent, p.depth, m) for p, m in zip(PAGES, swa_on_disk)],
            )
        )
        assert ix.lookup(KEYS) == [
            NodeMatch("g", 6, Tier.DEVICE),
            NodeMatch("h", 6, Tier.HOST),
            NodeMatch("d", 6, Tier.DISK),
            NodeMatch("m", 6, Tier.DISK),  # page 2 on disk: the full run reads it
            NodeMatch("w", 6, Tier.DISK),  # the window's SWA pages on disk
        ]
        # Two pages: node m's page on disk is past them; w's window is still on disk.
        assert [(m.node, m.tier) for m in ix.lookup(KEYS[:2])] == [
            ("g", Tier.DEVICE),
            ("m", Tier.DEVICE),
            ("h", Tier.HOST),
            ("d", Tier.DISK),
            ("w", Tier.DISK),
        ]


@pytest.mark.parametrize("bad", [["x" * 16], [b"short"], [bytearray(16)], b"k" * 16])
def test_lookup_rejects_bad_keys(bad):
    with pytest.raises(ValueError):
        PrefixIndex(MatchRule(1)).lookup(bad)


def test_rejects_bad_config_and_events_unchanged():
    for w, full in ((-1, True), (1.5, True), (True, True), (0, False)):
        with pytest.raises(ValueError):
            PrefixIndex(MatchRule(w, full))
    ix = PrefixIndex(MatchRule(1))
    bad = PAGES[:2] + (PageState(b"k" * 15, KEYER.root, 0, 1),)
    for b in (
        batch("a", 1, 0, bad),
        batch("a", 1, 0, [PageState(KEYS[0], KEYER.root, 0, 64)]),
        batch("", 1, 0, PAGES),
        batch("a", -1, 0, PAGES),
        batch("a", 1, True, PAGES),
    ):
        with pytest.raises(EventError):
            ix.apply(b)
    with pytest.raises(EventError):
        ix.load_snapshot(Snapshot("a", 1, 0, (PageState(KEYS[0], KEYER.root, 0, 0),)))
    assert len(ix) == 0 and ix.nodes() == []
    # what crosses the wire decodes into what the index takes
    assert ix.apply(decode(batch("a", 1, 0, PAGES).encode())) is R.APPLIED


def test_apply_chain_equals_batch():
    """A chain is the EventBatch of its PageStates: results, lookups, pages, metas, stats."""
    ix, cx = PrefixIndex(MatchRule(2)), PrefixIndex(MatchRule(2))
    steps = [
        ("a", 1, 0, 0, 3, int(M.FULL_DEVICE | M.SWA_DEVICE), False),  # a put of pages 0..2
        ("a", 1, 1, 3, 6, FULL_ALL, False),  # the rest of the request
        ("b", 1, 0, 0, 4, int(M.FULL_HOST | M.SWA_HOST), True),
        ("a", 1, 2, 4, 6, 0, False),  # an eviction of a suffix
        ("b", 1, 1, 1, 3, int(M.FULL_DEVICE), False),  # a tombstoned window
        ("a", 1, 2, 0, 6, FULL_ALL, False),  # duplicate
        ("a", 1, 4, 0, 6, FULL_ALL, False),  # gap
        ("b", 1, 2, 0, 0, FULL_ALL, False),  # an empty chain
        ("b", 0, 3, 0, 2, FULL_ALL, False),  # stale epoch
        ("a", 2, 0, 2, 5, int(M.FULL_DEVICE | M.SWA_HOST), False),  # restart
        ("b", 1, 7, 5, 6, FULL_ALL, True),
    ]  # cleared after a gap
    for node, epoch, seq, lo, hi, mask, cleared in steps:
        parent = KEYS[lo - 1] if lo else KEYER.root
        b = batch(
            node,
            epoch,
            seq,
            [PageState(p.key, p.parent, p.depth, mask) for p in PAGES[lo:hi]],
            cleared,
        )
        assert cx.apply_chain(node, epoch, seq, KEYS[lo:hi], lo, parent, mask, cleared) is ix.apply(
            b
        )
        assert [cx.lookup(KEYS[:n]) for n in range(1, 7)] == [
            ix.lookup(KEYS[:n]) for n in range(1, 7)
        ]
        assert {n: cx.node_pages(n) for n in "ab"} == {n: ix.node_pages(n) for n in "ab"}
        assert [cx.page_meta(k) for k in KEYS] == [ix.page_meta(k) for k in KEYS]
        assert [cx.sync_point(n) for n in "ab"] == [ix.sync_point(n) for n in "ab"] and len(
            cx
        ) == len(ix)
    assert cx.stats() == ix.stats()
    s = cx.stats()
    assert (s["applied"], s["duplicate"], s["need_snapshot"], s["stale_epoch"]) == (8, 1, 1, 1)
    assert set(cx.node_pages("a")) == set(KEYS[2:5]) and set(cx.node_pages("b")) == {KEYS[5]}
    assert cx.lookup(KEYS) == [] and cx.page_meta(KEYS[3]) == (KEYS[2], 3)
    # tuples and PageMask flags are fine too
    assert cx.apply_chain("c", 1, 0, tuple(KEYS), 0, KEYER.root, M.FULL_DEVICE) is R.APPLIED
    assert cx.node_pages("c") == {p.key: PageState(p.key, p.parent, p.depth, 1) for p in PAGES}


def test_apply_chain_records_repeats_and_overwrites():
    """A chain's pages are stored as one record: metas follow each key's last position,
    and later publications (chains or single pages) override parts of it."""
    ix, cx = PrefixIndex(MatchRule(0)), PrefixIndex(MatchRule(0))
    odd = [KEYS[0], KEYS[1], KEYS[0], KEYS[2]]  # a key twice: its last place wins
    ix.apply(
        batch(
            "a", 1, 0, [PageState(k, ([KEYER.root] + odd)[i], 7 + i, 1) for i, k in enumerate(odd)]
        )
    )
    cx.apply_chain("a", 1, 0, odd, 7, KEYER.root, 1)
    assert cx.node_pages("a") == ix.node_pages("a") and cx.page_meta(KEYS[0]) == (KEYS[1], 9)
    for x in (ix, cx):
        x.apply(
            batch("a", 1, 1, [PageState(KEYS[1], KEYS[0], 1, 3), PageState(KEYS[2], KEYS[1], 2, 0)])
        )
        x.apply(batch("b", 1, 0, PAGES[:2]))
    cx.apply_chain("a", 1, 2, KEYS[3:5], 3, KEYS[2], 2)
    ix.apply(batch("a", 1, 2, [PageState(p.key, p.parent, p.depth, 2) for p in PAGES[3:5]]))
    assert cx.node_pages("a") == ix.node_pages("a") and cx.node_pages("b") == ix.node_pages("b")
    assert [cx.page_meta(k) for k in KEYS] == [ix.page_meta(k) for k in KEYS]
    assert cx.page_meta(KEYS[1]) == (KEYS[0], 1) and cx.page_meta(KEYS[2]) is None
    assert (
        cx.lookup(KEYS)
        == ix.lookup(KEYS)
        == [NodeMatch("a", 2, Tier.DEVICE), NodeMatch("b", 2, Tier.DEVICE)]
    )


@pytest.mark.parametrize(
    "args",
    [
        dict(keys=KEYS[:2] + [b"k" * 15]),
        dict(keys=["x" * 16]),
        dict(keys=[bytearray(16)]),
        dict(keys=b"k" * 16),
        dict(keys=KEYS[0]),
        dict(keys=7),
        dict(parent=b"p" * 15),
        dict(parent="p" * 16),
        dict(first_depth=-1),
        dict(first_depth=1.0),
        dict(first_depth=True),
        dict(mask=64),
        dict(mask=-1),
        dict(mask=True),
        dict(mask=1.0),
        dict(cleared=1),
        dict(node=""),
        dict(node=None),
        dict(epoch=-1),
        dict(seq=True),
    ],
)
def test_apply_chain_rejects_bad_input(args):
    ix = PrefixIndex(MatchRule(1))
    ok = dict(node="a", epoch=1, seq=0, keys=KEYS, first_depth=0, parent=KEYER.root, mask=FULL_ALL)
    with pytest.raises(EventError):
        ix.apply_chain(**{**ok, **args})
    assert len(ix) == 0 and ix.nodes() == [] and ix.stats()["applied"] == 0
    assert ix.apply_chain(**ok) is R.APPLIED and ix.lookup(KEYS) == [NodeMatch("a", 6, Tier.DEVICE)]
    # the next batch of a node in sync (the fast path: the table checks): refused alike
    before = (ix.node_pages("a"), ix.sync_point("a"), ix.stats())
    nxt = {**ok, "seq": 1, "keys": KEYS[:3], "mask": int(M.FULL_HOST)}
    with pytest.raises(EventError):
        ix.apply_chain(**{**nxt, **args})
    assert (ix.node_pages("a"), ix.sync_point("a"), ix.stats()) == before
    assert ix.apply_chain(**nxt) is R.APPLIED and ix.sync_point("a") == (1, 1)
    assert ix.lookup(KEYS) == [NodeMatch("a", 6, Tier.HOST)]


def test_apply_chain_in_sync_takes_int_subclasses():
    """The table's own check takes exact ints; a PageMask or an IntFlag depth from a node
    in sync still applies (the full path converts it), as for the first batch."""
    ix, cx = PrefixIndex(MatchRule(0)), PrefixIndex(MatchRule(0))
    assert ix.apply_chain("a", 1, 0, KEYS[:2], 0, KEYER.root, M.FULL_DEVICE) is R.APPLIED
    assert ix.apply_chain("a", 1, 1, KEYS[2:4], M.FULL_HOST, KEYS[1], M.FULL_HOST) is R.APPLIED
    cx.apply(
        batch("a", 1, 0, [PageState(k, p.parent, p.depth, 1) for k, p in zip(KEYS[:2], PAGES)])
    )
    cx.apply(
        batch("a", 1, 1, [PageState(k, p.parent, p.depth, 2) for k, p in zip(KEYS[2:4], PAGES[2:])])
    )
    assert ix.node_pages("a") == cx.node_pages("a") and ix.stats() == cx.stats()
    assert ix.lookup(KEYS) == cx.lookup(KEYS) == [NodeMatch("a", 4, Tier.HOST)]


def test_twenty_thousand_engine_lives_leave_one_shard_as_it_was():
    """Engines are named per life (the Serve replica id): each life admitted, publishing
    pages that node actors hold too, then retired. The shard's slots stay those of the
    publishers alive, its memory stops growing once the retired names it remembers reach
    their bound (and its tables their size under this churn: the C table's held keys keep
    their order in an array that doubles until it holds twice the live keys, here within
    12,000 lives), and lookups answer as before."""
    import tracemalloc

    from kvfabric.core.index.admission import Admission

    ix = PrefixIndex(MatchRule(2))
    ix.admission = Admission(max_retired=512)
    keyer = PageKeyer("tenant", b"f" * 16, 2)
    held = list(range(40_000))  # two node actors hold 10,000 pages (of 2 tokens) each
    keys = keyer.keys(held)
    parents = [keyer.root] + keys[:-1]
    for node, part in (("kvf-node-a", slice(0, 10_000)), ("kvf-node-b", slice(10_000, 20_000))):
        pages = [PageState(k, p, d, FULL_ALL) for d, (k, p) in enumerate(zip(keys, parents))]
        ix.apply(batch(node, 1, 0, pages[part]))
    probe = keys[:1024]
    want = ix.lookup(probe)
    slots, marks = ix.stats()["slots"], {}
    tracemalloc.start()
    try:
        for life in range(20_000):
            name = f"kvf-node-a/engine/replica-{life}"
            ix.admit(name, 1)
            d = life % 1000
            own = PageState(KEYER.keys([life, life])[0], KEYER.root, 0, FULL_ALL)
            shared = [PageState(keys[i], parents[i], i, FULL_ALL) for i in range(d, d + 8)]
            assert ix.apply(batch(name, 1, 0, [own, *shared])) is R.APPLIED
            if life % 3 == 0:  # a life that dies with a late batch still in flight
                late = batch(name, 1, 1, [own])
            ix.retire(name, 1)
            if life % 3 == 0:
                assert ix.apply(late) is R.STALE_EPOCH
            if life in (14_000, 19_999):
                marks[life] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    s = ix.stats()
    assert s["slots"] <= slots + 1 and s["nodes"] == 2 and s["floors"] <= 512 + 2
    assert marks[19_999] - marks[14_000] < 16 << 10, marks  # flat, not 6,000 lives more
    assert ix.lookup(probe) == want and len(ix) == 20_000
    # A later life of a retired name (a stable slot name) is a publisher again.
    ix.admit("kvf-node-a/engine/replica-7", 2)
    ix.apply(batch("kvf-node-a/engine/replica-7", 2, 0, PAGES[:1]))
    assert ix.node_pages("kvf-node-a/engine/replica-7")
