"""Any exception at any step of put, load-back (get), export and import leaves the
cache whole: no open transaction, no lock, no leaked page, `check()` passing, the
bytes of every cached prefix intact, and the cache exactly as before unless the
failing transaction had already passed a point of no return (a commit, or a
seal after which its evictions were final). put, get and export let the
exception through; an import's reader or checksum failure is a TRANSFER_FAILED
outcome, with the pages an unknown reader error may still write quarantined."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.check import PageAudit
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.core.exchange.destination import FetchOutcome, ReadFailed, import_prefix
from kvfabric.core.exchange.source import export_prefix

from tests.core.test_cache_stateful import LAYOUTS, family
from tests.core.test_fetch_walk import copy_reader
from tests.inject import CAN_RAISE_AFTER, EXCEPTIONS, Plan, Step, injecting
from tests.kvgen import prefix_kv

NS = "a"
S = Step
OPS = {
    "put": (S.RESERVE, S.EVICT, S.COPY, S.DEFER_COPY, S.GROW, S.PLACE, S.COMMIT, S.WRITE, S.KEYS),
    "get": (S.RESERVE, S.EVICT, S.COPY, S.DEFER_COPY, S.PLACE, S.COMMIT),
    "export": (S.RESERVE, S.EVICT, S.COPY, S.DEFER_COPY, S.PLACE, S.COMMIT, S.LEASE, S.CHECKSUM),
    "import": (
        S.RESERVE,
        S.EVICT,
        S.COPY,
        S.DEFER_COPY,
        S.GROW,
        S.PLACE,
        S.COMMIT,
        S.KEYS,
        S.READ,
        S.CHECKSUM,
    ),
}


@st.composite
def plans(draw, op: str) -> Plan:
    step = draw(st.sampled_from(OPS[op]))
    after = draw(st.booleans()) if step in CAN_RAISE_AFTER else False
    return Plan(step, draw(st.integers(1, 3)), after, draw(st.sampled_from(EXCEPTIONS)))


scenes = dict(
    layout=st.sampled_from(sorted(LAYOUTS)),
    policy=st.sampled_from(list(WritePolicy)),
    seed=st.integers(0, 2**16),
    i=st.integers(0, 7),
)


def warm(layout_name: str, policy: WritePolicy, seed: int, device: tuple[int, int] = (6, 4)):
    """A cache under pressure: small device pools, a host tier, related prefixes stored."""
    layout = LAYOUTS[layout_name]
    caps = {p: PoolCapacity(device[p], 10) for p in layout.pools}
    cache = NodeCache(layout, caps, tier=TierConfig(policy=policy, selective_hits=1), device="cpu")
    seqs = family(seed)
    for s in seqs[:5]:
        cache.put(s, prefix_kv(layout, s), NS)
    return cache, seqs


def assert_whole(cache: NodeCache) -> None:
    cache.check()
    assert cache.audit() == PageAudit(0, 0, 0)
    assert not cache.open_txns
    assert all(not any(node.locks) for node in cache.tree.nodes())


def assert_settled(cache: NodeCache, inj, before: tuple, keys_before: set, seqs) -> None:
    assert_whole(cache)
    if inj.fired is not None:
        if inj.exact():
            assert cache.snapshot() == before
        if inj.commits == 0:
            assert cache.tree.page_keys() <= keys_before  # nothing half inserted
    cache.release_quarantine(force=True)
    for s in seqs:  # every cached prefix reads back its own bytes
        hit = cache.get(s, NS)
        want = prefix_kv(cache.layout, s)
        for li, kind in enumerate(cache.layout.layers):
            start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
            if hit.tokens:
                assert torch.equal(hit.layers[li], want[li][:, start : hit.tokens])
    assert_whole(cache)


def run(op, inj, cache) -> BaseException | None:
    try:
        op()
    except BaseException as e:  # noqa: B036 -- what escaped must be exactly what was injected
        assert e is inj.fired, f"{type(e).__name__}: {e}"
        return e
    return None


@given(plan=plans("put"), **scenes)
def test_put(plan, layout, policy, seed, i):
    cache, seqs = warm(layout, policy, seed)
    t = seqs[i]
    before, keys = cache.snapshot(), cache.tree.page_keys()
    with injecting(plan, cache) as inj:
        escaped = run(lambda: cache.put(t, prefix_kv(cache.layout, t), NS), inj, cache)
    assert escaped is inj.fired
    assert_settled(cache, inj, before, keys, seqs)


@given(plan=plans("get"), **scenes)
def test_get_load_back(plan, layout, policy, seed, i):
    cache, seqs = warm(layout, policy, seed)
    before, keys = cache.snapshot(), cache.tree.page_keys()
    with injecting(plan, cache) as inj:
        escaped = run(lambda: cache.get(seqs[i], NS), inj, cache)
    assert escaped is inj.fired
    assert_settled(cache, inj, before, keys, seqs)


@given(plan=plans("export"), skip=st.integers(0, 2), **scenes)
def test_export(plan, skip, layout, policy, seed, i):
    cache, seqs = warm(layout, policy, seed)
    leases = LeaseTable(cache)
    before, keys = cache.snapshot(), cache.tree.page_keys()
    grants = []
    with injecting(plan, cache, leases) as inj:
        escaped = run(
            lambda: grants.append(export_prefix(cache, leases, cache.keys(seqs[i], NS), skip, 5.0)),
            inj,
            cache,
        )
    assert escaped is inj.fired
    for grant in grants:
        if grant.lease_id:
            assert leases.release(grant.lease_id)
    assert len(leases) == 0
    assert_settled(cache, inj, before, keys, seqs)


@given(plan=plans("import"), **scenes)
def test_import(plan, layout, policy, seed, i):
    cache, seqs = warm(layout, policy, seed)
    src = NodeCache(
        cache.layout, {p: PoolCapacity(64, 0) for p in cache.layout.pools}, device="cpu"
    )
    t = seqs[i] + [7, 7, 7, 7]
    src.put(t, prefix_kv(src.layout, t), NS)
    leases = LeaseTable(src)
    grant = export_prefix(src, leases, cache.keys(t, NS), cache.match(t, NS).present_pages, 5.0)
    before, keys = cache.snapshot(), cache.tree.page_keys()
    outcomes = []
    with injecting(plan, cache) as inj:
        read = (
            inj.wrap(copy_reader(src, cache)) if plan.step == Step.READ else copy_reader(src, cache)
        )
        escaped = run(lambda: outcomes.append(import_prefix(cache, t, NS, grant, read)), inj, cache)
    if inj.fired is not None and plan.step in (Step.READ, Step.CHECKSUM):
        assert escaped is None and outcomes == [FetchOutcome.TRANSFER_FAILED]
        # The reader did not say it finished: it may still write, so its pages are held.
        assert bool(cache.quarantined) == (plan.step == Step.READ)
    else:
        assert escaped is inj.fired
    if grant.lease_id:
        leases.release(grant.lease_id)
    src.check()
    assert_settled(cache, inj, before, keys, seqs + [t])


def test_a_reader_that_fails_with_read_failed_still_decides_quarantine():
    """The expected exception keeps its meaning: may_still_write says whether pages are held."""
    for may_still_write in (False, True):
        cache, seqs = warm("mixed", WritePolicy.WRITE_BACK, 1, device=(64, 64))
        src = NodeCache(
            cache.layout, {p: PoolCapacity(64, 0) for p in cache.layout.pools}, device="cpu"
        )
        t = list(range(300, 316))
        src.put(t, prefix_kv(src.layout, t), NS)
        grant = export_prefix(src, LeaseTable(src), cache.keys(t, NS), 0, 5.0)
        before = cache.snapshot()

        def read(pool, refs, pages):
            raise ReadFailed("peer gone", may_still_write=may_still_write)

        assert import_prefix(cache, t, NS, grant, read) == FetchOutcome.TRANSFER_FAILED
        assert bool(cache.quarantined) == may_still_write
        assert cache.snapshot() == before
        assert_whole(cache)
