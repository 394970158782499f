"""The remote-fetch transaction between two caches, with the page reads done
in process: every failure at every step leaves the destination as it was."""

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig
from kvfabric.core.exchange.destination import FetchOutcome, ReadFailed, import_prefix
from kvfabric.core.exchange.grant import ExportGrant, GrantError
from kvfabric.core.exchange.source import export_prefix
from kvfabric.deploy.chaos.faults import AllocationFaults

from tests.kvgen import prefix_kv

LAYOUT = KVLayout(layers=("full", "swa", "full"), kv_heads=2, head_dim=4, page_size=4, window=8)
NS = "tenant"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def cache(faults=None, full=(16, 16), swa=(8, 8)):
    return NodeCache(
        LAYOUT,
        {PoolName.FULL: PoolCapacity(*full), PoolName.SWA: PoolCapacity(*swa)},
        tier=TierConfig(policy="write_back"),
        device="cpu",
        reserve_hook=faults,
    )


def reader(src: NodeCache, dst: NodeCache, fail_on=None, corrupt_on=None, hang_on=None):
    calls = []

    def read(pool, refs, pages):
        calls.append(pool)
        if hang_on == len(calls):
            read.late = (pool, pages)  # the hung peer could still write these
            raise ReadFailed("injected: deadline passed, transfer abandoned", may_still_write=True)
        if fail_on == len(calls):
            # a peer dying mid-transfer leaves the destination partly written
            dst.registry.pool(pool, Tier.DEVICE).data[pages[:1]] = 7.0
            raise ReadFailed("injected: peer died")
        for (tier, index), page in zip(refs, pages):
            dst.registry.pool(pool, Tier.DEVICE).data[page] = src.registry.pool(pool, tier).data[
                index
            ]
        if corrupt_on == len(calls):
            dst.registry.pool(pool, Tier.DEVICE).data[pages[-1]].view(-1)[3] += 1.0

    read.calls = calls
    return read


def tokens(n_pages, start=0):
    return list(range(start, start + n_pages * LAYOUT.page_size))


def assert_kv(c, toks, pages):
    hit = c.get(toks, NS)
    assert hit.tokens == pages * LAYOUT.page_size
    want = prefix_kv(LAYOUT, toks)
    for i, kind in enumerate(LAYOUT.layers):
        start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
        assert torch.equal(hit.layers[i], want[i][:, start : hit.tokens])


def setup_pair(dst_faults=None, dst_prefix=0, src_on_host=False, clock=None):
    src, dst = cache(), cache(dst_faults)
    if clock is not None:
        dst.clock = clock
    t = tokens(6)
    src.put(t, prefix_kv(LAYOUT, t), NS)
    if src_on_host:  # push the source's pages to host: the export reads them there
        src.evict(PoolName.FULL, Tier.DEVICE, 16)
        src.evict(PoolName.SWA, Tier.DEVICE, 16)
        assert src.match(t, NS).usable_device_pages == 0 and src.match(t, NS).usable_pages == 6
    if dst_prefix:
        dst.put(t[: dst_prefix * 4], prefix_kv(LAYOUT, t[: dst_prefix * 4]), NS)
    return src, dst, t


@pytest.mark.parametrize("dst_prefix", [0, 2, 5])
@pytest.mark.parametrize("src_on_host,device_only", [(False, True), (True, True), (True, False)])
def test_fetch_moves_full_and_swa_bytes(dst_prefix, src_on_host, device_only):
    src, dst, t = setup_pair(dst_prefix=dst_prefix, src_on_host=src_on_host)
    leases = LeaseTable(src)
    skip = dst.match(t, NS).present_pages
    grant = export_prefix(src, leases, dst.keys(t, NS), skip, 5.0, device_only=device_only)
    tiers = {t for pp in grant.pools.values() for t in pp.tiers}
    assert tiers == ({Tier.HOST} if src_on_host and not device_only else {Tier.DEVICE})
    grant = ExportGrant.from_wire(msgpack.unpackb(msgpack.packb(grant.to_wire())))
    assert grant.pages == 6 and len(leases) == 1
    assert (
        src.stats().pools["FULL/HOST" if src_on_host and not device_only else "FULL/DEVICE"][
            "protected"
        ]
        > 0
    )
    assert import_prefix(dst, t, NS, grant, reader(src, dst)) == FetchOutcome.COMMITTED
    assert leases.release(grant.lease_id)
    src.check(), dst.check()
    assert src.stats().pools["FULL/DEVICE"]["protected"] == 0
    assert_kv(dst, t, 6)


