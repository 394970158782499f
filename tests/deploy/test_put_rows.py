"""A put stores only the rows its caller has, and what a request matched stays
held until its put (issue 11, defect 1: SWA pages padded with NaN).

The reference engine on an in-process NodeCache: the request's cached tail is
evicted between its get and its put, so the put's walk branches off before
the SWA rows the request holds. No page may then hold bytes the request did
not compute, and a later request served from the cache must equal the
uncached run bit for bit."""

import pytest
import torch
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.deploy.reference.engine import Engine
from kvfabric.deploy.reference.model import ModelConfig, TinyLM

from tests.core.test_node_cache import MIXED, SWA_ONLY, make, seq
from tests.engine_checks import assert_no_nan, assert_same
from tests.kvgen import prefix_kv

CONFIG = ModelConfig()  # full/swa/full/swa, page 16, window 32 (2 pages)
MODEL = TinyLM(CONFIG)
PS = CONFIG.page_size
NS = "tenant"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab, (n,), generator=g).tolist()


def reference(prompt, max_tokens):
    return Engine(MODEL).generate(prompt, max_tokens, NS, return_logits=True)


class EvictBeforePut:
    """A NodeCache seen by one request, and `between` run once just before its
    first put: what the replica's other request threads and peers' exports do
    between a request's get and its put."""

    def __init__(self, cache: NodeCache, between) -> None:
        self.cache, self.between, self.done = cache, between, False

    def get(self, tokens, namespace, *args, **kw):
        return self.cache.get(tokens, namespace, *args, **kw)

    def put(self, tokens, kv, namespace, **kw):
        if not self.done:
            self.done = True
            self.between()
        return self.cache.put(tokens, kv, namespace, **kw)

    def release_lease(self, lease):
        return self.cache.release_lease(lease)


@pytest.mark.parametrize("hold_expires", [False, True], ids=["held", "hold-expired"])
def test_eviction_between_get_and_put_stores_no_unknown_rows(hold_expires):
    clock = Clock()
    c = NodeCache(
        CONFIG.layout(),
        {PoolName.FULL: PoolCapacity(64, 0), PoolName.SWA: PoolCapacity(32, 0)},
        device="cpu",
        clock=clock,
    )
    engine = Engine(MODEL, c, lease_s=5.0)
    stem, x_tail, y_tail = toks(64, 1), toks(64, 2), toks(32, 3)
    engine.generate(stem + x_tail, 1, NS)  # 8 pages; SWA kept for 6, 7
    engine.generate(stem + y_tail, 1, NS)  # branch at page 4: SWA kept for 2, 3 too
    prompt = stem + x_tail + toks(40, 4)

    def between():
        if hold_expires:  # the request outlived its hold
            clock.now += 10.0
            c.leases.expire()  # (the node actor's heartbeat)
        c.get(stem + y_tail, NS)  # another thread reads the other branch
        c.evict(PoolName.SWA, Tier.DEVICE, 10_000)
        c.evict(PoolName.FULL, Tier.DEVICE, 4)  # the least recent leaf: the matched tail

    got = Engine(MODEL, EvictBeforePut(c, between), lease_s=5.0).generate(
        prompt, 4, NS, return_logits=True
    )
    assert got.cached_tokens == 128
    assert_same(got, reference(prompt, 4))
    assert len(c.leases) == 0  # the put released the hold (or it expired)
    assert_no_nan(c)
    c.check()
    if hold_expires:  # the tail went: the put branched off at page 4, before its SWA rows
        assert c.match(stem + x_tail, NS).present_pages == 8
    else:  # the hold kept the matched prefix whole
        assert c.match(stem + x_tail, NS).usable_pages == 8
    # Later requests on the stem are served from what is stored, and equal the uncached run.
    for later in (stem + toks(30, 5), stem + y_tail + toks(5, 6), prompt):
        assert_same(engine.generate(later, 4, NS, return_logits=True), reference(later, 4))
    assert_no_nan(c)
    c.check()


def test_a_failed_request_releases_its_hold():
    c = NodeCache(
        CONFIG.layout(),
        {PoolName.FULL: PoolCapacity(64, 0), PoolName.SWA: PoolCapacity(32, 0)},
        device="cpu",
    )
    prompt = toks(100, 7)
    Engine(MODEL, c).generate(prompt, 1, NS)

    class Boom(RuntimeError):
        """Any failure of the put: the hold must still be released."""

    class FailingPut(EvictBeforePut):
        def put(self, tokens, kv, namespace, **kw):
            raise Boom("the node's cache went away")

    with pytest.raises(Boom):
        Engine(MODEL, FailingPut(c, None)).generate(prompt, 2, NS)
    assert len(c.leases) == 0
    lock = c.lock(c.match(prompt, NS))  # nothing is left pinned: locks balance
    c.unlock(lock)
    assert c.tree.protected == [[0, 0], [0, 0], [0, 0]]
    c.check()


# --- NodeCache.put with partial rows ------------------------------------------------------
def rows(layout, tokens, starts):
    """prefix_kv of `tokens`, each pool's layers from its start on."""
    kv = prefix_kv(layout, tokens)
    return [
        t[:, starts.get(p, 0) :]
        for t, kind in zip(kv, layout.layers)
        for p in [PoolName.FULL if kind.value == "full" else PoolName.SWA]
    ]


