"""A failed fetch leaves the destination's tree whole, on full-only, SWA-only and
mixed layouts: a regression for the emptied path node, and a random walk that
interleaves put / get / fetch (with readers that fail in every way) / evict and
checks every invariant after each step."""

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvfabric.core.cache.check import PageAudit
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.core.exchange.destination import FetchOutcome, ReadFailed, import_prefix
from kvfabric.core.exchange.source import export_prefix

from tests.core.test_cache_stateful import family
from tests.kvgen import prefix_kv

NS = "tenant"
SWA_ONLY = KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=4)
LAYOUTS = {
    "full": KVLayout(layers=("full", "full"), kv_heads=1, head_dim=2, page_size=2),
    "swa": SWA_ONLY,
    "mixed": KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=4),
}


def copy_reader(src: NodeCache, dst: NodeCache):
    """What a healthy transport does: the source's pages land in the destination's."""

    def read(pool, refs, pages):
        for (tier, index), page in zip(refs, pages):
            dst.registry.pool(pool, Tier.DEVICE).data[page] = src.registry.pool(pool, tier).data[
                index
            ]

    return read


def failing_reader(exc: BaseException, write_first: bool, src: NodeCache, dst: NodeCache):
    """A transfer that writes (or not) and then fails with `exc`."""
    copy = copy_reader(src, dst)

    def read(pool, refs, pages):
        if write_first:
            copy(pool, refs, pages)
        raise exc

    return read


def assert_whole(cache: NodeCache) -> None:
    cache.check()
    assert cache.audit() == PageAudit(0, 0, 0)
    assert not cache.open_txns
    assert all(not any(node.locks) for node in cache.tree.nodes())


def test_failed_fetch_after_evicting_the_only_child_leaves_no_empty_leaf():
    """SWA-only: the path node the fetch hangs its pages under holds none itself;
    making room evicts its only child; the read then fails."""
    caps = {PoolName.SWA: PoolCapacity(2, 0)}
    src = NodeCache(SWA_ONLY, caps, device="cpu")
    dst = NodeCache(SWA_ONLY, caps, device="cpu", tier=TierConfig(policy=WritePolicy.WRITE_BACK))
    stored = list(range(12)) + [99]  # 6 pages and a partial one; SWA keeps the last 2
    dst.put(stored, prefix_kv(SWA_ONLY, stored), NS)
    wanted = stored[:6] + [90, 91, 92, 93]  # shares 3 pages (no SWA pages there), then differs
    src.put(wanted + [94], prefix_kv(SWA_ONLY, wanted + [94]), NS)  # SWA: its last 2 pages
    leases = LeaseTable(src)
    grant = export_prefix(
        src, leases, dst.keys(wanted, NS), dst.match(wanted, NS).present_pages, 5.0
    )
    assert grant.pages == 5
    outcome = import_prefix(
        dst, wanted, NS, grant, failing_reader(ReadFailed("peer died"), True, src, dst)
    )
    assert outcome == FetchOutcome.TRANSFER_FAILED
    assert_whole(dst)
    assert dst.tree.node_count == 0  # the emptied head went with its child
    leases.release(grant.lease_id)
    retry = export_prefix(src, leases, dst.keys(wanted, NS), 0, 5.0)
    assert import_prefix(dst, wanted, NS, retry, copy_reader(src, dst)) == FetchOutcome.COMMITTED
    assert_whole(dst)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Boom(Exception):
    """A reader failure no code expects."""


# How a fetch's transfer ends: ok, a reported failure (finished or maybe still writing),
# an unexpected exception after writing some pages or none, or corrupt bytes.
READS = ("ok", "failed", "abandoned", "boom_after_write", "boom", "memory", "corrupt")