def run_fetch(fault):
    """One fetch with `fault`; returns (outcome, dst, snapshot before, src, leases, grant, t)."""
    faults = AllocationFaults()
    clock = Clock()
    src, dst, t = setup_pair(faults, dst_prefix=2, clock=clock)
    leases = LeaseTable(src, clock)
    grant = export_prefix(src, leases, dst.keys(t, NS), 2, ttl_s=5.0)
    read = reader(src, dst, **fault.get("reader", {}))
    if "alloc" in fault:
        faults.arm(fault["alloc"])
    if "mutate" in fault:
        grant = fault["mutate"](grant)
    before = dst.snapshot()
    outcome = import_prefix(dst, t, fault.get("ns", NS), grant, read, peer="src")
    faults.disarm()
    if hasattr(read, "late"):  # the abandoned transfer lands late: only quarantined pages change
        pool, pages = read.late
        dst.registry.pool(pool, Tier.DEVICE).data[pages] = -1.0
        assert dst.quarantined
    return outcome, dst, before, src, leases, clock, grant, t


FAULTS = {
    "alloc_full": ({"alloc": 1}, FetchOutcome.NO_ROOM),
    "alloc_swa": ({"alloc": 2}, FetchOutcome.NO_ROOM),
    "read_full_dies": ({"reader": {"fail_on": 1}}, FetchOutcome.TRANSFER_FAILED),
    "read_swa_dies": ({"reader": {"fail_on": 2}}, FetchOutcome.TRANSFER_FAILED),
    "hang_full": ({"reader": {"hang_on": 1}}, FetchOutcome.TRANSFER_FAILED),
    "hang_swa": ({"reader": {"hang_on": 2}}, FetchOutcome.TRANSFER_FAILED),
    "corrupt_full": ({"reader": {"corrupt_on": 1}}, FetchOutcome.CHECKSUM_MISMATCH),
    "corrupt_swa": ({"reader": {"corrupt_on": 2}}, FetchOutcome.CHECKSUM_MISMATCH),
    "other_tenant": ({"ns": "intruder"}, FetchOutcome.BAD_GRANT),
    "other_layout": (
        {"mutate": lambda g: ExportGrant(g.lease_id, b"x" * 16, g.pages, g.keys, g.pools)},
        FetchOutcome.BAD_GRANT,
    ),
    "short_grant": (
        {"mutate": lambda g: ExportGrant(g.lease_id, g.fingerprint, g.pages, g.keys, {})},
        FetchOutcome.BAD_GRANT,
    ),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_every_fault_rolls_back_whole_and_a_retry_succeeds(name):
    fault, expected = FAULTS[name]
    outcome, dst, before, src, leases, clock, grant, t = run_fetch(fault)
    assert outcome == expected
    assert dst.snapshot() == before  # nothing inserted, nothing leaked
    dst.check()
    assert dst.match(t, NS).usable_pages == 2
    clock.now += 11.0  # the requester never released: the lease expires
    assert leases.expire() == 1 and leases.overdue() == 0
    held = list(dst.quarantined)
    dst.release_quarantine()
    assert dst.quarantined == held  # time alone frees no quarantined page
    src.check()
    assert src.stats().pools["FULL/DEVICE"]["protected"] == 0
    retry = export_prefix(src, leases, dst.keys(t, NS), 2, 5.0)
    if held:  # the hung peer may still write: no new read from it starts
        assert (
            import_prefix(dst, t, NS, retry, reader(src, dst), peer="src")
            == FetchOutcome.PEER_QUARANTINED
        )
        assert dst.snapshot() == before
        assert dst.release_quarantine("src") == sum(len(p) for q in held for p in q.pages.values())
    assert import_prefix(dst, t, NS, retry, reader(src, dst), peer="src") == FetchOutcome.COMMITTED
    leases.release(retry.lease_id)
    assert_kv(dst, t, 6)
    dst.check()


@pytest.mark.parametrize("during_read", [1, 2])
@pytest.mark.parametrize("other_pages", [1, 3, 6])
def test_a_put_that_evicts_during_a_read_leaves_the_import_whole(during_read, other_pages):
    """The node actor gives up the cache's lock while a read moves bytes: a put of another
    prefix may run then and evict. It must not take the pages or the path the import
    grows from (its read-in pages are reserved; its path is locked)."""
    src, t = cache(), tokens(6)
    src.put(t, prefix_kv(LAYOUT, t), NS)
    dst = cache(full=(8, 0), swa=(8, 0))  # the import takes 6 pages: the put must evict
    dst.put(t[:8], prefix_kv(LAYOUT, t[:8]), NS)
    grant = export_prefix(src, LeaseTable(src), dst.keys(t, NS), 2, 5.0)
    other = tokens(other_pages, 1000)
    base, stored = reader(src, dst), []

    def read(pool, refs, pages):
        base(pool, refs, pages)
        if len(base.calls) == during_read:
            stored.append(dst.put(other, prefix_kv(LAYOUT, other), NS))
            dst.check()  # the pages being read in belong to the import meanwhile

    assert import_prefix(dst, t, NS, grant, read) == FetchOutcome.COMMITTED
    dst.check()
    assert_kv(dst, t, 6)
    hit = dst.get(other, NS)  # whatever the put stored is whole and right
    assert hit.tokens == stored[0] * LAYOUT.page_size or stored[0] == 0


def test_export_without_device_room_ends_at_the_device_prefix():
    src, dst, t = setup_pair(src_on_host=True)
    blocker = tokens(4, 500)
    src.put(blocker, prefix_kv(LAYOUT, blocker), NS)
    src.lock(src.match(blocker, NS))  # device room is pinned elsewhere
    src.put(tokens(12, 700), prefix_kv(LAYOUT, tokens(12, 700)), NS)
    src.lock(src.match(tokens(12, 700), NS))
    assert src.match(t, NS).usable_device_pages == 0
    leases = LeaseTable(src)
    grant = export_prefix(src, leases, dst.keys(t, NS), 0, 5.0)
    assert grant.pages == 0 and grant.lease_id == 0 and len(leases) == 0
    src.check()
    assert src.stats().pools["FULL/HOST"]["protected"] == 0  # the export's own pin is gone


def test_nothing_to_fetch_and_shorter_source():
    src, dst, t = setup_pair(dst_prefix=6)
    leases = LeaseTable(src)
    grant = export_prefix(src, leases, dst.keys(t, NS), 6, 5.0)
    assert grant.lease_id == 0 and len(leases) == 0  # nothing pinned for nothing
    assert import_prefix(dst, t, NS, grant, reader(src, dst)) == FetchOutcome.NOTHING_TO_FETCH
    longer = t + tokens(3, 900)
    grant = export_prefix(src, leases, dst.keys(longer, NS), 0, 5.0)
    assert grant.pages == 6  # the length the source really has


def test_a_fetch_is_stored_as_a_put_is():
    # One insert path: a write-through destination backs fetched pages up to host and
    # counts them, exactly as it does for pages it computed itself.
    src, _, t = setup_pair()
    dst = NodeCache(
        LAYOUT,
        {PoolName.FULL: PoolCapacity(16, 16), PoolName.SWA: PoolCapacity(8, 8)},
        tier=TierConfig(policy="write_through"),
        device="cpu",
    )
    put_twin = NodeCache(
        LAYOUT,
        {PoolName.FULL: PoolCapacity(16, 16), PoolName.SWA: PoolCapacity(8, 8)},
        tier=TierConfig(policy="write_through"),
        device="cpu",
    )
    # A fetch stores what a match of its pages needs: a put of tokens ending inside a
    # page does the same (on a page boundary it keeps one more SWA window page).
    twin_tokens = list(t) + [12345]
    put_twin.put(twin_tokens, prefix_kv(LAYOUT, twin_tokens), NS)
    grant = export_prefix(src, LeaseTable(src), dst.keys(t, NS), 0, 5.0)
    assert import_prefix(dst, t, NS, grant, reader(src, dst)) == FetchOutcome.COMMITTED
    dst.check()
    assert dst.snapshot() == put_twin.snapshot()
    assert dst.stats().inserted_pages == put_twin.stats().inserted_pages == 6
    assert dst.stats().pools["FULL/HOST"] == put_twin.stats().pools["FULL/HOST"]
    assert dst.match(t, NS).usable_pages == 6


@given(
    st.dictionaries(
        st.sampled_from(["v", "lease", "fp", "pages", "keys", "pools", "x"]),
        st.one_of(
            st.integers(-3, 3),
            st.binary(max_size=20),
            st.none(),
            st.booleans(),
            st.lists(st.binary(min_size=16, max_size=16), max_size=3),
            st.lists(
                st.lists(
                    st.one_of(st.integers(-1, 3), st.lists(st.integers(-1, 3), max_size=3)),
                    max_size=6,
                ),
                max_size=3,
            ),
        ),
    )
)
def test_malformed_grants_are_rejected(msg):
    try:
        grant = ExportGrant.from_wire(msg)
    except GrantError:
        return
    assert grant.pages == len(grant.keys)


def test_grant_wire_rejects_each_bad_field():
    src, dst, t = setup_pair()
    good = export_prefix(src, LeaseTable(src), dst.keys(t, NS), 0, 5.0).to_wire()
    assert ExportGrant.from_wire(good).pages == 6
    bad = [
        dict(good, v=2),
        dict(good, pages=5),
        dict(good, lease=-1),
        dict(good, keys=good["keys"][:-1]),
        dict(good, pools=[[0, 0, [3], [1], [1]]]),
        dict(good, pools=[[7, *good["pools"][0][1:]]]),
        dict(good, pools=[good["pools"][0], good["pools"][0]]),
        dict(good, pools=[[0, 5, *good["pools"][0][2:]]]),
        {k: v for k, v in good.items() if k != "fp"},
    ]
    for msg in bad:
        with pytest.raises(GrantError):
            ExportGrant.from_wire(msg)