def test_swa_rows_from_a_later_start_leave_earlier_pages_tombstoned():
    c = make(MIXED)
    a = seq(6) + [999]  # ends inside a page: SWA keeps the window before page 6 only
    starts = {PoolName.SWA: 3 * 4}
    assert c.put(a, rows(MIXED, a, starts), NS, starts=starts) == 6
    assert c.presence(c.match(a, NS), PoolName.SWA) == [False] * 4 + [True] * 2
    # A branch at page 2 would keep pages 0, 1 of SWA: the caller has no rows there.
    b = seq(2) + seq(4, 300)
    assert c.put(b + [999], rows(MIXED, b + [999], starts), NS, starts=starts) == 4
    assert c.presence(c.match(b, NS), PoolName.SWA) == [False] * 4 + [True] * 2
    assert c.match(seq(2) + seq(1, 500), NS).usable_pages == 0
    hit = c.get(b, NS)
    want = prefix_kv(MIXED, b)
    assert hit.tokens == 24 and torch.equal(
        hit.layers[1], want[1][:, hit.starts[PoolName.SWA] : 24]
    )
    c.check()


def test_full_rows_must_reach_back_to_the_match():
    # Full KV obeys prefix closure: a put without full rows for a page stores
    # neither that page nor any after it (it stores nothing new, returns 0).
    c = make(MIXED)
    a = seq(6)
    starts = {PoolName.FULL: 2 * 4, PoolName.SWA: 2 * 4}
    assert c.put(a, rows(MIXED, a, starts), NS, starts=starts) == 0
    assert c.tree.node_count == 0
    assert c.put(a[:8], prefix_kv(MIXED, a[:8]), NS) == 2
    assert c.put(a, rows(MIXED, a, starts), NS, starts=starts) == 4
    hit = c.get(a, NS)
    assert hit.tokens == 24 and torch.equal(hit.layers[0], prefix_kv(MIXED, a)[0])
    c.check()


def test_swa_only_rows_must_cover_the_last_page():
    c = make(SWA_ONLY)
    a = seq(4)
    assert c.put(a, rows(SWA_ONLY, a, {PoolName.SWA: 16}), NS, starts={PoolName.SWA: 16}) == 0
    assert c.tree.node_count == 0  # never a leaf with no pages
    assert c.put(a, rows(SWA_ONLY, a, {PoolName.SWA: 12}), NS, starts={PoolName.SWA: 12}) == 4
    m = c.match(a, NS)
    assert m.present_pages == 4 and m.usable_pages == 0  # page 2 of the window was not given
    assert c.presence(m, PoolName.SWA) == [False] * 3 + [True]
    c.check()


@pytest.mark.parametrize(
    "starts",
    [{PoolName.SWA: 3}, {PoolName.SWA: -4}, {PoolName.SWA: 4.0}, {PoolName.SWA: True}, {7: 0}],
)
def test_bad_starts_are_refused_and_the_hold_released(starts):
    c = make(MIXED)
    a = seq(4)
    put_all = c.put(a, prefix_kv(MIXED, a), NS)
    hit = c.get(a, NS, lease_s=5.0)
    assert put_all == 4 and hit.lease and len(c.leases) == 1
    assert c.tree.protected != [[0, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError):
        c.put(
            a + seq(1, 100), prefix_kv(MIXED, a + seq(1, 100)), NS, starts=starts, release=hit.lease
        )
    assert len(c.leases) == 0 and c.tree.protected == [[0, 0], [0, 0], [0, 0]]
    assert c.match(a + seq(1, 100), NS).present_pages == 4  # nothing stored
    c.check()


def test_rows_shorter_than_the_sequence_are_refused():
    c = make(MIXED)
    a = seq(4)
    kv = rows(MIXED, a, {PoolName.SWA: 8})
    with pytest.raises(ValueError, match="kv\\[1\\]"):
        c.put(a, kv, NS)  # SWA rows from 8 handed over as if from 0
    assert c.tree.node_count == 0


def test_hold_pins_the_match_until_released_or_expired():
    clock = Clock()
    c = make(MIXED, full=(6, 0), swa=(4, 0), clock=clock)
    a = seq(5)
    c.put(a + [999], prefix_kv(MIXED, a + [999]), NS)  # SWA: the window before page 5 only
    hit = c.get(a, NS, lease_s=2.0)
    assert hit.tokens == 20 and hit.lease
    assert c.evict(PoolName.FULL, Tier.DEVICE, 100) == 0
    assert c.evict(PoolName.SWA, Tier.DEVICE, 100) == 0  # only the held window is left
    assert c.get(seq(5, 100), NS, lease_s=2.0).lease == 0  # a miss holds nothing
    assert c.put(seq(5, 100), prefix_kv(MIXED, seq(5, 100)), NS) == 0  # no room while held
    clock.now = 2.5
    assert c.leases.expire() == 1 and not c.release_lease(hit.lease)
    assert c.evict(PoolName.FULL, Tier.DEVICE, 100) == 5
    c.put(a, prefix_kv(MIXED, a), NS)
    with pytest.raises(ValueError, match="ttl"):
        c.get(a, NS, lease_s=0.0)
    assert len(c.leases) == 0 and c.tree.protected == [[0, 0], [0, 0], [0, 0]]
    c.check()