class FetchWalk(RuleBasedStateMachine):
    """A destination on small pools fetches from a roomy source while it puts,
    gets, locks and evicts on its own."""

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        policy=st.sampled_from(list(WritePolicy)),
        device=st.integers(2, 6),
        host=st.integers(0, 6),
        seed=st.integers(0, 2**16),
    )
    def setup(self, layout, policy, device, host, seed):
        self.layout = LAYOUTS[layout]
        self.clock = Clock()
        caps = {p: PoolCapacity(device, host) for p in self.layout.pools}
        self.dst = NodeCache(
            self.layout, caps, tier=TierConfig(policy=policy), device="cpu", clock=self.clock
        )
        self.src = NodeCache(
            self.layout, {p: PoolCapacity(128, 0) for p in self.layout.pools}, device="cpu"
        )
        self.leases = LeaseTable(self.src)
        self.seqs = family(seed)
        self.locks = []

    def seq(self, i: int, extra: int) -> list[int]:
        return self.seqs[i % len(self.seqs)] + list(range(200, 200 + extra))

    @rule(i=st.integers(0, 7), extra=st.integers(0, 6))
    def put_dst(self, i, extra):
        t = self.seq(i, extra)
        self.dst.put(t, prefix_kv(self.layout, t), NS)

    @rule(i=st.integers(0, 7), extra=st.integers(0, 6))
    def put_src(self, i, extra):
        t = self.seq(i, extra)
        self.src.put(t, prefix_kv(self.layout, t), NS)

    @rule(i=st.integers(0, 7), extra=st.integers(0, 8))
    def get_dst(self, i, extra):
        t = self.seq(i, extra)
        hit = self.dst.get(t, NS)
        want = prefix_kv(self.layout, t)
        for li, kind in enumerate(self.layout.layers):
            if hit.tokens:
                start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
                assert torch.equal(hit.layers[li], want[li][:, start : hit.tokens])

    @rule(i=st.integers(0, 7), extra=st.integers(0, 8), how=st.sampled_from(READS))
    def fetch(self, i, extra, how):
        t = self.seq(i, extra)
        grant = export_prefix(
            self.src, self.leases, self.dst.keys(t, NS), self.dst.match(t, NS).present_pages, 5.0
        )
        keys = self.dst.tree.page_keys()
        refused = self.dst.quarantines("src")
        outcome = import_prefix(self.dst, t, NS, grant, self.reader(how), peer="src")
        if refused:  # an abandoned read from "src" may still write: no new read starts
            assert outcome == FetchOutcome.PEER_QUARANTINED and self.dst.tree.page_keys() == keys
            how = "refused"
        elif how == "abandoned" and outcome == FetchOutcome.TRANSFER_FAILED:
            assert self.dst.quarantines("src")
        if grant.lease_id:
            assert self.leases.release(grant.lease_id)
        assert len(self.leases) == 0
        if outcome != FetchOutcome.COMMITTED:
            assert self.dst.tree.page_keys() <= keys  # nothing half inserted
        # Outcomes decided before any read (BAD_GRANT: the source is shorter than what we
        # matched and sent no pages for the window we lack) are possible for every reader.
        early = (FetchOutcome.NOTHING_TO_FETCH, FetchOutcome.NO_ROOM, FetchOutcome.BAD_GRANT)
        if how == "refused":
            pass  # any outcome: the checks above hold for all of them
        elif how == "corrupt":
            assert outcome in (FetchOutcome.CHECKSUM_MISMATCH, *early)
        elif how != "ok":
            assert outcome in (FetchOutcome.TRANSFER_FAILED, *early)

    def reader(self, how: str):
        ok = copy_reader(self.src, self.dst)

        def read(pool, refs, pages):
            if how in ("ok", "corrupt", "boom_after_write"):
                ok(pool, refs, pages)
            if how == "corrupt":
                self.dst.registry.pool(pool, Tier.DEVICE).data[pages[0]].view(-1)[0] += 1.0
            elif how != "ok":
                raise {
                    "failed": ReadFailed("peer died"),
                    "abandoned": ReadFailed("deadline", may_still_write=True),
                    "memory": MemoryError("staging"),
                }.get(how, Boom("unexpected"))

        return read

    @rule(i=st.integers(0, 7), extra=st.integers(0, 6))
    def lock(self, i, extra):
        m = self.dst.match(self.seq(i, extra), NS)
        self.locks.append(self.dst.lock(m))

    @precondition(lambda self: self.locks)
    @rule(k=st.integers(0, 10))
    def unlock(self, k):
        self.dst.unlock(self.locks.pop(k % len(self.locks)))

    @rule(
        pool=st.sampled_from(list(PoolName)), tier=st.sampled_from(list(Tier)), n=st.integers(1, 6)
    )
    def evict(self, pool, tier, n):
        if pool in self.dst.registry:
            self.dst.evict(pool, tier, n)

    @rule(dt=st.floats(0.0, 1e6))
    def time_passes(self, dt):
        # No time releases quarantine: a stopped peer may resume after any delay.
        held = [q.pages for q in self.dst.quarantined]
        self.clock.now += dt
        self.dst.release_quarantine()
        assert [q.pages for q in self.dst.quarantined] == held

    @rule()
    def peer_drained(self):
        # "src" died, or a probe read posted after its abandoned ones completed.
        self.dst.release_quarantine("src")
        assert not self.dst.quarantines("src")

    @invariant()
    def whole(self):
        if hasattr(self, "dst"):
            for cache in (self.dst, self.src):
                cache.check()
                assert cache.audit() == PageAudit(0, 0, 0)
                assert not cache.open_txns

    def teardown(self):
        if hasattr(self, "dst"):
            for lock in self.locks:
                self.dst.unlock(lock)
            assert_whole(self.dst)
            self.dst.release_quarantine(force=True)
            freed = 1
            while freed:  # with no locks, everything can go (a tier at a time)
                freed = sum(
                    self.dst.evict(pool, tier, 10_000)
                    for pool in self.dst.registry.names
                    for tier in Tier
                )
            assert_whole(self.dst)
            assert self.dst.tree.node_count == 0


TestFetchWalk = FetchWalk.TestCase
