"""Incremental eviction (candidates.py) makes exactly the walk's choices: two caches, one
keeping its candidates across evictions and one walking the tree per eviction (the
reference), driven through the same random puts, gets, leases, locks, evictions and failed
operations (reservations failed, any exception at any step), drop the same pages in the
same order and end every step with equal snapshots, stats and evictor counts. A kept heap,
brought up to date, holds exactly the walk's groups."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvfabric.core.cache.candidates import CandidateHeap, Candidates
from kvfabric.core.cache.check import PageAudit
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.radix import RadixTree
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.deploy.chaos.faults import AllocationFaults

from tests.core.test_cache_stateful import NAMESPACES, family, small_capacities
from tests.examples import examples
from tests.inject import CAN_RAISE_AFTER, EXCEPTIONS, Plan, Step, injecting
from tests.kvgen import prefix_kv

LAYOUTS = {
    "full": KVLayout(layers=("full",), kv_heads=1, head_dim=2, page_size=2),
    "mixed": KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=3),
    "swa": KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=2),
    # Windows of several nodes: an anchor's change moves the cut of nodes far above it.
    "mixed-wide": KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=1, window=6),
    "swa-wide": KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=1, window=5),
}
PUT_STEPS = (Step.RESERVE, Step.EVICT, Step.COPY, Step.DEFER_COPY, Step.GROW, Step.PLACE)


def logged(tree: RadixTree, log: list) -> None:
    """Record every page drop of `tree` (eviction's and pruning's), in order."""
    real = tree.drop_pages

    def drop_pages(node, tier, pool, offsets, journal):
        log.append((node.keys[0], node.start, tier, pool, tuple(offsets)))
        return real(node, tier, pool, offsets, journal)

    tree.drop_pages = drop_pages  # type: ignore[method-assign]


def live_groups(heap: CandidateHeap) -> list:
    return sorted(
        (r, k, o) for r, k, o, stamp, node in heap.entries if heap.stamps.get(node) == stamp
    )


class TwinMachine(RuleBasedStateMachine):
    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        policy=st.sampled_from(list(WritePolicy)),
        seed=st.integers(0, 2**16),
        device=st.integers(3, 10),
        host=st.sampled_from([0, 4, 12]),
        walk_share=st.sampled_from([0.5, float("inf")]),
    )
    def setup(self, layout, policy, seed, device, host, walk_share):
        self.layout = LAYOUTS[layout]
        caps = small_capacities(self.layout, device, host)
        self.twins, self.logs, self.faults = [], [], []
        for incremental in (True, False):
            faults = AllocationFaults()
            cache = NodeCache(
                self.layout,
                caps,
                tier=TierConfig(policy=policy, selective_hits=2),
                device="cpu",
                reserve_hook=faults,
                incremental_eviction=incremental,
            )
            if incremental:
                candidates = next(iter(cache.evictors.values())).candidates
                assert candidates is not None
                candidates.walk_share = walk_share
            log: list = []
            logged(cache.tree, log)
            self.twins.append(cache)
            self.logs.append(log)
            self.faults.append(faults)
        self.seqs = family(seed) + family(seed + 1)
        self.leases: list[tuple[int, int]] = []
        self.locks: list[tuple] = []

    def tokens(self, i: int) -> list[int]:
        return self.seqs[i % len(self.seqs)]

    def both(self, op) -> None:
        """`op(cache)` on both; they must return or raise alike."""
        out = []
        for cache in self.twins:
            try:
                out.append(("ok", op(cache)))
            except Exception as e:  # compared below: the twins must fail alike
                out.append(("raised", type(e)))
        assert out[0] == out[1]

    @rule(i=st.integers(0, 15), ns=st.sampled_from(NAMESPACES))
    def put(self, i, ns):
        t = self.tokens(i)
        self.both(lambda c: c.put(t, prefix_kv(self.layout, t), ns))

    @rule(i=st.integers(0, 15), ns=st.sampled_from(NAMESPACES), extra=st.integers(0, 3))
    def get(self, i, ns, extra):
        t = self.tokens(i) + list(range(100, 100 + extra))
        self.both(lambda c: c.get(t, ns).tokens)

    @rule(i=st.integers(0, 15), ns=st.sampled_from(NAMESPACES))
    def get_and_hold(self, i, ns):
        got = [c.get(self.tokens(i), ns, lease_s=1e9) for c in self.twins]
        assert got[0].tokens == got[1].tokens and bool(got[0].lease) == bool(got[1].lease)
        if got[0].lease:
            self.leases.append((got[0].lease, got[1].lease))

    @precondition(lambda self: self.leases)
    @rule(k=st.integers(0, 10))
    def release_lease(self, k):
        ids = self.leases.pop(k % len(self.leases))
        assert [c.release_lease(h) for c, h in zip(self.twins, ids)] == [True, True]

    @rule(i=st.integers(0, 15), ns=st.sampled_from(NAMESPACES))
    def lock(self, i, ns):
        self.locks.append(tuple(c.lock(c.match(self.tokens(i), ns)) for c in self.twins))

    @precondition(lambda self: self.locks)
    @rule(k=st.integers(0, 10))
    def unlock(self, k):
        for c, lock in zip(self.twins, self.locks.pop(k % len(self.locks))):
            c.unlock(lock)

    @rule(
        pool=st.sampled_from(list(PoolName)), tier=st.sampled_from(list(Tier)), n=st.integers(1, 8)
    )
    def evict(self, pool, tier, n):
        if pool in self.layout.pools:
            self.both(lambda c: c.evict(pool, tier, n))

    @rule(i=st.integers(0, 15), ns=st.sampled_from(NAMESPACES), point=st.integers(1, 4))
    def failed_reservation(self, i, ns, point):
        t = self.tokens(i)
        for faults in self.faults:
            faults.arm(point)
        self.both(lambda c: c.put(t, prefix_kv(self.layout, t), ns))
        for faults in self.faults:
            faults.disarm()

    @rule(
        i=st.integers(0, 15),
        ns=st.sampled_from(NAMESPACES),
        step=st.sampled_from(PUT_STEPS),
        at=st.integers(1, 3),
        after=st.booleans(),
        exc=st.sampled_from(EXCEPTIONS),
        get=st.booleans(),
    )
    def failed_step(self, i, ns, step, at, after, exc, get):
        plan = Plan(step, at, after and step in CAN_RAISE_AFTER, exc)
        t = self.tokens(i)
        fired = []
        for cache in self.twins:
            with injecting(plan, cache) as inj:
                try:
                    if get:
                        cache.get(t, ns)
                    else:
                        cache.put(t, prefix_kv(self.layout, t), ns)
                except BaseException as e:  # noqa: B036 -- exactly what was injected, below
                    assert e is inj.fired
            fired.append(inj.fired is not None)
        assert fired[0] == fired[1]

    @rule()
    def heaps_hold_the_walks_groups(self):
        """Each kept heap, brought up to date as an eviction would, holds exactly the
        groups a walk finds now."""
        assert_heaps_agree(self.twins[0])

    @invariant()
    def twins_agree(self):
        if not hasattr(self, "twins"):
            return
        inc, ref = self.twins
        assert self.logs[0] == self.logs[1]
        assert inc.snapshot() == ref.snapshot()
        assert inc.stats() == ref.stats()
        for p in self.layout.pools:
            a, b = inc.evictors[p], ref.evictors[p]
            assert (a.evicted, a.written_back) == (b.evicted, b.written_back)
        shape = [
            [(n.keys[0], n.start, n.n, n.last_access, n.hits) for n in c.tree.nodes()]
            for c in self.twins
        ]
        assert sorted(shape[0]) == sorted(shape[1])
        inc.check()
        assert inc.audit() == PageAudit(0, 0, 0) and not inc.open_txns

    def teardown(self):
        if not hasattr(self, "twins"):
            return
        for ids in self.leases:
            assert [c.release_lease(h) for c, h in zip(self.twins, ids)] == [True, True]
        for locks in self.locks:
            for c, lock in zip(self.twins, locks):
                c.unlock(lock)
        while True:  # with nothing held, everything goes (a device copy with children
            freed = [0, 0]  # goes once they have left the host), alike
            for pool in self.layout.pools:
                for tier in Tier:
                    for k, cache in enumerate(self.twins):
                        freed[k] += cache.evict(pool, tier, 10_000)
            assert freed[0] == freed[1]
            self.twins_agree()
            if not freed[0]:
                break
        assert self.twins[0].tree.node_count == 0


TwinMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=50, deadline=None
)
TestTwins = TwinMachine.TestCase


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_long_run_under_pressure_agrees(layout):
    """Many puts and gets of related sequences through small pools: the kept heaps, walked
    once each to be built, make the walk's choices all along."""
    lay = LAYOUTS[layout]
    caps = {p: PoolCapacity(64, 32) for p in lay.pools}
    twins = [NodeCache(lay, caps, device="cpu", incremental_eviction=b) for b in (True, False)]
    candidates = next(iter(twins[0].evictors.values())).candidates
    assert candidates is not None
    candidates.walk_share = float("inf")  # never walk where changes can be looked at
    logs: list[list] = [[], []]
    for cache, log in zip(twins, logs):
        logged(cache.tree, log)
    seqs = [s for seed in range(30) for s in family(seed)]
    for k, s in enumerate(seqs):
        for cache in twins:
            cache.put(s, prefix_kv(lay, s), NAMESPACES[k % 2])
            cache.get(seqs[k // 2], NAMESPACES[k % 2])
    assert logs[0] == logs[1] and len(logs[0]) > 100
    assert twins[0].snapshot() == twins[1].snapshot() and twins[0].stats() == twins[1].stats()
    assert sum(h.walks for h in candidates.heaps.values()) == len(candidates.heaps)  # builds


def assert_heaps_agree(cache: NodeCache) -> None:
    candidates = next(iter(cache.evictors.values())).candidates
    assert isinstance(candidates, Candidates)
    for (pool, tier, keep_copy), heap in list(candidates.heaps.items()):
        with candidates.source(heap.policy, tier, keep_copy) as source:
            assert source is heap and not heap.stale
            walked = heap.policy.groups(cache.tree, tier, keep_copy)
            assert live_groups(heap) == sorted((g.rank, g.key, tuple(g.offsets)) for g in walked)


def test_a_chain_above_an_evicted_branch_is_looked_at_again():
    """A branch point's child is evicted: the nodes whose single-child chain reaches that
    branch point (untouched by the eviction) are further from an anchor now, and their
    SWA pages near it become far."""
    lay = LAYOUTS["mixed-wide"]  # a page a token, a window of 6 pages
    cache = NodeCache(lay, {p: PoolCapacity(40, 0) for p in lay.pools}, device="cpu")
    s1, s2 = [1, 2, 3, 4, 5, 10, 11], [1, 2, 3, 4, 5, 20, 21]
    for s in (s2, s1):  # the second put stores the window before the branch at 5 too
        cache.put(s, prefix_kv(lay, s), "a")
    cache.get(s2, "a")  # splits at 1 (the window's start) and leaves s1's leaf the oldest
    top = cache.match(s1, "a").path[0]
    assert top.n == 1 and len(top.children) == 1 and top.count(Tier.DEVICE, PoolName.SWA) == 1
    swa = cache.policies[PoolName.SWA]
    (near,) = swa.groups(cache.tree, Tier.DEVICE, False)[:1]
    assert near.node is top and near.rank[0] is True  # 4 pages above the branch point
    candidates = cache.evictors[PoolName.SWA].candidates
    assert candidates is not None
    candidates.walk_share = float("inf")  # a tree this small would be walked again
    with candidates.source(swa, Tier.DEVICE, False):
        pass  # the SWA heap is built now, before the eviction
    assert cache.evict(PoolName.FULL, Tier.DEVICE, 1) == 2  # s1's leaf
    far = [g for g in swa.groups(cache.tree, Tier.DEVICE, False) if g.node is top]
    assert [g.rank[0] for g in far] == [False]  # 6 pages above a leaf now
    assert_heaps_agree(cache)
